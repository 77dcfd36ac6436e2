"""Meta-BayFL and its comparators: ELBO, learning-rate selection, aggregation rules, FedProx, and
what a run records (chosen learning rates per client, P-local and G-local metrics)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Literal

import pytest
import torch
from torch import nn

from fedlore.algorithms.bayes import MetaBayFL, elbo_kl_term
from fedlore.algorithms.fedavg import FedProx
from fedlore.algorithms.meta_lr import (
    MetaScore,
    MetaSplit,
    meta_loss,
    meta_nll,
    meta_split,
    pick_lowest,
)
from fedlore.bayes import bayesianize, combine_gaussians, is_bayesian, kl_divergence, sampling
from fedlore.config import load_config
from fedlore.data.client_data import ClientData, TensorSplit, minibatches
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.settings import LocalTraining
from fedlore.train.local import EVAL_SAMPLING_SEED, local_train


def _regression_case() -> tuple[nn.Module, TensorSplit, TensorSplit]:
    """A 2-class linear problem whose classes split on x[0]; a tiny model starting at zero."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 4, generator=g)
    y = (x[:, 0] > 0).long()
    lin = nn.Linear(4, 2)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.zero_()
    model = nn.Sequential(lin)
    return model, TensorSplit(x[:160], y[:160]), TensorSplit(x[160:], y[160:])


@pytest.mark.parametrize("trials", ["sequential", "batched"])
def test_learning_rate_selection_picks_the_best_candidate(
    trials: Literal["sequential", "batched"],
) -> None:
    model, fit, meta = _regression_case()
    # 1e-6 barely moves; 1e4 overshoots into a terrible (or non-finite) loss; 0.5 learns
    algo = MetaBayFL(
        train=LocalTraining(batch_size=32),
        posterior="none",
        candidate_lrs=(1e-6, 0.5, 1e4),
        temp_steps=10,
        local_optimizer="sgd",
        trials=trials,
    )
    opt = algo.make_optimizer(model)
    before = copy.deepcopy(model.state_dict())
    chosen, scores = algo.select_lr(model, opt, fit, meta, [], seed=3)
    assert chosen == 0.5
    # the scores are the candidates' meta losses, recomputed independently
    for lr, score in zip(algo.candidate_lrs, scores, strict=True):
        trial = copy.deepcopy(model)
        topt = torch.optim.SGD(trial.parameters(), lr=lr)
        g = torch.Generator().manual_seed(3)
        with torch.random.fork_rng():
            torch.manual_seed(3)
            local_train(trial, minibatches(fit, 32, 10, g), topt, [lr] * 10)
            expect = meta_loss(trial, meta, [])
        if lr < 1e4:
            assert math.isclose(score, expect, rel_tol=1e-5)
    assert scores[1] < scores[0] and not scores[2] <= scores[1]
    # the trials do not touch the local model
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_pick_lowest_rules() -> None:
    assert pick_lowest((1e-2, 1e-3, 1e-4), [0.5, 0.2, 0.3]) == 1e-3
    assert pick_lowest((1e-2, 1e-3), [0.2, 0.2]) == 1e-2  # tie: the earlier candidate
    assert pick_lowest((1e-2, 1e-3), [float("nan"), 5.0]) == 1e-3  # non-finite never wins
    assert pick_lowest((1e-2, 1e-3), [float("inf"), float("nan")]) == 1e-3  # none: smallest
    with pytest.raises(ValueError):
        pick_lowest((1e-2,), [])


def test_elbo_kl_term_is_beta_kl_over_n() -> None:
    model = bayesianize(nn.Sequential(nn.Linear(3, 2)), rho_init=-2.0)
    term = elbo_kl_term(0.5, 40)
    kl = float(kl_divergence(model).detach())
    assert math.isclose(float(term(model).detach()), 0.5 * kl / 40, rel_tol=1e-6)
    with pytest.raises(ValueError, match="N_k"):
        elbo_kl_term(1.0, 0)


