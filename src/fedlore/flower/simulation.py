"""``engine=flower-sim``: one method x seed on Flower's Simulation Engine (Ray backend).

The ServerApp runs fedlore's round loop in a thread of this process; ``num_clients`` virtual
SuperNodes (``partition-id`` 0..N-1) run the ClientApp in Ray actors, ``flower.client_cpus``
CPUs (and torch threads) each.

Ray starts once per :func:`ray_session` (``fedlore run`` holds one around all its runs), not
once per method and seed: Flower's backend would shut it down at the end of each simulation,
:func:`keep_ray` has it kill the simulation's actors instead (their processes, with whatever
they cached, end with them; the next simulation's actors are new processes).

Flower hands a stored message to its virtual SuperNode by a thread that looks for new messages
every 0.1 s, and its other threads look whether the simulation has ended once a second; during
:func:`run_simulated` the first is woken when the server stores a message and the others look
every 0.02 s (:mod:`fedlore.flower.sim_threads`), so a round of fast clients is not rounded up
to the poll and a simulation ends as soon as its ServerApp does.

SIGINT (Ctrl-C) or SIGTERM during a simulation stops it cleanly (:mod:`fedlore.engine.interrupt`):
the round loop, in the ServerApp's thread, starts no other round and discards the round in
progress; the ServerApp ends, Flower's simulation ends with it, Ray is shut down and whatever of
it still runs is killed (:func:`stop_ray`, as the session ends), and
:class:`~fedlore.engine.interrupt.Interrupted` is raised in the calling thread. Ray's processes
run in sessions of their own (:func:`start_ray`), so a signal to the terminal's process group
reaches this process alone, not the workers of a round in progress. A second signal kills them
all and exits at once.

A killed simulated run resumes from its checkpoint to the result of the uninterrupted run, as
an in-process run does. Its clients' states live in Flower's ``Context.state`` of the virtual
SuperNodes, which a new simulation does not have; so each client also writes its state to
``<run folder>/clients/<client id>/``, versioned by round (:mod:`fedlore.engine.node_states`,
what a device's local storage is to a deployed client). Before a resumed simulation starts,
:func:`run_simulated` deletes the states of rounds after the checkpoint's (a discarded round's
clients may have written theirs) and checks the rest can be read; each client then reads its
newest state on its first message, and the server keeps its record of what the clients hold
(no :meth:`~fedlore.algorithms.base.Hyper.clients_restarted`), unless the checkpoint is
another engine's (in process, a deployment): then the files are deleted and every client
restarts (:mod:`fedlore.engine.client_holder`). Under DP the ledger counts, as
in process, the rows after the checkpoint that the resume runs again. A finished run's
``clients/`` folder is removed.

Two kinds of run are still run again from their first round by ``--resume`` (as a resume: same
config and data, or refused; the DP ledger counts every row the earlier attempt released,
:func:`fedlore.experiment.run_one`'s ``from_start``): one with ``checkpoint: false`` (nothing to
resume from) and FedBuff on the wall clock (``asynchronous.clock: wall``), whose clients in
flight at the kill may have trained from a version the checkpoint holds without their replies
(:func:`fedlore.engine.node_states.kept_by_clients`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from fedlore.config import Config
from fedlore.engine import interrupt, node_states
from fedlore.engine.interrupt import Interrupted, Process
from fedlore.engine.lock import RunLock
from fedlore.engine.loop import Callback
from fedlore.engine.node_states import restore_clients
from fedlore.engine.rerun import finished_record, stamp, write_dir
from fedlore.engine.run_record import check_same_config
from fedlore.engine.rundir import run_dir
from fedlore.experiment_parts import make_algorithm
from fedlore.flower.app import make_apps
from fedlore.flower.sim_threads import prompt_threads

log = logging.getLogger(__name__)


def run_simulated(
    cfg: Config,
    method: str,
    seed: int,
    resume: bool = False,
    overwrite: bool = False,
    extra_callbacks: tuple[Callback, ...] = (),
) -> dict[str, Any]:
    """Run ``method`` for ``seed`` on the Simulation Engine; returns the run summary. With
    ``overwrite`` a finished run is replaced as by :func:`fedlore.experiment.run_one` (the new run
    trains beside it and takes its place once finished, :mod:`fedlore.engine.rerun`); with
    ``resume`` an unfinished run continues from its checkpoint (the module docstring).
    ``extra_callbacks`` are called after every round in the ServerApp's thread, after the run's
    own (as :func:`fedlore.experiment.run_one`'s); an exception one raises stops the run and is
    raised here once the simulation has ended (``fedlore tune``'s pruning).

    Raises:
        RuntimeError: if the simulation ended without writing a summary (its log says why).
        NodeStateError: on a resume, when a client's state file is damaged or another run's
            (:func:`fedlore.engine.node_states.restore_point`).
    """
    from flwr.simulation import run_simulation

    target = run_dir(cfg, method, seed)
    summary_path = target / "summary.json"
    # where it trains: the run folder, or beside a finished run its replacement (new under
    # --overwrite; under --resume an interrupted one of this config, continued)
    folder = write_dir(cfg, method, target, resume, overwrite, make_algorithm)
    finished = resume and folder == target
    record = finished_record(cfg, method, target, make_algorithm) if finished else None
    if record is not None:  # finished: reported once its record is whole and this config's
        return record[0]
    keep = node_states.kept_by_clients(cfg)
    states = (folder / node_states.FOLDER).resolve()  # Ray's workers may run elsewhere
    if resume:
        check_same_config(cfg, method, folder, make_algorithm)
        if keep:
            with RunLock(folder):  # not under a process that runs it
                restore_clients(folder, states, method, seed)
    before = stamp(summary_path)  # a replaced finished run's summary is not this run's
    interrupt.check()  # a signal between two runs: no simulation starts
    ended: dict[str, Any] = {}

    def on_end(stopped: Interrupted | None) -> None:  # the ServerApp's thread; Ray still runs
        ended["stopped"], ended["ray"] = stopped, ray_processes()

    # a file the ServerApp could not write (one line, not a trace), a callback's exception
    failed: list[Exception] = []
    server, client = make_apps(
        cfg,
        method,
        seed,
        on_end,
        overwrite,
        failed,
        restart=resume,
        state_dir=states if keep else None,
        callbacks=extra_callbacks,
    )
    with ray_session() as session, interrupt.handling(), interrupt.deferred():
        try:
            with flower_output_to(folder / "flower.log"), prompt_threads(), keep_ray():
                session.start(cfg)
                run_simulation(
                    server_app=server,
                    client_app=client,
                    num_supernodes=cfg.num_clients,
                    backend_config=backend_config(cfg),
                )
        finally:
            session.after(ended.get("ray", []))
    stopped: Interrupted | None = ended.get("stopped")
    if stopped is not None:
        stopped.starts_over = not keep  # --resume runs it again from round 0 (the docstring)
        raise stopped
    if failed:
        raise failed[0]
    if stamp(summary_path) in (None, before):
        raise RuntimeError(f"the Flower simulation of {method} (seed {seed}) wrote no summary")
    result: dict[str, Any] = json.loads(summary_path.read_text())
    return result


class RaySession:
    """The Ray of a :func:`ray_session`."""

    def __init__(self) -> None:
        self.init: dict[str, Any] | None = None
        """The ``init_args`` Ray was started with (None: not started in this session)."""
        self.used = False
        """Whether a simulation began in this session (Ray is stopped when it ends)."""

    def start(self, cfg: Config) -> None:
        """Ray for a simulation of ``cfg``: the running one when it was started with the same
        ``init_args`` (:func:`backend_config`), else a new one (:func:`start_ray`)."""
        import ray

        self.used = True
        init = backend_config(cfg)["init_args"]
        if ray.is_initialized() and self.init not in (None, init):
            stop_ray(ray_processes())  # started for another config of Ray's (CPUs, GPUs)
        start_ray(cfg)
        self.init = init

    def after(self, seen: list[Process]) -> None:
        """After a simulation: when Flower has shut Ray down all the same (a backend that
        :func:`keep_ray` does not know), kill what is left of it at once (``seen``: Ray's
        processes listed before the end, :func:`stop_ray`); the next simulation starts Ray
        again."""
        import ray

        if not ray.is_initialized():
            stop_ray(seen)
            self.init = None


_session: RaySession | None = None


@contextlib.contextmanager
def ray_session() -> Iterator[RaySession]:
    """One Ray for every :func:`run_simulated` inside (``fedlore run`` holds one around all its
    runs): the first simulation starts Ray, the next ones reuse it (:func:`keep_ray`), and
    leaving stops it (:func:`stop_ray`, the processes listed while Ray still runs), after an
    exception or an interrupt as well. Nothing is imported or started until a simulation runs.
    Nested: the outermost one stops Ray. A :func:`run_simulated` outside any holds its own."""
    global _session
    if _session is not None:
        yield _session
        return
    _session = session = RaySession()
    try:
        yield session
    finally:
        _session = None
        if session.used:
            with interrupt.handling(), interrupt.deferred():  # a signal now: a flag, no trace
                stop_ray(ray_processes())


@contextlib.contextmanager
def keep_ray() -> Iterator[None]:
    """While inside, Flower's Ray backend ends a simulation without shutting Ray down: flwr's
    ``RayBackend.terminate`` asks its actors to exit and calls ``ray.shutdown()``; in its place
    the actors of the simulation's pool (idle or busy) are killed (``ray.kill``), so their
    worker processes end with every state they held, and the next simulation's pool, built by
    Flower anew, runs in new processes. A Flower version whose backend has no ``terminate``
    keeps its own, as does a pool whose actors are not where they are looked for (Ray then
    shuts down after each simulation and the next one starts it again)."""
    try:
        from flwr.server.superlink.fleet.vce.backend import raybackend
    except ImportError:
        yield
        return
    backend: Any = getattr(raybackend, "RayBackend", None)
    own = getattr(backend, "terminate", None)
    if own is None:
        yield
        return

    def kill_actors(self: Any) -> None:
        import ray

        pool = getattr(self, "pool", None)
        idle, busy = getattr(pool, "pool", None), getattr(pool, "_future_to_actor", None)
        if pool is not None and (not isinstance(idle, list) or not isinstance(busy, dict)):
            own(self)  # not the pool known: Flower's own end, Ray included
            return
        for actor in [*(idle or []), *(busy or {}).values()]:
            with contextlib.suppress(Exception):  # an actor already gone
                ray.kill(actor, no_restart=True)

    with _patch_lock:
        backend.terminate = kill_actors
    try:
        yield
    finally:
        with _patch_lock:
            backend.terminate = own


@contextlib.contextmanager
def flower_output_to(path: Path) -> Iterator[None]:
    """Send Flower's log records and Python warnings raised meanwhile to the file ``path``
    (appended) instead of the console. When the root logger is at INFO or below (``-v``: the
    user asked to see everything) they stay on the console, each line once (flwr's own handler
    prints them; they do not propagate to the root's as well)."""
    if logging.getLogger().isEnabledFor(logging.INFO):
        flwr_log = logging.getLogger("flwr")
        propagate = flwr_log.propagate
        flwr_log.propagate = not flwr_log.handlers  # flwr prints its own lines: once, not twice
        try:
            yield
        finally:
            flwr_log.propagate = propagate
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    flwr_log = logging.getLogger("flwr")
    handlers, propagate = list(flwr_log.handlers), flwr_log.propagate
    file = logging.FileHandler(path, encoding="utf-8")
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    stream: TextIO = file.stream  # type: ignore[assignment]

    def to_file(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))
        stream.flush()

    for h in handlers:
        flwr_log.removeHandler(h)
    flwr_log.addHandler(file)
    flwr_log.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.showwarning = to_file
            yield
    finally:
        flwr_log.removeHandler(file)
        file.close()
        for h in handlers:
            flwr_log.addHandler(h)
        flwr_log.propagate = propagate


_patch_lock = threading.Lock()


def backend_config(cfg: Config) -> dict[str, Any]:
    """The Ray backend's settings: every virtual client reserves ``flower.client_cpus`` CPUs
    and ``flower.client_gpus`` of a GPU (a fraction lets several clients share one); Ray gets
    ``flower.num_cpus`` CPUs and, with GPU clients, every visible GPU.

    Raises:
        ConfigError: when ``flower.client_gpus`` > 0 without a CUDA device.
    """
    import torch

    from fedlore.config import ConfigError

    init: dict[str, Any] = {"num_cpus": cfg.flower.num_cpus, "include_dashboard": False}
    if cfg.flower.client_gpus > 0:
        if not torch.cuda.is_available():
            raise ConfigError(
                f"flower.client_gpus={cfg.flower.client_gpus}: no CUDA device is available; "
                "set flower.client_gpus=0"
            )
        init["num_gpus"] = torch.cuda.device_count()
    return {
        "client_resources": {
            "num_cpus": cfg.flower.client_cpus,
            "num_gpus": cfg.flower.client_gpus,
        },
        "init_args": init,
    }


def start_ray(cfg: Config) -> None:
    """Start Ray for the simulation as Flower's Ray backend would (the ``init_args`` of
    :func:`backend_config` with Flower's defaults, this process's ``sys.path`` as the workers'
    PYTHONPATH; Flower then uses the running instance), with two differences:

    * every process ``ray.init`` starts (GCS, raylet, dashboard, monitors) begins a session of
      its own, and the raylet starts the workers and agents in its session: a signal to this
      process's group (Ctrl-C in a terminal, ``kill -- -PGID``) reaches this process alone, and
      the round loop stops cleanly while Ray's workers finish their clients (a worker killed by
      the signal mid-round would leave the round short of clients, and a Ray whose GCS died
      takes many seconds to shut down);
    * ``ray.init`` replaces the SIGTERM handler; fedlore's is put back
      (:func:`fedlore.engine.interrupt.reinstall`).

    A Ray already running in this process is left as it is (Flower uses it too)."""
    import ray

    if ray.is_initialized():
        return
    init: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": True}
    with contextlib.suppress(ImportError, AttributeError):
        from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG as flwr_defaults

        init["logging_level"] = flwr_defaults.init_args_logging_level
        init["log_to_driver"] = flwr_defaults.init_args_log_to_driver
    init.update(backend_config(cfg)["init_args"])
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    # as Flower's backend sets it; the raylet that ray.init starts inherits it and hands it to
    # every worker, so it is not repeated as a runtime_env (which would cost each new worker,
    # the actors of every simulation, about half a second of setup, and leave the workers Ray
    # starts in advance unused)
    os.environ["PYTHONPATH"] = pythonpath
    with _own_sessions():
        ray.init(**init)
    interrupt.reinstall()


@contextlib.contextmanager
def _own_sessions() -> Iterator[None]:
    """While inside, every process Ray starts through ``ray._private.services.ConsolePopen``
    starts a new session (``start_new_session=True``). A Ray without that class (another
    version) starts its processes as it does; interrupts still stop cleanly, only a signal to
    the whole process group then reaches Ray's processes too."""
    if os.name != "posix":
        yield
        return
    try:
        from ray._private import services as ray_services
    except ImportError:
        yield
        return
    services: Any = ray_services
    base = getattr(services, "ConsolePopen", None)
    if base is None:
        yield
        return

    def popen(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("start_new_session", True)
        return base(*args, **kwargs)

    services.ConsolePopen = popen
    try:
        yield
    finally:
        services.ConsolePopen = base


def ray_processes() -> list[Process]:
    """The processes Ray runs for this process: its descendants named ``ray::...`` (workers,
    agents) or run from Ray's package (GCS, raylet, dashboard, monitors)."""
    mark = f"{os.sep}ray{os.sep}"
    return [
        p for p in interrupt.descendants() if p.command.startswith("ray::") or mark in p.command
    ]


def stop_ray(seen: list[Process]) -> None:
    """Shut Ray down (unless Flower's simulation has done it: outside :func:`keep_ray`), then
    kill what still runs of the processes ``seen`` (listed while Ray ran: once their raylet is gone,
    Ray's agents are no longer this process's descendants and would linger for a minute) and
    of Ray's processes among this process's descendants."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    interrupt.kill([*seen, *ray_processes()])
