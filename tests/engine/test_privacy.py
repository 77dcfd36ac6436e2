"""Secure aggregation and central DP (fedlore.privacy): the algebra, the accountant, and runs.

* Masked uploads sum to the plain sum (exactly in the ring, within the fixed-point error after
  decoding), also when clients drop out after the masks were fixed; a single masked upload is
  uniform whatever the data.
* DP: clipping bounds the whole upload (the sketch's share on its own), the server refuses an
  unclipped upload, ε comes from dp-accounting for the sampling in use and a target ε is met.
* Runs: a secure FedFull run gives the plain run's model; a client failing mid-round leaves the
  round complete; a DP run resumes to the same result; methods that need individual uploads and
  settings that break the bound are refused with the reason.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from fedlore.config import load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.transport import LocalTransport
from fedlore.privacy import (
    MASKED,
    DPSettings,
    Privacy,
    clip_upload,
    epsilon_spent,
    flatten,
    noise_for_epsilon,
    privatize,
    secagg,
)
from fedlore.privacy.aggregation import pair_secret
from fedlore.run import make_algorithm, make_privacy, run_dir, run_one
from fedlore.types import Broadcast, Reply

SEED = 5


def _vectors(k: int, n: int, scale: float = 3.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [scale * torch.randn(n, generator=g, dtype=torch.float64) for _ in range(k)]


@pytest.mark.parametrize("degree", [0, 4])
@pytest.mark.parametrize("dropped", [(), (1, 3)])
def test_masked_uploads_sum_to_the_plain_sum(dropped: tuple[int, ...], degree: int) -> None:
    """All pairs (SecAgg) and a degree-4 ring graph (SecAgg+) over 9 clients, with and without
    two clients dropping out after the masks were fixed."""
    clients = list(range(9))
    graph = secagg.neighbours(clients, degree, seed=3)
    assert all(c in graph[j] for c in clients for j in graph[c])  # symmetric
    assert all(len(graph[c]) == (8 if degree == 0 else 4) for c in clients)
    vecs = _vectors(len(clients), 257)
    secret = 1234
    masked = {c: secagg.mask(secagg.encode(vecs[c]), c, graph[c], 7, secret) for c in clients}
    alive = {c: y for c, y in masked.items() if c not in dropped}
    revealed = {
        c: secagg.reveal(c, [j for j in dropped if j in graph[c]], 7, secret) for c in alive
    }
    ring = secagg.unmask_sum(alive, revealed)
    exact = sum(secagg.encode(vecs[c]).view(np.int64) for c in alive)
    assert np.array_equal(ring.view(np.int64), exact)  # the masks cancel exactly
    plain = sum(vecs[c] for c in alive)
    err = (secagg.decode(ring) - plain).abs().max().item()
    assert err <= len(alive) * 2.0 ** -(secagg.FRACTION_BITS + 1)
    if dropped:  # without the revealed seeds the sum is garbage
        assert not np.array_equal(secagg.unmask_sum(alive, {}).view(np.int64), exact)


def test_a_single_masked_upload_is_uniform_whatever_the_data() -> None:
    """Client 0's masked first entry over 2,000 rounds (fresh pair seeds each): its top byte is
    uniform on 0..255 for all-zero data and for large data alike, and it does not correlate
    with the data."""
    zeros = torch.zeros(4, dtype=torch.float64)
    big = torch.full((4,), 1e5, dtype=torch.float64)
    tops = {}
    for name, x in (("zeros", zeros), ("big", big)):
        enc = secagg.encode(x)
        top = [
            int(secagg.mask(enc, 0, [0, 1, 2], rnd, 99)[0] >> np.uint64(56)) for rnd in range(2000)
        ]
        tops[name] = np.array(top)
        counts = np.bincount(tops[name], minlength=256)
        assert stats.chisquare(counts).pvalue > 1e-4, name
    # the same masks on other data shift every value by the same ring element: the
    # distributions agree (two-sample KS), so the upload tells nothing about which data
    assert stats.ks_2samp(tops["zeros"], tops["big"]).pvalue > 1e-4


def test_encode_refuses_what_it_cannot_represent() -> None:
    with pytest.raises(ValueError, match="NaN or Inf"):
        secagg.encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="too large"):
        secagg.encode(torch.tensor([secagg.LIMIT * 2]))


def _reply(seed: int, n: int = 1) -> Reply:
    g = torch.Generator().manual_seed(seed)
    arrays = {
        "update.w": torch.randn(3, 4, generator=g),
        "sketch.w": 50 * torch.randn(3, 2, generator=g),
    }
    return Reply(arrays, {"num_examples": n, "train_loss": 0.5, "train_s": 0.1})


def _spec(reply: Reply) -> dict[str, Any]:
    return {k: (tuple(v.shape), v.dtype) for k, v in reply.arrays.items()}


@pytest.mark.parametrize(("uniform", "degree"), [(True, 0), (False, 2)])
def test_in_process_round_gives_the_weighted_mean_with_a_dropout(
    uniform: bool, degree: int
) -> None:
    privacy = Privacy(True, None, uniform, 10, 4, 0, SEED, mask_degree=degree)
    replies = {c: _reply(c, n=10 + c) for c in (0, 2, 5, 7)}
    msgs = privacy.configure(3, {c: Broadcast({}, {"round": 3}) for c in replies})
    sent = {c: privatize(r, msgs[c].config, c, 3, SEED) for c, r in replies.items()}
    assert set(sent[0].arrays) == {MASKED} and sent[0].metrics == {
        "train_s": 0.1,
        "num_examples": 1,
    }
    accepted = [(c, None if c == 5 else sent[c]) for c in sorted(sent)]  # client 5 dropped out
    out, metrics = privacy.combine(3, _spec(replies[0]), accepted, torch.device("cpu"))
    assert metrics["secagg_dropped"] == 1 and [c for c, r in out if r is None] == [5]
    alive = [c for c in replies if c != 5]
    w = {c: 1.0 if uniform else float(replies[c].num_examples) for c in alive}
    for key in replies[0].arrays:
        want = sum(w[c] * replies[c].arrays[key].double() for c in alive) / sum(w.values())
        got = next(r for c, r in out if r is not None).arrays[key]
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), want, atol=1e-6)


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
    honest = privatize(_reply(0), msgs[0].config, 0, 0, SEED)
    assert honest.metrics["dp_clipped"] == 1 and "train_loss" not in honest.metrics
    assert privacy.screen(honest) is None
    assert "exceeds dp.clip_norm" in str(privacy.screen(_reply(1)))
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
    """Client 2 fails in round 1 after the round's masks were fixed (its peers masked with it):
    the survivors' revealed seeds unmask the sum and the round completes without it."""
    real = LocalTransport._run_client

    def flaky(self: LocalTransport, rnd: int, cid: int, msg: Broadcast) -> Any:
        if rnd == 1 and cid == 2:
            return RuntimeError("lost connection after the masks were fixed")
        return real(self, rnd, cid, msg)

    monkeypatch.setattr(LocalTransport, "_run_client", flaky)
    extra = ("secure_aggregation=true", "weighting=uniform", "dp.clip_norm=5")
    cfg = _cfg(tmp_path, *extra, "dp.noise_multiplier=0.3")
    summary = run_one(cfg, "fedfull", SEED)
    assert summary is not None and math.isfinite(summary["final_loss"])
    rows = _rows(cfg, "fedfull")
    assert rows[1]["accepted"] == 3 and rows[1]["secagg_dropped"] == 1
    assert rows[0]["accepted"] == rows[2]["accepted"] == 4
    eps = [r["dp_epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    assert summary["dp_noise_multiplier"] == 0.3 and summary["dp_epsilon"] == eps[-1]


def test_dp_run_resumes_to_the_same_result(tmp_path: Path) -> None:
    extra = ("secure_aggregation=true", "weighting=uniform", "dp.clip_norm=1", "dp.epsilon=20")
    whole = _cfg(tmp_path / "whole", *extra)
    parts = _cfg(tmp_path / "parts", *extra)
    run_one(whole, "fedfull", SEED)
    assert run_one(parts, "fedfull", SEED, stop_after=0) is None
    run_one(parts, "fedfull", SEED, resume=True)
    a, b = _final_model(whole, "fedfull"), _final_model(parts, "fedfull")
    assert all(torch.equal(a[k], b[k]) for k in a)
    eps = [r["dp_epsilon"] for r in _rows(whole, "fedfull")]
    assert eps == [r["dp_epsilon"] for r in _rows(parts, "fedfull")]
    assert eps[-1] == pytest.approx(20.0, rel=1e-3)


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
    ],
)
def test_settings_that_cannot_hold_are_refused_with_the_reason(
    tmp_path: Path, method: str, extra: list[str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):  # ConfigError, or the accountant's refusal
        cfg = _cfg(tmp_path, *extra)
        make_privacy(cfg, make_algorithm(method, cfg), SEED)


def test_pair_secret_is_per_run() -> None:
    assert pair_secret(1) != pair_secret(2)
