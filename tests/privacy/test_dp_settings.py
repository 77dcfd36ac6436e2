"""The DP settings a run is built from (fedlore.privacy.dp.DPSettings) and adaptive clipping's
noise split, at the edges of what they accept.

C must be a positive number, σ a number >= 0 (σ = 0 clips without noise; its ε is infinite),
δ and the sketch's share of the budget lie strictly between 0 and 1; the split of σ between
the update and the noised count needs σ_b > σ / 2. Everything else is refused before a round
runs, with a message that names the setting, the value given and, where there is one, the way
out.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from fedlore.privacy import dp

VALID: dict[str, Any] = {"clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 1e-5}


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("clip_norm", 0.0, "dp.clip_norm must be a positive number, got 0.0"),
        ("clip_norm", -1.0, "dp.clip_norm must be a positive number, got -1.0"),
        ("clip_norm", math.inf, "dp.clip_norm must be a positive number, got inf"),
        ("clip_norm", math.nan, "dp.clip_norm must be a positive number, got nan"),
        ("noise_multiplier", -0.5, "dp.noise_multiplier must be >= 0, got -0.5"),
        ("noise_multiplier", math.inf, "dp.noise_multiplier must be >= 0, got inf"),
        ("noise_multiplier", math.nan, "dp.noise_multiplier must be >= 0, got nan"),
        ("delta", 0.0, "dp.delta must be in (0, 1), got 0.0"),
        ("delta", 1.0, "dp.delta must be in (0, 1), got 1.0"),
        ("delta", 1.5, "dp.delta must be in (0, 1), got 1.5"),
        ("sketch_share", 0.0, "dp.sketch_share must be in (0, 1), got 0.0"),
        ("sketch_share", 1.0, "dp.sketch_share must be in (0, 1), got 1.0"),
        ("sketch_share", 1.5, "dp.sketch_share must be in (0, 1), got 1.5"),
    ],
)
def test_dp_settings_refusals(field: str, bad: float, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dp.DPSettings(**{**VALID, field: bad})


def test_dp_settings_accept_the_edges_of_their_ranges() -> None:
    """σ = 0 (clipping, no noise) and values just inside each open interval are accepted; the
    noise std on the sum is σ C."""
    no_noise = dp.DPSettings(2.0, 0.0, 1e-5)
    assert no_noise.noise_std == 0.0
    assert dp.epsilon_spent(0.0, 1e-5, 3, 10, 10) == math.inf
    edges = dp.DPSettings(0.5, 3.0, 1 - 1e-9, sketch_share=1 - 1e-9)
    assert edges.noise_std == 1.5 and edges.delta == 1 - 1e-9
    tiny = dp.DPSettings(1e-12, 1e-12, 1e-300, sketch_share=1e-12)
    assert tiny.noise_std == pytest.approx(1e-24, rel=1e-12)


@pytest.mark.parametrize("count_std", [2.0, 1.0, 0.0, -1.0, math.nan, math.inf])
def test_noise_split_refusals_say_why(count_std: float) -> None:
    """σ = 4: a count noise σ_b at or below σ/2 = 2 would leave the update no budget (refused
    with the bound and both ways out); one that is not a positive number is refused as such."""
    if 0 < count_std < math.inf:
        message = (
            f"dp.clipped_count_stddev = {count_std:g} is too small for noise multiplier 4: "
            "adaptive clipping needs it above z/2 = 2 (the noised count of unclipped clients "
            "would spend the whole privacy budget, z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) is "
            "undefined); raise dp.clipped_count_stddev (default: clients per round / 20) or "
            "lower the noise multiplier"
        )
    else:
        message = f"dp.clipped_count_stddev must be a positive number, got {count_std!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dp.update_noise_multiplier(4.0, count_std)


def test_noise_split_refuses_a_bad_noise_multiplier() -> None:
    """A negative or non-finite σ is refused, whatever σ_b; σ_b must be positive even when σ
    is 0 (which needs no split: 0)."""
    for z in (-1.0, math.inf, math.nan):
        with pytest.raises(
            ValueError, match=rf"^dp\.noise_multiplier must be >= 0, got {re.escape(repr(z))}$"
        ):
            dp.update_noise_multiplier(z, 5.0)
    assert dp.update_noise_multiplier(0.0, 5.0) == 0.0
    with pytest.raises(
        ValueError, match=r"^dp\.clipped_count_stddev must be a positive number, got 0\.0$"
    ):
        dp.update_noise_multiplier(0.0, 0.0)
