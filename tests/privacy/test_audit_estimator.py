"""The one-shot estimator's math (fedlore.privacy.empirical): cosines -> ε.

The privacy curve of two Gaussians is checked against numerical integration of
∫ max(0, p − e^ε q) in both directions (a curve that keeps one direction, flips a sign in the
log-ratio or mixes up the variances fails), the ε of equal variances against the exact
Gaussian-DP value (tests/privacy/gdp.py, brentq) and dp-accounting's PLD, the fit against
synthetic cosines of known mean and standard deviation (a fit that returns the variance fails),
and ε against the shift: monotone, zero at zero, invariant when both populations move.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from gdp import exact_gdp_epsilon
from scipy import integrate, stats

from fedlore.privacy.empirical import (
    Fit,
    _log_mass,
    estimate_epsilon,
    fit,
    gdp_delta,
    gdp_epsilon,
    hockey_stick,
    null_std,
    pair_epsilon,
    privacy_curve,
)

DELTA = 1e-5


def _integral(eps: float, shift: float, sd_p: float, sd_q: float) -> float:
    """∫ max(0, p − e^ε q) for p = N(shift, sd_p²), q = N(0, sd_q²), by quadrature."""

    def gap(x: float) -> float:
        return max(0.0, stats.norm.pdf(x, shift, sd_p) - math.exp(eps) * stats.norm.pdf(x, 0, sd_q))

    lim = 40.0 * max(sd_p, sd_q) + abs(shift)
    return float(integrate.quad(gap, -lim, lim, limit=800, points=[0.0, shift], epsabs=1e-13)[0])


CASES = [  # (shift, sd_p, sd_q): equal variances, p wider, p narrower, no shift
    (1.0, 1.0, 1.0),
    (2.0, 1.3, 1.0),
    (0.5, 0.7, 1.0),
    (3.0, 0.5, 1.2),
    (0.0, 1.2, 1.0),
    (0.04, 0.015, 0.0144),
]


@pytest.mark.parametrize("shift,sd_p,sd_q", CASES)
@pytest.mark.parametrize("eps", [0.0, 0.5, 1.0, 2.0, 3.0])
def test_the_curve_is_the_hockey_stick_integral_in_both_directions(
    shift: float, sd_p: float, sd_q: float, eps: float
) -> None:
    forward = _integral(eps, shift, sd_p, sd_q)
    backward = _integral(eps, -shift, sd_q, sd_p)  # ∫ max(0, q − e^ε p), shifted
    assert hockey_stick(eps, shift, sd_p, sd_q) == pytest.approx(forward, rel=1e-6, abs=1e-11)
    assert privacy_curve(eps, shift, sd_p, sd_q) == pytest.approx(
        max(forward, backward), rel=1e-6, abs=1e-11
    )


@pytest.mark.parametrize("shift,sd_p,sd_q", [*CASES, (0.0, 1.0, 1.0)])
@pytest.mark.parametrize("eps", [-0.5, 0.0, 1.0])
def test_each_direction_is_its_own_hockey_stick_at_any_epsilon(
    shift: float, sd_p: float, sd_q: float, eps: float
) -> None:
    """Each direction alone (the reverse one has the opposite shift) against quadrature, at
    ε < 0 too, where the region can be the whole line: for P = Q, δ(ε) = 1 − e^ε."""
    for args in ((shift, sd_p, sd_q), (-shift, sd_q, sd_p)):
        want = _integral(eps, *args)
        assert hockey_stick(eps, *args) == pytest.approx(want, rel=1e-6, abs=1e-11)
    if shift == 0.0 and sd_p == sd_q:
        assert hockey_stick(eps, 0.0, sd_p, sd_q) == pytest.approx(max(-math.expm1(eps), 0.0))


def test_the_log_mass_of_an_empty_or_vanishing_interval_is_minus_infinity() -> None:
    """log P(lo < X < hi) is a log probability: -inf for an empty interval (lo >= hi) and for
    one too narrow for its mass to be told from 0 in floating point, never above 0."""
    assert _log_mass(0.0, 1.0, 1.0, 0.5) == -math.inf
    assert _log_mass(0.0, 1.0, 0.5, 0.5) == -math.inf
    assert _log_mass(0.0, 1.0, 0.5, float(np.nextafter(0.5, 1.0))) == -math.inf
    assert _log_mass(0.0, 1.0, -1.0, 1.0) == pytest.approx(math.log(stats.norm.cdf(1) * 2 - 1))
    assert _log_mass(0.0, 1.0, 5.0, math.inf) == pytest.approx(stats.norm.logsf(5.0), rel=1e-12)


def test_the_reverse_direction_counts() -> None:
    """With the observed canaries narrower than the null, telling Q from P is the harder bound
    at δ = 1e-5: a curve of δ_{P‖Q} alone would understate ε."""
    shift, sd_p, sd_q = 0.5, 0.7, 1.0
    one_way = [e for e in np.linspace(0, 12, 2401) if hockey_stick(e, shift, sd_p, sd_q) > DELTA]
    eps = pair_epsilon(shift, sd_p, sd_q, DELTA)
    assert eps > max(one_way, default=0.0) + 1.0
    assert privacy_curve(eps, shift, sd_p, sd_q) == pytest.approx(DELTA, rel=1e-6)
    assert _integral(eps, -shift, sd_q, sd_p) == pytest.approx(DELTA, rel=1e-4)


@pytest.mark.parametrize("mu", [0.2, 0.5, 1.0, 1.58, 3.0, 6.0])
def test_equal_variances_give_the_gaussian_dp_epsilon(mu: float) -> None:
    """N(μσ, σ²) against N(0, σ²) is μ-GDP: the numeric curve, the closed form and the exact
    value agree to 1e-7; dp-accounting's PLD for the Gaussian mechanism of multiplier 1/μ
    (add/remove: sensitivity 1) agrees within its discretization."""
    import dp_accounting
    from dp_accounting import pld

    exact = exact_gdp_epsilon(mu, DELTA)
    assert gdp_epsilon(mu, DELTA) == pytest.approx(exact, rel=1e-7)
    for sd in (1.0, 0.0144, 3.0):
        assert pair_epsilon(mu * sd, sd, sd, DELTA) == pytest.approx(exact, rel=1e-7)
        assert pair_epsilon(-mu * sd, sd, sd, DELTA) == pytest.approx(exact, rel=1e-7)
    interval = 1e-4 * max(exact, 1.0)  # pessimistic by about this much
    acc = pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=interval
    )
    acc.compose(dp_accounting.GaussianDpEvent(1.0 / mu))
    assert acc.get_epsilon(DELTA) == pytest.approx(exact, rel=1e-3, abs=1e-3)


def test_the_fit_of_synthetic_cosines_gives_the_known_epsilon() -> None:
    """Cosines with mean exactly μ σ₀ and standard deviation exactly σ₀ (σ₀ = 1/√d, d = 4810:
    the scale of real cosines, where the variance is 2e-4 and a fit returning it fails) against
    the null N(0, σ₀²): ε is μ-GDP's, to 1e-6."""
    s0 = null_std(4810)
    rng = np.random.default_rng(0)
    for mu in (0.5, 1.5, 3.0):
        raw = rng.standard_normal(500)
        cos = mu * s0 + s0 * (raw - raw.mean()) / raw.std(ddof=1)
        seen = fit(cos)
        assert seen.mean == pytest.approx(mu * s0, rel=1e-12)
        assert seen.std == pytest.approx(s0, rel=1e-12)
        eps = estimate_epsilon(seen, Fit(0.0, s0, 4810), DELTA)
        assert eps == pytest.approx(exact_gdp_epsilon(mu, DELTA), rel=1e-6)


