"""The DP accountant (fedlore.privacy.dp) against dp-accounting called directly and against the
exact Gaussian-DP value, so that a wrong noise multiplier or a wrong bound fails a test.

* Full participation is the Gaussian mechanism composed T times; under replace-one adjacency
  (sensitivity 2C, noise σC) it is μ-GDP with μ = 2√T/σ (Dong, Roth & Su 2022, Corollary 2.13),
  whose exact ε at δ solves δ = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2). The PLD accountant must be
  within 1 % of it and never below; the RDP accountant at or above it and within 20 %.
* Mutants of the events fed to dp-accounting (σ for σ/2, σ/4 for σ/2, and the PLD's own
  mistakes) fail those checks: the checks are run against them.
* Sampling m of N: far from full participation ε is dp-accounting's
  ``SampledWithoutReplacementDpEvent`` value; near it (99 of 100) no worse than full
  participation; never below the ε of one concrete neighbouring pair (all other clients send 0).
* ``noise_for_epsilon`` and ``epsilon_spent`` round-trip for both accountants.
* Adaptive clipping (Andrew et al. 2021): the noise split spends exactly the privacy of the
  unsplit multiplier (dp-accounting's ``ComposedDpEvent``), the clip update moves the right way
  and settles at the target quantile; the config keys are validated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from dp_accounting.rdp import rdp_privacy_accountant
from gdp import exact_gdp_epsilon
from pydantic import ValidationError

from fedlore.config import DPConfig
from fedlore.privacy import dp

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
ADD_OR_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
DELTA = 1e-5


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    """The accountant caches by argument; a monkeypatched event must not meet a cached value."""
    for fn in (dp.epsilon_spent, dp.noise_for_epsilon, dp.rdp_curve):
        fn.cache_clear()
    yield
    for fn in (dp.epsilon_spent, dp.noise_for_epsilon, dp.rdp_curve):
        fn.cache_clear()


def full_participation_exact(sigma: float, rounds: int, delta: float = DELTA) -> float:
    """Replace-one: sensitivity 2C, noise σC, T rounds: μ = 2√T / σ."""
    return exact_gdp_epsilon(2.0 * math.sqrt(rounds) / sigma, delta)


def rdp_direct(event: Any, rounds: int, delta: float = DELTA) -> float:
    acc = rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)  # dp-accounting's default orders
    acc.compose(event, rounds)
    return float(acc.get_epsilon(delta))


def pld_direct(
    event: Any,
    rounds: int,
    delta: float = DELTA,
    relation: Any = REPLACE_ONE,
    interval: float = 1e-4,  # dp-accounting's default
) -> float:
    acc = pld.PLDAccountant(relation, value_discretization_interval=interval)
    acc.compose(event, rounds)
    return float(acc.get_epsilon(delta))


def sampled_pair_lower_bound(sigma: float, rounds: int, n: int, m: int) -> float:
    """The ε of one concrete pair of neighbouring federations under sampling m of N: every other
    client sends 0 and the replaced client sends +Cu in one federation, −Cu in the other. A
    round's output is then q N(±C u, σ²C²) + (1 − q) N(0, σ²C²), q = m / N, which is
    dp-accounting's Poisson-sampled Gaussian under REPLACE, composed T times; discretized
    optimistically, so it is below that pair's ε, which is below the mechanism's."""
    one = pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma,
        sampling_prob=m / n,
        neighboring_relation=REPLACE_ONE,
        pessimistic_estimate=False,
        use_connect_dots=False,  # connect-the-dots is pessimistic only
    )
    return float(one.self_compose(rounds).get_epsilon_for_delta(DELTA))


# --- full participation: exact, direct, and the mutants -------------------------------------


def check_full_participation(sigma: float, rounds: int) -> None:
    """The checks of every full-participation ε fedlore reports (both accountants)."""
    n = 100
    exact = full_participation_exact(sigma, rounds)
    got_rdp = dp.epsilon_spent(sigma, DELTA, rounds, n, n)
    got_pld = dp.epsilon_spent(sigma, DELTA, rounds, n, n, accountant="pld")
    # dp-accounting with the events built by hand
    assert got_rdp == pytest.approx(rdp_direct(dp_accounting.GaussianDpEvent(sigma / 2), rounds))
    assert got_pld == pytest.approx(
        pld_direct(dp_accounting.GaussianDpEvent(sigma), rounds), rel=1e-3
    )
    # the exact value: RDP and the pessimistic PLD are upper bounds; PLD tight, RDP close
    assert exact * (1 - 1e-9) <= got_rdp <= 1.2 * exact
    assert exact * (1 - 1e-9) <= got_pld <= 1.01 * exact


def test_full_participation_reference_value() -> None:
    """σ = 4, T = 10, δ = 1e-5 (issue 28): exact ε = 7.51."""
    assert full_participation_exact(4.0, 10) == pytest.approx(7.5113, abs=1e-4)
    check_full_participation(4.0, 10)
    assert dp.epsilon_spent(4.0, DELTA, 10, 100, 100, accountant="pld") == pytest.approx(
        7.5113, abs=1e-3
    )


@pytest.mark.parametrize(("sigma", "rounds"), [(100.0, 1), (20.0, 1), (4.0, 50), (2.0, 51)])
def test_full_participation_matches_exact_and_dp_accounting(sigma: float, rounds: int) -> None:
    check_full_participation(sigma, rounds)


def test_default_renyi_orders() -> None:
    """σ = 100, one round: 0.114 with orders up to 64 (issue 28), 0.0702 with dp-accounting's
    default orders (up to 1024), exact 0.0586."""
    orders, _ = dp.rdp_curve(100.0, 100, 100)
    assert list(orders) == list(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
    got = dp.epsilon_spent(100.0, DELTA, 1, 100, 100)
    assert got == pytest.approx(0.0702, abs=5e-4)
    assert dp.epsilon_spent(100.0, DELTA, 1, 100, 100, accountant="pld") == pytest.approx(
        full_participation_exact(100.0, 1), rel=1e-4
    )


def test_pld_is_dp_accountings_at_the_documented_discretization() -> None:
    """σ = 4, T = 10: the PLD ε is dp-accounting's PLD at ``value_discretization_interval`` =
    PLD_RELATIVE_INTERVAL × the unsampled RDP ε (8.08 here: 0.0081; dp-accounting's default
    1e-4 takes tens of times as long to lower ε by 3e-6 relative), pessimistic: at or above the
    exact 7.5113."""
    rdp_eps = dp.epsilon_spent(4.0, DELTA, 10, 100, 100)
    interval = dp.PLD_RELATIVE_INTERVAL * max(rdp_eps, 0.1)
    want = pld_direct(dp_accounting.GaussianDpEvent(4.0), 10, interval=interval)
    got = dp.epsilon_spent(4.0, DELTA, 10, 100, 100, accountant="pld")
    assert got == pytest.approx(want, rel=1e-12)
    assert got >= full_participation_exact(4.0, 10)


def _scaled(factor: float) -> Callable[..., Any]:
    real = dp.rdp_event
    return lambda sigma, n, m: real(sigma * factor, n, m)


def _scaled_pld(factor: float) -> Callable[..., Any]:
    real = dp.pld_event
    return lambda sigma: real(sigma * factor)


@pytest.mark.parametrize(
    ("target", "mutant", "what"),
    [
        ("rdp_event", _scaled(2.0), "RDP fed σ instead of σ/2: ε under-reported"),
        ("rdp_event", _scaled(0.5), "RDP fed σ/4 instead of σ/2: ε doubled"),
        ("pld_event", _scaled_pld(0.5), "PLD fed σ/2 under REPLACE_ONE: sensitivity 4C"),
        ("pld_event", _scaled_pld(2.0), "PLD fed 2σ: ε under-reported"),
    ],
)
def test_a_wrong_noise_multiplier_fails_the_checks(
    monkeypatch: pytest.MonkeyPatch, target: str, mutant: Callable[..., Any], what: str
) -> None:
    monkeypatch.setattr(dp, target, mutant)
    with pytest.raises(AssertionError):
        check_full_participation(4.0, 10)


def test_pld_needs_sigma_under_replace_one() -> None:
    """dp-accounting's PLD builds the replace-one pair from the ball radius (REPLACE: noise at
    +1 against noise at −1), so GaussianDpEvent(σ) with REPLACE_ONE is sensitivity 2C; σ/2 with
    REPLACE_ONE would double-count, and σ with ADD_OR_REMOVE would halve it."""
    exact = full_participation_exact(4.0, 10)
    gauss = dp_accounting.GaussianDpEvent
    assert pld_direct(gauss(4.0), 10) == pytest.approx(exact, rel=1e-6)
    assert pld_direct(gauss(2.0), 10, relation=ADD_OR_REMOVE) == pytest.approx(exact, rel=1e-6)
    assert pld_direct(gauss(2.0), 10) > 2.0 * exact  # σ/2 with REPLACE_ONE: 17.9
    assert pld_direct(gauss(4.0), 10, relation=ADD_OR_REMOVE) < 0.5 * exact  # 3.34
    # and the RDP accountant ignores the relation for a Gaussian: it needs σ/2 itself
    assert rdp_direct(gauss(2.0), 10) >= exact
    assert rdp_direct(gauss(4.0), 10) < exact


def test_the_rdp_event_samples_only_when_some_clients_sit_out() -> None:
    """All N of N clients (or a request for more than N) is the bare ``GaussianDpEvent(σ/2)``;
    m < N wraps it in dp-accounting's sampling-without-replacement event of m of N."""
    bare = dp_accounting.GaussianDpEvent(2.0)
    assert dp.rdp_event(4.0, 10, 10) == bare == dp.rdp_event(4.0, 10, 12)
    assert dp.rdp_event(4.0, 10, 9) == dp_accounting.SampledWithoutReplacementDpEvent(10, 9, bare)


