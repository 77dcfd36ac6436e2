"""A finished run is never replaced unasked: what a run may do with the folder it writes.

A run folder ``<output_dir>/<name>/<method>/seed-<s>`` whose ``summary.json`` exists holds a
finished run. Running into it again:

* with the config and the data it was made with (``config.json``: the settings that decide
  results, and the data fingerprint), nothing is trained: the run is said to be finished, with
  its folder, and its summary is returned (:func:`finished_run`);
* with another config, on other data, or when its ``config.json`` or ``summary.json`` cannot be
  read (so it cannot be told apart from another config's), the run is refused naming what
  differs, and ``--overwrite`` or another ``name=`` are the ways on
  (:func:`check_no_finished_run_of_another_config`);
* with ``--overwrite``, the new run trains in the sibling folder ``seed-<s>.overwrite``
  (:func:`write_dir`) and takes the finished run's place only once it has finished itself
  (:func:`swap_in`). Killed, failed or interrupted before, it leaves the finished run as it was;
  ``--resume`` continues the interrupted replacement and ``--overwrite`` starts it over
  (``--overwrite --resume`` continues an interrupted ``--overwrite`` of a whole experiment:
  :mod:`fedlore.engine.overwriting`).

Why a sibling folder and a swap rather than moving the finished run aside as a backup: the run
folder then holds the finished run at every moment until its replacement is complete, so no
report, plain rerun or ``--resume`` ever finds a half-trained replacement in its place, and
nothing has to know about a backup in order to restore it. The swap exchanges the two folders in
one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); on a system or file system that cannot,
it takes two renames through ``seed-<s>.replaced``. Right after the exchange the sibling folder
holds the replaced run, summary and all, like a finished replacement: a journal
(``seed-<s>.swap.json``, :data:`JOURNAL`) names the two folders for the duration of the swap,
and the next run of the folder completes a swap that a kill cut short
(:func:`complete_swap`): it swaps a finished replacement in, or deletes the replaced run left
beside the new one. ``fedlore report`` reads only ``seed-<s>`` folders.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlore.atomic import WriteError, write_json
from fedlore.config import ConfigError
from fedlore.engine.run_record import MakeAlgorithm, config_diff
from fedlore.engine.rundir import run_dir
from fedlore.engine.runstart import rows_problem
from fedlore.progress import tell, tell_once

if TYPE_CHECKING:
    from fedlore.config import Config
    from fedlore.data.federation import Federation

SUMMARY = "summary.json"
STAGING = ".overwrite"
"""Suffix of the sibling folder a replacement (``--overwrite``) trains in."""
REPLACED = ".replaced"
"""Suffix the finished run's folder takes for the instant between the two renames of a swap on a
file system that cannot exchange two folders."""

JOURNAL = ".swap.json"
"""Suffix of the file beside a run folder that names, for the instant of a swap, the folders of
the replacement and of the run it replaces (device and inode, which a rename keeps): right after
the exchange the sibling folder holds the replaced run, summary and all, and only the journal
tells it from a finished replacement still to be swapped in (:func:`pending_replacement`)."""

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging_dir(target: Path) -> Path:
    """``seed-<s>.overwrite`` beside the run folder ``target``."""
    return target.with_name(target.name + STAGING)


def read_record(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is missing, unreadable or not an object."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def finished_record(
    cfg: Config, method: str, out: Path, make_algorithm: MakeAlgorithm
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(summary, config.json)`` of the finished run of ``cfg`` in the folder ``out``; None when
    ``out`` holds no finished run (no ``summary.json``). ``make_algorithm`` builds the method as
    the config does (:data:`~fedlore.engine.run_record.MakeAlgorithm`), for the settings comparison.

    Raises:
        ConfigError: when the finished run is another config's (naming the keys that differ), or
            its ``summary.json`` or ``config.json`` cannot be read; the message gives the ways out
            (``--overwrite``, another ``name=``).
    """
    summary_path = out / SUMMARY
    if not summary_path.is_file():
        return None
    summary, recorded = read_record(summary_path), read_record(out / "config.json")
    bad = _unreadable(summary, recorded, method, out)
    if bad is not None:
        raise ConfigError(
            f"{out} holds a finished run whose {bad}, so it cannot be told apart from another "
            "config's run; it is left as it is. Pass --overwrite to replace it, or give this "
            "run another name=... to keep both"
        )
    assert summary is not None and recorded is not None  # _unreadable said so
    details = config_diff(cfg, method, recorded, make_algorithm)
    if details:
        raise ConfigError(
            f"{out} holds a finished run of another config ({details}); a fresh run would "
            "delete it. Pass --overwrite to replace it, or give this run another name=... to "
            "keep both (--resume applies only to the config the run was started with)"
        )
    return summary, recorded


SUMMARY_KEYS = ("method", "seed", "rounds", "final_loss", "bytes_up_total")
"""Keys every ``summary.json`` holds (:func:`fedlore.results.summary.summarize`)."""


