"""A private round at the level of :class:`~fedlore.privacy.Privacy` (no run, no model).

* A secure round through the privacy layer's plan gives the weighted mean, with a client
  dropping out; under DP the clients' noise shares are not the seed's (the attack that
  regenerates and subtracts them fails, and works on the seeded debugging mode).
* DP: clipping bounds the whole upload (the sketch's share on its own), the server refuses an
  unclipped upload, ε comes from dp-accounting for the sampling in use and a target ε is met;
  adaptive clipping finds the target quantile of the upload norms, DP alone and under secure
  aggregation.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from fedlore.privacy import (
    ClipNorm,
    DPSettings,
    Privacy,
    SeededSource,
    client_contribution,
    clip_upload,
    epsilon_spent,
    flatten,
    noise_for_epsilon,
    parties,
    privatize,
)
from fedlore.seeding import DP_NOISE, generator
from fedlore.types import Broadcast, Reply

SEED = 5


def _reply(seed: int, n: int = 1) -> Reply:
    g = torch.Generator().manual_seed(seed)
    arrays = {
        "update.w": torch.randn(3, 4, generator=g),
        "sketch.w": 50 * torch.randn(3, 2, generator=g),
    }
    return Reply(arrays, {"num_examples": n, "train_loss": 0.5, "train_s": 0.1})


def _spec(reply: Reply) -> dict[str, Any]:
    return {k: (tuple(v.shape), v.dtype) for k, v in reply.arrays.items()}


def _secure_round(
    privacy: Privacy, replies: dict[int, Reply], dropped: tuple[int, ...], rnd: int = 3
) -> tuple[list[tuple[int, Reply | None]], dict[str, Any], dict[int, Any]]:
    """One in-process secure round of ``replies`` (client -> its unprotected reply) with
    :class:`Privacy`'s plan, the clients of ``dropped`` failing after they shared their keys:
    the replies the method would aggregate, the privacy metrics, each client's contribution."""
    spec = _spec(next(iter(replies.values())))
    msgs = privacy.configure(rnd, {c: Broadcast({}, {"round": rnd}) for c in replies})
    plan = privacy.plan(rnd, sorted(replies), spec)
    contrib = {}

    def upload(c: int) -> Any:
        if c in dropped:
            raise RuntimeError("lost after sharing its keys")
        contrib[c] = client_contribution(replies[c], msgs[c].config, c, rnd, privacy.noise)
        return plan.encode(contrib[c])

    res = parties.secure_sum(plan.params, parties.LocalParties(plan.params, upload), plan.length)
    sum_wx, sum_w, _ = plan.decode(res.total)
    clear = {c: contrib[c].metrics for c in res.survivors}
    out, metrics = privacy.from_mean(
        rnd, spec, sum_wx / sum_w, clear, sorted(replies), torch.device("cpu")
    )
    return out, metrics, contrib


@pytest.mark.parametrize(("uniform", "degree"), [(True, 0), (False, 4)])
def test_in_process_round_gives_the_weighted_mean_with_a_dropout(
    uniform: bool, degree: int
) -> None:
    """One of six clients drops out: every survivor keeps t surviving mask partners (complete
    graph: 4 of 5, t = 3; ring of degree 4: at least 3 of 4, t = 3), so the round withstands
    t − 1 colluders and completes with the survivors' mean."""
    replies = {c: _reply(c, n=10 + c) for c in (0, 2, 5, 7, 8, 9)}
    privacy = Privacy(True, None, uniform, 10, 6, 0, SEED, mask_degree=degree,
                      threshold=0.5, max_weight=19.0)  # fmt: skip
    out, metrics, contrib = _secure_round(privacy, replies, dropped=(5,))
    assert metrics["secagg_dropped"] == 1 and [c for c, r in out if r is None] == [5]
    assert all(set(c.metrics) == {"train_s"} for c in contrib.values())  # no loss in the clear
    alive = [c for c in replies if c != 5]
    w = {c: 1.0 if uniform else float(replies[c].num_examples) for c in alive}
    for key in replies[0].arrays:
        want = torch.stack([w[c] * replies[c].arrays[key].double() for c in alive]).sum(0)
        want /= sum(w.values())
        got = next(r for c, r in out if r is not None).arrays[key]
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), want, atol=1e-6)


def test_secure_dp_shares_cannot_be_regenerated_from_the_seed() -> None:
    """Issue 28's attack under secure aggregation with DP: regenerate every client's noise
    share from ``(seed, DP_NOISE, round, client)`` and subtract it from the unmasked mean.
    With shares from OS entropy the error stays of the noise's size; with
    ``dp.reproducible_noise`` (the seeded debugging mode) the same attack gives the exact
    clipped mean, so the attack itself works."""
    replies = {c: _reply(c) for c in range(4)}
    dp = DPSettings(clip_norm=1.0, noise_multiplier=2.0, delta=1e-5)
    for source, works in ((None, False), (SeededSource(SEED), True)):
        kwargs = {} if source is None else {"noise": source}
        privacy = Privacy(True, dp, True, 4, 4, 0, SEED, **kwargs)  # type: ignore[arg-type]
        out, _, _ = _secure_round(privacy, replies, dropped=())
        released = flatten(out[0][1].arrays)  # type: ignore[union-attr]
        share = privacy.noise_share(4)
        regenerated = sum(
            share * torch.randn(released.numel(), generator=generator(SEED, DP_NOISE, 3, c),
                                dtype=torch.float64)
            for c in range(4)
        ) / 4  # fmt: skip
        clipped = (
            sum(flatten(clip_upload(dict(r.arrays), 1.0, 0.5)[0]) for r in replies.values()) / 4
        )
        err = (released - regenerated - clipped).abs().max().item()
        if works:
            assert err < 1e-5
        else:
            assert err > 0.5  # noise of std ~ σC sqrt(4/3)/4 = 0.58 per entry, 18 entries
        # the share is sized for the fewest survivors: their shares alone reach σC
        assert share == pytest.approx(2.0 / math.sqrt(privacy.min_survivors(4)))