def test_meta_split_is_a_fixed_twenty_percent_subset_of_d() -> None:
    x = torch.arange(50, dtype=torch.float32).unsqueeze(1)
    data = ClientData(
        3, TensorSplit(x, torch.zeros(50, dtype=torch.long)), TensorSplit(x[:1], x[:1, 0].long())
    )
    # the seed: d ⊂ D, the client trains on all of D
    train, meta = meta_split(data, 0.2)
    assert len(meta) == 10 and torch.equal(train.x, data.train.x)
    assert set(meta.x[:, 0].tolist()) <= set(train.x[:, 0].tolist())
    # the held-out variant: the same d, removed from training
    fit, held = meta_split(data, 0.2, "heldout")
    fit2, held2 = meta_split(data, 0.2, "heldout")
    assert torch.equal(held.x, meta.x)
    assert len(held) == 10 and len(fit) == 40
    assert torch.equal(held.x, held2.x) and torch.equal(fit.x, fit2.x)
    assert set(held.x[:, 0].tolist()).isdisjoint(fit.x[:, 0].tolist())
    tiny = ClientData(
        0, TensorSplit(x[:1], torch.zeros(1, dtype=torch.long)), TensorSplit(x[:1], x[:1, 0].long())
    )
    with pytest.raises(ValueError, match="at least 2"):
        meta_split(tiny, 0.2, "heldout")
    one_train, one_meta = meta_split(tiny, 0.2)  # a subset needs one example: d = D
    assert len(one_meta) == 1 and len(one_train) == 1


