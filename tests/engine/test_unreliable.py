"""Unreliable clients (:mod:`fedlore.engine.unreliable`): dropouts, stragglers past a deadline
(dropped, or sending their partial work with a smaller weight), and availability traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.algorithms.fedavg import FedAvg
from fedlore.config import ConfigError, load_config
from fedlore.data.client_data import ClientData
from fedlore.engine.unreliable import ClientDropped, UnreliableTransport, available_sampler
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.settings import STEP_BUDGET
from fedlore.types import Broadcast, Reply

SMALL = ["num_clients=6", "local_steps=4", "batch_size=16", "progress=false",
         "model.kwargs={hidden: [16]}", "algorithms=[fedavg]"]  # fmt: skip


def _rows(out: Path, method: str = "fedavg", name: str = "experiment") -> list[dict[str, Any]]:
    path = out / name / method / "seed-42" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


class _Echo:
    """A transport whose clients answer at once with the steps they took (their lr count)."""

    def __init__(self, algo: Any, data: Any) -> None:
        self.algo, self.data = algo, data

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out: dict[int, Reply | BaseException] = {}
        for cid in messages:
            steps = len(self.algo.round_lrs(rnd, self.data(cid).num_examples))
            out[cid] = Reply({}, {"num_examples": 10, "steps": steps})
        return out


def _messages(clients: int) -> dict[int, Broadcast]:
    """One (empty) message per client: the transports pass them on unread."""
    return {c: Broadcast({}, {"round": 0}) for c in range(clients)}


def _data(n: int) -> Any:
    from fedlore.data.client_data import TensorSplit

    def data(cid: int) -> ClientData:
        split = TensorSplit(torch.zeros(n, 2), torch.zeros(n, dtype=torch.long))
        return ClientData(cid, split, split)

    return data


def test_dropout_loses_about_p_of_the_replies_the_same_way_every_time() -> None:
    cfg = load_config(None, [*SMALL, "clients.dropout=0.3"])
    algo = FedAvg.of(local_steps=4)
    t = UnreliableTransport(_Echo(algo, _data(40)), cfg, algo, _data(40), 42)
    lost = [
        isinstance(r, ClientDropped)
        for rnd in range(200)
        for r in t.send(rnd, _messages(6)).values()
    ]
    assert sum(lost) / len(lost) == pytest.approx(0.3, abs=0.04)
    again = UnreliableTransport(_Echo(algo, _data(40)), cfg, algo, _data(40), 42)
    round7 = again.send(7, _messages(6)).values()
    assert [isinstance(r, ClientDropped) for r in round7] == lost[42:48]


def test_stragglers_are_dropped_or_send_their_partial_work_with_its_share() -> None:
    """Speeds 1, 0.5, 0.25 per client (a trace); 8 steps of 0.1 s at speed 1 take 0.8 s, so
    with a 1 s deadline client 0 makes it, 1 (1.6 s) and 2 (3.2 s) do not: dropped, or with
    partial work they train floor(1 · speed / 0.1) = 5 and 2 steps, weighted 5/8 and 2/8."""
    algo = FedAvg.of(local_steps=8)
    base = ["num_clients=3", "clients.step_s=0.1", "clients.round_deadline_s=1"]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "speeds.json"
        trace.write_text("[1.0, 0.5, 0.25]")
        drop = load_config(None, [*base, f"clients.speed_trace={trace}"])
        t = UnreliableTransport(_Echo(algo, _data(40)), drop, algo, _data(40), 42)
        got = t.send(0, _messages(3))
        assert isinstance(got[0], Reply) and got[0].metrics["steps"] == 8
        assert isinstance(got[1], ClientDropped) and "straggler" in str(got[1])
        part = load_config(
            None, [*base, f"clients.speed_trace={trace}", "clients.partial_work=true"]
        )
        t = UnreliableTransport(_Echo(algo, _data(40)), part, algo, _data(40), 42)
        got = t.send(0, _messages(3))
    replies = {c: r for c, r in got.items() if isinstance(r, Reply)}
    assert replies.keys() == got.keys()  # with partial work every client answers
    steps = {c: r.metrics["steps"] for c, r in replies.items()}
    shares = {c: r.metrics.get("work_share", 1.0) for c, r in replies.items()}
    assert steps == {0: 8, 1: 5, 2: 2} and shares == {0: 1.0, 1: 5 / 8, 2: 2 / 8}
    # the weights follow the work done: n_i times the share (uniform: the share)
    ordered = [replies[c] for c in range(3)]
    assert algo.weights(ordered) == [10.0, 6.25, 2.5]
    assert FedAvg.of(weighting="uniform").weights(ordered) == [1.0, 5 / 8, 2 / 8]
    # a reply that claims more than its whole round counts as its whole round, never more
    boast = Reply({}, {"num_examples": 10, "work_share": 1e6})
    low = Reply({}, {"num_examples": 10, "work_share": -3.0})
    assert algo.weights([boast, low]) == pytest.approx([10.0, 1e-5])


def test_a_straggler_of_a_method_with_only_local_steps_sends_its_share(tmp_path: Path) -> None:
    """A method of one's own with ``local_steps`` and no ``round_steps``/``round_work`` (not
    derived from Hyper): its stragglers' budgets and shares count its local steps (the same
    trace as above: 5 and 2 of 8 steps)."""

    class Own:
        def local_steps(self, n: int) -> int:
            return 8

        def round_lrs(self, rnd: int, n: int) -> list[float]:
            return [1.0] * (STEP_BUDGET.get() or 8)

    trace = tmp_path / "speeds.json"
    trace.write_text("[1.0, 0.5, 0.25]")
    base = ["num_clients=3", "clients.step_s=0.1", "clients.round_deadline_s=1"]
    cfg = load_config(None, [*base, f"clients.speed_trace={trace}", "clients.partial_work=true"])
    algo = Own()
    t = UnreliableTransport(_Echo(algo, _data(40)), cfg, algo, _data(40), 42)
    got = {c: r for c, r in t.send(0, _messages(3)).items() if isinstance(r, Reply)}
    done = {c: (r.metrics["steps"], r.metrics.get("work_share", 1.0)) for c, r in got.items()}
    assert done == {0: (8, 1.0), 1: (5, 5 / 8), 2: (2, 2 / 8)}


def test_an_availability_trace_limits_who_is_sampled(tmp_path: Path) -> None:
    trace = tmp_path / "avail.json"
    trace.write_text("[[0, 1, 2], [3, 4], [5]]")
    cfg = load_config(
        None, ["num_clients=6", "participation=0.34", f"clients.availability={trace}"]
    )
    sample = available_sampler(cfg, 42)
    assert sample is not None
    for rnd in range(9):
        pool = [[0, 1, 2], [3, 4], [5]][rnd % 3]
        got = sample(rnd)
        assert set(got) <= set(pool) and len(got) == min(2, len(pool))
    trace.write_text("[[0, 9]]")
    with pytest.raises(ConfigError, match=r"client ids in 0\.\.5"):
        available_sampler(cfg, 42)


def test_runs_go_on_through_dropouts_and_record_why(tmp_path: Path) -> None:
    """FedAvg and FedLore (whose returning clients catch up from the log) finish 6 rounds with
    40 % of the sampled clients dropping out; each lost reply is recorded with its reason."""
    for method in ("fedavg", "fedlore"):
        lr = "lr=0.3" if method == "fedavg" else "lr=3e-2"
        extra = ["rounds=6", "clients.dropout=0.4", f"algorithms=[{method}]", lr]
        cfg = load_config(None, [*SMALL, *extra, f"output_dir={tmp_path}"])
        summary = run_one(cfg, method, 42)
        assert summary is not None and summary["final_accuracy"] > 0.3, summary
        rows = [r for r in _rows(tmp_path, method) if r["round"] >= 0]
        reasons = [x for r in rows for x in r.get("rejected_reasons", [])]
        assert reasons and all("dropped out" in x for x in reasons)
        assert sum(r["accepted"] for r in rows) + len(reasons) == 6 * 6


def test_unreliable_clients_are_refused_where_they_cannot_hold() -> None:
    with pytest.raises(ConfigError, match="engine=local"):
        make_algorithm("fedavg", load_config(None, ["clients.dropout=0.1", "engine=flower-sim"]))
    with pytest.raises(ConfigError, match="partial_work"):
        partial = ["clients.round_deadline_s=1", "clients.partial_work=true"]
        secure = ["secure_aggregation=true", "weighting=uniform"]
        make_algorithm("fedavg", load_config(None, [*partial, *secure]))


@pytest.mark.parametrize(
    "extra",
    [["clients.dropout=0.2"], ["clients.speed=lognormal", "clients.round_deadline_s=0.358"]],
    ids=["dropout", "deadline"],
)
def test_secure_aggregation_loses_the_same_clients_as_the_clear_rounds(
    tmp_path: Path, extra: list[str]
) -> None:
    """Under in-process secure aggregation dropouts and deadlines were not applied (every
    sampled client answered): the clients they drop now leave the secure round after sharing
    their keys, and the survivors' sum is unmasked: each round keeps the clients the clear
    round keeps, or none where they are fewer than the protocol's threshold (it aborts)."""
    runs = {}
    for name, secure in (("clear", []), ("secure", ["secure_aggregation=true"])):
        cfg = load_config(None, [*SMALL, "rounds=4", "weighting=uniform", "lr=0.3", *extra,
                                 *secure, f"name={name}", f"output_dir={tmp_path}"])  # fmt: skip
        assert run_one(cfg, "fedavg", 42) is not None
        runs[name] = [r for r in _rows(tmp_path, name=name) if r["round"] >= 0]
    kept = [sorted(r["accepted_clients"]) for r in runs["clear"]]
    got = [sorted(r["accepted_clients"]) for r in runs["secure"]]
    aborted = [bool(r.get("secagg_aborted")) for r in runs["secure"]]
    assert all(g == k or (a and not g) for g, k, a in zip(got, kept, aborted, strict=True))
    assert any(g == k and 0 < len(k) < 6 for g, k in zip(got, kept, strict=True))
    if got == kept:  # no round aborted: the same model, to the fixed-point encoding
        assert runs["secure"][-1]["accuracy"] == pytest.approx(runs["clear"][-1]["accuracy"],
                                                               abs=0.02)  # fmt: skip
