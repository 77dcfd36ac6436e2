"""``engine=flower-sim``: one method x seed on Flower's Simulation Engine (Ray backend).

The ServerApp runs fedlore's round loop in a thread of this process; ``num_clients`` virtual
SuperNodes (``partition-id`` 0..N-1) run the ClientApp in Ray actors, ``flower.client_cpus``
CPUs (and torch threads) each.

Flower hands a stored message to its virtual SuperNode by a thread that looks for new messages
every 0.1 s; during :func:`run_simulated` that thread is woken when the server stores a message
instead (:func:`prompt_delivery`), so a round of fast clients is not rounded up to the poll.

Ctrl-C (SIGINT) during a simulation ends the process at once with exit status 130 (Flower's
shutdown would otherwise wait forever on its worker threads) and shuts Ray down. A simulated run
is not resumed from its checkpoint: its client states live in Flower's ``Context.state`` of the
virtual SuperNodes, which a new simulation does not have, so ``--resume`` returns a finished
run's summary and starts an unfinished one over.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from queue import Queue
from types import FrameType
from typing import Any, TextIO

from fedlore.config import Config
from fedlore.flower.app import make_apps

log = logging.getLogger(__name__)


def run_simulated(cfg: Config, method: str, seed: int, resume: bool = False) -> dict[str, Any]:
    """Run ``method`` for ``seed`` on the Simulation Engine; returns the run summary.

    Raises:
        RuntimeError: if the simulation ended without writing a summary (its log says why).
    """
    from flwr.simulation import run_simulation

    from fedlore.run import check_same_config, run_dir

    summary_path = run_dir(cfg, method, seed) / "summary.json"
    if resume:
        check_same_config(cfg, method, summary_path.parent)
    if resume and summary_path.exists():
        done: dict[str, Any] = json.loads(summary_path.read_text())
        return done
    server, client = make_apps(cfg, method, seed)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _stop_now) if main else None
    try:
        with flower_output_to(summary_path.parent / "flower.log"), prompt_delivery():
            run_simulation(
                server_app=server,
                client_app=client,
                num_supernodes=cfg.num_clients,
                backend_config=backend_config(cfg),
            )
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    if not summary_path.exists():
        raise RuntimeError(f"the Flower simulation of {method} (seed {seed}) wrote no summary")
    result: dict[str, Any] = json.loads(summary_path.read_text())
    return result


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


DELIVERY_POLL_S = 0.1
"""Seconds the delivery thread of :func:`prompt_delivery` waits for a wake-up before it looks for
new messages anyway (Flower's own polling period)."""

_patch_lock = threading.Lock()


def deliver_when_stored(
    state: Any, queue: Queue[Any], nodes_mapping: dict[int, int], f_stop: threading.Event
) -> None:
    """Flower's ``vce_api.add_messages_to_queue`` (the thread that moves the messages stored for
    the virtual SuperNodes to the workers' queue), woken as soon as the server stores a message
    rather than every 0.1 s: ``state.store_message_ins`` of this simulation's link state is
    wrapped to set an event. Looks again at once after delivering something (a node's second
    message), and every :data:`DELIVERY_POLL_S` seconds in any case; returns once ``f_stop`` is
    set (the simulation ends)."""
    stored = threading.Event()
    store = state.store_message_ins

    def store_and_wake(message: Any) -> Any:
        msg_id = store(message)
        stored.set()
        return msg_id

    state.store_message_ins = store_and_wake  # this state object only, not its class
    try:
        while not f_stop.is_set():
            stored.clear()  # a message stored from here on wakes the wait below
            found = False
            for node_id in list(nodes_mapping.keys()):
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
                    found = True
            if not found:
                stored.wait(DELIVERY_POLL_S)
    finally:
        state.store_message_ins = store


@contextlib.contextmanager
def prompt_delivery() -> Iterator[None]:
    """Use :func:`deliver_when_stored` as the Simulation Engine's delivery thread while inside;
    Flower's own is put back on leaving. A Flower version whose delivery function has another
    signature keeps its own (a 0.1 s poll: slower rounds, same results)."""
    from flwr.server.superlink.fleet.vce import vce_api

    own = getattr(vce_api, "add_messages_to_queue", None)
    expected = ["state", "queue", "nodes_mapping", "f_stop"]
    if own is None or list(inspect.signature(own).parameters) != expected:
        log.debug("Flower's delivery thread is not the one known; keeping its 0.1 s poll")
        yield
        return
    with _patch_lock:
        vce_api.add_messages_to_queue = deliver_when_stored
    try:
        yield
    finally:
        with _patch_lock:
            vce_api.add_messages_to_queue = own


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


def _stop_now(signum: int, frame: FrameType | None) -> None:
    """SIGINT handler of a running simulation: say how to continue, then exit at once (130)."""
    sys.stderr.write(
        "\ninterrupted: the Flower simulation stops now (a simulated run restarts from round 0 "
        "when run again: its client states lived in Flower's Context.state)\n"
    )
    sys.stderr.flush()
    watchdog = threading.Timer(10.0, os._exit, args=(130,))  # in case Ray's shutdown hangs
    watchdog.daemon = True
    watchdog.start()
    try:  # stop Ray and every process it started (they would outlive a bare exit)
        import psutil  # a dependency of ray
        import ray

        started = psutil.Process().children(recursive=True)
        ray.shutdown()
        for p in started:
            with contextlib.suppress(psutil.Error):
                p.kill()
    except Exception:  # exiting anyway
        pass
    os._exit(130)
