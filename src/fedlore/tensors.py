"""Pure helpers on :data:`fedlore.types.Arrays` (named tensors). No side effects."""

from __future__ import annotations

import cmath
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from fedlore.types import Arrays, State


def nbytes(arrays: Arrays) -> int:
    """Total payload size in bytes (``numel * element_size`` summed over all tensors)."""
    return sum(int(t.numel()) * t.element_size() for t in arrays.values())


def state_bytes(state: State | None) -> int:
    """The bytes a client keeps between rounds: its state's tensors (0 for no state)."""
    return 0 if state is None else nbytes(state.arrays)


WIRE_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
"""``transport_dtype`` setting -> the dtype floating tensors cross the wire in (None: their own
dtype, unchanged; ``fp32`` is the model's precision, float64 under ``precision: fp64``)."""


def to_wire(arrays: Arrays, dtype: torch.dtype | None) -> Arrays:
    """The floating-point tensors of ``arrays`` cast to ``dtype`` (round to nearest even);
    integer and boolean tensors, and everything when ``dtype`` is None, unchanged (the same
    tensor objects). A float16 cast maps magnitudes beyond 65504 to ±inf (IEEE), which the
    server's reply validation then rejects like any non-finite upload; bfloat16 has float32's
    range. Pure: nothing is modified in place."""
    if dtype is None:
        return dict(arrays)
    return {
        k: v.to(dtype).contiguous() if v.is_floating_point() and v.dtype != dtype else v
        for k, v in arrays.items()
    }


def from_wire(arrays: Arrays, dtypes: torch.dtype | dict[str, torch.dtype]) -> Arrays:
    """The floating-point tensors of received ``arrays`` upcast (exactly) to ``dtypes``: one
    dtype for all, or per key (keys missing from the mapping, and non-floating tensors, stay as
    they are). The receiver's side of :func:`to_wire`."""
    out: Arrays = {}
    for k, v in arrays.items():
        want = dtypes if isinstance(dtypes, torch.dtype) else dtypes.get(k, v.dtype)
        out[k] = v.to(want) if v.is_floating_point() and v.dtype != want else v
    return out


def snap(arrays: Arrays, dtype: torch.dtype | None) -> Arrays:
    """``from_wire(to_wire(arrays, dtype), own dtypes)``: each floating tensor rounded to the
    nearest ``dtype`` value and kept in its own dtype, so that sending it later through
    :func:`to_wire` is lossless (the sender keeps exactly what the receiver gets)."""
    if dtype is None:
        return dict(arrays)
    return from_wire(to_wire(arrays, dtype), {k: v.dtype for k, v in arrays.items()})


def select(arrays: Arrays, prefix: str, strip: bool = True) -> Arrays:
    """The tensors whose key starts with ``prefix`` (``strip`` removes the prefix)."""
    n = len(prefix)
    return {(k[n:] if strip else k): v for k, v in arrays.items() if k.startswith(prefix)}


def with_prefix(arrays: Arrays, prefix: str) -> Arrays:
    """The same tensors with ``prefix`` prepended to every key."""
    return {prefix + k: v for k, v in arrays.items()}


def weighted_mean(items: Sequence[Arrays], weights: Sequence[float]) -> Arrays:
    """Key-wise weighted mean ``Σ_i w_i x_i / Σ_i w_i`` computed in float64 (complex128 for
    complex tensors), cast back.

    Args:
        items: N dicts with identical keys and shapes.
        weights: N non-negative scalars with a positive sum.

    Raises:
        ValueError: on empty input, mismatched keys, or non-positive total weight.
    """
    if not items:
        raise ValueError("weighted_mean needs at least one item")
    if len(items) != len(weights):
        raise ValueError(f"{len(items)} items but {len(weights)} weights")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights must have a positive sum, got {list(weights)}")
    keys = items[0].keys()
    out: Arrays = {}
    for k in keys:
        ref = items[0][k]
        if not (ref.is_floating_point() or ref.is_complex()):
            out[k] = ref.clone()  # integer buffers (e.g. BatchNorm counters): take the first
            continue
        wide = torch.complex128 if ref.is_complex() else torch.float64
        acc = torch.zeros(ref.shape, dtype=wide, device=ref.device)
        for item, w in zip(items, weights, strict=True):
            if item.keys() != keys:
                raise ValueError("weighted_mean: items have different keys")
            acc += float(w) * item[k].to(wide)
        out[k] = (acc / total).to(ref.dtype)
    return out


def sub(a: Arrays, b: Arrays) -> Arrays:
    """``a - b`` key-wise."""
    return {k: a[k] - b[k].to(a[k].dtype) for k in a}


def clone(a: Arrays) -> Arrays:
    """Detached contiguous copies on the tensors' own device (the form every message and state
    holds: on the run's device; checkpoints and the Flower codec move them to the CPU)."""
    return {k: v.detach().clone().contiguous() for k, v in a.items()}


