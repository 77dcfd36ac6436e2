"""One-shot empirical privacy estimation: from canary cosines to an ε (pure math).

Andrew, Kairouz, Oh, Oprea, McMahan & Suriyakumar, "One-shot Empirical Privacy Estimation for
Federated Learning" (ICLR 2024). k canary clients take part in one training run; canary i
uploads a secret random unit direction ``c_i`` scaled to the clip norm whenever it is sampled
(:mod:`fedlore.privacy.canaries`). Afterwards the auditor computes, for each canary, the cosine
between the model's change ``Δ = θ_T − θ_0`` and ``c_i``, and the same cosine for directions
that were never inserted (*unseen* canaries). Inserted canaries leave a mean shift; unseen ones
follow the null: for an isotropic unit vector in dimension d the cosine with any fixed vector
has mean 0 and variance exactly ``1/d`` (:func:`null_std`), close to ``N(0, 1/d)``.

The estimate fits a Gaussian to each population, ``P = N(μ, σ²)`` (the inserted canaries) and
``Q = N(μ₀, σ₀²)`` (the null), and reports the ε at δ of the mechanism that outputs one draw of
P or of Q: the smallest ε with

    δ(ε) = max(δ_{P‖Q}(ε), δ_{Q‖P}(ε)) ≤ δ,   δ_{P‖Q}(ε) = ∫ max(0, p(x) − e^ε q(x)) dx

(the hockey-stick divergence; both directions, since an (ε, δ) guarantee bounds both;
:func:`privacy_curve`, :func:`pair_epsilon`). The integral is exact: the set where
``log p − log q > ε`` is a half-line, an interval or the complement of one (the log-ratio of two
Gaussians is a quadratic in x), so δ is a difference of normal tail probabilities, computed in
log space (:func:`hockey_stick`). ε is found by bisection on the monotone curve. For equal
variances the pair is μ-GDP with ``μ_GDP = |μ − μ₀| / σ`` (Dong, Roth & Su, "Gaussian
Differential Privacy", JRSS-B 2022, Corollary 2.13: ``δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ −
μ/2)``), :func:`gdp_epsilon`, the cross-check of the numeric curve.

This is an *estimate*, not a bound: the Gaussian fits, the sampling error of k canaries and the
adversary's statistic (one cosine) all stand between it and the mechanism's true ε. A small
value does not prove privacy; a value well above the accountant's ε, beyond that sampling
error, means the mechanism or its accounting is broken. The sampling error is
:mod:`fedlore.privacy.empirical_error`'s: a confidence interval for ε̂ and the chance that a
sound mechanism's ε̂ lands above a claim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

EPSILON_TOL = 1e-9
"""The bisection stops when its bracket on ε is this narrow (absolute)."""

EPSILON_CAP = 1e4
"""ε above this is reported as ``inf`` (the two Gaussians are told apart with certainty)."""

SPREAD_RATIO = 1e-100
"""Standard deviations whose ratio r is below this (or above its inverse) give ε = ``inf``:
outside ``√r`` wider-scale units of the narrower Gaussian's mean, the narrower one has mass
below ``e^{-1/(2r)}`` and the wider all its own but ``√r`` = 1e-50, so δ(ε) rounds to 1 at
every ε up to :data:`EPSILON_CAP`. (The curve's coefficients, ``1/sd²``, overflow below about
1e-154, where a finite ε came out, 0 past 1e-160, for a pair told apart with certainty.)"""


def standardized(shift: float, sd_p: float, sd_q: float) -> tuple[float, float] | None:
    """``(shift, sd_p)`` in units of ``sd_q`` (ε is unchanged by rescaling x), or None when
    the pair's ε is ``inf`` at every δ < 1: a shift of more than a float's range of ``sd_q``
    or spreads :data:`SPREAD_RATIO` apart."""
    shift, ratio = shift / sd_q, sd_p / sd_q
    if not (math.isfinite(shift) and SPREAD_RATIO <= ratio <= 1.0 / SPREAD_RATIO):
        return None
    return shift, ratio


def null_std(dimension: int) -> float:
    """``1/√d``: the standard deviation of the cosine between a uniformly random unit vector of
    dimension d and any fixed nonzero vector (its square has mean ``1/d`` by symmetry: the d
    squared coordinates of a unit vector sum to 1 and share one distribution).

    Raises:
        ValueError: for ``dimension < 1``.
    """
    if dimension < 1:
        raise ValueError(f"the upload dimension must be at least 1, got {dimension!r}")
    return 1.0 / math.sqrt(dimension)


def _log_phi(x: float) -> float:
    """``log Φ(x)``, the standard normal's log CDF, accurate far into both tails (scipy's
    ``log_ndtr``, imported here so that importing fedlore does not load scipy)."""
    from scipy.special import log_ndtr

    return float(log_ndtr(x))


def _log_mass(mean: float, sd: float, lo: float, hi: float) -> float:
    """``log P(lo < X < hi)`` for ``X ~ N(mean, sd²)`` (``-inf`` for an empty interval), from
    whichever tail keeps the difference of two small numbers accurate."""
    if not lo < hi:
        return -math.inf
    a, b = (lo - mean) / sd, (hi - mean) / sd
    if a > 0:  # both in the upper tail: P = Φ(−a) − Φ(−b)
        la, lb = _log_phi(-a), _log_phi(-b)
    elif b < 0:  # both in the lower tail: P = Φ(b) − Φ(a)
        la, lb = _log_phi(b), _log_phi(a)
    else:  # around the mean (a ≤ 0 ≤ b): 1 − Φ(a) − Φ(−b) while the tails hold under half
        tails = math.exp(_log_phi(a)) + math.exp(_log_phi(-b))
        if tails < 0.5:
            return math.log1p(-tails)
        # a narrow interval: ½ (erf(b/√2) + erf(−a/√2)), two terms ≥ 0 (no cancellation; the
        # tails' sum rounds to 1 for an interval below 1e-16 of sd, and log1p(-1) raises)
        mass = 0.5 * (math.erf(b / math.sqrt(2.0)) + math.erf(-a / math.sqrt(2.0)))
        return math.log(mass) if mass > 0.0 else -math.inf
    if lb == -math.inf:
        return float(la)
    return la + math.log1p(-math.exp(lb - la)) if la > lb else -math.inf


def _region(shift: float, sd_p: float, sd_q: float, eps: float) -> list[tuple[float, float]]:
    """The intervals of x where ``log p(x) − log q(x) > ε`` for ``p = N(shift, sd_p²)`` and
    ``q = N(0, sd_q²)``. The log-ratio is ``A x² + B x + C`` with

        A = (1/sd_q² − 1/sd_p²) / 2,   B = shift / sd_p²,   C = log(sd_q/sd_p) − shift² / (2 sd_p²),

    so the region is a half-line (A = 0), the outside of the roots (A > 0: p has the heavier
    tails) or the inside (A < 0)."""
    a = 0.5 * (1.0 / sd_q**2 - 1.0 / sd_p**2)
    b = shift / sd_p**2
    c = math.log(sd_q / sd_p) - 0.5 * shift**2 / sd_p**2 - eps
    inf = math.inf
    if abs(a) <= 1e-12 * max(1.0 / sd_q**2, 1.0 / sd_p**2):  # equal variances: linear
        if b == 0.0:
            return [(-inf, inf)] if c > 0 else []
        root = -c / b
        return [(root, inf)] if b > 0 else [(-inf, root)]
    disc = b * b - 4.0 * a * c
    if disc <= 0.0:
        return [(-inf, inf)] if a > 0 else []
    sq = math.sqrt(disc)
    # the two roots without cancellation (Numerical Recipes §5.6)
    qq = -0.5 * (b + math.copysign(sq, b))
    r1, r2 = sorted((qq / a, c / qq) if qq != 0.0 else (-sq / (2 * a), sq / (2 * a)))
    return [(-inf, r1), (r2, inf)] if a > 0 else [(r1, r2)]


def hockey_stick(eps: float, shift: float, sd_p: float, sd_q: float) -> float:
    """``δ_{P‖Q}(ε) = ∫ max(0, p − e^ε q) = P(R) − e^ε Q(R)`` for ``P = N(shift, sd_p²)``,
    ``Q = N(0, sd_q²)`` and R the region where ``p > e^ε q`` (:func:`_region`); exact up to
    float rounding (normal tails in log space)."""
    total = 0.0
    for lo, hi in _region(shift, sd_p, sd_q, eps):
        lp = _log_mass(shift, sd_p, lo, hi)
        lq = _log_mass(0.0, sd_q, lo, hi)
        if lp == -math.inf:
            continue
        # P(R) − e^ε Q(R) = P(R) (1 − e^{ε + log Q(R) − log P(R)}), and p > e^ε q on R
        ratio = eps + lq - lp
        total += math.exp(lp) * -math.expm1(min(ratio, 0.0))
    return max(total, 0.0)


def privacy_curve(eps: float, shift: float, sd_p: float, sd_q: float) -> float:
    """δ(ε) of the pair: the larger of :func:`hockey_stick` in both directions (the pair
    ``N(shift, sd_p²)``, ``N(0, sd_q²)`` is the pair ``N(0, sd_p²)``, ``N(−shift, sd_q²)``
    shifted, so the reverse direction is the same function with the roles swapped)."""
    return max(hockey_stick(eps, shift, sd_p, sd_q), hockey_stick(eps, -shift, sd_q, sd_p))


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"δ must be in (0, 1), got {delta!r}")


def _solve(curve: Callable[[float], float], delta: float) -> float:
    """The smallest ε ≥ 0 with ``curve(ε) ≤ δ`` for a non-increasing ``curve``, by bisection
    (``inf`` past :data:`EPSILON_CAP`)."""
    _check_delta(delta)
    if curve(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while curve(hi) > delta:  # double the bracket up to the cap (a root below it is kept)
        if hi >= EPSILON_CAP:
            return math.inf
        lo, hi = hi, min(2.0 * hi, EPSILON_CAP)
    while hi - lo > EPSILON_TOL * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if curve(mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def pair_epsilon(shift: float, sd_p: float, sd_q: float, delta: float) -> float:
    """ε at ``delta`` of telling ``N(shift, sd_p²)`` from ``N(0, sd_q²)`` (either way round):
    the root of :func:`privacy_curve` by bisection.

    Raises:
        ValueError: for a non-positive or non-finite standard deviation, a non-finite shift or
            δ outside (0, 1).
    """
    for name, sd in (("sd_p", sd_p), ("sd_q", sd_q)):
        if not (math.isfinite(sd) and sd > 0):
            raise ValueError(f"{name} must be a positive number, got {sd!r}")
    if not math.isfinite(shift):
        raise ValueError(f"the mean shift must be finite, got {shift!r}")
    scaled = standardized(shift, sd_p, sd_q)
    if scaled is None:
        _check_delta(delta)
        return math.inf
    mu, ratio = scaled
    return _solve(lambda e: privacy_curve(e, mu, ratio, 1.0), delta)


def gdp_delta(eps: float, mu: float) -> float:
    """δ(ε) of μ-GDP: ``Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)`` (Dong, Roth & Su 2022, Cor. 2.13)."""
    if mu <= 0:
        return 0.0
    upper = _log_phi(-eps / mu + mu / 2)
    if upper == -math.inf:  # ε/μ past log Φ's range: both terms are 0 (not −inf − −inf, NaN)
        return 0.0
    lower = eps + _log_phi(-eps / mu - mu / 2)
    return float(math.exp(upper) * -math.expm1(min(lower - upper, 0.0)))


def gdp_epsilon(mu: float, delta: float) -> float:
    """ε at ``delta`` of μ-GDP (:func:`gdp_delta` solved by bisection): the closed form of
    :func:`pair_epsilon` for equal variances, ``μ = |shift| / sd``."""
    return _solve(lambda e: gdp_delta(e, abs(mu)), delta)


@dataclass(frozen=True)
class Fit:
    """A Gaussian fitted to a sample: its mean, its standard deviation (the square root of the
    unbiased variance) and the sample size."""

    mean: float
    std: float
    count: int


def fit(values: Sequence[float] | np.ndarray) -> Fit:
    """The Gaussian of ``values`` (at least 2, all finite).

    Raises:
        ValueError: for fewer than 2 values or a non-finite one.
    """
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.size < 2:
        raise ValueError(f"a Gaussian fit needs at least 2 values, got {x.size}")
    if not np.isfinite(x).all():
        raise ValueError("the cosines to fit contain NaN or Inf")
    return Fit(float(x.mean()), float(x.std(ddof=1)), int(x.size))


def estimate_epsilon(observed: Fit, null: Fit, delta: float) -> float:
    """The one-shot estimate: ε at ``delta`` of ``N(observed.mean, observed.std²)`` against
    ``N(null.mean, null.std²)`` (:func:`pair_epsilon`); ``inf`` when the observed cosines do
    not vary (a degenerate fit: every canary told apart)."""
    if observed.std <= 0:
        return math.inf
    return pair_epsilon(observed.mean - null.mean, observed.std, null.std, delta)
