"""Flower ServerApp and ClientApp running fedlore's round loop and ``client_update`` unchanged.

* ServerApp: runs :func:`fedlore.experiment.run_one` with a :class:`FlowerTransport` instead of the
  in-process transport; metrics, summary and checkpoints are written as for ``engine=local``.
* ClientApp (``train``): decodes the broadcast, loads the client's state from ``Context.state``,
  calls the same ``client_update`` with the same seeded generator as the in-process transport
  (``generator(seed, CLIENT, round, client)``), stores the new state and replies. ``query``
  answers with the node's ``partition-id`` (its fedlore client id). On the Simulation Engine
  each client also writes its state to the run folder, round by round, and a resumed
  simulation's client reads it from there (:mod:`fedlore.engine.node_states`); a deployment's
  node with ``flower.node_states`` on its own disk (:mod:`fedlore.flower.node_files`).

Site-local data (``flower.site_data: true``, deployments only): every SuperNode reads its own
data from ``--node-config 'partition-id=<i> data-root="<folder>"'`` (a quoted string) with the
loader of ``data.name`` (an ``npz`` folder, an IDX folder, a CSV/JSONL file: whatever that
source reads), :func:`fedlore.flower.sites.site_federation`; the server reads only the
test split of its own ``data.root`` (:func:`~fedlore.flower.sites.server_federation`) and
never sees a client's data. Without it, every node rebuilds the central federation and takes
its partition (a simulation of a central data set).

Two ways to build them: :func:`make_apps` (closures over a validated config; used by
``fedlore run CONFIG engine=flower-sim``) and the module-level ``server_app`` / ``client_app``
for ``flwr run`` deployments, which read the config from the run config keys ``config``
(a YAML path), ``overrides`` (space-separated ``key=value``), ``method`` and ``seed``.

A SIGINT or SIGTERM to a deployed ServerApp's process stops its round loop before another
round, discarding the round in progress (:mod:`fedlore.engine.interrupt`); the ServerApp logs
where the run stopped, then hands the signal to Flower's own handler, which reports the run as
stopped and exits. ``resume=true`` in the run config continues from the last complete round.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from torch import nn

from fedlore import registry
from fedlore.algorithm import Algorithm
from fedlore.atomic import WriteError, explain
from fedlore.checks.asynchronous import check_deployed
from fedlore.config import Config, load_config, validate
from fedlore.data.client_data import ClientData
from fedlore.data.federation import Federation, build_federation
from fedlore.device import PeakMemory, resolve_device, training_precision
from fedlore.engine import interrupt
from fedlore.engine.interrupt import Interrupted
from fedlore.engine.loop import Callback, Row
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.flower.codec import record_to_broadcast, reply_to_record
from fedlore.flower.node_files import keep_state, load_state
from fedlore.flower.secure import SECURE_KEY, secagg_settings
from fedlore.flower.secure_client import (
    contribution_record,
    drop_out_now,
    is_secagg_stage,
    secagg_mod,
)
from fedlore.flower.sites import (
    check_site,
    data_shape,
    server_federation,
    site_config,
    site_federation,
)
from fedlore.flower.transport import TRAIN_ROUND, FlowerTransport, bound_superlink_wait
from fedlore.flower.wallclock import WallClockTransport
from fedlore.seeding import CLIENT, generator
from fedlore.tensors import state_bytes, to_device
from fedlore.types import Broadcast, Reply, State

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _federation(cfg_json: str, seed: int, device: str) -> Federation:
    """The federation of a config and seed on ``device``, built once per process (a ClientApp
    is called once per round; rebuilding the partition each time would be wasted work)."""
    return build_federation(validate(json.loads(cfg_json)), seed).to(device)


@functools.lru_cache(maxsize=4)
def _site(cfg_json: str, seed: int, cid: int, root: str, device: str) -> Federation:
    """The site's own one-client federation (:func:`site_federation`), built once per process."""
    return site_federation(validate(json.loads(cfg_json)), seed, cid, root).to(device)


