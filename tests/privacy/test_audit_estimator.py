"""The one-shot estimator's math (fedlore.privacy.empirical): cosines -> ε.

The privacy curve of two Gaussians is checked against numerical integration of
∫ max(0, p − e^ε q) in both directions (a curve that keeps one direction, flips a sign in the
log-ratio or mixes up the variances fails), the ε of equal variances against the exact
Gaussian-DP value (tests/privacy/gdp.py, brentq) and dp-accounting's PLD, the fit against
synthetic cosines of known mean and standard deviation (a fit that returns the variance fails),
and ε against the shift: monotone, zero at zero, invariant when both populations move. The
estimate's error (fedlore.privacy.empirical_error): the vector ε against the scalar one, the
interval against a brute-force projection and, by simulation of a Gaussian mechanism, its
coverage of the true ε; the false-alarm probability against a simulation; the advised canaries
and the sound canary's cosine against a simulated mechanism.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
from gdp import exact_gdp_epsilon
from scipy import integrate, optimize, stats

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
from fedlore.privacy.empirical_error import (
    LEVEL,
    MAX_ADVISED,
    _curve,
    _hockey,
    canaries_for,
    epsilon_interval,
    epsilons,
    false_alarm,
    sound_canary,
)
from fedlore.privacy.empirical_error import _log_mass as _vector_log_mass

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


@pytest.mark.parametrize("scale", [1e-12, 1e12])
def test_the_curve_depends_on_the_spreads_in_units_of_the_shift_only(scale: float) -> None:
    """δ(ε) of N(s, σ_p²) against N(0, σ_q²) is that of N(t s, (t σ_p)²) against N(0, (t σ_q)²)
    (the change of variable x -> t x): the scalar and vector forms of pairs scaled by t = 1e±12
    against the quadrature of the unscaled pair. A cutoff of "equal variances" not in units of
    1/σ² (σ_q² for 1/σ_q², 1/σ_q³, 2/σ_q) takes the scaled pair's unequal variances for equal."""
    rows = []
    for shift, sd_p, sd_q in [(2.0, 1.3, 1.0), (0.5, 0.7, 1.0), (3.0, 0.5, 1.2)]:
        for args in ((shift, sd_p, sd_q), (-shift, sd_q, sd_p)):
            for eps in (0.0, 1.0):
                want = _integral(eps, *args)
                scaled = tuple(scale * v for v in args)
                assert hockey_stick(eps, *scaled) == pytest.approx(want, rel=1e-6, abs=1e-11)
                rows.append((eps, *scaled, want))
    eps_, shift_, sd_p_, sd_q_, want_ = map(np.array, zip(*rows, strict=True))
    assert np.allclose(_hockey(eps_, shift_, sd_p_, sd_q_), want_, rtol=1e-6, atol=1e-11)


@pytest.mark.parametrize("shift", [-1.0, 1.0])
def test_a_region_that_ends_at_the_nulls_mean(shift: float) -> None:
    """At ε = log(σ_q/σ_p) − s²/(2 σ_p²), the log-ratio at x = 0, the region's inner end is 0
    exactly (the quadratic's constant term vanishes: roots 0 and −B/A; here the root formula's
    q is ±1 exactly): each direction, scalar and vector, against quadrature."""
    sd_p, sd_q = 1.0, 2.0
    eps = math.log(sd_q / sd_p) - 0.5 * shift**2 / sd_p**2
    want = _integral(eps, shift, sd_p, sd_q)
    assert want > 1e-3  # the premise: a region of real mass
    assert hockey_stick(eps, shift, sd_p, sd_q) == pytest.approx(want, rel=1e-6, abs=1e-11)
    got = _hockey(*(np.array([v]) for v in (eps, shift, sd_p, sd_q)))
    assert got[0] == pytest.approx(want, rel=1e-6, abs=1e-11)


