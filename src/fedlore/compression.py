"""Upload compression of dense deltas: top-k sparsification with error feedback and QSGD.

Pure tensor functions (no engine, no method): the dense methods
(:class:`~fedlore.algorithms.fedavg.FedFull`, FedAvg, FedProx) encode each client's delta with
them and their server decodes before averaging.

* **Top-k** (Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP
  2017; Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018): per floating
  tensor of ``n`` entries, the ``k = ceil(fraction * n)`` entries of largest magnitude travel as
  ``values`` (``k``, the wire dtype) and ``index`` (``k`` flat positions, int32, int64 for a
  tensor of more than 2^31 entries). Ties in magnitude go to the lower index, so the selection
  is a function of the tensor alone; the indices are sent in increasing order.
* **QSGD** (Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient SGD via
  Gradient Quantization and Encoding", NeurIPS 2017): per floating tensor ``v``, its norm
  ``||v||_2`` (one value of the wire dtype, rounded up to it) and per entry the signed integer
  code ``c_i = sign(v_i) * l_i``, ``l_i`` in ``{0, ..., s}`` (``s`` = levels) drawn by stochastic
  rounding of ``s |v_i| / ||v||`` so that ``E[l_i] = s |v_i| / ||v||``: the decode
  ``||v|| c_i / s`` is unbiased. Codes are int8 for ``s <= 127``, int16 up to ``s = 32767``
  (no entropy coding: the bytes counted are the codes'). Quantizing relative to the norm *as
  sent* keeps the estimate unbiased whatever the wire dtype of the norm.
* **Error feedback** (Stich et al. 2018; Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback
  Fixes SignSGD and other Gradient Compression Schemes", ICML 2019): the client compresses
  ``x = delta + e`` and keeps ``e <- x - decode(encode(x))``, so what one round leaves out (and
  the rounding of a 16-bit value) is sent in a later one. :func:`compress_update`.

Array names: a floating tensor ``w`` becomes ``w.values`` and ``w.index`` (top-k) or ``w.norm``
and ``w.code`` (QSGD); a non-floating tensor (an integer buffer) travels as ``w``, unchanged.
A state-dict name is never a prefix of another plus a dot (a tensor is not a module), so the
names cannot collide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import torch

from fedlore.types import Arrays

KINDS = ("none", "topk", "qsgd")
"""The ``compression`` settings: no compression, top-k sparsification, QSGD."""

MAX_LEVELS = 32767
"""The most QSGD levels: the largest code that int16 holds."""

INT8_LEVELS = 127
"""The most QSGD levels whose signed codes fit int8."""

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def topk_count(numel: int, fraction: float) -> int:
    """``k = ceil(fraction * numel)``, with ``fraction`` read as the decimal it prints as
    (``0.07 * 100`` is 7, not the 8 that float arithmetic would give)."""
    return math.ceil(Fraction(repr(float(fraction))) * numel)


def index_dtype(numel: int) -> torch.dtype:
    """int32 for the flat positions of a tensor of up to 2^31 entries, else int64."""
    return torch.int32 if numel <= 2**31 else torch.int64


def code_dtype(levels: int) -> torch.dtype:
    """int8 for the signed QSGD codes of up to 127 levels, int16 up to :data:`MAX_LEVELS`."""
    return torch.int8 if levels <= INT8_LEVELS else torch.int16


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The flat positions (int64, increasing) of the ``k`` entries of ``x`` of largest
    magnitude; among equal magnitudes the lower positions; NaN counts as the largest (so a
    non-finite delta is sent, and rejected by the server, rather than hidden)."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    mag = flat.abs()
    mag = torch.where(torch.isnan(mag), torch.full_like(mag, math.inf), mag)
    kth = torch.topk(mag, k, sorted=False).values.min()  # fewer than k above it, k or more >=
    above = torch.nonzero(mag > kth).reshape(-1)
    tied = torch.nonzero(mag == kth).reshape(-1)[: k - above.numel()]
    return torch.cat([above, tied]).sort().values


def round_up(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest ``dtype`` number at or above the float64 scalar ``value`` (on the CPU)."""
    exact = value.detach().to("cpu", torch.float64)
    out = exact.to(dtype)
    if bool(out.to(torch.float64) < exact):
        out = torch.nextafter(out, torch.tensor(math.inf, dtype=dtype, device=out.device))
    return out


