"""The statistical error of the one-shot estimate (:mod:`fedlore.privacy.empirical`): a
confidence interval for ε̂ and the chance that a sound mechanism's ε̂ lands above its claim.

The estimate ε̂ = f(μ̂, σ̂ [, μ̂₀, σ̂₀]) is the ε of two Gaussians fitted to k canaries' cosines
(and, for the all-iterates estimate, to k' unseen canaries'). Its error is the sampling error
of those fits: the mean of k values moves by σ/√k, the standard deviation by about σ/√(2k), and
at δ = 1e-5 a standard deviation off from the null's by a few percent alone adds units of ε
(the variance term of the Gaussians' log-ratio grows without bound in the tails).

**The interval** (:func:`epsilon_interval`) is the *profile-likelihood* interval of ε under the
estimator's own model, Gaussian cosines (Wilks 1938; e.g. Pawitan, "In All Likelihood", OUP
2001, §3.4 and §9.7; Venzon & Moolgavkar, "A method for computing profile-likelihood-based
confidence intervals", Applied Statistics 1988): every ε = f(θ) of a parameter θ whose
deviance ``D(θ) = 2 (ℓ(θ̂) − ℓ(θ))`` is at most ``χ²_p(level)``, p the parameters fitted (2,
5.99 at 95 %, for the final model's (μ, σ); 3, 7.81, for the all-iterates estimate's
(μ − μ₀, σ, σ₀)). The usual one-parameter ``χ²₁`` is too narrow here: ε has a kink where the
two standard deviations are equal, which is where a sound mechanism sits, and with it the lower
end lay above the true ε in about 11 % of simulated sound runs. For k Gaussian
values of MLE mean x̄ and MLE standard deviation ŝ the deviance is

    D(μ, σ) = k [2 log(σ/ŝ) + ŝ²/σ² − 1] + k (x̄ − μ)² / σ²,

so the √k scaling of the mean's error and the √(2k) of the standard deviation's are both in it.
The set ``{D ≤ c}`` is connected and f continuous, so the interval is [min f, max f] over it.
For a fixed σ (σ₀) the admissible shifts μ − μ₀ form one interval (the final-model null is
exact, ``N(0, 1/d)``; the all-iterates null is fitted to the unseen canaries, and the two
samples are independent, so their deviances add: by Cauchy-Schwarz the shift's half-width is
``√(r (σ²/k + σ₀²/k'))`` with r the deviance left over by the standard deviations), and ε grows
with the shift's size at fixed standard deviations, so the extremes over each such interval are
at its ends (or at 0 when it holds 0). The interval is then a scan over σ (a grid of
:data:`GRID` points; over (σ, σ₀) for the all-iterates estimate) of ε at those ends, computed
all at once (:func:`epsilons`). Its coverage is at least ``level`` asymptotically (Wilks; the
projection of a joint region is conservative), measured in
``tests/privacy/test_audit_estimator.py``; it uses no randomness at all, so there is no analysis
seed to choose. It is the error of the Gaussian model's ε, not of the model: cosines that are
far from Gaussian (a canary sampled in few rounds) are outside it.

**The false-alarm probability** (:func:`false_alarm`) is the chance that a sound mechanism's
final-model ε̂ exceeds a claim ε: for k cosines of N(μ, s²) in null units (null N(0, 1)) the
mean is N(μ, s²/k) and, independently, the unbiased variance ``s² χ²_{k−1} / (k − 1)``; for
each of :data:`QUADRATURE` equiprobable values of the variance the set of means with ε̂ above
the claim is ``|x̄| > x*`` (ε grows with the shift), found by bisection, so the probability is
an average of normal tails. ``dp.audit`` warns at start when it is above the interval's own
one-sided error, ``(1 − level)/2`` (:func:`canaries_for`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedlore.privacy.empirical import EPSILON_CAP, SPREAD_RATIO, Fit, estimate_epsilon

LEVEL = 0.95
"""The confidence level of the audit's intervals (``dp_audit_*_low`` / ``_high``)."""

GRID = 129
"""Points of the scan over the fitted standard deviation (its admissible range, log-spaced)."""

GRID_2D = 41
"""Points per standard deviation of the scan over both (the all-iterates estimate's σ and σ₀)."""

QUADRATURE = 256
"""Equiprobable values of the fitted variance that :func:`false_alarm` averages over."""

_BISECTIONS = 56
"""Halvings of ε's bracket in :func:`epsilons` (from at most :data:`EPSILON_CAP` to ~1e-13)."""


def _ndtr(x: np.ndarray) -> np.ndarray:
    from scipy.special import ndtr

    return np.asarray(ndtr(x), dtype=np.float64)


