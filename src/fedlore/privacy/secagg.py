"""In-process secure aggregation: fixed-point vectors with pairwise masks that cancel in the sum.

The algebra of Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning" (CCS 2017), §4, without its cryptography: client ``i`` of the round's sampled set ``S``
encodes its vector ``v_i`` in fixed point in the ring Z_{2^64} and uploads

    y_i = enc(v_i) + Σ_{j ∈ S, j > i} PRG(s_ij) − Σ_{j ∈ S, j < i} PRG(s_ij)   (mod 2^64),

where ``s_ij = s_ji`` is a seed the pair shares for this round. Each mask is uniform on the
ring, so ``y_i`` alone is uniform whatever ``v_i`` is; in ``Σ_{i ∈ S} y_i`` every mask appears
once with each sign and cancels, leaving ``Σ enc(v_i)``. When clients drop out after the masks
were fixed, the survivors reveal their seeds with the dropped clients (the paper's unmasking
round; a dropped client's own vector never arrives, so revealing them discloses nothing) and the
server removes those masks.

What this simulates and what it does not: the pair seeds come from a per-run secret derived
from the run seed inside the client-side functions here (the paper agrees them by Diffie-Hellman
and secret-shares them with Shamir's scheme so the unmasking survives further dropouts); the
server-side code (:func:`unmask_sum`) sees only masked vectors and the revealed seeds. The real
protocol, for deployments, is Flower's SecAgg+ (``fedlore.flower``).

Fixed point: ``enc(x) = round(x · 2^F)`` with ``F = FRACTION_BITS``; the sum of ``k`` encoded
vectors is exact in the ring while ``|Σ enc| < 2^63``, so the decoded sum differs from the real
sum by at most ``k · 2^-(F+1)`` per coordinate.
"""

from __future__ import annotations

import numpy as np
import torch

from fedlore.seeding import SECAGG, derive_seed

FRACTION_BITS = 24
"""F: fixed-point resolution 2^-24 (about 6e-8) per coordinate."""
LIMIT = float(2 ** (43 - FRACTION_BITS))
"""Largest |v| a client may encode (2^19 = 524,288): each encoded entry stays below 2^43, so the
sum of up to 2^20 clients stays below 2^63 and is exact in the ring."""


def encode(vector: torch.Tensor) -> np.ndarray:
    """``round(v · 2^F)`` as ring elements (uint64, two's complement for negatives).

    Args:
        vector: 1-D floating tensor (any device).

    Raises:
        ValueError: if an entry is not finite or ``|v| >= LIMIT``.
    """
    v = vector.detach().to("cpu", torch.float64).numpy()
    if not np.isfinite(v).all():
        raise ValueError("the upload vector contains NaN or Inf; it cannot be masked")
    big = float(np.abs(v).max()) if v.size else 0.0
    if big >= LIMIT:
        raise ValueError(f"upload entry {big:.3g} is too large for fixed point (limit {LIMIT:g})")
    return np.rint(v * 2.0**FRACTION_BITS).astype(np.int64).view(np.uint64)


def decode(ring: np.ndarray) -> torch.Tensor:
    """The float64 values of ring elements (signed two's complement) divided by 2^F."""
    return torch.from_numpy(ring.view(np.int64).astype(np.float64) / 2.0**FRACTION_BITS)


def pair_seed(secret: int, rnd: int, i: int, j: int) -> int:
    """s_ij = s_ji: the seed clients ``i`` and ``j`` share in round ``rnd``."""
    lo, hi = min(i, j), max(i, j)
    return derive_seed(secret, SECAGG, rnd, lo, hi)


def _prg(seed: int, length: int) -> np.ndarray:
    """``length`` uniform ring elements from ``seed`` (PCG64 raw 64-bit outputs)."""
    return np.random.PCG64(seed).random_raw(length).astype(np.uint64)


def mask(encoded: np.ndarray, client: int, peers: list[int], rnd: int, secret: int) -> np.ndarray:
    """``y_i = enc(v_i) + Σ_{j>i} PRG(s_ij) − Σ_{j<i} PRG(s_ij)`` (mod 2^64) over the other
    clients ``peers`` of the round (the client itself is skipped if listed)."""
    out = encoded.copy()
    with np.errstate(over="ignore"):
        for j in peers:
            if j == client:
                continue
            m = _prg(pair_seed(secret, rnd, client, j), out.size)
            out = out + m if j > client else out - m
    return out


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


def reveal(client: int, dropped: list[int], rnd: int, secret: int) -> dict[int, int]:
    """What surviving ``client`` tells the server in the unmasking step: its pair seeds with
    the clients that dropped out (their uploads never arrive, so these seeds unmask nothing of
    theirs)."""
    return {j: pair_seed(secret, rnd, client, j) for j in dropped if j != client}


def unmask_sum(masked: dict[int, np.ndarray], revealed: dict[int, dict[int, int]]) -> np.ndarray:
    """``Σ_i enc(v_i)`` over the survivors ``masked`` (client id -> masked upload), with the
    masks they shared with dropped clients removed using the seeds each survivor ``revealed``
    (survivor -> {dropped client: seed}).

    Raises:
        ValueError: if there is no upload or the uploads differ in length.
    """
    if not masked:
        raise ValueError("no masked upload to sum")
    sizes = {v.size for v in masked.values()}
    if len(sizes) != 1:
        raise ValueError(f"masked uploads differ in length: {sorted(sizes)}")
    total = np.zeros(sizes.pop(), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for y in masked.values():
            total = total + y
        for i, seeds in revealed.items():
            for j, seed in seeds.items():  # i added +PRG if j > i, -PRG if j < i
                m = _prg(seed, total.size)
                total = total - m if j > i else total + m
    return total
