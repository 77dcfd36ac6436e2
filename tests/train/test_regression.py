"""Regression tasks (issue 16): real targets choose the unit-noise Gaussian likelihood for every
method's training, the ELBO and the Meta-BayFL score; evaluation reports RMSE and NLL; sklearn's
diabetes data is the embedded regression source."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedlore.algorithms.bayes import MetaBayFL, elbo_kl_term
from fedlore.algorithms.meta_lr import meta_nll
from fedlore.bayes import sampling
from fedlore.config import ConfigError, load_config
from fedlore.data.client_data import TensorSplit
from fedlore.data.federation import build_federation
from fedlore.data.holdout import target_strata
from fedlore.data.sources import load_diabetes
from fedlore.experiment import run_one
from fedlore.settings import LocalTraining
from fedlore.train.local import (
    evaluate,
    gaussian_nll,
    predictive_draws,
    regression_metrics,
    regression_nll,
    task_loss,
)

BASE = [
    "data.name=diabetes",
    "model.name=mlp",
    "model.kwargs={hidden: [16]}",
    "num_clients=3",
    "rounds=2",
    "local_steps=3",
    "batch_size=16",
    "partition.min_size=10",
    "progress=false",
]


def test_task_loss_of_real_targets_is_the_unit_noise_gaussian_nll() -> None:
    pred = torch.tensor([[0.5], [2.0], [-1.0]], requires_grad=True)
    y = torch.tensor([1.0, 0.0, -1.0])
    loss = task_loss(pred, y)
    expect = np.mean([0.5 * 0.25, 0.5 * 4.0, 0.0]) + 0.5 * math.log(2 * math.pi)
    assert float(loss.detach()) == pytest.approx(expect, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, pred)
    torch.testing.assert_close(grad, (pred.detach() - y[:, None]) / 3)
    # against torch's own Gaussian NLL with unit variance (full=True adds the constant)
    ref = nn.GaussianNLLLoss(full=True)(pred.detach()[:, 0], y, torch.ones(3))
    assert float(loss.detach()) == pytest.approx(float(ref), rel=1e-6)
    # integer targets still mean classes
    logits = torch.randn(4, 3)
    labels = torch.tensor([0, 2, 1, 1])
    assert float(task_loss(logits, labels)) == pytest.approx(
        float(nn.functional.cross_entropy(logits, labels))
    )
    with pytest.raises(ValueError, match="do not match"):
        gaussian_nll(torch.zeros(3, 2), y)


def test_regression_metrics_rmse_and_mixture_nll() -> None:
    y = torch.tensor([0.0, 1.0])
    draws = torch.tensor([[[0.0], [1.0]], [[2.0], [1.0]]])  # S = 2 draws, n = 2
    res = regression_metrics(draws, y)
    assert res["rmse"] == pytest.approx(math.sqrt((1.0**2 + 0.0) / 2))  # predictive mean 1, 1
    # mixture of N(0,1) and N(2,1) at y = 0, and N(1,1) twice at y = 1
    log_n = lambda d: -0.5 * d * d - 0.5 * math.log(2 * math.pi)  # noqa: E731
    nll0 = -math.log(0.5 * math.exp(log_n(0.0)) + 0.5 * math.exp(log_n(2.0)))
    nll1 = -log_n(0.0)
    assert res["loss"] == pytest.approx((nll0 + nll1) / 2, rel=1e-6)
    assert float(regression_nll(draws, y)[0]) == pytest.approx(nll0, rel=1e-6)
    nan = regression_metrics(torch.full((1, 2, 1), float("nan")), y)
    assert math.isnan(nan["rmse"]) and math.isnan(nan["loss"])


def test_diabetes_is_standardized_fixed_and_local() -> None:
    src = load_diabetes()
    assert src.task == "regression" and src.input_shape == (10,) and src.num_classes == 1
    assert (len(src.train), len(src.test)) == (353, 89)
    assert src.train.y.dtype == torch.float32
    assert abs(float(src.train.y.mean())) < 1e-5 and float(src.train.y.std()) == pytest.approx(
        1.0, rel=1e-2
    )
    again = load_diabetes()
    assert torch.equal(src.test.x, again.test.x)
    with pytest.raises(ValueError, match=r"data\.root"):
        load_diabetes("/somewhere")


def test_federation_partitions_regression_targets_by_decile() -> None:
    cfg = load_config(None, [*BASE, "partition.alpha=0.1", "data.selection_fraction=0.1"])
    fed = build_federation(cfg, 0)
    assert fed.task == "regression" and fed.strata is not None
    hist = fed.histogram()
    assert hist.shape == (3, 10)
    assert int(hist.sum()) == sum(len(t) for t in fed.train_indices)
    assert fed.selection is not None and fed.selection.y.is_floating_point()
    bins = target_strata(np.arange(100.0))
    assert np.array_equal(np.bincount(bins), np.full(10, 10))
    for bad in ("data.noise=0.1", "data.label_flip=0.1"):
        with pytest.raises(ConfigError, match="regression"):
            build_federation(load_config(None, [*BASE, bad]), 0)


@pytest.mark.parametrize("method", ["fedfull", "fedlore", "meta_bayfl", "ditto"])
def test_methods_train_a_regression_model(tmp_path: Path, method: str) -> None:
    cfg = load_config(
        None,
        [*BASE, f"output_dir={tmp_path}", f"algorithms=[{method}]", "rank=4", "eval.local=true",
         "eval.clients=true", "rounds=4", "lr=1e-2", "eval.mc_samples=4"],
    )  # fmt: skip
    summary = run_one(cfg, method, 0)
    assert summary is not None and summary["final_accuracy"] is None
    rows = [json.loads(r) for r in (tmp_path / cfg.name / method / "seed-0" / "metrics.jsonl")
            .read_text().splitlines()]  # fmt: skip
    first = next(r for r in rows if r["round"] >= 0)
    assert 0 < summary["final_rmse"] < first["rmse"]  # it learns
    assert math.isfinite(summary["final_client_rmse"]) and summary["final_loss"] > 0
    if method != "fedlore":  # P-local of the projected methods is another issue's work
        assert math.isfinite(summary["local_rmse"])


def test_fedbe_refuses_regression(tmp_path: Path) -> None:
    cfg = load_config(
        None, [*BASE, f"output_dir={tmp_path}", "algorithms=[fedbe]", "data.server_fraction=0.1"]
    )
    with pytest.raises(ConfigError, match="classification"):
        run_one(cfg, "fedbe", 0)


def test_meta_score_of_a_regression_bnn_is_the_predictive_mixture_nll() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(40, generator=g)
    fit, meta = TensorSplit(x[:30], y[:30]), TensorSplit(x[30:], y[30:])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    scores = {}
    for trials in ("sequential", "batched"):
        algo = MetaBayFL(
            train=LocalTraining(batch_size=10, mc_samples=4),
            candidate_lrs=(0.1, 0.01),
            temp_steps=3,
            trials=trials,
        )
        net = algo.prepare_model(nn.Sequential(*[m for m in model]))  # the same weights
        opt = algo.make_optimizer(net)
        with sampling(net, True):
            _, scores[trials] = algo.select_lr(net, opt, fit, meta, [elbo_kl_term(1.0, 30)], 1)
    torch.testing.assert_close(
        torch.tensor(scores["sequential"]), torch.tensor(scores["batched"]), rtol=1e-4, atol=0
    )
    # the score is the predictive mixture NLL of meta_nll, recomputed from the draws
    net = MetaBayFL().prepare_model(nn.Sequential(nn.Linear(3, 1)))
    draws = predictive_draws(net, meta.x, mc_samples=4)
    expect = float(regression_nll(draws, meta.y).mean())
    assert meta_nll(net, meta, 4) == pytest.approx(expect, rel=1e-6)
    assert evaluate(net, meta, mc_samples=4)["loss"] == pytest.approx(expect, rel=1e-6)
