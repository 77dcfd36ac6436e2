"""Who masks with whom in a secure round, when the survivors still form one group, and how a
threshold setting becomes a count."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


def neighbours(clients: list[int], degree: int, seed: int) -> dict[int, list[int]]:
    """Who masks with whom in a round: every pair of ``clients`` when ``degree`` is 0 or at
    least ``len(clients) - 1`` (SecAgg, Bonawitz et al. 2017), else the Harary graph of SecAgg+
    (Bell et al., CCS 2020, §3): the clients on a ring in a seeded (public) random order, each
    joined to the ``degree // 2`` nearest on either side (``degree`` rounded up to even), so each
    client draws O(degree · L) mask entries instead of O(m · L). The relation is symmetric, so
    the masks still cancel in the sum.

    Args:
        clients: the round's sampled client ids. seed: public seed of the ring order.
    """
    m = len(clients)
    if degree <= 0 or degree >= m - 1:
        return {c: [j for j in clients if j != c] for c in clients}
    half = (degree + 1) // 2
    order = [clients[i] for i in np.random.default_rng(seed).permutation(m)]
    out: dict[int, set[int]] = {c: set() for c in clients}
    for q, c in enumerate(order):
        for d in range(1, half + 1):
            j = order[(q + d) % m]
            out[c].add(j)
            out[j].add(c)
    return {c: sorted(v) for c, v in out.items()}


def connected(nodes: set[int], graph: Mapping[int, tuple[int, ...] | list[int]]) -> bool:
    """Whether ``nodes`` form one connected component of ``graph`` restricted to them."""
    if not nodes:
        return False
    start = min(nodes)
    seen, todo = {start}, [start]
    while todo:
        u = todo.pop()
        for v in graph[u]:
            if v in nodes and v not in seen:
                seen.add(v)
                todo.append(v)
    return seen == nodes


def threshold_count(value: int | float, holders: int) -> int:
    """A threshold setting as a count: an int as it is, a fraction ``f`` of ``holders`` as
    ``ceil(f · holders)``; at least 2 either way.

    Raises:
        ValueError: for a float outside (0, 1] (a count is an int).
    """
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"a threshold fraction must be in (0, 1], got {value!r}")
        return max(2, math.ceil(value * holders - 1e-9))
    return max(2, int(value))
