"""DP-FedBuff's server side (:mod:`fedlore.privacy.buffer_dp`): the noised buffer mean, its noise
scale and source, the staleness weights' bound, once per step, and the per-client accounting
(m-fold Gaussian, no amplification, the largest over the clients)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from fedlore.privacy import DPSettings, Privacy, SecureSource, SeededSource
from fedlore.privacy.buffer_dp import (
    CONTRIBUTIONS_KEY,
    BufferDP,
    check_weight,
    contribution_epsilon,
)
from fedlore.privacy.client import ReplySpec
from fedlore.privacy.randomness import SERVER
from fedlore.types import Reply, State

SPEC: ReplySpec = {"update.a": ((3,), torch.float32), "update.b": ((2,), torch.float32)}
CPU = torch.device("cpu")


def _privacy(
    sigma: float = 2.0,
    clip: float = 1.0,
    noise: Any = None,
    setup: int = 0,
    accountant: str = "rdp",
    **kw: Any,
) -> Privacy:
    return Privacy(
        False, DPSettings(clip, sigma, 1e-5, accountant=accountant), True, 6, 6, setup, 42,
        noise=noise if noise is not None else SecureSource(), **kw,
    )  # fmt: skip


def _reply(a: list[float], b: list[float], clipped: int = 0) -> Reply:
    arrays = {"update.a": torch.tensor(a), "update.b": torch.tensor(b)}
    return Reply(arrays, {"num_examples": 1, "dp_clipped": clipped, "train_loss": 0.3})


class Recorded:
    """A noise source that returns a fixed draw and records what it was asked for."""

    secure = True

    def __init__(self, value: float) -> None:
        self.value, self.calls = value, []  # type: ignore[var-annotated]

    def gaussian(self, n: int, std: float, rnd: int, client: int) -> torch.Tensor:
        self.calls.append((n, std, rnd, client))
        return torch.full((n,), self.value, dtype=torch.float64)

    def sample(self, num_clients: int, per_round: int, rnd: int) -> list[int]:
        raise AssertionError("DP-FedBuff draws no sample")


def _mean(out: list[tuple[int, Reply | None]]) -> torch.Tensor:
    r = out[0][1]
    assert r is not None
    return torch.cat([r.arrays["update.a"].double(), r.arrays["update.b"].double()])


def test_the_step_is_the_weighted_sum_plus_noise_divided_by_k() -> None:
    noise = Recorded(0.5)
    dp = BufferDP(_privacy(sigma=2.0, clip=1.5, noise=noise))
    x = _reply([0.3, 0.0, 0.4], [0.0, 0.0], clipped=1)
    y = _reply([0.0, 0.6, 0.0], [0.8, 0.0])
    out, metrics = dp.combine(4, SPEC, [(3, x, 1.0), (5, y, 0.5)], CPU)
    want = (
        torch.tensor([0.3, 0.0, 0.4, 0.0, 0.0], dtype=torch.float64)
        + 0.5 * torch.tensor([0.0, 0.6, 0.0, 0.8, 0.0], dtype=torch.float64)
        + 0.5
    ) / 2
    torch.testing.assert_close(_mean(out), want, rtol=0, atol=1e-7)
    # noise once, on the sum, of std σC, for the step's version from the server's stream
    assert noise.calls == [(5, 3.0, 4, SERVER)]
    assert [c for c, _ in out] == [3, 5]
    for _, r in out:  # every contributor: the same noised mean, weight 1, no training loss
        assert r is not None and r.metrics["num_examples"] == 1 and "train_loss" not in r.metrics
    assert metrics["dp_clipped"] == 1 and metrics["dp_clip_norm"] == 1.5


def test_a_float64_model_is_summed_and_averaged_in_float64() -> None:
    """The sum of the weighted uploads is taken in float64: a float64 model's step keeps
    values that float32 cannot hold (0.1, 1/3, 1 + 1e-12), exactly as summed by hand."""
    spec: ReplySpec = {"update.a": ((3,), torch.float64)}
    x = torch.tensor([0.1, 1 / 3, 1 + 1e-12], dtype=torch.float64)
    y = torch.tensor([1e-9, -0.2, 2.0**-40], dtype=torch.float64)
    dp = BufferDP(_privacy(noise=Recorded(0.0)))
    buffer = [(0, Reply({"update.a": x}, {}), 1.0), (1, Reply({"update.a": y}, {}), 0.7)]
    out, metrics = dp.combine(0, spec, buffer, CPU)
    r = out[0][1]
    assert r is not None and r.arrays["update.a"].dtype == torch.float64
    torch.testing.assert_close(r.arrays["update.a"], (x + 0.7 * y) / 2, rtol=0, atol=1e-16)
    # replies without the clip count (none here) count as not clipped, as in a synchronous round
    _, sync = _privacy(noise=Recorded(0.0)).combine(0, spec, [(0, buffer[0][1])], CPU)
    assert metrics["dp_clipped"] == sync["dp_clipped"] == 0


def test_the_mean_is_placed_on_the_models_device() -> None:
    """The noised mean is computed on the CPU and handed to the method on the global model's
    device (``meta`` here: the mutation runs are CPU-only)."""
    x = _reply([0.3, 0.0, 0.4], [0.0, 0.0])
    out, _ = BufferDP(_privacy()).combine(0, SPEC, [(0, x, 1.0)], torch.device("meta"))
    r = out[0][1]
    assert r is not None
    assert {v.device.type for v in r.arrays.values()} == {"meta"}


def test_a_step_without_contributions_releases_no_mean() -> None:
    """An empty buffer (the engine steps only with contributions, but ``combine`` takes one)
    reads nothing: no reply, no noise, no clip count, ε 0 and a busiest client of 0 steps."""
    noise = Recorded(0.5)
    out, metrics = BufferDP(_privacy(clip=1.5, noise=noise)).combine(0, SPEC, [], CPU)
    assert out == [] and noise.calls == []
    assert metrics == {"dp_clip_norm": 1.5, "dp_epsilon": 0.0, "dp_contributions_max": 0}


def test_canaries_join_the_buffers_sum_not_its_count() -> None:
    """Under the canary audit every inserted canary adds ``C c_i / ‖c_i‖`` to the sum before
    the noise, and the sum is still divided by the K real contributions (by hand)."""
    from fedlore.privacy.canaries import Canaries

    can = Canaries(3, 0, 3, [("update.a", "a"), ("update.b", "b")],
                   torch.zeros(5, dtype=torch.float64), lambda s: s.arrays)  # fmt: skip
    noise = Recorded(0.25)
    dp = BufferDP(_privacy(clip=1.5, noise=noise, canaries=can))
    x = _reply([0.3, 0.0, 0.4], [0.0, 0.0])
    y = _reply([0.0, 0.6, 0.0], [0.8, 0.0])
    out, _ = dp.combine(2, SPEC, [(3, x, 1.0), (5, y, 0.5)], CPU)
    g = can.vectors.double()
    uploads = torch.tensor([0.3, 0.3, 0.4, 0.4, 0.0], dtype=torch.float64)  # x + y / 2
    want = (uploads + (1.5 * g / g.norm(dim=1, keepdim=True)).sum(0) + 0.25) / 2
    torch.testing.assert_close(_mean(out), want, rtol=0, atol=1e-6)
    assert noise.calls == [(5, 1.5 * 2.0, 2, SERVER)]


def test_the_noise_has_std_sigma_c_on_the_sum() -> None:
    """With OS noise, K x (mean) - Σ w x over 200,000 coordinates: std σC within 1 %."""
    spec: ReplySpec = {"update.a": ((200_000,), torch.float32)}
    dp = BufferDP(_privacy(sigma=3.0, clip=0.5))
    zero = Reply({"update.a": torch.zeros(200_000)}, {"num_examples": 1})
    buffer = [(c, zero, 1.0) for c in range(4)]
    out, _ = dp.combine(0, spec, buffer, CPU)
    r = out[0][1]
    assert r is not None
    noise = 4 * r.arrays["update.a"].double()
    assert float(noise.std()) == pytest.approx(1.5, rel=0.01)
    assert abs(float(noise.mean())) < 0.02


def test_reproducible_noise_is_the_synchronous_rounds_draw() -> None:
    """Under ``dp.reproducible_noise`` a step's noise is the synchronous round's of the same
    number (the seed's DP_NOISE stream for the server): with weights 1 both paths agree."""
    x, y = _reply([0.1, 0.2, 0.3], [0.4, 0.5]), _reply([0.0, -0.2, 0.1], [0.2, 0.0])
    buffered = BufferDP(_privacy(noise=SeededSource(42)))
    a, _ = buffered.combine(3, SPEC, [(1, x, 1.0), (2, y, 1.0)], CPU)
    b, _ = _privacy(noise=SeededSource(42)).combine(3, SPEC, [(1, x), (2, y)], CPU)
    torch.testing.assert_close(_mean(a), _mean(b), rtol=0, atol=0)
    c, _ = BufferDP(_privacy(noise=SeededSource(43))).combine(3, SPEC, [(1, x, 1.0)], CPU)
    assert not torch.equal(_mean(a), _mean(c))


@pytest.mark.parametrize("w", [1.0000001, 2.0, -0.1, math.nan])
def test_a_weight_that_could_raise_the_sensitivity_is_refused(w: float) -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_weight(w)
    dp = BufferDP(_privacy())
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dp.combine(0, SPEC, [(0, _reply([1, 0, 0], [0, 0]), w)], CPU)


@pytest.mark.parametrize("w", [0.0, 0.5, 1.0])
def test_every_weight_in_the_unit_interval_passes(w: float) -> None:
    check_weight(w)


def test_staleness_weights_keep_a_clipped_upload_within_c() -> None:
    """Every staleness weighting is at most 1 at every staleness, so w x stays in the C-ball."""
    from fedlore.engine.buffered import staleness_weight

    for kind in ("sqrt", "constant", "polynomial"):
        for s in range(50):
            check_weight(staleness_weight(s, kind, 0.5))


def test_a_client_twice_in_one_buffer_is_refused() -> None:
    dp = BufferDP(_privacy())
    r = _reply([0.1, 0, 0], [0, 0])
    with pytest.raises(ValueError, match="contributes twice"):
        dp.combine(0, SPEC, [(1, r, 1.0), (2, r, 1.0), (1, r, 0.5)], CPU)


def test_a_cap_of_one_step_lets_every_client_in_once() -> None:
    """``dp.max_contributions: 1``: a client not yet in any step may start (its count is 0),
    and once it has contributed it never starts again."""
    dp = BufferDP(_privacy(), max_contributions=1)
    assert all(dp.startable(c, set()) for c in range(6))
    dp.combine(0, SPEC, [(2, _reply([0.1, 0, 0], [0, 0]), 1.0)], CPU)
    assert not dp.startable(2, set())
    assert all(dp.startable(c, set()) for c in (0, 1, 3, 4, 5))


def test_a_client_in_the_buffer_or_at_the_cap_is_not_started() -> None:
    dp = BufferDP(_privacy(), max_contributions=2)
    assert dp.startable(0, set()) and not dp.startable(0, {0}) and dp.startable(1, {0})
    r = _reply([0.1, 0, 0], [0, 0])
    dp.combine(0, SPEC, [(0, r, 1.0), (1, r, 1.0)], CPU)
    assert dp.startable(0, set())  # one step of two
    dp.combine(1, SPEC, [(0, r, 1.0)], CPU)
    assert not dp.startable(0, set()) and dp.startable(1, set())
    assert BufferDP(_privacy()).startable(0, set())  # no cap


def _gaussian_rdp_epsilon(sigma: float, steps: int, delta: float) -> float:
    """ε of ``steps`` self-composed Gaussians of multiplier σ/2 (sensitivity 2C, noise σC),
    computed here from dp-accounting directly."""
    import dp_accounting
    from dp_accounting import rdp

    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma / 2), steps))
    return float(acc.get_epsilon(delta))


