"""Round callbacks on Flower's Simulation Engine: ``run_experiment(callbacks=...)`` calls them in
the ServerApp's thread after every round, and an exception one raises stops the run after that
round and reaches the caller (how ``fedlore tune`` prunes a trial); ``fedlore tune --prune
median`` on ``engine: flower-sim`` prunes the trials the in-process search prunes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
from sim_helpers import SMALL

from fedlore.cli import ENGINES
from fedlore.config import apply_overrides, load_config, validate
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_experiment
from fedlore.flower.simulation import ray_session
from fedlore.tune import plan_search
from fedlore.tune_study import run_search
from fedlore.types import State

# one worker runs the whole module, so the module's one Ray starts once (spread over two
# pytest-xdist workers, each started its own)
pytestmark = [pytest.mark.flower, pytest.mark.xdist_group("ray-callbacks")]


@pytest.fixture(scope="module", autouse=True)
def one_ray() -> Iterator[None]:
    with ray_session():
        yield


class Stop(Exception):
    """What the test's callback raises."""


class Watch:
    """Records each round's row; raises :class:`Stop` after round ``stop_after``."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.stop_after = stop_after

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        self.rows.append(dict(row))
        if rnd == self.stop_after:
            raise Stop(f"stop after round {rnd}")


def test_callbacks_see_every_round_and_an_exception_stops_the_run(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    run_cfg = ["rounds=3", "algorithms=[fedavg]", "seeds=[42]", "engine=flower-sim"]
    cfg = load_config(None, [*SMALL, *digits_npz, *run_cfg, f"output_dir={tmp_path}"])
    engine = ENGINES["flower-sim"]()
    stopping = Watch(stop_after=1)
    with pytest.raises(Stop, match="stop after round 1"):
        run_experiment(cfg, engine=engine, callbacks=lambda m, s: [stopping])
    run = run_dir(cfg, "fedavg", 42)
    written = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in written] == [0, 1]  # stopped after round 1's row and checkpoint
    assert stopping.rows == written
    assert (run / "checkpoint.pt").is_file() and not (run / "summary.json").exists()
    rest = Watch()
    out = run_experiment(cfg, resume=True, engine=engine, callbacks=lambda m, s: [rest])
    assert [r["round"] for r in rest.rows] == [2]  # resumed from its checkpoint
    assert out["fedavg"][0]["rounds"] == 3


TUNE = [
    "name=tiny",
    "rounds=3",
    "local_steps=5",
    "algorithms=[fedavg]",
    "seeds=[1]",
    "data.selection_fraction=0.2",
    "tune.sampler=grid",
    "tune.seed=1",
    "tune.trials=3",
    "tune.space={lr: 'cat:0.3,1e-5,2e-5'}",  # seed 1 runs 0.3 first
    "tune.prune=median",
    "tune.prune_startup_trials=1",
]


def test_median_pruning_on_the_simulation_prunes_as_in_process(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    outcomes = {}
    for engine in ("local", "flower-sim"):
        raw = apply_overrides(
            {}, [*SMALL, *digits_npz, *TUNE, f"output_dir={tmp_path / engine}", f"engine={engine}"]
        )
        outcomes[engine] = run_search(
            plan_search(validate(raw), raw, "tiny.yaml"), ENGINES[engine]()
        )
    local, sim = outcomes["local"], outcomes["flower-sim"]
    assert [(r.state, r.note) for r in sim.rows] == [
        ("complete", ""), ("pruned", "after round 0"), ("pruned", "after round 0")
    ]  # fmt: skip
    assert [(r.state, r.note) for r in local.rows] == [(r.state, r.note) for r in sim.rows]
    for a, b in zip(local.rows, sim.rows, strict=True):
        assert a.value == pytest.approx(b.value)
    run = tmp_path / "flower-sim" / "tiny" / "tune" / "trial-1" / "fedavg" / "seed-1"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0]
    assert (run / "checkpoint.pt").is_file() and not (run / "summary.json").exists()
