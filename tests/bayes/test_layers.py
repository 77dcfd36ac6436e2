"""Mean-field Gaussian layers, KL, prior, MC dropout, the converters, the MC predictive."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.distributions import Normal
from torch.distributions import kl_divergence as torch_kl

from fedlore.bayes import (
    BayesConv2d,
    BayesLinear,
    GaussianPrior,
    MCDropoutLinear,
    add_mc_dropout,
    bayesianize,
    gaussian_kl,
    inverse_softplus,
    is_bayesian,
    kl_divergence,
    log_prior,
    log_softplus,
    sampling,
    set_estimator,
)
from fedlore.data.client_data import TensorSplit
from fedlore.models import build_model
from fedlore.train.local import evaluate, predictive_log_probs


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return build_model("cnn", (1, 8, 8), 3, channels=(2, 3), hidden=5)


def test_kl_is_zero_at_the_prior_and_positive_elsewhere() -> None:
    prior = GaussianPrior(0.3, 0.5)
    layer = BayesLinear(nn.Linear(4, 3), prior, rho_init=0.0)
    with torch.no_grad():
        layer.weight_mu.fill_(0.3)
        layer.bias_mu.fill_(0.3)  # type: ignore[union-attr]
        rho = inverse_softplus(0.5)
        layer.weight_rho.fill_(float(rho))
        layer.bias_rho.fill_(float(rho))  # type: ignore[union-attr]
    assert abs(float(layer.kl().detach())) < 1e-5
    with torch.no_grad():
        layer.weight_mu[0, 0] += 0.1
    assert float(layer.kl().detach()) > 0
    with torch.no_grad():
        layer.weight_mu[0, 0] -= 0.1
        layer.bias_rho[1] -= 1.0  # type: ignore[index]
    assert float(layer.kl().detach()) > 0


def test_kl_matches_torch_distributions() -> None:
    torch.manual_seed(1)
    mu, rho = torch.randn(50), torch.randn(50) * 2 - 3
    ours = gaussian_kl(mu, log_softplus(rho), -0.2, 0.7)
    ref = torch_kl(Normal(mu, torch.nn.functional.softplus(rho)), Normal(-0.2, 0.7)).sum()
    assert torch.allclose(ours, ref, rtol=1e-5)
    model = bayesianize(_cnn(), GaussianPrior(0.0, 1.0), rho_init=-4.0)
    total = sum(float(m.kl()) for m in model.modules() if isinstance(m, BayesLinear | BayesConv2d))
    assert math.isclose(float(kl_divergence(model)), total, rel_tol=1e-6)


def test_log_prior_of_a_weight_far_in_the_tail_is_finite() -> None:
    prior = GaussianPrior(0.0, 1.0)
    far = torch.tensor([1e20, -3e19, 40.0])
    value = prior.log_prob(far)
    assert math.isfinite(float(value)) and float(value) < -1e38
    # the density itself underflows to 0 here; its log, computed in log space, does not
    assert float(Normal(0.0, 1.0).log_prob(torch.tensor(40.0)).exp()) == 0.0
    assert math.isclose(
        float(prior.log_prob(torch.tensor([40.0]))), -800.0 - 0.5 * math.log(2 * math.pi)
    )
    layer = BayesLinear(nn.Linear(2, 1), prior, rho_init=-300.0)  # sigma underflows in fp32
    assert math.isfinite(float(layer.kl().detach()))  # log sigma = rho, not log(0)
    with torch.no_grad():
        layer.weight_mu.fill_(1e20)
    assert math.isfinite(float(layer.log_prior().detach()))
    assert torch.equal(log_softplus(torch.tensor([-300.0])), torch.tensor([-300.0]))


def test_sampling_flag_is_independent_of_train_and_eval() -> None:
    model = bayesianize(_cnn(), rho_init=-1.0)
    x = torch.rand(4, 1, 8, 8)
    model.eval()
    with sampling(model, True):
        a, b = model(x), model(x)
    assert not torch.allclose(a, b)  # eval mode still samples
    model.train()
    with sampling(model, False):
        c, d = model(x), model(x)
    assert torch.equal(c, d)  # train mode with sampling off uses the means
    assert all(m.sampling for m in model.modules() if hasattr(m, "sampling"))  # restored


def test_bayesianize_keeps_the_deterministic_model_as_its_mean() -> None:
    det = _cnn()
    x = torch.rand(4, 1, 8, 8)
    ref = det(x)
    model = bayesianize(det, rho_init=-5.0)
    names = list(model.state_dict())
    assert "fc.weight_mu" in names and "fc.weight_rho" in names and "fc.weight" not in names
    assert is_bayesian(model)
    with sampling(model, False):
        assert torch.allclose(model(x), ref)
    assert bayesianize(model) is model and list(model.state_dict()) == names  # idempotent
    fc = model.fc
    assert isinstance(fc, BayesLinear)
    sigma = torch.nn.functional.softplus(fc.weight_rho)
    assert torch.allclose(sigma, torch.full_like(sigma, 0.0067153), atol=1e-6)


def test_mc_dropout_keeps_names_and_turns_off_with_the_flag() -> None:
    det = _cnn()
    x = torch.rand(8, 1, 8, 8)
    ref = det(x)
    names = list(det.state_dict())
    model = add_mc_dropout(det, p=0.5)
    assert list(model.state_dict()) == names
    assert isinstance(model.fc, MCDropoutLinear)
    model.eval()
    with sampling(model, False):
        assert torch.allclose(model(x), ref)
    with sampling(model, True):
        assert not torch.allclose(model(x), model(x))
    with pytest.raises(ValueError, match="MC dropout p"):
        add_mc_dropout(_cnn(), p=1.0)


def test_mc_predictive_averages_probabilities_not_log_probabilities() -> None:
    model = bayesianize(_cnn(), rho_init=0.0)
    x = torch.rand(6, 1, 8, 8)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    log_p = predictive_log_probs(model, x, mc_samples=7)
    assert torch.allclose(log_p.exp().sum(-1), torch.ones(6), atol=1e-5)
    # same seed -> same draws -> same predictive; more draws -> another estimate
    assert torch.equal(log_p, predictive_log_probs(model, x, mc_samples=7))
    assert not torch.allclose(log_p, predictive_log_probs(model, x, mc_samples=3))
    res = evaluate(model, TensorSplit(x, y), mc_samples=7)
    nll = -log_p[torch.arange(6), y].mean()
    assert math.isclose(res["loss"], float(nll), rel_tol=1e-5)
    assert 0.0 <= res["ece"] <= 1.0
    # Jensen: the NLL of the averaged probabilities is at most the mean NLL of the draws
    stacked = torch.stack([torch.log_softmax(model(x), -1) for _ in range(3)])
    avg = torch.logsumexp(stacked, 0) - math.log(3)
    assert float(-avg[torch.arange(6), y].mean()) <= float(-stacked[:, torch.arange(6), y].mean())


def test_deterministic_model_ignores_mc_samples() -> None:
    model = _cnn()
    x = torch.rand(5, 1, 8, 8)
    assert torch.equal(
        predictive_log_probs(model, x, mc_samples=20), predictive_log_probs(model, x)
    )


def test_log_prior_sums_layers() -> None:
    model = bayesianize(_cnn())
    total = sum(
        float(m.log_prior()) for m in model.modules() if isinstance(m, BayesLinear | BayesConv2d)
    )
    assert math.isclose(float(log_prior(model)), total, rel_tol=1e-9)


def test_bad_prior_and_conv_mode_are_refused() -> None:
    with pytest.raises(ValueError, match="sigma > 0"):
        GaussianPrior(0.0, 0.0)
    with pytest.raises(ValueError, match="padding_mode"):
        BayesConv2d(nn.Conv2d(1, 1, 3, padding_mode="reflect"), GaussianPrior(), -5.0)
    with pytest.raises(ValueError, match=r"no nn\.Linear or nn\.Conv2d"):
        bayesianize(nn.Sequential(nn.ReLU()))


def test_diverged_predictions_score_nan_not_chance() -> None:
    from fedlore.train.local import classification_metrics

    res = classification_metrics(torch.full((10, 10), float("nan")), torch.arange(10))
    assert all(math.isnan(res[k]) for k in ("accuracy", "loss", "ece"))


def test_mc_dropout_that_drops_nothing_is_refused() -> None:
    convs = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
    with pytest.raises(ValueError, match="drops nothing"):
        add_mc_dropout(convs, p=0.5, conv_p=0.2)  # the first conv never drops
    with pytest.raises(ValueError, match="drops nothing"):
        add_mc_dropout(_cnn(), p=0.0)


def _local_case() -> tuple[BayesLinear, torch.Tensor]:
    """A BayesLinear with unequal sigmas per weight and a bias sigma that matters, and inputs
    of unequal scale (so a transposed or missing variance term shows)."""
    g = torch.Generator().manual_seed(5)
    layer = BayesLinear(nn.Linear(6, 4), GaussianPrior(), rho_init=-1.0)
    with torch.no_grad():
        layer.weight_mu.copy_(torch.randn(4, 6, generator=g))
        layer.weight_rho.copy_(torch.rand(4, 6, generator=g) * 2.0 - 2.0)  # sigma 0.13 .. 0.69
        layer.bias_mu.copy_(torch.randn(4, generator=g))  # type: ignore[union-attr]
        layer.bias_rho.copy_(torch.tensor([0.5, -1.0, 0.0, 1.0]))  # type: ignore[union-attr]
    x = torch.randn(3, 6, generator=g) * torch.tensor([[2.0], [0.5], [1.0]])
    return layer, x


def test_local_estimator_matches_the_moments_of_weight_sampling() -> None:
    """Kingma et al. 2015 Eq. 6: b ~ N(x mu_W^T + mu_b, x² sigma_W²^T + sigma_b²), the exact
    marginal of one pre-activation under a weight draw; both estimators' sample means and
    variances over many draws agree with it within five standard errors."""
    layer, x = _local_case()
    sw = torch.nn.functional.softplus(layer.weight_rho.detach())
    sb = torch.nn.functional.softplus(layer.bias_rho.detach())  # type: ignore[union-attr]
    mean = x @ layer.weight_mu.detach().T + layer.bias_mu.detach()  # type: ignore[union-attr]
    var = (x * x) @ (sw * sw).T + sb * sb
    n = 4000
    torch.manual_seed(11)
    with torch.no_grad():
        draws = {"weights": torch.stack([layer(x) for _ in range(n)])}  # one W per draw
        layer.estimator = "local"
        draws["local"] = layer(x.repeat(n, 1)).view(n, 3, 4)  # one draw per example
    se_mean = (var / n).sqrt()
    se_var = var * math.sqrt(2.0 / (n - 1))
    for name, d in draws.items():
        assert bool(((d.mean(0) - mean).abs() < 5 * se_mean).all()), name
        assert bool(((d.var(0) - var).abs() < 5 * se_var).all()), name
    # the tolerance has power: the variance without sigma_b², or with sigma for sigma², fails
    wrong = [(x * x) @ (sw * sw).T, (x * x) @ sw.T + sb]
    for bad in wrong:
        assert not bool(((draws["local"].var(0) - bad).abs() < 5 * se_var).all())


def test_local_estimator_trains_sigma_and_uses_the_means_with_sampling_off() -> None:
    layer, x = _local_case()
    layer.estimator = "local"
    torch.manual_seed(0)
    layer(x).pow(2).sum().backward()
    assert layer.weight_rho.grad is not None and float(layer.weight_rho.grad.abs().sum()) > 0
    assert layer.bias_rho is not None and layer.bias_rho.grad is not None
    assert float(layer.bias_rho.grad.abs().sum()) > 0
    with sampling(layer, False):
        ref = torch.nn.functional.linear(x, layer.weight_mu, layer.bias_mu)
        assert torch.equal(layer(x), ref)
    # per-example noise: two copies of one example get different pre-activations
    twice = layer(torch.cat([x[:1], x[:1]]))
    assert not torch.allclose(twice[0], twice[1])
    with torch.no_grad():  # a variance that underflows keeps finite outputs and gradients
        layer.weight_rho.fill_(-200.0)
        layer.bias_rho.fill_(-200.0)
    layer.zero_grad()
    layer(torch.zeros(2, 6)).sum().backward()
    assert bool(torch.isfinite(layer.weight_rho.grad).all())


def test_estimator_is_set_on_every_bayesian_layer_and_checked() -> None:
    model = bayesianize(_cnn(), estimator="local")
    layers = [m for m in model.modules() if isinstance(m, BayesLinear | BayesConv2d)]
    assert layers and all(m.estimator == "local" for m in layers)
    assert bayesianize(model) is model  # idempotent conversion, estimator set again
    assert all(m.estimator == "weights" for m in layers)
    assert set_estimator(model, "local") is model and all(m.estimator == "local" for m in layers)
    assert "estimator=local" in repr(model.fc)
    with pytest.raises(ValueError, match="accepted: weights, local"):
        set_estimator(model, "flipout")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown BNN estimator"):
        bayesianize(_cnn(), estimator="bad")  # type: ignore[arg-type]
    # a conv keeps one weight draw per pass under "local": all examples share its noise
    features = model.features
    assert isinstance(features, nn.Sequential)
    conv = features[0]
    x = torch.rand(1, 1, 8, 8).repeat(2, 1, 1, 1)
    out = conv(x)
    assert torch.equal(out[0], out[1])


def test_flattened_kl_equals_the_per_layer_sums() -> None:
    from fedlore.bayes import gaussian_kl_between, posterior_kl

    model = bayesianize(_cnn(), GaussianPrior(0.0, 1.0), rho_init=-3.0)
    model.fc.prior = GaussianPrior(0.2, 0.5)  # type: ignore[union-attr]  # two priors: two passes
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    layers = [m for m in model.modules() if isinstance(m, BayesLinear | BayesConv2d)]
    per_layer = sum(float(m.kl().detach()) for m in layers)
    ref = 0.0  # torch.distributions, element by element, float64
    for m in layers:
        for mu, rho in ((m.weight_mu, m.weight_rho), (m.bias_mu, m.bias_rho)):
            assert mu is not None and rho is not None  # the CNN's layers have biases
            q = Normal(mu.detach().double(), torch.nn.functional.softplus(rho.detach().double()))
            ref += float(torch_kl(q, Normal(m.prior.mu, m.prior.sigma)).sum())
    assert math.isclose(float(kl_divergence(model)), per_layer, rel_tol=1e-6)
    assert math.isclose(float(kl_divergence(model)), ref, rel_tol=1e-5)
    other = bayesianize(_cnn(), rho_init=-2.0)
    pairs = zip(model.parameters(), other.parameters(), strict=True)
    flat = [(a.reshape(-1), b.reshape(-1)) for a, b in pairs]
    mus, rhos = flat[0::2], flat[1::2]  # params alternate weight_mu, weight_rho, bias_mu, ...
    by_tensor = sum(
        float(gaussian_kl_between(mq, log_softplus(rq), mp, log_softplus(rp)))
        for (mq, mp), (rq, rp) in zip(mus, rhos, strict=True)
    )
    assert math.isclose(float(posterior_kl(model, other)), by_tensor, rel_tol=1e-5)
    assert abs(float(posterior_kl(model, model))) < 1e-2  # KL(q || q) = 0 (sum of ~1.6k terms)


def test_a_channels_last_model_draws_the_same_weights() -> None:
    model = bayesianize(_cnn(), rho_init=-1.0).eval()
    last = copy.deepcopy(model).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x = torch.rand(4, 1, 8, 8)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        ref = model(x)
        torch.manual_seed(3)
        out = last(x)
    assert torch.allclose(out, ref, atol=1e-6)
    conv = last.features[3]
    features = model.features
    assert isinstance(features, nn.Sequential) and isinstance(features[3], BayesConv2d)
    assert conv.weights()[0].stride() == conv.weight_mu.stride() != features[3].weight_mu.stride()
