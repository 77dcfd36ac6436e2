"""``fedlore.trained.load_trained``: a run folder's global model back in Python, the model the
run evaluated last (its accuracy on the central test set is the run's ``final_accuracy``, for a
dense, a low-rank, a LoRA and a Bayesian method), and clear errors without a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedlore.config import ConfigError, load_config
from fedlore.experiment import run_experiment
from fedlore.train.local import evaluate
from fedlore.trained import load_trained

TINY = [
    "num_clients=3",
    "rounds=2",
    "local_steps=3",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "seeds=[5]",
    "progress=false",
    "eval.mc_samples=2",
]


@pytest.mark.parametrize("method", ["fedavg", "fedlore", "fedit", "bayfl"])
def test_the_loaded_model_scores_what_the_run_scored_last(tmp_path: Path, method: str) -> None:
    cfg = load_config(None, [*TINY, f"algorithms=[{method}]", f"output_dir={tmp_path}"])
    run_experiment(cfg)
    folder = tmp_path / "experiment" / method / "seed-5"
    summary = json.loads((folder / "summary.json").read_text())
    got = load_trained(folder)
    assert (got.method, got.seed, got.round, got.finished) == (method, 5, 1, True)
    assert not got.model.training
    res = evaluate(got.model, got.fed.central_test, 512, cfg.eval.mc_samples)
    assert res["accuracy"] == pytest.approx(summary["final_accuracy"], abs=1e-6)
    assert res["loss"] == pytest.approx(summary["final_loss"], rel=1e-5)


def test_no_checkpoint_or_no_run_folder_is_said(tmp_path: Path) -> None:
    cfg = load_config(
        None, [*TINY, "algorithms=[fedavg]", "checkpoint=false", f"output_dir={tmp_path}"]
    )
    run_experiment(cfg)
    folder = tmp_path / "experiment" / "fedavg" / "seed-5"
    with pytest.raises(FileNotFoundError, match=r"checkpoint\.pt: no such .*checkpoint: false"):
        load_trained(folder)
    with pytest.raises(ConfigError, match="not a run folder"):
        load_trained(folder.parent)
