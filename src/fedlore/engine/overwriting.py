"""Continuing an interrupted ``--overwrite``: ``fedlore run ... --overwrite --resume``.

``--overwrite`` replaces an experiment's finished runs one after another, each in its sibling
folder until it has finished (:mod:`fedlore.engine.rerun`). Interrupted, it leaves three kinds
of run: those it has replaced already, the one it was training, and those it had not reached.
Neither flag alone continues that: ``--resume`` keeps finished runs, so it cannot tell the runs
not reached yet from runs to keep (and refuses those of another config), and ``--overwrite``
trains the replaced ones again and the interrupted one from its first round.

So while an ``--overwrite`` runs, the experiment folder holds :data:`RECORD`, the runs it has
finished. ``--overwrite --resume`` (:func:`plan`) keeps those that are of this config and data,
continues an interrupted replacement of this config (or an unfinished run of it) from its
checkpoint, and replaces every other run, as ``--overwrite`` would. The record goes when the
experiment has finished; without one, the two flags together are refused
(:func:`check_run_flags`), since there is nothing to continue.

The record also names the runs the ``--overwrite`` was started on (its targets). Continuing it
with a command that names other runs too (a longer ``algorithms`` list, another seed: most often
an override left off the second command) is refused, since those runs were never meant to be
replaced and ``--overwrite --resume`` would replace them; a command that names only some of the
targets continues those, and the record stays until every target has finished.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlore.atomic import write_json
from fedlore.config import Config, ConfigError
from fedlore.engine.rerun import (
    SUMMARY,
    finished_run,
    finished_runs,
    read_record,
    staging_dir,
    swap_in,
)
from fedlore.engine.rundir import MakeAlgorithm, config_diff, run_dir

if TYPE_CHECKING:
    from fedlore.data.federation import Federation

RECORD = "overwriting.json"
"""In the experiment folder while an ``--overwrite`` runs: ``{"finished": [<method>/seed-<s>,
...], "targets": [...]}``, the runs it has finished so far and those it was started on (a record
written before targets were kept has none, and then every run counts as one)."""

Flags = tuple[bool, bool]
"""``(resume, overwrite)`` for one run."""


def _record(cfg: Config) -> Path:
    return Path(cfg.output_dir) / cfg.name / RECORD


def _name(cfg: Config, method: str, seed: int) -> str:
    return run_dir(cfg, method, seed).relative_to(Path(cfg.output_dir) / cfg.name).as_posix()


def _names(cfg: Config) -> list[str]:
    """The runs of the command, in the order it runs them."""
    return [_name(cfg, m, s) for s in cfg.seeds for m in cfg.algorithms]


def _listed(cfg: Config, key: str) -> list[str] | None:
    """The record's list under ``key`` (None: no record, or none under that key)."""
    raw = read_record(_record(cfg))
    names = raw.get(key) if raw is not None else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else None


def check_run_flags(cfg: Config, resume: bool, overwrite: bool) -> None:
    """Refuse ``resume`` with ``overwrite`` unless an interrupted ``--overwrite`` of this
    experiment is there to continue, and unless every run of the command is one it was started
    on (see the module docstring).

    Raises:
        ConfigError: saying what each flag does, or which runs the command adds.
    """
    if not (resume and overwrite):
        return
    if not _record(cfg).is_file():
        raise ConfigError(
            f"--resume with --overwrite continues an interrupted --overwrite, and "
            f"{_record(cfg).parent} holds none: --resume continues interrupted runs and keeps "
            "finished ones; --overwrite trains finished runs again. Give one of them"
        )
    targets = _listed(cfg, "targets")
    added = [n for n in _names(cfg) if targets is not None and n not in targets]
    if targets is not None and added:
        methods = list(dict.fromkeys(n.split("/")[0] for n in targets))
        seeds = list(dict.fromkeys(n.rsplit("seed-", 1)[-1] for n in targets))
        raise ConfigError(
            f"--resume with --overwrite continues the interrupted --overwrite of "
            f"{_record(cfg).parent}, which was started on {', '.join(targets)}; this command "
            f"also names {', '.join(added)}, which it was never meant to replace. Continue it "
            f"with algorithms=[{','.join(methods)}] seeds=[{','.join(seeds)}], then run the "
            "others as you mean to (--resume keeps their finished runs, --overwrite replaces "
            "them)"
        )


