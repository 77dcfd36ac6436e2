"""fedlore.tensors on hand-computed cases: payload bytes, the wire casts (what is rounded, what
passes untouched, that nothing is modified in place), key selection, the float64 weighted mean
and its refusals, differences, copies and loading a model's arrays."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fedlore.tensors import (
    WIRE_DTYPES,
    clone,
    from_wire,
    load_model_arrays,
    model_arrays,
    nbytes,
    nonnegative_increments,
    nonnegative_variances,
    select,
    snap,
    sub,
    to_cpu,
    to_device,
    to_wire,
    weighted_mean,
    with_prefix,
)


def test_nbytes_sums_numel_times_element_size() -> None:
    """3x4 float32 (48) + 5 float16 (10) + 2 int64 (16) + an empty tensor (0) = 74 bytes."""
    arrays = {
        "a": torch.zeros(3, 4),
        "b": torch.zeros(5, dtype=torch.float16),
        "c": torch.zeros(2, dtype=torch.int64),
        "e": torch.zeros(0),
    }
    assert nbytes(arrays) == 74
    assert nbytes({}) == 0


def test_wire_dtypes_name_the_transport_casts() -> None:
    """``fp32`` sends every tensor in its own dtype; ``fp16`` / ``bf16`` the 16-bit ones."""
    assert {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16} == WIRE_DTYPES


def test_to_wire_rounds_floats_to_nearest_even_and_passes_the_rest() -> None:
    """Floating tensors are cast (1 + 2^-11 is halfway between two float16 values: it rounds to
    the even one, 1; 1 + 3·2^-11 rounds up to 1 + 2^-9), beyond 65504 to inf; integer and
    bool tensors, and tensors already in the wire dtype, are the same objects; the input
    dict and tensors are left as they were."""
    x = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1e5], dtype=torch.float32)
    ints, flags = torch.tensor([70000]), torch.tensor([True])
    half = torch.tensor([0.5], dtype=torch.float16)
    arrays = {"x": x, "i": ints, "m": flags, "h": half}
    out = to_wire(arrays, torch.float16)
    assert out["x"].dtype == torch.float16 and out["x"].is_contiguous()
    assert out["x"].tolist() == [1.0, 1 + 2**-9, float("inf")]
    assert out["i"] is ints and out["m"] is flags and out["h"] is half
    assert arrays["x"] is x and x.dtype == torch.float32 and x[0] == 1 + 2**-11
    same = to_wire(arrays, None)
    assert same == arrays and same is not arrays
    assert all(same[k] is arrays[k] for k in arrays)


def test_to_wire_makes_a_transposed_tensor_contiguous() -> None:
    """A non-contiguous floating tensor crosses the wire as a contiguous copy."""
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    out = to_wire({"t": t}, torch.bfloat16)["t"]
    assert out.is_contiguous() and out.dtype == torch.bfloat16
    assert torch.equal(out.float(), t)


def test_from_wire_upcasts_floats_exactly_by_key() -> None:
    """One dtype for every floating tensor, or per key (others keep theirs); integer tensors
    never change; a tensor already in the asked dtype is the same object."""
    h = torch.tensor([0.1], dtype=torch.float16)
    b = torch.tensor([0.3], dtype=torch.bfloat16)
    i = torch.tensor([3])
    one = from_wire({"h": h, "b": b, "i": i}, torch.float64)
    assert one["h"].dtype == torch.float64 and float(one["h"]) == float(h)
    assert one["b"].dtype == torch.float64 and float(one["b"]) == float(b)
    assert one["i"] is i
    per_key = from_wire({"h": h, "b": b, "i": i}, {"h": torch.float32, "i": torch.float32})
    assert per_key["h"].dtype == torch.float32 and per_key["b"] is b and per_key["i"] is i
    assert from_wire({"h": h}, torch.float16)["h"] is h


def test_snap_rounds_to_the_wire_dtype_and_keeps_the_own_dtype() -> None:
    """``snap`` = the value the receiver gets, in the sender's dtype: sending it again is
    lossless; with no wire dtype everything is kept as it is."""
    x = torch.tensor([0.1, 1 + 2**-12], dtype=torch.float32)
    d = torch.tensor([0.1], dtype=torch.float64)
    snapped = snap({"x": x, "d": d}, torch.float16)
    assert snapped["x"].dtype == torch.float32 and snapped["d"].dtype == torch.float64
    assert torch.equal(snapped["x"], x.half().float()) and not torch.equal(snapped["x"], x)
    assert torch.equal(snapped["d"], d.half().double())
    again = to_wire(snapped, torch.float16)
    assert torch.equal(again["x"].float(), snapped["x"])
    kept = snap({"x": x}, None)
    assert kept["x"] is x


def test_select_and_with_prefix_are_inverse_key_maps() -> None:
    """``select`` keeps the keys with the prefix (stripped or not), ``with_prefix`` adds it."""
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    arrays = {"enc.w": a, "enc.b": b, "head.w": c, "xenc.w": c}
    assert select(arrays, "enc.") == {"w": a, "b": b}
    assert select(arrays, "enc.", strip=False) == {"enc.w": a, "enc.b": b}
    assert select(arrays, "nope.") == {}
    assert with_prefix({"w": a, "b": b}, "enc.") == {"enc.w": a, "enc.b": b}
    assert with_prefix(select(arrays, "head."), "head.") == {"head.w": c}


def test_weighted_mean_is_normalized_and_computed_in_float64() -> None:
    """Σ w_i x_i / Σ w_i per key, shapes and dtypes kept (weights 1 and 3 of 0 and 4: 3); in
    float64 (float16 inputs near 60000 whose float16 sum overflows; float64 inputs 2^-50
    apart); a zero weight drops an item; an integer tensor is the first item's, copied."""
    items: list[dict[str, torch.Tensor]] = [
        {"n": torch.tensor([n])}
        for n in (5, 7)  # first: the loop goes on past it
    ]
    items[0] |= {"w": torch.tensor([[0.0, 8.0]]), "h": torch.tensor([6e4], dtype=torch.float16)}
    items[1] |= {"w": torch.tensor([[4.0, 0.0]]), "h": torch.tensor([6e4], dtype=torch.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # real tensors: no complex detour, no cast warning
        out = weighted_mean(items, [1.0, 3.0])
    assert out["w"].shape == (1, 2) and out["w"].dtype == torch.float32
    assert torch.equal(out["w"], torch.tensor([[3.0, 2.0]]))
    assert out["h"].dtype == torch.float16 and float(out["h"]) == 60000.0
    assert torch.equal(out["n"], torch.tensor([5])) and out["n"] is not items[0]["n"]
    assert torch.equal(weighted_mean(items, [0.0, 2.0])["w"], items[1]["w"])
    assert torch.equal(weighted_mean(items, [0.125, 0.375])["w"], out["w"])  # sum below 1
    fine = [{"d": torch.tensor([1.0 + k * 2**-50], dtype=torch.float64)} for k in (0, 1)]
    assert float(weighted_mean(fine, [1.0, 1.0])["d"]) == 1.0 + 2**-51  # float64 resolution


def test_weighted_mean_and_to_device_keep_the_tensors_device() -> None:
    """The mean is accumulated on the items' device (the meta device here: any other than the
    CPU would do), integer tensors included; ``to_device`` moves every tensor there."""
    items = [
        {"w": torch.ones(2, device="meta"), "n": torch.ones(1, dtype=torch.long, device="meta")}
        for _ in range(2)
    ]
    out = weighted_mean(items, [1.0, 2.0])
    assert out["w"].device.type == "meta" and out["w"].dtype == torch.float32
    assert out["n"].device.type == "meta"
    moved = to_device(
        {"t": torch.ones(2), "i": torch.ones(1, dtype=torch.long)}, torch.device("meta")
    )
    assert {v.device.type for v in moved.values()} == {"meta"}


def test_weighted_mean_keeps_complex_values() -> None:
    """Complex tensors are averaged, imaginary parts included, in complex128 (not taken from
    the first item, not cut to their real parts)."""
    items = [{"z": torch.tensor([1 + 1j])}, {"z": torch.tensor([3 + 5j])}]
    out = weighted_mean(items, [1.0, 3.0])["z"]
    assert out.dtype == items[0]["z"].dtype and torch.equal(out, torch.tensor([2.5 + 4j]))


def test_weighted_mean_refuses_bad_input() -> None:
    """No item, a weight count that differs, weights without a positive sum and items with
    different keys are errors naming the problem."""
    one = {"w": torch.ones(1)}
    with pytest.raises(ValueError, match=r"^weighted_mean needs at least one item$"):
        weighted_mean([], [])
    with pytest.raises(ValueError, match="2 items but 1 weights"):
        weighted_mean([one, one], [1.0])
    for weights in ([0.0, 0.0], [1.0, -1.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError, match="positive sum"):
            weighted_mean([one, one], weights)
    with pytest.raises(ValueError, match=r"^weighted_mean: items have different keys$"):
        weighted_mean([one, {"v": torch.ones(1)}], [1.0, 1.0])
    with pytest.raises(ValueError, match="different keys"):
        weighted_mean([one, {"w": torch.ones(1), "v": torch.ones(1)}], [1.0, 1.0])


def test_sub_is_keywise_in_the_first_operands_dtype() -> None:
    """``a - b`` per key of ``a``, ``b`` cast to ``a``'s dtype first."""
    a = {"w": torch.tensor([1.0, 2.0]), "h": torch.tensor([1.0], dtype=torch.float16)}
    b = {"w": torch.tensor([0.5, 3.0], dtype=torch.float64), "h": torch.tensor([0.25])}
    out = sub(a, b)
    assert out["w"].dtype == torch.float32 and torch.equal(out["w"], torch.tensor([0.5, -1.0]))
    assert out["h"].dtype == torch.float16 and float(out["h"]) == 0.75


def test_clone_detaches_copies_and_makes_contiguous() -> None:
    """Copies that share no storage with the input, carry no autograd graph and are
    contiguous; ``to_cpu`` / ``to_device`` on the CPU return the tensors themselves."""
    p = torch.arange(6, dtype=torch.float32).reshape(2, 3).t().requires_grad_()
    out = clone({"p": p})["p"]
    assert torch.equal(out, p) and out.is_contiguous() and not out.requires_grad
    assert out.data_ptr() != p.data_ptr()
    t = torch.ones(2)
    assert to_cpu({"t": t})["t"] is t
    assert to_device({"t": t}, torch.device("cpu"))["t"] is t


def test_model_arrays_round_trip_and_strict_loading() -> None:
    """``model_arrays`` copies parameters and buffers (not views of the model);
    ``load_model_arrays`` writes them back in place, refuses missing or unexpected keys under
    ``strict`` (naming the first five of each, sorted) and loads the known ones otherwise."""
    first = nn.Linear(2, 2)
    model = nn.Sequential(first, nn.BatchNorm1d(2))
    arrays = model_arrays(model)
    assert set(arrays) == set(model.state_dict())
    with torch.no_grad():
        first.weight.add_(1.0)
    assert not torch.equal(arrays["0.weight"], first.weight)  # a copy, not a view
    weight = first.weight
    load_model_arrays(model, arrays)
    assert first.weight is weight and torch.equal(weight, arrays["0.weight"])
    missing = {k: v for k, v in arrays.items() if k != "0.bias"}
    with pytest.raises(KeyError, match=r"missing=\['0.bias'\] unexpected=\[\]"):
        load_model_arrays(model, missing)
    extra = {**arrays, "2.weight": torch.zeros(1)}
    with pytest.raises(KeyError, match=r"missing=\[\] unexpected=\['2.weight'\]"):
        load_model_arrays(model, extra)
    many = nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)])  # 8 keys: 5 are named
    with pytest.raises(
        KeyError,
        match=r"missing=\['0.bias', '0.weight', '1.bias', '1.weight', "
        r"'2.bias'\] unexpected=\['a', 'b', 'c', 'd', 'e'\]\"$",
    ):
        load_model_arrays(many, {k: torch.zeros(1) for k in "abcdef"})
    new = {"0.bias": torch.tensor([5.0, 6.0]), "2.weight": torch.zeros(1)}
    load_model_arrays(model, new, strict=False)
    assert torch.equal(first.bias, torch.tensor([5.0, 6.0]))