def to_cpu(a: Arrays) -> Arrays:
    """The tensors on the CPU (themselves when they are there), for files and the wire."""
    return {k: v.cpu() for k, v in a.items()}


def to_device(a: Arrays, device: torch.device) -> Arrays:
    """The tensors on ``device`` (themselves when they are there)."""
    return {k: v.to(device) for k, v in a.items()}


def model_arrays(model: nn.Module) -> Arrays:
    """Parameters and buffers of ``model`` as detached copies on the model's device
    (``state_dict`` names)."""
    return clone(dict(model.state_dict()))


def load_model_arrays(model: nn.Module, arrays: Arrays, strict: bool = True) -> None:
    """Load ``arrays`` into ``model`` in place.

    Raises:
        KeyError: with ``strict``, when keys are missing or unexpected (names them).
    """
    own = model.state_dict()
    if strict:
        missing = sorted(set(own) - set(arrays))
        extra = sorted(set(arrays) - set(own))
        if missing or extra:
            raise KeyError(f"model arrays mismatch: missing={missing[:5]} unexpected={extra[:5]}")
    with torch.no_grad():
        for k, v in arrays.items():
            if k in own:
                own[k].copy_(v)


def nonnegative_variances(arrays: Arrays) -> Arrays:
    """``arrays`` with every BatchNorm running variance (a floating-point tensor named
    ``running_var`` or ``*.running_var``, torch's name) clamped at 0, the others as they are.

    A plain weighted mean of client models keeps a variance non-negative, but DP's noise on the
    summed deltas, and a server optimizer's step, can take it below 0, and BatchNorm would then
    score with the square root of a negative number (NaN). Clamping is post-processing: it
    spends no privacy. A variance that is already non-negative keeps its bits.
    """
    return {k: v.clamp(min=0) if _is_variance(k, v) else v for k, v in arrays.items()}


def _is_variance(name: str, value: torch.Tensor) -> bool:
    """Whether ``name`` is a BatchNorm running variance (torch's ``running_var``, floating)."""
    return name.rsplit(".", 1)[-1] == "running_var" and value.is_floating_point()


def nonnegative_increments(values: Arrays, increments: Arrays) -> Arrays:
    """``increments`` with every BatchNorm running variance's entry that would take its value
    below 0 replaced by ``-value`` (in the increment's dtype, rounded towards 0 when it cannot
    hold ``-value`` exactly), so ``values[k] + increments[k]`` (the increment upcast to the
    value's dtype, as :func:`~fedlore.algorithms.lowrank.add_increment` adds it) is at least 0;
    the other entries, and every other tensor, keep their bits (the same objects when nothing
    is replaced).

    :func:`nonnegative_variances` for a method whose clients replay the server's logged
    increments (FedLore's servers): the server logs and applies the returned increment, so a
    client's cache stays bit-identical to the server's model. ``-value + value`` is exactly 0
    in IEEE arithmetic, so a clamped entry is 0 on both sides (at a 16-bit wire, a small
    non-negative number). Post-processing of the noised increment with the public model: it
    spends no privacy."""
    out = dict(increments)
    for k, inc in increments.items():
        value = values.get(k)
        if value is None or not _is_variance(k, inc):
            continue
        below = value + inc.to(value.dtype) < 0
        if not bool(below.any()):
            continue
        back = (-value).to(inc.dtype)  # rounded to nearest: it may overshoot -value by half an ulp
        over = value + back.to(value.dtype) < 0
        back = torch.where(over, torch.nextafter(back, torch.zeros_like(back)), back)
        out[k] = torch.where(below, back, inc)
    return out


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of every floating-point or complex tensor in ``tensors`` is finite
    (integer and bool tensors always are); the same answer as ``torch.isfinite(t).all()`` over
    each tensor, at the cost of one sum per tensor and one wait on the device.

    A sum of IEEE values that is finite implies every summand is finite (NaN and ±Inf propagate
    through every addition), so the common case is decided from the sum of the per-tensor sums;
    a non-finite total (a NaN or Inf, or finite values whose sum overflows) falls back to the
    exact element-wise check, so the answer never differs from it. (On the CPU ``isfinite`` of a
    large tensor is about 50x slower than its sum: per tensor it was a tenth of a CNN's step.)

    Args:
        tensors: any tensors on one device (any shapes, dtypes may differ; empty ones count as
            finite). Gradients, losses and uploads alike; nothing is copied.

    Returns:
        True when no element is NaN or ±Inf.
    """
    ts = [t for t in tensors if t.is_floating_point() or t.is_complex()]
    if not ts:
        return True
    if cmath.isfinite(torch.stack([t.sum() for t in ts]).sum().item()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in ts)  # exact, rare