def _trained_bnn(
    score: MetaScore,
) -> tuple[MetaBayFL, nn.Module, torch.optim.Optimizer, TensorSplit, TensorSplit, list]:
    """A small BNN classifier on 20 training examples whose means were fitted first (so a large
    step hurts the fit), with the ELBO's KL/N_k large (N_k = 20): the ELBO score favours the
    large rate, which shrinks the KL fastest; seed Eq. (19)'s predictive NLL the small one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 4, generator=g)
    y = (x[:, 0] > 0).long()
    fit, meta = TensorSplit(x[:20], y[:20]), TensorSplit(x[20:], y[20:])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    algo = MetaBayFL(
        train=LocalTraining(batch_size=20, mc_samples=10),
        candidate_lrs=(0.3, 0.003),
        temp_steps=5,
        meta_score=score,
    )
    algo.prepare_model(model)
    opt = algo.make_optimizer(model)
    with sampling(model, True):
        batches = minibatches(fit, 20, 100, torch.Generator().manual_seed(5))
        local_train(model, batches, opt, [0.01] * 100)
    return algo, model, opt, fit, meta, [elbo_kl_term(1.0, len(fit))]


def test_eq19_predictive_nll_and_the_elbo_pick_different_rates() -> None:
    chosen = {}
    for score in ("nll", "elbo"):
        algo, model, opt, fit, meta, terms = _trained_bnn(score)
        with sampling(model, True):
            chosen[score], scores = algo.select_lr(model, opt, fit, meta, terms, seed=1)
        if score != "nll":
            continue
        # Eq. (19) recomputed by hand: train each copy as the search does, then the mean of
        # -log((1/S) Σ_s softmax(f(x; w_s))_y) over d with S = 10 draws from the eval seed
        for lr, got in zip(algo.candidate_lrs, scores, strict=True):
            trial = copy.deepcopy(model)
            topt = algo.make_optimizer(trial)
            topt.load_state_dict(copy.deepcopy(opt.state_dict()))
            with torch.random.fork_rng(devices=[]), sampling(trial, True):
                torch.manual_seed(1)
                g = torch.Generator().manual_seed(1)
                local_train(trial, minibatches(fit, 20, 5, g), topt, [lr] * 5, loss_terms=terms)
                trial.eval()
                torch.manual_seed(EVAL_SAMPLING_SEED)
                with torch.no_grad():
                    probs = torch.stack([trial(meta.x).softmax(-1) for _ in range(10)]).mean(0)
            expect = float(-probs[torch.arange(len(meta)), meta.y].log().mean())
            assert math.isclose(got, expect, rel_tol=1e-5), (lr, got, expect)
    assert chosen == {"nll": 0.003, "elbo": 0.3}


def _recording_case() -> tuple[nn.Module, ClientData, list[torch.Tensor]]:
    """A deterministic model that records every input it trains on (also in its trial copies)."""
    g = torch.Generator().manual_seed(0)
    x = torch.arange(40, dtype=torch.float32).unsqueeze(1).repeat(1, 4) / 40
    y = torch.randint(0, 2, (40,), generator=g)
    data = ClientData(7, TensorSplit(x, y), TensorSplit(x[:4], y[:4]))
    seen: list[torch.Tensor] = []
    model = nn.Sequential(nn.Linear(4, 2))

    def record(mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if mod.training:
            seen.append(args[0][:, 0].detach().clone())

    model.register_forward_pre_hook(record)
    return model, data, seen


@pytest.mark.parametrize("mode", ["subset", "heldout"])
def test_the_client_trains_on_all_of_d_unless_d_is_held_out(mode: MetaSplit) -> None:
    model, data, seen = _recording_case()
    algo = MetaBayFL(
        train=LocalTraining(local_steps=30, batch_size=8),
        posterior="none",
        temp_steps=2,
        meta_split=mode,
    )
    state = algo.init_server(model, torch.Generator())
    algo.client_update(algo.broadcast(state, 0, 0), None, model, data, torch.Generator())
    trained = set(torch.cat(seen).tolist())
    _, d = meta_split(data, algo.meta_fraction, algo.meta_split, algo.meta_seed(torch.Generator()))
    in_d = set(d.x[:, 0].tolist())
    if mode == "subset":  # 30 steps of 8 over 40 examples: every example, d included
        assert trained == set(data.train.x[:, 0].tolist())
    else:
        assert trained.isdisjoint(in_d) and len(trained) == 40 - len(in_d)


def test_combine_gaussians_rules() -> None:
    mu = [torch.tensor([0.0]), torch.tensor([2.0])]
    rho = [torch.tensor([-5.0]), torch.tensor([-2.0])]
    w = [1.0, 1.0]
    sp = torch.nn.functional.softplus
    m, r = combine_gaussians(mu, rho, w, "mean")
    assert torch.allclose(m, torch.tensor([1.0])) and torch.allclose(r, torch.tensor([-3.5]))
    assert math.isclose(float(sp(r)), 0.0298, abs_tol=1e-3)  # reference notes 0.6 (A): 0.030
    _, r = combine_gaussians(mu, rho, w, "sigma")
    assert math.isclose(float(sp(r)), 0.0668, abs_tol=1e-3)  # (B): 0.067
    _, r = combine_gaussians(mu, rho, w, "moment")
    s1, s2 = float(sp(rho[0])), float(sp(rho[1]))
    assert math.isclose(float(sp(r)) ** 2, 0.5 * (s1**2 + s2**2) + 1.0, rel_tol=1e-4)  # + spread
    m, r = combine_gaussians(mu, rho, w, "precision")
    p1, p2 = 0.5 / s1**2, 0.5 / s2**2
    assert math.isclose(float(m), 2.0 * p2 / (p1 + p2), rel_tol=1e-4)
    assert math.isclose(float(sp(r)), (p1 + p2) ** -0.5, rel_tol=1e-4)
    same = combine_gaussians([mu[0], mu[0]], [rho[1], rho[1]], [3.0, 1.0], "precision")
    assert torch.allclose(same[0], mu[0]) and torch.allclose(same[1], rho[1], atol=1e-5)


def test_server_combines_posteriors_by_rule() -> None:
    model = {
        "l.weight_mu": torch.zeros(2),
        "l.weight_rho": torch.full((2,), -3.0),
        "b": torch.zeros(2),
    }
    ups = [
        {"l.weight_mu": torch.ones(2), "l.weight_rho": torch.zeros(2), "b": torch.ones(2)},
        {"l.weight_mu": -torch.ones(2), "l.weight_rho": torch.full((2,), 2.0), "b": torch.ones(2)},
    ]
    mean = MetaBayFL().mean_update(model, ups, [1.0, 1.0])
    assert torch.allclose(mean["l.weight_rho"], torch.ones(2))
    sig = MetaBayFL(posterior_aggregation="sigma").mean_update(model, ups, [1.0, 1.0])
    s = torch.nn.functional.softplus(torch.tensor([-3.0, -1.0]))
    combined = torch.nn.functional.softplus(model["l.weight_rho"] + sig["l.weight_rho"])
    assert torch.allclose(combined, s.mean().expand(2), atol=1e-6)  # sigma averaged
    assert torch.allclose(sig["b"], torch.ones(2))  # deterministic tensors always average


def test_fedprox_term_pulls_towards_the_global_model() -> None:
    algo = FedProx(mu=0.5)
    model = nn.Linear(2, 1)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    (term,) = algo.loss_terms(start)
    assert float(term(model).detach()) == 0.0
    with torch.no_grad():
        model.weight += 2.0
    loss = term(model)
    loss.backward()
    assert math.isclose(
        float(loss.detach()), 0.5 * 0.5 * 4.0 * 2, rel_tol=1e-6
    )  # (mu/2) ||dW||^2, 2 entries
    assert model.weight.grad is not None
    assert torch.allclose(model.weight.grad, torch.full((1, 2), 0.5 * 2.0))  # mu (w - w^t)
    with pytest.raises(ValueError, match="mu = 0 is FedAvg"):
        FedProx(mu=0.0)


def test_bad_hyperparameters_are_refused() -> None:
    for bad in (
        {"candidate_lrs": ()},
        {"candidate_lrs": (-1.0,)},
        {"temp_steps": 0},
        {"meta_fraction": 1.0},
        {"meta_split": "both"},
        {"meta_score": "kl"},
        {"prior_sigma": 0.0},
        {"posterior_aggregation": "median"},
        {"dropout": 1.0},
    ):
        with pytest.raises(ValueError, match="invalid"):
            MetaBayFL.of(**bad)


def test_a_bad_search_setting_is_refused_with_what_is_valid() -> None:
    """Each refusal names the key, the value and what a valid value is; a rate listed twice
    (also spelled differently, 1e-2 and 0.01) is refused, not tried twice per search."""
    for bad, valid in (
        ({"candidate_lrs": (1e-2, 0.0)}, "each > 0"),
        ({"candidate_lrs": (1e-2, -1e-3)}, "each > 0"),
        ({"meta_fraction": 0.0}, "strictly between 0 and 1"),
        ({"meta_fraction": 1.0}, "strictly between 0 and 1"),
        ({"temp_steps": 0}, "at least 1"),
        ({"prior_sigma": -1.0}, "finite and > 0"),
    ):
        key = next(iter(bad))
        with pytest.raises(ValueError, match=rf"invalid {key}=.*: must be .*{valid}"):
            MetaBayFL.of(**bad)
    for lrs, twice in (((1e-2, 0.01, 1e-3), "0.01"), ((1e-3, 1e-4, 1e-3, 1e-4), "0.0001, 0.001")):
        with pytest.raises(ValueError, match=rf"invalid candidate_lrs=.*: {twice} listed more"):
            MetaBayFL.of(candidate_lrs=lrs)
    cfg = load_config(None, ["method.meta_bayfl.candidate_lrs=[1e-2,0.01]"])
    with pytest.raises(ValueError, match=r"method\.meta_bayfl: invalid candidate_lrs"):
        make_algorithm("meta_bayfl", cfg)
    assert MetaBayFL.of(candidate_lrs=(1e-2, 1e-3)).candidate_lrs == (1e-2, 1e-3)


def test_a_search_setting_without_a_search_is_refused() -> None:
    """With ``lr_search="none"`` (BayFL's, or set) no search runs, so a search setting would
    change nothing: ``method.bayfl.meta_split=heldout`` does not take d out of BayFL's training
    data. The refusal names the settings and lr_search; the defaults, and the same settings with
    a search, pass."""
    for overrides, named in (
        (["method.bayfl.meta_split=heldout"], "meta_split='heldout'"),
        (
            ["method.bayfl.candidate_lrs=[1e-1]", "method.bayfl.temp_steps=3"],
            r"candidate_lrs=\(0\.1,\), temp_steps=3",
        ),
    ):
        cfg = load_config(None, ["algorithms=[bayfl]", *overrides])
        with pytest.raises(ValueError, match=rf"^method\.bayfl: {named} with lr_search='none'"):
            make_algorithm("bayfl", cfg)
    with pytest.raises(ValueError, match=r"trials='batched' with lr_search='none'"):
        MetaBayFL.of(lr_search="none", trials="batched")
    assert MetaBayFL.of(lr_search="none").candidate_lrs == (1e-2, 1e-3, 1e-4)
    assert MetaBayFL.of(meta_split="heldout", temp_steps=3).meta_split == "heldout"


def test_run_records_chosen_lrs_and_local_and_global_metrics(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "name=bayes",
            "num_clients=3",
            "rounds=2",
            "local_steps=6",
            "batch_size=16",
            "algorithms=[meta_bayfl]",
            "model.kwargs={hidden: [16]}",
            "partition.min_size=10",
            "eval.clients=true",
            "eval.local=true",
            "eval.mc_samples=4",
            "method.meta_bayfl.temp_steps=2",
            f"output_dir={tmp_path}",
            "progress=false",
        ],
    )
    summary = run_one(cfg, "meta_bayfl", 42)
    assert summary is not None
    rows = [
        json.loads(x)
        for x in (run_dir(cfg, "meta_bayfl", 42) / "metrics.jsonl").read_text().splitlines()
    ]
    for row in rows:
        assert set(row["lr_chosen"]) == {"0", "1", "2"}
        assert all(v in (1e-2, 1e-3, 1e-4) for v in row["lr_chosen"].values())
        assert row["client_train_s"] > 0
    last = rows[-1]
    for key in (
        "local_accuracy",
        "local_loss",
        "local_ece",
        "client_accuracy",
        "client_ece",
        "ece",
    ):
        assert math.isfinite(last[key]), key
    assert "local_accuracy" not in rows[0]  # P-local is scored in the last round only
    assert summary["local_accuracy"] == last["local_accuracy"]
    assert summary["client_train_s_per_round"] > 0
    assert isinstance(make_algorithm("meta_bayfl", cfg), MetaBayFL)


def test_bnn_sends_twice_the_bytes_of_fedavg(tmp_path: Path) -> None:
    base = [
        "num_clients=2",
        "rounds=1",
        "local_steps=2",
        "model.kwargs={hidden: [16]}",
        "partition.min_size=10",
        f"output_dir={tmp_path}",
        "progress=false",
    ]
    out = {}
    for m in ("fedavg", "bayfl"):
        cfg = load_config(None, [*base, f"name={m}", f"algorithms=[{m}]"])
        s = run_one(cfg, m, 42)
        assert s is not None
        out[m] = s["bytes_up_total"]
    assert out["bayfl"] == 2 * out["fedavg"]


def test_prepare_model_converts_once() -> None:
    net = nn.Sequential(nn.Linear(3, 2))
    algo = MetaBayFL()
    first = algo.prepare_model(net)
    names = list(first.state_dict())
    assert is_bayesian(first) and list(algo.prepare_model(first).state_dict()) == names


def _trial_splits() -> tuple[TensorSplit, TensorSplit]:
    """A search case: 96 fit and 24 held-out 8x8 images of 3 classes (seeded)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(120, 1, 8, 8, generator=g), torch.randint(0, 3, (120,), generator=g)
    return TensorSplit(x[:96], y[:96]), TensorSplit(x[96:], y[96:])


def _trial_model() -> nn.Module:
    """The same small CNN (seeded) for each way of running the trials."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(72, 3))


@pytest.mark.parametrize("score", ["nll", "elbo"])
@pytest.mark.parametrize("posterior", ["none", "bnn", "mcdropout"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_batched_trials_equal_sequential_trials(
    posterior: Literal["none", "bnn", "mcdropout"],
    optimizer: Literal["adamw", "sgd"],
    score: MetaScore,
) -> None:
    fit, meta = _trial_splits()
    out = {}
    for trials in ("sequential", "batched"):
        model = _trial_model()
        algo = MetaBayFL(
            train=LocalTraining(batch_size=16, mc_samples=3),
            posterior=posterior,
            local_optimizer=optimizer,
            trials=trials,
            temp_steps=4,
            meta_score=score,
        )
        algo.prepare_model(model)
        opt = algo.make_optimizer(model)
        terms = [elbo_kl_term(1.0, 96)] if posterior == "bnn" else []
        pre = torch.Generator().manual_seed(3)  # two steps first: the trials continue Adam
        local_train(model, minibatches(fit, 16, 2, pre), opt, [1e-3, 1e-3], loss_terms=terms)
        with sampling(model, True):
            out[trials] = algo.select_lr(model, opt, fit, meta, terms, seed=7)
    assert out["sequential"][0] == out["batched"][0]
    assert torch.allclose(
        torch.tensor(out["sequential"][1]), torch.tensor(out["batched"][1]), rtol=1e-4
    )


def test_yaml_numbers_without_a_dot_are_numbers() -> None:
    cfg = load_config(
        None, ["method.meta_bayfl.candidate_lrs=[1e-2,1e-3]", "method.meta_bayfl.beta_kl=1e-1"]
    )
    algo = make_algorithm("meta_bayfl", cfg)
    assert isinstance(algo, MetaBayFL)
    assert algo.candidate_lrs == (1e-2, 1e-3) and algo.beta_kl == 0.1
    bad = load_config(None, ["method.meta_bayfl.candidate_lrs=[fast]"])
    with pytest.raises(
        ValueError, match=r"method\.meta_bayfl\.candidate_lrs\[0\]: Input should be a valid number"
    ):
        make_algorithm("meta_bayfl", bad)


def test_batched_trials_count_the_kl_of_frozen_layers() -> None:
    _, fit, meta = _regression_case()
    out = {}
    for trials in ("sequential", "batched"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        algo = MetaBayFL(
            trials=trials,
            candidate_lrs=(0.1, 0.01, 0.001),
            temp_steps=3,
            meta_score="elbo",  # the KL of the frozen rho only enters the ELBO score
        )
        algo.prepare_model(model)
        for name, p in model.named_parameters():
            p.requires_grad_(not name.endswith("_rho"))  # params.freeze=["*_rho"]
        opt = algo.make_optimizer(model)
        terms = [elbo_kl_term(1.0, len(fit))]
        with sampling(model, True):
            out[trials] = algo.select_lr(model, opt, fit, meta, terms, seed=2)
    assert out["sequential"][0] == out["batched"][0]
    assert torch.allclose(
        torch.tensor(out["sequential"][1]), torch.tensor(out["batched"][1]), rtol=1e-4
    )


def test_combine_gaussians_keeps_tiny_sigmas() -> None:
    mu = [torch.zeros(3), torch.zeros(3)]
    rho = [torch.full((3,), -200.0), torch.full((3,), -200.0)]
    for rule in ("mean", "sigma", "moment", "precision"):
        m, r = combine_gaussians(mu, rho, [1.0, 2.0], rule)
        assert torch.allclose(m, mu[0]) and torch.allclose(r, rho[0], rtol=1e-5), (rule, r)


def test_a_client_with_one_example_searches_on_it_unless_d_is_held_out() -> None:
    model, fit, _ = _regression_case()
    one = ClientData(0, fit.subset(torch.tensor([0])), fit.subset(torch.tensor([1])))
    cases: tuple[tuple[MetaSplit, bool], ...] = (("heldout", False), ("subset", True))
    for mode, searches in cases:
        algo = MetaBayFL(
            train=LocalTraining(local_steps=2, batch_size=4), posterior="none", meta_split=mode
        )
        state = algo.init_server(model, torch.Generator())
        msg = algo.broadcast(state, 0, 0)
        reply, _ = algo.client_update(msg, None, model, one, torch.Generator().manual_seed(0))
        assert reply.num_examples == 1 and ("lr_chosen" in reply.metrics) is searches
        assert any(float(v.abs().sum()) > 0 for v in reply.arrays.values())


@pytest.mark.parametrize("score", ["nll", "elbo"])
def test_batched_trials_match_with_sgd_weight_decay_and_a_large_meta_split(
    score: MetaScore,
) -> None:
    """torch SGD adds the weight decay to the gradient, and the ELBO score draws one weight
    sample per 512 examples of d: the batched trials do the same."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(700, 6, generator=g), torch.randint(0, 3, (700,), generator=g)
    fit, meta = TensorSplit(x[:100], y[:100]), TensorSplit(x[100:], y[100:])  # |d| = 600
    out = {}
    for trials in ("sequential", "batched"):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        algo = MetaBayFL(
            train=LocalTraining(weight_decay=0.1, batch_size=20, mc_samples=2),
            trials=trials,
            local_optimizer="sgd",
            candidate_lrs=(0.5, 0.05),
            temp_steps=3,
            meta_score=score,
        )
        algo.prepare_model(model)
        opt = algo.make_optimizer(model)
        terms = [elbo_kl_term(1.0, len(fit))]
        with sampling(model, True):
            out[trials] = algo.select_lr(model, opt, fit, meta, terms, seed=4)
    torch.testing.assert_close(
        torch.tensor(out["sequential"][1]), torch.tensor(out["batched"][1]), rtol=1e-4, atol=0
    )


@pytest.mark.parametrize("posterior", ["bnn", "mcdropout"])
def test_candidates_scored_in_channels_last_equal_the_reference_scores(
    posterior: Literal["bnn", "mcdropout"],
) -> None:
    """The search scores each trial copy in the channels-last layout (issue 19): the same
    scores, to float rounding, and the same choice as scoring it in its own layout."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(80, 1, 8, 8, generator=g), torch.randint(0, 3, (80,), generator=g)
    fit, meta = TensorSplit(x[:64], y[:64]), TensorSplit(x[64:], y[64:])
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(27, 3)
    )
    algo = MetaBayFL(
        train=LocalTraining(batch_size=16, mc_samples=3),
        posterior=posterior,
        candidate_lrs=(1e-1, 1e-2, 1e-3),
        temp_steps=3,
        conv_dropout=0.2 if posterior == "mcdropout" else 0.0,  # the BNN refuses it
    )
    algo.prepare_model(model)
    opt = algo.make_optimizer(model)
    terms = [elbo_kl_term(1.0, 64)] if posterior == "bnn" else []
    with sampling(model, True):
        chosen, scores = algo.select_lr(model, opt, fit, meta, terms, seed=5)
        ref = []  # the search before issue 19: each copy scored in its own (NCHW) layout
        for lr in algo.candidate_lrs:
            trial = copy.deepcopy(model)
            topt = algo.make_optimizer(trial)
            topt.load_state_dict(copy.deepcopy(opt.state_dict()))
            with torch.random.fork_rng():
                torch.manual_seed(5)
                batches = minibatches(fit, 16, 3, torch.Generator().manual_seed(5))
                local_train(trial, batches, topt, [lr] * 3, loss_terms=terms)
                ref.append(meta_nll(trial, meta, 3))
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(ref), rtol=1e-5, atol=0)
    assert chosen == pick_lowest(algo.candidate_lrs, ref)
    assert len(set(ref)) == 3  # the candidates differ, so the comparison means something
    first = model[0]
    weight = first.weight_mu if posterior == "bnn" else first.weight
    assert isinstance(weight, torch.Tensor) and weight.is_contiguous()


@pytest.mark.parametrize("name", ["meta_bayfl", "bayfl", "pfedbayes"])
def test_bnn_estimator_reaches_the_layers_and_the_mc_predictive(name: str) -> None:
    from fedlore.bayes import BayesConv2d, BayesLinear
    from fedlore.train.local import predictive_log_probs

    algo = make_algorithm(name, load_config(None, [f"method.{name}.bnn_estimator=local"]))
    assert algo.bnn_estimator == "local"  # type: ignore[attr-defined]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(72, 3))
    algo.prepare_model(model)  # type: ignore[attr-defined]
    kinds = {
        type(m): m.estimator for m in model.modules() if isinstance(m, BayesLinear | BayesConv2d)
    }
    assert kinds == {BayesConv2d: "local", BayesLinear: "local"}
    x = torch.rand(1, 1, 8, 8).repeat(2, 1, 1, 1)  # one example twice
    local = predictive_log_probs(model, x, mc_samples=1)
    assert not torch.allclose(local[0], local[1])  # a pre-activation draw per example
    default = make_algorithm(name, load_config(None, []))
    default.prepare_model(model)  # type: ignore[attr-defined]
    same = predictive_log_probs(model, x, mc_samples=1)
    assert torch.equal(same[0], same[1])  # one weight draw shared by the batch


def test_bad_bnn_estimators_are_refused() -> None:
    bad = load_config(None, ["method.meta_bayfl.bnn_estimator=flipout"])
    with pytest.raises(ValueError, match=r"bnn_estimator: Input should be 'weights' or 'local'"):
        make_algorithm("meta_bayfl", bad)
    with pytest.raises(ValueError, match=r"bnn_estimator=.local.*posterior=.none."):
        make_algorithm("meta_fl", load_config(None, ["method.meta_fl.bnn_estimator=local"]))
    with pytest.raises(ValueError, match="bnn_estimator"):
        make_algorithm("pfedbayes", load_config(None, ["method.pfedbayes.bnn_estimator=x"]))


def test_a_setting_of_another_posterior_is_refused() -> None:
    """The BNN's settings (beta_kl, prior_mu, prior_sigma, rho_init) do nothing without a BNN,
    MC dropout's (dropout, conv_dropout) nothing without MC dropout: either is refused, with
    the setting and the posterior, where the other posterior runs; the defaults pass."""
    for name, override, named in (
        ("meta_bayfl_mcd", "beta_kl=0.1", "beta_kl=0.1 with posterior='mcdropout'"),
        ("meta_fl", "rho_init=-3", "rho_init=-3.0 with posterior='none'"),
        ("meta_bayfl", "dropout=0.2", "dropout=0.2 with posterior='bnn'"),
        ("fedavg_mcd", "prior_sigma=0.5", "prior_sigma=0.5 with posterior='mcdropout'"),
    ):
        cfg = load_config(None, [f"algorithms=[{name}]", f"method.{name}.{override}"])
        with pytest.raises(ValueError, match=rf"^method\.{name}: {named}: only posterior="):
            make_algorithm(name, cfg)
    assert MetaBayFL.of(posterior="mcdropout", dropout=0.2).dropout == 0.2
    assert MetaBayFL.of(posterior="none").beta_kl == 1.0


def test_meta_bayfl_with_the_local_estimator_trains_a_client() -> None:
    model, fit, _ = _regression_case()
    data = ClientData(0, fit, fit.subset(torch.arange(10)))
    algo = MetaBayFL(
        train=LocalTraining(local_steps=4, batch_size=16), bnn_estimator="local", temp_steps=2
    )
    state = algo.init_server(model, torch.Generator())
    reply, _ = algo.client_update(
        algo.broadcast(state, 0, 0), None, model, data, torch.Generator().manual_seed(0)
    )
    assert reply.metrics["skipped_steps"] == 0 and math.isfinite(float(reply.metrics["train_loss"]))
    assert "lr_chosen" in reply.metrics
    rho = [v for k, v in reply.arrays.items() if k.endswith("weight_rho")]
    assert rho and float(rho[0].abs().sum()) > 0  # sigma is trained


def test_batched_trials_match_sequential_trials_under_the_local_estimator() -> None:
    """vmap's shared randomness draws the same pre-activation noise for every candidate."""
    fit, meta = _trial_splits()
    out = {}
    for trials in ("sequential", "batched"):
        model = _trial_model()
        algo = MetaBayFL(
            train=LocalTraining(batch_size=16, mc_samples=3),
            trials=trials,
            temp_steps=4,
            bnn_estimator="local",
        )
        algo.prepare_model(model)
        opt = algo.make_optimizer(model)
        with sampling(model, True):
            out[trials] = algo.select_lr(model, opt, fit, meta, [elbo_kl_term(1.0, 96)], seed=7)
    assert out["sequential"][0] == out["batched"][0]
    torch.testing.assert_close(
        torch.tensor(out["sequential"][1]), torch.tensor(out["batched"][1]), rtol=1e-5, atol=0
    )
