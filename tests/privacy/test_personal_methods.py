"""FedPer, FedBN, FedRep and MOON under secure aggregation, central and local DP, attacked.

Their servers are FedAvg's (the weighted mean of the uploaded increments), so they are
sum-aggregable. What sets them apart is what a client keeps to itself: FedPer's and FedRep's
head, FedBN's BatchNorm layers (parameters, running statistics, batch counter), MOON's previous
model. Through the real round loop and in-process transport (``personal_bed.py``):

* what leaves a client, in every mode, is the increment of the shared tensors, every entry of
  them and nothing else: the vector it masks, or the arrays the server receives, hold exactly
  the shared tensors' entries; its training loss (MOON's contrastive term and FedRep's two
  phases are in it), its state size and (central DP with secure aggregation, local DP) its clip
  flag stay with it; the server's copy of the kept tensors never moves;
* the secure sum is the plain weighted mean: three rounds at unequal weights, a client sitting
  out one, end in the plain run's server model and clients' kept tensors;
* central DP: the server's noise is σC on exactly the shared coordinates and the model moves by
  exactly (Σ clipped uploads + that noise) / m; under secure aggregation each client's share is
  σC/√m_min on them; the kept tensors are neither clipped nor noised (after the first round
  they are the plain run's, bit for bit), and DP's clip acts on the shared upload's norm;
* local DP: each upload is the client's clipped shared increment plus noise of std σC, which a
  server that reruns the client with the seed cannot remove (under ``dp.reproducible_noise`` it
  removes it exactly);
* a shared BatchNorm's integer ``num_batches_tracked`` stays out of the private upload (it
  would come back truncated, and take a share of the clip norm), in FedAvg's too.

Whole runs (ε as FedAvg's, the rows, ``eval.local`` under the modes) are in
``tests/engine/test_privacy_personal.py``; SecAgg+ on Flower in ``tests/flower/test_secagg.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from personal_bed import (
    CLIP,
    KEPT_STATE,
    METHODS,
    MODES,
    SEED,
    SIGMA,
    D,
    N,
    kept_local,
    make,
    model,
    noise_std_ok,
    norm_of,
    privacy,
    run,
    shared,
)

from fedlore.algorithms.fedavg import FedAvg
from fedlore.algorithms.partial import batchnorm_tensors
from fedlore.privacy import (
    CLEAR_METRICS,
    Contribution,
    SecureSource,
    SeededSource,
    clip_upload,
    flatten,
)
from fedlore.privacy.randomness import SERVER
from fedlore.seeding import DP_NOISE, generator
from fedlore.tensors import load_model_arrays, select
from fedlore.types import Reply

EVERY = [list(range(N))] * 2


def _numel(names: list[str], method: str) -> int:
    sd = model(norm_of(method)).state_dict()
    return sum(sd[k].numel() for k in names)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
def test_only_the_shared_increment_leaves_a_client(
    method: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    algo = make(method, upload_increments=True)
    norm = norm_of(method)
    net = model(norm)
    kept, names = kept_local(algo, net), shared(algo, net)
    if method == "fedbn":  # every BatchNorm tensor, the counter included, stays
        assert set(batchnorm_tensors(net)) == kept
        assert any(k.endswith("num_batches_tracked") for k in kept)
    elif method != "moon":
        assert kept == {"head.weight", "head.bias"}
    trace = run(algo, norm, privacy(mode), EVERY, monkeypatch)
    length = _numel(names, method)
    for (rnd, cid), raw in trace.raw.items():
        assert sorted(raw.arrays) == ["update." + k for k in names]
        assert {"train_loss", "client_state_bytes"} <= raw.metrics.keys()  # measured, kept
        sent = trace.sent[(rnd, cid)]
        if isinstance(sent, Contribution):
            assert "secagg" in mode and sent.vector.numel() == length
            if mode == "secagg":  # nothing but the upload itself is masked
                assert torch.equal(sent.vector, flatten(raw.arrays).cpu())
            assert set(sent.metrics) <= set(CLEAR_METRICS)
        else:
            assert "secagg" not in mode and isinstance(sent, Reply)
            assert sent.arrays.keys() == raw.arrays.keys()
            flag = {"dp_clipped"} if mode == "dp" else set()  # the trusted curator's count
            assert set(sent.metrics) <= {*CLEAR_METRICS, "num_examples", *flag}
        # what the client keeps (its L, MOON's previous model) is in its state, trained
        mine = select(trace.clients[rnd][cid].arrays, KEPT_STATE[method])
        assert mine and set(mine) >= kept
        assert any(not torch.equal(mine[k], net.state_dict()[k]) for k in mine)
    # the server's kept tensors are its initialization after every round; the rest moved
    first, last = trace.states[0].arrays, trace.states[-1].arrays
    assert all(torch.equal(s.arrays["model." + k], first["model." + k])
               for s in trace.states for k in kept)  # fmt: skip
    assert any(not torch.equal(last["model." + k], first["model." + k]) for k in names)
    assert all(r["train_loss"] is None and "client_state_bytes" not in r for r in trace.rows)


@pytest.mark.parametrize("method", METHODS)
def test_the_secure_sum_is_the_plain_weighted_mean(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three rounds, clients weighted by their sizes (32 to 80 examples), client 2 sitting out
    round 1 (FedPer's family then sends it the shared part only, and it lays its own L over
    it): the secure run's server model and each client's kept tensors are the plain run's to
    float32 rounding (the fixed point has 50 fraction bits here)."""
    schedule = [[0, 1, 2, 3], [0, 1, 3], [0, 1, 2, 3]]
    norm = norm_of(method)
    plain = run(make(method), norm, None, schedule, monkeypatch)
    secure = run(make(method, upload_increments=True), norm, privacy("secagg"), schedule,
                 monkeypatch)  # fmt: skip
    assert all(r["secagg_aborted"] == 0 for r in secure.rows)
    want, got = plain.states[-1].arrays, secure.states[-1].arrays
    for k, v in want.items():
        if k.startswith("model.") and v.is_floating_point():
            torch.testing.assert_close(got[k], v, rtol=0, atol=2e-6, msg=k)
    prefix = KEPT_STATE[method]
    for cid in range(N):
        mine, theirs = plain.clients[-1][cid].arrays, secure.clients[-1][cid].arrays
        for k in select(mine, prefix, strip=False):
            torch.testing.assert_close(theirs[k], mine[k], rtol=0, atol=1e-5, msg=k)
    # the weights count: the uniform mean of round 0's uploads is 100 tolerances away
    ups = [flatten(plain.raw[(0, c)].arrays) for c in range(N)]
    uniform = torch.stack(ups).mean(0)
    sizes = torch.tensor([plain.raw[(0, c)].num_examples for c in range(N)], dtype=torch.float64)
    weighted = (sizes[:, None] * torch.stack(ups)).sum(0) / sizes.sum()
    assert float((uniform - weighted).abs().max()) > 100 * 2e-6