def test_random_synthetic_cosines_land_within_their_sampling_error() -> None:
    """20,000 draws of N(μ σ₀, σ₀²): the fitted mean and std are within 5 standard errors,
    so ε is within the ε of the shifts 5 standard errors away."""
    s0, mu, k = null_std(1000), 1.0, 20_000
    cos = np.random.default_rng(1).normal(mu * s0, s0, size=k)
    seen = fit(cos)
    se = 1.0 / math.sqrt(k)
    assert abs(seen.mean / s0 - mu) < 5 * se
    assert abs(seen.std / s0 - 1.0) < 5 * se
    eps = estimate_epsilon(seen, Fit(0.0, s0, 1000), DELTA)
    low = pair_epsilon(mu - 5 * se, 1.0, 1.0, DELTA)
    assert low < eps < estimate_epsilon(Fit(mu + 5 * se, 1 + 5 * se, k), Fit(0, 1, 1), DELTA)


@pytest.mark.parametrize("sd_p", [1.0, 0.8, 1.25])
def test_epsilon_grows_with_the_shift(sd_p: float) -> None:
    shifts = np.linspace(0.0, 6.0, 25)
    eps = [pair_epsilon(float(m), sd_p, 1.0, DELTA) for m in shifts]
    assert all(b > a for a, b in itertools.pairwise(eps))
    if sd_p == 1.0:
        assert eps[0] == 0.0  # identical distributions: nothing to tell apart


def test_only_the_difference_of_the_means_matters() -> None:
    """The all-iterates null is fitted (its mean is not 0): moving both populations changes
    nothing, ignoring the null's mean would."""
    seen, null = Fit(0.31, 0.1, 200), Fit(0.25, 0.09, 200)
    eps = estimate_epsilon(seen, null, DELTA)
    assert eps == pytest.approx(pair_epsilon(0.06, 0.1, 0.09, DELTA), rel=1e-9)
    moved = estimate_epsilon(Fit(1.31, 0.1, 200), Fit(1.25, 0.09, 200), DELTA)
    assert moved == pytest.approx(eps, rel=1e-6)
    assert pair_epsilon(0.31, 0.1, 0.09, DELTA) > eps + 5


