"""An exclusive lock on a run folder, held for the run's life.

Two ``fedlore run`` processes writing one run folder would interleave its ``metrics.jsonl`` and
overwrite each other's checkpoint and ``config.json``. :class:`RunLock` takes an OS lock
(``fcntl.flock``) on ``<run folder>/run.lock`` before a run touches the folder and keeps it until
the run ends: a second run of the same folder is refused with the holder's PID. The kernel
releases the lock when its process exits, however it exits (normally, by an exception, killed),
so a lock file left behind by a dead process is stale and the next run takes it over; only a
live process holds the folder. (``flock`` locks are per machine: two machines writing one folder
on a network file system are not detected.)

A run that ends (finished, failed with an error, or stopped by Ctrl-C) removes its lock file, so
a finished run folder holds only its results (and a folder the lock created, in which nothing
was written, goes too: a run refused before it started leaves no empty folder). The file is
removed while still locked, and a process that locks a file only keeps it when the file is
still the one at ``run.lock`` (else it opens the path again): one that opened the file before
its removal and locked it after cannot hold the folder beside one that created a new
``run.lock``. Only a killed process (``SIGKILL``, a power loss) leaves a stale lock file behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from fedlore.atomic import WriteError
from fedlore.config import ConfigError

LOCK_FILE = "run.lock"

_HELD: dict[Path, int] = {}
"""Locks this process holds (resolved lock-file path -> nesting depth): a run takes the lock of
its folder again inside an experiment that already holds it (``run_experiment`` locks every
folder it will write before it starts)."""


class RunLocked(ConfigError):
    """The run folder is held by another live fedlore process."""


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` names the file open as ``fd`` (False when it names none)."""
    try:
        st = path.stat()
    except OSError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


class RunLock:
    """``with RunLock(folder): ...`` holds ``folder/run.lock`` exclusively for the block (the
    folder is created if needed) and removes it when the block ends, however it ends.

    Args:
        folder: the run folder.
        moves_to: the folder ``folder`` may be renamed to while it is held (a replacement,
            ``seed-<s>.overwrite``, swapped into its run folder): its lock file is removed
            there then.

    Raises:
        RunLocked: on entry, when another live process holds it; the message names its PID,
            host and start time (read from the lock file).
    """

    def __init__(self, folder: Path, moves_to: Path | None = None) -> None:
        self.path = Path(folder) / LOCK_FILE
        self._moved = None if moves_to is None else Path(moves_to) / LOCK_FILE
        self._fd: int | None = None
        self._nested = False
        self._created: list[Path] = []

    def __enter__(self) -> RunLock:
        # the folders this lock makes (the run folder, its method folder, ...), deepest first:
        # removed again if left empty
        folder = self.path.parent
        self._created = []
        while not folder.is_dir() and folder != folder.parent:
            self._created.append(folder)
            folder = folder.parent
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = self.path.resolve()
        if key in _HELD:  # this process holds it already: re-entered, released by the outer
            _HELD[key] += 1
            self._nested = True
            return self
        fd = self._take()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"PID {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode())
        except OSError as e:  # a full disk: one line naming the file, not a bare strerror
            self._release(fd)
            raise WriteError(self.path, e) from e
        self._fd = fd
        _HELD[key] = 1
        return self

    def _take(self) -> int:
        """The lock file open and locked; opened again when the file locked is no longer the
        one at its path (its holder removed it on release: :meth:`__exit__`).

        Raises:
            RunLocked: when another live process holds it.
        """
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # the folder, left empty, removed by its last holder
                self.path.parent.mkdir(parents=True, exist_ok=True)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 512).decode(errors="replace").strip() or "an unknown process"
                os.close(fd)
                raise _in_use(self.path.parent, holder) from None
            if _same_file(fd, self.path):
                return fd
            os.close(fd)  # a released file, removed: not the folder's lock any more

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._nested:
            _HELD[self.path.resolve()] -= 1
            self._nested = False
            return
        if self._fd is None:
            return
        _HELD.pop(self.path.resolve(), None)
        fd, self._fd = self._fd, None
        self._release(fd)

    def _release(self, fd: int) -> None:
        """Remove the lock file while it is still locked (where the folder went, with
        ``moves_to``), unlock and close it; then remove the folder, if this lock created it and
        nothing was written there, and so on up the folders it created (the method folder of
        a run that never started)."""
        try:
            with contextlib.suppress(OSError):  # a read-only folder: the file stays, unlocked
                os.ftruncate(fd, 0)  # no stale holder text for the next reader
                for path in (self.path, self._moved):  # removed while held (the module doc)
                    if path is not None and _same_file(fd, path):
                        path.unlink()
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        for folder in self._created:  # deepest first; the first one not empty stops it
            try:
                folder.rmdir()
            except FileNotFoundError:  # removed already (by another run's lock): go on up
                continue
            except OSError:  # not empty (a run's files, another run's folder): kept
                break


def _in_use(folder: Path, holder: str) -> RunLocked:
    return RunLocked(
        f"{folder} is in use by another fedlore run ({holder}); wait for it to finish, stop it, "
        "or give this run another name=..."
    )


def check_not_held(folder: Path) -> None:
    """Refuse as :class:`RunLock` would, without taking the lock (``fedlore run --dry-run``):
    whether a process holds ``folder/run.lock`` is read from Linux's ``/proc/locks``; elsewhere,
    or when it cannot be read, nothing is said.

    Raises:
        RunLocked: when another process holds it.
    """
    path = Path(folder) / LOCK_FILE
    try:
        st = path.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    held = any("FLOCK" in fields and key in fields for fields in map(str.split, table.splitlines()))
    if held and path.resolve() not in _HELD:
        holder = path.read_text(errors="replace").strip() or "an unknown process"
        raise _in_use(path.parent, holder)
