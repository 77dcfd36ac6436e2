"""``fedlore run CONFIG ... --dry-run``: what the command would do with each run, without doing it.

Before a long sweep, or after an interrupted one, a researcher wants to know which of its
method x seed runs would train from the start, continue from a checkpoint, be kept as finished,
or stop the command because another config's results are in the way. :func:`plan_runs` answers
that with the same rules and the same checks as :func:`fedlore.experiment.run_experiment` (the
config's own problems, the output folder, the first seed's data and the model on it, each run
folder's record, config, data and checkpoint), reading files only: nothing is trained, written,
locked or moved (the output folder and ``store.spill_dir`` are probed as the command probes
them, by a temporary file created and removed at once). The data of a later seed is built (its
fingerprint is checked against the runs' records) only when a folder of that seed holds a run.

One difference, said in the line: a finished ``--overwrite`` replacement whose swap a kill cut
in two (``seed-<s>.overwrite`` holds a summary) is completed by the real command before
anything else; the dry run reports the run as the swap would leave it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fedlore.checks import setup_rounds, warn_test_selection
from fedlore.config import Config, ConfigError
from fedlore.engine import node_states, overwriting
from fedlore.engine.callbacks import checkpoint_round
from fedlore.engine.dp_ledger import repeated
from fedlore.engine.lock import check_not_held
from fedlore.engine.rerun import (
    SUMMARY,
    finished_record,
    pending_replacement,
    read_record,
    staging_dir,
)
from fedlore.engine.run_record import check_same_config, check_same_data, config_diff
from fedlore.engine.rundir import check_output_dir, check_run_folder, run_dir
from fedlore.engine.runstart import check_rows_reach
from fedlore.experiment_parts import check_config, make_algorithm
from fedlore.progress import command
from fedlore.results.failed_runs import describe as describe_failure
from fedlore.results.failed_runs import read_failure

if TYPE_CHECKING:
    from fedlore.data.federation import Federation

ACTIONS = ("train", "continue", "keep", "refuse")
"""What the command does with a run: trains it from its first round, continues it from its
checkpoint, keeps it (finished: reported, not trained again), or refuses to start because of
it (then nothing trains: the command stops before the first run)."""


Fate = tuple[str, str]
"""``(action, why)`` of one run."""

WHEN = ("start", "seed", "run")
"""When the command refuses a run: before it trains anything (the checks of every run folder
before the first run), before any run of the run's seed (the finished runs of a seed are checked
together), or when it reaches the run (the checks of a resume): the runs before it in the
command's order have trained by then."""


@dataclass(frozen=True)
class Planned:
    """One run's fate under the command: ``action`` (one of :data:`ACTIONS`) and why; for a
    refused run, ``when`` (one of :data:`WHEN`) the command refuses it."""

    method: str
    seed: int
    action: str
    why: str
    when: str = "run"


def _rounds_in(folder: Path) -> tuple[int, bool]:
    """``(rounds, setup)`` an unfinished run has written: its rows of rounds 0 and on (the count
    the interrupt message gives: "stopped after N complete rounds"), and whether it has a row of
    a setup round (FedLore's round -1) too."""
    rounds, setup = 0, False
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0, False
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if isinstance(row, dict) and isinstance(row.get("round"), int):
            rounds += row["round"] >= 0
            setup = setup or row["round"] < 0
    return rounds, setup


def _same(
    cfg: Config, method: str, folder: Path, fingerprint: Callable[[], str] | None = None
) -> bool:
    """Whether ``folder`` holds a run (started) with this config; with ``fingerprint``, also on
    this data (:func:`fedlore.engine.overwriting.plan`'s test: a recorded fingerprint, if any,
    is the data's)."""
    recorded = read_record(folder / "config.json")
    if recorded is None or config_diff(cfg, method, recorded, make_algorithm):
        return False
    return fingerprint is None or recorded.get("data_fingerprint") in (None, fingerprint())


