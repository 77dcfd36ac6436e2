"""The empirical ε of Gaussian pairs at the ends of float64's range: spreads far apart, or a
whole pair scaled by 1e±200 (:func:`fedlore.privacy.empirical.standardized`).

A pair whose spreads are 1e-152 apart came out with a finite ε, and 1e-160 apart with ε = 0
(the curve's ``1/sd²`` overflowed), for two distributions told apart with certainty; a pair
scaled by 1e-200 divided by zero. Cosines of real canaries never come near (their spread is
above float rounding, about 1e-17), but the functions are public.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from fedlore.privacy.empirical import SPREAD_RATIO, Fit, _log_mass, pair_epsilon, privacy_curve
from fedlore.privacy.empirical_error import epsilon_interval, epsilons

TINY = [1e-101, 1e-130, 1e-152, 1e-154, 1e-160, 1e-200, 1e-300, 5e-324]


@pytest.mark.parametrize("ratio", TINY)
@pytest.mark.parametrize("shift", [0.0, 0.5, -3.0])
def test_spreads_far_apart_are_told_apart_with_certainty(ratio: float, shift: float) -> None:
    """The narrow Gaussian against the wide one, either way round, scalar and vector: ε = inf
    at any δ (a finite ε here under-reports a pair that leaks everything)."""
    for delta in (1e-10, 1e-5, 0.5, 1 - 1e-16):
        assert pair_epsilon(shift, ratio, 1.0, delta) == math.inf
        assert pair_epsilon(shift, 1.0, ratio, delta) == math.inf
        got = epsilons(
            np.array([shift, shift]), np.array([ratio, 1.0]), np.array([1.0, ratio]), delta
        )
        assert np.all(got == np.inf), got


def test_the_cutoff_changes_no_answer_the_old_curve_gave_right() -> None:
    """Between SPREAD_RATIO and the overflow (1e-100 to 1e-150) the curve itself, unscaled,
    already puts δ above any δ < 1 at the cap: the cutoff only replaces the wrong answers below
    it. And just above the cutoff the answer is still inf, computed (not cut off)."""
    for ratio in (1e-100, 1e-120, 1e-150):
        for shift in (0.0, 0.5, -3.0):
            assert privacy_curve(1e4, shift, ratio, 1.0) >= 1 - 1e-16
    assert SPREAD_RATIO == 1e-100
    assert pair_epsilon(0.5, 2e-100, 1.0, 1e-5) == math.inf


MIDDLE = [1e-17, 3e-17, 1e-20, 1e-40, 1e-77, 1e-78, 1e-99, 1e-100]


@pytest.mark.parametrize("ratio", MIDDLE)
def test_spreads_apart_but_inside_the_cutoff_are_computed_without_error(ratio: float) -> None:
    """Between float rounding and the cutoff the region around the narrow Gaussian's mean is
    below 1e-16 of the wide one's spread: its mass is the difference of two tails that round to
    1, so ``log1p(-1)`` raised (a math domain error) at shift 0. Now computed, inf at every δ,
    the same as the vector form (which warned about an overflow) for both orders."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for shift in (0.0, 1e-30, 1.0, -3.0):
            for delta in (1e-9, 1e-5, 0.5, 0.9):
                assert pair_epsilon(shift, ratio, 1.0, delta) == math.inf
                assert pair_epsilon(shift, 1.0, ratio, delta) == math.inf
                pair = (np.array([shift, shift]), np.array([ratio, 1.0]), np.array([1.0, ratio]))
                assert np.all(epsilons(*pair, delta) == np.inf)


