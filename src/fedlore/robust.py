"""Defences against uploads that are valid but absurd: a norm screen of replies and robust
aggregates of dense updates.

* :func:`upload_norm` and :func:`norm_screen`: a reply whose upload norm exceeds
  ``multiple`` × the round's median upload norm is rejected with its reason, like a reply with
  NaN (the screen needs at least :data:`MIN_SCREENED` replies: a median of one or two says
  nothing). Used by :class:`~fedlore.engine.loop.RoundLoop` for every method.
* :func:`combine_updates`: the coordinate-wise median or trimmed mean of the clients' dense
  deltas (Yin, Chen, Ramchandran & Bartlett, "Byzantine-Robust Distributed Learning: Towards
  Optimal Statistical Rates", ICML 2018, Definitions 1 and 2), Krum and Multi-Krum (Blanchard,
  El Mhamdi, Guerraoui & Stainer, "Machine Learning with Adversaries: Byzantine Tolerant
  Gradient Descent", NeurIPS 2017) or Bulyan (El Mhamdi, Guerraoui & Rouault, "The Hidden
  Vulnerability of Distributed Learning in Byzantium", ICML 2018) instead of FedAvg's weighted
  mean, for the methods whose server averages dense deltas (``aggregate`` setting).

Krum, for n updates of which at most f are Byzantine: each update's score is the sum of its
squared Euclidean distances (over all its floating tensors, flattened) to its n - f - 2 nearest
other updates (at least 1), and the update with the lowest score is the result. Multi-Krum
averages the m lowest-scoring updates with FedAvg's weights (m = ``multi_krum_keep``, default
n - f). Bulyan needs n ≥ 4f + 3: it selects θ = n - 2f updates by Krum one at a time (each
chosen update leaves the pool, the next Krum runs on the rest with the same f), then, per
coordinate, averages the β = θ - 2f selected values closest to their coordinate-wise median.
Ties go to the earlier client, as ``numpy.argsort``'s stable order does in Flower's
``aggregate_krum`` / ``aggregate_bulyan``, which ``tests/test_robust.py`` checks these against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedlore.tensors import weighted_mean
from fedlore.types import Arrays, Reply

MIN_SCREENED = 3
"""Fewest valid replies in a round for the norm screen to judge them."""

AGGREGATES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "bulyan")
DISTANCE_BASED = ("krum", "multi_krum", "bulyan")
"""The aggregates that need ``num_byzantine``, f."""


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


def _flat(update: Arrays) -> torch.Tensor:
    """All floating tensors of one update, flattened in key order (float64)."""
    parts = [
        t.detach().to(torch.float64).reshape(-1) for t in update.values() if t.is_floating_point()
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def krum_scores(updates: Sequence[Arrays], num_byzantine: int) -> list[float]:
    """Each update's Krum score: the sum of its squared distances to its n - f - 2 (at least
    1) nearest other updates."""
    flat = torch.stack([_flat(u) for u in updates])
    dist = torch.cdist(flat, flat).pow(2)  # n x n squared Euclidean distances
    n = len(updates)
    closest = max(1, n - num_byzantine - 2)
    scores = []
    for i in range(n):
        others = torch.cat([dist[i, :i], dist[i, i + 1 :]])
        scores.append(float(others.sort(stable=True).values[:closest].sum()))
    return scores


def _lowest(scores: Sequence[float], k: int) -> list[int]:
    """Indices of the ``k`` lowest scores, ties to the earlier index."""
    return sorted(range(len(scores)), key=lambda i: (scores[i], i))[:k]


def krum(
    updates: Sequence[Arrays], weights: Sequence[float], num_byzantine: int, keep: int | None
) -> Arrays:
    """Krum (``keep`` None or 1: the lowest-scoring update itself) or Multi-Krum (the weighted
    mean of the ``keep`` lowest-scoring updates)."""
    scores = krum_scores(updates, num_byzantine)
    if keep is None or keep <= 1:
        best = _lowest(scores, 1)[0]
        return {k: v.clone() for k, v in updates[best].items()}
    chosen = _lowest(scores, keep)
    return weighted_mean([updates[i] for i in chosen], [weights[i] for i in chosen])


def bulyan(updates: Sequence[Arrays], num_byzantine: int) -> Arrays:
    """Bulyan (module docstring).

    Raises:
        ValueError: when n < 4f + 3.
    """
    n, f = len(updates), num_byzantine
    if n < 4 * f + 3:
        raise ValueError(
            f"Bulyan needs n >= 4f + 3 updates: {n} replies for robust.num_byzantine={f} "
            f"(at most {(n - 3) // 4} Byzantine clients for {n} replies)"
        )
    pool = list(updates)
    selected: list[Arrays] = []
    for _ in range(n - 2 * f):
        best = _lowest(krum_scores(pool, f), 1)[0]
        selected.append(pool.pop(best))
    beta = len(selected) - 2 * f
    out: Arrays = {}
    for key, ref in selected[0].items():
        if not ref.is_floating_point():
            out[key] = ref.clone()
            continue
        stacked = torch.stack([u[key].to(torch.float64) for u in selected])
        median = (
            stacked.median(dim=0).values
            if len(selected) % 2
            else stacked.sort(dim=0)
            .values[len(selected) // 2 - 1 : len(selected) // 2 + 1]
            .mean(dim=0)
        )
        order = (stacked - median).abs().argsort(dim=0, stable=True)[:beta]
        out[key] = stacked.gather(0, order).mean(dim=0).to(ref.dtype)
    return out


def combine_updates(
    updates: Sequence[Arrays],
    weights: Sequence[float],
    rule: str = "mean",
    trim: float = 0.1,
    num_byzantine: int = 0,
    keep: int | None = None,
) -> Arrays:
    """Combine the clients' dense deltas key by key.

    Args:
        updates: N dicts of tensors with identical keys and shapes.
        weights: the p_i (used by ``mean`` only; the median and the trimmed mean are unweighted,
            as in Yin et al. 2018).
        rule: ``"mean"`` (``Σ p_i Δ_i / Σ p_i``), ``"median"`` (coordinate-wise median; the mean
            of the two middle values for even N), ``"trimmed_mean"`` (per coordinate, drop the
            ``floor(trim · N)`` largest and smallest values and average the rest), ``"krum"``,
            ``"multi_krum"`` or ``"bulyan"`` (module docstring).
        trim: share of clients dropped at each end by ``trimmed_mean``, in [0, 0.5).
        num_byzantine: f, the Byzantine clients Krum, Multi-Krum and Bulyan tolerate.
        keep: Multi-Krum's m (None: n - f).

    Returns:
        One dict of the same keys, shapes and dtypes (computed in float64; integer tensors are
        taken from the first update).

    Raises:
        ValueError: on an unknown rule, ``trim`` outside [0, 0.5), empty input, or fewer than
            4f + 3 updates for Bulyan.
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
    if rule == "krum":
        return krum(updates, weights, num_byzantine, None)
    if rule == "multi_krum":
        return krum(updates, weights, num_byzantine, keep or max(1, n - num_byzantine))
    if rule == "bulyan":
        return bulyan(updates, num_byzantine)
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