@pytest.mark.parametrize("sd_p", [1.0, 1.0 + 1e-11])
@pytest.mark.parametrize("eps", [0.5, 3.0])
def test_pairs_beyond_the_range_of_log_phi_give_delta_zero_or_one(eps: float, sd_p: float) -> None:
    """Pairs whose regions hold a mass whose log is -inf in floating point, against μ-GDP's closed
    form (Dong, Roth & Su): a shift of 1e-200 standard deviations (equal variances) has δ = 0
    at ε > 0, not NaN (its region x > ε/μ lies 1e200 standard deviations out: no mass under P
    or Q); a shift of 1e150 has δ = 1 at any ε, with equal variances and with variances 2e-11
    apart (the log-ratio's far root then lies 1e160 standard deviations out: the region's first
    interval holds no mass, its second all of P)."""
    if sd_p == 1.0:
        assert gdp_delta(eps, 1e-200) == 0.0
        for args in ((1e-200, 1.0, 1.0), (-1e-200, 1.0, 1.0)):
            assert hockey_stick(eps, *args) == 0.0
            assert _hockey(*(np.array([v]) for v in (eps, *args)))[0] == 0.0
    assert gdp_delta(eps, 1e150) == 1.0
    for args in ((1e150, sd_p, 1.0), (-1e150, sd_p, 1.0), (1e150, 1.0, sd_p)):
        assert hockey_stick(eps, *args) == pytest.approx(1.0, rel=1e-12)
        assert _hockey(*(np.array([v]) for v in (eps, *args)))[0] == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("shift,sd_p,sd_q", [(2.0, 1.3, 1.0), (-0.5, 2.0, 1.0)])
def test_where_p_is_above_e_eps_q_everywhere_the_region_is_the_whole_line(
    shift: float, sd_p: float, sd_q: float
) -> None:
    """A wider P at ε = −4, where the log-ratio's quadratic has no real root (p > e^ε q on the
    whole line, a shifted pair): δ(ε) = ∫ (p − e^ε q) = 1 − e^ε exactly, scalar and vector, and
    the quadrature agrees."""
    eps = -4.0
    want = -math.expm1(eps)
    assert _integral(eps, shift, sd_p, sd_q) == pytest.approx(want, rel=1e-6)
    assert hockey_stick(eps, shift, sd_p, sd_q) == pytest.approx(want, rel=1e-12)
    got = _hockey(*(np.array([v]) for v in (eps, shift, sd_p, sd_q)))
    assert got[0] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("eps", [300.0, 1000.0])
def test_where_p_is_below_e_eps_q_everywhere_the_region_is_empty_and_quiet(eps: float) -> None:
    """A narrower P far from Q's mean at a large ε (what the vector ε's bracket evaluates): the
    log-ratio's quadratic has no real root and lies below ε, so p ≤ e^ε q on the whole line and
    δ(ε) = 0 exactly, scalar and vector, for either sign of the shift, and quietly: the empty
    region is (0, 0), not a reversed interval between the stand-in roots far out, whose mass
    is 0 too but overflows its tail ratio on the way (a RuntimeWarning)."""
    rows = [(eps, shift, 0.9, 1.0) for shift in (10.0, -10.0)]
    for row in rows:
        _, shift, sd_p, sd_q = row
        a, b = 0.5 * (1 / sd_q**2 - 1 / sd_p**2), shift / sd_p**2
        c = math.log(sd_q / sd_p) - 0.5 * shift**2 / sd_p**2 - eps
        assert a < 0 and b * b - 4 * a * c < 0  # the premise: no real root, p below e^ε q
        assert hockey_stick(*row) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _hockey(*map(np.array, zip(*rows, strict=True)))
    assert got.tolist() == [0.0, 0.0]


