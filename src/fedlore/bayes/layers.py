"""The stochastic layers: mean-field Gaussian ``Linear`` / ``Conv2d`` and MC-dropout layers.

A Bayesian layer holds variational parameters ``weight_mu``, ``weight_rho`` (and ``bias_mu``,
``bias_rho``) with ``sigma = softplus(rho)``; the posterior is
``q(w) = Π_i N(w_i; mu_i, sigma_i²)`` and the prior ``p(w) = Π_i N(w_i; mu0, sigma0²)`` (seed 001,
the Meta-BayFL paper, arXiv 2603.18083, Eqs. 14-15; reference notes Part 0.1; the math is
in :mod:`fedlore.bayes.posterior`). A forward pass draws one weight sample
``w = mu + sigma · eps`` shared by the minibatch (the reparameterization of Blundell et al. 2015)
when the layer's :attr:`Stochastic.sampling` flag is on, and uses ``mu`` when it is off. The flag
is independent of ``train()`` / ``eval()``: a model evaluated in eval mode (BatchNorm frozen) can
still draw samples, which is what the MC predictive needs. A layer's ``estimator``
(:func:`~fedlore.bayes.model.set_estimator`, ``bayesianize(..., estimator=)``) switches the
Linear layers to the local reparameterization of Kingma, Salimans & Welling (2015):
pre-activations ``b ~ N(x mu_W^T + mu_b, x² sigma_W²^T + sigma_b²)`` drawn per example instead of
one weight sample per batch, in training and in the MC predictive alike; convolutions keep weight
sampling.

``forward`` returns a tensor; the KL is asked for separately (:meth:`_BayesMixin.kl`, and for a
whole model :func:`~fedlore.bayes.model.kl_divergence`). Converting a registered model, the
sampling switch and the other model-wide helpers are in :mod:`fedlore.bayes.model`.

Randomness: weight samples (and local pre-activation samples) come from torch's global CPU
generator, also for a model on a GPU
(drawn on the CPU and moved), so a run samples the same weights on every device; callers that
need reproducibility seed it (:func:`~fedlore.bayes.model.seeded`). MC-dropout masks come from
the device's own generator (``F.dropout``): an MC-dropout model on a GPU draws other masks than
on the CPU.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedlore.bayes.posterior import GaussianPrior, gaussian_kl, log_softplus


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