@dataclass(frozen=True)
class Codec:
    """One compression setting: ``kind`` (``topk`` or ``qsgd``), top-k's ``fraction``, QSGD's
    ``levels`` s, and ``wire``, the dtype floating values travel in (None: the tensor's own;
    fp16 / bf16 under a 16-bit ``transport_dtype``)."""

    kind: Literal["topk", "qsgd"]
    fraction: float = 0.01
    levels: int = INT8_LEVELS
    wire: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("topk", "qsgd"):
            raise ValueError(f"compression kind must be topk or qsgd, got {self.kind!r}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"top-k fraction must be in (0, 1], got {self.fraction!r}")
        if not 1 <= self.levels <= MAX_LEVELS:
            raise ValueError(f"QSGD levels must be in [1, {MAX_LEVELS}], got {self.levels!r}")

    def parts(self, shape: tuple[int, ...], dtype: torch.dtype) -> Spec:
        """``{part: (shape, dtype)}`` of the encoding of a floating tensor of ``shape`` and
        ``dtype``: ``values`` and ``index`` (top-k), ``norm`` and ``code`` (QSGD)."""
        numel = math.prod(shape)
        value = self.wire or dtype
        if self.kind == "topk":
            k = topk_count(numel, self.fraction)
            return {"values": ((k,), value), "index": ((k,), index_dtype(numel))}
        return {"norm": ((), value), "code": (tuple(shape), code_dtype(self.levels))}

    def encode(self, x: torch.Tensor, rng: torch.Generator) -> Arrays:
        """``x`` (floating) encoded: its parts (:meth:`parts`). QSGD draws one uniform per
        entry from ``rng`` (a CPU generator; top-k draws nothing)."""
        if self.kind == "topk":
            idx = topk_indices(x, topk_count(x.numel(), self.fraction))
            values = x.detach().reshape(-1)[idx].to(self.wire or x.dtype).contiguous()
            return {"values": values, "index": idx.to(index_dtype(x.numel())).contiguous()}
        return self._quantize(x, rng)

    def _quantize(self, x: torch.Tensor, rng: torch.Generator) -> Arrays:
        s = self.levels
        v = x.detach().to(torch.float64)
        norm = round_up(torch.linalg.vector_norm(v), self.wire or x.dtype)
        u = torch.rand(tuple(x.shape), generator=rng, dtype=torch.float64).to(x.device)
        scale = float(norm)
        if not (math.isfinite(scale) and scale > 0):  # zero delta, or non-finite (rejected)
            code = torch.zeros(x.shape, dtype=code_dtype(s), device=x.device)
        else:
            # within [0, s]: the norm is rounded up, but torch's norm of tiny float64 entries
            # (squares below the normal range) can come out below the largest |v_i|
            level = (v.abs() / scale * s).clamp_(0, s)
            low = level.floor()
            level = low + (u < level - low).to(torch.float64)
            code = (torch.sign(v) * level).to(code_dtype(s))
        return {"norm": norm.to(x.device), "code": code.contiguous()}

    def decode(self, parts: Arrays, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The dense tensor of ``shape`` and ``dtype`` that ``parts`` encode (zeros off the
        top-k support; ``norm * code / s`` for QSGD, computed in float64)."""
        if self.kind == "topk":
            values, index = parts["values"], parts["index"]
            out = torch.zeros(math.prod(shape), dtype=dtype, device=values.device)
            out[index.to(torch.int64)] = values.to(dtype)
            return out.reshape(shape)
        norm, code = parts["norm"], parts["code"]
        wide = norm.to(torch.float64) * code.to(torch.float64) / self.levels
        return wide.to(dtype).reshape(shape)

    def problem(self, parts: Arrays, shape: tuple[int, ...]) -> str | None:
        """Why ``parts`` (of the right shapes and dtypes) encode no tensor of ``shape``, or
        None: a top-k index outside ``[0, numel)`` or given twice; a QSGD norm that is negative
        or not finite, or a code outside ``[-s, s]``."""
        numel = math.prod(shape)
        if self.kind == "topk":
            index = parts["index"].to(torch.int64)
            if index.numel() == 0:
                return None
            lo, hi = int(index.min()), int(index.max())
            if lo < 0 or hi >= numel:
                return f"index {lo if lo < 0 else hi} out of range [0, {numel})"
            ordered = index.sort().values
            same = ordered[1:] == ordered[:-1]
            if bool(same.any()):
                return f"index {int(ordered[1:][same][0])} given twice"
            return None
        norm = float(parts["norm"])
        if not (math.isfinite(norm) and norm >= 0):
            return f"norm {norm} is not a finite number >= 0"
        code = parts["code"]
        if code.numel():
            lo, hi = int(code.min()), int(code.max())
            if lo < -self.levels or hi > self.levels:
                bad = lo if lo < -self.levels else hi
                return f"code {bad} outside [-{self.levels}, {self.levels}]"
        return None


def floating(like: Spec) -> list[str]:
    """The names of ``like`` (``{name: (shape, dtype)}``) whose tensors are compressed: the
    floating ones."""
    return [k for k, (_, dtype) in like.items() if dtype.is_floating_point]


def update_spec(codec: Codec, like: Spec) -> Spec:
    """``{array name: (shape, dtype)}`` of an encoded update of the tensors ``like``
    (``{name: (shape, model dtype)}``): each floating tensor's parts as ``<name>.<part>``, the
    others as ``<name>`` unchanged."""
    out: Spec = {}
    for name, (shape, dtype) in like.items():
        if dtype.is_floating_point:
            for part, spec in codec.parts(shape, dtype).items():
                out[f"{name}.{part}"] = spec
        else:
            out[name] = (shape, dtype)
    return out


def update_problem(codec: Codec, arrays: Arrays, like: Spec) -> str | None:
    """The first reason (in name order of ``like``) why ``arrays``, already of the shapes and
    dtypes of :func:`update_spec`, are no encoding of tensors ``like``; None when they are."""
    for name in floating(like):
        parts = {p: arrays[f"{name}.{p}"] for p in codec.parts(*like[name])}
        why = codec.problem(parts, like[name][0])
        if why is not None:
            return f"{name}: {why}"
    return None


def decode_update(codec: Codec, arrays: Arrays, like: Spec) -> Arrays:
    """The dense update (``{name: tensor}`` of ``like``'s shapes and dtypes) that ``arrays``
    encode."""
    out: Arrays = {}
    for name, (shape, dtype) in like.items():
        if dtype.is_floating_point:
            parts = {p: arrays[f"{name}.{p}"] for p in codec.parts(shape, dtype)}
            out[name] = codec.decode(parts, shape, dtype)
        else:
            out[name] = arrays[name]
    return out


def compress_update(
    codec: Codec,
    delta: Arrays,
    memory: Arrays | None,
    rng: torch.Generator,
    feedback: bool,
) -> tuple[Arrays, Arrays]:
    """A client's upload and its new error-feedback memory.

    Each floating tensor ``x = delta + e`` (``e`` from ``memory``, zero when absent) is encoded
    (:meth:`Codec.encode`, in name order, so QSGD's draws from ``rng`` are in a fixed order);
    with ``feedback`` the memory becomes ``x - decode(encode(x))`` at the tensor's dtype (what
    was not delivered, the rounding of 16-bit values included), else it stays empty. A tensor
    ``x`` with a non-finite entry (a diverged round, whose upload the server rejects) leaves its
    memory as it was. Non-floating tensors are sent as they are.

    Returns:
        (the encoded arrays, named as :func:`update_spec` names them; the new memory by tensor
        name, empty without ``feedback``).
    """
    memory = memory or {}
    sent: Arrays = {}
    kept: Arrays = {}
    for name in sorted(delta):
        d = delta[name]
        if not d.is_floating_point():
            sent[name] = d
            continue
        e = memory.get(name)
        x = d if e is None else d + e.to(d.dtype)
        parts = codec.encode(x, rng)
        sent.update({f"{name}.{p}": t for p, t in parts.items()})
        if not feedback:
            continue
        if bool(torch.isfinite(x).all()):
            kept[name] = (x - codec.decode(parts, tuple(x.shape), x.dtype)).contiguous()
        elif e is not None:
            kept[name] = e
    return sent, kept
