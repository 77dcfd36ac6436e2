"""The closed-form math of mean-field Gaussian posteriors, on (mu, rho) tensors: no layer, no
model. Seed 001 (the Meta-BayFL paper, arXiv 2603.18083), Eqs. 14-16.

* the parameterization ``sigma = softplus(rho)``, in log space (:func:`log_softplus`) and
  inverted (:func:`inverse_softplus`);
* the prior ``p(w) = Π_i N(w_i; mu0, sigma0²)`` (Eq. 14, :class:`GaussianPrior`) of the
  posterior ``q(w) = Π_i N(w_i; mu_i, sigma_i²)`` (Eq. 15);
* the closed-form ``KL(q || p)`` of Eq. 16 (:func:`gaussian_kl`, and between two mean-field
  posteriors :func:`gaussian_kl_between`);
* the server's combination of clients' posteriors (:func:`combine_gaussians`: Eq. 22's average
  of the variational parameters and three other rules, reference notes Part 0.6).

Everything is computed in log space: ``log sigma`` goes through :func:`log_softplus`, which stays
finite for any ``rho``, and the Gaussian log density is never exponentiated, so a weight far in
the tail has a finite, very negative log prior.

The layers that sample from these posteriors are in :mod:`fedlore.bayes.layers`; the model-wide
sums (KL of a model, between two models) in :mod:`fedlore.bayes.model`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

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


Aggregation = Literal["mean", "sigma", "moment", "precision"]
"""How the server combines the clients' (mu, rho): :func:`combine_gaussians`."""


def combine_gaussians(
    mus: list[torch.Tensor], rhos: list[torch.Tensor], weights: list[float], rule: Aggregation
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine clients' posteriors ``N(mu_i, softplus(rho_i)²)`` element-wise (reference notes
    Part 0.6, weights a_i normalized here):

    * ``mean`` (A): average mu and rho (what FedAvg of the raw parameters does);
    * ``sigma`` (B): average mu and sigma, ``rho = softplus⁻¹(Σ a_i sigma_i)``;
    * ``moment`` (C): moment-match the mixture ``Σ a_i q_i``:
      ``sigma² = Σ a_i (sigma_i² + mu_i²) - mu²``;
    * ``precision`` (D): conflation, ``tau = Σ a_i / sigma_i²``,
      ``mu = Σ a_i mu_i / sigma_i² / tau``, ``sigma = tau^-1/2``.

    Computed in float64 (sigma through log-softplus, so a client's sigma is exact down to
    rho = -708; below that it counts as the smallest positive float64).

    Returns:
        (mu, rho), each of the inputs' shape and dtype.

    Raises:
        ValueError: for an unknown ``rule``.
    """
    w = torch.tensor(weights, dtype=torch.float64, device=mus[0].device)
    w = w / w.sum()
    shape = (-1,) + (1,) * mus[0].dim()
    a = w.view(shape)
    mu = torch.stack([m.double() for m in mus])
    rho = torch.stack([r.double() for r in rhos])
    tiny = torch.finfo(torch.float64).tiny
    sigma = log_softplus(rho).exp().clamp_min(tiny)  # exact down to rho = -708
    if rule == "mean":
        out_mu, out_rho = (a * mu).sum(0), (a * rho).sum(0)
    elif rule == "sigma":
        out_mu = (a * mu).sum(0)
        out_rho = inverse_softplus((a * sigma).sum(0).clamp_min(tiny))
    elif rule == "moment":
        out_mu = (a * mu).sum(0)
        spread = (a * (mu - out_mu) ** 2).sum(0)  # Σ a (σ² + μ²) - μ̄², without cancellation
        out_rho = inverse_softplus(((a * sigma**2).sum(0) + spread).sqrt().clamp_min(tiny))
    elif rule == "precision":
        prec = a / sigma**2
        tau = prec.sum(0)
        out_mu = (prec * mu).sum(0) / tau
        out_rho = inverse_softplus(tau.rsqrt().clamp_min(tiny))
    else:
        raise ValueError(f"unknown posterior aggregation {rule!r}")
    return out_mu.to(mus[0].dtype), out_rho.to(rhos[0].dtype)
