"""FedBuff's staleness weighting (:mod:`fedlore.engine.buffered`): w(s) of an update ``s``
server steps stale, and a reply with its update scaled by it."""

from __future__ import annotations

import math

import torch

from fedlore.types import Reply


def staleness_weight(s: int, kind: str, exponent: float = 0.5) -> float:
    """w(s) of an update ``s`` server steps stale: ``sqrt`` 1/sqrt(1+s), ``constant`` 1,
    ``polynomial`` (1+s)^-exponent.

    Raises:
        ValueError: for a negative staleness or an unknown kind.
    """
    if s < 0:
        raise ValueError(f"staleness must be >= 0, got {s}")
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + s)
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((1.0 + s) ** -exponent)
    raise ValueError(f"unknown staleness weighting {kind!r}")


def weighted(reply: Reply, w: float, dtypes: dict[str, torch.dtype]) -> Reply:
    """``reply`` with each ``update.<k>`` scaled by ``w`` at the global tensor's dtype (unchanged
    when w is 1, so a constant weighting changes no bit)."""
    if w == 1.0:
        return reply
    arrays = {
        k: v.to(dtypes[k[7:]]) * w if k.startswith("update.") and k[7:] in dtypes else v
        for k, v in reply.arrays.items()
    }
    return Reply(arrays, dict(reply.metrics))