def test_a_client_in_m_steps_spends_the_m_fold_gaussian_and_the_run_the_largest() -> None:
    dp = BufferDP(_privacy(sigma=2.0))
    r = _reply([0.1, 0, 0], [0, 0])
    assert dp.epsilon() == 0.0
    for v, ids in enumerate([[0, 1], [0, 2], [0, 1], [3, 4]]):
        _, metrics = dp.combine(v, SPEC, [(c, r, 1.0) for c in ids], CPU)
    # client 0 in 3 steps, client 1 in 2, others in 1: the run's ε is client 0's
    assert dp.counts.counts == {0: 3, 1: 2, 2: 1, 3: 1, 4: 1}
    want = _gaussian_rdp_epsilon(2.0, 3, 1e-5)
    assert metrics["dp_epsilon"] == pytest.approx(want, rel=1e-9)
    assert metrics["dp_contributions_max"] == 3
    assert want > _gaussian_rdp_epsilon(2.0, 2, 1e-5) > _gaussian_rdp_epsilon(2.0, 1, 1e-5)
    assert contribution_epsilon(2.0, 1e-5, 3) == pytest.approx(want, rel=1e-9)
    # PLD: the same composition, a smaller (tighter) ε
    assert 0 < contribution_epsilon(2.0, 1e-5, 3, accountant="pld") < want


