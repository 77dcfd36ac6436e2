"""Clipping a client's upload and the adaptive clip's small helpers (fedlore.privacy.dp).

``clip_upload`` scales in float64 and hands every array back in its own dtype (a float16 or
bfloat16 model's upload stays what the model holds), leaves an upload at the bound untouched,
and refuses a non-finite upload naming the arrays at fault (the first three). Adaptive
clipping's default count noise is m / 20 for any m >= 1, and its clip update accepts a round
with a single contributor. Refusals say what was asked for.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedlore.privacy import dp
from fedlore.privacy.dp import clip_upload


def test_clipping_keeps_each_arrays_dtype_and_scales_in_float64() -> None:
    """Arrays of four dtypes clipped jointly to C = 1: each comes back in its own dtype and
    shape, scaled by the same C / ‖x‖ (‖x‖ over all of them, computed in float64)."""
    arrays = {
        "update.a": torch.full((4,), 3.0, dtype=torch.float32),
        "update.b": torch.full((2,), -3.0, dtype=torch.float16),
        "update.c": torch.full((3,), 3.0, dtype=torch.bfloat16),
        "update.d": torch.full((7,), 3.0, dtype=torch.float64),
    }
    clipped, did = clip_upload(arrays, 1.0, 0.5)
    assert did and list(clipped) == list(arrays)
    scale = 1.0 / (3.0 * math.sqrt(16))  # 16 entries of magnitude 3
    for key, v in arrays.items():
        assert clipped[key].dtype == v.dtype and clipped[key].shape == v.shape
        want = (v.double() * scale).to(v.dtype)
        assert torch.equal(clipped[key], want)
    assert dp.upload_norm(clipped) == pytest.approx(1.0, rel=1e-2)  # bfloat16's rounding
    # exactly at the bound (‖(3, 4)‖ = 5): untouched, the same tensors, not counted as clipped
    at_bound = {"update.w": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    same, did = clip_upload(at_bound, 5.0, 0.5)
    assert not did and same["update.w"] is at_bound["update.w"]


def test_a_non_finite_upload_is_refused_naming_the_arrays() -> None:
    """The message names the arrays that hold NaN or Inf (not the finite ones), at most the
    first three of them, whichever part of a split clip they are in."""
    ok = torch.ones(3)
    one_bad = {"update.a": ok, "update.b": torch.tensor([1.0, math.nan]), "update.c": ok}
    with pytest.raises(
        ValueError, match=r"^upload arrays \['update\.b'\] contain NaN or Inf; nothing is sent$"
    ):
        clip_upload(one_bad, 1.0, 0.5)
    sketch_bad = {"sketch.y": torch.tensor([math.inf]), "update.a": ok}
    with pytest.raises(ValueError, match=r"^upload arrays \['sketch\.y'\] contain NaN"):
        clip_upload(sketch_bad, 1.0, 0.5)
    many_bad = {"update.ok": ok} | {f"update.{i}": torch.tensor([-math.inf]) for i in range(5)}
    with pytest.raises(
        ValueError,
        match=r"^upload arrays \['update\.0', 'update\.1', 'update\.2'\] contain NaN or Inf; "
        r"nothing is sent$",
    ):
        clip_upload(many_bad, 1.0, 0.5)


def test_default_count_noise_is_a_twentieth_of_the_round() -> None:
    """σ_b = m / 20 (Andrew et al.; Flower) from one client per round up; none is refused."""
    assert dp.default_clipped_count_stddev(1) == 0.05
    assert dp.default_clipped_count_stddev(2) == 0.1
    assert dp.default_clipped_count_stddev(100) == 5.0
    with pytest.raises(ValueError, match=r"^clients per round must be at least 1, got 0$"):
        dp.default_clipped_count_stddev(0)


def test_clip_update_with_a_single_contributor() -> None:
    """One contributor (one client per round, or one survivor): b̃ is its noised bit itself;
    unclipped (b̃ = 1) lowers C by exp(−η_C (1 − γ)), clipped raises it by exp(η_C γ)."""
    assert dp.next_clip_norm(1.0, 1.0, 1, 0.5, 0.2) == pytest.approx(math.exp(-0.1), rel=1e-15)
    assert dp.next_clip_norm(2.0, 0.0, 1, 0.3, 0.2) == pytest.approx(
        2.0 * math.exp(0.06), rel=1e-15
    )
    with pytest.raises(
        ValueError, match=r"^adaptive clipping needs at least 1 contributor, got 0$"
    ):
        dp.next_clip_norm(1.0, 1.0, 0, 0.5, 0.2)