def test_rounds_compose_by_scaling_one_cached_curve() -> None:
    """ε after each of T rounds comes from one curve per (σ, N, m), scaled: equal to
    dp-accounting composing the event T times."""
    sigma, n, m = 2.0, 1000, 100
    event = dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(1))
    for t in range(1, 52):
        dp.epsilon_spent(sigma, DELTA, t, n, m)
    info = dp.rdp_curve.cache_info()
    assert info.misses == 1 and info.hits == 50
    for t in (1, 7, 51):
        assert dp.epsilon_spent(sigma, DELTA, t, n, m) == pytest.approx(rdp_direct(event, t))
    assert dp.epsilon_spent(sigma, DELTA, 0, n, m) == 0.0
    assert dp.epsilon_spent(0.0, DELTA, 3, n, m) == math.inf
    with pytest.raises(ValueError, match=r"dp\.accountant"):
        dp.epsilon_spent(sigma, DELTA, 3, n, m, accountant="moments")


# --- sampling m of N ------------------------------------------------------------------------


def test_sampled_rounds_far_from_full_use_the_sampled_curve() -> None:
    """σ = 2, 100 of 1,000 clients, 51 rounds: dp-accounting's sampled-without-replacement
    value (amplification by sampling), far below full participation, above a concrete pair."""
    sigma, n, m, t = 2.0, 1000, 100, 51
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        n, m, dp_accounting.GaussianDpEvent(sigma / 2)
    )
    direct = rdp_direct(event, t)
    got = dp.epsilon_spent(sigma, DELTA, t, n, m)
    assert got == pytest.approx(direct, rel=1e-9)
    assert got == pytest.approx(9.520, abs=1e-3)
    assert got < dp.epsilon_spent(sigma, DELTA, t, n, n) / 5
    # PLD: no sampling-without-replacement event in dp-accounting, so the unsampled PLD
    # (55.2 here) loses to the sampled RDP bound, which is reported
    with pytest.raises(dp_accounting.UnsupportedEventError):
        pld.PLDAccountant(REPLACE_ONE).compose(event)
    got_pld = dp.epsilon_spent(sigma, DELTA, t, n, m, accountant="pld")
    unsampled_pld = pld_direct(dp_accounting.GaussianDpEvent(sigma), t)
    assert got_pld == pytest.approx(min(direct, unsampled_pld), rel=1e-6)
    assert got_pld >= sampled_pair_lower_bound(sigma, t, n, m)


