"""The canary clients of the empirical privacy audit (fedlore.privacy.canaries, ``dp.audit``).

What the audit must not break, attacked: the canaries enter the noised sum and never its count,
never reach a real client, leave the real sample, the DP noise and the accountant's ε as they
were (a run with and without canaries under seeded noise differs by exactly C Σ c_i / n);
their directions are isotropic unit vectors from OS entropy (not the run seed), inserted at a
ratio never above the real clients'; the all-iterates statistic sees each round's change; a
resumed run keeps its canaries; the settings and methods the audit cannot measure are refused.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from fedlore.config import ConfigError, load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import build, run_one
from fedlore.experiment_privacy import PrivacyWarning
from fedlore.privacy.canaries import (
    KEY,
    Canaries,
    _interval,
    canaries_per_round,
    directions,
    flat_model,
    upload_model_keys,
)
from fedlore.privacy.empirical import Fit, estimate_epsilon, fit, null_std, pair_epsilon
from fedlore.privacy.empirical_error import epsilon_interval
from fedlore.results.report import report
from fedlore.types import Broadcast, Reply, State

# these runs use a handful of canaries to stay fast, which the run warns about (AuditWarning,
# tested on its own below, where pytest.warns still records it)
pytestmark = pytest.mark.filterwarnings("ignore::fedlore.experiment_privacy.AuditWarning")

SEED = 3


def _cfg(out: Path, *extra: str) -> Any:
    return load_config(
        None,
        [
            "name=audit",
            "num_clients=4",
            "rounds=3",
            "local_steps=2",
            "batch_size=16",
            "lr=1e-2",
            "model.kwargs={hidden: [16]}",
            "partition.min_size=10",
            "progress=false",
            "weighting=uniform",
            "algorithms=[fedavg]",
            "dp.clip_norm=0.5",
            "dp.noise_multiplier=0.3",
            f"output_dir={out}",
            *extra,
        ],
    )


def _canaries(count: int = 6, unseen: int = 4, dim: int = 50, per_round: int = 2) -> Canaries:
    start = torch.zeros(dim, dtype=torch.float64)
    pairs = [("update.w", "w")]
    return Canaries(count, unseen, per_round, pairs, start, lambda s: s.arrays)


def _state(vector: torch.Tensor) -> State:
    return State(arrays={"w": vector.clone()})


# ---------------------------------------------------------------- directions and sampling


def test_directions_are_isotropic_unit_vectors_of_the_key() -> None:
    """Unit rows whose cosine with a fixed vector has mean 0 and variance 1/d (the exact null
    the final-model estimate uses: null_std), the same rows for the same key only."""
    d, rows = 100, 6000
    key = bytes(range(32))
    g = directions(key, rows, d).double()
    assert torch.allclose(g.norm(dim=1), torch.ones(rows, dtype=torch.float64), atol=1e-6)
    fixed = torch.linspace(-1.0, 2.0, d, dtype=torch.float64)
    cos = (g @ fixed / fixed.norm()).numpy()
    se_var = math.sqrt(2.0 / rows) / d  # sd of the sample variance of ~N(0, 1/d) values
    assert abs(cos.mean()) < 5 * null_std(d) / math.sqrt(rows)
    assert abs(cos.var() - null_std(d) ** 2) < 5 * se_var
    coords = g.numpy()
    assert np.abs(coords.mean(axis=0)).max() < 6 * null_std(d) / math.sqrt(
        rows
    )  # no favourite axis
    assert torch.equal(directions(key, 3, d), directions(key, rows, d)[:3])
    assert not torch.equal(directions(bytes(32), 3, d), directions(key, 3, d))


def _reference_directions(key: bytes, rows: int, dim: int) -> np.ndarray:
    """The directions by hand, in float64, from the definition: the AES-256-CTR stream of
    ``key`` (counter block 0) read as one run of little-endian 32-bit words, ``2·⌈d/2⌉`` a row;
    the top 24 bits ``k`` of a word give the uniform ``(k + 1/2) 2⁻²⁴``; a row's first
    ``⌈d/2⌉`` uniforms are the radii ``√(−2 ln u)``, the next the angles ``2π u``, its
    coordinates ``r cos θ`` then ``r sin θ`` (the last one dropped for an odd d), normalized."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    half = (dim + 1) // 2
    stream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    raw = stream.update(bytes(4 * 2 * half * rows)) + stream.finalize()
    words = np.array(
        [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)], dtype=np.int64
    ).reshape(rows, 2 * half)
    u = ((words // 256).astype(np.float64) + 0.5) / 2.0**24
    radius, angle = np.sqrt(-2.0 * np.log(u[:, :half])), 2.0 * math.pi * u[:, half:]
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=1)[:, :dim]
    return z / np.linalg.norm(z, axis=1, keepdims=True)


@pytest.mark.parametrize(("rows", "dim"), [(600, 7), (3, 8), (1, 1)])
def test_directions_are_the_normalized_box_muller_gaussians_of_the_keys_stream(
    rows: int, dim: int
) -> None:
    """Every row against :func:`_reference_directions` (float64, from the stream by hand):
    across blocks of 256 rows and a last partial one (600 rows), an odd dimension (a pair's
    sine dropped), an even one and d = 1 (±1). float32 rows of norm 1 to rounding, on the CPU;
    the global generators' state does not enter (the run seed cannot reach the directions), nor
    torch's default dtype and device."""
    key = bytes(range(100, 132))
    torch.manual_seed(0)
    np.random.seed(0)
    got = directions(key, rows, dim)
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    assert tuple(got.shape) == (rows, dim)
    want = _reference_directions(key, rows, dim)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=5e-6)
    np.testing.assert_allclose(got.double().norm(dim=1).numpy(), 1.0, rtol=0, atol=1e-6)
    torch.manual_seed(12345)
    np.random.seed(12345)
    torch.randn(10)  # a run seeded otherwise, its generators moved
    assert torch.equal(directions(key, rows, dim), got)
    if dim == 1:
        assert set(got.flatten().tolist()) <= {-1.0, 1.0}
    # float32 on the CPU whatever torch's defaults (the memory limit counts 4-byte entries)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            again = directions(key, rows, dim)
    finally:
        torch.set_default_dtype(default)
    assert again.dtype == torch.float32 and again.device.type == "cpu"
    assert torch.equal(again, got)