@functools.lru_cache(maxsize=4)
def _algorithm(method: str, cfg_json: str) -> Algorithm:
    """The method of a config, built once per process
    (:func:`fedlore.experiment_parts.make_algorithm`)."""
    return make_algorithm(method, validate(json.loads(cfg_json)))


_models: dict[tuple[str, str, int, str, str], nn.Module] = {}


def _scratch_model(
    cfg_json: str, method: str, seed: int, shape: str, device: str, fed: Federation
) -> nn.Module:
    """The scratch model every client of this process trains on, built once per config, method,
    seed, data shape and device (as :class:`~fedlore.engine.transport.LocalTransport` builds one
    per run; ``client_update`` loads the broadcast into it). The latest four are kept."""
    key = (cfg_json, method, seed, shape, device)
    model = _models.pop(key, None)
    if model is None:
        model = model_factory(validate(json.loads(cfg_json)), fed, seed)()
    _models[key] = model  # the most recent last
    while len(_models) > 4:
        del _models[next(iter(_models))]
    return model


@functools.lru_cache(maxsize=4)
def _config(cfg_json: str) -> Config:
    """A validated config from its JSON, once per process (the simulated ClientApp's closure
    holds the JSON; validating it every message would be repeated work)."""
    return validate(json.loads(cfg_json))


def client_data(
    cfg: Config, context: Context, seed: int, device: torch.device, bcast: Broadcast
) -> tuple[Federation, ClientData]:
    """This node's federation and client data: its site's folder under ``flower.site_data``
    (checked against the server's data shape), else its partition of the central federation.

    Raises:
        ValueError: when a site has no ``data-root`` in its node config, or its data have a
            different number of classes, class names or input shape than the server's test set.
    """
    cid = int(context.node_config["partition-id"])
    if not cfg.flower.site_data:
        fed = _federation(cfg.model_dump_json(), seed, str(device))
        return fed, fed.client(cid)
    root = context.node_config.get("data-root")
    if not root:
        raise ValueError(
            f"flower.site_data=true, but SuperNode {cid} has no data-root: start it with "
            f"--node-config 'partition-id={cid} data-root=\"<its data folder or file>\"'"
        )
    fed = _site(cfg.model_dump_json(), seed, cid, str(root), str(device))
    check_site(fed, bcast.config, cid, str(root))
    return fed, dataclasses.replace(fed.client(0), client_id=cid)


def client_train(
    msg: Message,
    context: Context,
    cfg: Config,
    method: str,
    seed: int,
    threads: int | None = None,
    state_dir: Path | None = None,
) -> Message:
    """One ``client_update`` for the node's client; state kept in ``context.state``.

    ``state_dir``: the folder where the client also keeps its state round by round (a simulated
    run's ``<run folder>/clients``, :mod:`fedlore.engine.node_states`): read when
    ``context.state`` holds none (the first message of a resumed simulation), written after
    every training. None: ``context.state`` only, or a deployed node's own folder under
    ``flower.node_states`` (:mod:`fedlore.flower.node_files`).

    ``threads``: torch's intra-op threads for this process (:func:`set_threads`); None: the
    run's ``threads`` setting. The method, the config's validation and the scratch model are
    built once per process (:func:`_algorithm`, :func:`_scratch_model`), as the in-process
    transport builds them once per run: a Ray actor serves many messages (one at a time).
    """
    cid = int(context.node_config["partition-id"])
    set_threads(cfg, threads)
    device = resolve_device(cfg.device)  # the node's own: auto finds its GPU
    cfg_json = cfg.model_dump_json()
    algo = _algorithm(method, cfg_json)
    got = record_to_broadcast(msg.content)
    bcast = Broadcast(to_device(got.arrays, device), got.config)
    fed, data = client_data(cfg, context, seed, device, bcast)
    state = load_state(context, bcast.config, cid, method, seed, state_dir)  # node_files.py
    if state is not None:
        state = State(to_device(state.arrays, device), state.values)
    rnd = int(bcast.config.get(TRAIN_ROUND, bcast.config["round"]))  # FedBuff's repeats
    secure = bool(bcast.config.get(SECURE_KEY, False))
    if secure != is_secagg_stage(msg):
        raise ValueError(
            f"client {cid}: a broadcast with {SECURE_KEY}={secure} came "
            + ("outside" if secure else "inside")
            + " a SecAgg+ round; the server and client disagree on secure aggregation"
        )
    if secure:
        drop_out_now(context, rnd)  # fault injection; nothing without fault-drop-round
    model = _scratch_model(cfg_json, method, seed, data_shape(fed), str(device), fed)
    with training_precision(cfg.precision), PeakMemory(device) as peak:
        reply, new_state = algo.client_update(
            bcast, state, model, data, generator(seed, CLIENT, rnd, cid)
        )
    measured = {"client_state_bytes": state_bytes(new_state)}  # as the in-process transport
    if peak.bytes is not None:
        measured["peak_memory_bytes"] = peak.bytes
    reply = Reply(reply.arrays, {**reply.metrics, **measured})
    keep_state(context, bcast.config, cid, new_state, method, seed, state_dir)
    if secure:
        from fedlore.privacy import client_contribution, client_noise

        noise = client_noise(bcast.config, seed)  # OS entropy unless dp.reproducible_noise
        c = client_contribution(reply, bcast.config, cid, rnd, noise)
        return Message(contribution_record(c.summed, c.weight, c.metrics, context), reply_to=msg)
    from fedlore.privacy import client_noise, privatize

    # DP only (local DP: noised here, on the client, from OS entropy); no privacy.*: unchanged
    reply = privatize(reply, bcast.config, client_noise(bcast.config, seed), rnd, cid)
    return Message(reply_to_record(reply), reply_to=msg)