def test_near_full_participation_is_no_worse_than_full() -> None:
    """σ = 4, 50 rounds, 99 of 100 clients: 47.5 with the sampled curve alone (issue 28), 22.2
    (RDP) for all 100. The per-order minimum of the two curves gives ≤ full participation."""
    sigma, n, t = 4.0, 100, 50
    gauss = dp_accounting.GaussianDpEvent(sigma / 2)
    sampled_alone = rdp_direct(dp_accounting.SampledWithoutReplacementDpEvent(n, 99, gauss), t)
    assert sampled_alone > 47.0
    for accountant in dp.ACCOUNTANTS:
        full = dp.epsilon_spent(sigma, DELTA, t, n, n, accountant=accountant)
        near = dp.epsilon_spent(sigma, DELTA, t, n, 99, accountant=accountant)
        assert near <= full
        assert near >= sampled_pair_lower_bound(sigma, t, n, 99)
    # the per-order minimum, by hand from dp-accounting's two curves
    curves = []
    for event in (gauss, dp_accounting.SampledWithoutReplacementDpEvent(n, 99, gauss)):
        acc = rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
        acc.compose(event, t)
        curves.append(acc.rdp)
    by_hand, _ = rdp_privacy_accountant.compute_epsilon(
        rdp_privacy_accountant.DEFAULT_RDP_ORDERS, np.minimum(*curves), DELTA
    )
    assert dp.epsilon_spent(sigma, DELTA, t, n, 99) == pytest.approx(by_hand, rel=1e-9)
    assert dp.epsilon_spent(sigma, DELTA, t, n, 99) == pytest.approx(22.02, abs=0.01)
    assert dp.epsilon_spent(sigma, DELTA, t, n, 99, accountant="pld") == pytest.approx(
        full_participation_exact(sigma, t), rel=1e-4
    )