def test_the_directions_are_a_function_of_the_key_alone() -> None:
    """The same key gives the same rows (a prefix for fewer rows, whatever the row count's
    split into blocks); each of the 32 key bytes matters, and another key's rows are
    unrelated to these (cosines of order 1/√d)."""
    key = bytes(range(32))
    rows = directions(key, 300, 64)
    assert torch.equal(directions(key, 300, 64), rows)
    assert torch.equal(directions(key, 257, 64), rows[:257])
    for at in (0, 15, 31):
        other = bytearray(key)
        other[at] ^= 1
        moved = directions(bytes(other), 300, 64).double()
        assert float((moved * rows.double()).sum(dim=1).abs().max()) < 6 / math.sqrt(64)


def test_each_audit_draws_its_key_from_os_entropy(tmp_path: Path) -> None:
    """Two builds of the same seed get different canaries: nothing of them comes from the seed."""
    cfg = _cfg(tmp_path, "dp.audit.canaries=8")
    a, b = build(cfg, "fedavg", SEED), build(cfg, "fedavg", SEED)
    assert a.privacy is not None and b.privacy is not None
    ca, cb = a.privacy.canaries, b.privacy.canaries
    assert ca is not None and cb is not None
    assert len(ca.key) == 32 and ca.key != cb.key
    assert not torch.equal(ca.vectors, cb.vectors)
    assert torch.equal(ca.start, cb.start)  # θ_0 is the seed's model


@pytest.mark.parametrize(
    ("count", "clients", "per_round", "expected"),
    [
        (200, 10, 10, 200),
        (200, 10, 5, 100),
        (7, 10, 3, 2),
        (10, 10, 1, 1),
        (9, 30, 7, 2),
        (7, 10, 5, 3),  # 3.5 rounds down, never up
        (2, 10, 1, 0),  # none: the audit refuses it (fewer than 1 per round), never 1
    ],
)
def test_canaries_are_inserted_at_most_at_the_real_clients_ratio(
    count: int, clients: int, per_round: int, expected: int
) -> None:
    got = canaries_per_round(count, clients, per_round)
    assert got == expected
    assert got / count <= min(1.0, per_round / clients) + 1e-12


def test_injection_adds_clip_norm_uploads_of_a_fresh_sample() -> None:
    can = _canaries(count=6, per_round=2)
    seen: dict[int, int] = {}
    for _ in range(3000):
        total = torch.zeros(can.dimension, dtype=torch.float64)
        chosen = can.inject(total, 0.7)
        assert len(set(chosen)) == 2
        expected = sum(
            0.7 * can.vectors[i].double() / can.vectors[i].double().norm() for i in chosen
        )
        assert torch.allclose(total, expected, atol=1e-6)  # float32 products
        for i in chosen:
            seen[i] = seen.get(i, 0) + 1
    # each canary in a third of the rounds (sd of a count: sqrt(3000 · 1/3 · 2/3) ≈ 26)
    assert sorted(seen) == list(range(6))
    assert all(abs(n - 1000) < 6 * 26 for n in seen.values())
    one = _canaries(count=6, per_round=1)
    total = torch.zeros(one.dimension, dtype=torch.float64)
    one.inject(total, 0.7)
    assert float(total.norm()) == pytest.approx(0.7, rel=1e-6)  # the clip norm


