"""Flower ServerApp and ClientApp running fedlore's round loop and ``client_update`` unchanged.

* ServerApp: runs :func:`fedlore.run.run_one` with a :class:`FlowerTransport` instead of the
  in-process transport; metrics, summary and checkpoints are written as for ``engine=local``.
* ClientApp (``train``): decodes the broadcast, loads the client's state from ``Context.state``,
  calls the same ``client_update`` with the same seeded generator as the in-process transport
  (``generator(seed, CLIENT, round, client)``), stores the new state and replies. ``query``
  answers with the node's ``partition-id`` (its fedlore client id).

Two ways to build them: :func:`make_apps` (closures over a validated config; used by
``fedlore run CONFIG engine=flower-sim``) and the module-level ``server_app`` / ``client_app``
for ``flwr run`` deployments, which read the config from the run config keys ``config``
(a YAML path), ``overrides`` (space-separated ``key=value``), ``method`` and ``seed``.
"""

from __future__ import annotations

import functools
import json
import logging
import shlex
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedlore.config import Config, load_config, validate
from fedlore.data.federation import Federation, build_federation
from fedlore.device import PeakMemory, resolve_device, training_precision
from fedlore.flower.codec import (
    record_to_broadcast,
    record_to_state,
    reply_to_record,
    state_to_record,
)
from fedlore.flower.transport import FlowerTransport
from fedlore.seeding import CLIENT, generator
from fedlore.tensors import to_device
from fedlore.types import Broadcast, Reply, State

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _federation(cfg_json: str, seed: int, device: str) -> Federation:
    """The federation of a config and seed on ``device``, built once per process (a ClientApp
    is called once per round; rebuilding the partition each time would be wasted work)."""
    return build_federation(validate(json.loads(cfg_json)), seed).to(device)


def client_train(msg: Message, context: Context, cfg: Config, method: str, seed: int) -> Message:
    """One ``client_update`` for the node's client; state kept in ``context.state``."""
    from fedlore.run import make_algorithm, model_factory

    cid = int(context.node_config["partition-id"])
    device = resolve_device(cfg.device)  # the node's own: auto finds its GPU
    fed = _federation(cfg.model_dump_json(), seed, str(device))
    algo = make_algorithm(method, cfg)
    got = record_to_broadcast(msg.content)
    bcast = Broadcast(to_device(got.arrays, device), got.config)
    state = record_to_state(context.state)
    if state is not None:
        state = State(to_device(state.arrays, device), state.values)
    rnd = int(bcast.config["round"])
    model = model_factory(cfg, fed, seed)()
    with training_precision(cfg.precision), PeakMemory(device) as peak:
        reply, new_state = algo.client_update(
            bcast, state, model, fed.client(cid), generator(seed, CLIENT, rnd, cid)
        )
    if peak.bytes is not None:
        reply = Reply(reply.arrays, {**reply.metrics, "peak_memory_bytes": peak.bytes})
    for key in list(context.state.keys()):
        del context.state[key]
    for key, rec in state_to_record(new_state).items():
        context.state[key] = rec
    return Message(reply_to_record(reply), reply_to=msg)


def client_query(msg: Message, context: Context) -> Message:
    """Reply with the node's fedlore client id (``partition-id``)."""
    ident = ConfigRecord({"partition-id": int(context.node_config["partition-id"])})
    return Message(RecordDict({"identity": ident}), reply_to=msg)


def server_main(grid: Grid, cfg: Config, method: str, seed: int) -> dict[str, Any] | None:
    """Run one method x seed of ``cfg`` over ``grid``; returns the run summary."""
    from fedlore.run import run_one

    transport_box: dict[str, FlowerTransport] = {}

    def make_transport(*_: Any) -> FlowerTransport:
        t = FlowerTransport(
            grid,
            round_timeout=cfg.flower.round_timeout_s,
            max_message_bytes=(
                None if cfg.flower.max_message_mb is None else int(cfg.flower.max_message_mb * 1e6)
            ),
            wait_for_nodes=cfg.flower.wait_for_nodes_s,
            expected_nodes=cfg.num_clients,
            device=resolve_device(cfg.device),
        )
        transport_box["t"] = t
        return t

    summary = run_one(cfg, method, seed, make_transport=make_transport)
    t = transport_box.get("t")
    if t is not None and summary is not None:
        summary["wire_bytes_up_total"] = t.wire_bytes_up
        summary["wire_bytes_down_total"] = t.wire_bytes_down
        from fedlore.run import run_dir

        (run_dir(cfg, method, seed) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def make_apps(cfg: Config, method: str, seed: int) -> tuple[ServerApp, ClientApp]:
    """A ServerApp/ClientApp pair bound to a validated config, one method and one seed."""
    server = ServerApp()
    client = ClientApp()
    cfg_json = cfg.model_dump_json()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        server_main(grid, validate(json.loads(cfg_json)), method, seed)

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        return client_train(msg, context, validate(json.loads(cfg_json)), method, seed)

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
    seed = int(rc.get("seed", cfg.seeds[0]))
    return cfg, method, seed


server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def _deployed_main(grid: Grid, context: Context) -> None:
    cfg, method, seed = _from_run_config(context)
    server_main(grid, cfg, method, seed)


@client_app.train()
def _deployed_train(msg: Message, context: Context) -> Message:
    cfg, method, seed = _from_run_config(context)
    return client_train(msg, context, cfg, method, seed)


@client_app.query()
def _deployed_query(msg: Message, context: Context) -> Message:
    return client_query(msg, context)
