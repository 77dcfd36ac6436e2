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

Last, the record names the runs the ``--overwrite`` has started training (``started``). The
one among them it has not finished is the one it was training when it stopped, and the
continuation refuses to carry it on under a changed setting or on changed data, as a plain
``--resume`` refuses an interrupted run (:func:`check_continued`): one line naming what
differs, and the ways on (restore the config, or delete the interrupted folder to train that run
afresh with this config). Starting it over silently would throw away its rounds for a setting
typed differently by mistake. The runs the ``--overwrite`` had not reached are replaced, as
before, whatever the config of an unfinished run their folder holds. A record written before
``started`` was kept has none, and its continuation starts such a run over, as it used to.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlore.atomic import write_json
from fedlore.config import Config, ConfigError
from fedlore.engine.rerun import (
    SUMMARY,
    complete_swap,
    finished_run,
    finished_runs,
    pending_replacement,
    read_record,
    staging_dir,
    swap_in,
)
from fedlore.engine.run_record import MakeAlgorithm, config_diff
from fedlore.engine.rundir import run_dir

if TYPE_CHECKING:
    from fedlore.data.federation import Federation

RECORD = "overwriting.json"
"""In the experiment folder while an ``--overwrite`` runs: ``{"finished": [<method>/seed-<s>,
...], "targets": [...], "started": [...]}``, the runs it has finished so far, those it was
started on (a record written before targets were kept has none, and then every run counts as
one) and those it has started training (none in a record written before they were kept)."""

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


