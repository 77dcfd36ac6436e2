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

Nothing disappears unnoticed: an entry whose magnitude is under half the resolution encodes to 0
and is counted (``underflow``), an entry beyond ``±B`` is clipped to it and counted
(``clipped``); both counts travel inside the masked sum, so the server learns only their totals.
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

    def encode(self, vector: torch.Tensor) -> tuple[np.ndarray, int, int]:
        """``round(v · 2^F)`` as ring elements (uint64, two's complement), with the number of
        nonzero entries that encoded to 0 (``underflow``) and of entries clipped to ``±B``.

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
        underflow = int(((q == 0) & (v != 0)).sum())
        return q.astype(np.int64).view(np.uint64), underflow, clipped

    def decode(self, ring: np.ndarray) -> torch.Tensor:
        """The float64 values of ring elements (signed two's complement) divided by 2^F."""
        return torch.from_numpy(ring.view(np.int64).astype(np.float64) * self.resolution)
