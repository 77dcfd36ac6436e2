"""Which route computes a client's candidate basis, per matrix (``candidate_svd: auto``).

FedLore's client candidate ``P_i`` is the top-r left singular vectors of its last local
gradient (seed ``000_7a70688bd6d66f38`` Algorithm 1 line 21, TopLeftSVD). The exact route
(:func:`fedlore.optim.subspace.top_left_singular`, the seed's rule) costs about ``s·m·n``
multiply-adds in float64 for an ``m x n`` view with ``s = min(m, n)`` (``A Aᵀ`` and its
``s x s`` eigh, or the SVD of a tall matrix), whatever the rank. The warm-started subspace
route (:func:`fedlore.optim.subspace.subspace_iteration`) costs about
``((2 q + 1)(r + p) + p)·m·n`` multiply-adds in the gradient's dtype (``p`` sketch columns
``A Ω``, ``q`` iterations of ``A (Qᵀ A)ᵀ`` on the ``r + p`` block, the final ``Qᵀ A``). The
subspace route pays when ``r + p`` is small against ``s`` — and that is also where it is
accurate: its error shrinks like ``(σ_{r+p+1} / σ_r)^{2q}``, and a block much narrower than
the matrix leaves a tail to skip (Halko, Martinsson & Tropp, SIAM Review 2011, section 10;
Golub & Van Loan, Matrix Computations, 4th ed., section 8.2.4).
"""

from __future__ import annotations

from typing import Literal

Route = Literal["exact", "subspace"]

AUTO_MARGIN = 2
"""The subspace route must need at most ``1 / AUTO_MARGIN`` of the exact route's multiply-adds
(see :func:`candidate_route`)."""


def subspace_macs(m: int, n: int, rank: int, oversample: int, niter: int) -> int:
    """Multiply-adds of the subspace route's products on an ``m x n`` matrix:
    ``((2·niter + 1)(rank + oversample) + oversample)·m·n`` (the QRs and the small SVD,
    ``O((m + n)(r + p)²)``, are left out)."""
    return ((2 * niter + 1) * (rank + oversample) + oversample) * m * n


def exact_macs(m: int, n: int) -> int:
    """Multiply-adds of the exact route's product on an ``m x n`` matrix: ``min(m, n)·m·n``
    (``A Aᵀ`` for a wide matrix, the SVD's leading term for a tall one; the ``min(m, n)³``
    eigh is left out, which only favours the exact route)."""
    return min(m, n) * m * n


def candidate_route(
    m: int, n: int, rank: int, oversample: int, niter: int, warm: bool = True
) -> Route:
    """The route ``candidate_svd: auto`` takes for one ``m x n`` gradient view at rank r.

    ``"subspace"`` when a warm start exists (``warm``: the client's current basis ``P^t``),
    ``oversample >= 1``, ``niter >= 1`` and :func:`subspace_macs` is at most half of
    :func:`exact_macs`, i.e. ``2·((2·niter + 1)(r + p) + p) <= min(m, n)``; else ``"exact"``.
    At the defaults (p = 10, niter = 2) that is ``10 r + 120 <= min(m, n)``: r = 8 needs
    ``min(m, n) >= 200``, r = 32 needs ``>= 440``.

    Why (``benchmarks/subspace.py`` on gradients captured from real FedLore runs, one thread,
    ``benchmarks/results/subspace.json``):

    * CNN fc 512 x 3136, r = 8 (``r + p`` = 3.5 % of the short side; the rule: subspace): the
      subspace route took 44 ms against 381 ms and kept at least 99.9999 % of the exact
      top-r's captured energy on every one of 30 captured gradients.
    * CNN conv2 64 x 800 and conv1 32 x 25, r = 8 (28 % and 72 %; the rule: exact): the
      subspace route was slower than exact (5.6 vs 3.5 ms, 0.7 vs 0.5 ms).
    * LLaMA 128 x 128 / 352 x 128 / 128 x 352, r = 32 (33 %; the rule: exact): it saved
      little or nothing (8.1 vs 11.6 ms, 12.8 vs 21.2, 25.3 vs 22.9) and lost up to 0.33 % of
      the energy (3–11 % of the captures beyond 0.1 %): a flat tail next to a wide block.
    * Without sketch columns (p = 0) the route fell short of 0.1 % on 3–48 % of the captures
      even with two iterations (fc worst 99.74 %, LLaMA 128 x 128 worst 98.6 %); with no
      iteration (q = 0) it is one Rayleigh–Ritz step on the start block (the warm start alone
      captured as little as 25 %): both stay exact.
    * Without a warm start the route is a cold randomized range finder: FedLore's setup
      exchange (once per run) and Local GaLore (a baseline: its bases stay the seed's
      Algorithm 2) keep the exact route.

    The margin of 2 leaves the float64 arithmetic and the eigh of the exact route (which make
    it slower per multiply-add) as a safety margin: near the boundary the subspace route was
    measured 16x faster (synthetic 256 x 256, r = 8: 1.1 vs 16.7 ms, 0.9999999 of the exact
    captured energy).

    Args:
        m, n: the gradient view's shape.
        rank: r.
        oversample: p, the sketch columns (``svd_oversample``).
        niter: q, the power iterations (``svd_niter``).
        warm: whether the client holds a current basis to start from.

    Returns:
        ``"subspace"`` or ``"exact"``.
    """
    if not warm or oversample < 1 or niter < 1 or rank + oversample > min(m, n):
        return "exact"
    fits = AUTO_MARGIN * subspace_macs(m, n, rank, oversample, niter) <= exact_macs(m, n)
    return "subspace" if fits else "exact"
