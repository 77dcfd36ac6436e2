"""What one secure round sums and what comes back: the layout of the in-process ring vector
(:class:`SecurePlan`) and the result of a secure round on any engine (:class:`SecureSum`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fedlore.privacy import secagg
from fedlore.privacy.client import Contribution
from fedlore.privacy.fixedpoint import FixedPoint
from fedlore.types import Scalars

COUNTS = ("secagg_underflow", "secagg_clipped_entries")
"""Secure aggregation without DP: how many upload entries lost precision in the fixed point
(entries of uploads whose encoding errs by more than 2^-24 of their norm,
:mod:`fedlore.privacy.fixedpoint`), and how many were clipped to ``±secure_aggregation_range``
(totals over the round's survivors)."""
WHY = {
    "secagg_underflow": (
        "upload entries that lost precision in the fixed point: uploads whose encoding errs by "
        "more than 2^-24 of their norm; secure_aggregation_range is far above the uploads"
    ),
    "secagg_clipped_entries": "upload entries clipped to ±secure_aggregation_range",
}
"""What the round loop's warning says beside each nonzero count of :data:`COUNTS`."""


@dataclass(frozen=True)
class SecurePlan:
    """The public description of one in-process secure round: who masks with whom, the
    thresholds, the fixed point and the layout of the summed vector
    ``[w x (L), w e (E), w (1)]`` (e: the contribution's extras, adaptive clipping's noised bit)
    followed, without DP, by the raw counts of :data:`COUNTS`.

    Attributes:
        params: the protocol's round parameters (mask graph, thresholds).
        fixed: the fixed point of the float entries.
        spec_len: L, the upload's entries.
        extras: E, entries summed beside the upload.
        counts: append the underflow and clipped-entry counts (secure aggregation alone).
        max_weight: W; a client's weight entry is p_i / W.
    """

    params: secagg.RoundParams
    fixed: FixedPoint
    spec_len: int
    extras: int
    counts: bool
    max_weight: float

    @property
    def length(self) -> int:
        """Entries of each masked vector."""
        return self.spec_len + self.extras + 1 + (len(COUNTS) if self.counts else 0)

    @property
    def min_survivors(self) -> int:
        return self.params.min_survivors

    def encode(self, c: Contribution) -> np.ndarray:
        """A client's vector in the ring (uint64, :attr:`length` entries).

        Raises:
            ValueError: when the vector has another length, or the weight exceeds W.
        """
        if c.vector.numel() != self.spec_len or c.extras.numel() != self.extras:
            raise ValueError(
                f"upload has {c.vector.numel()} + {c.extras.numel()} entries, expected "
                f"{self.spec_len} + {self.extras}"
            )
        w = c.weight / self.max_weight
        if not 0 < w <= 1:
            raise ValueError(
                f"weight {c.weight:g} is outside (0, {self.max_weight:g}], the largest client "
                "weight known when the run started"
            )
        v = torch.cat([c.summed * w, torch.tensor([w], dtype=torch.float64, device="cpu")])
        ring, underflow, clipped = self.fixed.encode(v, measured=self.spec_len)
        if self.counts:
            ring = np.concatenate([ring, np.array([underflow, clipped], dtype=np.uint64)])
        return ring

    def decode(self, total: np.ndarray) -> tuple[torch.Tensor, float, dict[str, int]]:
        """(Σ w_i [x_i, e_i] as float64, Σ w_i, the counts) of a summed vector."""
        n = self.spec_len + self.extras
        floats = self.fixed.decode(total[: n + 1])
        counts = {}
        if self.counts:
            counts = dict(zip(COUNTS, (int(x) for x in total[n + 1 :].view(np.int64)), strict=True))
        return floats[:n], float(floats[n]), counts


@dataclass
class SecureSum:
    """The result of one secure round, in process or on Flower.

    Attributes:
        mean: float64 ``(L + E,)`` CPU tensor, ``Σ p_i v_i / Σ p_i`` over the clients whose
            vectors entered the sum (v_i: a :class:`~fedlore.privacy.client.Contribution`'s
            ``summed``).
        clients: their client ids, sorted.
        metrics: per contributing client, the metrics it sent in the clear.
        bytes_up: bytes the clients sent for the round (masked vectors; in process also the
            keys, encrypted shares and unmasking answers).
        bytes_down: in process, bytes of the protocol's own messages to the clients (the
            broadcasts are counted by the loop).
        counts: totals of :data:`COUNTS` (in process, secure aggregation alone).
        reasons: why each other sampled client is not in the sum.
    """

    mean: torch.Tensor
    clients: list[int]
    metrics: dict[int, Scalars] = field(default_factory=dict)
    bytes_up: int = 0
    bytes_down: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