def test_the_log_mass_of_an_empty_or_vanishing_interval_is_minus_infinity() -> None:
    """log P(lo < X < hi) is a log probability: -inf for an empty interval (lo >= hi) and for
    one too narrow for its mass to be told from 0 in floating point, never above 0."""
    assert _log_mass(0.0, 1.0, 1.0, 0.5) == -math.inf
    assert _log_mass(0.0, 1.0, 0.5, 0.5) == -math.inf
    assert _log_mass(0.0, 1.0, 0.5, float(np.nextafter(0.5, 1.0))) == -math.inf
    # around the mean (the narrow-interval erf form): ends that round to the mean in sd's units
    # (a = b = 0) leave a mass of 0, whose log is -inf, not a math domain error
    assert _log_mass(0.0, 10.0, -5e-324, 5e-324) == -math.inf
    assert _log_mass(1.0, 1e308, 1.0, float(np.nextafter(1.0, 2.0))) == -math.inf
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


# ---------------------------------------------------------------- the estimate's error


def test_the_vector_epsilon_is_the_scalar_one() -> None:
    """epsilons (the interval's workhorse) against pair_epsilon: the fixed cases, random pairs
    of unequal variances and an infinite one."""
    rng = np.random.default_rng(7)
    shift = np.concatenate([[c[0] for c in CASES], rng.uniform(0, 5, 60), [200.0]])
    sd_p = np.concatenate([[c[1] for c in CASES], rng.uniform(0.3, 3, 60), [1.0]])
    sd_q = np.concatenate([[c[2] for c in CASES], rng.uniform(0.3, 3, 60), [1.0]])
    got = epsilons(shift, sd_p, sd_q, DELTA)
    want = [pair_epsilon(s, p, q, DELTA) for s, p, q in zip(shift, sd_p, sd_q, strict=True)]
    assert got[-1] == math.inf
    assert np.allclose(got[:-1], want[:-1], rtol=1e-8, atol=1e-9)
    # the result has the inputs' broadcast shape (a 0-d array for scalars)
    grid = epsilons(np.array([[0.5], [1.0]]), np.array([0.8, 1.0, 1.2]), 1.0, DELTA)
    assert grid.shape == (2, 3) and epsilons(0.5, 1.0, 1.0, DELTA).shape == ()
    assert grid[1, 1] == pytest.approx(pair_epsilon(1.0, 1.0, 1.0, DELTA), rel=1e-8)
    # float32 inputs are computed in float64: the result of their float64 values
    single = np.array([0.7, 1.3, 0.9], dtype=np.float32)
    scalar = epsilons(float(single[0]), float(single[1]), float(single[2]), DELTA)
    assert epsilons(single[:1], single[1:2], single[2:], DELTA) == scalar


def test_the_vector_epsilon_below_the_cap_is_reported_not_infinite() -> None:
    """As pair_epsilon (test_an_epsilon_below_the_cap_is_reported_not_infinite): ε of about
    7,000 and 8,700 (μ-GDP, μ = 114 and 128) are the exact values, μ = 141 (ε past the cap
    10^4) is inf. The vector form used to double its bracket from 8,192 to 16,384 and report
    every root above 8,192 as inf (the interval's upper end of an estimate of 8,700 was inf),
    and to lose e^ε Q(R) where Q(R) underflows (ε above about 700: 7,000 came out 1 too
    high)."""
    mu = np.array([114.0, 128.0, 141.0])
    got = epsilons(mu, 1.0, 1.0, DELTA)
    assert got[:2] == pytest.approx([exact_gdp_epsilon(m, DELTA) for m in mu[:2]], rel=1e-9)
    assert got[2] == math.inf
    seen = Fit(128.0, 1.0, 10**6)
    got_interval = epsilon_interval(seen, Fit(0.0, 1.0, 10), DELTA, null_exact=True)
    assert 8_000 < got_interval.low < got_interval.high < 1e4


