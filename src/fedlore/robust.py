"""Defences against uploads that are valid but absurd: a norm screen of replies and robust
aggregates of dense updates.

* :func:`upload_norm` and :func:`norm_screen`: a reply whose upload norm exceeds
  ``multiple`` × the round's median upload norm is rejected with its reason, like a reply with
  NaN (the screen needs at least :data:`MIN_SCREENED` replies: a median of one or two says
  nothing). Used by :class:`~fedlore.engine.loop.RoundLoop` for every method.
* :func:`combine_updates`: the coordinate-wise median or trimmed mean of the clients' dense
  deltas (Yin, Chen, Ramchandran & Bartlett, "Byzantine-Robust Distributed Learning: Towards
  Optimal Statistical Rates", ICML 2018, Definitions 1 and 2) instead of FedAvg's weighted
  mean, for the methods whose server averages dense deltas (``aggregate`` setting).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedlore.tensors import weighted_mean
from fedlore.types import Arrays, Reply

MIN_SCREENED = 3
"""Fewest valid replies in a round for the norm screen to judge them."""

AGGREGATES = ("mean", "median", "trimmed_mean")


def upload_norm(reply: Reply) -> float:
    """The Euclidean norm of everything a reply uploads for aggregation (scalar): all floating
    arrays but the ``diag.*`` measurements, in float64. For dense methods these are the deltas
    ``Δ_i``; for FedLore the coordinates ΔZ_i, the candidate bases and the dense deltas; for
    the LoRA methods the adapter factors."""
    total = 0.0
    for key, t in reply.arrays.items():
        if key.startswith("diag.") or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        total += float(t.detach().to(torch.float64).pow(2).sum())
    return math.sqrt(total)


def norm_screen(replies: dict[int, Reply], multiple: float | None) -> dict[int, str]:
    """Which replies the norm screen rejects, with the reason.

    Args:
        replies: the round's valid replies by client id.
        multiple: the largest allowed ratio of a reply's :func:`upload_norm` to the round's
            median (``robust.norm_screen``); None turns the screen off.

    Returns:
        ``{client id: reason}`` of the rejected replies (empty with fewer than
        :data:`MIN_SCREENED` replies, when the median is 0, or when ``multiple`` is None).
    """
    if multiple is None or len(replies) < MIN_SCREENED:
        return {}
    norms = {cid: upload_norm(r) for cid, r in replies.items()}
    ordered = sorted(norms.values())
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
    if not median > 0:
        return {}
    return {
        cid: (
            f"upload norm {n:.3g} is {n / median:.3g}x the round's median {median:.3g} "
            f"(robust.norm_screen={multiple:g})"
        )
        for cid, n in norms.items()
        if n > multiple * median
    }


def combine_updates(
    updates: Sequence[Arrays], weights: Sequence[float], rule: str = "mean", trim: float = 0.1
) -> Arrays:
    """Combine the clients' dense deltas key by key.

    Args:
        updates: N dicts of tensors with identical keys and shapes.
        weights: the p_i (used by ``mean`` only; the median and the trimmed mean are unweighted,
            as in Yin et al. 2018).
        rule: ``"mean"`` (``Σ p_i Δ_i / Σ p_i``), ``"median"`` (coordinate-wise median; the mean
            of the two middle values for even N) or ``"trimmed_mean"`` (per coordinate, drop the
            ``floor(trim · N)`` largest and smallest values and average the rest).
        trim: share of clients dropped at each end by ``trimmed_mean``, in [0, 0.5).

    Returns:
        One dict of the same keys, shapes and dtypes (computed in float64; integer tensors are
        taken from the first update).

    Raises:
        ValueError: on an unknown rule, ``trim`` outside [0, 0.5), or empty input.
    """
    if rule == "mean":
        return weighted_mean(updates, weights)
    if rule not in AGGREGATES:
        raise ValueError(f"unknown aggregate {rule!r}; choose one of {AGGREGATES}")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim}")
    if not updates:
        raise ValueError("combine_updates needs at least one update")
    n = len(updates)
    cut = math.floor(trim * n) if rule == "trimmed_mean" else 0
    out: Arrays = {}
    for key, ref in updates[0].items():
        if not ref.is_floating_point():
            out[key] = ref.clone()
            continue
        stacked = torch.stack([u[key].to(torch.float64) for u in updates]).sort(dim=0).values
        if rule == "median":
            mid = n // 2
            value = stacked[mid] if n % 2 else 0.5 * (stacked[mid - 1] + stacked[mid])
        else:
            value = stacked[cut : n - cut].mean(dim=0)
        out[key] = value.to(ref.dtype)
    return out
