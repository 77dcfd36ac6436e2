"""A run resumed on another engine than the attempt it continues: its checkpoint names where the
clients kept their states (:mod:`fedlore.engine.client_holder`), and a resume whose transport
cannot restore them restarts every client (the dense model at its next contact, no state), with
one line, instead of losing a round to log replays every client rejects.

Played in process, without Ray or a SuperLink: a deployment is the ClientApp over a new
``Context`` per client and attempt, told to keep no files (a new ``flwr run``'s nodes hold
nothing of ours: ``keeps_client_states = False``, as
:class:`~fedlore.flower.transport.FlowerTransport` on a deployment); a simulation is the same
ClientApp keeping its state in the run folder's ``clients/``
(:mod:`fedlore.engine.node_states`), its resume preceded by
:func:`~fedlore.engine.node_states.restore_clients` as
:func:`fedlore.flower.simulation.run_simulated` does; in process is
:class:`~fedlore.engine.transport.LocalTransport`."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
import torch
from app_helpers import node_contexts, train_message

from fedlore.config import Config, load_config
from fedlore.engine import client_holder, node_states
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.client_holder import ClientsRestartedWarning
from fedlore.engine.rundir import run_dir
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_one
from fedlore.flower.app import make_apps
from fedlore.flower.codec import record_to_reply
from fedlore.flower.transport import TRAIN_ROUND
from fedlore.types import Broadcast, Reply

pytestmark = pytest.mark.flower

SEED = 42
TINY = [
    "num_clients=3",
    "rounds=5",
    "local_steps=2",
    "batch_size=16",
    "lr=0.01",
    "rank=4",
    "model.kwargs={hidden: [16]}",
    "progress=false",
]


class _Nodes:
    """The ClientApp called here, one new ``Context`` per client (a new Flower run's nodes)."""

    def __init__(self, client: Any, num_clients: int, keeps: bool) -> None:
        self.client = client
        self.keeps_client_states = keeps
        self.ctx = node_contexts(num_clients)

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out: dict[int, Reply | BaseException] = {}
        for cid, b in messages.items():
            if b.config["round"] != rnd:
                b = Broadcast(b.arrays, {**b.config, TRAIN_ROUND: rnd})
            msg = train_message(rnd, cid, b)
            try:
                out[cid] = record_to_reply(self.client(msg, self.ctx[cid]).content)
            except Exception as e:  # a client's refusal comes back as its error, as on Flower
                out[cid] = e
        return out


class _Restarted(LocalTransport):
    """In process, over clients that start without their states and a server told so: the
    reference of an in-process resume from a checkpoint with restarted clients."""

    keeps_client_states = False

    def __init__(self, algorithm: Any, data: Any, factory: Any, seed: int, _: Any) -> None:
        super().__init__(algorithm, data, factory, seed, ClientStore())


class _Peek(LocalTransport):
    """In process; records how many client states its store holds when the first round sends."""

    held: ClassVar[list[int]] = []

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        _Peek.held.append(len(self.store))
        return super().send(rnd, messages)


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(None, [*TINY, f"output_dir={out}", *extra])


def _run(cfg: Config, method: str, engine: str, **kwargs: Any) -> dict[str, Any] | None:
    """``method`` on ``engine`` ("deploy", "sim", "local", or "restarted": :class:`_Restarted`;
    "peek": :class:`_Peek`)."""
    folder = run_dir(cfg, method, SEED)
    states = folder / node_states.FOLDER
    if engine in ("local", "restarted", "peek"):
        make = {"local": None, "restarted": _Restarted, "peek": _Peek}[engine]
        return run_one(cfg, method, SEED, make_transport=make, **kwargs)
    sim = engine == "sim"
    if sim and kwargs.get("resume"):
        node_states.restore_clients(folder, states, method, SEED)
    _, client = make_apps(cfg, method, SEED, state_dir=states if sim else None)
    nodes = _Nodes(client, cfg.num_clients, keeps=sim)
    return run_one(cfg, method, SEED, make_transport=lambda *_: nodes, **kwargs)


def _rows(cfg: Config, method: str) -> list[dict[str, Any]]:
    path = run_dir(cfg, method, SEED) / "metrics.jsonl"
    return [
        {k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
        for line in path.read_text().splitlines()
    ]


def _same(a: Config, b: Config, method: str) -> bool:
    ma = Checkpointer.load(run_dir(a, method, SEED) / "checkpoint.pt")[1].arrays
    mb = Checkpointer.load(run_dir(b, method, SEED) / "checkpoint.pt")[1].arrays
    return _rows(a, method) == _rows(b, method) and all(torch.equal(ma[k], mb[k]) for k in ma)


def _copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)


def _resume(cfg: Config, method: str, engine: str) -> list[str]:
    """Resume (to the end, checkpoint kept: ``checkpoint=true`` writes it each round) on
    ``engine``; the ClientsRestartedWarning lines it gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _run(cfg, method, engine, resume=True) is not None
    return [str(w.message) for w in seen if issubclass(w.category, ClientsRestartedWarning)]


def test_a_deployment_resumed_in_process_loses_no_round(tmp_path: Path) -> None:
    """The newcomer's case: a deployed FedLore run (all 3 clients each round) whose SuperLink
    died after round 2, resumed in process (``fedlore run --resume``: the deployment's config
    reads ``engine: local``). No client is rejected, one line says the clients restart, and the
    result is the in-process run from that checkpoint with restarted clients, bit for bit."""
    method = "fedlore"
    cfg = _cfg(tmp_path / "a", "participation=1.0")
    assert _run(cfg, method, "deploy", stop_after=2) is None
    ckpt = run_dir(cfg, method, SEED) / "checkpoint.pt"
    assert client_holder.recorded_in(ckpt, tmp_path) == client_holder.NODES
    _copy(tmp_path / "a", tmp_path / "ref")
    said = _resume(cfg, method, "local")
    assert len(said) == 1 and "on a Flower deployment's nodes" in said[0], said
    rows = _rows(cfg, method)
    assert rows[-1]["round"] == 4
    assert all(r.get("rejected", 0) == 0 for r in rows), rows
    assert all(r["accepted"] == 3 for r in rows if r["round"] >= 3)
    ref = _cfg(tmp_path / "ref", "participation=1.0")
    assert _resume(ref, method, "restarted") == []  # a deployment's resume: restarted, silent
    assert _same(cfg, ref, method)
    final = Checkpointer.load(ckpt, extra=lambda raw: said.append(raw[client_holder.KEY]))
    assert final[0] == 4 and said[-1] == client_holder.CHECKPOINT  # in process from then on


@pytest.mark.parametrize(
    ("first", "then", "reference"),
    [
        ("deploy", "sim", "deploy"),
        ("sim", "local", "restarted"),
        ("local", "sim", "deploy"),
        ("local", "deploy", "deploy"),
        ("sim", "sim", None),
        ("local", "local", None),
    ],
)
def test_every_change_of_engine_restarts_the_clients_in_one_line(
    tmp_path: Path, first: str, then: str, reference: str | None
) -> None:
    """Each direction, FedLore (a log replay needs the client's cache): a change of where the
    clients' states are kept restarts them, says so once, and rejects no client; its result is
    the same engine's resume of that checkpoint over clients restarted as a deployment's are
    (ClientApp) or as in process (LocalTransport). Same engine: no line, no restart (the
    clients' states as of the checkpoint are there; a deployment's own resume restarts them
    without a line, as before)."""
    method = "fedlore"
    cfg = _cfg(tmp_path / "a")
    assert _run(cfg, method, first, stop_after=1) is None
    _copy(tmp_path / "a", tmp_path / "ref")
    said = _resume(cfg, method, then)
    if first == then:
        assert said == []
    else:  # in process -> deployment too (a deployment's own resume restarts them silently)
        assert len(said) == 1, said
    assert all(r.get("rejected", 0) == 0 for r in _rows(cfg, method))
    if reference is not None:
        ref = _cfg(tmp_path / "ref")
        _resume(ref, method, reference)
        assert _same(cfg, ref, method)


def test_stale_states_of_an_earlier_attempt_are_not_read(tmp_path: Path) -> None:
    """SCAFFOLD (control variates): simulated to round 1, in process to round 3, simulated again.
    The simulation's files of round 1 are not the clients' states as of round 3: they are
    deleted and every client starts without a state, as the same checkpoint resumed over a
    deployment's new nodes gives. The in-process store the middle attempt checkpointed is
    emptied when the clients restart (an in-process resume after a simulated attempt finds no
    state in it)."""
    method = "scaffold"
    cfg = _cfg(tmp_path / "a", "rounds=6")
    states = run_dir(cfg, method, SEED) / node_states.FOLDER
    assert _run(cfg, method, "sim", stop_after=1) is None
    assert any(states.rglob("state.*.pt"))
    with pytest.warns(ClientsRestartedWarning):
        assert _run(cfg, method, "local", resume=True, stop_after=3) is None
    assert any(states.rglob("state.*.pt"))  # the simulation's, of round 1, still there
    _copy(tmp_path / "a", tmp_path / "ref")
    assert len(_resume(cfg, method, "sim")) == 1
    ref = _cfg(tmp_path / "ref", "rounds=6")
    _resume(ref, method, "deploy")
    assert _same(cfg, ref, method)
    cfg2 = _cfg(tmp_path / "b", "rounds=6")
    assert _run(cfg2, method, "local", stop_after=1) is None
    assert len(Checkpointer.load(run_dir(cfg2, method, SEED) / "checkpoint.pt")[2]) > 0
    with pytest.warns(ClientsRestartedWarning):
        assert _run(cfg2, method, "sim", resume=True, stop_after=3) is None
    _Peek.held.clear()
    with pytest.warns(ClientsRestartedWarning):
        assert _run(cfg2, method, "peek", resume=True) is not None
    assert _Peek.held[0] == 0, _Peek.held


def test_the_dp_ledger_counts_a_resume_across_engines(tmp_path: Path) -> None:
    """Under DP, a deployment killed between round 2's row and its checkpoint, resumed in
    process: the released round 2 runs again and the ledger counts it (ε of 4 + 1 exchanges),
    as the in-process resume with restarted clients counts it; no client is rejected. (FedLore
    with a sketched basis: its server needs only sums, as DP requires.)"""
    method = "fedlore_sketch"
    dp = ("participation=1.0", "weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1")
    cfg = _cfg(tmp_path / "a", *dp)
    ckpt = run_dir(cfg, method, SEED) / "checkpoint.pt"
    assert _run(cfg, method, "deploy", stop_after=1) is None
    round1 = ckpt.read_bytes()
    assert _run(cfg, method, "deploy", resume=True, stop_after=2) is None
    ckpt.write_bytes(round1)  # killed after round 2's row, before its checkpoint
    _copy(tmp_path / "a", tmp_path / "ref")
    assert len(_resume(cfg, method, "local")) == 1
    ref = _cfg(tmp_path / "ref", *dp)
    _resume(ref, method, "restarted")
    got = json.loads((run_dir(cfg, method, SEED) / "summary.json").read_text())
    want = json.loads((run_dir(ref, method, SEED) / "summary.json").read_text())
    assert got["dp_repeated_exchanges"] == want["dp_repeated_exchanges"] == 1
    assert got["dp_epsilon"] == want["dp_epsilon"]
    assert all(r.get("rejected", 0) == 0 for r in _rows(cfg, method))


def test_a_checkpoint_written_before_the_holder_was_recorded(tmp_path: Path) -> None:
    """Older checkpoints name no holder: a Flower transport's entry with states in
    ``clients/`` is a simulation's, without them a deployment's; no such entry, in process."""
    states = tmp_path / "clients"
    flower = {"transport": {"wire_bytes_up": 0}}
    assert client_holder.recorded({}, states) == client_holder.CHECKPOINT
    assert client_holder.recorded(flower, states) == client_holder.NODES
    (states / "0").mkdir(parents=True)
    assert client_holder.recorded(flower, states) == client_holder.NODES  # no file
    (states / "0" / "state.1.pt").write_bytes(b"")
    assert client_holder.recorded(flower, states) == client_holder.NODE_FILES
    assert client_holder.recorded({client_holder.KEY: "nodes"}, states) == client_holder.NODES
    assert client_holder.recorded({client_holder.KEY: "?"}, tmp_path) == client_holder.CHECKPOINT
    assert client_holder.restarts(client_holder.NODES, client_holder.NODES)
    assert not client_holder.restarts(client_holder.NODE_FILES, client_holder.NODE_FILES)
    assert not client_holder.restarts(client_holder.CHECKPOINT, client_holder.CHECKPOINT)


FEDBUFF = ("asynchronous.buffer=2", "clients.speed=lognormal", "clients.speed_spread=1.0")


@pytest.mark.parametrize("buffered", [False, True], ids=["sync", "fedbuff"])
@pytest.mark.parametrize(
    ("method", "first", "then"),
    [
        ("fedavg", "deploy", "local"),
        ("fedprox", "sim", "local"),
        ("fedfull", "local", "sim"),
        ("fedavg", "local", "deploy"),
    ],
)
def test_clients_that_keep_nothing_resume_anywhere_silently_and_exactly(
    tmp_path: Path, method: str, first: str, then: str, buffered: bool
) -> None:
    """Methods whose clients keep no state (every row's ``client_state_bytes`` 0, no server
    record of what they hold): a resume on another engine, synchronous or under FedBuff on the
    simulated clock (its in-flight clients in the checkpoint), loses nothing, so it says
    nothing and gives the uninterrupted in-process run's rows and model, bit for bit."""
    extra = ("participation=1.0", *(FEDBUFF if buffered else ()))
    cfg = _cfg(tmp_path / "a", *extra)
    assert _run(cfg, method, first, stop_after=2) is None
    assert all(r["client_state_bytes"] == 0 for r in _rows(cfg, method))
    assert _resume(cfg, method, then) == []
    assert all(r.get("rejected", 0) == 0 for r in _rows(cfg, method))
    whole = _cfg(tmp_path / "whole", *extra)
    assert _run(whole, method, "local") is not None
    assert _same(cfg, whole, method)


def test_restarted_clients_that_kept_a_state_are_still_named(tmp_path: Path) -> None:
    """The line stays where the restart loses something the server cannot see: FedProx (no
    server record of its clients) whose rows report a client state (a row of another run's
    making here, ``client_state_bytes`` 8), or whose rows lack the count (as under secure
    aggregation or DP)."""
    method = "fedprox"
    key = "client_state_bytes"
    edits = [lambda r: {**r, key: 8}, lambda r: {k: v for k, v in r.items() if k != key}]
    for n, edit in enumerate(edits):
        cfg = _cfg(tmp_path / str(n), "participation=1.0")
        assert _run(cfg, method, "deploy", stop_after=1) is None
        path = run_dir(cfg, method, SEED) / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps(r) + "\n" for r in [edit(rows[0]), *rows[1:]]))
        assert len(_resume(cfg, method, "local")) == 1