def client_threads(cfg: Config, simulated: bool) -> int | None:
    """torch threads of a ClientApp process: ``max(1, int(flower.client_cpus))`` for a simulated
    client (the CPUs its Ray actor reserves; Ray runs ``flower.num_cpus / client_cpus`` of them
    side by side), the run's ``threads`` count for a deployed one (None: ``threads: auto``,
    decided by :func:`set_threads`)."""
    if simulated:
        return max(1, int(cfg.flower.client_cpus))
    return cfg.threads if isinstance(cfg.threads, int) else None


_DEPLOYED_THREADS: dict[str, int] = {}
"""The count ``threads: auto`` chose in this process, kept for its later messages (one CPU
sample per SuperNode process, and one count for all its rounds, as an in-process run)."""


def set_threads(cfg: Config, threads: int | None) -> int:
    """Set torch's intra-op threads of this process to ``threads`` (None: the run's ``threads``
    setting, as the in-process engine applies it; ``auto`` is decided on the first message and
    kept) and return the count in effect."""
    if threads is None:
        from fedlore.device import use_threads

        key = str(cfg.threads)
        _DEPLOYED_THREADS[key] = use_threads(cfg.threads, _DEPLOYED_THREADS.get(key))
        return _DEPLOYED_THREADS[key]
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def client_query(msg: Message, context: Context) -> Message:
    """Reply with the node's fedlore client id (``partition-id``)."""
    ident = ConfigRecord({"partition-id": int(context.node_config["partition-id"])})
    return Message(RecordDict({"identity": ident}), reply_to=msg)


