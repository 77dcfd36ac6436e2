"""Run a :class:`~fedlore.tune.Search` on Optuna (the optional extra ``fedlore[tune]``, imported
only here and only when a search runs): the study, its trials, pruning, ``best.json``.

Layout, under ``output_dir/name/tune/``:

* ``study.db``: the Optuna study (SQLite, Optuna's RDB storage): every trial's parameters,
  state, value and per-evaluation scores, and the search's record
  (:func:`fedlore.tune.search_record`);
* ``trial-<n>/``: trial ``n`` as an experiment folder (``<method>/seed-<s>/`` with its
  ``summary.json``, ``metrics.jsonl`` and ``checkpoint.pt``) and ``trial.json``, its parameters
  and how it ended (``complete``, ``pruned`` after a round, ``failed`` and why);
* ``best.json``: the best trial, its parameters and value, and the ``fedlore run`` command for
  every seed, and under DP the ε of the whole search (every trial's exchanges composed:
  :mod:`fedlore.tune_privacy`), written atomically when the search ends.

**Resuming.** The folder is locked while a search runs (:class:`~fedlore.engine.lock.RunLock`),
so a trial the study records as running was cut off (a kill, Ctrl-C, a full disk). The same
command continues: such a trial first, with the parameters it was given, resumed from its
checkpoint as ``fedlore run --resume`` resumes a run (its scores reported before the cut are
read back from its ``metrics.jsonl``), then new ones. Finished trials are kept, never trained
again. The sampler of trial ``n`` is seeded with ``derive_seed(tune.seed, TUNE_SAMPLER, n)``
and sees only finished trials, so a search interrupted and continued proposes, prunes and ends
as an uninterrupted one (the trials' runs are deterministic).

**Failures.** A trial whose settings the config or the method refuses, or that raises a
``ValueError`` while it trains, is recorded as failed and the search goes on; one that
diverges (no final score) too. Any other error fails the trial and stops the search; an
interrupt or an ``OSError`` (a full disk) leaves it running, for the next command to resume.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlore.atomic import write_json
from fedlore.config import ConfigError
from fedlore.engine.lock import RunLock
from fedlore.engine.loop import Callback
from fedlore.engine.rundir import run_dir
from fedlore.experiment import Engine, run_experiment
from fedlore.progress import say
from fedlore.seeding import TUNE_SAMPLER, derive_seed
from fedlore.tune import (
    Search,
    override,
    record_diff,
    run_command,
    search_record,
    seeds_note,
    trial_config,
)
from fedlore.tune_privacy import SearchPrivacy, search_privacy, trial_spend
from fedlore.types import State

if TYPE_CHECKING:
    import optuna

STUDY = "study.db"
BEST = "best.json"
TRIAL = "trial.json"
RECORD = "fedlore"
"""The study's user attribute holding the search's record."""

MISSING = "fedlore tune needs Optuna, the extra fedlore[tune]: pip install 'fedlore[tune]'"


class MissingExtra(ConfigError):
    """An optional extra a command needs is not installed."""


def import_optuna() -> Any:
    """Optuna, its logging at warnings only.

    Raises:
        MissingExtra: naming the extra to install.
    """
    try:
        import optuna
    except ImportError:
        raise MissingExtra(MISSING) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


@dataclass(frozen=True)
class TrialRow:
    """One trial of a search, for the table: its number, state (``complete``, ``pruned``,
    ``failed``, ``running``), parameters, objective value (a pruned trial's last reported
    score) and a note (the round it was pruned after, why it failed)."""

    number: int
    state: str
    params: dict[str, Any]
    value: float | None
    note: str = ""


@dataclass(frozen=True)
class Outcome:
    """A search's trials and, when one completed, the best (``best`` is its row and ``command``
    runs every seed at its parameters); under DP the ε of the whole search (``privacy``)."""

    rows: list[TrialRow]
    best: TrialRow | None = None
    command: str | None = None
    best_file: Path | None = None
    counts: dict[str, int] = field(default_factory=dict)
    privacy: SearchPrivacy | None = None


class _Reporter:
    """A round callback that reports the trial's ``metric`` after each evaluation to the study
    (Optuna's intermediate values, by round) and, with pruning, raises ``TrialPruned`` once
    the pruner says so: after the round's row and checkpoint are written, so the trial's
    folder holds every round it ran."""

    def __init__(self, trial: optuna.Trial, metric: str, prune: bool) -> None:
        self.trial, self.metric, self.prune = trial, metric, prune
        self.seen = set(trial.storage.get_trial(trial._trial_id).intermediate_values)
        self.pruned_at: int | None = None

    def _report(self, rnd: int, row: dict[str, Any]) -> bool:
        if rnd < 0 or self.metric not in row:
            return False  # no evaluation this round
        if rnd not in self.seen:
            raw = row[self.metric]
            real = isinstance(raw, int | float) and not isinstance(raw, bool)
            self.trial.report(float(raw) if real else math.nan, rnd)
            self.seen.add(rnd)
        return True

    def backfill(self, rows: Path) -> None:
        """Report the rounds a cut-off attempt of the trial wrote (``metrics.jsonl``) and ask
        the pruner after the last, as the attempt would have."""
        last = None
        lines = rows.read_text(encoding="utf-8").splitlines() if rows.is_file() else []
        for line in lines:
            try:
                row = json.loads(line)
                rnd = int(row["round"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line
            if self._report(rnd, row):
                last = rnd
        if last is not None and self.prune and self.trial.should_prune():
            self.pruned_at = last

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        if self._report(rnd, row) and self.prune and self.trial.should_prune():
            import optuna

            self.pruned_at = rnd
            raise optuna.TrialPruned(f"pruned after round {rnd}")


def _sampler(search: Search, number: int) -> optuna.samplers.BaseSampler:
    """The sampler that proposes trial ``number``: seeded from the search seed and the number
    alone (the grid's order from the search seed), so a continued search proposes what an
    uninterrupted one would."""
    import optuna

    grid = search.grid()
    if grid is not None:

        class Grid(optuna.samplers.GridSampler):
            def after_trial(self, *args: Any, **kwargs: Any) -> None:
                """fedlore stops at the grid's size itself (Optuna's would stop
                ``optimize``, which a search does not use)."""

        return Grid(grid, seed=search.cfg.tune.seed)
    seed = derive_seed(search.cfg.tune.seed, TUNE_SAMPLER, number) % 2**32
    if search.cfg.tune.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def _pruner(search: Search) -> optuna.pruners.BasePruner:
    import optuna

    tune = search.cfg.tune
    if tune.prune == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=tune.prune_startup_trials, n_warmup_steps=tune.prune_warmup_rounds
        )
    return optuna.pruners.NopPruner()


def _study(storage: optuna.storages.BaseStorage, search: Search) -> optuna.Study:
    """The search's study: created with its record, or loaded and held to it.

    Raises:
        ConfigError: the folder holds a search of other settings (naming them).
    """
    import optuna

    record = search_record(search)
    name = search.cfg.name
    if name not in optuna.get_all_study_names(storage):
        study = optuna.create_study(
            storage=storage,
            study_name=name,
            direction="maximize" if search.direction == "max" else "minimize",
            pruner=_pruner(search),
        )
        study.set_user_attr(RECORD, record)
        return study
    study = optuna.load_study(study_name=name, storage=storage, pruner=_pruner(search))
    diff = record_diff(study.user_attrs.get(RECORD, {}), record)
    if diff:
        raise ConfigError(
            f"{search.folder} holds a search with other settings ({diff}): run it with its own "
            "settings to continue it, or give another name (name=...) or output_dir for this "
            "one; its trials are kept"
        )
    return study


def _suggest(trial: optuna.Trial, search: Search) -> dict[str, Any]:
    """The trial's parameters (those it was given already, for a resumed trial)."""
    params: dict[str, Any] = {}
    for d in search.dims:
        if d.kind == "cat":
            params[d.key] = trial.suggest_categorical(d.key, list(d.choices))
        elif d.kind == "int":
            assert isinstance(d.low, int) and isinstance(d.high, int)
            params[d.key] = trial.suggest_int(d.key, d.low, d.high)
        else:
            assert d.low is not None and d.high is not None
            params[d.key] = trial.suggest_float(d.key, d.low, d.high, log=d.kind == "log")
    return params


def _end(
    study: optuna.Study,
    trial: optuna.Trial,
    search: Search,
    params: dict[str, Any],
    state: str,
    value: float | None = None,
    note: str = "",
) -> None:
    """Tell the study how the trial ended and write its ``trial.json``."""
    from optuna.trial import TrialState

    if note:
        trial.set_user_attr("note", note)
    if state == "complete":
        study.tell(trial, value)
    else:
        study.tell(trial, state=TrialState.PRUNED if state == "pruned" else TrialState.FAIL)
    _write_trial(search, trial.number, params, state, value, note)
    say("trial %d %s%s", trial.number, state, f" ({note})" if note else "")


def _write_trial(
    search: Search,
    number: int,
    params: dict[str, Any],
    state: str,
    value: float | None = None,
    note: str = "",
) -> None:
    folder = search.folder / f"trial-{number}"
    folder.mkdir(parents=True, exist_ok=True)
    entry = {"trial": number, "state": state, "params": params, "metric": search.metric}
    entry.update(value=value, note=note, overrides=[override(k, v) for k, v in params.items()])
    write_json(folder / TRIAL, entry)


def _run_trial(
    study: optuna.Study,
    trial: optuna.Trial,
    search: Search,
    engine: Engine | None,
    extra: Sequence[Callback],
) -> None:
    """Train trial ``trial`` (or resume it) and tell the study how it ended."""
    import optuna

    n = trial.number
    params = _suggest(trial, search)
    say(
        "trial %d of %d: %s", n, search.trials, ", ".join(override(k, v) for k, v in params.items())
    )
    try:
        cfg = trial_config(search, n, params)
    except ConfigError as e:  # a combination of settings the config refuses
        _end(study, trial, search, params, "failed", note=str(e).replace("\n", " "))
        return
    _write_trial(search, n, params, "running")
    reporter = _Reporter(trial, search.metric, search.cfg.tune.prune != "none")
    reporter.backfill(run_dir(cfg, search.method, search.run_seed) / "metrics.jsonl")
    if reporter.pruned_at is not None:  # cut off after a round that pruned it
        _end(study, trial, search, params, "pruned", note=f"after round {reporter.pruned_at}")
        return
    callbacks = None
    if search.in_process:
        callbacks = lambda method, seed: [*extra, reporter]  # noqa: E731
    try:
        summaries = run_experiment(cfg, resume=True, engine=engine, callbacks=callbacks)
    except optuna.TrialPruned:
        _end(study, trial, search, params, "pruned", note=f"after round {reporter.pruned_at}")
        return
    except ValueError as e:  # ConfigError too: settings the method or data refuse
        _end(study, trial, search, params, "failed", note=str(e).replace("\n", " "))
        return
    except OSError:
        raise  # a full disk, a lost folder: the trial stays running, to resume
    except Exception as e:
        _end(study, trial, search, params, "failed", note=f"{type(e).__name__}: {e}")
        raise
    summary = summaries[search.method][0]
    value = summary.get(f"final_{search.metric}")
    if isinstance(value, int | float) and math.isfinite(value):
        _end(study, trial, search, params, "complete", float(value))
        return
    why = "diverged" if summary.get("diverged") else f"no final {search.metric}"
    _end(study, trial, search, params, "failed", note=why)


FINISHED = ("COMPLETE", "PRUNED", "FAIL")


def _finished(study: optuna.Study) -> int:
    return sum(1 for t in study.get_trials(deepcopy=False) if t.state.name in FINISHED)


def run_search(
    search: Search,
    engine: Engine | None = None,
    callbacks: Callable[[int], Sequence[Callback]] | None = None,
) -> Outcome:
    """Run (or continue) ``search`` until ``search.trials`` trials have finished; write
    ``best.json``.

    Args:
        engine: carries out the trials' runs (:func:`fedlore.experiment.run_experiment`'s;
            None: in process).
        callbacks: ``trial number -> round callbacks`` added to that trial's run (in process),
            called before the round is reported to the study.

    Raises:
        MissingExtra: Optuna is not installed.
        ConfigError: another search holds the folder (its settings differ, or a live process
            runs it).
    """
    optuna = import_optuna()
    folder = search.folder
    folder.mkdir(parents=True, exist_ok=True)
    with RunLock(folder):  # a running trial in the study is a cut-off one
        storage = optuna.storages.RDBStorage(f"sqlite:///{(folder / STUDY).resolve()}")
        try:
            study = _study(storage, search)
            running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
            for frozen in running:
                study.sampler = _sampler(search, frozen.number)
                trial = optuna.trial.Trial(study, frozen._trial_id)
                say("trial %d was cut off: resumed", frozen.number)
                _run_trial(
                    study, trial, search, engine, callbacks(frozen.number) if callbacks else ()
                )
            while _finished(study) < search.trials:
                number = len(study.get_trials(deepcopy=False))
                study.sampler = _sampler(search, number)
                trial = study.ask()
                _run_trial(study, trial, search, engine, callbacks(number) if callbacks else ())
            outcome = _outcome(study, search)
        finally:
            storage.engine.dispose()
    return outcome


def _outcome(study: optuna.Study, search: Search) -> Outcome:
    """The table's rows, the best trial and ``best.json`` (written when a trial completed)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        state = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}.get(
            t.state.name, t.state.name.lower()
        )
        # a pruned trial's value: Optuna's, its last reported score
        rows.append(
            TrialRow(t.number, state, dict(t.params), t.value, t.user_attrs.get("note", ""))
        )
    counts = {s: sum(1 for r in rows if r.state == s) for s in ("complete", "pruned", "failed")}
    privacy = _privacy(search, rows) if search.cfg.dp.enabled else None
    done = [r for r in rows if r.state == "complete"]
    if not done:
        return Outcome(rows, counts=counts, privacy=privacy)
    best = next(r for r in rows if r.number == study.best_trial.number)
    command = run_command(search, best.params)
    path = search.folder / BEST
    write_json(path, best_record(search, best, command, counts, privacy))
    return Outcome(rows, best, command, path, counts, privacy)


def _privacy(search: Search, rows: Sequence[TrialRow]) -> SearchPrivacy:
    """The ε of the whole search: every trial of the study, from its run folder
    (:mod:`fedlore.tune_privacy`)."""
    spends = []
    for r in rows:
        try:
            cfg = trial_config(search, r.number, r.params)
        except ConfigError:  # refused before it ran (recorded as failed)
            cfg = None
        spends.append(trial_spend(r.number, r.state, r.note, cfg, search.method, search.run_seed))
    return search_privacy(search.cfg, spends)


def best_record(
    search: Search,
    best: TrialRow,
    command: str,
    counts: dict[str, int],
    privacy: SearchPrivacy | None = None,
) -> dict[str, Any]:
    """``best.json``: the best trial and what to run next; under DP the ε of the search."""
    record: dict[str, Any] = {
        "metric": search.metric,
        "direction": search.direction,
        "value": best.value,
        "trial": best.number,
        "trial_folder": f"trial-{best.number}",
        "params": best.params,
        "overrides": [override(k, v) for k, v in best.params.items()],
        "command": command,
        "method": search.method,
        "run_seed": search.run_seed,
        "seeds": list(search.cfg.seeds),  # what the command runs
        "run_seed_in_seeds": search.run_seed in search.cfg.seeds,
        "seeds_note": seeds_note(search),
        "search_seed": search.cfg.tune.seed,
        "sampler": search.cfg.tune.sampler,
        "trials": counts,
    }
    if search.cfg.dp.enabled:
        summary = run_dir(trial_config(search, best.number, best.params), search.method,
                          search.run_seed) / "summary.json"  # fmt: skip
        eps = json.loads(summary.read_text()).get("dp_epsilon") if summary.is_file() else None
        record["dp_epsilon_of_one_trial"] = eps
        record["search_privacy_accounted"] = search.cfg.tune.search_privacy_accounted
        if privacy is not None:
            record.update(privacy.record())
    return record