def test_uploads_must_be_changes_of_model_tensors() -> None:
    model = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    spec = {"update.w": ((3, 2), torch.float32), "update.b": ((2,), torch.float32)}
    assert upload_model_keys(spec, model) == [("update.b", "b"), ("update.w", "w")]
    with pytest.raises(ValueError, match=r"'update.w' \[2, 3\].*model deltas"):
        upload_model_keys({"update.w": ((2, 3), torch.float32)}, model)
    with pytest.raises(ValueError, match=r"'lora\.A'"):
        upload_model_keys({"lora.A": ((2,), torch.float32)}, model)


def test_an_upload_names_its_model_tensor_after_the_first_dot() -> None:
    """``<role>.<name>``: the name is everything after the role, dots included (every real
    model's tensors are dotted, ``body.0.weight``), not the last part nor the last two; a key
    without a role is refused as not a model change, with the whole message."""
    model = {
        "body.0.weight": torch.zeros(2, 2), "body.0.bias": torch.zeros(2),
        "weight": torch.zeros(2, 2), "0.weight": torch.zeros(2, 2), "bias": torch.zeros(2),
    }  # fmt: skip
    spec = {
        "update.body.0.weight": ((2, 2), torch.float32),
        "update.body.0.bias": ((2,), torch.float32),
    }
    assert upload_model_keys(spec, model) == [
        ("update.body.0.bias", "body.0.bias"), ("update.body.0.weight", "body.0.weight"),
    ]  # fmt: skip
    with pytest.raises(ValueError) as info:
        upload_model_keys({"w": ((3,), torch.float32)}, model)
    assert str(info.value) == (
        "its upload 'w' [3] is not the change of a global model tensor 'w' of that shape; the "
        "canary audit compares the model's change with each canary's upload, so it needs a "
        "method whose clients upload model deltas (such as fedavg, fedfull, fedprox)"
    )


def test_the_model_is_laid_out_in_upload_order_in_float64() -> None:
    """``flat_model``: the global tensors named by ``pairs``, each flattened row-major, in the
    pairs' order (the uploads' sorted keys), float64; tensors no upload names are left out."""
    w = torch.arange(6, dtype=torch.float32).reshape(3, 2) / 3
    model = {"w": w, "b": torch.tensor([-1.5, 2.25], dtype=torch.float32), "other": torch.ones(4)}
    spec = {"update.w": ((3, 2), torch.float32), "update.b": ((2,), torch.float32)}
    flat = flat_model(model, upload_model_keys(spec, model))
    want = [-1.5, 2.25, *[float(x) for x in w.double().flatten()]]
    assert flat.dtype == torch.float64 and flat.tolist() == want
    flat = flat_model(model, [("update.w", "w"), ("update.b", "b")])
    assert flat.tolist() == [*want[2:], *want[:2]]


