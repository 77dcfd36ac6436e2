"""A DP-FedBuff run capped by ``dp.max_contributions`` is refused before training when its
schedule starves (:mod:`fedlore.engine.cap_schedule`): the replay is the run's schedule, the
boundary holds on both sides (a run that just finishes, one that just starves, at the same
exact fill N x cap = rounds x K), and the bound that no schedule can starve past holds."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedlore.config import Config, load_config
from fedlore.engine import cap_schedule
from fedlore.engine.cap_schedule import Rules, Schedule, replay
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one

# 6 clients, K = 3, C = 4, lognormal speeds: cap 3 x 6 clients = 6 steps x 3 (exact fill)
SMALL = ["num_clients=6", "local_steps=3", "batch_size=16", "progress=false", "lr=0.05",
         "model.kwargs={hidden: [16]}", "algorithms=[fedavg]", "weighting=uniform",
         "asynchronous.buffer=3", "asynchronous.concurrency=4", "clients.speed=lognormal",
         "dp.clip_norm=0.5", "dp.noise_multiplier=1.0", "eval.every=100"]  # fmt: skip
SEED = 42
STARVES = (
    "dp.max_contributions=3: this run's schedule (seed 42; asynchronous.buffer=3, 4 in flight, "
    "the clients' speeds) starves at round 5 (counting from 0), which would hold 2 of 3 "
    "updates with every other client at the cap or in the buffer, so rounds=6 cannot finish; "
    "dp.max_contributions=4 is the smallest cap that finishes them, or rounds=5 finishes with "
    "this cap (refused before training)"
)


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(None, [*SMALL, f"output_dir={out}", *extra])


def _steps(cfg: Config) -> list[list[int]]:
    path = run_dir(cfg, "fedavg", SEED) / "metrics.jsonl"
    return [json.loads(line)["accepted_clients"] for line in path.read_text().splitlines()]


def _run(cfg: Config, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # δ against 1/N on 6 clients
        return run_one(cfg, "fedavg", SEED, **kw)


def test_an_exact_fill_that_starves_is_refused_before_training(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "dp.max_contributions=3", "rounds=6")
    with pytest.raises(ValueError) as e:
        _run(cfg)
    assert str(e.value) == STARVES
    metrics = run_dir(cfg, "fedavg", SEED) / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # nothing trained


def test_past_the_check_the_same_run_starves_where_the_replay_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("fedlore.engine.buffered.check_loop", lambda loop, end: None)
    cfg = _cfg(tmp_path, "dp.max_contributions=3", "rounds=6")
    with pytest.raises(ValueError, match=r"round 5 \(counting from 0\) holds 2 update\(s\)"):
        _run(cfg)
    assert len(_steps(cfg)) == 5


@pytest.mark.parametrize("extra", [["dp.max_contributions=4", "rounds=6"],
                                   ["dp.max_contributions=3", "rounds=5"],
                                   # ties: arrivals in start order; stale uploads rejected
                                   ["dp.max_contributions=3", "rounds=5", "clients.speed=equal"],
                                   ["dp.max_contributions=4", "rounds=6",
                                    "asynchronous.max_staleness=1"]])  # fmt: skip
def test_the_cap_or_the_rounds_the_refusal_names_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    """The smallest cap (4) and the most rounds (5) the refusal names finish, and the replay
    before training gave the run's own steps, client for client."""
    predicted: list[list[int]] = []
    check = cap_schedule.check_loop

    def noted(loop: Any, end: int) -> None:
        p, dp = loop.progress, loop.privacy
        s = Schedule(p.version, p.clock, p.seq, p.draws, [], dict(dp.counts.counts))
        rules = Rules(3, 4, dp.max_contributions, SEED, loop.duration, loop.pool,
                      loop.settings.max_staleness)  # fmt: skip
        assert replay(s, rules, end, predicted) is None
        check(loop, end)

    monkeypatch.setattr("fedlore.engine.buffered.check_loop", noted)
    cfg = _cfg(tmp_path, *extra)
    assert _run(cfg) is not None
    assert _steps(cfg) == predicted and len(predicted) == cfg.rounds
    if "asynchronous.max_staleness=1" in extra:
        assert _rejected(cfg) > 0  # the replay rejected the stale uploads the run did


def _rejected(cfg: Config) -> int:
    path = run_dir(cfg, "fedavg", SEED) / "metrics.jsonl"
    return sum(json.loads(line)["rejected"] for line in path.read_text().splitlines())


def _rules(rng: np.random.Generator, n: int, k: int, c: int, cap: int) -> Rules:
    speed = rng.lognormal(0.0, 1.0, n)
    return Rules(k, c, cap, int(rng.integers(1 << 30)), lambda i: float(1 / speed[i]),
                 lambda v: list(range(n)))  # fmt: skip


def test_no_schedule_starves_past_the_bound_and_every_starved_step_is_within_it() -> None:
    """(N − K + 1)·m > (T − 1)·K: never starves (random speeds and seeds); a step t that
    starves holding b updates has (N − b)·m ≤ t·K; the exact fill starves for some."""
    rng = np.random.default_rng(0)
    starved = 0
    for _ in range(300):
        n = int(rng.integers(3, 9))
        k = int(rng.integers(1, n + 1))
        c = int(rng.integers(k, n + 1))
        cap = int(rng.integers(1, 5))
        safe = ((n - k + 1) * cap) // k + (1 if ((n - k + 1) * cap) % k else 0)  # T−1 < that
        for rounds in (safe, n * cap // k):  # the bound's largest T, the exact fill's
            stop = replay(Schedule(), _rules(rng, n, k, c, cap), rounds)
            if (n - k + 1) * cap > (rounds - 1) * k:
                assert stop is None, (n, k, c, cap, rounds)
            if stop is not None:
                step, held = stop
                assert held < k and (n - held) * cap <= step * k
                starved += 1
    assert starved > 0