def test_the_vector_hockey_stick_is_the_scalar_one_in_each_direction() -> None:
    """_hockey and _curve (the vector forms the interval and the false alarm use) against
    hockey_stick and privacy_curve, elementwise in one call that mixes every kind of region
    (half-line, interval, outside of one, whole line, empty): the cases, equal distributions,
    negative shifts, and ε < 0 (where P = Q gives the whole line, δ = 1 − e^ε)."""
    cases = [*CASES, (0.0, 1.0, 1.0), (-1.5, 0.8, 1.1), (-0.7, 1.0, 1.0)]
    rows = [
        (eps, *args)
        for shift, sd_p, sd_q in cases
        for eps in (-0.5, 0.0, 0.5, 2.0)
        for args in ((shift, sd_p, sd_q), (-shift, sd_q, sd_p))
    ]
    eps, shift, sd_p, sd_q = map(np.array, zip(*rows, strict=True))
    want = [hockey_stick(*row) for row in rows]
    assert np.allclose(_hockey(eps, shift, sd_p, sd_q), want, rtol=1e-9, atol=1e-15)
    curve = [privacy_curve(*row) for row in rows]
    assert np.allclose(_curve(eps, shift, sd_p, sd_q), curve, rtol=1e-9, atol=1e-15)
    assert _hockey(np.array([-0.5]), np.zeros(1), np.ones(1), np.ones(1))[0] == pytest.approx(
        -math.expm1(-0.5)
    )