def test_clipping_bounds_the_whole_upload_and_each_part() -> None:
    reply = _reply(1)
    clipped, did = clip_upload(dict(reply.arrays), 2.0, 0.25)
    assert did
    sketch = clipped["sketch.w"].double().norm().item()
    rest = clipped["update.w"].double().norm().item()
    assert sketch == pytest.approx(2.0 * math.sqrt(0.25), rel=1e-6)  # 50x larger: clipped
    assert rest <= 2.0 * math.sqrt(0.75) * (1 + 1e-6)
    assert math.hypot(sketch, rest) <= 2.0 * (1 + 1e-6)
    small = {"update.w": torch.full((2,), 0.1)}
    same, did = clip_upload(small, 1.0, 0.5)
    assert not did and same["update.w"] is small["update.w"]


def test_dp_alone_clips_on_the_client_and_the_server_refuses_an_unclipped_upload() -> None:
    dp = DPSettings(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5)
    privacy = Privacy(False, dp, True, 10, 2, 0, SEED)
    msgs = privacy.configure(0, {0: Broadcast({}, {"round": 0}), 1: Broadcast({}, {"round": 0})})
    honest = privatize(_reply(0), msgs[0].config)
    assert honest.metrics["dp_clipped"] == 1 and "train_loss" not in honest.metrics
    assert privacy.screen(honest) is None
    assert "exceeds the clip norm 1" in str(privacy.screen(_reply(1)))
    out, metrics = privacy.combine(
        0, _spec(_reply(0)), [(0, honest), (1, None)], torch.device("cpu")
    )
    epsilon, noised = metrics["dp_epsilon"], out[0][1]
    assert metrics["dp_clipped"] == 1 and isinstance(epsilon, float) and epsilon > 0
    assert noised is not None
    # the noise is sigma*C on the sum, one contributor: the mean moved by about that
    moved = (flatten(noised.arrays) - flatten(honest.arrays)).std().item()
    assert 0.5 < moved < 2.0


def test_accountant_follows_the_sampling_and_meets_a_target_epsilon() -> None:
    eps = [epsilon_spent(1.0, 1e-5, t, 100, 10) for t in (1, 5, 20)]
    assert eps[0] < eps[1] < eps[2]
    assert epsilon_spent(1.0, 1e-5, 20, 100, 10) < epsilon_spent(1.0, 1e-5, 20, 100, 100)
    sigma = noise_for_epsilon(4.0, 1e-5, 20, 100, 10)
    got = epsilon_spent(sigma, 1e-5, 20, 100, 10)
    assert 3.9 < got <= 4.0 + 1e-6
    assert epsilon_spent(sigma * 0.95, 1e-5, 20, 100, 10) > 4.0  # the smallest such sigma


def _norm_replies(norms: list[float]) -> dict[int, Reply]:
    """Replies whose upload has exactly the given L2 norms."""
    out = {}
    for c, n in enumerate(norms):
        x = torch.zeros(4)
        x[c % 4] = n
        out[c] = Reply({"update.w": x}, {"num_examples": 1})
    return out


@pytest.mark.parametrize("secure", [False, True])
def test_adaptive_clipping_finds_the_target_quantile(secure: bool) -> None:
    """Andrew et al.'s adaptive clip on ten clients whose upload norms are 1..10, from C = 100
    towards the 0.3 quantile: after 60 rounds C lies between the 2nd and the 5th norm (the
    noised count, σ_b = 0.2, travels in the clear DP alone and inside the masked sum under secure
    aggregation); every round reports the C it used and the noised unclipped fraction."""
    norms = [float(n) for n in range(1, 11)]
    replies = _norm_replies(norms)
    dp = DPSettings(clip_norm=100.0, noise_multiplier=0.2, delta=1e-5)  # σ_b must exceed z / 2
    privacy = Privacy(secure, dp, True, 10, 10, 0, SEED, threshold=0.5,
                      clip=ClipNorm(100.0, 0.3, 0.2, 0.2))  # fmt: skip
    spec = _spec(replies[0])
    used = []
    for rnd in range(60):
        used.append(privacy.clip_norm)
        if secure:
            _, metrics, _ = _secure_round(privacy, replies, dropped=(), rnd=rnd)
        else:
            msgs = privacy.configure(rnd, {c: Broadcast({}, {"round": rnd}) for c in replies})
            sent = [(c, privatize(r, msgs[c].config)) for c, r in replies.items()]
            _, metrics = privacy.combine(rnd, spec, sent, torch.device("cpu"))
        assert metrics["dp_clip_norm"] == used[-1]
        exact = sum(n <= used[-1] for n in norms) / 10
        assert abs(metrics["dp_unclipped_fraction"] - exact) < 0.2  # σ_b / 10 = 0.02 per round
    assert used[0] == 100.0 and used == sorted(used, reverse=True)[:1] + used[1:]
    assert 2.0 <= privacy.clip_norm <= 5.0
    # the update's noise multiplier is raised so the pair spends what Gaussian(z) does
    assert privacy.update_multiplier > 0.2