def _unreadable(
    summary: dict[str, Any] | None, recorded: dict[str, Any] | None, method: str, out: Path
) -> str | None:
    """What makes the record of the finished run in ``out`` unusable (None: nothing): an
    unreadable ``config.json`` or ``summary.json``, a summary without the keys every summary
    holds or of another method (a file copied into the wrong folder, or emptied), or no
    ``metrics.jsonl`` (the rows every report and table reads), or one that lacks, repeats or
    garbles a row of the rounds the summary counts."""
    if summary is None:
        return f"{SUMMARY} is unreadable"
    if recorded is None:
        return "config.json is missing or unreadable"
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        return f"{SUMMARY} lacks {', '.join(missing)}"
    if summary["method"] != method:
        return f"{SUMMARY} is {summary['method']}'s, not {method}'s"
    named = re.fullmatch(rf"seed-(-?\d+)(?:{re.escape(STAGING)})?", out.name)
    if named is not None and summary["seed"] != int(named.group(1)):
        return f"{SUMMARY} is of seed {summary['seed']}, not of {out.name}"
    if not (out / "metrics.jsonl").is_file():
        return "metrics.jsonl is missing"
    rounds = summary["rounds"]
    if isinstance(rounds, int):
        rows = rows_problem(out / "metrics.jsonl", 0, rounds - 1, torn_ok=False)
        if rows is not None:
            return f"metrics.jsonl {rows} (its summary counts {rounds} rounds)"
    return None


def check_no_finished_run_of_another_config(
    cfg: Config, method: str, out: Path, make_algorithm: MakeAlgorithm
) -> None:
    """Refuse to start where a finished run of another config lies (:func:`finished_record`);
    a finished run of this config is fine (it is reported, not retrained)."""
    finished_record(cfg, method, out, make_algorithm)


def finished_run(
    cfg: Config, method: str, seed: int, fingerprint: str, make_algorithm: MakeAlgorithm
) -> dict[str, Any] | None:
    """The summary of the finished run of ``cfg``, ``method`` and ``seed`` on data with this
    ``fingerprint``, after saying that it is finished and where; None when its folder holds no
    finished run.

    Raises:
        ConfigError: as :func:`finished_record`, and when the run was made on other data (the
            files under ``data.root`` or the tokenizer changed since).
    """
    out = run_dir(cfg, method, seed)
    record = finished_record(cfg, method, out, make_algorithm)
    if record is None:
        return None
    summary, recorded = record
    before = recorded.get("data_fingerprint")
    if before is not None and before != fingerprint:
        raise ConfigError(
            f"{out} holds a finished run of this config made on other data (fingerprint "
            f"{before} -> {fingerprint}: files under data.root or the tokenizer changed since); "
            "a fresh run would delete it. Pass --overwrite to replace it, or give this run "
            "another name=... to keep both"
        )
    tell(
        "%s seed %d: finished already; results in %s (--overwrite trains it again)",
        method,
        seed,
        out,
    )
    if staging_dir(out).is_dir():
        tell(
            "%s seed %d: %s holds an interrupted --overwrite of it: --resume continues it (with "
            "its config), --overwrite starts it over",
            method,
            seed,
            staging_dir(out),
        )
    return summary


def finished_runs(
    cfg: Config, seed: int, fed: Federation, make_algorithm: MakeAlgorithm, resume: bool = False
) -> dict[str, dict[str, Any]]:
    """Method -> summary of each method of ``cfg`` whose run for ``seed`` on ``fed`` is finished
    (:func:`finished_run`, which says so, after the checks of a rerun). Under ``resume`` a
    method whose folder holds an interrupted replacement of this config (``--overwrite``, then
    killed) is left out: ``--resume`` continues the replacement."""
    methods = list(cfg.algorithms)
    for m in methods:  # a swap a kill cut short is completed first
        complete_swap(run_dir(cfg, m, seed))
    if resume:
        methods = [m for m in methods if not _continues_replacement(cfg, m, seed, make_algorithm)]
    if not any((run_dir(cfg, m, seed) / SUMMARY).is_file() for m in methods):
        return {}
    fingerprint = fed.fingerprint()
    done = {m: finished_run(cfg, m, seed, fingerprint, make_algorithm) for m in methods}
    return {m: s for m, s in done.items() if s is not None}


def _continues_replacement(cfg: Config, method: str, seed: int, make: MakeAlgorithm) -> bool:
    """Whether the run folder of ``method`` and ``seed`` holds an interrupted replacement
    (:func:`staging_dir`) started by this config, which ``--resume`` continues."""
    recorded = read_record(staging_dir(run_dir(cfg, method, seed)) / "config.json")
    return recorded is not None and not config_diff(cfg, method, recorded, make)


