"""Finding runs on disk without wandering off: ``fedlore report PATH`` looks at most three
folders deep below ``PATH`` (``<experiment>/<method>/seed-<s>/``) and follows no symbolic link
to a folder below it (``PATH`` itself may be one): a link back up (``/proc/self/root``, a
``runs/latest -> ..``) would take the search elsewhere, into folders it cannot read. A folder
that cannot be read is left out with a one-line note (:class:`UnreadableFolderWarning`, once
per report), never an exception."""

from __future__ import annotations

import re
import stat
from pathlib import Path

from fedlore import progress

SEED_DIR = re.compile(r"^seed-(-?\d+)$")


class UnreadableFolderWarning(UserWarning):
    """A folder below a reported path that cannot be read: left out of the report."""


def unreadable(path: Path, error: OSError) -> None:
    """Say once (per report: :func:`fedlore.progress.warn_once`) that ``path`` is left out
    because of ``error``."""
    why = error.strerror or type(error).__name__
    progress.warn_once(f"{path}: cannot be read ({why}); left out", UnreadableFolderWarning)


def subfolders(path: Path) -> list[Path]:
    """The folders in ``path``, sorted by name: no symbolic link to a folder, and none when
    ``path`` cannot be read (said by :func:`unreadable`) or is gone (said by nothing: a folder
    removed while a report walks its parent)."""
    try:
        entries = sorted(path.iterdir())
    except FileNotFoundError:  # gone since its parent was listed (a removed run, a thread's
        return []  # /proc/self/task/<tid>): nothing in it to leave out
    except OSError as e:
        unreadable(path, e)
        return []
    out = []
    for entry in entries:
        try:
            if not entry.is_symlink() and entry.is_dir():
                out.append(entry)
        except OSError as e:  # a folder whose kind cannot be told
            unreadable(entry, e)
    return out


def regular_file(path: Path) -> bool:
    """Whether ``path`` is a regular file itself: not a symbolic link (to ``/proc/self/mem``,
    to a file elsewhere) nor a special file (a FIFO, a device), which the report never reads
    (reading one may fail, block or never end); False when it is missing or cannot be told."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def special_file(path: Path) -> bool:
    """Whether something is at ``path`` that :func:`regular_file` refuses (a symbolic link,
    even a broken one, or a special file)."""
    try:
        path.lstat()
    except OSError:
        return False
    return not regular_file(path)


def linked_folders(path: Path) -> list[Path]:
    """The symbolic links to folders in ``path`` (which :func:`subfolders` does not follow)."""
    try:
        entries = sorted(path.iterdir())
    except OSError:
        return []
    out = []
    for entry in entries:
        try:
            if entry.is_symlink() and entry.is_dir():
                out.append(entry)
        except OSError:
            continue
    return out


def is_experiment_dir(path: Path) -> bool:
    """Whether ``path`` holds ``<method>/seed-<s>/`` run directories (folders in folders: no
    symbolic link below ``path`` is followed)."""
    try:
        if not path.is_dir():
            return False
    except OSError as e:
        unreadable(path, e)
        return False
    return any(SEED_DIR.match(d.name) for m in subfolders(path) for d in subfolders(m))
