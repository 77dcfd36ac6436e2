"""The simulated clock of synchronous rounds (:mod:`fedlore.engine.simclock`): a round lasts as
long as its slowest answering client, or until the deadline when a sampled client does not
answer; ``sim_time_s`` sums the rounds, resumes bit for bit and reads as FedBuff's does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore import progress
from fedlore.algorithms.ditto import Ditto
from fedlore.algorithms.fedavg import FedAvg
from fedlore.config import Config, load_config
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.rundir import run_dir
from fedlore.engine.simclock import SimClock, simulates_time
from fedlore.engine.unreliable import ClientDropped, client_plan, client_speeds
from fedlore.experiment import run_one
from fedlore.experiment_privacy import PrivacyWarning

SMALL = ["num_clients=6", "local_steps=3", "batch_size=16", "progress=false", "lr=0.05",
         "model.kwargs={hidden: [16]}", "algorithms=[fedavg]", "rounds=4"]  # fmt: skip
SEED = 42
# speeds per client; 4 steps of 0.05 s at speed 1 take 0.2 s: clients need 0.2, 0.1, 0.4,
# 0.05, 1/3 and 0.2 s
SPEEDS = [1.0, 2.0, 0.5, 4.0, 0.6, 1.0]


def _data(cid: int) -> ClientData:
    split = TensorSplit(torch.zeros(40, 2), torch.zeros(40, dtype=torch.long))
    return ClientData(cid, split, split)


def _clock(tmp_path: Path, *extra: str) -> SimClock:
    trace = tmp_path / "speeds.json"
    trace.write_text(json.dumps(SPEEDS))
    cfg = load_config(None, ["num_clients=6", f"clients.speed_trace={trace}", *extra])
    return SimClock(cfg, FedAvg.of(local_steps=4), _data, SEED)


def _need(cid: int, steps: int = 4) -> float:
    return steps * 0.05 / SPEEDS[cid]


def test_a_round_lasts_as_long_as_its_slowest_client(tmp_path: Path) -> None:
    clock = _clock(tmp_path)
    assert clock.round_s(0, [0, 1, 2]) == _need(2) == 0.4
    assert clock.round_s(0, [0, 1, 3]) == _need(0)
    assert clock.round_s(0, []) == 0.0


def test_a_client_past_the_deadline_makes_the_round_last_until_it(tmp_path: Path) -> None:
    clock = _clock(tmp_path, "clients.round_deadline_s=0.3")
    assert clock.round_s(0, [0, 1, 2]) == 0.3  # client 2 (0.4 s) is dropped: the deadline
    assert clock.round_s(0, [0, 1, 3]) == _need(0)  # everyone in time: the slowest


def test_a_straggler_with_partial_work_counts_the_steps_it_trained(tmp_path: Path) -> None:
    clock = _clock(tmp_path, "clients.round_deadline_s=0.3", "clients.partial_work=true")
    # client 4 (speed 0.6) trains floor(0.3 · 0.6 / 0.05) = 3 of its 4 steps: 0.25 s
    assert clock.round_s(0, [1, 4]) == _need(4, 3) == pytest.approx(0.25)
    # client 2 (speed 0.5) trains floor(0.3 · 0.5 / 0.05) = 2 steps (0.15/0.05 < 3): 0.2 s
    assert clock.round_s(0, [1, 2]) == _need(2, 2)


def test_the_clock_charges_the_optimizer_steps_a_method_runs_besides(tmp_path: Path) -> None:
    """Ditto's round is its 4 local steps and 2 personal ones: 6 steps of work (the work a
    method's clients run, ``round_work``, is checked against their optimizers in
    ``tests/algorithms/test_round_work.py``)."""
    trace = tmp_path / "speeds.json"
    trace.write_text(json.dumps(SPEEDS))
    cfg = load_config(None, ["num_clients=6", f"clients.speed_trace={trace}"])
    clock = SimClock(cfg, Ditto.of(local_steps=4, personal_steps=2), _data, SEED)
    assert clock.round_s(0, [0, 1, 2]) == pytest.approx(6 * 0.05 / SPEEDS[2])


def test_a_stragglers_budget_is_the_most_local_steps_whose_work_fits(tmp_path: Path) -> None:
    """With work beyond the local steps (here 3 trial steps before every second local step, as
    a search before each epoch of 2 steps), a straggler keeps the most local steps whose work
    ends by the deadline, and at least one."""
    trace = tmp_path / "speeds.json"
    trace.write_text(json.dumps(SPEEDS))
    cfg = load_config(
        None,
        ["num_clients=6", f"clients.speed_trace={trace}", "clients.round_deadline_s=0.3",
         "clients.partial_work=true"],
    )  # fmt: skip

    def work(b: int) -> int:
        return b + 3 * ((b + 1) // 2)

    speeds = client_speeds(cfg, SEED)
    seen = set()
    for cid in range(6):
        can = 0.3 * SPEEDS[cid] / 0.05  # optimizer steps by the deadline
        plan = client_plan(cfg, speeds, SEED, 0, cid, 8, work)
        if plan is None:
            assert work(8) <= can
            seen.add("whole")
            continue
        assert isinstance(plan, int) and 1 <= plan < 8
        assert work(plan) <= can or plan == 1
        assert work(plan + 1) > can
        seen.add("cut" if work(plan) <= can else "one")
    assert seen == {"whole", "cut", "one"}  # each case met


def _dropped(cfg: Config, rnd: int, cid: int) -> bool:
    plan = client_plan(cfg, client_speeds(cfg, SEED), SEED, rnd, cid, 4)
    return isinstance(plan, ClientDropped)


def test_dropped_clients_cost_nothing_without_a_deadline_and_the_deadline_with_one(
    tmp_path: Path,
) -> None:
    clock = _clock(tmp_path, "clients.dropout=0.5")
    ids = [0, 1, 2, 3]
    # a round where the slowest client (2) dropped out and another answered
    rnd = next(r for r in range(100) if _dropped(clock.cfg, r, 2) and not _dropped(clock.cfg, r, 0))
    left = [c for c in ids if not _dropped(clock.cfg, rnd, c)]
    assert clock.round_s(rnd, ids) == max(_need(c) for c in left) < _need(2)
    everyone = next(r for r in range(100) if not any(_dropped(clock.cfg, r, c) for c in ids))
    assert clock.round_s(everyone, ids) == _need(2)
    # with a deadline the server cannot tell a dropout from a straggler: it waits until then
    late = _clock(tmp_path, "clients.dropout=0.5", "clients.round_deadline_s=0.5")
    assert late.round_s(rnd, ids) == 0.5
    assert late.round_s(everyone, ids) == _need(2)


def test_the_clock_sums_the_rounds(tmp_path: Path) -> None:
    clock = _clock(tmp_path)
    first, second = clock(0, [0, 2]), clock(1, [1, 3])
    assert first == {"sim_round_s": 0.4, "sim_time_s": 0.4}
    assert second == {"sim_round_s": _need(1), "sim_time_s": 0.4 + _need(1)}


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(None, [*SMALL, f"output_dir={out}", *extra])


def _rows(cfg: Config, method: str = "fedavg") -> list[dict[str, Any]]:
    path = run_dir(cfg, method, SEED) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("wall_s", "eval_s", "client_train_s")}


def test_a_run_records_the_clock_and_a_killed_run_resumes_it(tmp_path: Path) -> None:
    extra = ["clients.speed=lognormal", "participation=0.5", "rounds=5"]
    whole = _cfg(tmp_path / "whole", *extra)
    run_one(whole, "fedavg", SEED)
    rows = _rows(whole)
    speeds, clock = client_speeds(whole, SEED), 0.0
    for r in rows:  # the slowest sampled client (all answer), summed
        assert r["sim_round_s"] == max(3 * 0.05 / float(speeds[c]) for c in r["accepted_clients"])
        clock += r["sim_round_s"]
        assert r["sim_time_s"] == clock
    cut = _cfg(tmp_path / "cut", *extra)
    assert run_one(cut, "fedavg", SEED, stop_after=2) is None
    run_one(cut, "fedavg", SEED, resume=True)
    assert [_plain(r) for r in _rows(cut)] == [_plain(r) for r in rows]


def test_runs_without_simulated_compute_record_no_clock(tmp_path: Path) -> None:
    plain = _cfg(tmp_path / "plain", "rounds=1")
    assert not simulates_time(plain)
    run_one(plain, "fedavg", SEED)
    assert not {"sim_round_s", "sim_time_s"} & _rows(plain)[0].keys()
    for extra in (
        "clients.speed=uniform",
        "clients.dropout=0.1",
        "clients.round_deadline_s=1",
        f"clients.speed_trace={tmp_path}/s.json",
    ):
        assert simulates_time(_cfg(tmp_path, extra)), extra
    assert not simulates_time(_cfg(tmp_path, "clients.speed=uniform", "asynchronous.buffer=2"))
    assert not simulates_time(_cfg(tmp_path, "clients.speed=uniform", "engine=flower-sim"))
    dropping = _cfg(tmp_path / "drop", "rounds=1", "clients.dropout=0.1")
    run_one(dropping, "fedavg", SEED)
    assert {"sim_round_s", "sim_time_s"} <= _rows(dropping)[0].keys()


def test_a_dp_run_whose_sample_is_secret_records_no_clock(tmp_path: Path) -> None:
    """The slowest sampled client's time would name it: under DP with secure noise the rows keep
    no clock; with reproducible noise (no privacy, nothing to hide) they do."""
    dp = ["rounds=1", "algorithms=[fedfull]", "weighting=uniform", "dp.clip_norm=1",
          "dp.noise_multiplier=1", "participation=0.5", "clients.speed=lognormal"]  # fmt: skip
    secret = _cfg(tmp_path / "secret", *dp)
    run_one(secret, "fedfull", SEED)
    assert not {"sim_round_s", "sim_time_s"} & _rows(secret, "fedfull")[0].keys()
    seeded = _cfg(tmp_path / "seeded", *dp, "dp.reproducible_noise=true")
    with progress.command(), pytest.warns(PrivacyWarning, match="NO PRIVACY"):
        run_one(seeded, "fedfull", SEED)  # a command of its own: said once per command
    assert {"sim_round_s", "sim_time_s"} <= _rows(seeded, "fedfull")[0].keys()


def test_with_all_clients_as_buffer_and_equal_speeds_fedbuff_reads_the_same_clock(
    tmp_path: Path,
) -> None:
    # speeds all exactly 1 (uniform, no spread): FedBuff with C = K = N is synchronous FedAvg
    equal = ["clients.speed=uniform", "clients.speed_spread=0"]
    sync = _cfg(tmp_path / "sync", *equal)
    buff = _cfg(tmp_path / "buff", *equal, "asynchronous.buffer=6",
                "asynchronous.concurrency=6", "asynchronous.staleness=constant")  # fmt: skip
    run_one(sync, "fedavg", SEED)
    run_one(buff, "fedavg", SEED)
    a, b = _rows(sync), _rows(buff)
    assert [r["sim_time_s"] for r in a] == [r["sim_time_s"] for r in b]
    assert [r["accuracy"] for r in a] == [r["accuracy"] for r in b]
    assert a[0]["sim_round_s"] == a[0]["sim_time_s"] == 3 * 0.05  # 3 steps at speed 1