def begin(cfg: Config, resume: bool, overwrite: bool) -> None:
    """A new ``--overwrite`` (not continued) starts its record: no run finished, the command's
    runs as its targets."""
    if overwrite and not resume:
        write_json(_record(cfg), {"finished": [], "targets": _names(cfg)})


def _finished(cfg: Config) -> list[str]:
    return _listed(cfg, "finished") or []


def record_finished(cfg: Config, method: str, seed: int, overwrite: bool) -> None:
    """Add a run an ``--overwrite`` has finished to its record (atomically), keeping its
    targets."""
    if overwrite:
        record = {"finished": [*_finished(cfg), _name(cfg, method, seed)]}
        targets = _listed(cfg, "targets")
        write_json(_record(cfg), record if targets is None else {**record, "targets": targets})


def end(cfg: Config, resume: bool, overwrite: bool) -> None:
    """Every run of the command has finished: an ``--overwrite``'s record goes, unless it names
    targets outside this command that have not finished (a continuation of only some of them).
    So it does after a plain ``--resume`` that finished an interrupted ``--overwrite`` (it
    refuses the runs of another config, so once it has finished every run is of this one):
    left there, the record would let a later ``--overwrite --resume`` train again the runs it
    names as not yet replaced."""
    if not (overwrite or resume):
        return
    done = {*_finished(cfg), *_names(cfg)}
    if not [n for n in _listed(cfg, "targets") or [] if n not in done]:
        _record(cfg).unlink(missing_ok=True)


def _same(cfg: Config, method: str, folder: Path, make: MakeAlgorithm, fingerprint: str) -> bool:
    """Whether ``folder`` holds a run (started) with this config on this data."""
    recorded = read_record(folder / "config.json")
    return (
        recorded is not None
        and not config_diff(cfg, method, recorded, make)
        and recorded.get("data_fingerprint") in (None, fingerprint)
    )


def plan(
    cfg: Config, seed: int, fed: Federation, resume: bool, overwrite: bool, make: MakeAlgorithm
) -> tuple[dict[str, dict[str, Any]], dict[str, Flags]]:
    """The runs of ``seed`` to keep (method -> summary; each said to be finished) and the
    ``(resume, overwrite)`` each other method runs with: the flags as given, except under both
    (continuing an interrupted ``--overwrite``, see the module docstring)."""
    if not overwrite:
        done = finished_runs(cfg, seed, fed, make, resume)
        return done, {m: (resume, False) for m in cfg.algorithms if m not in done}
    if not resume:
        return {}, {m: (False, True) for m in cfg.algorithms}
    replaced = set(_finished(cfg))
    fingerprint = fed.fingerprint()
    kept: dict[str, dict[str, Any]] = {}
    flags: dict[str, Flags] = {}
    for m in cfg.algorithms:
        target = run_dir(cfg, m, seed)
        staged = staging_dir(target)
        if (staged / SUMMARY).is_file():  # a replacement whose swap a kill cut in two
            swap_in(staged, target)
            replaced.add(_name(cfg, m, seed))
        if not (target / SUMMARY).is_file():  # unfinished: continued if it is this config's
            other = not _same(cfg, m, target, make, fingerprint)
            fresh = (target / "config.json").exists() and other
            flags[m] = (not fresh, fresh)
        elif _name(cfg, m, seed) in replaced and _same(cfg, m, target, make, fingerprint):
            summary = finished_run(cfg, m, seed, fingerprint, make)
            assert summary is not None  # a readable summary of this config and data
            kept[m] = summary
        elif _same(cfg, m, staged, make, fingerprint):  # the interrupted replacement
            flags[m] = (True, False)
        else:  # not reached yet: replaced
            flags[m] = (False, True)
    return kept, flags
