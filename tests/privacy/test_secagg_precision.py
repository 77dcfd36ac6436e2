"""When secure aggregation's fixed point loses precision (``secagg_underflow``,
:mod:`fedlore.privacy.fixedpoint`): an upload whose encoding errs by more than 2^-24 of its norm.

Every entry is rounded to a multiple of r = 2^-F, an error of at most r / 2 whether it rounds to
0 or not; entries far below r beside entries of 0.1 (SCAFFOLD's control-variate increments) are
no loss, and SCAFFOLD's run stays silent. An upload that vanishes in the fixed point (an entry
bound far above the uploads) is a loss, and the run warns.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlore.config import load_config
from fedlore.experiment import run_experiment
from fedlore.privacy.fixedpoint import RELATIVE_PRECISION, FixedPoint

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def _rint_zero(f: FixedPoint, v: torch.Tensor) -> int:
    """Nonzero entries that encode to 0 (what the warning used to count)."""
    x = v.numpy()
    return int(((np.rint(x * 2.0**f.fraction_bits) == 0) & (x != 0)).sum())


def test_tiny_entries_beside_large_ones_are_no_loss() -> None:
    f = FixedPoint(50, 1000.0)  # r = 8.9e-16: 1000 range, 10 clients -> F = 48 in a run
    v = torch.tensor([0.1, -0.05, 1e-17, -3e-18, 2e-16, 0.0], dtype=torch.float64)
    assert _rint_zero(f, v) == 3  # they do round to 0 ...
    assert f.encode(v)[1] == 0  # ... within the rounding every entry has


def test_an_upload_that_vanishes_or_keeps_few_bits_is_counted() -> None:
    f = FixedPoint(50, 1000.0)
    r = f.resolution
    gone = torch.full((5,), 0.3 * r, dtype=torch.float64)
    assert f.encode(gone)[1] == 5  # every entry rounds to 0
    coarse = torch.tensor([3.3 * r, -7.4 * r, 0.0, 2 * r], dtype=torch.float64)
    assert _rint_zero(f, coarse) == 0
    assert f.encode(coarse)[1] == 2  # 3 and 7 steps: 10 % and 5 % off; 2 steps is exact


@pytest.mark.parametrize(("scale", "lost"), [(1 - 2**-10, 1), (1 + 2**-10, 0)])
def test_the_bound_is_the_uploads_norm_times_2_to_the_minus_24(scale: float, lost: int) -> None:
    """[A, r/4]: the error r/4 (the small entry rounds to 0, A is exact) against ρ ‖v‖ ≈ ρ A,
    at A just below and just above r / (4 ρ)."""
    f = FixedPoint(30, 1.0)
    r = f.resolution
    assert RELATIVE_PRECISION == 2.0**-24  # float32's unit roundoff
    a = 2.0**-8 * scale  # r / (4 ρ) (1 ∓ 2^-10): a multiple of r
    assert a / r == round(a / r)
    assert f.encode(torch.tensor([a, r / 4], dtype=torch.float64))[1] == lost


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "secagg_underflow" in r.getMessage()]


def _rows(out: Path, method: str) -> list[int]:
    path = out / "precision" / method / "seed-42" / "metrics.jsonl"
    return [json.loads(line)["secagg_underflow"] for line in path.read_text().splitlines()]


ARGS = ["name=precision", "seeds=[42]", "progress=false", "secure_aggregation=true", "threads=1"]


def test_scaffolds_secure_run_is_silent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The quickstart's SCAFFOLD under secure aggregation: from round 3 on its uploads hold
    entries that round to 0 (the old count warned 11, 40 and 20 times); none is a loss."""
    cfg = load_config(QUICKSTART, [*ARGS, "rounds=6", "algorithms=[scaffold]",
                                   f"output_dir={tmp_path}"])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fedlore.engine.loop"):
        run_experiment(cfg)
    assert _warnings(caplog) == []
    assert _rows(tmp_path, "scaffold") == [0] * 6


def test_an_upload_lost_in_the_fixed_point_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A range of 1e9 leaves F = 28 (r = 3.7e-9) for 10 clients; at lr 1e-7 FedAvg's deltas
    are about that size: the round warns, saying what was lost and why."""
    big = ["secure_aggregation_range=1e9", "lr=1e-7"]
    cfg = load_config(QUICKSTART, [*ARGS, *big, "rounds=1", "algorithms=[fedavg]",
                                   f"output_dir={tmp_path}"])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fedlore.engine.loop"):
        run_experiment(cfg)
    (said,) = _warnings(caplog)
    (count,) = _rows(tmp_path, "fedavg")
    assert count > 0
    assert said.startswith(f"round 0: secagg_underflow = {count} (upload entries that lost ")
    assert "secure_aggregation_range is far above the uploads" in said
