"""Writing files so that each holds its old content or its new one, never a torn mix, and so that
a failed write is one line naming the file.

Every file fedlore writes (checkpoints, spilled client states, ``config.json``, ``summary.json``,
reports, plots, converted corpora) goes through here. :func:`replacing` writes ``<name>.tmp`` in
the file's own folder, flushes it to disk (``fsync``) and renames it over ``<name>``
(``os.replace``, atomic on a POSIX file system), so a kill, a full disk or a lost permission at any
moment leaves the old file as it was. ``metrics.jsonl`` grows by whole lines instead
(:func:`append_text`): an append that fails is cut back to the line before. A ``<name>.tmp``
that a kill left is never read as ``<name>``; the next run of its folder deletes it
(:func:`remove_temps`), and a later report of an experiment folder deletes what a killed
report or plot write left there, once untouched for ten minutes
(:func:`remove_dead_shared_temps`).

Any ``OSError`` on the way (no space left, a quota, no permission, a read-only file system) removes
the temporary file and is raised as :class:`WriteError`; ``torch.save``, which reports a failed
write as a ``RuntimeError`` around the ``OSError``, is unwrapped to it. :func:`explain` turns one
into the command line's single line: the file, the error, its errno and what to do next.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

TMP_SUFFIX = ".tmp"
"""``checkpoint.pt`` is written as ``checkpoint.pt.tmp`` and renamed when complete."""

ADVICE = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space or raise the disk quota",
    errno.EACCES: "make the folder writable",
    errno.EPERM: "make the folder writable",
    errno.EROFS: "make the file system writable",
}
"""errno -> what clears the way, as said after a failed write."""


class WriteError(OSError):
    """A file that could not be written; ``str()`` is one line, ``cannot write <file>: <error>
    (errno <n>)``. ``errno``, ``strerror`` and ``filename`` are the failed call's."""

    def __init__(self, path: Path | str, error: OSError) -> None:
        super().__init__(error.errno, error.strerror or str(error), str(path))

    def __str__(self) -> str:
        code = "" if self.errno is None else f" (errno {self.errno})"
        return f"cannot write {self.filename}: {self.strerror}{code}"


def temp_path(path: Path, shared: bool = False) -> Path:
    """``<path>.tmp``: where :func:`replacing` writes before the rename; for a ``shared`` file
    (one that several processes may write at once: an experiment's report and plots, written
    by each run of the experiment that finishes) ``<path>.<pid>.<thread>.tmp``, so that one
    writer's rename never takes another's temporary file from under it."""
    if shared:
        return path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
    return path.with_name(path.name + TMP_SUFFIX)


def remove_temps(folder: Path, names: Iterable[str]) -> list[str]:
    """Delete the temporary file (:func:`temp_path`, ``<name>.tmp``) of each of ``names`` in
    ``folder`` that a write cut short by a kill left behind, and return the names of those
    deleted. Nothing else goes: not a file of another name, nor a ``shared`` write's. Call it
    only while no other process can be writing them (a run holds its folder's lock)."""
    removed = []
    for name in names:
        tmp = temp_path(Path(folder) / name)
        with contextlib.suppress(FileNotFoundError):
            if tmp.is_file() and not tmp.is_symlink():
                tmp.unlink()
                removed.append(tmp.name)
    return removed


_SHARED_TEMP = re.compile(r"^(?P<name>.+)\.(?P<pid>\d+)\.\d+" + re.escape(TMP_SUFFIX) + "$")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True


SHARED_TEMP_GRACE_S = 600.0
"""How long a ``shared`` write's temporary file stays untouched before
:func:`remove_dead_shared_temps` may take it: a report or plot is written in seconds."""


def remove_dead_shared_temps(folder: Path, owns: Callable[[str], bool]) -> list[str]:
    """Delete the temporary files of ``shared`` writes (:func:`temp_path`,
    ``<name>.<pid>.<thread>.tmp``) in ``folder`` whose ``<name>`` ``owns`` accepts, whose
    writer is dead (a report or plot write cut by a kill) and that nothing wrote for
    :data:`SHARED_TEMP_GRACE_S`, and return their names. A live writer's file stays (its
    rename is still to come), and so does any file of another name. This knows the processes
    of this machine only (as :mod:`fedlore.engine.lock`): the grace keeps the file another
    machine or PID namespace is writing into a shared folder (its PID is no process here)."""
    removed = []
    with contextlib.suppress(OSError):
        for tmp in sorted(Path(folder).iterdir()):
            match = _SHARED_TEMP.match(tmp.name)
            if not match or not owns(match["name"]) or _alive(int(match["pid"])):
                continue
            with contextlib.suppress(FileNotFoundError):
                if time.time() - tmp.lstat().st_mtime < SHARED_TEMP_GRACE_S:
                    continue  # being written, perhaps by another machine's process
                if tmp.is_file() and not tmp.is_symlink():
                    tmp.unlink()
                    removed.append(tmp.name)
    return removed