def test_cosines_and_uploads_divide_by_each_directions_own_norm() -> None:
    """The float32 rows are unit vectors only up to rounding, so the cosines and the uploads
    use each row's own norm: with rows of norms 0.5 to 3, the cosines are still
    ``⟨c_i, v⟩ / (‖c_i‖ ‖v‖)`` and each inserted canary adds ``C c_i / ‖c_i‖`` (norm C), by
    hand."""
    can = _canaries(count=4, unseen=2, dim=50, per_round=4)
    scale = torch.tensor([0.5, 1.0, 2.0, 3.0, 0.75, 1.5], dtype=torch.float32)
    can.vectors = can.vectors * scale[:, None]
    can.inverse_norms = 1.0 / can.vectors.double().norm(dim=1)
    g = can.vectors.double()
    v = torch.randn(50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = (g @ v) / (g.norm(dim=1) * v.norm())
    torch.testing.assert_close(can.cosines(3.0 * v), want, rtol=0, atol=1e-6)
    total = torch.zeros(50, dtype=torch.float64)
    assert can.inject(total, 0.7) == [0, 1, 2, 3]  # every canary: per_round = count
    torch.testing.assert_close(total, (0.7 * g[:4] / g[:4].norm(dim=1)[:, None]).sum(0),
                               rtol=0, atol=1e-6)  # fmt: skip


# ---------------------------------------------------------------- the statistics


def test_the_all_iterates_statistic_takes_each_rounds_change() -> None:
    """Round 1 moves the model along canary 0, round 2 (on top) along canary 1, round 3 not at
    all: each canary's largest per-round cosine is ~1, the unseen ones' near 0, and the
    unmoved round is not counted. The cumulative change would give both canaries 1/√2."""
    can = _canaries(count=3, unseen=3, dim=400)
    g = can.vectors.double()
    after1 = 2.0 * g[0]
    after2 = after1 + 3.0 * g[1]
    for vec in (after1, after2, after2):
        can.observe(_state(vec))
    assert can.rounds == 2
    assert float(can.best[0]) == pytest.approx(1.0, abs=1e-6)
    assert float(can.best[1]) == pytest.approx(1.0, abs=1e-6)
    assert float(can.best[3:].abs().max()) < 6 * null_std(400)
    final = can.cosines(after2)  # the cumulative change: 2/√13 for orthogonal directions
    exact = float(g[0] @ after2 / after2.norm())  # the random directions overlap by ~1/√d
    assert float(final[0]) == pytest.approx(exact, abs=1e-6)
    assert float(final[0]) < 0.8  # far below the per-round statistic's 1


def test_the_summary_fits_the_inserted_cosines_against_the_exact_null() -> None:
    can = _canaries(count=20, unseen=20, dim=2000)
    out = can.summary(1e-5)
    assert "dp_audit_epsilon" not in out  # the model never moved: nothing to estimate
    assert out["dp_audit_null_std"] == pytest.approx(1 / math.sqrt(2000))
    g = can.vectors.double()
    can.observe(_state(g[:20].sum(dim=0)))  # every canary inserted once, no noise
    out = can.summary(1e-5)
    assert out["dp_audit_cosine_mean"] == pytest.approx(1 / math.sqrt(20), rel=0.1)
    assert abs(out["dp_audit_unseen_cosine_mean"]) < 5 * null_std(2000) / math.sqrt(20)
    assert out["dp_audit_epsilon"] > 20 and out["dp_audit_epsilon_all_iterates"] > 20
    for key in ("dp_audit_epsilon", "dp_audit_epsilon_all_iterates"):  # the intervals
        assert out[f"{key}_low"] <= out[key] <= out[f"{key}_high"]
        assert out[f"{key}_low"] < out[f"{key}_high"]
    assert out["dp_audit_level"] == 0.95
    exact = epsilon_interval(  # the final-model null is exact: N(0, 1/d), not fitted
        Fit(out["dp_audit_cosine_mean"], out["dp_audit_cosine_std"], 20),
        Fit(0.0, null_std(2000), 2000),
        1e-5,
        null_exact=True,
    )
    assert (exact.low, exact.high) == (out["dp_audit_epsilon_low"], out["dp_audit_epsilon_high"])
    assert (out["dp_audit_canaries"], out["dp_audit_unseen"]) == (20, 20)


def test_the_summary_is_the_estimate_of_the_models_change_since_the_start() -> None:
    """A model that starts away from 0 and moves by less than 1 (a small ε): every number of the
    summary from the cosines of θ_T − θ_0 by hand: the inserted ones' fit against the exact
    null N(0, 1/d), the unseen ones' fit, the maxima's estimate against the unseen maxima."""
    d, k = 400, 30
    can = Canaries(k, 30, 5, [("update.w", "w")], torch.linspace(-1, 1, d, dtype=torch.float64),
                   lambda s: s.arrays, key=bytes(range(32)))  # fmt: skip
    g = can.vectors.double()
    noise = torch.randn(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    change = 0.4 * g[:k].sum(dim=0) / math.sqrt(k) + noise
    change = 0.5 * change / change.norm()
    can.observe(_state(can.start + change))
    out = can.summary(1e-5)
    cos = (g @ change) / (g.norm(dim=1) * change.norm())
    seen, unseen = fit(cos[:k].numpy()), fit(cos[k:].numpy())
    eps = pair_epsilon(seen.mean, seen.std, 1 / math.sqrt(d), 1e-5)
    assert 0 < eps < 20  # the premise: a finite estimate that a wrong null or change moves
    assert out["dp_audit_dimension"] == d
    assert out["dp_audit_epsilon"] == pytest.approx(eps, rel=1e-3)
    assert out["dp_audit_cosine_mean"] == pytest.approx(seen.mean, abs=1e-5)
    assert out["dp_audit_cosine_std"] == pytest.approx(seen.std, abs=1e-5)
    assert out["dp_audit_unseen_cosine_mean"] == pytest.approx(unseen.mean, abs=1e-5)
    assert out["dp_audit_unseen_cosine_std"] == pytest.approx(unseen.std, abs=1e-5)
    best, best_null = fit(cos[:k].numpy()), fit(cos[k:].numpy())  # one round: maxima = cosines
    assert out["dp_audit_epsilon_all_iterates"] == pytest.approx(
        estimate_epsilon(best, best_null, 1e-5), rel=1e-3
    )
    assert out["dp_audit_max_cosine_mean"] == pytest.approx(best.mean, abs=1e-5)
    assert out["dp_audit_max_cosine_std"] == pytest.approx(best.std, abs=1e-5)
    assert out["dp_audit_unseen_max_cosine_mean"] == pytest.approx(best_null.mean, abs=1e-5)
    assert out["dp_audit_unseen_max_cosine_std"] == pytest.approx(best_null.std, abs=1e-5)
    counts = ("dp_audit_canaries", "dp_audit_unseen", "dp_audit_canaries_per_round")
    assert tuple(out[key] for key in counts) == (k, 30, 5)


def test_without_unseen_canaries_the_summary_has_the_final_model_estimate_only() -> None:
    """No unseen canaries (dp.audit.unseen = 0): the final-model estimate against the exact
    null, and no all-iterates estimate (it needs the unseen canaries' maxima for its null) nor
    unseen cosines, after rounds that moved the model."""
    can = _canaries(count=20, unseen=0, dim=2000)
    g = can.vectors.double()
    can.observe(_state(g[:20].sum(dim=0)))
    assert can.rounds == 1
    out = can.summary(1e-5)
    assert out["dp_audit_epsilon"] > 20 and out["dp_audit_unseen"] == 0
    assert not [key for key in out if "unseen_" in key or "all_iterates" in key or "max_" in key]


def test_the_interval_is_the_fits_projection_or_infinite_when_the_cosines_do_not_vary() -> None:
    """``_interval``: the interval of :func:`epsilon_interval` with the null exact only when
    asked (the final-model null ``N(0, 1/d)``; the all-iterates null is fitted by default),
    low end first; both ends inf when the seen cosines do not vary (std 0, or NaN: the estimate
    is inf, every canary told apart)."""
    seen, null = Fit(0.3, 0.05, 20), Fit(0.0, 0.05, 20)  # at δ = 1e-4, not the runs' 1e-5
    fitted = epsilon_interval(seen, null, 1e-4)
    exact = epsilon_interval(seen, null, 1e-4, null_exact=True)
    assert fitted.low < exact.low <= exact.high < fitted.high  # the premise: they differ
    assert _interval(seen, null, 1e-4) == (fitted.low, fitted.high)
    assert _interval(seen, null, 1e-4, exact=True) == (exact.low, exact.high)
    # spreads of 5e-8 vary all the same: the pair scaled by 1e-6, the same interval (it depends
    # on the spreads in units of the shift only), not the shortcut's
    small = _interval(Fit(3e-7, 5e-8, 20), Fit(0.0, 5e-8, 20), 1e-4, exact=True)
    assert small == pytest.approx((exact.low, exact.high), rel=1e-9)
    for flat in (0.0, math.nan):
        for exact_null in (False, True):
            got = _interval(Fit(0.3, flat, 20), null, 1e-4, exact=exact_null)
            assert got == (math.inf, math.inf)


def test_the_canaries_refuse_counts_they_cannot_audit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Canaries`` itself (the config checks come first in a run): at least 2 canaries, 0 or at
    least 2 unseen, 1 to k per round, at most MAX_DIRECTION_ENTRIES direction entries (k + k')
    d; each bound accepted, one past it refused with its whole message. A built audit has its
    k + k' unit directions, no round seen, θ_0 as the last model (a copy) and maxima of −inf."""
    import fedlore.privacy.canaries as module

    def make(count: int, unseen: int, per_round: int, dim: int = 5) -> Canaries:
        start = torch.zeros(dim, dtype=torch.float64, device="cpu")
        return Canaries(count, unseen, per_round, [("update.w", "w")], start, lambda s: s.arrays)

    def refused(count: int, unseen: int, per_round: int, dim: int = 5) -> str:
        with pytest.raises(ValueError) as info:
            make(count, unseen, per_round, dim)
        return str(info.value)

    assert refused(1, 0, 1) == "the audit needs at least 2 canaries, got 1"
    assert refused(1, 0, 1) == refused(1, 4, 1)  # the count is checked first
    assert refused(2, 1, 1) == "unseen canaries: 0, or at least 2 for a fit; got 1"
    assert refused(2, -1, 1) == "unseen canaries: 0, or at least 2 for a fit; got -1"
    assert refused(3, 0, 0) == "0 canaries per round of 3: need 1 to 3"
    assert refused(3, 0, 4) == "4 canaries per round of 3: need 1 to 3"
    for count, unseen, per_round in ((2, 0, 1), (2, 2, 2), (3, 5, 3), (3, 0, 1)):
        can = make(count, unseen, per_round)
        assert tuple(can.vectors.shape) == (count + unseen, 5)
        assert can.rounds == 0 and tuple(can.best.shape) == (count + unseen,)
        assert can.best.dtype == torch.float64 and bool((can.best == -math.inf).all())
        assert torch.equal(can.previous, can.start) and can.previous is not can.start
        torch.testing.assert_close(
            can.inverse_norms, 1 / can.vectors.double().norm(dim=1), rtol=1e-15, atol=0
        )
    # the float32 rows are unit vectors only up to rounding: their inverse norms scale them to
    # norm 1 in float64 (a fixed key whose rows are not all of norm exactly 1)
    can = Canaries(4, 2, 1, [("update.w", "w")], torch.zeros(50, dtype=torch.float64),
                   lambda s: s.arrays, key=bytes(range(32)))  # fmt: skip
    norms = can.vectors.double().norm(dim=1)
    assert bool((norms != 1).any())
    scaled = (can.vectors.double() * can.inverse_norms[:, None]).norm(dim=1)
    torch.testing.assert_close(scaled, torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-15)
    with torch.device("meta"):  # the audit's state stays on the CPU whatever torch's default
        can = make(3, 2, 1)
    assert {x.device.type for x in (can.vectors, can.inverse_norms, can.best, can.previous)} == {
        "cpu"
    }
    monkeypatch.setattr(module, "MAX_DIRECTION_ENTRIES", 40)
    assert make(3, 5, 1, dim=5).dimension == 5  # 40 entries: the limit itself
    assert refused(3, 5, 1, dim=6) == (
        "3 + 5 canaries of dimension 6 are 48 direction entries, above the 40 (1 GiB) kept in "
        "memory; use fewer canaries or unseen canaries"
    )
    monkeypatch.setattr(module, "MAX_DIRECTION_ENTRIES", 3999)  # thousands separated
    assert refused(2000, 2000, 1, dim=1) == (
        "2000 + 2000 canaries of dimension 1 are 4,000 direction entries, above the 3,999 (1 GiB) "
        "kept in memory; use fewer canaries or unseen canaries"
    )


def test_the_audit_record_restores_the_same_canaries() -> None:
    can = _canaries(count=4, unseen=2, dim=30)
    can.observe(_state(can.vectors[0].double()))
    state = State(arrays={"w": can.vectors[0].double()}, values=can.record())
    again = _canaries(count=4, unseen=2, dim=30)
    assert again.key != can.key
    again.restore(state)
    assert again.key == can.key and torch.equal(again.vectors, can.vectors)
    assert torch.equal(again.best, can.best) and again.rounds == 1
    assert torch.equal(again.previous, can.previous)
    with pytest.raises(ValueError) as info:
        again.restore(State(arrays=state.arrays))
    assert str(info.value) == (
        "the checkpoint holds no canary key (dp.audit): its canaries' directions are lost, so "
        "the audit cannot go on; start the run over without --resume"
    )
    bad = dict(state.values)
    bad[KEY] = "00"
    with pytest.raises(ValueError) as info:
        again.restore(State(arrays=state.arrays, values=bad))
    assert str(info.value) == (
        "the checkpoint's canary audit record does not match dp.audit (key of 1 bytes, 6 "
        "canaries for 4 + 2)"
    )
    bad = {**state.values, KEY: "not hex"}
    with pytest.raises(ValueError, match=r"^the checkpoint's canary audit record is damaged: "):
        again.restore(State(arrays=state.arrays, values=bad))


# ---------------------------------------------------------------- in a run


class _Spy(LocalTransport):
    """LocalTransport that records every message sent and every reply."""

    log: ClassVar[list[tuple[int, dict[int, Broadcast], dict[int, Any]]]] = []

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out = super().send(rnd, messages)
        _Spy.log.append((rnd, messages, out))
        return out


def _rows(cfg: Any) -> list[dict[str, Any]]:
    path = run_dir(cfg, "fedavg", SEED) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _model(cfg: Any) -> tuple[torch.Tensor, State]:
    _, state, _ = Checkpointer.load(run_dir(cfg, "fedavg", SEED) / "checkpoint.pt")
    model = {k[6:]: v for k, v in state.arrays.items() if k.startswith("model.")}
    return torch.cat([model[k].reshape(-1).double() for k in sorted(model)]), state


def test_canaries_join_the_sum_not_its_count_and_leave_clients_noise_and_epsilon_alone(
    tmp_path: Path,
) -> None:
    """Seeded noise (dp.reproducible_noise) makes the run without canaries replayable: with 8
    canaries (all inserted: full participation) round 0 moves the model by exactly
    C Σ c_i / n (n = 4 real clients) more. Counting the canaries (n + 8), dropping the clip norm,
    or drawing the noise differently breaks the equality. No message goes to a canary, the
    real clients' round-0 replies are the same, and so is every ε."""
    seeded = ("rounds=1", "dp.reproducible_noise=true")
    plain = _cfg(tmp_path / "plain", *seeded)
    audit = _cfg(tmp_path / "audit", *seeded, "dp.audit.canaries=8", "dp.audit.unseen=0")
    logs = []
    for cfg in (plain, audit):
        _Spy.log = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrivacyWarning)  # seeded noise: no privacy
            summary = run_one(cfg, "fedavg", SEED, make_transport=_Spy)
        assert summary is not None
        logs.append(list(_Spy.log))
    (_, sent0, got0), (_, sent1, got1) = logs[0][0], logs[1][0]
    assert sorted(sent1) == sorted(sent0) == [0, 1, 2, 3]  # real clients only
    for c in sent0:
        assert torch.equal(
            sent0[c].arrays["model.body.0.weight"], sent1[c].arrays["model.body.0.weight"]
        )
        for k in got0[c].arrays:
            assert torch.equal(got0[c].arrays[k], got1[c].arrays[k])
    without, _ = _model(plain)
    with_canaries, state = _model(audit)
    keys = bytes.fromhex(str(state.values[KEY]))
    g = directions(keys, 8, without.numel()).double()
    g = g / g.norm(dim=1, keepdim=True)
    expected = 0.5 * g.sum(dim=0) / 4  # C Σ c_i / n_real, in sorted upload order
    assert torch.allclose(with_canaries - without, expected, atol=2e-6)
    assert not torch.allclose(with_canaries - without, 0.5 * g.sum(dim=0) / 12, atol=2e-6)
    assert [r["dp_epsilon"] for r in _rows(plain)] == [r["dp_epsilon"] for r in _rows(audit)]


def test_canaries_leave_the_real_clients_sample_alone(tmp_path: Path) -> None:
    """Under seeded sampling (2 of 4 clients a round) the same clients are drawn in every round
    with and without canaries (which are drawn from OS entropy, apart)."""
    extra = ["rounds=4", "participation=0.5", "dp.reproducible_noise=true"]
    plain = _cfg(tmp_path / "plain", *extra)
    audit = _cfg(tmp_path / "audit", *extra, "dp.audit.canaries=10")
    for cfg in (plain, audit):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrivacyWarning)
            run_one(cfg, "fedavg", SEED)
    picks = [[r["accepted_clients"] for r in _rows(cfg)] for cfg in (plain, audit)]
    assert picks[0] == picks[1] and all(len(p) == 2 for p in picks[0])
    summary = json.loads((run_dir(audit, "fedavg", SEED) / "summary.json").read_text())
    assert summary["dp_audit_canaries_per_round"] == 5  # ⌊10 · 2 / 4⌋


def test_a_resumed_audit_keeps_its_canaries(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "rounds=4", "dp.audit.canaries=6")
    assert run_one(cfg, "fedavg", SEED, stop_after=1) is None  # killed after round 1
    _, killed = _model(cfg)
    summary = run_one(cfg, "fedavg", SEED, resume=True)
    assert summary is not None and math.isfinite(summary["dp_audit_epsilon"])
    _, final = _model(cfg)
    assert final.values[KEY] == killed.values[KEY]
    assert final.values["privacy.audit.rounds"] == 4
    assert summary["dp_audit_unseen"] == 6 and "dp_audit_epsilon_all_iterates" in summary
    # the report's privacy cell: the estimate beside the accountant's ε
    shown = report(tmp_path / cfg.name, write=False)
    audit, every = summary["dp_audit_epsilon"], summary["dp_audit_epsilon_all_iterates"]
    assert f"{summary['dp_epsilon']:.3g} (1e-05) / 0.3 / 0.5 / " in shown
    assert f" · audit ε̂ {audit:.3g}, all iterates {every:.3g}" in shown


def test_an_infinite_estimate_is_shown_not_dropped() -> None:
    from fedlore.results.markdown import _dp_cell

    row = {"dp_noise_multiplier_mean": 1.0, "dp_epsilon_mean": 3.0, "dp_delta": 1e-5}
    assert _dp_cell(row) == "3 (1e-05) / 1 / – / –"
    row["dp_audit_epsilon_mean"] = math.inf
    assert _dp_cell(row) == "3 (1e-05) / 1 / – / – · audit ε̂ ∞"


def _record(seed: int, eps: float, audit: float, low: float, every_low: float) -> Any:
    from fedlore.results.store import RunRecord

    summary = {
        "dp_epsilon": eps,
        "dp_noise_multiplier": 1.0,
        "dp_delta": 1e-5,
        "dp_audit_epsilon": audit,
        "dp_audit_epsilon_low": low,
        "dp_audit_epsilon_high": audit + 1.0,
        "dp_audit_epsilon_all_iterates": audit - 0.5,
        "dp_audit_epsilon_all_iterates_low": every_low,
        "dp_audit_epsilon_all_iterates_high": audit,
        "final_accuracy": 0.5,
    }
    return RunRecord(seed=seed, rows=[], summary=summary)


def test_the_cell_shows_the_largest_seed_and_flags_an_interval_above_the_claim() -> None:
    """Two seeds against ε = 3: the cell shows the mean and the largest estimate (the mean 2.5
    hides the seed at 3.5), and "AUDIT ABOVE ε" with the runs whose interval's lower end is over
    their ε (3.2 > 3, not 2.9: an estimate above ε whose interval reaches below it is no flag;
    an equal lower end is none either)."""
    from fedlore.results.markdown import _dp_cell
    from fedlore.results.tables import summary_table

    quiet = [_record(1, 3.0, 1.5, 0.5, 0.1), _record(2, 3.0, 3.5, 2.9, 3.0)]
    (row,) = summary_table({"fedavg": quiet})
    assert row["dp_audit_epsilon_max"] == 3.5 and row["dp_audit_above_runs"] == 0
    cell = _dp_cell(row)
    assert cell.endswith(" · audit ε̂ 2.5 (max 3.5), all iterates 2 (max 3)")
    loud = [_record(1, 3.0, 1.5, 0.5, 0.1), _record(2, 3.0, 4.0, 3.2, 3.1)]
    (row,) = summary_table({"fedavg": loud})
    assert (row["dp_audit_above_runs"], row["dp_audit_all_iterates_above_runs"]) == (1, 1)
    assert _dp_cell(row).endswith(
        " · **AUDIT ABOVE ε** (interval's lower end over the claim): final model in 1 of 2 "
        "runs, all iterates in 1 of 2 runs"
    )


def test_too_few_canaries_are_warned_of_with_the_count_that_suffices(tmp_path: Path) -> None:
    """100 canaries over 2 rounds at σ = 6 (ε ≈ 2.4, the newcomer's setting): a sound run's
    estimate would land above ε about a third of the time, so the build warns, naming the
    count and the fewest canaries that bring that chance to 2.5 %; with those, it does not."""
    from fedlore.experiment_privacy import AuditWarning

    base = ("rounds=2", "dp.noise_multiplier=6", "dp.audit.unseen=0")
    cfg = _cfg(tmp_path, *base, "dp.audit.canaries=100")
    with pytest.warns(AuditWarning, match=r"dp.audit.canaries = 100 is too few") as got:
        build(cfg, "fedavg", SEED)
    (message,) = [str(w.message) for w in got if w.category is AuditWarning]
    enough = int(message.split("use at least ")[1].split(" ")[0].replace(",", ""))
    assert 300 < enough < 3000
    cfg = _cfg(tmp_path, *base, f"dp.audit.canaries={enough}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", AuditWarning)
        build(cfg, "fedavg", SEED)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["dp.mode=local"], "dp.mode=local is refused"),
        (["secure_aggregation=true"], "with secure_aggregation is refused"),
        (["participation=0.25", "dp.audit.canaries=3"], "use at least 4"),
        (["dp.audit.unseen=1"], "0 or at least 2"),
        (
            ["dp.clip_norm=null", "dp.noise_multiplier=null"],
            r"config:\n  dp.audit.canaries = 8 needs DP, which is off: .*; set dp.clip_norm and "
            r"dp.noise_multiplier \(or dp.epsilon\), or drop dp.audit$",
        ),
    ],
)
def test_what_the_audit_cannot_measure_is_refused(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, "dp.audit.canaries=8", *extra)


