"""Mean-field Gaussian layers, MC-dropout layers, and converters for any registered model.

A Bayesian layer holds variational parameters ``weight_mu``, ``weight_rho`` (and ``bias_mu``,
``bias_rho``) with ``sigma = softplus(rho)``; the posterior is
``q(w) = Π_i N(w_i; mu_i, sigma_i²)`` and the prior ``p(w) = Π_i N(w_i; mu0, sigma0²)`` (seed 001,
Eqs. 14-15; reference notes Part 0.1). A forward pass draws one weight sample
``w = mu + sigma · eps`` shared by the minibatch (the reparameterization of Blundell et al. 2015)
when the layer's :attr:`Stochastic.sampling` flag is on, and uses ``mu`` when it is off. The flag
is independent of ``train()`` / ``eval()``: a model evaluated in eval mode (BatchNorm frozen) can
still draw samples, which is what the MC predictive needs. A layer's ``estimator``
(:func:`set_estimator`, ``bayesianize(..., estimator=)``) switches the Linear layers to the local
reparameterization of Kingma, Salimans & Welling (2015): pre-activations
``b ~ N(x mu_W^T + mu_b, x² sigma_W²^T + sigma_b²)`` drawn per example instead of one weight
sample per batch, in training and in the MC predictive alike; convolutions keep weight sampling.

``forward`` returns a tensor; the KL is asked for separately (:func:`kl_divergence`).

Everything is computed in log space: ``log sigma`` goes through :func:`log_softplus`, which stays
finite for any ``rho``, and the Gaussian log density is never exponentiated, so a weight far in
the tail has a finite, very negative log prior.

Randomness: weight samples (and local pre-activation samples) come from torch's global CPU
generator, also for a model on a GPU
(drawn on the CPU and moved), so a run samples the same weights on every device; callers that
need reproducibility seed it (:func:`seeded`). MC-dropout masks come from the device's own
generator (``F.dropout``): an MC-dropout model on a GPU draws other masks than on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

LOG_2PI = math.log(2.0 * math.pi)


def log_softplus(rho: torch.Tensor) -> torch.Tensor:
    """``log(softplus(rho))`` without underflow: for ``rho < -20`` softplus(rho) = e^rho to
    within 1e-9 relative, so the log is ``rho`` itself (softplus would round to 0 in fp32 below
    about -104 and its log would be -inf).

    Args:
        rho: any float tensor.

    Returns:
        Tensor of ``rho``'s shape: ``log sigma``.
    """
    # clamp_min keeps softplus's argument >= -20 (no log(0)) and passes no gradient below it
    return torch.where(rho < -20.0, rho, F.softplus(rho.clamp_min(-20.0)).log())


def inverse_softplus(sigma: torch.Tensor | float) -> torch.Tensor:
    """``rho = log(exp(sigma) - 1)``, the inverse of softplus, computed as
    ``sigma + log(-expm1(-sigma))`` (stable for small and large sigma), in ``sigma``'s dtype
    (the default dtype for a Python number).

    Raises:
        ValueError: when a sigma is not positive.
    """
    s = torch.as_tensor(sigma)
    if not s.is_floating_point():
        s = s.to(torch.get_default_dtype())
    if not bool((s > 0).all()):
        raise ValueError(
            f"inverse_softplus: sigma must be > 0 (smallest given: {float(s.min()):.3g}, "
            f"dtype {s.dtype})"
        )
    return s + torch.log(-torch.expm1(-s))


@dataclass(frozen=True)
class GaussianPrior:
    """The prior ``N(mu0, sigma0²)`` of every weight (seed 001 Eq. 14).

    Attributes:
        mu: prior mean mu0.
        sigma: prior standard deviation sigma0 (> 0).
    """

    mu: float = 0.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mu) and math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"prior needs a finite mu and sigma > 0, got {self.mu}, {self.sigma}")

    def log_prob(self, w: torch.Tensor) -> torch.Tensor:
        """Summed log density ``Σ_i log N(w_i; mu0, sigma0²)`` (nats), computed in float64 in
        log space: finite for any finite ``w`` (a weight 1e20 prior deviations out gives about
        -5e39, not -inf).

        Returns:
            0-d float64 tensor.
        """
        z = (w.double() - self.mu) / self.sigma
        return (-0.5 * z * z - math.log(self.sigma) - 0.5 * LOG_2PI).sum()


def gaussian_kl(
    mu_q: torch.Tensor, log_sigma_q: torch.Tensor, mu_p: float, sigma_p: float
) -> torch.Tensor:
    """Closed-form ``KL(N(mu_q, sigma_q²) || N(mu_p, sigma_p²))`` summed over elements:

    ``Σ_i [log sigma_p - log sigma_q + (sigma_q² + (mu_q - mu_p)²) / (2 sigma_p²) - 1/2]``

    (reference notes Part 0.2; a sum, not a mean, as the ELBO requires).

    Args:
        mu_q, log_sigma_q: same-shape tensors of posterior means and log standard deviations.
        mu_p, sigma_p: prior mean and standard deviation.

    Returns:
        0-d tensor (nats), differentiable in ``mu_q`` and ``log_sigma_q``.
    """
    # one element-wise chain and one reduction (fewer kernels than a sum per term); each
    # element's terms cancel to rounding at the prior, so a KL near 0 stays near 0 for any n
    diff = mu_q - mu_p
    spread = torch.addcmul(torch.exp(2.0 * log_sigma_q), diff, diff)  # sigma_q² + (mu_q - mu_p)²
    per = spread * (0.5 / sigma_p**2) + (math.log(sigma_p) - 0.5)
    return (per - log_sigma_q).sum()


def gaussian_kl_between(
    mu_q: torch.Tensor, log_sigma_q: torch.Tensor, mu_p: torch.Tensor, log_sigma_p: torch.Tensor
) -> torch.Tensor:
    """Closed-form ``KL(N(mu_q, sigma_q²) || N(mu_p, sigma_p²))`` between two same-shape
    mean-field Gaussians, summed over elements:

    ``Σ_i [log sigma_p - log sigma_q + (sigma_q² + (mu_q - mu_p)²) / (2 sigma_p²) - 1/2]``

    (the KL between a personal posterior and the local copy of the global one, pFedBayes,
    Zhang et al. ICML 2022, Eq. 4; :func:`gaussian_kl` is the case of a scalar prior).

    Args:
        mu_q, log_sigma_q, mu_p, log_sigma_p: tensors of one shape.

    Returns:
        0-d tensor (nats), differentiable in all four.
    """
    diff = mu_q - mu_p
    spread = torch.addcmul(torch.exp(2.0 * log_sigma_q), diff, diff)  # sigma_q² + (mu_q - mu_p)²
    per = 0.5 * (spread * torch.exp(-2.0 * log_sigma_p) - 1.0) + log_sigma_p
    return (per - log_sigma_q).sum()


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


class Stochastic:
    """Mixin of every layer whose forward pass can draw a sample; ``sampling`` switches it."""

    sampling: bool = True


Estimator = Literal["weights", "local"]
"""How a mean-field Gaussian layer samples: ``"weights"`` draws one weight sample per forward
pass (Blundell et al. 2015; the seed's estimator), ``"local"`` samples the pre-activations
(local reparameterization, Kingma, Salimans & Welling 2015; :class:`BayesLinear` only)."""

ESTIMATORS: tuple[str, ...] = ("weights", "local")


def _noise(shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
    """Standard normal noise of ``shape`` in ``like``'s dtype and device, drawn from torch's
    global CPU generator (moved to ``like``'s device), so every device draws the same numbers."""
    if like.device.type == "cpu":
        return torch.randn(shape, dtype=like.dtype)
    return torch.randn(shape, dtype=like.dtype).to(like.device, non_blocking=True)


class _BayesMixin(Stochastic, nn.Module):
    """Shared parts of :class:`BayesLinear` and :class:`BayesConv2d`."""

    weight_mu: nn.Parameter
    weight_rho: nn.Parameter
    bias_mu: nn.Parameter | None
    bias_rho: nn.Parameter | None
    prior: GaussianPrior
    estimator: Estimator = "weights"

    def _init_variational(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        prior: GaussianPrior,
        rho_init: float,
    ) -> None:
        self.prior = prior
        self.sampling = True
        self.estimator = "weights"
        self.weight_mu = nn.Parameter(weight.detach().clone())
        self.weight_rho = nn.Parameter(torch.full_like(weight, rho_init))
        if bias is not None:
            self.bias_mu = nn.Parameter(bias.detach().clone())
            self.bias_rho = nn.Parameter(torch.full_like(bias, rho_init))
        else:
            self.register_parameter("bias_mu", None)
            self.register_parameter("bias_rho", None)

    def _draw(self, mu: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        """``mu + softplus(rho) * eps`` in one fused ``addcmul`` (``mu`` itself when sampling is
        off)."""
        if not self.sampling:
            return mu
        w = torch.addcmul(mu, F.softplus(rho), _noise(mu.shape, mu))
        if w.stride() != mu.stride():  # e.g. channels_last: the sample keeps mu's exact layout,
            w = torch.empty_like(mu).copy_(w)  # which picks the convolution's kernel
        return w

    def weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draw of (weight, bias) (the means when :attr:`sampling` is off)."""
        w = self._draw(self.weight_mu, self.weight_rho)
        b = None
        if self.bias_mu is not None and self.bias_rho is not None:
            b = self._draw(self.bias_mu, self.bias_rho)
        return w, b

    def kl(self) -> torch.Tensor:
        """``KL(q || p)`` of this layer's weights and bias, summed (nats)."""
        out = gaussian_kl(
            self.weight_mu, log_softplus(self.weight_rho), self.prior.mu, self.prior.sigma
        )
        if self.bias_mu is not None and self.bias_rho is not None:
            out = out + gaussian_kl(
                self.bias_mu, log_softplus(self.bias_rho), self.prior.mu, self.prior.sigma
            )
        return out

    def log_prior(self) -> torch.Tensor:
        """``log p(w)`` of the current means (float64, finite for any finite mean)."""
        out = self.prior.log_prob(self.weight_mu)
        if self.bias_mu is not None:
            out = out + self.prior.log_prob(self.bias_mu)
        return out


class BayesLinear(_BayesMixin):
    """Mean-field Gaussian ``nn.Linear``: ``y = x W^T + b`` with ``(W, b) ~ q``.

    With :attr:`estimator` ``"weights"`` (default) a forward pass draws one ``(W, b)`` shared by
    the batch. With ``"local"`` it samples the pre-activations instead (the local
    reparameterization trick, Kingma, Salimans & Welling 2015, Eq. 6):
    ``y ~ N(x mu_W^T + mu_b, x² sigma_W²^T + sigma_b²)``, independently per example and output
    unit; every example's marginal is the same as under one weight draw, the gradient's variance
    is lower and the noise is ``[..., out]`` instead of ``[out, in]``. With sampling off both
    give ``x mu_W^T + mu_b``.

    Args:
        layer: the deterministic layer whose weights become the posterior means.
        prior: the prior of every weight.
        rho_init: initial rho of every weight (sigma = softplus(rho); -5 gives 0.0067).
    """

    def __init__(self, layer: nn.Linear, prior: GaussianPrior, rho_init: float) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self._init_variational(layer.weight, layer.bias, prior, rho_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., out]``: one weight draw for the whole batch, or with the local
        estimator one pre-activation draw per example and unit."""
        if self.sampling and self.estimator == "local":
            return self.local_forward(x)
        w, b = self.weights()
        return F.linear(x, w, b)

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local reparameterization (Kingma et al. 2015, Eq. 6): mean ``x mu_W^T + mu_b``,
        variance ``x² sigma_W²^T + sigma_b²`` (``[..., out]``), one draw
        ``mean + sqrt(var) * eps`` with ``eps`` from torch's global CPU generator. The variance
        is floored at the dtype's smallest normal number, so the square root's gradient stays
        finite where a unit's variance underflows.

        Returns:
            ``[..., out]``.
        """
        mean = F.linear(x, self.weight_mu, self.bias_mu)
        var_b = None
        if self.bias_rho is not None:
            var_b = F.softplus(self.bias_rho).square()
        var = F.linear(x * x, F.softplus(self.weight_rho).square(), var_b)
        std = var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()
        return torch.addcmul(mean, std, _noise(mean.shape, mean))

    def extra_repr(self) -> str:
        est = "" if self.estimator == "weights" else f", estimator={self.estimator}"
        return f"in={self.in_features}, out={self.out_features}, prior={self.prior}{est}"


class BayesConv2d(_BayesMixin):
    """Mean-field Gaussian ``nn.Conv2d`` (same stride, padding, dilation, groups). A forward
    pass draws one weight sample for the batch under either :attr:`estimator`: the local
    estimator would need a second convolution (of ``x²`` with ``sigma²``) per pass, doubling
    the layer's cost, so convolutions keep weight sampling.

    Args:
        layer: the deterministic conv (``padding_mode="zeros"``) whose weights become the means.
        prior: the prior of every weight.
        rho_init: initial rho of every weight.

    Raises:
        ValueError: for a conv with another ``padding_mode``.
    """

    def __init__(self, layer: nn.Conv2d, prior: GaussianPrior, rho_init: float) -> None:
        super().__init__()
        if layer.padding_mode != "zeros":
            raise ValueError(f"BayesConv2d supports padding_mode='zeros', got {layer.padding_mode}")
        self.stride, self.padding = layer.stride, layer.padding
        self.dilation, self.groups = layer.dilation, layer.groups
        self._init_variational(layer.weight, layer.bias, prior, rho_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W] -> [B, C', H', W']`` with one weight draw for the whole batch."""
        w, b = self.weights()
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight_mu.shape)}, stride={self.stride}, prior={self.prior}"


class MCDropoutLinear(Stochastic, nn.Linear):
    """``nn.Linear`` with dropout on its input while :attr:`sampling` is on (Gal & Ghahramani
    2016). Parameter names stay ``weight`` / ``bias``, so a converted model's state dict keeps the
    deterministic names and averages like the deterministic model."""

    p: float = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.dropout(x, self.p, training=self.sampling))


class MCDropoutConv2d(Stochastic, nn.Conv2d):
    """``nn.Conv2d`` with (element-wise) dropout on its input while :attr:`sampling` is on."""

    p: float = 0.1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.dropout(x, self.p, training=self.sampling))


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
