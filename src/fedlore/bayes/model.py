"""Operations on a whole model: converting a registered model into its Bayesian or MC-dropout
twin in place (:func:`bayesianize`, :func:`add_mc_dropout`), the estimator and sampling switches,
the seeded sampling block, and the model-wide sums of the layers' Gaussian math: ``KL(q || p)``
over every Bayesian layer (seed 001, the Meta-BayFL paper, arXiv 2603.18083, Eq. 16, the
ELBO's KL of Eq. 17), ``KL(q || p)`` between two models' posteriors, and the log prior.

The layers are in :mod:`fedlore.bayes.layers`, the closed-form math in
:mod:`fedlore.bayes.posterior`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fedlore.bayes.layers import (
    ESTIMATORS,
    BayesConv2d,
    BayesLinear,
    Estimator,
    MCDropoutConv2d,
    MCDropoutLinear,
    Stochastic,
    _BayesMixin,
)
from fedlore.bayes.posterior import GaussianPrior, gaussian_kl, gaussian_kl_between, log_softplus


def posterior_kl(q: nn.Module, p: nn.Module) -> torch.Tensor:
    """``KL(q || p)`` summed over the mean-field Gaussian layers of two models of the same
    architecture (layers paired by name), in nats; the deterministic tensors do not enter.

    Raises:
        ValueError: when the two models' Bayesian layers do not pair up.
    """
    ql = {n: m for n, m in q.named_modules() if isinstance(m, _BayesMixin)}
    pl = {n: m for n, m in p.named_modules() if isinstance(m, _BayesMixin)}
    if ql.keys() != pl.keys():
        raise ValueError(f"posterior_kl: Bayesian layers differ ({sorted(ql)} vs {sorted(pl)})")
    cols: tuple[list[torch.Tensor], ...] = ([], [], [], [])
    for name, a in ql.items():
        b = pl[name]
        pairs = [(a.weight_mu, a.weight_rho, b.weight_mu, b.weight_rho)]
        if a.bias_mu is not None and a.bias_rho is not None and b.bias_mu is not None:
            assert b.bias_rho is not None
            pairs.append((a.bias_mu, a.bias_rho, b.bias_mu, b.bias_rho))
        for pair in pairs:
            if pair[0].shape != pair[2].shape:
                raise ValueError(
                    f"posterior_kl: {name} has shapes {tuple(pair[0].shape)} vs "
                    f"{tuple(pair[2].shape)}"
                )
            for col, t in zip(cols, pair, strict=True):
                col.append(t.reshape(-1))
    if not cols[0]:
        return torch.zeros((), device=_device_of(q))
    # every layer in one flattened pass: a handful of kernels per step, not ~20 per tensor
    mq, rq, mp, rp = (torch.cat(col) for col in cols)
    return gaussian_kl_between(mq, log_softplus(rq), mp, log_softplus(rp))


def _replace(
    model: nn.Module, types: tuple[type, ...], make: Callable[[nn.Module], nn.Module]
) -> int:
    """Swap every descendant whose exact type is in ``types`` (subclasses, i.e. layers already
    converted, are kept) by ``make(child)``; returns how many were swapped."""
    count = 0
    for name, child in list(model.named_children()):
        if type(child) in types:
            setattr(model, name, make(child))
            count += 1
        else:
            count += _replace(child, types, make)
    return count


def bayesianize(
    model: nn.Module,
    prior: GaussianPrior | None = None,
    rho_init: float = -5.0,
    estimator: Estimator = "weights",
) -> nn.Module:
    """Turn every ``nn.Linear`` and ``nn.Conv2d`` of ``model`` into its mean-field Gaussian twin,
    in place; the deterministic weights become the posterior means (so a BNN and its
    deterministic counterpart start from the same means), every rho starts at ``rho_init``.

    State-dict names change from ``<layer>.weight`` to ``<layer>.weight_mu`` /
    ``<layer>.weight_rho`` (likewise for the bias). Norm layers, embeddings and layers already
    converted are left as they are, so the call is idempotent; ``estimator`` is set on every
    Bayesian layer, converted now or before (:func:`set_estimator`).

    Args:
        model: any registered image or feature classifier.
        prior: the prior of every weight (default N(0, 1), reference notes Part 16 #8).
        rho_init: initial rho (default -5: sigma 0.0067).
        estimator: ``"weights"`` (one weight draw per forward pass, the seed's) or ``"local"``
            (local reparameterization in the Linear layers, :class:`BayesLinear`).

    Returns:
        ``model`` itself.

    Raises:
        ValueError: when the model has no Linear or Conv2d layer to convert and none converted,
            or for an unknown ``estimator``.
    """
    prior = prior if prior is not None else GaussianPrior()
    if not math.isfinite(rho_init):
        raise ValueError(f"rho_init must be finite, got {rho_init}")
    _check_estimator(estimator)

    def make(layer: nn.Module) -> nn.Module:
        if isinstance(layer, nn.Conv2d):
            return BayesConv2d(layer, prior, rho_init)
        assert isinstance(layer, nn.Linear)
        return BayesLinear(layer, prior, rho_init)

    n = _replace(model, (nn.Linear, nn.Conv2d), make)
    if n == 0 and not any(isinstance(m, _BayesMixin) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has no nn.Linear or nn.Conv2d to make Bayesian")
    return set_estimator(model, estimator)


def _check_estimator(estimator: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown BNN estimator {estimator!r} (accepted: {', '.join(ESTIMATORS)})")


def set_estimator(model: nn.Module, estimator: Estimator) -> nn.Module:
    """Set how every mean-field Gaussian layer of ``model`` samples (:data:`Estimator`), in
    place; layers without a local estimator (:class:`BayesConv2d`) keep weight sampling.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: for an unknown ``estimator``.
    """
    _check_estimator(estimator)
    for m in model.modules():
        if isinstance(m, _BayesMixin):
            m.estimator = estimator
    return model


def add_mc_dropout(model: nn.Module, p: float = 0.5, conv_p: float = 0.0) -> nn.Module:
    """Put dropout before every ``nn.Linear`` (rate ``p``) and, if ``conv_p > 0``, before every
    ``nn.Conv2d`` except the first (rate ``conv_p``), in place; parameter names are unchanged
    (reference notes Part 6: p = 0.5 before the fully connected layers, optionally 0.1-0.25 in
    the conv blocks).

    Returns:
        ``model`` itself.

    Raises:
        ValueError: for rates outside [0, 1), or when no layer would drop anything (no
            ``nn.Linear`` with ``p > 0`` and no second ``nn.Conv2d`` with ``conv_p > 0``).
    """
    for name, rate in (("p", p), ("conv_p", conv_p)):
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"MC dropout {name} must be in [0, 1), got {rate}")
    first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)

    def make(layer: nn.Module) -> nn.Module:
        new: nn.Module
        if isinstance(layer, nn.Conv2d):
            new = MCDropoutConv2d.__new__(MCDropoutConv2d)
            new.__dict__.update(layer.__dict__)
            new.p = conv_p if layer is not first_conv else 0.0
        else:
            new = MCDropoutLinear.__new__(MCDropoutLinear)
            new.__dict__.update(layer.__dict__)
            new.p = p
        new.sampling = True
        return new

    swap: tuple[type, ...] = (nn.Linear, nn.Conv2d) if conv_p > 0 else (nn.Linear,)
    _replace(model, swap, make)
    dropping = [m for m in model.modules() if isinstance(m, MCDropoutLinear | MCDropoutConv2d)]
    if not any(m.p > 0 for m in dropping):
        raise ValueError(
            f"MC dropout on {type(model).__name__} drops nothing: it needs an nn.Linear with "
            f"p > 0 (got p={p}) or a second nn.Conv2d with conv_p > 0 (got conv_p={conv_p})"
        )
    return model


def kl_divergence(model: nn.Module) -> torch.Tensor:
    """``KL(q || p)`` summed over every Bayesian layer of ``model`` (0 for a model without one):
    :func:`gaussian_kl` of all layers' (mu, rho) concatenated, one pass per prior.

    Returns:
        0-d tensor (nats), differentiable in the variational parameters.
    """
    groups: dict[GaussianPrior, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for m in model.modules():
        if isinstance(m, _BayesMixin):
            mus, rhos = groups.setdefault(m.prior, ([], []))
            mus.append(m.weight_mu.reshape(-1))
            rhos.append(m.weight_rho.reshape(-1))
            if m.bias_mu is not None and m.bias_rho is not None:
                mus.append(m.bias_mu.reshape(-1))
                rhos.append(m.bias_rho.reshape(-1))
    if not groups:
        return torch.zeros((), device=_device_of(model))
    # one flattened pass per prior (usually one): a handful of kernels per step, forward and
    # backward, instead of about twenty per tensor
    terms = [
        gaussian_kl(torch.cat(mus), log_softplus(torch.cat(rhos)), prior.mu, prior.sigma)
        for prior, (mus, rhos) in groups.items()
    ]
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


def log_prior(model: nn.Module) -> torch.Tensor:
    """``log p(mu)`` summed over every Bayesian layer (float64; 0 without one)."""
    terms = [m.log_prior() for m in model.modules() if isinstance(m, _BayesMixin)]
    if not terms:
        return torch.zeros((), dtype=torch.float64, device=_device_of(model))
    return torch.stack(terms).sum()


def _device_of(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters live (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def is_bayesian(model: nn.Module) -> bool:
    """Whether ``model`` has a mean-field Gaussian layer."""
    return any(isinstance(m, _BayesMixin) for m in model.modules())


def is_stochastic(model: nn.Module) -> bool:
    """Whether ``model`` has a layer that samples (Bayesian or MC dropout)."""
    return any(isinstance(m, Stochastic) for m in model.modules())


@contextmanager
def sampling(model: nn.Module, on: bool) -> Iterator[nn.Module]:
    """Switch every stochastic layer's sampling ``on`` or off inside the block, then restore each
    layer's previous flag. Independent of ``model.train()`` / ``model.eval()``."""
    layers = [m for m in model.modules() if isinstance(m, Stochastic)]
    before = [m.sampling for m in layers]
    for m in layers:
        m.sampling = on
    try:
        yield model
    finally:
        for m, b in zip(layers, before, strict=True):
            m.sampling = b


@contextmanager
def seeded(rng: torch.Generator) -> Iterator[None]:
    """Run the block with torch's global CPU generator seeded from ``rng`` (one draw), restoring
    the global state afterwards: weight samples and dropout masks then depend only on ``rng``."""
    seed = int(torch.randint(0, 2**62, (1,), generator=rng))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
