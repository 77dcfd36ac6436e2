"""Fixed point from the clipping range (fedlore.privacy.fixedpoint, SecurePlan).

Issue 28's findings, each turned around: ten clients sending 2.9e-8 each sum to 2.9e-7 (they
summed to 0 at the old 2^-24 resolution); an entry too small to represent is counted, not lost
silently; an entry beyond the range is clipped and counted; a client with 2^19 or more examples
under ``weighting: num_examples`` encodes (weights travel as p_i / W); a weight above W, or a
config whose fixed point would be too coarse, is refused with the reason.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from fedlore.privacy import Contribution, SecurePlan
from fedlore.privacy.fixedpoint import MIN_FRACTION_BITS, FixedPoint
from fedlore.privacy.secagg import RoundParams


def test_the_resolution_comes_from_the_bound_and_the_clients() -> None:
    """F is the largest with clients · bound · 2^F ≤ 2^62: the sum of ``clients`` entries at
    the bound still fits, one more bit would not."""
    for bound, clients in ((1.0, 100), (1000.0, 10), (3.7, 1000), (1.0, 1)):
        f = FixedPoint.for_sum(bound, clients)
        assert clients * bound * 2.0**f.fraction_bits <= 2.0**62
        assert f.fraction_bits == 62 or clients * bound * 2.0 ** (f.fraction_bits + 1) > 2.0**62
    assert FixedPoint.for_sum(1.0, 100).fraction_bits == 55
    with pytest.raises(ValueError, match="fraction bits"):
        FixedPoint.for_sum(2.0**30, 2**12)  # 62 - 42 = 20 bits: too coarse


def test_ten_tiny_uploads_do_not_vanish() -> None:
    """Ten clients each sending 2.9e-8 (below the old 2^-24 step) sum to 2.9e-7."""
    f = FixedPoint.for_sum(1.0, 10)
    one = torch.full((4,), 2.9e-8, dtype=torch.float64)
    total = sum(f.encode(one)[0].view(np.int64) for _ in range(10))
    got = f.decode(np.asarray(total).view(np.uint64))
    assert f.encode(one)[1] == 0  # nothing underflowed
    assert torch.allclose(got, torch.full((4,), 2.9e-7, dtype=torch.float64), rtol=1e-9)


def test_the_sum_of_the_most_clients_at_the_bound_is_exact() -> None:
    """``clients`` vectors at ±bound sum without wrapping around the ring."""
    f = FixedPoint.for_sum(5.0, 64)
    enc = [f.encode(torch.tensor([5.0, -5.0], dtype=torch.float64))[0] for _ in range(64)]
    with np.errstate(over="ignore"):
        total = np.zeros(2, dtype=np.uint64)
        for e in enc:
            total += e
    assert f.decode(total).tolist() == [320.0, -320.0]


def test_underflow_and_clipping_are_counted() -> None:
    """Clipped entries are counted; entries that round to 0 beside large ones are within the
    rounding every entry has (the upload keeps float32's precision), an upload that vanishes
    is not."""
    f = FixedPoint(MIN_FRACTION_BITS, 2.0)
    x = torch.tensor([0.0, 1e-9, -1e-9, 3.0, -5.0, 1.0], dtype=torch.float64)
    ring, underflow, clipped = f.encode(x)
    assert underflow == 0 and clipped == 2
    assert f.decode(ring).tolist() == [0.0, 0.0, 0.0, 2.0, -2.0, 1.0]
    assert f.encode(x[:3])[1:] == (2, 0)  # only the tiny entries: all of them lost
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(
            ValueError, match=r"^the upload vector contains NaN or Inf; it cannot be encoded$"
        ):
            f.encode(torch.tensor([1.0, bad]))
    with pytest.raises(ValueError, match="fraction bits"):
        FixedPoint(MIN_FRACTION_BITS - 1, 1.0)
    with pytest.raises(ValueError, match="positive and finite"):
        FixedPoint(30, math.inf)


NONE = torch.zeros(0, dtype=torch.float64)  # no extra entries (no adaptive clipping)


def _plan(counts: bool, max_weight: float) -> SecurePlan:
    params = RoundParams(0, {0: (1,), 1: (0,)}, 2, 2)
    return SecurePlan(params, FixedPoint.for_sum(8.0, 2), 3, 0, counts, max_weight)


def test_weights_travel_normalized_and_a_large_client_encodes() -> None:
    """weighting=num_examples with a client of 2^20 examples: its weight entry is p / W = 1,
    a small client's is 10 / 2^20; the decoded sums give the weighted mean exactly."""
    big, small = 2.0**20, 10.0
    plan = _plan(counts=True, max_weight=big)
    xa = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    xb = torch.tensor([3.0, 4.0, -1.0], dtype=torch.float64)
    ra = plan.encode(Contribution(xa, NONE, big, False, {}))
    rb = plan.encode(Contribution(xb, NONE, small, False, {}))
    assert ra.size == plan.length == 3 + 1 + 2
    with np.errstate(over="ignore"):
        sum_wx, sum_w, counts = plan.decode(ra + rb)
    want = (big * xa + small * xb) / (big + small)
    assert torch.allclose(sum_wx / sum_w, want, rtol=1e-12)
    assert sum_w == pytest.approx((big + small) / big, rel=1e-15)
    assert counts == {"secagg_underflow": 0, "secagg_clipped_entries": 0}
    with pytest.raises(ValueError, match="largest client weight"):
        plan.encode(Contribution(xa, NONE, 2 * big, False, {}))
    with pytest.raises(ValueError, match="expected 3"):
        plan.encode(Contribution(xa[:2], NONE, small, False, {}))


def test_counts_travel_inside_the_sum() -> None:
    """Without DP, each client's underflow and clipped-entry counts are summed in the ring;
    the weight entry (1 here) does not hide an upload that vanishes in the fixed point."""
    plan = _plan(counts=True, max_weight=1.0)
    x = torch.tensor([1e-30, 100.0, 1.0], dtype=torch.float64)
    r = plan.encode(Contribution(x, NONE, 1.0, False, {}))
    tiny = torch.tensor([1e-18, -2e-18, 0.0], dtype=torch.float64)  # r = 2^-58 = 3.5e-18
    lost = plan.encode(Contribution(tiny, NONE, 1.0, False, {}))
    with np.errstate(over="ignore"):
        _, _, counts = plan.decode(r + r + lost)
    assert counts == {"secagg_underflow": 2, "secagg_clipped_entries": 2}
    no_counts = _plan(counts=False, max_weight=1.0)
    assert no_counts.length == 4 and no_counts.decode(no_counts.encode(
        Contribution(x, NONE, 1.0, False, {})))[2] == {}  # fmt: skip


def test_the_ring_limits_the_resolution_both_ways() -> None:
    """A tiny range would ask for more bits than the ring has: F stops at 64 − 2 = 62. The
    coarsest fixed point accepted, F = 24, is still built; one bit fewer is refused."""
    tiny = FixedPoint.for_sum(1e-3, 1)  # log2 gives 71 bits
    assert tiny.fraction_bits == 62 and tiny.resolution == 2.0**-62
    coarsest = FixedPoint.for_sum(2.0**26, 2**12)  # 62 − 38
    assert coarsest.fraction_bits == MIN_FRACTION_BITS and coarsest.resolution == 2.0**-24
    assert coarsest.bound == 2.0**26
    with pytest.raises(ValueError, match="leave 23 fraction bits"):
        FixedPoint.for_sum(2.0**27, 2**12)


def test_refusals_say_what_is_wrong() -> None:
    """Each refusal names the value it refuses (and, for a range too wide for the ring, both
    settings and what to change); a zero, infinite or negative bound and an empty round are
    refused before any arithmetic with them."""
    with pytest.raises(
        ValueError,
        match=r"^secure aggregation: 4096 clients with entries up to 1\.07374e\+09 leave 20 "
        r"fraction bits in the 64-bit ring \(at least 24 are needed\): lower "
        r"secure_aggregation_range \(or dp\.clip_norm\), or sample fewer clients per round$",
    ):
        FixedPoint.for_sum(2.0**30, 2**12)
    with pytest.raises(ValueError, match=r"^fixed point for 0 clients$"):
        FixedPoint.for_sum(1.0, 0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        refused = rf"^a fixed-point bound must be positive and finite, got {re.escape(str(bad))}$"
        with pytest.raises(ValueError, match=refused):
            FixedPoint.for_sum(bad, 10)
        with pytest.raises(ValueError, match=refused):
            FixedPoint(30, bad)
    for bits in (MIN_FRACTION_BITS - 1, 63, 64):
        with pytest.raises(
            ValueError, match=rf"^fixed point needs 24 to 62 fraction bits, got {bits}$"
        ):
            FixedPoint(bits, 1.0)


def test_any_float_dtype_encodes_as_its_float64_values() -> None:
    """float16, bfloat16 and float32 vectors encode from their float64 values: the ring
    elements of ``round(v · 2^55)`` (far finer than their own resolution, and far beyond their
    range), which decode back to the values exactly; entries exactly at ±B are representable,
    not counted as clipped."""
    f = FixedPoint.for_sum(1.0, 100)  # F = 55
    values = [0.5, -0.75, 1.0, -1.0, 2.0**-10, 0.3, 0.0]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.tensor(values, dtype=dtype)
        ring, underflow, clipped = f.encode(x)
        want = np.rint(x.double().numpy() * 2.0**55).astype(np.int64).view(np.uint64)
        assert np.array_equal(ring, want) and ring.dtype == np.uint64
        assert underflow == 0 and clipped == 0
        assert torch.equal(f.decode(ring), x.double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_vector_on_the_gpu_encodes_like_its_cpu_copy() -> None:
    """The ring lives in numpy on the CPU: a CUDA vector is moved there and encodes to the same
    ring elements and counts as its CPU copy."""
    f = FixedPoint.for_sum(2.0, 10)
    x = torch.tensor([0.5, -1.25, 3.0, 1e-30], dtype=torch.float32)
    want = f.encode(x)
    got = f.encode(x.to("cuda"))
    assert np.array_equal(got[0], want[0]) and got[1:] == want[1:] == (1, 1)