def write_dir(
    cfg: Config,
    method: str,
    target: Path,
    resume: bool,
    overwrite: bool,
    make_algorithm: MakeAlgorithm,
) -> Path:
    """The folder a run of ``target`` writes: ``target`` itself, or, while ``target`` holds a
    finished run, its sibling :func:`staging_dir` under ``--overwrite`` (without ``--resume``: a
    new replacement) or under ``--resume`` when the sibling holds an interrupted replacement of
    this config. A replacement that finished but whose swap a kill interrupted is swapped in
    first."""
    staged = staging_dir(target)
    complete_swap(target)
    if not (target / SUMMARY).is_file():
        return target
    if resume:
        recorded = read_record(staged / "config.json")
        if recorded is None or config_diff(cfg, method, recorded, make_algorithm):
            return target
        tell_once("continuing the replacement of the finished run in %s (in %s)", target, staged)
        return staged
    if not overwrite:
        return target
    tell_once(
        "replacing the finished run in %s: the new run trains in %s and takes its place when it "
        "has finished (until then the finished run stays as it is)",
        target,
        staged,
    )
    return staged


def _identity(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


def _journal(target: Path) -> Path:
    return target.with_name(target.name + JOURNAL)


def _exchanged(target: Path) -> bool:
    """Whether a swap into ``target`` was cut right after its exchange: the journal names
    ``target``'s folder as the replacement and the sibling folder as the run it replaced."""
    try:
        named = json.loads(_journal(target).read_text("utf-8"))
        return bool(
            named["replacement"] == _identity(target)
            and named["replaced"] == _identity(staging_dir(target))
        )
    except (OSError, ValueError, KeyError, TypeError):  # no journal (or not one)
        return False


def pending_replacement(target: Path) -> Path | None:
    """The sibling folder (:func:`staging_dir`) when it holds a finished replacement whose swap
    a kill cut short, which the next run of ``target`` swaps in first (:func:`complete_swap`);
    None otherwise, and when it holds the finished run that a swap cut after its exchange has
    already replaced (the new run is in ``target``)."""
    staged = staging_dir(target)
    if (staged / SUMMARY).is_file() and not _exchanged(target):
        return staged
    return None


def complete_swap(target: Path) -> bool:
    """Finish a swap into ``target`` that a kill cut short: swap a finished replacement in
    (:func:`pending_replacement`; True), or delete the replaced run a swap cut after its
    exchange left in the sibling folder; a journal left behind goes.

    Raises:
        WriteError: as :func:`swap_in`.
    """
    staged = staging_dir(target)
    if pending_replacement(target) is not None:
        swap_in(staged, target)
        return True
    replaced = target.with_name(target.name + REPLACED)
    try:
        if (staged / SUMMARY).is_file():  # the run replaced: out of the way, then deleted
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(staged, replaced)
            tell("deleted the run that a swap cut short had replaced, beside %s", target)
        _journal(target).unlink(missing_ok=True)
    except OSError as e:
        raise WriteError(target, e) from None
    shutil.rmtree(replaced, ignore_errors=True)
    return False


def swap_in(staged: Path, target: Path) -> None:
    """Put the finished run in ``staged`` in the place of ``target`` and delete the run it
    replaces (nothing when ``staged`` is ``target``). A journal beside ``target``
    (:data:`JOURNAL`) names the two folders until the replaced one is out of the way, so that a
    kill at any point leaves the new run in place or still to be swapped in
    (:func:`complete_swap`), never the replaced run.

    Raises:
        WriteError: when a rename fails (e.g. no permission on the folder).
    """
    if staged == target:
        return
    replaced = target.with_name(target.name + REPLACED)
    try:
        if target.exists():
            journal = {"replacement": _identity(staged), "replaced": _identity(target)}
            write_json(_journal(target), journal)
        if target.exists() and _exchange(staged, target):
            # ``staged`` now holds the run replaced, summary and all: renamed out of the way
            # at once, so that a kill or a failed removal never leaves it looking like a
            # finished replacement (the next run would swap it back in)
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(staged, replaced)
        else:
            shutil.rmtree(replaced, ignore_errors=True)
            if target.exists():
                os.rename(target, replaced)
            os.rename(staged, target)
        _journal(target).unlink(missing_ok=True)
    except OSError as e:
        raise WriteError(target, e) from None
    shutil.rmtree(replaced, ignore_errors=True)  # also what a swap cut in two left there
    tell("the new run took the place of the finished one in %s", target)


def _exchange(a: Path, b: Path) -> bool:
    """Exchange two paths in one atomic step (Linux ``renameat2(..., RENAME_EXCHANGE)``); False
    where the C library or the file system cannot.

    Raises:
        OSError: for any other failure of the call.
    """
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def stamp(path: Path) -> tuple[int, int] | None:
    """``(inode, mtime in ns)`` of a file, None when it is absent: a file written or swapped in
    since has another."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns
