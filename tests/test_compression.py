"""The upload codecs of :mod:`fedlore.compression`, on their own: top-k keeps exactly the k
largest magnitudes (ties to the lower index) and its error feedback loses nothing over rounds;
QSGD is unbiased with the variance its rounding implies, on its levels, and a function of the
generator; 16-bit values and norms; and the checks that reject malformed encodings."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from fedlore.compression import (
    MAX_LEVELS,
    Codec,
    code_dtype,
    compress_update,
    decode_update,
    index_dtype,
    round_up,
    topk_count,
    topk_indices,
    update_problem,
    update_spec,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------ top-k


def test_k_is_the_ceiling_of_the_decimal_fraction() -> None:
    assert topk_count(100, 0.07) == 7  # 0.07 * 100 is 7.000000000000001 in floats
    assert topk_count(1000, 0.01) == 10
    assert topk_count(10, 0.01) == 1  # at least one entry of a non-empty tensor
    assert topk_count(101, 0.01) == 2
    assert topk_count(7, 1.0) == 7
    assert topk_count(0, 0.5) == 0
    assert index_dtype(2**31) == torch.int32  # positions up to 2^31 - 1
    assert index_dtype(2**31 + 1) == torch.int64
    assert code_dtype(127) == torch.int8 and code_dtype(128) == torch.int16


@pytest.mark.parametrize("k", [1, 17, 50, 999, 1000])
def test_topk_keeps_exactly_the_k_largest_magnitudes(k: int) -> None:
    x = torch.randn(1000, generator=_gen(0), dtype=torch.float64)
    idx = topk_indices(x, k)
    assert idx.dtype == torch.int64 and idx.numel() == k
    assert torch.equal(idx, idx.sort().values)  # increasing
    want = torch.argsort(-x.abs(), stable=True)[:k].sort().values
    assert torch.equal(idx, want)
    kept, dropped = x.abs()[idx], x.abs()[torch.ones(1000, dtype=torch.bool).index_fill(0, idx, 0)]
    if dropped.numel():
        assert float(kept.min()) >= float(dropped.max())


def test_ties_go_to_the_lower_index_whatever_the_sign() -> None:
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -3.0, 3.0, 0.5])
    assert topk_indices(x, 2).tolist() == [1, 3]
    assert topk_indices(x, 4).tolist() == [1, 3, 4, 5]
    assert topk_indices(x, 5).tolist() == [1, 2, 3, 4, 5]
    assert topk_indices(torch.zeros(5), 2).tolist() == [0, 1]  # all tied
    # one entry above the k-th magnitude, three tied at it: only k - 1 of the tied
    assert topk_indices(torch.tensor([1.0, 5.0, -1.0, 1.0]), 2).tolist() == [0, 1]
    flipped = topk_indices(-x, 2)  # magnitudes only
    assert flipped.tolist() == [1, 3]


def test_topk_of_nothing_and_of_everything_on_the_tensors_device() -> None:
    """k = 0 selects no position and k >= n every one (int64, as every selection), without a
    search: the positions are made on the tensor's device (the ``meta`` device here, on which
    the search itself cannot run); the top-k decode fills a tensor on the values' device."""
    none = topk_indices(torch.randn(5), 0)
    assert none.dtype == torch.int64 and none.shape == (0,)
    meta = torch.empty(6, device="meta")
    for k in (0, 6, 9):
        idx = topk_indices(meta, k)
        assert idx.device.type == "meta" and idx.dtype == torch.int64
        assert idx.shape == (min(k, 6),)
    parts = {
        "values": torch.empty(2, device="meta"),
        "index": torch.empty(2, dtype=torch.int32, device="meta"),
    }
    dense = Codec("topk", fraction=0.5).decode(parts, (2, 2), torch.float64)
    assert dense.device.type == "meta" and dense.dtype == torch.float64 and dense.shape == (2, 2)


def test_topk_sends_a_nan_rather_than_hiding_it() -> None:
    x = torch.tensor([0.1, float("nan"), 5.0, 0.2])
    assert topk_indices(x, 1).tolist() == [1]
    parts = Codec("topk", fraction=0.25).encode(x, _gen(0))
    assert bool(torch.isnan(parts["values"]).all())  # the server rejects it


@pytest.mark.parametrize("shape", [(40, 30), (7,), (3, 2, 5)])
def test_topk_round_trip_and_residual_is_what_was_dropped(shape: tuple[int, ...]) -> None:
    codec = Codec("topk", fraction=0.1)
    x = torch.randn(shape, generator=_gen(1))
    parts = codec.encode(x, _gen(0))
    k = topk_count(x.numel(), 0.1)
    assert parts["values"].shape == (k,) and parts["values"].dtype == torch.float32
    assert parts["index"].shape == (k,) and parts["index"].dtype == torch.int32
    dense = codec.decode(parts, shape, torch.float32)
    flat = dense.reshape(-1)
    idx = parts["index"].long()
    assert torch.equal(flat[idx], x.reshape(-1)[idx])  # the kept entries exactly
    assert int((flat != 0).sum()) <= k
    _, memory = compress_update(codec, {"w": x}, None, _gen(0), feedback=True)
    residual = memory["w"]
    assert torch.equal(residual.reshape(-1)[idx], torch.zeros(k))
    off = torch.ones(x.numel(), dtype=torch.bool).index_fill(0, idx, False)
    assert torch.equal(residual.reshape(-1)[off], x.reshape(-1)[off])  # everything dropped
    assert torch.equal(residual + dense, x)


def test_error_feedback_delivers_every_delta_exactly_in_float64() -> None:
    """Σ_t decode(sent_t) + e_T = Σ_t Δ_t, bit for bit: the deltas are multiples of 2^-10
    below 2^10, so every sum is exact and any lost or doubled entry would show."""
    codec = Codec("topk", fraction=0.05)
    shapes = {"a.weight": (20, 15), "a.bias": (15,), "b": (3,)}
    like = {k: (s, torch.float64) for k, s in shapes.items()}
    g = _gen(3)
    memory: dict[str, torch.Tensor] | None = None
    total_sent = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}
    total_delta = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}
    for _ in range(25):
        delta = {
            k: torch.randint(-1024, 1024, s, generator=g).to(torch.float64) / 1024
            for k, s in shapes.items()
        }
        sent, memory = compress_update(codec, delta, memory, g, feedback=True)
        dense = decode_update(codec, sent, like)
        for k in shapes:
            total_sent[k] += dense[k]
            total_delta[k] += delta[k]
            assert int((dense[k] != 0).sum()) <= topk_count(math.prod(shapes[k]), 0.05)
    assert memory is not None
    for k in shapes:
        assert torch.equal(total_sent[k] + memory[k], total_delta[k]), k
        assert bool(memory[k].abs().sum() > 0)  # something is still waiting: not vacuous
    # guard: without feedback what was dropped is lost
    lost = {k: torch.zeros(s, dtype=torch.float64) for k, s in shapes.items()}
    g = _gen(3)
    for _ in range(25):
        delta = {
            k: torch.randint(-1024, 1024, s, generator=g).to(torch.float64) / 1024
            for k, s in shapes.items()
        }
        sent, kept = compress_update(codec, delta, None, g, feedback=False)
        assert kept == {}
        for k, v in decode_update(codec, sent, like).items():
            lost[k] += v
    assert not torch.equal(lost["a.weight"], total_delta["a.weight"])


def test_a_non_finite_round_leaves_the_memory_as_it_was() -> None:
    codec = Codec("topk", fraction=0.5)
    _, memory = compress_update(codec, {"w": torch.tensor([1.0, 2.0])}, None, _gen(0), True)
    assert torch.equal(memory["w"], torch.tensor([1.0, 0.0]))
    bad = {"w": torch.tensor([float("nan"), 0.0])}
    sent, after = compress_update(codec, bad, memory, _gen(0), True)
    assert torch.equal(after["w"], memory["w"])
    assert bool(torch.isnan(sent["w.values"]).any())


def test_integer_tensors_travel_as_they_are() -> None:
    codec = Codec("topk", fraction=0.5)
    count = torch.tensor(7)
    sent, memory = compress_update(
        codec, {"bn.num_batches_tracked": count, "w": torch.ones(4)}, None, _gen(0), True
    )
    assert sent["bn.num_batches_tracked"] is count and "bn.num_batches_tracked" not in memory
    like = {"bn.num_batches_tracked": ((), torch.int64), "w": ((4,), torch.float32)}
    assert update_spec(codec, like) == {
        "bn.num_batches_tracked": ((), torch.int64),
        "w.values": ((2,), torch.float32),
        "w.index": ((2,), torch.int32),
    }
    # the tensors after it in name order are encoded too, and it is decoded as it came
    dense = decode_update(codec, sent, like)
    assert dense["bn.num_batches_tracked"] is count
    assert torch.equal(dense["w"], torch.tensor([1.0, 1.0, 0.0, 0.0]))


def test_the_memory_is_added_in_the_deltas_precision() -> None:
    """A memory kept in another precision (float64 here) is added at the delta's dtype: the
    upload and the new memory are in the delta's dtype, the one the server expects."""
    codec = Codec("topk", fraction=0.5)
    delta = {"w": torch.tensor([1.0, -3.0, 0.5, 2.0])}
    memory = {"w": torch.tensor([0.25, 0.0, 4.0, 0.0], dtype=torch.float64)}
    sent, kept = compress_update(codec, delta, memory, _gen(0), feedback=True)
    assert sent["w.values"].dtype == torch.float32 and kept["w"].dtype == torch.float32
    assert sent["w.values"].tolist() == [-3.0, 4.5] and sent["w.index"].tolist() == [1, 2]
    assert kept["w"].tolist() == [1.25, 0.0, 0.0, 2.0]


# -------------------------------------------------------------------------------------- QSGD


def _qsgd_variance(v: torch.Tensor, norm: float, s: int) -> torch.Tensor:
    """Per entry, Var of ||v|| c_i / s: (||v|| / s)^2 p (1 - p), p = frac(s |v_i| / ||v||)."""
    level = v.abs().double() / norm * s
    p = level - level.floor()
    return (norm / s) ** 2 * p * (1 - p)


def _bernstein(var: torch.Tensor, norm: float, s: int, draws: int) -> torch.Tensor:
    """Per entry, a bound on |mean of ``draws`` decodes - v_i| that holds for all (at most 300)
    entries at once with probability 1 - 1e-3 (Bernstein's inequality for the mean of a variable
    within one level, norm / s, of its mean, with a union bound): the skewed Bernoulli of an entry
    with a small rounding share p needs its second term."""
    log = math.log(2 * 300 / 1e-3)
    return (2 * var * log / draws).sqrt() + 2 * log / (3 * draws) * norm / s


@pytest.mark.parametrize("levels", [1, 4, 127])
def test_qsgd_is_unbiased_within_the_variance_of_its_rounding(levels: int) -> None:
    codec = Codec("qsgd", levels=levels)
    v = torch.randn(300, generator=_gen(7), dtype=torch.float64) * torch.linspace(0.01, 3, 300)
    draws = 4000
    decodes = torch.stack(
        [codec.decode(codec.encode(v, _gen(s)), (300,), torch.float64) for s in range(draws)]
    )
    norm = float(torch.linalg.vector_norm(v))
    var = _qsgd_variance(v, norm, levels)
    err = decodes.mean(0) - v
    # every entry within its Bernstein bound (an entry with p = 0 is exact)
    bound = _bernstein(var, norm, levels, draws)
    assert bool((err.abs() <= bound + 1e-12).all()), float((err.abs() / bound).max())
    # and the standardized errors are a chi-square with n degrees of freedom
    mask = var > 0
    chi2 = float((err[mask] ** 2 / (var[mask] / draws)).sum())
    n = int(mask.sum())
    assert chi2 < n + 5 * math.sqrt(2 * n), (chi2, n)
    # the empirical variance is the formula's, and within the paper's bound
    assert abs(float(decodes.var(0).sum() / var.sum()) - 1) < 0.1
    mse = float(((decodes - v) ** 2).sum(1).mean())
    assert mse <= min(300 / levels**2, math.sqrt(300) / levels) * norm**2


def test_qsgd_guard_round_to_nearest_would_fail_the_bound() -> None:
    """The bound above is tight enough to catch a biased quantizer: deterministic rounding to
    the nearest level misses most entries by more than the bound allows for 4000 draws."""
    levels = 4
    v = torch.randn(300, generator=_gen(7), dtype=torch.float64) * torch.linspace(0.01, 3, 300)
    norm = float(torch.linalg.vector_norm(v))
    nearest = torch.sign(v) * (v.abs() / norm * levels).round() * norm / levels
    bound = _bernstein(_qsgd_variance(v, norm, levels), norm, levels, 4000)
    assert int(((nearest - v).abs() > bound + 1e-12).sum()) > 200