# --- σ from a target ε -----------------------------------------------------------------------


@pytest.mark.parametrize("accountant", dp.ACCOUNTANTS)
@pytest.mark.parametrize(("n", "m", "t", "target"), [(100, 100, 10, 7.5113), (100, 10, 20, 4.0)])
def test_noise_for_epsilon_round_trips(
    accountant: str, n: int, m: int, t: int, target: float
) -> None:
    sigma = dp.noise_for_epsilon(target, DELTA, t, n, m, accountant=accountant)
    got = dp.epsilon_spent(sigma, DELTA, t, n, m, accountant=accountant)
    assert target * (1 - 1e-3) < got <= target
    smaller = sigma * (1 - 2 * dp.SIGMA_SEARCH_RTOL)
    assert dp.epsilon_spent(smaller, DELTA, t, n, m, accountant=accountant) > target
    if m == n and accountant == "pld":  # the exact ε = 7.5113 is σ = 4
        assert sigma == pytest.approx(4.0, rel=1e-3)


def test_noise_for_epsilon_refusals() -> None:
    with pytest.raises(ValueError, match="positive"):
        dp.noise_for_epsilon(0.0, DELTA, 10, 100, 100)
    with pytest.raises(ValueError, match=r"raise dp\.epsilon"):
        dp.noise_for_epsilon(1e-6, DELTA, 10, 100, 100)
    with pytest.raises(ValueError, match=r"dp\.accountant"):
        dp.noise_for_epsilon(1.0, DELTA, 10, 100, 100, accountant="gdp")


# --- adaptive clipping -----------------------------------------------------------------------


@pytest.mark.parametrize(("z", "count_std"), [(1.0, 5.0), (4.0, 2.5), (0.9, 0.5), (2.0, 100.0)])
def test_noise_split_spends_what_the_unsplit_multiplier_spends(z: float, count_std: float) -> None:
    """Update: sensitivity 2C, noise z_Δ C (multiplier z_Δ/2); count: sensitivity 1, noise σ_b.
    Composed, they spend exactly what GaussianDpEvent(z/2) spends (replace-one)."""
    z_update = dp.update_noise_multiplier(z, count_std)
    assert z_update > z
    gauss = dp_accounting.GaussianDpEvent
    composed = dp_accounting.ComposedDpEvent([gauss(z_update / 2), gauss(count_std)])
    split, whole = (rdp.RdpAccountant(neighboring_relation=REPLACE_ONE) for _ in range(2))
    split.compose(composed, 10)
    whole.compose(gauss(z / 2), 10)
    np.testing.assert_allclose(split.rdp, whole.rdp, rtol=1e-9)
    assert rdp_direct(composed, 10) == pytest.approx(dp.epsilon_spent(z, DELTA, 10, 50, 50))
    # PLD (REPLACE_ONE doubles a GaussianDpEvent's sensitivity: the count's 1 is 2σ_b)
    composed_pld = dp_accounting.ComposedDpEvent([gauss(z_update), gauss(2 * count_std)])
    assert pld_direct(composed_pld, 10, interval=1e-3) == pytest.approx(
        pld_direct(gauss(z), 10, interval=1e-3), rel=1e-3
    )
    # a split that does not pay for the count (z_Δ = z) spends more; one without the 2 spends
    # something else
    assert rdp_direct(
        dp_accounting.ComposedDpEvent([gauss(z / 2), gauss(count_std)]), 10
    ) > rdp_direct(gauss(z / 2), 10) * (1 + 1e-6)
    if count_std > z:
        wrong = (z**-2 - count_std**-2) ** -0.5
        wrong_composed = dp_accounting.ComposedDpEvent([gauss(wrong / 2), gauss(count_std)])
        assert rdp_direct(wrong_composed, 10) != pytest.approx(rdp_direct(gauss(z / 2), 10))


def test_noise_split_matches_flower_and_refuses_a_count_noise_too_small() -> None:
    assert dp.default_clipped_count_stddev(100) == 5.0
    assert dp.update_noise_multiplier(0.0, 1.0) == 0.0
    flwr_dp = pytest.importorskip("flwr.supercore.differential_privacy")
    count_std, z_update = flwr_dp.compute_adaptive_noise_params(1.3, 40, None)
    assert count_std == dp.default_clipped_count_stddev(40)
    assert dp.update_noise_multiplier(1.3, count_std) == pytest.approx(z_update, rel=1e-12)


