"""Run an experiment: every method of the config for every seed, side by side.

One run is one method for one seed: :func:`build` makes its
:class:`~fedlore.experiment_parts.Experiment` (the federation on the run's device, the method,
the model factory, the server's first state, the privacy) and
:func:`run` trains it over a transport into its run folder; :func:`run_one` does both, with the
run folder's rules (:mod:`fedlore.engine.rundir`, :mod:`fedlore.engine.rerun`).
:func:`run_experiment` runs every method x seed through an
:class:`~fedlore.experiment_sweep.Engine` (:mod:`fedlore.experiment_sweep`: the order, and
``keep_going``'s failed runs): in process by default; the CLI's table
(:data:`fedlore.cli.ENGINES`) names the others. Nothing here imports Flower.

Output: ``<output_dir>/<name>/<method>/seed-<s>/metrics.jsonl`` (one object per round),
``summary.json`` and ``checkpoint.pt`` beside it. A run whose ``summary.json`` exists is complete;
with ``resume=True`` an incomplete run continues from its checkpoint and reaches the same final
metrics as an uninterrupted run (all randomness is derived from seed, round and client). A
complete run is reported, not trained again, and ``overwrite=True`` replaces it only once the new
run has finished (:mod:`fedlore.engine.rerun`); every file is written atomically
(:mod:`fedlore.atomic`).
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import Callable, Sequence
from typing import Any

from fedlore.atomic import write_json
from fedlore.checks import (
    check_in_process,
    check_params,
    check_site_data,
    preflight,
    setup_rounds,
    warn_own_optimizer,
    warn_test_selection,
)
from fedlore.config import Config, ConfigError
from fedlore.data.federation import Federation, build_federation
from fedlore.device import resolve_device, training_precision, use_threads
from fedlore.engine import client_holder, failed, node_states, overwriting
from fedlore.engine.attack import attacked
from fedlore.engine.buffered import AsyncState, hooks
from fedlore.engine.callbacks import Checkpointer, MetricsWriter, ProgressBar
from fedlore.engine.dp_ledger import say_repeats
from fedlore.engine.early_stopping import early_stopper
from fedlore.engine.interrupt import Interrupted
from fedlore.engine.lock import RunLock
from fedlore.engine.loop import Callback
from fedlore.engine.rerun import (
    check_no_finished_run_of_another_config,
    finished_run,
    pending_replacement,
    write_dir,
)
from fedlore.engine.resume_changes import record_changes, resumed_record
from fedlore.engine.run_record import check_same_config, check_same_data, run_record
from fedlore.engine.rundir import (
    RunFolder,
    check_output_dir,
    check_run_folder,
    make_output_dir,
    recorded_threads,
    run_dir,
    spill_dir,
)
from fedlore.engine.runstart import remove_stale_temps, resume_point, start_fresh
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport, Transport
from fedlore.engine.unreliable import unreliable
from fedlore.experiment_loop import final_summary, make_loop
from fedlore.experiment_parts import (
    Experiment,
    check_config,
    describe_parameters,
    evaluator,
    make_algorithm,
    model_factory,
    prepare_federation,
    start_server,
    try_method,
)
from fedlore.experiment_privacy import (
    make_privacy,
    privacy_record,
    warn_over_target,
    warn_uncounted,
)
from fedlore.experiment_releases import warn_many_releases
from fedlore.experiment_sweep import Engine, RunsFailed, run_all, with_callbacks
from fedlore.progress import command, say_once
from fedlore.seeding import SERVER_INIT, generator
from fedlore.tracking import open_tracking


def build(
    cfg: Config,
    method: str,
    seed: int,
    fed: Federation | None = None,
    fingerprint: str | None = None,
) -> Experiment:
    """The run of ``method`` for ``seed``: its method, model and privacy built, its server
    started; every check that can refuse the config has run, and nothing is written.

    Args:
        fed: the seed's federation as
            :func:`~fedlore.experiment_parts.prepare_federation` returns it (built and prepared
            here when None).
        fingerprint: ``fed.fingerprint()`` when the caller has it already.

    Raises:
        ConfigError, ValueError, KeyError: naming the setting that cannot hold.
    """
    device = resolve_device(cfg.device)
    fed = prepare_federation(cfg, seed) if fed is None else fed
    fingerprint = fed.fingerprint() if fingerprint is None else fingerprint
    algo = make_algorithm(method, cfg)
    factory = model_factory(cfg, fed, seed)
    eval_model = factory()
    check_params(cfg, eval_model)
    state = start_server(algo, eval_model, generator(seed, SERVER_INIT), fed, method)
    privacy = make_privacy(cfg, algo, seed, float(fed.client_sizes().max()), state)
    return Experiment(
        cfg, method, seed, fed, device, fingerprint, algo, factory, eval_model, state, privacy
    )


def run(
    exp: Experiment,
    transport: Callable[..., Transport],
    folder: RunFolder,
    stop_after: int | None = None,
    extra_callbacks: tuple[Callback, ...] = (),
) -> dict[str, Any] | None:
    """Train ``exp`` in ``folder`` (holding its locks until it ends) and return its summary;
    None when stopped early by ``stop_after`` (the last round to run: a killed run, for tests).
    A run that ``early_stopping`` ends before ``rounds`` is finished
    (:mod:`fedlore.engine.early_stopping`).

    ``transport(algorithm, client_data, model_factory, seed, store)`` makes the transport
    (:class:`~fedlore.engine.transport.LocalTransport`, or the Flower ServerApp's over its
    Grid). A fresh run starts over in ``folder.out``; a resumed one continues from its
    checkpoint. A finished run's summary is written, and a replacement takes the finished run's
    place (:func:`~fedlore.engine.rerun.swap_in`)."""
    cfg, method, seed, algo, out = exp.cfg, exp.method, exp.seed, exp.algorithm, folder.out
    threads = use_threads(cfg.threads, recorded_threads(out) if folder.resume else None)
    if exp.device.type == "cpu":
        say_once("%d CPU thread%s (threads=%s)", threads, "" if threads == 1 else "s", cfg.threads)
    with RunLock(folder.target), RunLock(out, moves_to=folder.target):  # ours until it ends
        remove_stale_temps(out, folder.spill)  # a killed write's: never read, and now gone
        failed.clear(out)  # trained again: an earlier --keep-going failure is not its state
        prior = resumed_record(out) if folder.resume else None  # its resume_changes go on
        if not folder.resume:  # a fresh run: nothing of an earlier run in this folder may survive
            warn_uncounted(exp.privacy, out)  # an unfinished DP run's releases
            start_fresh(out, folder.spill, method, seed)
        elif folder.from_start:  # from round 0 again: the DP ledger and the rows stay to count
            start_fresh(out, folder.spill, method, seed, keep_ledger=True)
        out.mkdir(parents=True, exist_ok=True)
        written = run_record(cfg, method, exp.fingerprint, algo, exp.device, threads)
        write_json(out / "config.json", {**written, **privacy_record(exp.privacy)})
        max_bytes = None if cfg.store.max_memory_mb is None else int(cfg.store.max_memory_mb * 1e6)
        metrics = MetricsWriter(out / "metrics.jsonl")
        stopper = early_stopper(cfg)  # early_stopping: its state comes back with the checkpoint
        progress = AsyncState() if cfg.asynchronous.enabled else None  # FedBuff's clients
        keep, restore = hooks(progress, stopper)  # the checkpoint's entries besides the states
        entries: dict[str, Any] = {}  # the checkpoint's, for the transport's own entry

        def restore_all(raw: dict[str, Any]) -> None:
            entries.update(raw)
            if restore is not None:
                restore(raw)

        last, state, store, privacy = resume_point(
            folder,
            metrics,
            exp.state,
            ClientStore(max_bytes, folder.spill, exp.device),
            exp.privacy,
            max_bytes,
            exp.device,
            method,
            seed,
            first_round=-setup_rounds(algo),
            restore=restore_all,
        )
        if not warn_over_target(cfg, privacy, f"{method} seed {seed}"):  # past dp.epsilon?
            say_repeats(privacy, out)  # else the ledger's count, in one line either way
        start = -setup_rounds(algo) if last is None else last + 1
        record_changes(out / "config.json", prior, cfg, start)  # DP-FedBuff's cap, rounds
        clients = transport(algo, exp.fed.client, exp.model_factory, seed, store)
        keep = client_holder.with_holder(clients, with_transport(clients, keep, entries))
        # who kept the clients' states: a deployment's new run, another engine, holds none
        before, now = (
            client_holder.recorded(entries, out / node_states.FOLDER),
            client_holder.holder(clients),
        )
        entries.clear()
        restarted = getattr(algo, "clients_restarted", None)
        if last is not None and restarted and client_holder.restarts(before, now):
            state = client_holder.restart_clients(
                restarted, state, store, before, now, metrics.path
            )
        evaluate_state = evaluator(cfg, exp.fed, algo, exp.eval_model)
        callbacks: list[Callback] = [metrics] if stopper is None else [metrics, stopper]
        if cfg.checkpoint:  # after the stopper: it keeps the rule's state of the round
            callbacks.append(Checkpointer(out / "checkpoint.pt", store, keep))
        callbacks.extend(extra_callbacks)
        tracking = open_tracking(cfg, method, seed, out, folder.target)  # tracking: [...]
        callbacks.append(tracking)
        bar = None
        if cfg.progress:
            bar = ProgressBar(f"{method} seed {seed}", 0, cfg.rounds - start, cfg.rounds)
            callbacks.append(bar)
        loop = make_loop(
            exp, clients, privacy, evaluate_state, callbacks, stopper, progress, metrics.path, last
        )
        end = cfg.rounds if stop_after is None else min(cfg.rounds, stop_after + 1)
        ran = False
        try:
            with training_precision(cfg.precision):
                loop.run(state, start, end)
            ran = True
        except Interrupted as e:  # a signal (fedlore.engine.interrupt): name the run and folder
            e.stopped_in(f"{method} seed {seed}", out)
            raise
        except Exception as e:  # an error while training: the command names the run and folder
            if getattr(e, "fedlore_run", None) is None:
                e.fedlore_run = (f"{method} seed {seed}", out)  # type: ignore[attr-defined]
            raise
        finally:
            if bar is not None:
                bar.close()
            finished = end == cfg.rounds or (stopper is not None and stopper.stopped())
            if not (finished and ran):
                tracking.abort()  # unfinished: a resume logs its rounds again
        if not finished:  # stop_after: a killed run, for tests
            return None
        summary = final_summary(exp, metrics.path, stopper, privacy, clients)
        write_json(out / "summary.json", summary)
        tracking.finish(summary, out)  # before the folder moves (a tracker may write in it)
        # a finished run is never resumed: its spilled client states are no longer needed
        shutil.rmtree(folder.spill, ignore_errors=True)
        shutil.rmtree(out / node_states.FOLDER, ignore_errors=True)  # its clients' own states
        overwriting.swap_finished(cfg, method, seed, out, folder.target)  # a replacement: now
        return summary


def with_transport(
    clients: Transport, keep: Callable[[], dict[str, Any]] | None, raw: dict[str, Any]
) -> Callable[[], dict[str, Any]] | None:
    """``keep`` (the checkpoint's extra entries) with the transport's own, after restoring it
    from a resumed checkpoint's entries ``raw`` (empty: a fresh run), when the transport has
    ``checkpoint_entry`` (:class:`~fedlore.engine.transport.Transport`)."""
    own = getattr(clients, "checkpoint_entry", None)
    if own is None:
        return keep
    if raw:
        clients.restore_checkpoint(raw)  # type: ignore[attr-defined]
    return lambda: {**(keep() if keep is not None else {}), **own()}


def run_one(
    cfg: Config,
    method: str,
    seed: int,
    fed: Federation | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    extra_callbacks: tuple[Callback, ...] = (),
    make_transport: Callable[..., Transport] | None = None,
    overwrite: bool = False,
    from_start: bool = False,
) -> dict[str, Any] | None:
    """Run one method for one seed; returns its summary (None if stopped early by ``stop_after``,
    which simulates a killed run for tests).

    ``from_start`` (with ``resume``): continue an unfinished run from its first round instead
    of its checkpoint (:attr:`~fedlore.engine.rundir.RunFolder.from_start`; Flower's
    simulation of a run whose clients keep no states to resume from,
    :func:`fedlore.engine.node_states.kept_by_clients`).

    ``make_transport(algorithm, client_data, model_factory, seed, store)`` replaces the
    in-process transport (the Flower ServerApp passes one over its Grid)."""
    check_site_data(cfg, deployed=make_transport is not None)
    check_in_process(cfg, deployed=make_transport is not None)  # FedBuff clock=wall: Flower only
    target = run_dir(cfg, method, seed)
    # a sibling replaces a finished run
    out = write_dir(cfg, method, target, resume, overwrite, make_algorithm)
    spill = spill_dir(cfg, method, seed, out)
    # ``out`` holds a finished run only when it is ``target`` (write_dir swaps a finished
    # replacement in first); with or without --resume, that run is reported only after the
    # checks of a rerun (readable record, same config, same data): a run folder copied from
    # another machine is held to the same rules as one made here
    finished = (out / "summary.json").exists()
    if resume and not finished:
        check_same_config(cfg, method, out, make_algorithm)
    if finished or not (resume or overwrite):
        check_no_finished_run_of_another_config(cfg, method, out, make_algorithm)
    # every check that can refuse the config runs before anything in the run folder is touched
    fed = prepare_federation(cfg, seed, fed)
    fingerprint = fed.fingerprint()
    if finished or not (resume or overwrite):
        kept = finished_run(cfg, method, seed, fingerprint, make_algorithm)
        if kept is not None:
            return kept  # finished already: said, not trained again
    if resume:
        check_same_data(out, fingerprint)
    exp = build(cfg, method, seed, fed, fingerprint)
    folder = RunFolder(target, out, spill, resume, from_start=resume and from_start)
    factory = make_transport if make_transport is not None else LocalTransport
    a = cfg.attack
    factory = attacked(factory, a.kind, a.fraction, a.scale, fed.num_clients, fed.num_classes)
    factory = unreliable(factory, cfg)  # dropouts, stragglers (clients.*)
    return run(exp, factory, folder, stop_after, extra_callbacks)


IN_PROCESS = Engine(run_one)
"""Every run in this process, over :class:`~fedlore.engine.transport.LocalTransport`."""


@command()  # a message said once is said once for all its runs (fedlore.progress)
def run_experiment(
    cfg: Config,
    resume: bool = False,
    overwrite: bool = False,
    engine: Engine | None = None,
    callbacks: Callable[[str, int], Sequence[Callback]] | None = None,
    keep_going: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Every method x seed of ``cfg``; the federation of a seed is built once and shared, so all
    methods see identical client data. Returns method -> summaries.

    Before any work: ``output_dir`` must be a folder (or not exist yet); every method name and
    hyperparameter is checked and every problem reported at once; without ``resume`` or
    ``overwrite`` no finished run of another config may be in the way, and the finished runs of
    this config are reported and returned, not trained again.

    Args:
        engine: carries out the runs that train: :data:`IN_PROCESS` by default, which only an
            ``engine: local`` config may use; ``fedlore run`` passes the config's engine from
            :data:`fedlore.cli.ENGINES`.
        callbacks: ``(method, seed) -> callbacks`` for each run that trains: objects with
            ``on_round_end(rnd, row, state)`` (:class:`~fedlore.engine.loop.Callback`), called
            after every round with its ``metrics.jsonl`` row and the new server state, after
            the run's own (the row is written, the checkpoint saved), in this process (on
            ``engine: flower-sim`` in the ServerApp's thread). An exception one raises stops
            the run after that round and propagates (``fedlore tune``'s pruning).
        keep_going: a run that raises is recorded as failed in its folder and the other runs
            go on (``fedlore run --keep-going``, :mod:`fedlore.experiment_sweep`); without it
            the first error stops the experiment. An interrupt stops it either way.

    Raises:
        RunsFailed: under ``keep_going``, once every run has been tried, when any failed
            (its ``summaries`` are the finished runs'; ``--resume`` retries the failed ones).
        ConfigError: as above, naming each problem; ``resume``
            and ``overwrite`` together with no interrupted ``--overwrite`` to continue
            (:mod:`fedlore.engine.overwriting`).
    """
    overwriting.check_run_flags(cfg, resume, overwrite, make_algorithm)
    if engine is None:
        if cfg.engine != "local":
            raise ConfigError(
                f"engine={cfg.engine}: run_experiment runs in process unless given an engine; "
                f"pass engine=fedlore.cli.ENGINES[{cfg.engine!r}]() (as `fedlore run` does)"
            )
        engine = IN_PROCESS
    if callbacks is not None:
        engine = Engine(functools.partial(with_callbacks, engine.run, callbacks), engine.session)
    out: dict[str, list[dict[str, Any]]] = {m: [] for m in cfg.algorithms}
    check_config(cfg)
    check_site_data(cfg, deployed=False)  # before the data: a server's folder has no training set
    check_output_dir(cfg)
    for seed in cfg.seeds:  # before any folder or lock is made
        for method in cfg.algorithms:
            check_run_folder(cfg, method, seed)
    if not resume and not overwrite:
        for seed in cfg.seeds:
            for method in cfg.algorithms:
                target = run_dir(cfg, method, seed)
                # what the folder holds once a finished replacement whose swap a kill cut in two
                # is swapped in (the first thing a run of it does): that run is judged, not the
                # one it replaces
                judged = pending_replacement(target) or target
                check_no_finished_run_of_another_config(cfg, method, judged, make_algorithm)
    first = build_federation(cfg, cfg.seeds[0])
    # every check runs before a run folder is created or touched
    build_model = model_factory(cfg, first, cfg.seeds[0])
    start = functools.partial(try_method, cfg, first, build_model)
    algos = {}
    for name, algo in preflight(cfg, first, build_model, start):
        describe_parameters(name, algo, build_model())
        warn_own_optimizer(cfg, name, algo)
        algos[name] = algo
    warn_many_releases(cfg, algos)  # DP: the runs' releases compose
    kept = overwriting.kept_runs(cfg, resume, overwrite)  # allow_test: said once, counted
    trains = len(cfg.algorithms) * len(cfg.seeds) - kept
    if trains:  # no CUDA for device=cuda: refused before a folder is made (reported runs need none)
        resolve_device(cfg.device)
    warn_test_selection(cfg, first, trains, kept)
    make_output_dir(cfg)
    with contextlib.ExitStack() as held:
        # every folder this experiment will write is its own from the start: a second process
        # running the same experiment is refused now, not when it reaches a busy folder (after
        # having redone and rewritten the finished ones)
        for target in (run_dir(cfg, m, s) for s in cfg.seeds for m in cfg.algorithms):
            held.enter_context(RunLock(target))
            remove_stale_temps(target)  # what a killed write left (also in a finished run)
        overwriting.begin(cfg, resume, overwrite)  # once the runs are ours, not a refused twin's
        failures = run_all(cfg, first, resume, overwrite, engine, out, keep_going)
    if failures:  # an --overwrite's record stays: its failed runs are still to replace
        raise RunsFailed(failures, out, len(cfg.algorithms) * len(cfg.seeds))
    overwriting.end(cfg, resume, overwrite)
    return out
