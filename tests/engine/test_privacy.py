"""Secure aggregation and central DP in a round and in runs (fedlore.privacy, the loop).

* A secure round through :class:`~fedlore.privacy.Privacy`'s plan gives the weighted mean, with
  a client dropping out; under DP the clients' noise shares are not the seed's (the attack that
  regenerates them and subtracts them fails).
* DP: clipping bounds the whole upload (the sketch's share on its own), the server refuses an
  unclipped upload, ε comes from dp-accounting for the sampling in use and a target ε is met.
* Runs: a secure FedFull run gives the plain run's model; a client failing mid-round leaves the
  round complete; too few survivors abort the round and leave the model where it was; a DP run
  resumes after a kill (bit for bit only with ``dp.reproducible_noise``, which marks the run
  "no privacy"); methods that need individual uploads and settings that break the bound are
  refused with the reason.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.config import load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.transport import LocalTransport
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
    privatize,
    secagg,
)
from fedlore.results.report import report
from fedlore.run import NO_PRIVACY, make_algorithm, make_privacy, run_dir, run_one
from fedlore.seeding import DP_NOISE, generator
from fedlore.types import Broadcast, Reply, State

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

    res = secagg.secure_sum(plan.params, secagg.LocalParties(plan.params, upload), plan.length)
    sum_wx, sum_w, _ = plan.decode(res.total)
    clear = {c: contrib[c].metrics for c in res.survivors}
    out, metrics = privacy.from_mean(
        rnd, spec, sum_wx / sum_w, clear, sorted(replies), torch.device("cpu")
    )
    return out, metrics, contrib


@pytest.mark.parametrize(("uniform", "degree"), [(True, 0), (False, 2)])
def test_in_process_round_gives_the_weighted_mean_with_a_dropout(
    uniform: bool, degree: int
) -> None:
    replies = {c: _reply(c, n=10 + c) for c in (0, 2, 5, 7)}
    privacy = Privacy(True, None, uniform, 10, 4, 0, SEED, mask_degree=degree,
                      threshold=0.5, max_weight=17.0)  # fmt: skip
    out, metrics, contrib = _secure_round(privacy, replies, dropped=(5,))
    assert metrics["secagg_dropped"] == 1 and [c for c, r in out if r is None] == [5]
    assert all(set(c.metrics) == {"train_s"} for c in contrib.values())  # no loss in the clear
    alive = [c for c in replies if c != 5]
    w = {c: 1.0 if uniform else float(replies[c].num_examples) for c in alive}
    for key in replies[0].arrays:
        want = sum(w[c] * replies[c].arrays[key].double() for c in alive) / sum(w.values())
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
    assert metrics["dp_clipped"] == 1 and metrics["dp_epsilon"] > 0
    # the noise is sigma*C on the sum, one contributor: the mean moved by about that
    moved = (flatten(out[0][1].arrays) - flatten(honest.arrays)).std().item()
    assert 0.5 < moved < 2.0


def test_accountant_follows_the_sampling_and_meets_a_target_epsilon() -> None:
    eps = [epsilon_spent(1.0, 1e-5, t, 100, 10) for t in (1, 5, 20)]
    assert eps[0] < eps[1] < eps[2]
    assert epsilon_spent(1.0, 1e-5, 20, 100, 10) < epsilon_spent(1.0, 1e-5, 20, 100, 100)
    sigma = noise_for_epsilon(4.0, 1e-5, 20, 100, 10)
    got = epsilon_spent(sigma, 1e-5, 20, 100, 10)
    assert 3.9 < got <= 4.0 + 1e-6
    assert epsilon_spent(sigma * 0.95, 1e-5, 20, 100, 10) > 4.0  # the smallest such sigma


def _cfg(out: Path, *extra: str) -> Any:
    return load_config(
        None,
        [
            "name=privacy",
            "num_clients=4",
            "rounds=3",
            "local_steps=2",
            "batch_size=16",
            "lr=1e-2",
            "model.kwargs={hidden: [16]}",
            "partition.min_size=10",
            "progress=false",
            f"output_dir={out}",
            *extra,
        ],
    )


def _final_model(cfg: Any, method: str) -> dict[str, torch.Tensor]:
    _, state, _ = Checkpointer.load(run_dir(cfg, method, SEED) / "checkpoint.pt")
    return {k: v for k, v in state.arrays.items() if k.startswith("model.")}


def _rows(cfg: Any, method: str) -> list[dict[str, Any]]:
    path = run_dir(cfg, method, SEED) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_secure_fedfull_run_gives_the_plain_model(tmp_path: Path) -> None:
    plain = _cfg(tmp_path / "plain")
    secure = _cfg(tmp_path / "secure", "secure_aggregation=true")
    run_one(plain, "fedfull", SEED)
    summary = run_one(secure, "fedfull", SEED)
    assert summary is not None and "diverged" not in summary  # no train loss is released
    a, b = _final_model(plain, "fedfull"), _final_model(secure, "fedfull")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
    rows = _rows(secure, "fedfull")
    assert all(r["secagg_dropped"] == 0 and r["accepted"] == 4 for r in rows)
    assert all(
        r["bytes_up"] > p["bytes_up"] for r, p in zip(rows, _rows(plain, "fedfull"), strict=True)
    )


def test_a_client_failing_mid_round_leaves_the_secure_round_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client 2 fails in round 1 after it shared its keys (its peers masked with it): the
    survivors' shares of its mask key unmask the sum and the round completes without it."""
    real = LocalTransport._train

    def flaky(self: LocalTransport, rnd: int, cid: int, msg: Broadcast) -> Any:
        if rnd == 1 and cid == 2:
            raise RuntimeError("lost connection after sharing its keys")
        return real(self, rnd, cid, msg)

    monkeypatch.setattr(LocalTransport, "_train", flaky)
    extra = ("secure_aggregation=true", "weighting=uniform", "dp.clip_norm=5")
    cfg = _cfg(tmp_path, *extra, "dp.noise_multiplier=0.3")
    summary = run_one(cfg, "fedfull", SEED)
    assert summary is not None and math.isfinite(summary["final_loss"])
    rows = _rows(cfg, "fedfull")
    assert rows[1]["accepted"] == 3 and rows[1]["secagg_dropped"] == 1
    assert rows[1]["rejected_reasons"] == [
        "2: RuntimeError: lost connection after sharing its keys"
    ]
    assert rows[0]["accepted"] == rows[2]["accepted"] == 4
    assert all(r["secagg_aborted"] == 0 for r in rows)
    eps = [r["dp_epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    assert summary["dp_noise_multiplier"] == 0.3 and summary["dp_epsilon"] == eps[-1]
    assert summary["dp_noise_source"] == "os" and "privacy" not in summary


class _Models:
    """A callback keeping the global model after every round."""

    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        self.after[rnd] = {k: v.clone() for k, v in state.arrays.items() if k.startswith("model.")}


def test_too_few_survivors_abort_the_round_and_the_model_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two of four clients fail in round 1 (secure_aggregation_threshold 2/3: 3 must survive):
    the round is aborted, nothing is unmasked, the model after round 1 is the model after round
    0, and the row says why; the next round runs as usual."""
    real = LocalTransport._train

    def flaky(self: LocalTransport, rnd: int, cid: int, msg: Broadcast) -> Any:
        if rnd == 1 and cid in (1, 3):
            raise RuntimeError("gone")
        return real(self, rnd, cid, msg)

    monkeypatch.setattr(LocalTransport, "_train", flaky)
    cfg = _cfg(tmp_path, "secure_aggregation=true")
    models = _Models()
    run_one(cfg, "fedfull", SEED, extra_callbacks=(models,))
    rows = _rows(cfg, "fedfull")
    assert rows[1]["secagg_aborted"] == 1 and rows[1]["accepted"] == 0
    assert rows[1]["secagg_dropped"] == 4
    assert all("aborted" in why and "2 of 4 clients remain, 3 needed" in why
               for why in rows[1]["rejected_reasons"])  # fmt: skip
    assert all(torch.equal(models.after[0][k], models.after[1][k]) for k in models.after[0])
    assert rows[2]["secagg_aborted"] == 0 and rows[2]["accepted"] == 4
    assert not all(torch.equal(models.after[1][k], models.after[2][k]) for k in models.after[1])


def test_dp_runs_are_private_not_reproducible_and_resume(tmp_path: Path) -> None:
    """A DP run (secure aggregation, σ solved for ε = 20) killed after round 0 resumes from its
    checkpoint to the end with the same ε per round; two runs of the same seed end in different
    models (their noise comes from OS entropy)."""
    extra = ("secure_aggregation=true", "weighting=uniform", "dp.clip_norm=1", "dp.epsilon=20")
    whole = _cfg(tmp_path / "whole", *extra)
    again = _cfg(tmp_path / "again", *extra)
    parts = _cfg(tmp_path / "parts", *extra)
    run_one(whole, "fedfull", SEED)
    run_one(again, "fedfull", SEED)
    assert run_one(parts, "fedfull", SEED, stop_after=0) is None
    summary = run_one(parts, "fedfull", SEED, resume=True)
    assert summary is not None and summary["rounds"] == 3
    a, b = _final_model(whole, "fedfull"), _final_model(again, "fedfull")
    assert not all(torch.equal(a[k], b[k]) for k in a)
    eps = [r["dp_epsilon"] for r in _rows(whole, "fedfull")]
    assert eps == [r["dp_epsilon"] for r in _rows(parts, "fedfull")]
    assert eps[-1] == pytest.approx(20.0, rel=1e-3)


def test_reproducible_noise_replays_and_says_no_privacy(tmp_path: Path) -> None:
    """``dp.reproducible_noise: true``: a kill-and-resume gives the uninterrupted run's model bit
    for bit, and the summary and the report row say the run has no privacy."""
    extra = ("weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1",
             "dp.reproducible_noise=true", "participation=0.5")  # fmt: skip
    whole = _cfg(tmp_path / "whole", *extra)
    parts = _cfg(tmp_path / "parts", *extra)
    summary = run_one(whole, "fedfull", SEED)
    assert summary is not None and summary["privacy"] == NO_PRIVACY
    assert summary["dp_noise_source"] == "seed"
    assert run_one(parts, "fedfull", SEED, stop_after=0) is None
    run_one(parts, "fedfull", SEED, resume=True)
    a, b = _final_model(whole, "fedfull"), _final_model(parts, "fedfull")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["accepted_clients"] for r in _rows(whole, "fedfull")] == [
        r["accepted_clients"] for r in _rows(parts, "fedfull")
    ]
    assert "no privacy (1 runs with seeded noise)" in report(str(tmp_path / "whole" / "privacy"))


@pytest.mark.parametrize(
    ("method", "extra", "match"),
    [
        ("fedlore", ["secure_aggregation=true"], "candidate"),
        ("fedfull", ["dp.clip_norm=1", "dp.noise_multiplier=1"], "weighting=uniform"),
        ("fedfull", ["secure_aggregation=true", "robust.aggregate=median"], "robust.aggregate"),
        ("fedfull", ["secure_aggregation=true", "transport_dtype=bf16"], "transport_dtype"),
        ("fedfull", ["secure_aggregation=true", "participation=0.25"], "at least 2 clients"),
        ("fedfull", ["secure_aggregation=true", "eval.local=true"], "eval.local"),
        ("fedfull", ["secure_aggregation_degree=3"], "secure_aggregation is off"),
        ("fedlore_fixed", ["secure_aggregation=true"], "secure_aggregation .*init_basis"),
        ("fedlore_sketch", ["weighting=uniform", "dp.clip_norm=1", "dp.epsilon=1e-6"], "raise dp"),
        ("fedfull", ["secure_aggregation=true", "secure_aggregation_threshold=5"], "exceeds the 4"),
        ("fedfull", ["secure_aggregation=true", "secure_aggregation_threshold=1"], "at least 2"),
        ("fedfull", ["secure_aggregation=true", "secure_aggregation_threshold=1.5"], "fraction"),
        ("fedfull", ["secure_aggregation=true", "secure_aggregation_range=1e15"], "fraction bits"),
        ("fedfull", ["secure_aggregation=true", "flower.site_data=true"], "secagg_max_weight"),
        (
            "fedfull",
            [
                "secure_aggregation=true",
                "weighting=uniform",
                "dp.clip_norm=1",
                "dp.noise_multiplier=1",
                "dp.colluding_clients=3",
            ],
            "no honest survivor",
        ),
    ],
)
def test_settings_that_cannot_hold_are_refused_with_the_reason(
    tmp_path: Path, method: str, extra: list[str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):  # ConfigError, or the accountant's refusal
        cfg = _cfg(tmp_path, *extra)
        make_privacy(cfg, make_algorithm(method, cfg), SEED)


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


def test_adaptive_clipping_resumes_from_the_clip_norm_it_reached(tmp_path: Path) -> None:
    """A run with adaptive clipping killed after round 1 resumes with the clip norm the
    checkpoint holds (not dp.clip_norm again), and the rows report each round's C."""
    extra = ("weighting=uniform", "dp.clip_norm=50", "dp.noise_multiplier=0.3",
             "dp.target_quantile=0.5", "dp.clip_lr=0.5")  # fmt: skip
    cfg = _cfg(tmp_path, *extra)
    assert run_one(cfg, "fedfull", SEED, stop_after=1) is None
    _, state, _ = Checkpointer.load(run_dir(cfg, "fedfull", SEED) / "checkpoint.pt")
    reached = state.values["privacy.clip_norm"]
    rows = _rows(cfg, "fedfull")
    assert rows[0]["dp_clip_norm"] == 50.0 and rows[1]["dp_clip_norm"] < 50.0  # all unclipped
    assert reached < rows[1]["dp_clip_norm"]
    run_one(cfg, "fedfull", SEED, resume=True)
    rows = _rows(cfg, "fedfull")
    assert rows[2]["dp_clip_norm"] == pytest.approx(reached)
    assert all(0.0 <= r["dp_unclipped_fraction"] + 1.5 <= 3.0 for r in rows)


def test_adaptive_clipping_needs_enough_count_noise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        _cfg(tmp_path, "weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=2",
             "dp.target_quantile=0.5", "dp.clipped_count_stddev=0.5")  # fmt: skip
    cfg = _cfg(
        tmp_path,
        "weighting=uniform",
        "dp.clip_norm=1",
        "dp.noise_multiplier=8",
        "dp.target_quantile=0.5",
    )  # fmt: skip (default σ_b = m / 20 = 0.2 < 8 / 2)
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        make_privacy(cfg, make_algorithm("fedfull", cfg), SEED)
