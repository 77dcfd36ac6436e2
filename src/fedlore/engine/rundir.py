"""Run folders: where a run writes, what it records there, and when it may continue.

A run of (config, method, seed) lives in ``<output_dir>/<name>/<method>/seed-<seed>``
(:func:`run_dir`): ``config.json`` records the settings that decide its results
(:mod:`fedlore.engine.run_record`, which also says when a config may continue it); ``--resume``
continues it from its checkpoint (:func:`fedlore.engine.runstart.resume_point`), and a fresh
run clears what an earlier one left (:func:`fedlore.engine.runstart.start_fresh`). Client
states spill to :func:`spill_dir`. What a run may do with a folder that holds a *finished* run
is :mod:`fedlore.engine.rerun`'s.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path

from fedlore.config import Config, ConfigError


def run_dir(cfg: Config, method: str, seed: int) -> Path:
    """``<output_dir>/<name>/<method>/seed-<seed>``."""
    return Path(cfg.output_dir) / cfg.name / method / f"seed-{seed}"


def spill_dir(cfg: Config, method: str, seed: int, out: Path | None = None) -> Path:
    """Where a run's client states spill: ``client_states/`` in its run directory (``out``, by
    default :func:`run_dir`), or below ``store.spill_dir`` in a folder unique to the run
    directory (two runs never share one)."""
    out = run_dir(cfg, method, seed) if out is None else out
    if not cfg.store.spill_dir:
        return out / "client_states"
    tag = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:10]
    return Path(cfg.store.spill_dir) / f"{cfg.name}-{method}-seed{seed}-{tag}"


def recorded_threads(out: Path) -> int | None:
    """The thread count a run in ``out`` started with (``ran_threads`` of its ``config.json``),
    None when there is none or it cannot be read."""
    try:
        n = json.loads((out / "config.json").read_text()).get("ran_threads")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def check_output_dir(cfg: Config) -> None:
    """``<output_dir>/<name>`` can be a folder this process creates and writes: no part of the
    path is a file, and the deepest part that exists is a folder that can hold files (a
    temporary file is created in it and removed at once: :func:`_probe`; nothing else is
    created). So can ``store.spill_dir`` when client states may spill there
    (``store.max_memory_mb`` set), checked before any run trains instead of when a run builds
    its store.

    Raises:
        ConfigError: naming ``output_dir`` (or ``name``, ``store.spill_dir``) and the part of
            the path in the way.
    """
    target = Path(cfg.output_dir) / cfg.name
    where = f"output_dir={cfg.output_dir!r}, name={cfg.name!r}"
    _check_folder(target, "output_dir", where, "name")
    if cfg.store.spill_dir and cfg.store.max_memory_mb is not None:
        spill = Path(cfg.store.spill_dir)
        _check_folder(spill, "store.spill_dir", f"store.spill_dir={cfg.store.spill_dir!r}")


def _check_folder(target: Path, key: str, where: str, own_key: str | None = None) -> None:
    """``target`` can be created and written (see :func:`check_output_dir`); ``own_key`` names
    the setting when ``target`` itself is the file in the way."""
    for part in [target, *target.parents]:
        if not part.exists():
            continue
        if not part.is_dir():
            named = own_key if part == target and own_key else key
            raise ConfigError(
                f"{named}: {part} is a file, not a folder ({where}); choose another {key}"
                + (f" or {own_key}" if own_key else "")
            )
        problem = _probe(part)
        if problem is not None:
            raise ConfigError(
                f"{key}: cannot create or write {target} ({part} cannot hold files: {problem}; "
                f"{where}); choose another {key}"
            )
        break


def _probe(folder: Path) -> str | None:
    """Why ``folder`` cannot hold files, or None when it can: a temporary file is created in it
    (atomically, under a name no other file has) and removed. ``os.access`` is no answer: as
    root it says yes to every folder, ``/proc`` and read-only mounts included, and the run would
    fail later, when it writes there."""
    try:
        fd, name = tempfile.mkstemp(prefix=".fedlore-probe-", dir=folder)
    except OSError as e:
        if e.errno == errno.ENOENT:  # the folder is there: its file system makes no files
            return "its file system creates no files there"
        return e.strerror or type(e).__name__
    os.close(fd)
    os.unlink(name)
    return None


def check_run_folder(cfg: Config, method: str, seed: int) -> None:
    """The run folder of ``method`` and ``seed`` (:func:`run_dir`) can be a folder: neither it
    nor its method's folder is a file (nothing is created).

    Raises:
        ConfigError: naming the file in the way.
    """
    target = run_dir(cfg, method, seed)
    for part in (target.parent, target):
        if part.exists() and not part.is_dir():
            raise ConfigError(
                f"{part} is a file, not a folder: the run of {method} seed {seed} cannot be made "
                "there; move the file away, or give this run another name=..."
            )


def make_output_dir(cfg: Config) -> None:
    """Create ``<output_dir>/<name>``.

    Raises:
        ConfigError: naming ``output_dir`` when the folder cannot be created.
    """
    target = Path(cfg.output_dir) / cfg.name
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"output_dir={cfg.output_dir!r}: cannot create {target} ({e.strerror or e}); "
            "choose another output_dir"
        ) from e


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """The folders of one run.

    Attributes:
        target: its run folder (:func:`run_dir`).
        out: the folder it writes: ``target``, or, while ``target`` holds a finished run that
            ``--overwrite`` replaces, the sibling the replacement trains in
            (:func:`fedlore.engine.rerun.write_dir`).
        spill: where its client states spill (:func:`spill_dir`).
        resume: whether it continues the run in ``out`` (``--resume``) instead of starting over.
        from_start: a resume that runs again from the first round without the checkpoint (an
            engine that cannot restore its clients' states, Flower's simulation): the run's
            record is kept, and its DP ledger counts the released rows it runs again.
    """

    target: Path
    out: Path
    spill: Path
    resume: bool
    from_start: bool = False
