"""A deployment whose SuperNodes keep their clients' states on their own disks
(``flower.node_states``, :mod:`fedlore.flower.node_files`), killed and resumed with it, gives
the uninterrupted run bit for bit.

Played in process, without Ray or a SuperLink: the real :class:`FlowerTransport` (its
broadcasts, checkpoint entry and restore) whose ``send`` calls the deployment's ClientApp over
one ``Context`` per node, new for every attempt (a new ``flwr run``), each node given its own
``state-dir`` in its node config. A kill during round k + 1 is played by running that round
(and more) and then putting back the checkpoint of round k: the nodes wrote states of rounds
the resume discards, and the attempt that wrote them left no checkpoint of its own.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
import torch
from app_helpers import node_context, train_message
from flwr.app import Context

from fedlore.config import Config, ConfigError, load_config
from fedlore.engine import client_holder
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.client_holder import ClientsRestartedWarning
from fedlore.engine.node_states import NodeStateError
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.flower import node_files
from fedlore.flower.app import make_apps
from fedlore.flower.transport import FlowerTransport
from fedlore.types import Broadcast, Reply, Scalar, State

pytestmark = pytest.mark.flower

SEED = 42
TINY = [
    "num_clients=4",
    "rounds=6",
    "local_steps=2",
    "batch_size=16",
    "lr=0.01",
    "rank=4",
    "model.kwargs={hidden: [16]}",
    "progress=false",
]


class _NoGrid:
    """A grid with no nodes: the transport's sends are played by :class:`_Deployed`."""

    def get_node_ids(self) -> list[int]:
        return []


class _Deployed(FlowerTransport):
    """:class:`FlowerTransport` whose ``send`` calls the ClientApp here, one ``Context`` per
    node (new per attempt: a new ``flwr run``'s), replies decoded by the transport's own
    ``decode``."""

    def __init__(self, client: Any, cfg: Config, disks: Path | None) -> None:
        grid: Any = _NoGrid()
        super().__init__(grid, wait_for_nodes=0.0, node_files=cfg.flower.node_states)
        self.client = client
        self.raised: dict[int, BaseException] = {}
        self.ctx: dict[int, Context] = {}
        for c in range(cfg.num_clients):
            conf: dict[str, Any] = {}
            if disks is not None:
                conf[node_files.NODE_KEY] = str(disks / f"node{c}")
            self.ctx[c] = node_context(c, **conf)

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out: dict[int, Reply | BaseException] = {}
        for cid, b in messages.items():
            msg = train_message(rnd, cid, self.outgoing(rnd, b, cid))
            try:
                out[cid] = self.decode(cid, self.client(msg, self.ctx[cid]))
            except Exception as e:  # a client's refusal comes back as its error, as on Flower
                self.raised[cid] = e
                out[cid] = e
        return out


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(None, [*TINY, f"output_dir={out}", "flower.node_states=true", *extra])


def _run(
    cfg: Config, method: str, disks: Path | None, same: _Deployed | None = None, **kwargs: Any
) -> _Deployed:
    """One attempt (a new ``flwr run``) of ``method``; its transport. ``same``: an earlier
    attempt whose nodes' ``Context`` objects this one keeps (a node that held on to them)."""
    _, client = make_apps(cfg, method, SEED)
    transport = _Deployed(client, cfg, disks)
    if same is not None:
        transport.ctx = same.ctx
    run_one(cfg, method, SEED, make_transport=lambda *_: transport, **kwargs)
    return transport