@pytest.mark.parametrize(
    ("levels", "dtype"), [(1, torch.int8), (127, torch.int8), (300, torch.int16)]
)
def test_qsgd_codes_are_on_the_stated_levels(levels: int, dtype: torch.dtype) -> None:
    codec = Codec("qsgd", levels=levels)
    v = torch.randn(5, 200, generator=_gen(2))
    parts = codec.encode(v, _gen(0))
    code, norm = parts["code"], parts["norm"]
    assert code.dtype == dtype and code.shape == (5, 200)
    assert norm.shape == () and norm.dtype == torch.float32
    assert float(norm) >= float(torch.linalg.vector_norm(v.double()))  # rounded up
    assert int(code.min()) >= -levels and int(code.max()) <= levels
    assert bool((torch.sign(code) == torch.sign(v).to(code.dtype))[code != 0].all())
    dense = codec.decode(parts, (5, 200), torch.float32)
    # each decoded entry is ||v|| l / s with l an integer in [0, s]
    ratio = dense.double().abs() / float(norm) * levels
    assert torch.allclose(ratio, ratio.round(), atol=1e-4)
    assert int(ratio.round().max()) <= levels
    # the level reached is the floor or the ceiling of s |v_i| / ||v||
    exact = v.double().abs() / float(norm) * levels
    assert bool(((ratio.round() == exact.floor()) | (ratio.round() == exact.ceil())).all())
    if levels == 1:
        assert set(code.unique().tolist()) <= {-1, 0, 1}