def test_clip_update_direction_and_value() -> None:
    c, gamma, lr = 1.0, 0.5, 0.2
    assert dp.next_clip_norm(c, 8.0, 10, gamma, lr) == pytest.approx(math.exp(-0.2 * 0.3))
    assert dp.next_clip_norm(c, 8.0, 10, gamma, lr) < c  # too many unclipped: lower C
    assert dp.next_clip_norm(c, 2.0, 10, gamma, lr) > c  # too many clipped: raise C
    assert dp.next_clip_norm(c, 5.0, 10, gamma, lr) == c  # at the target: keep C
    assert dp.next_clip_norm(c, 5.0, 10, gamma) == c  # default η_C
    assert dp.next_clip_norm(2.0, 0.0, 4, 0.25, 0.5) == pytest.approx(2.0 * math.exp(0.125))


def test_clip_update_settles_at_the_target_quantile() -> None:
    """Noiseless geometric updates from far below and far above end up at the γ-quantile of the
    upload norms (norms 1, 2, ..., 100: between the 30th and 31st for γ = 0.3), and the noised
    count keeps C near it."""
    norms = np.arange(1.0, 101.0)
    rng = np.random.default_rng(0)
    for start in (0.01, 1e4):
        c = start
        for _ in range(400):
            c = dp.next_clip_norm(c, float((norms <= c).sum()), len(norms), 0.3, 0.2)
        assert 29.0 <= c <= 32.0
    c, late = 1.0, []
    for step in range(2000):
        noised = float((norms <= c).sum()) + rng.normal(0.0, dp.default_clipped_count_stddev(100))
        c = dp.next_clip_norm(c, noised, len(norms), 0.3, 0.2)
        late += [c] if step >= 1000 else []
    assert 25.0 <= float(np.median(late)) <= 36.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_quantile": 0.0}, "target_quantile"),
        ({"target_quantile": 1.0}, "target_quantile"),
        ({"clip_lr": 0.0}, "clip_lr"),
        ({"clip_lr": math.inf}, "clip_lr"),
        ({"contributors": 0}, "contributor"),
        ({"noised_count": math.nan}, "count"),
        ({"clip_norm": 0.0}, "clip norm"),
    ],
)
def test_clip_update_refusals(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {
        "clip_norm": 1.0,
        "noised_count": 3.0,
        "contributors": 10,
        "target_quantile": 0.5,
        "clip_lr": 0.2,
    }
    with pytest.raises(ValueError, match=match):
        dp.next_clip_norm(**{**args, **kwargs})


def test_dp_config_keys() -> None:
    cfg = DPConfig(clip_norm=1.0, noise_multiplier=1.0)
    assert cfg.accountant == "rdp" and cfg.target_quantile is None
    assert cfg.clip_lr == 0.2 and cfg.clipped_count_stddev is None
    adaptive = DPConfig(
        clip_norm=0.1,
        noise_multiplier=1.0,
        target_quantile=0.5,
        clipped_count_stddev=0.6,
        accountant="pld",
    )
    assert DPConfig.model_validate(json.loads(adaptive.model_dump_json())) == adaptive
    assert DPConfig.model_validate(json.loads(cfg.model_dump_json())) == cfg
    with pytest.raises(ValidationError, match=r"dp\.clip_norm is not"):
        DPConfig(target_quantile=0.5)
    assert dp.DPSettings(1.0, 1.0, DELTA).accountant == "rdp"
    assert dp.DPSettings(1.0, 1.0, DELTA, accountant="pld").accountant == "pld"
    with pytest.raises(ValueError, match=r"dp\.accountant"):
        dp.DPSettings(1.0, 1.0, DELTA, accountant="moments")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accountant": "moments"}, "accountant"),
        ({"target_quantile": 0.0}, "target_quantile"),
        ({"target_quantile": 1.0}, "target_quantile"),
        ({"target_quantile": 0.5, "clip_lr": 0.0}, "clip_lr"),
        ({"target_quantile": 0.5, "clipped_count_stddev": 0.0}, "clipped_count_stddev"),
        ({"clipped_count_stddev": 1.0}, "dp.target_quantile is not"),
        ({"target_quantile": 0.5, "clipped_count_stddev": 0.5}, r"noise_multiplier / 2"),
    ],
)
def test_dp_config_refusals(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        DPConfig(**{"clip_norm": 1.0, "noise_multiplier": 1.0, **kwargs})
