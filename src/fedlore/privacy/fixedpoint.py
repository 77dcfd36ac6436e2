"""Fixed point in the ring Z_{2^64}, its resolution chosen from the bound on the entries and the
number of clients summed.

Secure aggregation sums integers modulo 2^64. A client's vector ``v`` (entries bounded by ``B``:
the DP clip norm plus its noise share's tail, or ``secure_aggregation_range`` without DP) is
encoded as ``round(v · 2^F)``; the sum of ``m`` encodings stays below ``m · B · 2^F`` in absolute
value, which must stay below 2^63 for the signed sum to be exact in the ring. As SecAgg+ derives
its quantization step from the clipping range and the number of clients (Bell et al. 2020,
§5; flwr's ``quantization_range`` = ``modulus_range / clients``), :meth:`FixedPoint.for_sum`
takes the largest ``F`` with ``m · B · 2^F ≤ 2^62`` (one bit of margin): with ``B = 1`` and
``m = 100``, F = 55 (resolution 2.8e-17).

Nothing disappears unnoticed: an entry beyond ``±B`` is clipped to it and counted (``clipped``),
and an upload that loses precision in the encoding has its imprecise entries counted
(``underflow``); both counts travel inside the masked sum, so the server learns only their totals.

What counts as lost precision. Every entry is rounded to the nearest multiple of the resolution
``r = 2^-F``, so each carries an error of at most ``r / 2``: the fixed point's promise, kept by
every entry, those that round to 0 included (their error, their whole value, is under ``r / 2``
too). An entry that rounds to 0 is therefore no loss in itself: the entries of SCAFFOLD's
control-variate increments or of a converged layer are often far below ``r`` beside entries
of 0.1, and the model they update (float32, whose step at 0.1 is ``7e-9``) could not hold them
either. Precision is lost when the rounding error is large *against the upload itself*: an
upload ``v`` whose encoding ``Q(v)`` errs by more than float32's relative precision,

    ‖Q(v) − v‖₂ > ρ ‖v‖₂,   ρ = 2^-24 (:data:`RELATIVE_PRECISION`),

keeps fewer significant bits in the sum than the float32 training it came from had (an entry
bound ``B`` far above the uploads: ``secure_aggregation_range`` set too large, or a learning rate
too small for it). In such an upload every nonzero entry whose own rounding error exceeds
``ρ |x|`` (all those that encoded to 0 among them) is counted; an upload within the bound counts
none. The bound is computed per upload, from its own entries, on the client, after clipping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

RING_BITS = 64
"""Arithmetic modulo 2^64 (numpy uint64 wraps around)."""
MARGIN_BITS = 2
"""Bits kept free at the top: the sum's magnitude stays below 2^(64 − 2) = 2^62."""
MIN_FRACTION_BITS = 24
"""The coarsest resolution accepted (2^-24, float32's relative precision at 1)."""
RELATIVE_PRECISION = 2.0**-24
"""ρ, float32's unit roundoff: an upload whose encoding errs by more than ρ times its norm has
lost precision (see the module docstring)."""


@dataclass(frozen=True)
class FixedPoint:
    """Signed fixed point with ``fraction_bits`` bits after the point, entries within ``bound``.

    Attributes:
        fraction_bits: F: ``enc(x) = round(x · 2^F)``.
        bound: B: entries beyond ``±B`` are clipped to it (and counted).
    """

    fraction_bits: int
    bound: float

    def __post_init__(self) -> None:
        if not (self.bound > 0 and math.isfinite(self.bound)):
            raise ValueError(f"a fixed-point bound must be positive and finite, got {self.bound}")
        if not MIN_FRACTION_BITS <= self.fraction_bits <= RING_BITS - MARGIN_BITS:
            raise ValueError(
                f"fixed point needs {MIN_FRACTION_BITS} to {RING_BITS - MARGIN_BITS} fraction "
                f"bits, got {self.fraction_bits}"
            )

    @classmethod
    def for_sum(cls, bound: float, clients: int) -> FixedPoint:
        """The finest fixed point in which ``clients`` vectors of entries within ``±bound`` sum
        exactly: the largest F with ``clients · bound · 2^F ≤ 2^62``.

        Raises:
            ValueError: naming both settings when that leaves fewer than
                :data:`MIN_FRACTION_BITS` bits (the bound or the round is too large).
        """
        if clients < 1:
            raise ValueError(f"fixed point for {clients} clients")
        if not (bound > 0 and math.isfinite(bound)):
            raise ValueError(f"a fixed-point bound must be positive and finite, got {bound}")
        bits = math.floor(RING_BITS - MARGIN_BITS - math.log2(clients * bound))
        bits = min(bits, RING_BITS - MARGIN_BITS)
        if bits < MIN_FRACTION_BITS:
            raise ValueError(
                f"secure aggregation: {clients} clients with entries up to {bound:g} leave "
                f"{bits} fraction bits in the 64-bit ring (at least {MIN_FRACTION_BITS} are "
                "needed): lower secure_aggregation_range (or dp.clip_norm), or sample fewer "
                "clients per round"
            )
        return cls(bits, float(bound))

    @property
    def resolution(self) -> float:
        """2^-F, the step between representable values."""
        return 2.0**-self.fraction_bits

    def encode(
        self, vector: torch.Tensor, measured: int | None = None
    ) -> tuple[np.ndarray, int, int]:
        """``round(v · 2^F)`` as ring elements (uint64, two's complement), with the number of
        entries that lost precision (``underflow``: when the encoding of the clipped upload errs
        by more than :data:`RELATIVE_PRECISION` times its norm, its nonzero entries whose own
        error exceeds that share of their size, those that encoded to 0 included; else 0) and
        of entries clipped to ``±B``. ``measured``: how many leading entries form the upload
        whose precision is judged (None: all; the weight entry a secure round appends is left
        out, or it would hide any loss in a tiny upload behind its own norm).

        Raises:
            ValueError: if an entry is not finite.
        """
        v = vector.detach().to("cpu", torch.float64).numpy()
        if not np.isfinite(v).all():
            raise ValueError("the upload vector contains NaN or Inf; it cannot be encoded")
        over = np.abs(v) > self.bound
        clipped = int(over.sum())
        if clipped:
            v = np.clip(v, -self.bound, self.bound)
        q = np.rint(v * 2.0**self.fraction_bits)
        n = len(v) if measured is None else measured
        return q.astype(np.int64).view(np.uint64), self.imprecise(v[:n], q[:n]), clipped

    def imprecise(self, v: np.ndarray, q: np.ndarray) -> int:
        """The entries of ``v`` (float64, within ``±B``) that lost precision in their encoding
        ``q`` (:meth:`encode`'s ``underflow``): none when ``‖q r − v‖ ≤ ρ ‖v‖``."""
        err = np.abs(q * self.resolution - v)
        if float(np.linalg.norm(err)) <= RELATIVE_PRECISION * float(np.linalg.norm(v)):
            return 0  # every entry within the rounding the fixed point promises
        return int(((err > RELATIVE_PRECISION * np.abs(v)) & (v != 0)).sum())

    def decode(self, ring: np.ndarray) -> torch.Tensor:
        """The float64 values of ring elements (signed two's complement) divided by 2^F."""
        return torch.from_numpy(ring.view(np.int64).astype(np.float64) * self.resolution)