def _os_error(e: BaseException) -> OSError | None:
    """``e`` if it is an OSError, else the OSError it was raised while handling (torch.save turns a
    failed write into ``RuntimeError: [enforce fail at inline_container.cc]``), else None (also
    for an interrupt: Ctrl-C is never reported as a failed write)."""
    if not isinstance(e, Exception):
        return None
    seen = 0
    cause: BaseException | None = e
    while cause is not None and seen < 4:
        if isinstance(cause, OSError):
            return cause
        cause = cause.__cause__ or cause.__context__
        seen += 1
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_temp(tmp: Path, mode: str, compress: bool, **kwargs: Any) -> IO[Any]:
    """The temporary file, open for writing (gzip-compressed with ``compress``)."""
    if compress:
        return gzip.open(tmp, mode, **kwargs)  # type: ignore[return-value]
    return open(tmp, mode, **kwargs)


@contextlib.contextmanager
def replacing(
    path: Path | str,
    mode: str = "wb",
    *,
    compress: bool = False,
    fsync: bool = True,
    shared: bool = False,
    **kwargs: Any,
) -> Iterator[IO[Any]]:
    """``with replacing(path) as f: ...`` writes ``f`` to ``<path>.tmp``; when the block ends
    without an error the file is closed, fsynced and renamed over ``path`` (then the folder is
    fsynced). On any error the temporary file is removed and ``path`` is left as it was.

    Args:
        mode: a write mode of :func:`open` (``"wb"``, ``"w"``, ``"wt"``); ``kwargs`` go to it
            (``encoding``, ``newline``).
        compress: write gzip (``gzip.open``).
        fsync: False leaves flushing the file to disk to the caller (a spilled client state is
            fsynced with the others before the checkpoint that names it is committed).
        shared: several processes may write ``path`` at once (:func:`temp_path`); the last
            rename wins, whole.

    Raises:
        WriteError: for an OSError (also one torch.save wrapped in a RuntimeError); any other
            error as raised.
    """
    path = Path(path)
    tmp = temp_path(path, shared)
    try:
        with _open_temp(tmp, mode, compress, **kwargs) as f:
            yield f
        if fsync:
            _fsync(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        error = _os_error(e)
        if error is None or isinstance(e, WriteError):
            raise
        raise WriteError(path, error) from None
    if fsync:
        with contextlib.suppress(OSError):  # the rename itself survives a power loss
            _fsync(path.parent)


def write_bytes(path: Path | str, data: bytes, shared: bool = False) -> None:
    """Replace ``path`` by ``data`` (:func:`replacing`)."""
    with replacing(path, shared=shared) as f:
        f.write(data)


def write_text(path: Path | str, text: str, shared: bool = False) -> None:
    """Replace ``path`` by ``text`` in UTF-8 (:func:`replacing`)."""
    write_bytes(path, text.encode("utf-8"), shared)


def write_json(path: Path | str, obj: Any) -> None:
    """Replace ``path`` by ``obj`` as indented JSON (:func:`replacing`)."""
    write_text(path, json.dumps(obj, indent=2))


def save_tensors(obj: Any, path: Path | str, fsync: bool = True) -> None:
    """``torch.save(obj)`` replacing ``path`` (:func:`replacing`)."""
    import torch

    with replacing(path, fsync=fsync) as f:
        torch.save(obj, f)


def save_figure(fig: Any, path: Path | str, shared: bool = False, **kwargs: Any) -> None:
    """``fig.savefig`` replacing ``path``, in the format its suffix names (:func:`replacing`)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    with replacing(path, shared=shared) as f:
        fig.savefig(f, format=fmt, **kwargs)


def append_text(path: Path | str, text: str, sync: bool = False) -> None:
    """Append ``text`` (whole lines) to ``path``, creating it. A failed append is cut back to the
    file's length before it, so the file never ends in a torn line. ``sync``: on disk before
    returning (``fsync``), so a file written after it cannot outlive it in a power loss.

    Raises:
        WriteError: for an OSError.
    """
    path = Path(path)
    data = memoryview(text.encode("utf-8"))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise WriteError(path, e) from None
    try:
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data) :]
            if sync:
                os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise WriteError(path, e) from None
    finally:
        os.close(fd)


def explain(e: WriteError) -> str:
    """The command line's one line for a failed write: :class:`WriteError`'s text, then what to
    do. Inside a run folder: the last checkpoint there is intact, rerun with ``--resume`` (or,
    before the first checkpoint, the run starts from its first round); for a report file: run
    ``fedlore report`` on its folder; else: run again."""
    advice = ADVICE.get(e.errno or 0, "fix the cause")
    path = Path(e.filename)
    for folder in list(path.parents)[:2]:  # a run folder, or its client_states/
        ckpt = folder / "checkpoint.pt"
        if ckpt.is_file():
            which = "the previous checkpoint" if ckpt == path else f"the last checkpoint ({ckpt})"
            return f"{e}; {which} is intact: {advice} and rerun with --resume"
        if (folder / "config.json").is_file():
            return f"{e}; no checkpoint was written yet: {advice} and run the command again"
    if path.name.startswith("report.") or path.suffix == ".png":
        return (
            f"{e}; the runs themselves are untouched: {advice} and run "
            f"`fedlore report {path.parent}` again"
        )
    return f"{e}; {advice} and run again"