def _log_ndtr(x: np.ndarray) -> np.ndarray:
    from scipy.special import log_ndtr

    return np.asarray(log_ndtr(x), dtype=np.float64)


def _log_mass(mean: np.ndarray, sd: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``log P(lo < X < hi)`` for ``X ~ N(mean, sd²)``, elementwise (``-inf`` for an empty
    interval), from the tail that keeps the difference accurate (both ends above the mean:
    upper tails), in log space: a mass far in a tail (e^ε Q(R) at ε of hundreds) does not
    underflow to 0 (:func:`fedlore.privacy.empirical._log_mass`)."""
    a, b = (lo - mean) / sd, (hi - mean) / sd
    upper = a > 0
    big = np.where(upper, _log_ndtr(-a), _log_ndtr(b))  # log of the larger of the two terms
    small = np.where(upper, _log_ndtr(-b), _log_ndtr(a))
    with np.errstate(divide="ignore", invalid="ignore"):  # log1p(-1) = -inf: no mass
        out = big + np.log1p(-np.exp(small - big))
    return np.where(big > small, out, -np.inf)


def _hockey(eps: np.ndarray, shift: np.ndarray, sp: np.ndarray, sq: np.ndarray) -> np.ndarray:
    """δ_{P‖Q}(ε) for P = N(shift, sp²), Q = N(0, sq²), elementwise: the vector form of
    :func:`fedlore.privacy.empirical.hockey_stick` (same region, same roots)."""
    inf = np.inf
    a = 0.5 * (1.0 / sq**2 - 1.0 / sp**2)
    b = shift / sp**2
    c = np.log(sq / sp) - 0.5 * shift**2 / sp**2 - eps
    linear = np.abs(a) <= 1e-12 * np.maximum(1.0 / sq**2, 1.0 / sp**2)
    # b² overflows for spreads below about 1e-77 of each other: the roots go to ±inf and 0,
    # and the pair's ε is inf from the other direction whatever this one's region
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        root = np.where(b != 0, -c / np.where(b != 0, b, 1.0), 0.0)
        disc = b * b - 4.0 * a * c
        sq_disc = np.sqrt(np.maximum(disc, 0.0))
        qq = -0.5 * (b + np.copysign(sq_disc, b))
        safe_a = np.where(a != 0, a, 1.0)
        safe_q = np.where(qq != 0, qq, 1.0)
        r_a = np.where(qq != 0, qq / safe_a, -sq_disc / (2 * safe_a))
        r_b = np.where(qq != 0, c / safe_q, sq_disc / (2 * safe_a))
    r1, r2 = np.minimum(r_a, r_b), np.maximum(r_a, r_b)
    zero = np.zeros_like(shift)
    # two intervals (lo1, hi1) and (lo2, hi2); an empty one is (0, 0)
    lo1 = np.where(linear, np.where(b > 0, root, -inf), np.where(a > 0, -inf, r1))
    hi1 = np.where(linear, np.where(b > 0, inf, root), np.where(a > 0, r1, r2))
    lo2 = np.where(linear | (a < 0), zero, r2)
    hi2 = np.where(linear | (a < 0), zero, inf)
    whole = (linear & (b == 0) & (c > 0)) | (~linear & (disc <= 0) & (a > 0))
    empty = (linear & (b == 0) & (c <= 0)) | (~linear & (disc <= 0) & (a < 0))
    lo1 = np.where(whole, -inf, np.where(empty, zero, lo1))
    hi1 = np.where(whole, inf, np.where(empty, zero, hi1))
    lo2 = np.where(whole | empty, zero, lo2)
    hi2 = np.where(whole | empty, zero, hi2)
    p = np.exp(_log_mass(shift, sp, lo1, hi1)) + np.exp(_log_mass(shift, sp, lo2, hi2))
    # e^ε Q(R) from log Q(R): Q(R) itself underflows where ε passes about 700
    scaled_q = sum(
        np.exp(np.minimum(eps + _log_mass(zero, sq, lo, hi), 700.0))
        for lo, hi in ((lo1, hi1), (lo2, hi2))
    )
    return np.maximum(p - scaled_q, 0.0)


def _curve(eps: np.ndarray, shift: np.ndarray, sp: np.ndarray, sq: np.ndarray) -> np.ndarray:
    """δ(ε) of each pair, both directions (:func:`fedlore.privacy.empirical.privacy_curve`)."""
    return np.maximum(_hockey(eps, shift, sp, sq), _hockey(eps, -shift, sq, sp))


def epsilons(
    shift: np.ndarray | float, sd_p: np.ndarray | float, sd_q: np.ndarray | float, delta: float
) -> np.ndarray:
    """:func:`~fedlore.privacy.empirical.pair_epsilon` of many pairs at once (broadcast): the
    smallest ε ≥ 0 with δ(ε) ≤ ``delta``, by a doubling bracket and :data:`_BISECTIONS`
    halvings; ``inf`` past :data:`~fedlore.privacy.empirical.EPSILON_CAP`."""
    s, p, q = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (shift, sd_p, sd_q)))
    with np.errstate(over="ignore", under="ignore"):  # in sd_q's units (standardized)
        s, p = s.ravel() / q.ravel(), p.ravel() / q.ravel()
    apart = ~(np.isfinite(s) & (p >= SPREAD_RATIO) & (p <= 1.0 / SPREAD_RATIO))
    # a pair told apart with certainty stands in as N(0, 1) against itself: done at once, inf
    s, p, q = np.where(apart, 0.0, s), np.where(apart, 1.0, p), np.ones_like(s)
    lo, hi = np.zeros_like(s), np.ones_like(s)
    done = _curve(lo, s, p, q) <= delta
    hi[done] = 0.0
    todo = ~done
    infinite = apart.copy()
    while todo.any():  # double the bracket up to the cap (a root below it is kept)
        above = np.zeros_like(todo)
        above[todo] = _curve(hi[todo], s[todo], p[todo], q[todo]) > delta
        infinite |= above & (hi >= EPSILON_CAP)
        todo = above & ~infinite
        lo[todo] = hi[todo]
        hi[todo] = np.minimum(2.0 * hi[todo], EPSILON_CAP)
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        over = _curve(mid, s, p, q) > delta
        lo = np.where(over, mid, lo)
        hi = np.where(over, hi, mid)
    out = np.where(infinite, np.inf, hi)
    return out.reshape(np.broadcast_shapes(*(np.shape(v) for v in (shift, sd_p, sd_q))))


def _sd_range(count: int, mle_sd: float, budget: float, points: int) -> np.ndarray:
    """σ on a log grid of ``points`` points over ``{σ: k [2 log(σ/ŝ) + ŝ²/σ² − 1] ≤ budget}``
    (the σ part of the deviance; ŝ the MLE standard deviation)."""

    def root(step: float) -> float:  # the root of the σ part on log u's side of ``step``
        inside, outside = 0.0, step
        while _sd_deviance(count, 1.0, np.exp(outside)) <= budget:
            inside, outside = outside, 2.0 * outside
        for _ in range(80):
            mid = 0.5 * (inside + outside)
            if _sd_deviance(count, 1.0, np.exp(mid)) <= budget:
                inside = mid
            else:
                outside = mid
        return inside

    lo, hi = root(-1.0), root(1.0)
    return np.asarray(mle_sd * np.exp(np.linspace(lo, hi, points)))


def _sd_deviance(count: int, mle_sd: float, sd: np.ndarray) -> np.ndarray:
    u = sd / mle_sd
    return np.asarray(count * (2.0 * np.log(u) + 1.0 / u**2 - 1.0))


@dataclass(frozen=True)
class Interval:
    """A confidence interval for an ε̂ (both ends inclusive; ``high`` may be ``inf``)."""

    low: float
    high: float
    level: float


def epsilon_interval(
    observed: Fit,
    null: Fit,
    delta: float,
    *,
    null_exact: bool = False,
    level: float = LEVEL,
) -> Interval:
    """The profile-likelihood interval at ``level`` of :func:`~fedlore.privacy.empirical.
    estimate_epsilon`'s ε (module docstring): over the fits' admissible parameters, the smallest
    and largest ε. ``null_exact``: the null is known (the final-model null ``N(0, 1/d)``), not
    fitted; otherwise it was fitted to ``null.count`` values, independent of the observed ones.
    The estimate itself always lies inside (its unbiased standard deviation has deviance
    ``≈ 1/(2k)``, far below the threshold).

    Raises:
        ValueError: for a level outside (0, 1), fewer than 2 values in a fit or a zero std.
    """
    from scipy.special import gammaincinv

    if not 0.0 < level < 1.0:
        raise ValueError(f"the interval's level must be in (0, 1), got {level!r}")
    fits = [observed] if null_exact else [observed, null]
    for f in fits:
        if f.count < 2 or not f.std > 0:
            raise ValueError(f"an interval needs a fit of at least 2 varying values, got {f}")
    point = estimate_epsilon(observed, null, delta)
    dof = 2 if null_exact else 3  # (μ, σ), or (μ − μ₀, σ, σ₀) with μ + μ₀ profiled out
    c = 2.0 * float(gammaincinv(0.5 * dof, level))  # χ²_dof(level)
    k = observed.count
    mle = observed.std * math.sqrt((k - 1) / k)
    sds = _sd_range(k, mle, c, GRID if null_exact else GRID_2D)
    if null_exact:
        sd_p, sd_q = sds, np.full_like(sds, null.std)
        left = np.maximum(c - _sd_deviance(k, mle, sds), 0.0)
        half = np.sqrt(left * sds**2 / k)
    else:
        k0 = null.count
        mle0 = null.std * math.sqrt((k0 - 1) / k0)
        sd_p, sd_q = np.meshgrid(sds, _sd_range(k0, mle0, c, GRID_2D), indexing="ij")
        left = c - _sd_deviance(k, mle, sd_p) - _sd_deviance(k0, mle0, sd_q)
        keep = left >= 0
        sd_p, sd_q, left = sd_p[keep], sd_q[keep], left[keep]
        half = np.sqrt(left * (sd_p**2 / k + sd_q**2 / k0))
    centre = abs(observed.mean - null.mean)
    far = epsilons(centre + half, sd_p, sd_q, delta)
    near = epsilons(np.maximum(centre - half, 0.0), sd_p, sd_q, delta)
    return Interval(min(float(near.min()), point), max(float(far.max()), point), level)


def false_alarm(shift: float, spread: float, count: int, claim: float, delta: float) -> float:
    """The chance that the final-model ε̂ of ``count`` canaries exceeds ``claim`` when their
    cosines are ``N(shift, spread²)`` in null units (the null N(0, 1) exact): module
    docstring. ε̂ > claim exactly when the fitted pair's δ(claim) > δ (the curve falls with ε),
    so each variance's threshold on the mean is one bisection of the curve."""
    from scipy.special import gammaincinv

    k = count
    probs = (np.arange(QUADRATURE) + 0.5) / QUADRATURE
    sd = spread * np.sqrt(2.0 * gammaincinv(0.5 * (k - 1), probs) / (k - 1))
    ones, at = np.ones_like(sd), np.full_like(sd, claim)

    def above(x: np.ndarray) -> np.ndarray:
        return np.asarray(_curve(at, x, sd, ones) > delta)

    always = above(np.zeros_like(sd))  # the variance alone puts ε̂ above the claim
    lo, hi = np.zeros_like(sd), np.ones_like(sd)
    while not bool(above(hi).all()):
        hi *= 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        over = above(mid)
        hi = np.where(over, mid, hi)
        lo = np.where(over, lo, mid)
    scale = spread / math.sqrt(k)
    tail = _ndtr((shift - hi) / scale) + _ndtr((-hi - shift) / scale)
    return float(np.clip(np.where(always, 1.0, tail), 0.0, 1.0).mean())


def sound_canary(rounds: int, rate: float, noise_multiplier: float) -> tuple[float, float]:
    """The final-model cosine of a canary of a sound mechanism in null units, ``(mean, sd)``: a
    canary inserted in ``n ~ Binomial(T, q)`` of T rounds against noise σC per round alone has
    cosine ``n / (σ √T) + N(0, 1)`` with the model's change (whose norm the noise dominates:
    σ C √(T d)), so mean ``q √T / σ`` and variance ``1 + q (1 − q) / σ²``. The real clients'
    signal and the other canaries only lengthen the change, so this is the largest shift a
    sound run shows (:mod:`fedlore.privacy.canaries`)."""
    shift = rate * math.sqrt(rounds) / noise_multiplier
    return shift, math.sqrt(1.0 + rate * (1.0 - rate) / noise_multiplier**2)


MAX_ADVISED = 10**7
""":func:`canaries_for` stops looking above this many canaries."""


def canaries_for(
    shift: float, spread: float, claim: float, delta: float, level: float = LEVEL
) -> int:
    """The fewest canaries whose final-model ε̂ exceeds ``claim`` with :func:`false_alarm`
    probability at most ``(1 − level) / 2`` (the one-sided error of the interval at ``level``)
    for cosines ``N(shift, spread²)`` in null units; :data:`MAX_ADVISED` + 1 when even that many
    do not (the sound canary's own ε is at the claim)."""
    target = 0.5 * (1.0 - level)
    low, high = 1, 2
    while false_alarm(shift, spread, high, claim, delta) > target:
        low, high = high, 2 * high
        if high > MAX_ADVISED:
            return MAX_ADVISED + 1
    while high - low > max(1, high // 100):  # to 1 %: the advice is a round number anyway
        mid = (low + high) // 2
        if false_alarm(shift, spread, mid, claim, delta) > target:
            low = mid
        else:
            high = mid
    return high