def test_the_run_epsilon_is_the_largest_over_the_clients_not_the_last_steps() -> None:
    dp = BufferDP(_privacy(sigma=2.0))
    r = _reply([0.1, 0, 0], [0, 0])
    for v in range(4):
        dp.combine(v, SPEC, [(0, r, 1.0)], CPU)
    _, metrics = dp.combine(4, SPEC, [(1, r, 1.0), (2, r, 1.0)], CPU)
    assert metrics["dp_epsilon"] == pytest.approx(_gaussian_rdp_epsilon(2.0, 4, 1e-5))


def test_repeats_and_setup_exchanges_count_for_every_client() -> None:
    dp = BufferDP(_privacy(sigma=2.0, repeated=2))
    _, metrics = dp.combine(0, SPEC, [(0, _reply([0.1, 0, 0], [0, 0]), 1.0)], CPU)
    assert metrics["dp_epsilon"] == pytest.approx(_gaussian_rdp_epsilon(2.0, 3, 1e-5))
    assert dp.spent(0) == 3 and dp.spent(9) == 2
    # one setup exchange (read every client's data before step 0) on top of the two repeats
    dp = BufferDP(_privacy(sigma=2.0, setup=1, repeated=2))
    _, metrics = dp.combine(0, SPEC, [(0, _reply([0.1, 0, 0], [0, 0]), 1.0)], CPU)
    assert dp.spent(0) == 4 and dp.spent(9) == 3
    assert metrics["dp_epsilon"] == pytest.approx(_gaussian_rdp_epsilon(2.0, 4, 1e-5))