def test_only_running_variances_are_clamped_at_zero_and_the_rest_keeps_its_bits() -> None:
    var = torch.tensor([-0.5, 0.0, 2.0, -1e-30])
    arrays = {
        "body.1.running_var": var,
        "running_var": torch.tensor([-1.0], dtype=torch.float64),
        "body.1.running_mean": torch.tensor([-3.0]),
        "head.my_running_var": torch.tensor([-2.0]),  # another name: not BatchNorm's
        "counts.running_var": torch.tensor([-4]),  # an integer tensor: left alone
        "body.1.weight": torch.tensor([-5.0]),
    }
    out = nonnegative_variances(arrays)
    assert torch.equal(out["body.1.running_var"], torch.tensor([0.0, 0.0, 2.0, 0.0]))
    assert out["running_var"].dtype == torch.float64 and float(out["running_var"]) == 0.0
    for k in ("body.1.running_mean", "head.my_running_var", "counts.running_var", "body.1.weight"):
        assert out[k] is arrays[k]
    assert float(var[0]) == -0.5  # not in place
    kept = torch.tensor([0.25, 3.0])
    assert torch.equal(nonnegative_variances({"bn.running_var": kept})["bn.running_var"], kept)


def test_a_clamped_increment_takes_the_variance_to_exactly_zero_and_leaves_the_rest() -> None:
    """Entries that would go below 0 get ``-value`` (value + it is exactly 0); the others, the
    other tensors and a variance increment that takes nothing below 0 keep their bits (the same
    objects); a tensor with no value (not in the model) is left alone."""
    values = {
        "bn.running_var": torch.tensor([0.3, 1.0, 2.0, 0.1]),
        "bn.running_mean": torch.tensor([0.5]),
        "other.running_var": torch.tensor([1.0, 1.0]),
    }
    incs = {
        "bn.running_var": torch.tensor([-0.7, 0.5, -2.0, -0.1 + 1e-9]),
        "bn.running_mean": torch.tensor([-3.0]),
        "other.running_var": torch.tensor([-0.5, 2.0]),
        "new.running_var": torch.tensor([-9.0]),
    }
    out = nonnegative_increments(values, incs)
    got = values["bn.running_var"] + out["bn.running_var"]
    assert torch.equal(
        got,
        torch.tensor(
            [0.0, 1.5, 0.0, float(values["bn.running_var"][3] + incs["bn.running_var"][3])]
        ),
    )
    assert torch.equal(out["bn.running_var"][1:2], incs["bn.running_var"][1:2])
    assert torch.equal(out["bn.running_var"][0], -values["bn.running_var"][0])
    for k in ("bn.running_mean", "other.running_var", "new.running_var"):
        assert out[k] is incs[k]
    assert float(incs["bn.running_var"][0]) == pytest.approx(-0.7)  # not in place


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_sixteen_bit_increment_is_rounded_towards_zero_where_it_cannot_hold_the_value(
    dtype: torch.dtype,
) -> None:
    """At a 16-bit wire ``-value`` rounds to nearest, which can overshoot it (1 + 1.7 ulp goes
    to -(1 + 2 ulp)): the increment takes the 16-bit number next to it towards 0, so the
    variance lands at a small number at or above 0 on the server and every client alike; an
    exactly representable value still lands at exactly 0."""
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    values = {"bn.running_var": torch.tensor([1.0 + 1.7 * ulp, 1.0 + ulp / 3, 0.5, 3.0])}
    incs = {"bn.running_var": torch.full((4,), -100.0, dtype=dtype)}
    out = nonnegative_increments(values, incs)["bn.running_var"]
    assert out.dtype == dtype
    got = values["bn.running_var"] + out.float()
    assert bool((got >= 0).all()), got
    assert float(got[2]) == float(got[3]) == 0.0  # exact in 16 bits
    assert 0 < float(got[0]) <= 2 * ulp  # rounded past -value, then one step back