def test_the_vector_log_mass_is_accurate_in_the_tails_and_minus_infinity_when_empty() -> None:
    """_log_mass (vector) is log P(lo < X < hi): far in either tail, where the mass itself
    underflows, to full relative precision (the difference taken from the tail, not 1 − Φ),
    around the mean, and -inf for an empty interval (quietly: no RuntimeWarning of log1p(-1) or
    of -inf - -inf); the scalar _log_mass's values."""
    rows = [  # (mean, sd, lo, hi)
        (0.0, 1.0, 10.0, math.inf),
        (0.0, 1.0, -math.inf, -10.0),
        (2.0, 3.0, 32.0, 33.5),
        (0.0, 1.0, 40.0, math.inf),
        (0.0, 2.0, -60.0, -50.0),
        (0.0, 1.0, -1.0, 1.0),
        (0.0, 1.0, -math.inf, math.inf),
        (0.0, 1.0, 3.0, 2.0),
        (0.0, 1.0, 0.5, 0.5),
        (0.0, 1.0, math.inf, math.inf),
        (0.0, 1.0, -math.inf, -math.inf),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _vector_log_mass(*map(np.array, zip(*rows, strict=True)))
    want = [_log_mass(*row) for row in rows]
    assert got[:7] == pytest.approx(want[:7], rel=1e-12)
    assert got[0] == pytest.approx(stats.norm.logsf(10.0), rel=1e-12)
    assert got[3] == pytest.approx(stats.norm.logsf(40.0), rel=1e-12)  # the mass is 4e-350
    assert got[6] == 0.0
    assert got[7] == got[8] == got[9] == got[10] == -math.inf


def test_the_vector_epsilon_of_a_private_pair_is_exactly_zero() -> None:
    """As pair_epsilon: ε = 0 where δ(0) ≤ δ (equal distributions; δ exactly the curve at 0),
    not the end of a bisection towards 0, elementwise beside pairs that need a search."""
    shift, sd_p, sd_q = np.array([0.0, 1.0, 0.5]), np.array([1.0, 1.0, 0.7]), np.ones(3)
    got = epsilons(shift, sd_p, sd_q, DELTA)
    assert got[0] == 0.0 and got[1] > 0.0 and got[2] > 0.0
    at_zero = float(_curve(np.zeros(1), np.ones(1), np.ones(1), np.ones(1))[0])
    assert epsilons(1.0, 1.0, 1.0, at_zero)[()] == 0.0
    assert epsilons(1.0, 1.0, 1.0, at_zero * (1 - 1e-6))[()] > 0.0


def test_epsilon_grows_with_the_shift_at_any_fixed_standard_deviations() -> None:
    """What the interval's scan relies on: at fixed (σ, σ₀) ε is smallest at the centre of the
    admissible shifts nearest 0 and largest at the far end."""
    shifts = np.linspace(0.0, 5.0, 41)
    for sd_p in (0.5, 0.8, 0.95, 1.0, 1.05, 1.3, 2.0):
        eps = epsilons(shifts, sd_p, 1.0, DELTA)
        assert np.all(np.diff(eps) >= -1e-9), sd_p


def _brute_interval(seen: Fit, null_sd: float, chi2_quantile: float) -> tuple[float, float]:
    """[min ε, max ε] over a dense grid of (μ, σ) with deviance below the threshold, with the
    scalar ε: the projection the interval is, computed the slow way."""
    k = seen.count
    s_hat = seen.std * math.sqrt((k - 1) / k)
    mus = seen.mean + np.linspace(-4, 4, 161) * s_hat / math.sqrt(k)
    sds = s_hat * np.exp(np.linspace(-4, 4, 161) / math.sqrt(2 * k))
    m, s = np.meshgrid(mus, sds, indexing="ij")
    dev = k * (2 * np.log(s / s_hat) + (s_hat**2 + (seen.mean - m) ** 2) / s**2 - 1)
    inside = dev <= chi2_quantile
    eps = epsilons(m[inside], s[inside], null_sd, DELTA)
    return float(eps.min()), float(eps.max())


@pytest.mark.parametrize(
    ("mu", "ratio", "k"), [(0.5, 1.0, 100), (1.2, 0.9, 400), (0.1, 1.1, 60), (0.8, 1.0, 30)]
)
def test_the_interval_is_the_projection_of_the_joint_confidence_region(
    mu: float, ratio: float, k: int
) -> None:
    """The final-model interval is [min, max] of ε over {(μ, σ): D(μ, σ) ≤ χ²₂(0.95) = 5.99},
    D the Gaussian deviance of k cosines (its k(x̄ − μ)²/σ² holds the √k of the mean's error):
    the brute-force projection on a dense grid agrees to its resolution, and the estimate lies
    inside. A deviance without its k, or a χ²₁ threshold (3.84), gives another interval."""
    s0 = null_std(5000)
    seen = Fit(mu * s0, ratio * s0, k)
    got = epsilon_interval(seen, Fit(0.0, s0, 5000), DELTA, null_exact=True)
    low, high = _brute_interval(seen, s0, -2 * math.log(0.05))
    assert got.level == LEVEL == 0.95
    assert got.low == pytest.approx(low, rel=0.03, abs=0.02)
    assert got.high == pytest.approx(high, rel=0.03)
    assert got.low <= estimate_epsilon(seen, Fit(0.0, s0, 5000), DELTA) <= got.high


@pytest.mark.parametrize(("mu", "ratio", "k"), [(0.5, 1.0, 100), (1.2, 0.9, 400)])
def test_the_all_iterates_interval_projects_three_parameters(
    mu: float, ratio: float, k: int
) -> None:
    """With the null fitted (3 parameters: μ − μ₀, σ, σ₀) to so many unseen canaries that its
    own error vanishes, the interval is the projection of {D(μ, σ) ≤ χ²₃(0.95) = 7.81}: the
    brute force with that threshold agrees; χ²₄ (9.49) or χ²₂ would not."""
    seen = Fit(mu, ratio, k)
    got = epsilon_interval(seen, Fit(0.0, 1.0, 10**9), DELTA)
    low, high = _brute_interval(seen, 1.0, float(stats.chi2.ppf(0.95, 3)))
    assert got.low == pytest.approx(low, rel=0.03, abs=0.02)
    assert got.high == pytest.approx(high, rel=0.03)


def _brute_fitted_interval(seen: Fit, null: Fit, chi2_quantile: float) -> tuple[float, float]:
    """[min ε, max ε] over a grid of (μ − μ₀, σ, σ₀) whose deviance (the two fits' standard
    deviations' parts plus the shift's, μ + μ₀ profiled out: (x̄ − x̄₀ − d)² / (σ²/k + σ₀²/k'))
    is below the threshold; each σ over its own admissible range (found by brentq)."""
    axes, parts = [], []
    for f in (seen, null):
        k, s_hat = f.count, f.std * math.sqrt((f.count - 1) / f.count)

        def part(u: float, k: int = k) -> float:
            return k * (2 * math.log(u) + 1 / u**2 - 1) - chi2_quantile

        lo, hi = optimize.brentq(part, 1e-3, 1.0), optimize.brentq(part, 1.0, 1e3)
        axes.append(s_hat * np.linspace(lo, hi, 21))
        parts.append((k, s_hat))
    sp, sq = np.meshgrid(*axes, indexing="ij")
    (k, s_hat), (k0, s0_hat) = parts
    dev = k * (2 * np.log(sp / s_hat) + s_hat**2 / sp**2 - 1)
    dev += k0 * (2 * np.log(sq / s0_hat) + s0_hat**2 / sq**2 - 1)
    var = sp**2 / seen.count + sq**2 / null.count
    centre = seen.mean - null.mean
    reach = math.sqrt(chi2_quantile * float(var.max()))
    shift = centre + np.linspace(-reach, reach, 41)
    inside = dev[..., None] + (centre - shift) ** 2 / var[..., None] <= chi2_quantile
    grid = [np.broadcast_to(v, inside.shape)[inside] for v in (shift, sp[..., None], sq[..., None])]
    eps = epsilons(grid[0], grid[1], grid[2], DELTA)
    return float(eps.min()), float(eps.max())


@pytest.mark.parametrize(("mu", "ratio", "k", "k0"), [(1.0, 1.0, 200, 6), (1.0, 1.2, 30, 3000)])
def test_the_all_iterates_interval_is_the_projection_of_both_fits_errors(
    mu: float, ratio: float, k: int, k0: int
) -> None:
    """With the null fitted to few unseen canaries (its spread's error dominates) or to many
    (the seen ones' does), at the scale of real cosines and a null mean away from 0: the
    interval holds every ε of the brute-force region of (μ − μ₀, σ, σ₀) and its upper end is
    that region's (to the grid's resolution)."""
    s0 = null_std(5000)
    seen, null = Fit((mu + 0.3) * s0, ratio * s0, k), Fit(0.3 * s0, s0, k0)
    got = epsilon_interval(seen, null, DELTA)
    low, high = _brute_fitted_interval(seen, null, float(stats.chi2.ppf(0.95, 3)))
    assert got.low <= low * (1 + 1e-6)
    assert high * (1 - 5e-3) <= got.high <= high * 1.03


def test_the_interval_depends_on_the_distance_of_the_means_only() -> None:
    """Moving both fits, or swapping which mean is larger, leaves the interval as it is (ε
    depends on |μ − μ₀|)."""
    want = epsilon_interval(Fit(0.8, 1.0, 400), Fit(0.0, 1.1, 300), DELTA)
    for seen, null in (
        (Fit(1.8, 1.0, 400), Fit(1.0, 1.1, 300)),
        (Fit(-0.8, 1.0, 400), Fit(0.0, 1.1, 300)),
    ):
        got = epsilon_interval(seen, null, DELTA)
        assert (got.low, got.high) == pytest.approx((want.low, want.high), rel=1e-9)
    exact = epsilon_interval(Fit(-0.8, 1.0, 400), Fit(0.0, 1.0, 10), DELTA, null_exact=True)
    assert exact == epsilon_interval(Fit(0.8, 1.0, 400), Fit(0.0, 1.0, 10), DELTA, null_exact=True)


def _coverage(trials: int, k: int, mu: float, fitted_null: bool) -> tuple[float, float]:
    """The share of simulated audits of a Gaussian mechanism (seen cosines N(μ, 1), null N(0, 1)
    exact or fitted to k unseen) whose interval holds the true ε = μ-GDP's, and the share whose
    lower end is above it (a false alarm against a claim at the true ε)."""
    rng = np.random.default_rng(2024)
    true = exact_gdp_epsilon(mu, DELTA)
    hit = above = 0
    for _ in range(trials):
        seen = fit(rng.normal(mu, 1.0, k))
        null = fit(rng.normal(0.0, 1.0, k)) if fitted_null else Fit(0.0, 1.0, 10**6)
        got = epsilon_interval(seen, null, DELTA, null_exact=not fitted_null)
        hit += got.low <= true <= got.high
        above += got.low > true
    return hit / trials, above / trials


def test_the_final_model_interval_covers_the_true_epsilon_at_its_level() -> None:
    """200 audits of a sound Gaussian mechanism with 100 canaries at μ = 0.5 (ε ≈ 2): the 95 %
    interval holds the true ε in 93-99.5 % of them (measured: 97 %; conservative, a projection),
    and its lower end is above it in at most 5 % (the false alarm of reading "lower end above
    ε" as broken). Forgetting √k (an interval √k times too wide) covers all 200; a mean error
    of σ/k, or the χ²₁ threshold at equal variances (where ε has a kink), covers too few."""
    coverage, above = _coverage(200, 100, 0.5, fitted_null=False)
    assert 0.93 <= coverage <= 0.995
    assert above <= 0.05


def test_the_all_iterates_interval_covers_and_narrows_as_one_over_root_k() -> None:
    """With the null fitted to k' unseen canaries (equal variances: ε's kink): 60 audits cover
    the true ε in at least 90 % (measured: 98 %), and four times the canaries and unseen ones
    halve the interval's width (within 20 %): the error of both fits scales as 1/√k."""
    coverage, above = _coverage(60, 100, 0.5, fitted_null=True)
    assert coverage >= 0.9 and above <= 0.05
    widths = []
    for k in (400, 1600):
        got = epsilon_interval(Fit(0.8, 1.0, k), Fit(0.0, 1.0, k), DELTA)
        widths.append(got.high - got.low)
    assert 0.4 <= widths[1] / widths[0] <= 0.6


def test_the_false_alarm_probability_matches_a_simulation() -> None:
    """false_alarm against 20,000 simulated fits of k canaries (x̄ ~ N(μ, 1/k), s² ~ χ²/(k−1),
    ε̂ above the claim), at k = 100 and k = 3: within 4 standard errors; a mean error of 1/k or
    a variance of χ²_k fails. The newcomer's case (ε = 2 over 2 rounds, a canary at half the
    accountant's exact μ) gives 41 % at 100 canaries (their simulation: 39 %), under 1 % at
    1,000 (0.3 %)."""
    rng = np.random.default_rng(11)
    cases = ((100, 0.35, 2.2), (3, 0.5, 12.0), (30, 0.0, 3.0))  # k = 3 tells χ²_{k−1} from χ²_k
    for k, mu, claim in cases:
        n = 20_000
        means = rng.normal(mu, 1.0 / math.sqrt(k), n)
        sds = np.sqrt(rng.chisquare(k - 1, n) / (k - 1))
        simulated = float(np.mean(epsilons(means, sds, 1.0, DELTA) > claim))
        computed = false_alarm(mu, 1.0, k, claim, DELTA)
        assert false_alarm(-mu, 1.0, k, claim, DELTA) == pytest.approx(computed, rel=1e-12)
        se = math.sqrt(simulated * (1 - simulated) / n)
        assert abs(computed - simulated) < 4 * se + 1e-3, k
        assert 0.2 < computed < 0.8  # a probability the test can tell apart
    mu_acc = exact_gdp_epsilon_inverse(2.0)
    assert false_alarm(mu_acc / 2, 1.0, 100, 2.0, DELTA) == pytest.approx(0.41, abs=0.02)
    assert false_alarm(mu_acc / 2, 1.0, 1000, 2.0, DELTA) < 0.01


def exact_gdp_epsilon_inverse(eps: float) -> float:
    """The μ of μ-GDP whose ε at DELTA is ``eps`` (bisection on the exact value)."""
    lo, hi = 1e-3, 10.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if exact_gdp_epsilon(mid, DELTA) < eps else (lo, mid)
    return 0.5 * (lo + hi)


def test_the_advised_canaries_are_the_fewest_with_a_small_false_alarm() -> None:
    shift, spread = 0.25, 1.0
    k = canaries_for(shift, spread, 2.0, DELTA)
    assert false_alarm(shift, spread, k, 2.0, DELTA) <= 0.025
    assert false_alarm(shift, spread, int(k * 0.97), 2.0, DELTA) > 0.025
    assert 300 < k < 3000
    assert canaries_for(1.0, 1.0, exact_gdp_epsilon(1.0, DELTA), DELTA) == MAX_ADVISED + 1


def test_few_advised_canaries_are_counted_exactly() -> None:
    """Below 100 canaries the search is exact: the advice is the fewest k whose false alarm is
    at most (1 − level)/2, k − 1 is above it."""
    k = canaries_for(0.0, 1.0, 6.0, DELTA)
    assert k == 45 and type(k) is int
    assert false_alarm(0.0, 1.0, k, 6.0, DELTA) <= 0.025 < false_alarm(0.0, 1.0, k - 1, 6.0, DELTA)


def test_the_sound_canary_is_the_noise_only_cosine() -> None:
    """A canary of a Gaussian mechanism in T = 4 rounds at rate q = 1/2 and σ = 2, simulated in
    d = 4,000 coordinates: its cosine with the sum of the rounds' noised insertions, in null
    units, has mean q√T/σ and variance 1 + q(1−q)/σ² (within sampling error and the other
    canaries' 2 % share of the norm)."""
    rng = np.random.default_rng(5)
    d, k, rounds, q, sigma = 4000, 400, 4, 0.5, 2.0
    g = rng.standard_normal((k, d))
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    total = np.zeros(d)
    for _ in range(rounds):
        chosen = rng.choice(k, size=int(q * k), replace=False)
        total += g[chosen].sum(axis=0) + sigma * rng.standard_normal(d)
    cos = g @ total / np.linalg.norm(total) * math.sqrt(d)
    shift, spread = sound_canary(rounds, q, sigma)
    assert shift == pytest.approx(0.5) and spread == pytest.approx(math.sqrt(1.0625))
    assert cos.mean() == pytest.approx(shift, abs=4 * spread / math.sqrt(k) + 0.02)
    assert cos.std(ddof=1) == pytest.approx(spread, rel=0.12)


def test_an_interval_needs_varying_fits() -> None:
    for level in (1.0, 0.0):
        with pytest.raises(
            ValueError, match=rf"^the interval's level must be in \(0, 1\), got {level}$"
        ):
            epsilon_interval(Fit(1.0, 1.0, 10), Fit(0.0, 1.0, 10), DELTA, level=level)
    message = r"^an interval needs a fit of at least 2 varying values, got "
    with pytest.raises(ValueError, match=message + r"Fit\(mean=1\.0, std=0\.0, count=10\)$"):
        epsilon_interval(Fit(1.0, 0.0, 10), Fit(0.0, 1.0, 10), DELTA)
    with pytest.raises(
        ValueError, match="varying values, got Fit\\(mean=0\\.0, std=1\\.0, count=1\\)"
    ):
        epsilon_interval(Fit(1.0, 1.0, 10), Fit(0.0, 1.0, 1), DELTA)  # a fitted null of 1 value
    # an exact null is not a fit: its count is not read; two observed values are enough
    got = epsilon_interval(Fit(1.0, 1.0, 2), Fit(0.0, 1.0, 1), DELTA, null_exact=True)
    assert 0.0 <= got.low <= got.high
    # two values in each fit: σ and σ₀ may lie more than e² from their fits (χ²₃ = 7.81)
    got = epsilon_interval(Fit(1.0, 1.0, 2), Fit(0.0, 1.0, 2), DELTA)
    assert got.low == 0.0 and 1000 < got.high < math.inf


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