def server_main(
    grid: Grid,
    cfg: Config,
    method: str,
    seed: int,
    resume: bool = False,
    overwrite: bool = False,
    from_start: bool = False,
    keeps_client_states: bool = False,
    extra_callbacks: tuple[Callback, ...] = (),
    node_files: bool = False,
) -> dict[str, Any] | None:
    """Run one method x seed of ``cfg`` over ``grid`` (``resume`` / ``overwrite`` /
    ``from_start`` as for :func:`fedlore.experiment.run_one`); returns the run summary.
    ``keeps_client_states``: the clients restore their own states on a resume (a simulation's,
    :mod:`fedlore.engine.node_states`), so the server keeps its record of what they hold
    (:attr:`FlowerTransport.keeps_client_states`). ``extra_callbacks``: as ``run_one``'s.
    ``node_files``: a deployment's nodes keep them on their disks (``flower.node_states``,
    :attr:`FlowerTransport.node_files`)."""
    fed = server_federation(cfg, seed) if cfg.flower.site_data else None

    wall = cfg.asynchronous.enabled and cfg.asynchronous.clock == "wall"  # FedBuff's real clock

    def make_transport(_algo: Any, *args: Any) -> FlowerTransport:
        return (WallClockTransport if wall else FlowerTransport)(
            grid,
            round_timeout=cfg.flower.round_timeout_s,
            max_message_bytes=(
                None if cfg.flower.max_message_mb is None else int(cfg.flower.max_message_mb * 1e6)
            ),
            wait_for_nodes=cfg.flower.wait_for_nodes_s,
            expected_nodes=cfg.num_clients,
            device=resolve_device(cfg.device),
            extra_config=None if fed is None else site_config(fed),
            secagg=secagg_settings(cfg, method, None if fed is not None else args[0]),
            keeps_client_states=keeps_client_states,
            node_files=node_files,
        )

    # the bytes measured on the wire and each site's example count go into the run's summary
    # as it is written (FlowerTransport.summary_fields): one write, seen by its trackers too
    return run_one(
        cfg,
        method,
        seed,
        fed=fed,
        resume=resume,
        overwrite=overwrite,
        make_transport=make_transport,
        from_start=from_start,
        extra_callbacks=extra_callbacks,
    )


class _CallbackRaised(Exception):
    """What a caller's callback raised, carried out of Flower's ServerApp thread."""

    def __init__(self, carried: Exception) -> None:
        super().__init__(str(carried))
        self.carried = carried


@dataclasses.dataclass
class _Carried:
    """A caller's callback whose exception is wrapped in :class:`_CallbackRaised` (so the
    ServerApp tells it from its own errors, which Flower logs)."""

    callback: Callback

    def on_round_end(self, rnd: int, row: Row, state: State) -> None:
        try:
            self.callback.on_round_end(rnd, row, state)
        except Exception as e:
            raise _CallbackRaised(e) from e


def make_apps(
    cfg: Config,
    method: str,
    seed: int,
    on_end: Callable[[Interrupted | None], None] | None = None,
    overwrite: bool = False,
    failed: list[Exception] | None = None,
    restart: bool = False,
    state_dir: Path | None = None,
    callbacks: tuple[Callback, ...] = (),
) -> tuple[ServerApp, ClientApp]:
    """A ServerApp/ClientApp pair bound to a validated config, one method and one seed
    (``overwrite``: replace a finished run, as :func:`server_main`; ``restart``: a ``--resume``
    of an unfinished simulated run). ``state_dir``: where the clients keep their states round
    by round (:mod:`fedlore.engine.node_states`), so that ``restart`` continues from the
    checkpoint; None: a ``restart`` runs again from the first round, its DP ledger counting the
    rows it repeats (:func:`fedlore.experiment.run_one`'s ``from_start``). A file the ServerApp
    cannot write (a full disk) is appended to ``failed`` when given (for the caller to report
    in one line), else raised; so is an exception one of ``callbacks`` raises (called after
    every round, after the run's own, :func:`fedlore.experiment.run_one`'s ``extra_callbacks``:
    ``fedlore tune``'s pruning raises ``TrialPruned``).

    ``on_end`` is called in the ServerApp's thread as its run ends (however it ends), with the
    :class:`~fedlore.engine.interrupt.Interrupted` that stopped the round loop or None; the
    interrupt is then handed over instead of raised (Flower's thread would print it as an
    unhandled exception). Without ``on_end`` it propagates."""
    server = ServerApp()
    client = ClientApp()
    cfg_json = cfg.model_dump_json()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        stopped = None
        try:
            server_main(
                grid,
                validate(json.loads(cfg_json)),
                method,
                seed,
                resume=restart,
                overwrite=overwrite,
                from_start=restart and state_dir is None,
                keeps_client_states=state_dir is not None,
                extra_callbacks=tuple(_Carried(c) for c in callbacks),
            )
        except (WriteError, _CallbackRaised) as e:
            if failed is None:
                raise e.carried if isinstance(e, _CallbackRaised) else e from None
            failed.append(e.carried if isinstance(e, _CallbackRaised) else e)
        except Interrupted as e:
            if on_end is None:
                raise
            stopped = e
        finally:
            if on_end is not None:
                on_end(stopped)

    threads = client_threads(cfg, simulated=True)

    @client.train(mods=[secagg_mod])  # SecAgg+ stages; other messages pass through
    def _train(msg: Message, context: Context) -> Message:
        return client_train(msg, context, _config(cfg_json), method, seed, threads, state_dir)

    @client.query()
    def _query(msg: Message, context: Context) -> Message:
        return client_query(msg, context)

    return server, client