def test_epsilon_solves_the_curve_at_delta() -> None:
    for shift, sd_p, sd_q in CASES:
        eps = pair_epsilon(shift, sd_p, sd_q, DELTA)
        if eps > 0:
            assert privacy_curve(eps, shift, sd_p, sd_q) <= DELTA
            assert privacy_curve(eps * (1 - 1e-6), shift, sd_p, sd_q) > DELTA


def test_fit_uses_the_unbiased_standard_deviation() -> None:
    f = fit([1.0, 2.0, 3.0])
    assert (f.mean, f.std, f.count) == (2.0, 1.0, 3)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        fit([1.0])
    with pytest.raises(ValueError, match=r"^the cosines to fit contain NaN or Inf$"):
        fit([1.0, float("nan")])
    with pytest.raises(ValueError, match=r"^sd_p must be a positive number, got 0\.0$"):
        pair_epsilon(1.0, 0.0, 1.0, DELTA)
    with pytest.raises(ValueError, match=r"^sd_q must be a positive number, got nan$"):
        pair_epsilon(1.0, 1.0, float("nan"), DELTA)
    with pytest.raises(ValueError, match=r"^the mean shift must be finite, got inf$"):
        pair_epsilon(float("inf"), 1.0, 1.0, DELTA)
    for delta in (1.0, 0.0):  # δ = 0: no finite ε separates two Gaussians of different means
        with pytest.raises(ValueError, match=r"δ must be in \(0, 1\)"):
            pair_epsilon(1.0, 1.0, 1.0, delta)
    with pytest.raises(ValueError, match="dimension"):
        null_std(0)
    assert estimate_epsilon(Fit(1.0, 0.0, 5), Fit(0.0, 1.0, 5), DELTA) == math.inf
    assert pair_epsilon(200.0, 1.0, 1.0, DELTA) == math.inf  # told apart with certainty


def test_the_null_of_one_or_four_dimensions() -> None:
    """A unit vector of dimension 1 is ±1: its cosine with any vector is ±1, of standard
    deviation 1; in 4 dimensions 1/√4."""
    assert null_std(1) == 1.0
    assert null_std(4) == 0.5


def test_gdp_without_a_shift_is_private_at_every_epsilon() -> None:
    """μ = 0: the two Gaussians are the same, δ(ε) = 0 for every ε and ε = 0 at any δ."""
    assert gdp_delta(0.0, 0.0) == 0.0
    assert gdp_delta(1.5, 0.0) == 0.0
    assert gdp_epsilon(0.0, DELTA) == 0.0


@pytest.mark.parametrize("mu", [0.5, 2.0])
def test_at_delta_equal_to_the_curve_at_zero_epsilon_is_zero(mu: float) -> None:
    """ε is the smallest ε ≥ 0 with δ(ε) ≤ δ: at δ = δ(0) exactly that is 0 itself (not the
    end of a bisection towards 0); just below δ(0) it is positive."""
    at_zero = gdp_delta(0.0, mu)
    assert 0.0 < at_zero < 1.0
    assert gdp_epsilon(mu, at_zero) == 0.0
    assert gdp_epsilon(mu, at_zero * (1 - 1e-6)) > 0.0


def test_float32_values_are_fitted_in_float64() -> None:
    """The fit of float32 cosines is that of their float64 values (a float32 mean and standard
    deviation would round at 1e-7 of the values, the size of a cosine's signal at d = 10^14)."""
    x = np.random.default_rng(0).normal(0.3, 0.01, 1001).astype(np.float32)
    want = fit(x.astype(np.float64))
    assert fit(x) == want
    assert fit(x.reshape(7, 143)) == want  # any shape: the values


@pytest.mark.parametrize("mu", [114.0, 128.0])
def test_an_epsilon_below_the_cap_is_reported_not_infinite(mu: float) -> None:
    """ε of about 7,000 (μ = 114) and 8,700 (μ = 128) lie below the cap (10^4, past which ε is
    reported as inf): the exact value, not inf (a bracket that doubles from 1 passes 8,192 to
    16,384 and used to report every root above 8,192 as inf)."""
    exact = exact_gdp_epsilon(mu, DELTA)
    assert 6_000 < exact < 1e4
    assert gdp_epsilon(mu, DELTA) == pytest.approx(exact, rel=1e-7)
    assert pair_epsilon(mu, 1.0, 1.0, DELTA) == pytest.approx(exact, rel=1e-7)
    assert exact_gdp_epsilon(141.0, DELTA) > 1e4 and gdp_epsilon(141.0, DELTA) == math.inf