class Recording:
    """The secure source, keeping every draw the server makes."""

    secure = True

    def __init__(self) -> None:
        self.draws: dict[tuple[int, int], torch.Tensor] = {}
        self.real = SecureSource()

    def gaussian(self, n: int, std: float, rnd: int, client: int) -> torch.Tensor:
        self.draws[(rnd, client)] = out = self.real.gaussian(n, std, rnd, client)
        return out

    def sample(self, num_clients: int, per_round: int, rnd: int) -> list[int]:
        return list(range(per_round))


@pytest.mark.parametrize("method", METHODS)
def test_central_dp_noises_the_shared_coordinates_only(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP alone: each sent upload is the client's shared increment clipped to C over its own
    norm; the server's one draw has the shared upload's length and std σC; the shared tensors
    move by exactly (Σ sent + draw) / m and the kept ones not at all. The kept tensors are
    neither clipped nor noised: after round 0 (the same broadcast as the plain run's) every
    client keeps the plain run's, bit for bit."""
    norm = norm_of(method)
    algo = make(method, upload_increments=True)
    names = shared(algo, model(norm))
    noise = Recording()
    trace = run(algo, norm, privacy("dp", noise=noise), EVERY, monkeypatch)
    plain = run(make(method), norm, None, EVERY[:1], monkeypatch)
    for rnd in range(2):
        total = torch.zeros(_numel(names, method), dtype=torch.float64)
        for cid in range(N):
            raw, sent = trace.raw[(rnd, cid)], trace.sent[(rnd, cid)]
            assert isinstance(sent, Reply)
            arrays, clipped = clip_upload(dict(raw.arrays), CLIP, 0.5)
            assert all(torch.equal(sent.arrays[k], arrays[k]) for k in arrays)
            assert bool(sent.metrics["dp_clipped"]) == clipped
            assert clipped == (float(flatten(raw.arrays).norm()) > CLIP)
            total += flatten(sent.arrays)
        draw = noise.draws[(rnd, SERVER)]
        assert draw.numel() == total.numel() and noise_std_ok(draw, SIGMA * CLIP)
        before, after = trace.states[rnd].arrays, trace.states[rnd + 1].arrays
        step = flatten({k: after["model." + k].double() - before["model." + k].double()
                        for k in names})  # fmt: skip
        torch.testing.assert_close(step, (total + draw) / N, rtol=0, atol=1e-6)
        assert all(torch.equal(after[k], before[k]) for k in before if k[6:] not in names)
    for cid in range(N):  # round 0: the kept tensors as trained, untouched by DP
        mine, theirs = plain.clients[0][cid].arrays, trace.clients[0][cid].arrays
        prefix = KEPT_STATE[method]
        assert all(torch.equal(theirs[k], v) for k, v in select(mine, prefix, False).items())


@pytest.mark.parametrize("method", METHODS)
def test_secure_central_dp_shares_cover_the_shared_coordinates(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Secure aggregation with central DP: each client masks its clipped shared increment plus
    a share of std σC/√m_min (m_min = 3 of 4) on each of its coordinates, and nothing else."""
    norm = norm_of(method)
    algo = make(method, upload_increments=True)
    priv = privacy("secagg+dp")
    share = SIGMA * CLIP / math.sqrt(priv.min_survivors(N))
    assert priv.min_survivors(N) == 3 and priv.noise_share(N) == pytest.approx(share)
    trace = run(algo, norm, priv, EVERY[:1], monkeypatch)
    residuals = []
    for cid in range(N):
        sent = trace.sent[(0, cid)]
        assert isinstance(sent, Contribution) and sent.extras.numel() == 0
        clipped = flatten(clip_upload(dict(trace.raw[(0, cid)].arrays), CLIP, 0.5)[0])
        residuals.append(sent.vector - clipped)
    assert noise_std_ok(torch.cat(residuals), share)
    assert not noise_std_ok(torch.cat(residuals), SIGMA * CLIP)  # the check tells σC apart


@pytest.mark.parametrize("method", METHODS)
def test_local_dp_noise_is_sigma_c_and_a_seeded_rerun_cannot_remove_it(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local DP alone: every upload the server receives is the client's clipped shared increment
    plus noise of std σC. The attacker reruns each client with the run seed (the same
    increment) and subtracts what the seed determines for its noise: noise of std √2 σC stays,
    and two runs receive other uploads; under ``dp.reproducible_noise`` the same attack gives
    the clipped increment back."""
    norm = norm_of(method)
    uploads = {}
    for name, noise in (("one", None), ("two", None), ("seeded", SeededSource(SEED))):
        algo = make(method, upload_increments=True)
        trace = run(algo, norm, privacy("ldp", noise=noise), EVERY[:1], monkeypatch)
        uploads[name] = {c: trace.sent[(0, c)] for c in range(N)}
        truth = {c: flatten(clip_upload(dict(trace.raw[(0, c)].arrays), CLIP, 0.5)[0])
                 for c in range(N)}  # fmt: skip
        for c, sent in uploads[name].items():
            assert isinstance(sent, Reply) and "dp_clipped" not in sent.metrics
            got = flatten(sent.arrays)
            g = generator(SEED, DP_NOISE, 0, c)  # what the seed determines for this client
            seeded = SIGMA * CLIP * torch.randn(got.numel(), generator=g, dtype=torch.float64)
            if name == "seeded":
                assert (got - seeded - truth[c]).abs().max().item() < 1e-5
            else:
                assert noise_std_ok(got - truth[c], SIGMA * CLIP)
                assert noise_std_ok(got - seeded - truth[c], math.sqrt(2) * SIGMA * CLIP)
    one, two = uploads["one"][0], uploads["two"][0]
    assert isinstance(one, Reply) and isinstance(two, Reply)
    assert not torch.equal(flatten(one.arrays), flatten(two.arrays))


@pytest.mark.parametrize("mode", ["secagg", "dp"])
@pytest.mark.parametrize("method", ["fedper", "fedavg"])
def test_an_integer_buffer_stays_out_of_the_private_upload(
    method: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedPer's body and FedAvg's model with BatchNorm: the private upload holds the floating
    tensors only (the running statistics are averaged as they would be in the plain run), and
    the server's ``num_batches_tracked`` stays where it started, which the plain run advances by
    the steps. Before, the counter's increment (4) travelled in the upload: under secure
    aggregation its mean came back truncated (3.999... -> 3), under DP it took most of a clip
    norm of 0.5 (and came back clipped to 0)."""
    hidden = [12]
    algo = make(method) if method != "fedavg" else FedAvg.of(lr=0.05, local_steps=4, batch_size=16)
    private = type(algo).of(lr=0.05, local_steps=4, batch_size=16, upload_increments=True)
    counters = [k for k in model("batch", hidden).state_dict() if k.endswith("num_batches_tracked")]
    assert counters == ["body.1.num_batches_tracked"]
    plain = run(algo, "batch", None, EVERY, monkeypatch, hidden)
    secure = run(private, "batch", privacy(mode), EVERY, monkeypatch, hidden)
    for (rnd, cid), raw in secure.raw.items():
        assert not any(k.endswith("num_batches_tracked") for k in raw.arrays)
        assert "update.body.1.running_mean" in raw.arrays
        assert "update.body.1.num_batches_tracked" in plain.raw[(rnd, cid)].arrays
        sent = secure.sent[(rnd, cid)]
        if isinstance(sent, Reply):  # DP alone: the clip covers exactly the floating upload
            norm = float(flatten(raw.arrays).norm())
            assert float(flatten(sent.arrays).norm()) == pytest.approx(min(norm, CLIP))
    key = "model.body.1.num_batches_tracked"
    assert int(plain.states[-1].arrays[key]) == 2 * 4
    assert int(secure.states[-1].arrays[key]) == 0
    if mode == "secagg":
        want, got = plain.states[-1].arrays, secure.states[-1].arrays
        for k in ("model.body.1.running_mean", "model.body.1.running_var", "model.body.0.weight"):
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-6)


@pytest.mark.parametrize("method", ["fedavg", "fedper"])
def test_dp_noise_never_leaves_a_running_variance_below_zero(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared BatchNorm's running variance gets DP's noise like any coordinate: at σ = 50 (std
    25 per coordinate against variances near 1) about half its entries would fall below 0 and
    BatchNorm would score with NaN. The server clamps them at 0 (post-processing, no privacy
    spent); every other tensor keeps the noised value, negatives included. The noise is seeded
    (the clamp, not the noise, is under test), so the case is the same every time."""
    hidden = [12]
    algo = make(method) if method != "fedavg" else FedAvg.of(lr=0.05, local_steps=4, batch_size=16)
    private = type(algo).of(lr=0.05, local_steps=4, batch_size=16, upload_increments=True)
    priv = privacy("dp", SeededSource(SEED), sigma=50.0)
    trace = run(private, "batch", priv, EVERY, monkeypatch, hidden)
    for state in trace.states[1:]:
        var = state.arrays["model.body.1.running_var"]
        assert bool((var >= 0).all()) and int((var == 0).sum()) >= 1  # clamped, not luck
        assert float(state.arrays["model.body.1.running_mean"].min()) < 0  # noised, not clamped
    net = model("batch", hidden)
    load_model_arrays(net, select(trace.states[-1].arrays, "model."), strict=False)
    net.eval()
    assert bool(torch.isfinite(net(torch.randn(5, D))).all())