def test_a_method_whose_uploads_are_not_model_changes_is_refused_before_any_folder(
    tmp_path: Path,
) -> None:
    from fedlore.experiment import run_experiment

    cfg = _cfg(tmp_path / "out", "dp.audit.canaries=8", "algorithms=[fedlore_random]")
    with pytest.raises(ConfigError, match=r"method 'fedlore_random'.*model deltas"):
        run_experiment(cfg)
    assert not (tmp_path / "out").exists()


def test_the_few_canaries_warning_says_when_no_count_fits_and_when_it_may_stop_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The advice is a count the run can hold: past the directions' memory limit for the
    model's size the warning says the audit cannot resolve this ε instead of naming a count
    the run then refuses; with early stopping it says the count assumes every round runs."""
    from fedlore import progress
    from fedlore.experiment_privacy import AuditWarning, warn_few_canaries
    from fedlore.privacy.canaries import MAX_DIRECTION_ENTRIES

    monkeypatch.setattr(progress, "_SAID", set())  # warned once per process: show each here
    base = ("rounds=2", "dp.noise_multiplier=6", "dp.audit.unseen=0", "dp.audit.canaries=100")
    cfg = _cfg(tmp_path, *base)
    for dimension, fits in ((1_000, True), (MAX_DIRECTION_ENTRIES // 200, False)):
        with pytest.warns(AuditWarning) as got:
            warn_few_canaries(cfg, 1.0, 6.0, 0, dimension)
        (message,) = [str(w.message) for w in got if w.category is AuditWarning]
        assert ("use at least " in message) is fits
        assert ("cannot resolve an ε this small on this model" in message) is not fits
        assert (", more than the 200 whose directions" in message) is not fits
        assert "early stopping" not in message
    # unseen canaries as many as the canaries (the default): half the rows are theirs
    both = _cfg(tmp_path, "rounds=2", "dp.noise_multiplier=6", "dp.audit.canaries=100")
    with pytest.warns(AuditWarning, match=", more than the 300 whose directions"):
        warn_few_canaries(both, 1.0, 6.0, 0, MAX_DIRECTION_ENTRIES // 600)
    stops = cfg.model_copy(
        update={
            "early_stopping": cfg.early_stopping.model_copy(update={"metric": "selection_accuracy"})
        }
    )
    with pytest.warns(AuditWarning, match="assumes all its rounds run, and early stopping"):
        warn_few_canaries(stops, 1.0, 6.0, 0, 1_000)
