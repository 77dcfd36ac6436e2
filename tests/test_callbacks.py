"""``run_experiment(callbacks=...)``: a user's round callbacks, made per run, see every round of
every run that trains (after its row is written), in process; another engine's runs get them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedlore.config import load_config
from fedlore.experiment import Engine, run_experiment, run_one
from fedlore.types import State

TINY = [
    "num_clients=3",
    "rounds=3",
    "local_steps=2",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "algorithms=[fedavg,fedlore]",
    "seeds=[1,2]",
    "progress=false",
]


class Seen:
    def __init__(self, method: str, seed: int, log: list[tuple[Any, ...]]) -> None:
        self.method, self.seed, self.log = method, seed, log

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        self.log.append((self.method, self.seed, rnd, row["round"], "accuracy" in row))


def test_callbacks_see_every_round_of_every_run_that_trains(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY, f"output_dir={tmp_path}"])
    log: list[tuple[Any, ...]] = []
    run_experiment(cfg, callbacks=lambda method, seed: [Seen(method, seed, log)])
    rounds = {(m, s): [r for mm, ss, r, _, _ in log if (mm, ss) == (m, s)] for m, s, *_ in log}
    assert set(rounds) == {(m, s) for m in ("fedavg", "fedlore") for s in (1, 2)}
    assert all(v[-3:] == [0, 1, 2] for v in rounds.values())  # FedLore: its setup round first
    assert all(r == row_round for _, _, r, row_round, _ in log)
    written = (tmp_path / "experiment" / "fedavg" / "seed-1" / "metrics.jsonl").read_text()
    assert len(written.splitlines()) == 3
    log.clear()  # finished runs are kept, not trained: no round to see
    run_experiment(cfg, callbacks=lambda method, seed: [Seen(method, seed, log)])
    assert log == []
    assert json.loads((tmp_path / "experiment" / "fedlore" / "seed-2" / "summary.json").read_text())


def test_callbacks_reach_another_engines_runs(tmp_path: Path) -> None:
    """An engine's ``run`` gets the callbacks as ``extra_callbacks`` (flower-sim's passes them
    to its ServerApp: tests/flower/test_simulation_callbacks.py)."""
    cfg = load_config(None, [*TINY, f"output_dir={tmp_path}"])
    given: list[tuple[object, ...]] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        given.append(kwargs["extra_callbacks"])
        return run_one(*args, **kwargs)

    log: list[tuple[Any, ...]] = []
    watch = {(m, s): Seen(m, s, log) for m in cfg.algorithms for s in cfg.seeds}
    run_experiment(cfg, engine=Engine(run), callbacks=lambda m, s: [watch[m, s]])
    assert sorted(map(id, (c for cs in given for c in cs))) == sorted(map(id, watch.values()))
    assert {(m, s) for m, s, *_ in log} == set(watch)