def check_run_flags(
    cfg: Config, resume: bool, overwrite: bool, make: MakeAlgorithm | None = None
) -> None:
    """Refuse ``resume`` with ``overwrite`` unless an interrupted ``--overwrite`` of this
    experiment is there to continue, unless every run of the command is one it was started
    on, and (with ``make``) when the run it was training when it stopped was started with
    another config (:func:`check_continued`; see the module docstring).

    Raises:
        ConfigError: saying what each flag does, which runs the command adds, or what differs.
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
    if make is not None:  # the data is checked seed by seed (plan), once it is built
        for seed in cfg.seeds:
            for method in cfg.algorithms:
                check_continued(cfg, method, seed, make)


def _interrupted(cfg: Config, method: str, seed: int) -> Path | None:
    """The folder in which the ``--overwrite`` was training ``method`` and ``seed`` when it
    stopped: its sibling folder while the run folder holds a finished run (a replacement),
    else the run folder; None when the record does not say the ``--overwrite`` started that
    run and left it unfinished, or when the folder holds no run (a finished replacement whose
    swap a kill cut in two is finished)."""
    name = _name(cfg, method, seed)
    if name not in (_listed(cfg, "started") or []) or name in _finished(cfg):
        return None
    target = run_dir(cfg, method, seed)
    if pending_replacement(target) is not None:
        return None
    staged = staging_dir(target)
    folder = staged if (target / SUMMARY).is_file() else target
    return folder if (folder / "config.json").is_file() else None


def check_continued(
    cfg: Config,
    method: str,
    seed: int,
    make: MakeAlgorithm,
    fingerprint: Callable[[], str] | None = None,
) -> None:
    """Refuse to go on with the run an interrupted ``--overwrite`` was training (a replacement
    in its sibling folder, or an unfinished run in its own) when this config differs from the
    one it was started with, or (with ``fingerprint``, this seed's data) its data changed, as
    a plain ``--resume`` refuses an interrupted run: continuing would mix two configs in one
    run, and starting it over would discard its rounds for a setting that may only have been
    typed differently.

    Raises:
        ConfigError: one line naming the folder, what differs and the ways on.
    """
    folder = _interrupted(cfg, method, seed)
    recorded = read_record(folder / "config.json") if folder is not None else None
    if folder is None or recorded is None:  # unreadable: the run's own resume names the file
        return
    target = run_dir(cfg, method, seed)
    replacement = folder != target
    what = (
        f"{folder}, the replacement of the finished run in {target} that the --overwrite was "
        "training when it stopped,"
        if replacement
        else f"{folder}, the run the --overwrite was training when it stopped,"
    )
    details = config_diff(cfg, method, recorded, make)
    if details:
        raise ConfigError(
            f"--overwrite --resume: {what} was started with a different config ({details}); "
            f"restore the config to continue it, or delete {folder} to train "
            f"{'the replacement' if replacement else 'it'} afresh with this config "
            "(--overwrite without --resume trains every run of the command again)"
        )
    before = recorded.get("data_fingerprint")
    if fingerprint is not None and before is not None and before != (now := fingerprint()):
        raise ConfigError(
            f"--overwrite --resume: {what} was started on other data (fingerprint {before} -> "
            f"{now}: files under data.root or the tokenizer changed since); restore them to "
            f"continue it, or delete {folder} to train it afresh on this data"
        )


def run_recorded(
    cfg: Config,
    method: str,
    seed: int,
    overwrite: bool,
    train: Callable[[Config, str, int], dict[str, Any] | None],
) -> dict[str, Any] | None:
    """``train(cfg, method, seed)``, the run of ``method`` and ``seed``; under ``overwrite``
    the record says it was started before, and finished after when it returns a summary
    (:func:`record_finished`)."""
    started = _listed(cfg, "started") or []
    if overwrite and _name(cfg, method, seed) not in started:
        _write(cfg, started=[*started, _name(cfg, method, seed)])
    summary = train(cfg, method, seed)
    if summary is not None:  # an --overwrite records what it has finished
        record_finished(cfg, method, seed, overwrite)
    return summary


def begin(cfg: Config, resume: bool, overwrite: bool) -> None:
    """A new ``--overwrite`` (not continued) starts its record: no run finished, the command's
    runs as its targets."""
    if overwrite and not resume:
        write_json(_record(cfg), {"finished": [], "targets": _names(cfg), "started": []})


def _write(cfg: Config, **lists: list[str]) -> None:
    """Replace the record's lists named in ``lists`` (atomically), keeping the others it has."""
    kept = {k: v for k in ("finished", "targets", "started") if (v := _listed(cfg, k)) is not None}
    write_json(_record(cfg), {**kept, **lists})


def _finished(cfg: Config) -> list[str]:
    return _listed(cfg, "finished") or []


def record_finished(cfg: Config, method: str, seed: int, overwrite: bool) -> None:
    """Add a run an ``--overwrite`` has finished to its record (atomically; once), keeping its
    targets."""
    if overwrite and _name(cfg, method, seed) not in _finished(cfg):
        _write(cfg, finished=[*_finished(cfg), _name(cfg, method, seed)])


def swap_finished(cfg: Config, method: str, seed: int, staged: Path, target: Path) -> None:
    """Put a finished run in its place (:func:`~fedlore.engine.rerun.swap_in`; nothing when it
    trained there). A replacement trained while an ``--overwrite``'s record exists is recorded
    finished first: a kill after the swap but before the command's own bookkeeping then never
    has ``--overwrite --resume`` train it again (discarding a finished result, and under DP
    releases that no ε counts), and a kill before the swap leaves a finished replacement that
    the next run of it swaps in (:func:`~fedlore.engine.rerun.complete_swap`)."""
    if staged != target and _record(cfg).is_file():
        record_finished(cfg, method, seed, overwrite=True)
    swap_in(staged, target)


def end(cfg: Config, resume: bool, overwrite: bool) -> None:
    """Every run of the command has finished: an ``--overwrite``'s record goes, unless it names
    targets outside this command that have not finished (a continuation of only some of them).
    So it does after a plain ``--resume`` that finished an interrupted ``--overwrite`` (it
    refuses the runs of another config, so once it has finished every run is of this one):
    left there, the record would let a later ``--overwrite --resume`` train again the runs it
    names as not yet replaced. After a plain run (neither flag) it goes when it says that every
    target is finished: an ``--overwrite`` killed after its last replacement but before its
    record went (most often inside a swap, which that run completed:
    :func:`~fedlore.engine.rerun.complete_swap`) is then as an uninterrupted one ends. A plain
    run replaces nothing, so a record with a target still to replace stays for
    ``--overwrite --resume`` (as does an older record, which names no targets)."""
    targets = _listed(cfg, "targets")
    if overwrite or resume:
        done, targets = {*_finished(cfg), *_names(cfg)}, targets or []
    elif targets is None:  # no record, or one that does not say what it was to replace
        return
    else:
        done = set(_finished(cfg))
    if all(n in done for n in targets):
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
    for m in cfg.algorithms:  # the run it was training, refused on changed data before any
        check_continued(cfg, m, seed, make, lambda: fingerprint)
    for m in cfg.algorithms:
        target = run_dir(cfg, m, seed)
        staged = staging_dir(target)
        if complete_swap(target):  # a replacement whose swap a kill cut short
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


def kept_runs(cfg: Config, resume: bool, overwrite: bool) -> int:
    """How many of the command's runs it keeps as finished rather than trains, read from the
    folders before it starts (for words said before the first run: the ``allow_test``
    warning): a finished run (its folder's, or a replacement's whose swap a kill cut in two)
    unless ``--overwrite``; under ``--overwrite --resume`` one the interrupted ``--overwrite``
    replaced already. Reads files only; the checks that may refuse such a run come later."""
    if overwrite and not resume:
        return 0
    replaced = set(_finished(cfg))
    kept = 0
    for seed in cfg.seeds:
        for method in cfg.algorithms:
            target = run_dir(cfg, method, seed)
            staged = staging_dir(target)
            swapped = (staged / SUMMARY).is_file()
            if not (swapped or (target / SUMMARY).is_file()):
                continue
            kept += not overwrite or swapped or _name(cfg, method, seed) in replaced
    return kept