def _trains(cfg: Config) -> str:
    """``trains 30 rounds``, or with early stopping, which may end it sooner, ``trains up to 30
    rounds``."""
    most = "up to " if cfg.early_stopping.metric is not None else ""  # it may stop early
    return f"trains {most}{cfg.rounds} {'round' if cfg.rounds == 1 else 'rounds'}"


def _how_far(cfg: Config, why: str) -> str:
    """``why`` of a run that trains or continues, with early stopping followed by ``; trains up
    to 30 rounds``: every line of such a run says how far it may go, as a fresh run's does
    (without early stopping the line's ``of 30`` or the fresh run's ``trains 30 rounds`` does)."""
    return f"{why}; {_trains(cfg)}" if cfg.early_stopping.metric is not None else why


def _fresh(cfg: Config, folder: Path, resumable: bool = True) -> Fate:
    done, setup = _rounds_in(folder)
    if not done and not setup:
        return "train", _trains(cfg)
    whose = "the unfinished run" if resumable else "an unfinished run of another config or data"
    hint = " (--resume continues it)" if resumable else ""
    what = f"the {done} complete round(s)" if done else "the setup round"
    if done and setup:
        what += " and the setup round"
    return "train", _how_far(cfg, f"starts over, discarding {what} of {whose} there{hint}")


def _continue(cfg: Config, method: str, folder: Path, what: str = "") -> Fate:
    """A resume of the run in ``folder``, after the checks
    :func:`fedlore.engine.runstart.resume_point` makes: its checkpoint can be read (the round it
    continues after is the checkpoint's), ``metrics.jsonl`` holds every round up to it, and
    under DP its ledger of repeated releases can be read."""
    if cfg.dp.clip_norm is not None:
        try:
            repeated(folder)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.engine == "flower-sim" and not node_states.kept_by_clients(cfg):
        why = (
            f"{what}trains again from its first round (its clients keep no states to resume "
            "from: checkpoint: false, or FedBuff on the wall clock)"
        )
        return "continue", _how_far(cfg, why)
    ckpt = folder / "checkpoint.pt"
    if not ckpt.exists():
        why = f"{what}has no checkpoint: trains from its first round (as --resume does)"
        return "train", _how_far(cfg, why)
    last = checkpoint_round(ckpt)
    check_rows_reach(folder / "metrics.jsonl", -setup_rounds(make_algorithm(method, cfg)), last)
    if last < 0:  # only the setup round (FedLore's round -1) was checkpointed
        return "continue", _how_far(cfg, f"{what}continues after its setup round (round {last})")
    if cfg.early_stopping.metric is not None:  # "of 30": it may stop before
        return "continue", _how_far(cfg, f"{what}continues after round {last}")
    return "continue", f"{what}continues after round {last} of {cfg.rounds}"