def _gaussian_dp_epsilon(sigma: float, steps: int, delta: float) -> float:
    """The exact ε at ``delta`` of ``steps`` Gaussians of sensitivity 2C and noise σC: μ-GDP
    with μ = 2√steps/σ (Dong, Roth & Su 2022), whose δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)
    is solved for ε by bisection, by hand (no dp-accounting)."""
    mu = 2 * math.sqrt(steps) / sigma

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    def gap(eps: float) -> float:
        return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2) - delta

    low, high = 0.0, 100.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if gap(mid) > 0 else (low, mid)
    return high


def test_the_run_epsilon_is_composed_by_the_configured_accountant() -> None:
    """Under ``dp.accountant: pld`` the run's ε is the PLD's: the exact Gaussian-DP ε of the
    busiest client's steps up to the PLD's discretization (pessimistic, under 1e-3 relative),
    well below the RDP bound of the same steps."""
    dp = BufferDP(_privacy(sigma=2.0, accountant="pld"))
    r = _reply([0.1, 0, 0], [0, 0])
    for v, ids in enumerate([[0, 1], [0], [0, 2]]):
        _, metrics = dp.combine(v, SPEC, [(c, r, 1.0) for c in ids], CPU)
    eps, exact = float(metrics["dp_epsilon"]), _gaussian_dp_epsilon(2.0, 3, 1e-5)
    assert exact <= eps <= exact * (1 + 1e-3)
    assert eps < 0.95 * _gaussian_rdp_epsilon(2.0, 3, 1e-5)
    assert dp.epsilon() == eps


def test_no_noise_is_infinite_epsilon() -> None:
    dp = BufferDP(_privacy(sigma=0.0))
    _, metrics = dp.combine(0, SPEC, [(0, _reply([0.1, 0, 0], [0, 0]), 1.0)], CPU)
    assert metrics["dp_epsilon"] == math.inf


def test_the_counts_survive_a_checkpoint() -> None:
    dp = BufferDP(_privacy())
    r = _reply([0.1, 0, 0], [0, 0])
    dp.combine(0, SPEC, [(0, r, 1.0), (3, r, 1.0)], CPU)
    dp.combine(1, SPEC, [(3, r, 1.0)], CPU)
    state = dp.record(State({"a": torch.zeros(1)}, {"other": 1}))
    assert state.values[CONTRIBUTIONS_KEY] == "0:1,3:2" and state.values["other"] == 1
    again = BufferDP(_privacy())
    again.restore(state)
    assert again.counts.counts == {0: 1, 3: 2} and again.epsilon() == dp.epsilon()
    fresh = BufferDP(_privacy())
    fresh.restore(State({"a": torch.zeros(1)}, {}))
    assert fresh.counts.counts == {}


@pytest.mark.parametrize(
    "kw", [{"secure": True}, {"local": True}, {"dp": None}], ids=["secure", "local", "off"]
)
def test_only_central_dp_without_secure_aggregation(kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {
        "secure": False, "dp": DPSettings(1.0, 1.0, 1e-5), "uniform": True, "num_clients": 6,
        "per_round": 6, "setup_rounds": 0, "seed": 0,
    }  # fmt: skip
    args.update(kw)
    with pytest.raises(ValueError) as info:
        BufferDP(Privacy(**args))
    assert str(info.value) == (
        "DP-FedBuff is central DP without secure aggregation, fixed clip, server noise"
    )