@pytest.mark.parametrize(
    ("levels", "dtype", "shape"),
    [(1, torch.float64, (400,)), (5, torch.float32, (20, 20)), (300, torch.float64, (4, 5, 20))],
)
def test_qsgd_codes_are_the_floor_plus_one_uniform_draw_per_entry(
    levels: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """The codes, exactly: ``l_i = floor(r_i) + [u_i < r_i - floor(r_i)]`` with
    ``r_i = s |v_i| / ||v||`` in float64 (the norm as sent: ``||v||`` of the float64 entries,
    rounded up to the tensor's dtype) and ``u_i`` the float64 uniforms that ``rng`` gives next,
    one per entry in row-major order; ``c_i = sign(v_i) l_i``."""
    v = (torch.randn(shape, generator=_gen(21), dtype=torch.float64) * 3).to(dtype)
    parts = Codec("qsgd", levels=levels).encode(v, _gen(5))
    norm = round_up(torch.linalg.vector_norm(v.double()), dtype)
    assert parts["norm"].dtype == dtype and float(parts["norm"]) == float(norm)
    u = torch.rand(shape, generator=_gen(5), dtype=torch.float64)
    r = v.double().abs() / float(norm) * levels
    want = torch.sign(v.double()) * (r.floor() + (u < r - r.floor()).double())
    assert parts["code"].dtype == code_dtype(levels) and parts["code"].shape == shape
    assert torch.equal(parts["code"].double(), want)
    assert bool((want.abs() != r.floor()).any()) and bool((want.abs() == r.floor()).any())


def test_the_qsgd_norm_is_the_float64_norm_rounded_up() -> None:
    """The norm sent with a float32 tensor is ``||v||`` of its entries in float64, rounded up
    to float32: never below ``||v||`` (torch's float32 norm is, for about half of these 20
    tensors)."""
    codec = Codec("qsgd", levels=7)
    below = 0
    for seed in range(20):
        v = torch.randn(50, generator=_gen(seed))
        true = torch.linalg.vector_norm(v.double())
        sent = codec.encode(v, _gen(0))["norm"]
        assert sent.dtype == torch.float32 and float(sent) == float(round_up(true, torch.float32))
        assert float(sent) >= float(true)
        below += float(torch.linalg.vector_norm(v)) < float(true)
    assert below > 0  # guard: the float32 norm would have been too small


def test_qsgd_of_a_zero_or_non_finite_tensor_sends_zero_codes() -> None:
    """A zero delta: norm 0 and zero codes, a valid encoding of zero; a non-finite one: its
    non-finite norm (which the server rejects) and zero codes. A float64 delta too small for
    its norm (torch squares the entries: 1e-170 squared underflows to 0) is sent as zero with
    norm 0, not as codes ±s times a zero norm."""
    codec = Codec("qsgd", levels=7)
    for x, norm in (
        (torch.zeros(4), 0.0),
        (torch.tensor([1.0, math.inf, -2.0, 0.0]), math.inf),
        (torch.tensor([1.0, -math.inf, 2.0, 3.0]), math.inf),
        (torch.tensor([1.0, math.nan, 2.0, 3.0]), math.nan),
        (torch.tensor([1e-170, -1e-170, 0.0, 1e-170], dtype=torch.float64), 0.0),
    ):
        parts = codec.encode(x, _gen(0))
        assert parts["code"].dtype == torch.int8
        assert torch.equal(parts["code"], torch.zeros(4, dtype=torch.int8)), x
        got = float(parts["norm"])
        assert got == norm or (math.isnan(norm) and math.isnan(got))
        assert parts["norm"].dtype == x.dtype
        why = codec.problem(parts, (4,))
        assert (why is None) == (norm == 0.0), why


def test_qsgd_of_tiny_float64_entries_stays_on_its_levels() -> None:
    """torch's norm of float64 entries near 1e-160 (squares below the normal range) can come out
    below the largest ``|v_i|``, so ``s |v_i| / ||v||`` above s: the level is clamped to s and
    the encoding stays valid (at s = 32767 it would otherwise be a code the server rejects)."""
    xs = torch.rand(64, generator=_gen(0), dtype=torch.float64) * 1e-160 + 1e-161
    vs = [torch.tensor([x, 0.0], dtype=torch.float64) for x in xs.tolist()]
    short = [v for v in vs if bool(torch.linalg.vector_norm(v) < v[0])]
    assert short  # guard: torch's norm falls short for about half of them
    codec = Codec("qsgd", levels=MAX_LEVELS)
    for v in short[:4]:
        parts = codec.encode(v, _gen(1))
        assert codec.problem(parts, (2,)) is None
        assert parts["code"].tolist() == [MAX_LEVELS, 0]


def test_qsgd_draws_in_name_order_whatever_the_order_of_the_delta() -> None:
    """compress_update encodes the tensors by name: ``a`` takes the generator's first draws, ``b``
    the next ones, whichever order the delta lists them in."""
    codec = Codec("qsgd", levels=3)
    a, b = torch.randn(50, generator=_gen(0)), torch.randn(30, generator=_gen(1))
    sent, _ = compress_update(codec, {"b": b, "a": a}, None, _gen(9), feedback=False)
    g = _gen(9)
    first, second = codec.encode(a, g), codec.encode(b, g)
    assert torch.equal(sent["a.code"], first["code"]) and torch.equal(
        sent["b.code"], second["code"]
    )
    assert list(sent) == ["a.norm", "a.code", "b.norm", "b.code"]


def test_qsgd_codes_are_a_function_of_the_generator() -> None:
    codec = Codec("qsgd", levels=15)
    v = torch.randn(1000, generator=_gen(4))
    a, b = codec.encode(v, _gen(11)), codec.encode(v, _gen(11))
    assert torch.equal(a["code"], b["code"]) and torch.equal(a["norm"], b["norm"])
    c = codec.encode(v, _gen(12))
    assert not torch.equal(a["code"], c["code"])
    # the draws come from the generator handed in, one per entry: it moves on
    g = _gen(11)
    codec.encode(v, g)
    assert not torch.equal(g.get_state(), _gen(11).get_state())
    zero = codec.encode(torch.zeros(3), _gen(0))
    assert float(zero["norm"]) == 0.0 and torch.equal(
        zero["code"], torch.zeros(3, dtype=torch.int8)
    )


# ---------------------------------------------------------------------------- 16-bit values


@pytest.mark.parametrize(
    ("value", "dtype", "want"),
    [
        (5.0, torch.float32, 5.0),  # exact: kept
        (1 + 2**-30, torch.float32, 1 + 2**-23),  # nearest is 1, below: the next one up
        (1 + 2**-23 - 2**-30, torch.float32, 1 + 2**-23),  # nearest is above: kept
        (-(1 + 2**-30), torch.float32, -1.0),  # at or above, also for a negative value
        (3.0, torch.bfloat16, 3.0),
        (1 + 2**-9, torch.bfloat16, 1 + 2**-7),  # bf16 keeps 7 fraction bits
        (1 + 2**-12, torch.float16, 1 + 2**-10),  # fp16 keeps 10
        (0.1, torch.float64, 0.1),
    ],
)
def test_a_norm_is_rounded_up_to_the_smallest_number_of_the_dtype_at_or_above(
    value: float, dtype: torch.dtype, want: float
) -> None:
    got = round_up(torch.tensor(value, dtype=torch.float64), dtype)
    assert got.dtype == dtype and got.shape == () and got.device.type == "cpu"
    assert float(got) == want


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_16_bit_topk_values_with_the_rounding_in_the_memory(wire: torch.dtype) -> None:
    codec = Codec("topk", fraction=0.2, wire=wire)
    x = torch.randn(50, generator=_gen(5))
    sent, memory = compress_update(codec, {"w": x}, None, _gen(0), feedback=True)
    assert sent["w.values"].dtype == wire
    dense = codec.decode({"values": sent["w.values"], "index": sent["w.index"]}, (50,), x.dtype)
    assert torch.equal(dense + memory["w"], x)  # what rounding lost waits in the memory
    idx = sent["w.index"].long()
    assert bool((memory["w"][idx] != 0).any())  # x is not all 16-bit numbers


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_16_bit_qsgd_norm_is_rounded_up_and_the_decode_stays_unbiased(wire: torch.dtype) -> None:
    codec = Codec("qsgd", levels=3, wire=wire)
    v = torch.randn(64, generator=_gen(8), dtype=torch.float64)
    parts = codec.encode(v, _gen(0))
    assert parts["norm"].dtype == wire
    true = float(torch.linalg.vector_norm(v))
    assert true <= float(parts["norm"]) <= true * (1 + 2**-7)
    draws = 3000
    mean = torch.stack(
        [codec.decode(codec.encode(v, _gen(s)), (64,), torch.float64) for s in range(draws)]
    ).mean(0)
    norm = float(parts["norm"])
    bound = _bernstein(_qsgd_variance(v, norm, 3), norm, 3, draws)
    assert bool(((mean - v).abs() <= bound + 1e-12).all())


# ------------------------------------------------------------------------------ the checks


LIKE = {"w": ((4, 5), torch.float32), "b": ((5,), torch.float32)}


def _encoded(codec: Codec) -> dict[str, torch.Tensor]:
    delta = {"w": torch.randn(4, 5, generator=_gen(0)), "b": torch.randn(5, generator=_gen(1))}
    sent, _ = compress_update(codec, delta, None, _gen(2), feedback=False)
    return sent


def test_a_good_encoding_passes() -> None:
    for codec in (Codec("topk", fraction=0.3), Codec("qsgd", levels=7)):
        sent = _encoded(codec)
        spec = update_spec(codec, LIKE)
        assert {k: (tuple(v.shape), v.dtype) for k, v in sent.items()} == spec
        assert update_problem(codec, sent, LIKE) is None


def _at(dim: int, i: int, value: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.index_fill(dim, torch.tensor([i]), value)


MALFORMED = [
    ("topk", "w.index", _at(0, 0, 20), "index 20 out of range [0, 20)"),
    ("topk", "w.index", _at(0, 1, -1), "index -1 out of range"),
    ("topk", "b.index", lambda t: torch.tensor([3, 3], dtype=torch.int32), "index 3 given twice"),
    ("qsgd", "w.code", _at(1, 2, 8), "code 8 outside [-7, 7]"),
    ("qsgd", "b.code", lambda t: torch.full_like(t, -8), "code -8 outside [-7, 7]"),
    ("qsgd", "w.norm", lambda t: torch.tensor(float("nan")), "norm nan is not a finite number"),
    ("qsgd", "b.norm", lambda t: torch.tensor(-1.0), "norm -1.0 is not a finite number >= 0"),
    ("qsgd", "b.norm", lambda t: torch.tensor(float("inf")), "norm inf"),
]


@pytest.mark.parametrize(("kind", "key", "value", "needle"), MALFORMED)
def test_malformed_encodings_are_named(
    kind: str, key: str, value: Callable[[torch.Tensor], torch.Tensor], needle: str
) -> None:
    codec = Codec("topk", fraction=0.3) if kind == "topk" else Codec("qsgd", levels=7)
    sent = _encoded(codec)
    sent[key] = value(sent[key].clone())
    why = update_problem(codec, sent, LIKE)
    assert why is not None and why.startswith(key.split(".")[0] + ": ") and needle in why, why


def _topk_parts(index: list[int]) -> dict[str, torch.Tensor]:
    return {"values": torch.ones(len(index)), "index": torch.tensor(index, dtype=torch.int32)}


def test_the_topk_check_at_its_bounds() -> None:
    """Positions 0 and n - 1 pass, n and -1 do not (the message names the offending one, the
    lowest below 0 first); a single index is checked too; of several repeated positions the
    lowest is named; an empty tensor sends no index and passes."""
    codec = Codec("topk", fraction=0.1)
    assert codec.problem(_topk_parts([0, 19]), (4, 5)) is None
    assert codec.problem(_topk_parts([0, 20]), (4, 5)) == "index 20 out of range [0, 20)"
    assert codec.problem(_topk_parts([-1, 20]), (4, 5)) == "index -1 out of range [0, 20)"
    assert codec.problem(_topk_parts([7]), (4, 5)) is None
    assert codec.problem(_topk_parts([20]), (4, 5)) == "index 20 out of range [0, 20)"
    assert codec.problem(_topk_parts([9, 5, 9, 5, 1]), (4, 5)) == "index 5 given twice"
    assert codec.problem(_topk_parts([]), (0, 3)) is None


def test_the_qsgd_check_at_its_bounds() -> None:
    """Codes -s and s pass, -s - 1 and s + 1 do not (the lower one named when both are out); a
    zero norm (a zero delta) passes, the smallest negative one does not; an empty tensor
    passes."""
    codec = Codec("qsgd", levels=7)

    def parts(code: list[int], norm: float = 2.0) -> dict[str, torch.Tensor]:
        return {"norm": torch.tensor(norm), "code": torch.tensor(code, dtype=torch.int8)}

    assert codec.problem(parts([-7, 0, 7]), (3,)) is None
    assert codec.problem(parts([-7, 0, 7], 0.0), (3,)) is None
    assert codec.problem(parts([-8, 0, 7]), (3,)) == "code -8 outside [-7, 7]"
    assert codec.problem(parts([-7, 0, 8]), (3,)) == "code 8 outside [-7, 7]"
    assert codec.problem(parts([-9, 0, 9]), (3,)) == "code -9 outside [-7, 7]"
    assert codec.problem(parts([], 1.0), (0,)) is None
    assert codec.problem(parts([1], -0.0), (1,)) is None
    tiny = -(2.0**-100)
    assert codec.problem(parts([1], tiny), (1,)) == f"norm {tiny} is not a finite number >= 0"


def test_the_first_malformed_tensor_in_the_models_order_is_named() -> None:
    codec = Codec("qsgd", levels=7)
    sent = _encoded(codec)
    sent["w.code"] = torch.full_like(sent["w.code"], 9)
    sent["b.code"] = torch.full_like(sent["b.code"], -9)
    assert update_problem(codec, sent, LIKE) == "w: code 9 outside [-7, 7]"
    flipped = {"b": LIKE["b"], "w": LIKE["w"]}
    assert update_problem(codec, sent, flipped) == "b: code -9 outside [-7, 7]"


def test_codec_settings_at_their_bounds() -> None:
    """A top-k fraction in (0, 1] and QSGD levels in [1, 32767]: the bounds themselves are
    taken, the numbers just outside refused with the setting's whole message."""
    assert Codec("topk", fraction=1.0).fraction == 1.0
    assert Codec("qsgd", levels=1).levels == 1
    assert Codec("qsgd", levels=MAX_LEVELS).levels == MAX_LEVELS
    for bad in (0.0, -0.5, 1.0 + 2**-52):
        with pytest.raises(ValueError) as info:
            Codec("topk", fraction=bad)
        assert str(info.value) == f"top-k fraction must be in (0, 1], got {bad!r}"
    for levels in (0, -1, MAX_LEVELS + 1):
        with pytest.raises(ValueError) as info:
            Codec("qsgd", levels=levels)
        assert str(info.value) == f"QSGD levels must be in [1, 32767], got {levels!r}"
    with pytest.raises(ValueError) as info:
        Codec("gzip")  # type: ignore[arg-type]
    assert str(info.value) == "compression kind must be topk or qsgd, got 'gzip'"
