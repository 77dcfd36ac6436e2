"""An exclusive lock on a run folder, held for the run's life.

Two ``fedlore run`` processes writing one run folder would interleave its ``metrics.jsonl`` and
overwrite each other's checkpoint and ``config.json``. :class:`RunLock` takes an OS lock
(``fcntl.flock``) on ``<run folder>/run.lock`` before a run touches the folder and keeps it until
the run ends: a second run of the same folder is refused with the holder's PID. The kernel
releases the lock when its process exits, however it exits (normally, by an exception, killed),
so a lock file left behind by a dead process is stale and the next run takes it over; only a
live process holds the folder. (``flock`` locks are per machine: two machines writing one folder
on a network file system are not detected.)
"""

from __future__ import annotations

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


class RunLock:
    """``with RunLock(folder): ...`` holds ``folder/run.lock`` exclusively for the block (the
    folder is created if needed).

    Raises:
        RunLocked: on entry, when another live process holds it; the message names its PID,
            host and start time (read from the lock file).
    """

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self._fd: int | None = None
        self._nested = False

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = self.path.resolve()
        if key in _HELD:  # this process holds it already: re-entered, released by the outer
            _HELD[key] += 1
            self._nested = True
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise _in_use(self.path.parent, holder) from None
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"PID {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode())
        except OSError as e:  # a full disk: one line naming the file, not a bare strerror
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise WriteError(self.path, e) from e
        self._fd = fd
        _HELD[key] = 1
        return self

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
        try:
            os.ftruncate(self._fd, 0)  # no stale holder text for the next reader
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None


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
