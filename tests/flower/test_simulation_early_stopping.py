"""Early stopping on Flower's Simulation Engine: the ServerApp runs the same round loop
(:func:`fedlore.experiment.run_one` over a Flower transport), so a simulated run stops at the
in-process run's round and reports the same best round's model."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
from sim_helpers import SMALL

from fedlore.config import load_config
from fedlore.experiment import run_one
from fedlore.flower.simulation import run_simulated

pytestmark = pytest.mark.flower


def test_a_simulated_run_stops_and_restores_as_in_process(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    es = [
        "early_stopping.metric=selection_accuracy",
        "early_stopping.min_delta=1.0",  # nothing improves on the first evaluation
        "early_stopping.patience=1",
        "early_stopping.restore_best=true",
        "data.selection_fraction=0.2",
        "rounds=5",
        "algorithms=[fedavg]",
    ]
    summaries = {}
    for engine in ("local", "flower-sim"):
        cfg = load_config(
            None, [*SMALL, *digits_npz, *es, f"engine={engine}", f"output_dir={tmp_path / engine}"]
        )
        run = run_one if engine == "local" else run_simulated
        summaries[engine] = run(cfg, "fedavg", 42)
    local, sim = summaries["local"], summaries["flower-sim"]
    assert local is not None and sim is not None
    assert (sim["stopped_round"], sim["best_round"], sim["rounds"]) == (1, 0, 2)
    assert (local["stopped_round"], local["best_round"], local["rounds"]) == (1, 0, 2)
    for key in ("final_accuracy", "final_selection_accuracy", "best_selection_accuracy"):
        assert sim[key] == pytest.approx(local[key]), key