def test_held_nothing_reads_the_rows_and_the_server_record(tmp_path: Path) -> None:
    """:func:`~fedlore.engine.client_holder.held_nothing`: all rows 0 and an unchanged server
    record; a positive count, a missing count, a torn line, no rows or no file, or a server
    record the restart changes (a value, an array's key or its contents): not."""
    from fedlore.types import State

    rows = tmp_path / "metrics.jsonl"
    a = State({"w": torch.zeros(2)}, {"v": 1})
    held = client_holder.held_nothing
    assert not held(rows, a, a)  # no file
    for text, want in [
        ('{"client_state_bytes": 0}\n{"client_state_bytes": 0}\n', True),
        ('{"client_state_bytes": 0}\n{"client_state_bytes": 4}\n', False),
        ('{"client_state_bytes": 0}\n{"round": 1}\n', False),
        ('{"client_state_bytes": 0}\n{"client_st', False),
        ("", False),
    ]:
        rows.write_text(text)
        assert held(rows, a, a) is want, text
    rows.write_text('{"client_state_bytes": 0}\n')
    assert not held(rows, a, State({"w": torch.zeros(2)}, {}))
    assert not held(rows, a, State({"x": torch.zeros(2)}, {"v": 1}))
    assert not held(rows, a, State({"w": torch.ones(2)}, {"v": 1}))
    assert held(rows, a, State({"w": torch.zeros(2)}, {"v": 1}))