def _from_run_config(context: Context) -> tuple[Config, str, int]:
    rc = context.run_config
    path = Path(str(rc.get("config", "experiments/quickstart.yaml")))
    overrides = shlex.split(str(rc.get("overrides", "")))  # quotes keep spaces in a value
    cfg = load_config(path, overrides)
    method = str(rc.get("method", cfg.algorithms[0]))
    try:  # a typo is one line naming the registered methods, not a KeyError's traceback
        registry.get("algorithm", method)
    except KeyError as e:
        raise ValueError(f"run config method={method!r}: {e.args[0]}") from None
    raw_seed = rc.get("seed", cfg.seeds[0])
    try:
        seed = int(str(raw_seed))
    except ValueError:
        raise ValueError(f"run config seed={raw_seed!r}: a seed is an integer") from None
    return cfg, method, seed


def _flag(context: Context, key: str) -> bool:
    """A run-config switch (``resume``, ``overwrite``): true, "true", 1 or "1"."""
    return str(context.run_config.get(key, "false")).strip().lower() in ("true", "1", "yes")


server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def _deployed_main(grid: Grid, context: Context) -> None:
    link_s = None
    try:
        cfg, method, seed = _from_run_config(context)
        check_deployed(cfg)  # DP-FedBuff: tested in process and on the Simulation Engine only
        link_s = cfg.flower.superlink_timeout_s
        bound_superlink_wait(grid, link_s)  # a killed SuperLink stops the run, freeing its folder
        # SIGINT / SIGTERM to this process stop the round loop between rounds, not mid-write
        with interrupt.handling():
            server_main(
                grid,
                cfg,
                method,
                seed,
                resume=_flag(context, "resume"),
                overwrite=_flag(context, "overwrite"),
                node_files=cfg.flower.node_states,
            )
    except httpx.TransportError as e:  # the SuperLink is gone: the rounds so far are kept
        logging.getLogger("flwr").error(
            "fedlore: error: the SuperLink did not answer for flower.superlink_timeout_s = %s s "
            "(%s: %s); the finished rounds are kept: start it again and `flwr run` with "
            "--run-config 'resume=true'",
            link_s, type(e).__name__, e,
        )  # fmt: skip
    except ValueError as e:  # ConfigError included: say what to do, without a traceback
        # flwr streams what its own logger records to `flwr run --stream`; the run then ends
        # without a summary, which scripts/flower_local_federation.sh reports as a failure
        logging.getLogger("flwr").error("fedlore: error: %s", e)
    except WriteError as e:  # a full disk, a quota, no permission: one line and what to do
        logging.getLogger("flwr").error("fedlore: error: %s", explain(e))
    except Interrupted as e:  # nothing of the round in progress was recorded
        logging.getLogger("flwr").warning(
            "fedlore: %s", e.describe("`flwr run` with --run-config 'resume=true'")
        )
        interrupt.pass_on(e)  # then Flower's own handler: it reports the run stopped and exits


@client_app.train(mods=[secagg_mod])  # SecAgg+ stages; other messages pass through
def _deployed_train(msg: Message, context: Context) -> Message:
    cfg, method, seed = _from_run_config(context)
    return client_train(msg, context, cfg, method, seed, client_threads(cfg, simulated=False))


@client_app.query()
def _deployed_query(msg: Message, context: Context) -> Message:
    return client_query(msg, context)
