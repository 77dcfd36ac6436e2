"""Reading and writing checkpoint files: atomic ``torch.save``, a safe ``torch.load`` (tensors and
plain values only) and a few words on why a file could not be read.

Shared by :mod:`fedlore.engine.callbacks` (the run's checkpoint) and :mod:`fedlore.engine.store`
(the spilled client states a checkpoint names), so that neither imports the other.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from fedlore.atomic import save_tensors
from fedlore.config import ConfigError


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``<path>.tmp``, fsync, then ``os.replace``: a kill at any moment leaves
    either the old or the new checkpoint, never a torn one, and a failed write removes the
    temporary file and raises :class:`fedlore.atomic.WriteError` (see
    :func:`fedlore.atomic.save_tensors`)."""
    save_tensors(obj, path)


class DamagedCheckpoint(ConfigError):
    """A checkpoint (or a spilled client state it names) that cannot be read."""


def damage_reason(e: BaseException, path: Path | None = None) -> str:
    """Why ``torch.load`` could not read a file, in a few words: an empty file, a file that is not
    the zip archive ``torch.save`` writes (truncated, overwritten, another kind of file), a
    checkpoint of something else, or torch's own message (its first line), never its advice to
    retry with ``weights_only=False``, which a damaged or foreign file must not get (it would run
    arbitrary code)."""
    if path is not None and path.is_file():
        if path.stat().st_size == 0:
            return "the file is empty"
        if not zipfile.is_zipfile(path):
            return (
                "not a PyTorch checkpoint: torch.save writes a zip archive and this file is not "
                "one (truncated, overwritten, or another kind of file)"
            )
    if isinstance(e, KeyError):
        return f"no {e.args[0]!r} entry: not a fedlore checkpoint"
    if isinstance(e, TypeError | AttributeError):
        return "its contents are not laid out as a fedlore checkpoint"
    text = str(e).splitlines()[0] if str(e) else repr(e)
    if "weights_only" in text:
        return "it holds objects other than tensors and plain values: not a fedlore checkpoint"
    return f"{type(e).__name__}: {text}"


def load_tensors(path: Path, map_location: torch.device | str) -> Any:
    """``torch.load(path, weights_only=True)`` without torch's warnings about the file's pickle
    protocol (a foreign file is reported by :func:`damage_reason`, not by a warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.load(path, weights_only=True, map_location=map_location)