def test_the_mass_of_an_interval_narrower_than_float_rounding_is_its_width_times_the_density() -> (
    None
):
    """``log P(−w < X < w)`` for X ~ N(0, 1) and w far below 1e-16 is ``log(2 w φ(0))`` (it was
    a math domain error; at w = 1e-9 the old subtraction kept 7 digits)."""
    for w in (1e-9, 1e-20, 1e-200):
        want = math.log(2 * w / math.sqrt(2 * math.pi))
        assert _log_mass(0.0, 1.0, -w, w) == pytest.approx(want, rel=1e-14, abs=0)
        assert _log_mass(0.0, 2.0, -2 * w, 6 * w) == pytest.approx(
            math.log(4 * w / math.sqrt(2 * math.pi)), rel=1e-14, abs=0
        )
    # a wide interval keeps its tails: log(1 − 2 Φ(−9)) ≈ −2 Φ(−9) = −2.26e-19, not log(1.0)
    assert _log_mass(0.0, 1.0, -9.0, 9.0) == pytest.approx(
        -math.erfc(9 / math.sqrt(2)), rel=1e-12, abs=0
    )
    assert _log_mass(0.0, 1.0, -1.0, 2.0) == pytest.approx(
        math.log(0.5 * (math.erf(2 / math.sqrt(2)) + math.erf(1 / math.sqrt(2)))), rel=1e-15
    )


@pytest.mark.parametrize("scale", [1e-200, 1e-150, 1e150, 1e200])
def test_a_pair_scaled_to_the_ends_of_float64_keeps_its_epsilon(scale: float) -> None:
    """ε is unchanged by rescaling x: pairs scaled by 1e±150 and 1e±200 (whose 1/sd² overflows
    or underflows) give the unscaled pair's ε, scalar and vector."""
    pairs = [(2.0, 1.3, 1.0), (0.5, 0.7, 1.0), (3.0, 0.5, 1.2), (1.0, 1.0, 1.0)]
    for shift, sd_p, sd_q in pairs:
        want = pair_epsilon(shift, sd_p, sd_q, 1e-5)
        assert 0 < want < math.inf
        got = pair_epsilon(scale * shift, scale * sd_p, scale * sd_q, 1e-5)
        assert got == pytest.approx(want, rel=1e-8)
    s, p, q = (scale * np.array(v) for v in zip(*pairs, strict=True))
    want_v = [pair_epsilon(*pair, 1e-5) for pair in pairs]
    assert np.allclose(epsilons(s, p, q, 1e-5), want_v, rtol=1e-8)


def test_a_shift_past_floats_range_of_the_spread_is_certain() -> None:
    """Without a warning: the shift in sd_q's units overflows to inf on purpose."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pair_epsilon(1e200, 1e-200, 1e-200, 1e-5) == math.inf
        assert epsilons(1e200, 1e-200, 1e-200, 1e-5) == np.inf


def test_a_batch_of_certain_capped_and_finite_pairs_gives_each_its_own_epsilon() -> None:
    """The vector form over a mixed batch equals the scalar pair by pair: a pair cut off as
    certain, one whose bracket reaches the cap (inf) or stops short of it (7887 at δ = 0.9),
    finite ones, a shift past float's range. A pair found inf early keeps it while the others'
    brackets go on doubling (the flag accumulates), without a warning."""
    pairs = [
        (0.5, 1e-200, 1.0),
        (0.0, 1e-3, 1.0),
        (2.0, 1.3, 1.0),
        (1e200, 1e-200, 1e-200),
        (3.0, 0.5, 1.2),
        (0.0, 1.0, 1e-120),
    ]
    shift, sd_p, sd_q = (np.array(v) for v in zip(*pairs, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for delta in (1e-5, 0.9):
            want = [pair_epsilon(*pair, delta) for pair in pairs]
            got = epsilons(shift, sd_p, sd_q, delta)
            assert [w == math.inf for w in want] == list(np.isinf(got)), (delta, got)
            assert np.allclose(got, want, rtol=1e-7), (delta, got)
    assert math.isinf(want[0]) and 1e3 < want[1] < 1e4 and 0 < want[4] < 10  # δ = 0.9


def test_the_interval_of_a_degenerate_fit_is_infinite() -> None:
    """Canaries whose cosines barely vary (a fitted spread of 1e-160) against the N(0, 1) null:
    certain distinction, so the interval is [inf, inf] (it was [0, 0])."""
    for null_exact in (True, False):
        got = epsilon_interval(
            Fit(0.5, 1e-160, 100), Fit(0.0, 1.0, 100), 1e-5, null_exact=null_exact
        )
        assert got.low == got.high == math.inf


def test_a_bad_delta_is_refused_for_a_pair_cut_off_too() -> None:
    with pytest.raises(ValueError, match="δ must be in"):
        pair_epsilon(0.5, 1e-200, 1.0, 1.0)
