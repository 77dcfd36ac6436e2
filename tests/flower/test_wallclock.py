"""FedBuff on the wall clock (``asynchronous.clock: wall``, :mod:`fedlore.flower.wallclock`) over
a grid whose SuperNodes answer in an order the test sets: fedlore's ClientApp handlers in this
process, a reply available only after a node's ``lag`` pulls, a dead node that never answers.
No Ray: the Simulation Engine's run is ``test_simulation_fedbuff.py``'s."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
from flwr.app import Context, Message, RecordDict

from fedlore.config import Config, load_config
from fedlore.device import resolve_device
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.flower.app import _federation, client_query, client_train
from fedlore.flower.codec import record_to_broadcast
from fedlore.flower.transport import TRAIN_ROUND
from fedlore.flower.wallclock import WallClockTransport

pytestmark = pytest.mark.flower

BASE = ["num_clients=3", "local_steps=2", "batch_size=16", "progress=false", "lr=0.05",
        "model.kwargs={hidden: [16]}", "algorithms=[fedavg]", "asynchronous.buffer=2",
        "asynchronous.clock=wall"]  # fmt: skip
MAX_PULLS = 3000
"""A run that stalls (a flight nothing ends) fails the test instead of hanging it."""


class _Grid:
    """SuperNodes 100 + i holding client i: a ``train`` reply is computed by fedlore's ClientApp
    handler when pushed and handed out once the node's ``lag`` pulls have passed; ``dead`` nodes
    answer no ``train`` message, and queries only while ``revives`` (else only the first, the
    transport's at its start: the node died after it)."""

    pull_interval = 0.005

    def __init__(self, cfg: Config, lag: dict[int, int], dead: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.cfg, self.lag, self.dead = cfg, lag, set(dead)
        self.contexts = {
            100 + c: Context(
                run_id=1,
                node_id=100 + c,
                node_config={"partition-id": c},
                state=RecordDict(),
                run_config={},
            )
            for c in range(cfg.num_clients)
        }
        # the central federation each node takes its partition of, built before any flight
        # starts (once per process; the first train message would spend seconds on it)
        _federation(cfg.model_dump_json(), 42, str(resolve_device(cfg.device)))
        self.waiting: dict[str, tuple[int, Message]] = {}  # message id -> (pulls left, reply)
        self.pushed: list[tuple[int, int, int]] = []  # (client, broadcast round, train round)
        self.delivered: list[tuple[int, int]] = []  # (client, broadcast round), in order
        self.pulls = 0
        self.asked: list[int] = []  # the clients whose node was queried
        self.revives = True  # a dead node answers queries (else only the first)
        self.query_lag = 0  # pulls before a query after the first is answered
        self.lose_first: set[int] = set()  # clients whose first train message gets no reply
        self.delay_s = 0.0  # seconds before a train reply can be pulled
        self.ready: dict[str, float] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = mid = str(uuid.uuid4())
            node = msg.metadata.dst_node_id
            ids.append(mid)
            ctx = self.contexts[node]
            if msg.metadata.message_type == "query":
                self.asked.append(node - 100)
                first = self.asked.count(node - 100) == 1
                if node - 100 not in self.dead or self.revives or first:
                    lag = 0 if first else self.query_lag
                    self.waiting[mid] = (lag, client_query(msg, ctx))
                continue
            config = record_to_broadcast(msg.content).config
            rnd = int(config["round"])
            self.pushed.append((node - 100, rnd, int(config.get(TRAIN_ROUND, rnd))))
            if node - 100 in self.dead:
                continue
            if node - 100 in self.lose_first:
                self.lose_first.discard(node - 100)
                continue
            reply = client_train(msg, ctx, self.cfg, "fedavg", 42, threads=1)
            reply.metadata.__dict__["_fedlore_round"] = rnd
            self.waiting[mid] = (self.lag.get(node - 100, 0), reply)
            self.ready[mid] = time.monotonic() + self.delay_s
        return ids

    def pull_messages(self, ids: Iterable[str]) -> list[Message]:
        self.pulls += 1
        assert self.pulls < MAX_PULLS, "the run stalled"
        out = []
        for mid in list(ids):
            if mid not in self.waiting:
                continue
            left, reply = self.waiting[mid]
            if time.monotonic() < self.ready.get(mid, 0.0):
                continue
            if left > 0:
                self.waiting[mid] = (left - 1, reply)
                continue
            del self.waiting[mid]
            out.append(reply)
            if reply.metadata.message_type == "train":
                src = reply.metadata.src_node_id - 100
                self.delivered.append((src, reply.metadata.__dict__["_fedlore_round"]))
        return out


def _run(tmp: Path, grid_of: Any, *extra: str) -> tuple[_Grid, list[dict[str, Any]]]:
    import json

    cfg = load_config(None, [*BASE, f"output_dir={tmp}", *extra])
    grid = grid_of(cfg)

    def transport(*_: Any) -> WallClockTransport:
        return WallClockTransport(grid, round_timeout=0.5, expected_nodes=0, wait_for_nodes=0)

    run_one(cfg, "fedavg", 42, make_transport=transport)
    path = run_dir(cfg, "fedavg", 42) / "metrics.jsonl"
    return grid, [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module", autouse=True)
def warm(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One step first: a process's first training (torch's first backward pass, the data) takes
    longer than the flights of the timing tests may."""
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        _run(tmp_path_factory.mktemp("warm"), lambda cfg: _Grid(cfg, lag={}), "rounds=1")
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = old


def test_arrivals_fill_the_buffer_in_order_stale_from_their_start_version(
    tmp_path: Path, task_identity: None
) -> None:
    """Client 2 answers after four pulls, 0 and 1 at once: the buffer takes replies as they
    come, each weighted by the steps taken since the version it started from (read from the
    broadcast it received), and replacements start from the version current when they start."""
    grid, rows = _run(tmp_path, lambda cfg: _Grid(cfg, lag={2: 4}), "rounds=5")
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    arrived = [
        (c, s, r["round"])
        for r in rows
        for c, s in zip(r["accepted_clients"], r["staleness"], strict=True)
    ]
    assert [c for c, _, _ in arrived] == [c for c, _ in grid.delivered[: len(arrived)]]
    for (cid, stale, step), (_, started) in zip(arrived, grid.delivered, strict=False):
        assert stale == step - started, (cid, stale, step, started)
    assert any(c == 2 and s > 0 for c, s, _ in arrived)  # the slow client's update was stale
    versions = [rnd for _, rnd, _ in grid.pushed]
    assert versions == sorted(versions) and versions[-1] == 4  # started from the newest model
    repeats = [(c, rnd, t) for c, rnd, t in grid.pushed if t != rnd]
    assert repeats  # a client started twice from one version draws another generator
    clock = [r["elapsed_s"] for r in rows]
    assert clock == sorted(clock) and all("sim_time_s" not in r for r in rows)


@pytest.mark.parametrize("revives", [True, False], ids=["answers-queries", "gone"])
def test_a_dead_supernode_frees_its_slot_after_the_flight_timeout(
    tmp_path: Path, task_identity: None, revives: bool
) -> None:
    """Client 2's SuperNode never answers a ``train`` message: its flight ends after
    ``flight_timeout_s``, the row says why, and the run goes on with the clients that answer.
    Its client is unmapped (its node may be gone): started again only once its node answers a
    query at a server step; a node that is gone is not waited for again."""

    def grid_of(cfg: Config) -> _Grid:
        grid = _Grid(cfg, lag={}, dead={2})
        grid.revives = revives
        grid.delay_s = 0.05  # 30 steps last for several flight timeouts
        return grid

    timeout = "asynchronous.flight_timeout_s=0.3"
    grid, rows = _run(tmp_path, grid_of, "rounds=30", "checkpoint=false", timeout)
    assert [r["round"] for r in rows] == list(range(30))
    reasons = [why for r in rows for why in r.get("rejected_reasons", [])]
    assert reasons and all(
        why == "2: no reply within asynchronous.flight_timeout_s=0.3" for why in reasons
    )
    assert all(r["accepted"] == 2 and set(r["accepted_clients"]) <= {0, 1} for r in rows)
    starts = sum(c == 2 for c, _, _ in grid.pushed)
    assert starts > 1 if revives else starts == 1
    if not revives:  # an unanswered query is asked again after its deadline
        assert grid.asked.count(2) > 2


def test_a_run_whose_every_flight_timed_out_waits_for_its_nodes_to_answer_again(
    tmp_path: Path, task_identity: None
) -> None:
    """No reply comes to any client's first start (every node was slow, or restarting): every
    flight times out and every client is unmapped; with no client in flight the server asks
    the nodes who they hold, waits for the answers (which take a few pulls) and goes on."""

    def grid_of(cfg: Config) -> _Grid:
        grid = _Grid(cfg, lag={})
        grid.lose_first, grid.query_lag = {0, 1, 2}, 5
        return grid

    grid, rows = _run(tmp_path, grid_of, "rounds=2", "asynchronous.flight_timeout_s=0.05")
    assert [r["round"] for r in rows] == [0, 1]
    reasons = rows[0]["rejected_reasons"]
    assert sorted(why.split(":")[0] for why in reasons) == ["0", "1", "2"]
    assert rows[0]["accepted"] == rows[1]["accepted"] == 2
    assert sorted(grid.asked[3:6]) == [0, 1, 2]  # asked again once all had timed out


def _client_two_always_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every upload of client 2 is rejected (as an update the server's checks refuse would be)."""
    from fedlore.flower.wallclock import WallClockLoop

    honest = WallClockLoop._arrive

    def arrive(self: WallClockLoop, f: Any, state: Any, rnd: int) -> Any:
        item, why, sent = honest(self, f, state, rnd)
        return (None, "refused by the test", sent) if f.cid == 2 else (item, why, sent)

    monkeypatch.setattr(WallClockLoop, "_arrive", arrive)


def test_rejections_in_a_row_end_a_wall_clock_run_and_an_accepted_upload_resets_them(
    tmp_path: Path, task_identity: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client 2 answers at once and is always rejected; clients 0 and 1 answer after a lag of
    pulls. With lags of 20 and 40 pulls, about 20 rejections come between accepted uploads: more
    than the limit of 10 per client in flight (30) in the step, never 30 in a row, and the step
    fills. With both lagging 60 pulls, 30 rejections come in a row and the run ends in one line
    naming the last reason (it looped until the grid's pull limit before)."""
    from fedlore.engine.buffered import REJECTED_IN_A_ROW

    _client_two_always_rejected(monkeypatch)
    limit = REJECTED_IN_A_ROW * 3  # asynchronous.concurrency = num_clients = 3
    _, rows = _run(tmp_path / "fills", lambda cfg: _Grid(cfg, lag={0: 20, 1: 40}), "rounds=1")
    assert rows[0]["accepted"] == 2 and rows[0]["rejected"] > limit
    with pytest.raises(ValueError) as e:
        _run(tmp_path / "ends", lambda cfg: _Grid(cfg, lag={0: 60, 1: 60}), "rounds=1")
    assert str(e.value).startswith(
        f"asynchronous.buffer=2: round 0 (counting from 0) rejected {limit} uploads in a row "
        "without filling its buffer (the last, 2: refused by the test)"
    )
