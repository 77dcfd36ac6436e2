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

**Batches.** With ``tune.workers`` W above 1 the trials are proposed W at a time, all of a batch
before any of it trains (each records its batch, :data:`BATCH`), and trained at once, each in a
process of its own (:mod:`fedlore.tune_parallel`); the next batch is proposed once the batch has
ended. The W processes are kept for the whole search: each imports once, keeps the federation
it built, and takes one trial after another. One worker (the default) is this process, which
keeps the federation it built for the search likewise. A trial is pruned by comparison with the
trials before its batch. A search cut off between two proposals of a batch proposes the rest of it
first, as the uninterrupted search did.

**Failures.** A trial whose settings the config or the method refuses, or that raises a
``ValueError`` while it trains, is recorded as failed and the search goes on; one that
diverges (no final score) too. Any other error fails the trial and stops the search; an
interrupt or an ``OSError`` (a full disk) leaves it running, for the next command to resume.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlore.atomic import write_json
from fedlore.config import ConfigError
from fedlore.engine import interrupt
from fedlore.engine.lock import RunLock
from fedlore.engine.loop import Callback
from fedlore.engine.rundir import run_dir
from fedlore.experiment import Engine, run_experiment
from fedlore.progress import say, tell
from fedlore.seeding import TUNE_SAMPLER, derive_seed
from fedlore.tune import (
    Search,
    override,
    record_diff,
    search_record,
    trial_config,
)
from fedlore.tune_outcome import Outcome, outcome
from fedlore.types import State

if TYPE_CHECKING:
    import optuna

STUDY = "study.db"
TRIAL = "trial.json"
RECORD = "fedlore"
"""The study's user attribute holding the search's record."""
BATCH = "batch"
"""A trial's user attribute ``[first, size]``: the trials proposed together with it
(``tune.workers`` above 1); a trial without it was proposed alone."""

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
    """Optuna's median pruner (or none) comparing a trial with the trials before its batch only
    (:data:`BATCH`; a trial proposed alone: every trial before it), so siblings that finish
    first do not decide whether it is pruned."""
    import optuna

    tune = search.cfg.tune
    if tune.prune != "median":
        return optuna.pruners.NopPruner()
    median = optuna.pruners.MedianPruner(
        n_startup_trials=tune.prune_startup_trials, n_warmup_steps=tune.prune_warmup_rounds
    )

    class BeforeItsBatch(optuna.pruners.BasePruner):
        def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
            first = trial.user_attrs.get(BATCH, [trial.number])[0]
            return median.prune(_Before(study, first), trial)  # type: ignore[arg-type]

    return BeforeItsBatch()


