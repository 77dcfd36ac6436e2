"""The canary audit (``dp.audit``; :mod:`fedlore.privacy.canaries`) attacks DP-FedBuff end to end:
the empirical ε stays below the claimed ε when the mechanism is right, and rises above it when
the noise is divided by the number of contributions (a plausible bug: noising the mean with the
sum's std).

The federation is :mod:`tests.privacy.test_audit_attack`'s (digits over N = 10 clients, FedAvg,
the MLP of d = 9,610 coordinates, C = 1, σ = 6, δ = 1e-5, k = k' = 2,000 canaries), run as
FedBuff for T = 10 steps:

* K = C = N = 10 at equal speeds: every client is in every step (the claim is the 10-fold
  Gaussian, ε = 5.02) and all k canaries are inserted in every step (⌊k K / N⌋ of them), the
  strongest canary the claim must cover: its cosine shifts by √T/σ = 0.527 null standard
  deviations, μ-GDP at half the μ = 2√T/σ the claim allows (a canary moves the sum by C, the
  accountant allows 2C). The argument of :mod:`tests.privacy.test_audit_attack` carries over:
  a false failure needs a 5-standard-error event (below 1e-6 per estimate).
* K = 5 of C = 10 in flight at lognormal speeds: half the canaries a step; the claim is the
  most-counted client's (up to 10 steps), the canary's shift √T/(2σ) = 0.26: further below.
* The sabotage: noise of std σC/K on the sum (K = 10) while the claim stays σ's; the expected
  shift is about 2 null standard deviations (ε near 10 where the claim is 5.02), as the
  synchronous σ/10 sabotage.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from fedlore.config import load_config
from fedlore.experiment import run_one
from fedlore.privacy.buffer_dp import contribution_epsilon
from fedlore.privacy.randomness import SecureSource

SIGMA, STEPS, CLIENTS, DELTA = 6.0, 10, 10, 1e-5


def _audit(tmp_path: Path, extra: list[str], mp: Any, divide: int = 1) -> dict[str, Any]:
    """One audited DP-FedBuff run whose server noise std is divided by ``divide``."""
    honest = SecureSource.gaussian

    def per_contribution(self: SecureSource, n: int, std: float, rnd: int, c: int) -> Any:
        return honest(self, n, std / divide, rnd, c)

    if divide != 1:
        mp.setattr(SecureSource, "gaussian", per_contribution)
    cfg = load_config(
        None,
        [
            "name=audit", f"num_clients={CLIENTS}", f"rounds={STEPS}", "local_steps=2",
            "batch_size=16", "lr=1e-2", "model.kwargs={hidden: [128]}", "partition.min_size=10",
            "progress=false", "weighting=uniform", "algorithms=[fedavg]", "dp.clip_norm=1.0",
            f"dp.noise_multiplier={SIGMA}", f"dp.delta={DELTA}", "dp.audit.canaries=2000",
            "dp.audit.unseen=2000", f"eval.every={STEPS}", f"output_dir={tmp_path}", *extra,
        ],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = run_one(cfg, "fedavg", 7)
    assert summary is not None
    return summary


EVERY = ["asynchronous.buffer=10", "asynchronous.concurrency=10"]
HALF = ["asynchronous.buffer=5", "asynchronous.concurrency=10", "clients.speed=lognormal"]


@pytest.mark.parametrize("extra", [EVERY, HALF], ids=["every-client-every-step", "k5-lognormal"])
def test_the_honest_mechanism_stays_below_the_claimed_epsilon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    s = _audit(tmp_path, extra, monkeypatch)
    rate = s["dp_audit_canaries_per_round"] / s["dp_audit_canaries"]
    assert rate == (1.0 if extra is EVERY else 0.5)
    if extra is EVERY:  # every client in all 10 steps: the 10-fold Gaussian
        assert s["dp_epsilon"] == pytest.approx(contribution_epsilon(SIGMA, DELTA, STEPS))
    shift = s["dp_audit_cosine_mean"] / s["dp_audit_null_std"]
    assert abs(shift - rate * math.sqrt(STEPS) / SIGMA) < 6 / math.sqrt(2000)
    assert 0 < s["dp_audit_epsilon"] < s["dp_epsilon"]
    assert 0 <= s["dp_audit_epsilon_all_iterates"] < s["dp_epsilon"]


def test_noise_divided_by_the_contributions_is_caught_above_the_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _audit(tmp_path, EVERY, monkeypatch, divide=10)
    assert s["dp_epsilon"] == pytest.approx(contribution_epsilon(SIGMA, DELTA, STEPS))
    assert s["dp_audit_epsilon_low"] > s["dp_epsilon"]  # the interval lies above the claim
    assert s["dp_audit_epsilon_all_iterates"] > s["dp_epsilon"]
