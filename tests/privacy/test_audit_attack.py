"""The canary audit attacks the DP guarantee end to end: it must stay below the accountant's ε
when the mechanism is right and rise above it when the noise is sabotaged.

The federation: digits over N = 10 clients, FedAvg, an MLP 64-128-10 (d = 9,610 uploaded
coordinates), T = 10 rounds, C = 1, σ = 6, δ = 1e-5; every client each round (claimed ε 5.02)
or 5 of 10 (4.34), dp-accounting's RDP. k = 2,000 canaries and k' = 2,000 unseen directions.
The sabotage replaces the server's noise by σ/10 or by nothing while the accountant still
claims σ (a monkeypatched :class:`~fedlore.privacy.randomness.SecureSource`), or keeps the
noise and tells the accountant 4σ (a broken accounting rather than a broken mechanism).

**Why the honest runs stay below.** A canary inserted in n of T rounds shifts its cosine by
about ``n / (√T σ)`` null standard deviations (at most 0.527 here; 0.264 at half participation),
the add/remove μ-GDP of its own releases, which the replace-one accountant (μ = 2√T/σ) covers.
The estimate fits mean and standard deviation: with k = 2,000 their standard errors are 0.022
(shift) and 0.016 (std ratio, 1/√(2k)). Even with the shift 5 standard errors high, the fitted
std ratio must leave [0.90, 1.12] (full participation; [0.88, 1.16] at half) before ε reaches
the claim, i.e. move by more than 6 of its standard errors; the all-iterates statistic (a
shift near 0.3 between two fitted populations) has more room. So a false failure needs a
5-standard-error event: probability below 1e-6 per estimate (P(shift > 5 SE) = 2.9e-7 plus
P(|ratio| beyond 6 SE) = 2e-9), with OS-entropy noise that no seed fixes.

**Why the sabotaged runs rise above.** At σ/10 the model's change is dominated by the
canaries themselves, the real clients' clipped uploads (their sum over the run has norm at most
T m C = 100) and the weak noise; the expected shift is about 2 null standard deviations (1.5 at
half participation), ε about 10 (8), where the claim is 5.02 (4.34). Falling below the claim
needs the fitted shift to drop to ~1.1: 20 standard errors.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from fedlore.config import load_config
from fedlore.experiment import run_one
from fedlore.privacy import aggregation
from fedlore.privacy.dp import epsilon_spent
from fedlore.privacy.randomness import SecureSource

SIGMA, ROUNDS, CLIENTS, DELTA = 6.0, 10, 10, 1e-5


def _audit(
    tmp_path: Path, participation: float, noise_scale: float, mp: Any, told: float = 1.0
) -> dict[str, Any]:
    """One audited run whose server noise is ``noise_scale`` times σ, and whose accountant is
    told ``told`` times σ."""
    honest, accountant = SecureSource.gaussian, aggregation.epsilon_spent

    def weak(self: SecureSource, n: int, std: float, rnd: int, client: int) -> Any:
        return honest(self, n, std * noise_scale, rnd, client)

    def flattering(sigma: float, *args: Any, **kwargs: Any) -> float:
        return accountant(sigma * told, *args, **kwargs)

    if noise_scale != 1.0:
        mp.setattr(SecureSource, "gaussian", weak)
    if told != 1.0:
        mp.setattr(aggregation, "epsilon_spent", flattering)
    cfg = load_config(
        None,
        [
            "name=audit",
            f"num_clients={CLIENTS}",
            f"participation={participation}",
            f"rounds={ROUNDS}",
            "local_steps=2",
            "batch_size=16",
            "lr=1e-2",
            "model.kwargs={hidden: [128]}",
            "partition.min_size=10",
            "progress=false",
            "weighting=uniform",
            "algorithms=[fedavg]",
            "dp.clip_norm=1.0",
            f"dp.noise_multiplier={SIGMA}",
            f"dp.delta={DELTA}",
            "dp.audit.canaries=2000",
            "dp.audit.unseen=2000",
            f"eval.every={ROUNDS}",
            f"output_dir={tmp_path}",
        ],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = run_one(cfg, "fedavg", 7)
    assert summary is not None
    per_round = int(CLIENTS * participation)
    claimed = epsilon_spent(SIGMA * told, DELTA, ROUNDS, CLIENTS, per_round)
    assert summary["dp_epsilon"] == pytest.approx(claimed)  # what the accountant is told
    assert summary["dp_audit_dimension"] == 64 * 128 + 128 + 128 * 10 + 10
    return summary


@pytest.mark.parametrize("participation", [1.0, 0.5])
def test_the_honest_mechanism_stays_below_the_accountants_epsilon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, participation: float
) -> None:
    s = _audit(tmp_path, participation, 1.0, monkeypatch)
    shift = s["dp_audit_cosine_mean"] / s["dp_audit_null_std"]
    expected = participation * math.sqrt(ROUNDS) / SIGMA  # the canary's own add/remove μ
    assert abs(shift - expected) < 6 / math.sqrt(2000)
    assert 0 < s["dp_audit_epsilon"] < s["dp_epsilon"]
    assert 0 <= s["dp_audit_epsilon_all_iterates"] < s["dp_epsilon"]
    # the unseen directions follow the exact null the final-model estimate uses
    assert abs(s["dp_audit_unseen_cosine_mean"]) < 6 * s["dp_audit_null_std"] / math.sqrt(2000)
    assert s["dp_audit_unseen_cosine_std"] == pytest.approx(s["dp_audit_null_std"], rel=0.1)


@pytest.mark.parametrize(("participation", "noise_scale"), [(1.0, 0.1), (1.0, 0.0), (0.5, 0.1)])
def test_a_sabotaged_noise_is_caught_above_the_accountants_epsilon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, participation: float, noise_scale: float
) -> None:
    s = _audit(tmp_path, participation, noise_scale, monkeypatch)
    assert s["dp_audit_epsilon"] > s["dp_epsilon"]
    assert s["dp_audit_epsilon_all_iterates"] > s["dp_epsilon"]


def test_an_accountant_that_understates_epsilon_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mechanism is right but the accountant is told 4σ: it claims ε = 1.07 where the canary
    alone reaches μ ≈ 0.51 (ε ≈ 2.0); even a shift 5 standard errors low (0.40) gives 1.55."""
    s = _audit(tmp_path, 1.0, 1.0, monkeypatch, told=4.0)
    assert s["dp_audit_epsilon"] > s["dp_epsilon"]