class _Before:
    """A study whose trials are those numbered below ``limit`` (what a pruner may compare)."""

    def __init__(self, study: optuna.Study, limit: int) -> None:
        self._study, self._limit = study, limit

    def get_trials(self, deepcopy: bool = True, states: Any = None) -> list[Any]:
        every = self._study.get_trials(deepcopy=deepcopy, states=states)
        return [t for t in every if t.number < self._limit]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)


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
    # called after every round, in this process (on flower-sim in the ServerApp's thread)
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
    ``best.json``. With ``tune.workers`` W above 1, trials are proposed W at a time (a batch)
    and trained at once on W worker processes kept for the search (:mod:`fedlore.tune_parallel`).

    Args:
        engine: carries out the trials' runs (:func:`fedlore.experiment.run_experiment`'s;
            None: in process). Unused by trials trained in processes of their own.
        callbacks: ``trial number -> round callbacks`` added to that trial's run (in process),
            called before the round is reported to the study; ``tune.workers`` 1 only.

    Raises:
        MissingExtra: Optuna is not installed.
        ConfigError: another search holds the folder (its settings differ, or a live process
            runs it); ``callbacks`` with several workers.
        RuntimeError: a trial trained in a process of its own failed with an unexpected error
            (recorded as failed) or its process ended without a word (it stays running).
    """
    import_optuna()
    workers = search.cfg.tune.workers
    if callbacks is not None and workers > 1:
        raise ConfigError(
            "run_search(callbacks=...) calls them in this process: it needs tune.workers=1"
        )
    folder = search.folder
    folder.mkdir(parents=True, exist_ok=True)
    with RunLock(folder), _workers(workers):  # a running trial in the study is a cut-off one
        storage = _storage(folder)
        try:
            study = _study(storage, search)
            batch = _open_batch(study, search)  # a cut-off batch, proposed in full first
            while batch or _finished(study) < search.trials:
                if not batch:
                    size = min(workers, search.trials - _finished(study))
                    first = len(study.get_trials(deepcopy=False))
                    batch = [_ask(study, search, first, size) for _ in range(size)]
                _run_batch(study, search, batch, engine, callbacks)
                batch = []
            result = outcome(study, search)
        finally:
            storage.engine.dispose()
    return result


def _workers(workers: int) -> contextlib.AbstractContextManager[None]:
    """The search's worker processes, kept from one batch to the next (several workers); one
    worker (this process) keeps the last federation built for the search, as each of several
    does (:func:`~fedlore.data.federation.keeping_built`: every trial gets a deep copy)."""
    if workers == 1:
        from fedlore.data.federation import keeping_built

        return keeping_built()
    from fedlore.tune_parallel import kept

    return kept(workers)


def _storage(folder: Path) -> optuna.storages.RDBStorage:
    """The study's database; a writer waits up to a minute for another process's write."""
    import optuna

    url = f"sqlite:///{(folder / STUDY).resolve()}"
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})


def _ask(study: optuna.Study, search: Search, first: int, size: int) -> optuna.Trial:
    """Propose the next trial, one of the ``size`` proposed together from trial ``first``."""
    number = len(study.get_trials(deepcopy=False))
    study.sampler = _sampler(search, number)
    trial = study.ask()
    if size > 1:
        trial.set_user_attr(BATCH, [first, size])
    _suggest(trial, search)  # now, before any trial of the batch trains
    return trial


def _open_batch(study: optuna.Study, search: Search) -> list[optuna.Trial]:
    """The trials a cut-off search left running: their batch, its missing proposals made as the
    uninterrupted search made them (before any of it trained), then every running trial."""
    import optuna

    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    if not running:
        return []
    first, size = running[0].user_attrs.get(BATCH, [running[0].number, 1])
    while len(study.get_trials(deepcopy=False)) < first + size:
        _ask(study, search, first, size)
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    for t in running:
        tell("trial %d was cut off: resumed", t.number)  # its rounds are kept
    return [optuna.trial.Trial(study, t._trial_id) for t in running]


def _run_batch(
    study: optuna.Study,
    search: Search,
    batch: list[optuna.Trial],
    engine: Engine | None,
    callbacks: Callable[[int], Sequence[Callback]] | None,
) -> None:
    """Train the trials of a batch: here one after the other (one worker), or each on a worker
    process of the search's; an interrupt, a full disk or an unexpected error is raised once
    all ended."""
    workers = search.cfg.tune.workers
    if workers == 1:
        for trial in batch:
            study.sampler = _sampler(search, trial.number)
            extra = callbacks(trial.number) if callbacks else ()
            _run_trial(study, trial, search, engine, extra)
        return
    from fedlore.tune_parallel import run_jobs

    numbers = ", ".join(str(t.number) for t in batch)
    say("trials %s of %d: %d at once", numbers, search.trials, min(workers, len(batch)))
    jobs = [(f"trial {t.number}", (search, t._trial_id, t.number)) for t in batch]
    ended = run_jobs(_trial_process, jobs, workers)
    interrupt.check()
    for kind in ("interrupted", "oserror", "error", "died"):
        for e in ended:
            if e.kind != kind:
                continue
            if kind == "interrupted":
                raise interrupt.Interrupted(int(e.message))
            if kind == "oserror":
                raise OSError(f"{e.label}: {e.message}")
            if kind == "error":
                raise RuntimeError(f"{e.label} failed: {e.message}; the search stops")
            raise RuntimeError(
                f"{e.label}: its process ended without a word ({e.message}); it stays "
                "running: run the same command to resume it"
            )


def _trial_process(search: Search, trial_id: int, number: int) -> None:
    """Train one trial of a batch in a worker process (:mod:`fedlore.tune_parallel`)."""
    optuna = import_optuna()
    storage = _storage(search.folder)
    try:
        study = optuna.load_study(
            study_name=search.cfg.name, storage=storage, pruner=_pruner(search)
        )
        study.sampler = _sampler(search, number)  # its parameters are given: nothing is drawn
        _run_trial(study, optuna.trial.Trial(study, trial_id), search, None, ())
    finally:
        storage.engine.dispose()