def _rows(cfg: Config, method: str) -> list[dict[str, Any]]:
    path = run_dir(cfg, method, SEED) / "metrics.jsonl"
    return [
        {k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
        for line in path.read_text().splitlines()
    ]


def _final(cfg: Config, method: str) -> dict[str, torch.Tensor]:
    return Checkpointer.load(run_dir(cfg, method, SEED) / "checkpoint.pt")[1].arrays


def _same(a: Config, b: Config, method: str) -> bool:
    ma, mb = _final(a, method), _final(b, method)
    return _rows(a, method) == _rows(b, method) and all(torch.equal(ma[k], mb[k]) for k in ma)


class _Keep:
    """Keeps the checkpoint's bytes as of round ``rnd`` (called after the run's Checkpointer)."""

    def __init__(self, path: Path, rnd: int) -> None:
        self.path, self.rnd, self.kept = path, rnd, path.read_bytes()

    def on_round_end(self, rnd: int, row: Any, state: State) -> None:
        if rnd == self.rnd:
            self.kept = self.path.read_bytes()


def _killed_during(cfg: Config, method: str, disks: Path, r: int, **kwargs: Any) -> _Deployed:
    """Resume and run through round ``r``, then put back the checkpoint of round ``r - 1``: an
    attempt killed during round ``r`` (its nodes wrote that round's states; the attempt left
    no checkpoint of its own when it resumed from round ``r - 1``); its transport."""
    ckpt = run_dir(cfg, method, SEED) / "checkpoint.pt"
    keep = _Keep(ckpt, r - 1)
    got = _run(cfg, method, disks, resume=True, stop_after=r, extra_callbacks=(keep,), **kwargs)
    ckpt.write_bytes(keep.kept)
    return got


def _files(disks: Path) -> list[Path]:
    return sorted(disks.rglob("state.*.pt"))


@pytest.mark.parametrize("method", ["fedlore", "scaffold", "ditto"])
def test_a_killed_deployment_resumes_bit_for_bit(tmp_path: Path, method: str) -> None:
    """Four attempts: to round 1; killed during round 3 (round 2 kept); killed during round 4
    (round 3 kept); to the end. Each kill came after the nodes wrote the round's states.
    Resumed as a deployment with node_states: no line, no rejected client, and the
    uninterrupted deployment's rows and final model, bit for bit (3 of 4 clients a round: a
    client's state may be from any earlier attempt)."""
    extra = ("participation=0.75",)
    whole = _cfg(tmp_path / "whole", *extra)
    _run(whole, method, tmp_path / "disks-whole")
    cfg = _cfg(tmp_path / "a", *extra)
    disks = tmp_path / "disks"
    _run(cfg, method, disks, stop_after=1)
    ckpt = run_dir(cfg, method, SEED) / "checkpoint.pt"
    assert client_holder.recorded_in(ckpt, tmp_path) == client_holder.NODE_DISKS
    _killed_during(cfg, method, disks, 3)
    _killed_during(cfg, method, disks, 4)
    assert len(torch.load(ckpt, weights_only=True)["transport"]["node_files"]["attempts"]) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", ClientsRestartedWarning)
        last = _run(cfg, method, disks, resume=True)
    assert not last.raised, last.raised
    assert all(r.get("rejected", 0) == 0 for r in _rows(cfg, method))
    assert _same(cfg, whole, method)
    # at most three states per client (module docstring of fedlore.flower.node_files)
    per_client = {p.parent for p in _files(disks)}
    assert len(_files(disks)) <= 3 * len(per_client), _files(disks)


def test_an_attempt_killed_before_its_first_checkpoint_is_ignored(tmp_path: Path) -> None:
    """The trap: attempt 2 resumes from round 1 and trains rounds 2-4 on some clients, then
    dies before any checkpoint of its own is kept (played by putting round 1's back); attempt
    3 resumes from round 1 again. A
    client attempt 2 trained in round 3 or 4 and attempt 3 has not contacted since holds
    attempt 2's files, newer than its state as of round 1: it must read the older one. The
    result is the uninterrupted run's, bit for bit (SCAFFOLD: the control variates count)."""
    method = "scaffold"
    extra = ("participation=0.5",)
    whole = _cfg(tmp_path / "whole", *extra)
    _run(whole, method, tmp_path / "disks-whole")
    cfg = _cfg(tmp_path / "a", *extra)
    disks = tmp_path / "disks"
    first = _run(cfg, method, disks, stop_after=1)
    ckpt = run_dir(cfg, method, SEED) / "checkpoint.pt"
    kept = ckpt.read_bytes()
    second = _run(cfg, method, disks, resume=True, stop_after=4)
    ckpt.write_bytes(kept)  # killed during round 5, its checkpoints lost (another disk)
    tokens = {p.name.split(".")[2] for p in _files(disks)}
    assert tokens == {first.attempts.token, second.attempts.token}
    stale = {p for p in _files(disks) if p.name.split(".")[2] == second.attempts.token}
    assert any(int(p.name.split(".")[1]) >= 3 for p in stale)
    # its nodes kept their Context objects: attempt 2's states there are not read either
    last = _run(cfg, method, disks, same=second, resume=True)
    assert not last.raised, last.raised
    assert _same(cfg, whole, method)


def test_each_rule_on_its_own(tmp_path: Path) -> None:
    """:func:`~fedlore.flower.node_files.valid`, the attempts a checkpoint keeps, and a
    node's pruning after a save: the new file, the newest valid one of an earlier round and
    the newest of the earlier attempts stay; invalid ones (an unknown attempt, a round past
    its attempt's end) and a killed write's ``.tmp`` go."""
    history: node_files.History = [("a", 3), ("b", 5), ("c", None)]
    assert node_files.valid("a", 3, history) and not node_files.valid("a", 4, history)
    assert node_files.valid("c", 9, history) and not node_files.valid("x", 0, history)
    assert node_files.valid("b", 5, history) and not node_files.valid("b", 6, history)
    att = node_files.Attempts()
    att.restore({"attempts": [["a", 3]], "held": [1]})
    assert att.entry() == {"attempts": [["a", 3]], "held": [1]}  # this one sent nothing yet
    att.config(0, {"round": 4})
    att.config(2, {"round": 5})
    assert att.entry() == {"attempts": [["a", 3], [att.token, 5]], "held": [1]}
    assert json.loads(str(att.config(1, {"round": 6})[node_files.HISTORY]))[-1] == [att.token, None]
    assert (
        att.config(1, {"round": 6})[node_files.HELD]
        and not att.config(0, {"round": 6})[node_files.HELD]
    )
    att.restore(None)
    assert att.entry()["attempts"] == [[att.token, 6]] and att.entry()["held"] == []
    # pruning on a node
    ctx = node_context(0, **{node_files.NODE_KEY: str(tmp_path)})
    where = tmp_path / "a" / "0"
    where.mkdir(parents=True)
    for name in ["state.2.a.pt", "state.3.a.pt", "state.4.a.pt", "state.4.b.pt", "state.6.b.pt",
                 "state.3.f.pt", "state.6.c.pt.tmp", "state.5.c.pt"]:  # fmt: skip
        (where / name).write_bytes(b"")
    conf = {"round": 7, node_files.HISTORY: json.dumps([["a", 3], ["b", 5], ["c", None]])}
    node_files.keep_state(ctx, conf, 0, State({"w": torch.ones(1)}, {}), "m", 1, None)
    # kept: the new one, the newest before it (this attempt's round 5), the newest of the
    # earlier attempts (the state as of the checkpoint this attempt resumed from)
    assert sorted(p.name for p in where.iterdir()) == [
        "state.4.b.pt", "state.5.c.pt", "state.7.c.pt"
    ]  # fmt: skip


def test_a_wiped_node_and_a_damaged_file_say_so(tmp_path: Path) -> None:
    """A node whose files are gone, though the server knows its client kept a state, refuses
    in one line naming its folder (the round goes on without it); a damaged file is named."""
    method = "fedlore"
    cfg = _cfg(tmp_path / "a", "participation=1.0")
    disks = tmp_path / "disks"
    _run(cfg, method, disks, stop_after=1)
    for p in (disks / "node1").rglob("state.*.pt"):
        p.unlink()
    newest = max((disks / "node2").rglob("state.*.pt"), key=lambda p: int(p.name.split(".")[1]))
    newest.write_bytes(b"torn")
    last = _run(cfg, method, disks, resume=True, stop_after=2)
    assert set(last.raised) == {1, 2}, last.raised
    wiped, torn = (str(last.raised[c]) for c in (1, 2))
    assert isinstance(last.raised[1], NodeStateError) and "\n" not in wiped
    assert "holds none of this run's" in wiped and str(disks / "node1") in wiped
    assert "is damaged" in torn and str(disks / "node2") in torn and "\n" not in torn
    # another client's file where client 0's newest lies (copied from another node's disk)
    theirs = sorted((disks / "node3").rglob("state.*.pt"))
    ours = max((disks / "node0").rglob("state.*.pt"), key=lambda p: int(p.name.split(".")[1]))
    assert ours.name == theirs[-1].name  # both trained in round 2 of attempt 2
    ours.write_bytes(theirs[-1].read_bytes())
    last = _run(cfg, method, disks, resume=True, stop_after=3)
    foreign = str(last.raised[0])
    assert "is not this run's" in foreign and "client 3" in foreign and "\n" not in foreign


def test_a_node_without_state_dir_refuses_in_one_line(tmp_path: Path) -> None:
    """flower.node_states on, a SuperNode started without ``state-dir``: its reply is one
    line naming the key and how to start the node."""
    cfg = _cfg(tmp_path / "a", "participation=1.0")
    got = _run(cfg, "fedavg", None, stop_after=0)
    assert set(got.raised) == set(range(cfg.num_clients))
    said = str(got.raised[0])
    assert "\n" not in said and "state-dir" in said and "--node-config" in said


def test_without_node_states_a_resume_restarts_the_clients(tmp_path: Path) -> None:
    """Off (the default): a deployment writes no files, its checkpoint names ``nodes`` and a
    resume restarts the clients, as before. A deployment with node_states resumed without it,
    or the other way round, restarts them too, with one line."""
    method = "fedlore"
    cfg = _cfg(tmp_path / "a", "flower.node_states=false")
    disks = tmp_path / "disks"
    _run(cfg, method, disks, stop_after=1)
    assert _files(disks) == []
    ckpt = run_dir(cfg, method, SEED) / "checkpoint.pt"
    assert client_holder.recorded_in(ckpt, tmp_path) == client_holder.NODES
    assert "node_files" not in torch.load(ckpt, weights_only=True)["transport"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _run(cfg, method, disks, resume=True, stop_after=2)  # nodes -> nodes: silent restart
        assert not [w for w in seen if issubclass(w.category, ClientsRestartedWarning)]
    on = _cfg(tmp_path / "a")  # node_states on now: nodes -> node-disks, one line
    with pytest.warns(ClientsRestartedWarning, match="on a Flower deployment's nodes"):
        _run(on, method, disks, resume=True, stop_after=3)
    assert _files(disks)
    with pytest.warns(ClientsRestartedWarning, match="disks"):  # node-disks -> nodes
        _run(cfg, method, disks, resume=True, stop_after=4)


def test_the_holder_of_a_deployment_with_node_states() -> None:
    """``node-disks`` resumed as ``node-disks`` keeps the clients; every other pair with it
    restarts them."""
    disks, others = client_holder.NODE_DISKS, [
        client_holder.NODES, client_holder.NODE_FILES, client_holder.CHECKPOINT
    ]  # fmt: skip
    assert not client_holder.restarts(disks, disks)
    assert all(
        client_holder.restarts(disks, o) and client_holder.restarts(o, disks) for o in others
    )
    assert client_holder.recorded({client_holder.KEY: disks}, Path("/nonexistent")) == disks


def test_wall_clock_fedbuff_is_refused_with_node_states(tmp_path: Path) -> None:
    """FedBuff on the wall clock cannot roll its nodes back: refused before it trains."""
    from fedlore.checks.asynchronous import check_deployed

    cfg = _cfg(tmp_path, "asynchronous.buffer=2", "asynchronous.clock=wall")
    with pytest.raises(ConfigError, match=r"flower\.node_states with asynchronous\.clock: wall"):
        check_deployed(cfg)
    check_deployed(_cfg(tmp_path, "asynchronous.buffer=2", "flower.node_states=false",
                        "asynchronous.clock=wall"))  # fmt: skip


def test_fedbuff_on_the_simulated_clock_resumes_bit_for_bit(tmp_path: Path) -> None:
    """FedBuff (simulated clock: clients in flight in the checkpoint, repeated starts from one
    version, FedBuff's own key), killed during round 3 and resumed: the uninterrupted run.
    (FedBuff runs the FedAvg family, whose clients keep empty states: the nodes' files and
    the broadcasts' attempts must change nothing.)"""
    method = "fedprox"
    extra = ("asynchronous.buffer=2", "clients.speed=lognormal", "clients.speed_spread=1.0")
    whole = _cfg(tmp_path / "whole", *extra)
    _run(whole, method, tmp_path / "disks-whole")
    cfg = _cfg(tmp_path / "a", *extra)
    disks = tmp_path / "disks"
    _run(cfg, method, disks, stop_after=2)
    _killed_during(cfg, method, disks, 3)
    assert _files(disks)
    last = _run(cfg, method, disks, resume=True)
    assert not last.raised, last.raised
    assert _same(cfg, whole, method)


def test_secure_aggregation_resumes_with_the_nodes_states(
    tmp_path: Path, task_identity: None
) -> None:
    """SCAFFOLD under SecAgg+ (flwr's workflow on a Grid that calls the ClientApps here, the
    real transport's secure rounds): the broadcasts of the collect stage carry the attempts,
    the nodes keep their control variates on disk, and a run killed during round 2 and
    resumed ends where the uninterrupted one ends, within SecAgg+'s quantization (its
    stochastic rounding differs from run to run); the same resume over restarted clients
    (node_states off) ends elsewhere."""
    from test_secagg import DirectGrid

    from fedlore.flower.secure import secagg_settings

    method = "scaffold"
    extra = ("secure_aggregation=true", "num_clients=3", "rounds=4", "lr=0.1",
             "model.kwargs={hidden: [8]}")  # fmt: skip

    def run(cfg: Config, disks: Path, **kwargs: Any) -> list[str]:
        _, client = make_apps(cfg, method, SEED)
        grid = DirectGrid(client, cfg.num_clients)
        for node, ctx in grid.ctx.items():
            ctx.node_config[node_files.NODE_KEY] = str(disks / f"node{node}")

        def make(_algo: Any, data: Any, *_: Any) -> FlowerTransport:
            return FlowerTransport(grid, wait_for_nodes=0.0, expected_nodes=0,
                                   secagg=secagg_settings(cfg, method, data),
                                   node_files=cfg.flower.node_states)  # fmt: skip

        run_one(cfg, method, SEED, make_transport=make, **kwargs)
        return [str(m.error.reason) for _, m in grid.seen if m.has_error()]

    whole = _cfg(tmp_path / "whole", *extra)
    assert run(whole, tmp_path / "dw") == []
    finals = {}
    for name, on in [("on", "true"), ("off", "false")]:
        cfg = _cfg(tmp_path / name, *extra, f"flower.node_states={on}")
        disks = tmp_path / f"d{name}"
        assert run(cfg, disks, stop_after=1) == []
        ckpt = run_dir(cfg, method, SEED) / "checkpoint.pt"
        kept = ckpt.read_bytes()
        assert run(cfg, disks, resume=True, stop_after=2) == []
        ckpt.write_bytes(kept)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ClientsRestartedWarning)
            assert run(cfg, disks, resume=True) == []
        assert all(r["accepted"] == 3 and r["secagg_aborted"] == 0 for r in _rows(cfg, method))
        assert bool(_files(disks)) == (on == "true")
        if on == "true":  # the clients whose masked vectors arrived kept a state
            entry = torch.load(run_dir(cfg, method, SEED) / "checkpoint.pt", weights_only=True)
            assert entry["transport"]["node_files"]["held"] == [0, 1, 2]
        finals[name] = _final(cfg, method)
    want = _final(whole, method)
    gap = {n: max(float((f[k] - want[k]).abs().max()) for k in want) for n, f in finals.items()}
    assert gap["on"] <= 1e-5 < 100 * gap["on"] <= gap["off"], gap


def test_the_deployed_server_app_passes_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``flwr run``'s ServerApp gives its transport ``flower.node_states``."""
    from flwr.app import RecordDict as Records

    from fedlore.flower import app

    seen: list[bool] = []
    monkeypatch.setattr(app, "server_main", lambda *_, **kw: seen.append(kw["node_files"]))
    for on in ("true", "false"):
        conf: dict[str, Scalar] = {"overrides": f"flower.node_states={on} progress=false"}
        ctx = Context(run_id=1, node_id=0, node_config={}, state=Records(), run_config=conf)
        app._deployed_main(object(), ctx)  # type: ignore[arg-type]
    assert seen == [True, False]