def _one(
    cfg: Config,
    method: str,
    seed: int,
    resume: bool,
    overwrite: bool,
    fingerprint: Callable[[], str],
    replaced: set[str],
) -> Fate | tuple[str, str, str]:
    """The fate of one run (:func:`plan_runs`), by the rules of ``run_experiment``,
    :func:`fedlore.engine.overwriting.plan` and :func:`fedlore.experiment.run_one`, and when
    (:data:`WHEN`) a refusal comes."""
    target = run_dir(cfg, method, seed)
    staged = staging_dir(target)
    pending = pending_replacement(target)  # the real command swaps it in first
    swapped = pending is not None
    view = pending or target
    note = " (its finished replacement in the .overwrite folder is swapped in first)"
    finished = (view / SUMMARY).is_file()
    name = target.relative_to(Path(cfg.output_dir) / cfg.name).as_posix()
    when = "run"
    try:
        when = "start"  # a file where the run's folder goes, a run of it in progress
        check_run_folder(cfg, method, seed)
        check_not_held(target)
        when = "run"
        if overwrite and resume:  # continuing an interrupted --overwrite (overwriting.plan)
            when = "seed"  # the run it was training, on other data: refused at its seed
            overwriting.check_continued(cfg, method, seed, make_algorithm, fingerprint)
            when = "run"
            if swapped:
                replaced = replaced | {name}
            if not finished:  # continued if it is this config's, on this data; else trained
                if (view / "config.json").exists() and not _same(cfg, method, view, fingerprint):
                    return _fresh(cfg, view, resumable=False)
                check_same_config(cfg, method, view, make_algorithm)
                return _continue(cfg, method, view)
            if name in replaced and _same(cfg, method, view, fingerprint):
                # kept after the checks of a rerun: a damaged record stops the command
                when = "seed"
                finished_record(cfg, method, view, make_algorithm)
                return "keep", "replaced already by the --overwrite: kept", "run"
            if not swapped and _same(cfg, method, staged, fingerprint):
                return _continue(cfg, method, staged, "the interrupted replacement ")
            return "train", "trains again, replacing the finished run"
        if overwrite:
            if finished:
                return "train", (
                    "trains again beside the finished run, which it replaces when it has "
                    "finished (until then the finished run stays)" + note * swapped
                )
            return _fresh(cfg, view)
        if resume and finished and not swapped and _same(cfg, method, staged):
            check_same_config(cfg, method, staged, make_algorithm)
            check_same_data(staged, fingerprint())
            return _continue(cfg, method, staged, "the interrupted --overwrite replacement ")
        if finished:
            # without a flag every run folder's record is checked before the first run; the
            # data, and under --resume the record too, seed by seed
            when = "seed" if resume else "start"
            record = finished_record(cfg, method, view, make_algorithm)
            assert record is not None
            when = "seed"
            _check_finished_data(view, fingerprint)
            why = "finished already: kept (--overwrite trains it again)" + note * swapped
            return "keep", why, "run"
        if resume:
            check_same_config(cfg, method, view, make_algorithm)
            check_same_data(view, fingerprint())
            failure = read_failure(view)  # --keep-going's: retried
            what = "" if failure is None else f"the run that {describe_failure(failure)} "
            return _continue(cfg, method, view, what)
        return _fresh(cfg, view)
    except ConfigError as e:
        return "refuse", str(e), when


def _check_finished_data(folder: Path, fingerprint: Callable[[], str]) -> None:
    """Refuse, as :func:`fedlore.engine.rerun.finished_run` does, a finished run made on other
    data."""
    before = (read_record(folder / "config.json") or {}).get("data_fingerprint")
    if before is not None and before != fingerprint():
        raise ConfigError(
            f"{folder} holds a finished run of this config made on other data (fingerprint "
            f"{before} -> {fingerprint()}); pass --overwrite to replace it, or give this run "
            "another name=... to keep both"
        )


@command()  # one command, as the real one: the allow_test warning counts its runs
def plan_runs(cfg: Config, resume: bool = False, overwrite: bool = False) -> list[Planned]:
    """What ``fedlore run`` with this config and these flags would do with each run, in the
    order it runs them (seed by seed, methods in config order). Reads files only.

    Raises:
        ConfigError: what the command itself refuses before it trains any run: the config's
            own problems, an output folder that is a file, ``--resume --overwrite`` with no
            interrupted ``--overwrite`` to continue, a model that does not fit the data or a
            method that cannot start on it (:func:`fedlore.checks.preflight`).
        ValueError: data the first seed's federation cannot be built from (as the command).
    """
    overwriting.check_run_flags(cfg, resume, overwrite, make_algorithm)
    check_config(cfg)
    check_output_dir(cfg)
    record = read_record(Path(cfg.output_dir) / cfg.name / overwriting.RECORD) or {}
    names = record.get("finished")
    replaced = {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()
    from fedlore.data.federation import build_federation

    first: list[Federation] = []  # the first seed's data, which the command always builds

    def first_federation() -> Federation:
        if not first:
            first.append(build_federation(cfg, cfg.seeds[0]))
        return first[0]

    planned = []
    for seed in cfg.seeds:
        prints: dict[str, str] = {}

        def fingerprint(seed: int = seed, prints: dict[str, str] = prints) -> str:
            if "fp" not in prints:  # the data of this seed, built once and only when needed
                fed = first_federation() if seed == cfg.seeds[0] else build_federation(cfg, seed)
                prints["fp"] = fed.fingerprint()
            return prints["fp"]

        for method in cfg.algorithms:
            fate = _one(cfg, method, seed, resume, overwrite, fingerprint, replaced)
            planned.append(Planned(method, seed, *fate))
    if not any(p.action == "refuse" and p.when == "start" for p in planned):
        _preflight(cfg, first_federation())  # what the command checks next, before any run
        trains = sum(1 for p in planned if p.action in ("train", "continue"))
        kept = sum(1 for p in planned if p.action == "keep")
        if trains:  # as the command: device=cuda without CUDA refuses runs that would train
            from fedlore.device import resolve_device

            resolve_device(cfg.device)
        warn_test_selection(cfg, first_federation(), trains, kept)  # as the command says it
    return planned


def _preflight(cfg: Config, fed: Federation) -> None:
    """The checks :func:`fedlore.experiment.run_experiment` makes on the first seed's data and
    model before its first run (the model fits the data, every method starts on it), and
    :func:`fedlore.experiment.run_one`'s of the config before it trains.

    Raises:
        ConfigError, ValueError, KeyError: as the command does.
    """
    import functools

    from fedlore.checks import check_site_data, preflight
    from fedlore.experiment_parts import model_factory, try_method

    if cfg.engine == "local":
        check_site_data(cfg, deployed=False)
    build_model = model_factory(cfg, fed, cfg.seeds[0])
    preflight(cfg, fed, build_model, functools.partial(try_method, cfg, fed, build_model))


def stop(planned: list[Planned]) -> tuple[Planned, list[Planned]] | None:
    """Where the command stops: the refused run it stops at and the runs that train or
    continue before (in its order: seed by seed, methods in config order); None when it refuses
    none. Every run folder is checked before the first run, the finished runs of a seed before
    its first run, and the rest as each run is reached (:data:`WHEN`)."""
    first: dict[int, int] = {}
    for i, p in enumerate(planned):
        first.setdefault(p.seed, i)
    at = {"start": lambda i, p: -1, "seed": lambda i, p: first[p.seed], "run": lambda i, p: i}
    refused = [(at[p.when](i, p), WHEN.index(p.when), i) for i, p in enumerate(planned)
               if p.action == "refuse"]  # fmt: skip
    if not refused:
        return None
    where, _, i = min(refused)
    done = [p for p in planned[: max(where, 0)] if p.action in ("train", "continue")]
    return planned[i], done


def describe(cfg: Config, planned: list[Planned]) -> str:
    """The dry run's text: one line per run, then the counts and whether the command would
    start."""
    folder = Path(cfg.output_dir) / cfg.name
    width = max(len(f"{p.method} seed {p.seed}") for p in planned)
    lines = [f"dry run of {folder} (nothing is trained or written): {len(planned)} run(s)"]
    for p in planned:
        head = f"{p.method} seed {p.seed}".ljust(width)
        lines.append(f"  {head}  {p.action}: {p.why}")
    counts = {a: sum(1 for p in planned if p.action == a) for a in ACTIONS}
    said = ", ".join(f"{n} {a}" for a, n in counts.items() if n)
    stopped = stop(planned)
    if stopped is not None:
        at, done = stopped
        if not done:
            lines.append(f"{said}: `fedlore run` would stop before training anything")
        else:
            runs = ", ".join(f"{p.method} seed {p.seed}" for p in done)
            lines.append(
                f"{said}: `fedlore run` would first train or continue {len(done)} run(s) "
                f"({runs}), then stop at {at.method} seed {at.seed}"
            )
    else:
        lines.append(said)
    return "\n".join(lines)
