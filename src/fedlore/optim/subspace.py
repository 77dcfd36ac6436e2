"""Orthonormal bases of gradient subspaces, and how they are built and averaged.

A projected weight ``W`` (any shape ``[out, ...]``) is seen as a matrix ``view`` of shape
``m x n``: ``W.reshape(out, -1)`` for the *left* side (the seed's convention, Algorithm 1:
``P`` is ``m x r``, coordinates ``r x n``) or its transpose for the *right* side (GaLore's
``proj_type='std'`` choice when ``out >= in``). The side is decided once, when the
:class:`~fedlore.optim.plan.MatrixSpec` is made (:mod:`fedlore.optim.plan`), and every function
below works on the view, so FedLore, Local
GaLore and FedLore-Random share one rule.

Sources: seed ``000_7a70688bd6d66f38`` Algorithm 1 lines 21 and 27 (TopLeftSVD of the last
gradient; of the stacked candidates ``[P_1..P_N]/sqrt(N)``), Algorithm 4 (SharedBasis from a
seed); GaLore (Zhao et al., ICML 2024) for the side rule; Halko, Martinsson & Tropp (SIAM
Review 2011) and Golub & Van Loan (Matrix Computations, orthogonal iteration) for the randomized
and the warm-started subspace routes of a client's candidate (options beside the exact one);
Halko et al. Algorithm 4.1 (randomized range finder) for FedLore-Sketch's seeded test matrix Ω
and its server basis from the mean sketch (issue 20).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

# the projection plan's names, importable from here as before (the plan is fedlore.optim.plan)
from fedlore.optim.plan import MatrixSpec as MatrixSpec
from fedlore.optim.plan import Side as Side
from fedlore.optim.plan import SideRule as SideRule
from fedlore.optim.plan import matrix_spec as matrix_spec
from fedlore.optim.plan import plan_of as plan_of
from fedlore.optim.plan import projection_plan as projection_plan
from fedlore.optim.plan import weight_matrices as weight_matrices
from fedlore.optim.svd import spectral_norm, svd_left


def _fix_signs(u: torch.Tensor) -> torch.Tensor:
    """Make the largest-magnitude entry of each column positive (a deterministic representative)."""
    idx = u.abs().argmax(dim=0)
    signs = torch.sign(u[idx, torch.arange(u.shape[1], device=u.device)])
    signs[signs == 0] = 1.0
    return u * signs


SvdMethod = Literal["exact", "randomized", "subspace"]


def top_left_singular(
    mat: torch.Tensor,
    rank: int,
    method: SvdMethod = "exact",
    generator: torch.Generator | None = None,
    oversample: int = 10,
    niter: int = 2,
    dtype: torch.dtype = torch.float32,
    warm: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Top-r left singular vectors of ``mat`` (TopLeftSVD_r in the seed).

    Computed in ``compute_dtype`` and returned in ``dtype`` (float32 by default; a method passes
    its model's dtype) with a deterministic sign per column. By default the exact and randomized
    routes compute in float64 (the seed's TopLeftSVD; float32 is an option, about twice as fast,
    that changes the bases in the last digits) and the subspace route in ``mat``'s own dtype (at
    least float32): an approximation whose error is far above float32 rounding, and an order of
    magnitude faster there (skinny float64 products are slow on the CPU: 15 ms vs 1.2 ms for
    ``Qᵀ A`` with A 512 x 3136, Q 512 x 8).

    Args:
        mat: ``m x k`` finite matrix.
        rank: r, ``1 <= r <= m``.
        method: ``"exact"`` (eigenvectors of ``A Aᵀ`` when m <= k, else ``torch.linalg.svd``),
            ``"randomized"`` (Halko et al. 2011, range finder with ``r + oversample`` columns and
            ``niter`` power iterations, seeded by ``generator``) or ``"subspace"`` (block power
            iteration warm-started from ``warm``, see :func:`subspace_iteration`). Both
            approximate routes take the exact one when ``r + oversample >= min(m, k)``.
        generator: CPU generator for the random sketch columns.
        oversample: extra columns of the randomized / subspace block.
        niter: power iterations of the randomized and subspace routes.
        dtype: dtype of the result.
        warm: ``m x r`` orthonormal start of the subspace route (a FedLore client's current
            basis ``P^t``); None starts it from the random sketch ``A Ω`` alone.
        compute_dtype: float64 or float32, the arithmetic (None: the defaults above).

    Returns:
        ``m x r`` matrix with orthonormal columns. An all-zero ``mat`` yields the first r
        standard basis vectors (no direction is preferred; documented, never NaN).

    Raises:
        ValueError: if ``mat`` is not 2-D, has non-finite entries, ``rank`` is out of range,
            ``warm`` is not ``m x r``, or ``method`` is unknown.
    """
    if mat.ndim != 2:
        raise ValueError(f"expected a matrix, got shape {tuple(mat.shape)}")
    m, k = mat.shape
    if not 1 <= rank <= m:
        raise ValueError(f"rank must be in [1, {m}], got {rank}")
    if method not in ("exact", "randomized", "subspace"):
        raise ValueError(f"unknown SVD method {method!r}")
    if warm is not None and tuple(warm.shape) != (m, rank):
        raise ValueError(f"warm basis has shape {tuple(warm.shape)}, expected {(m, rank)}")
    approximate = method != "exact" and rank + oversample < min(m, k)
    if compute_dtype is None:
        sub = approximate and method == "subspace"
        compute_dtype = torch.promote_types(mat.dtype, torch.float32) if sub else torch.float64
    a = mat.detach().to(compute_dtype)
    # one reduction for both checks (a NaN propagates to min and max, an Inf reaches one)
    lo, hi = (float(v) for v in torch.aminmax(a))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("cannot take the SVD of a matrix with NaN or Inf entries")
    if lo == 0.0 and hi == 0.0:
        return torch.eye(m, rank, dtype=dtype, device=mat.device)
    if not approximate:
        if m <= k:
            # Left singular vectors are the eigenvectors of A Aᵀ (m x m): an m^2 k product and an
            # m^3 eigh, far cheaper than the SVD of a wide m x k matrix (0.05 s vs 1.3 s for a
            # 512 x 3136 fc gradient here), exact up to float64 rounding of the squared spectrum.
            _, evecs = torch.linalg.eigh(a @ a.t())
            u = evecs.flip(1)[:, :rank]
        else:
            u, _ = svd_left(a)
            u = u[:, :rank]
    elif method == "randomized":
        q = min(rank + oversample, k)
        # drawn by the CPU generator and moved: the same sketch on every device
        omega = torch.randn(k, q, dtype=compute_dtype, generator=generator).to(a.device)
        y, _ = torch.linalg.qr(a @ omega)
        for _ in range(niter):
            z, _ = torch.linalg.qr(a.t() @ y)
            y, _ = torch.linalg.qr(a @ z)
        ub, _ = svd_left(y.t() @ a)
        u = (y @ ub)[:, :rank]
    else:
        u = subspace_iteration(a, rank, warm, niter, oversample, generator)
    if u.shape[1] < rank:  # k < rank: pad with an orthonormal complement
        eye = torch.eye(m, rank, dtype=u.dtype, device=u.device)
        extra = torch.linalg.qr(torch.cat([u, eye], dim=1))[0]
        u = extra[:, :rank]
    return _fix_signs(u).to(dtype).contiguous()


def subspace_iteration(
    a: torch.Tensor,
    rank: int,
    warm: torch.Tensor | None,
    niter: int = 2,
    oversample: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Top-r left singular vectors of ``a`` by block power (orthogonal) iteration from a warm
    start, with a Rayleigh–Ritz step at the end (Golub & Van Loan, *Matrix Computations*, 4th
    ed., Algorithm 8.2.7 "orthogonal iteration" on ``A Aᵀ``; Halko et al. 2011, Algorithm 4.4,
    for the sketch columns and the final projection).

    The block ``Q_0 = orth([P^t, A Ω])`` holds the warm basis ``P^t`` (``m x r``) and
    ``oversample`` sketch columns ``A Ω`` (``Ω`` Gaussian ``k x p`` from ``generator``); each of
    the ``niter`` iterations is ``Q <- orth(A (Aᵀ Q))``; the result is ``Q U_B[:, :r]`` with
    ``U_B`` the left singular vectors of the ``(r + p) x k`` matrix ``B = Qᵀ A``. The angle to
    the top-r subspace shrinks like ``(σ_{r+p+1} / σ_r)^{2 niter}`` times that of the start, so
    a start near the answer (FedLore's next basis is close to the current one) needs few
    iterations. Cost: ``2 (niter + 1) (r + p) m k`` multiply-adds plus QRs of ``m x (r + p)``
    blocks, against ``m^2 k`` for ``A Aᵀ`` and an ``m^3`` eigh on the exact route.

    Args:
        a: ``m x k`` finite matrix (its dtype is the arithmetic's).
        rank: r, ``1 <= r`` and ``r + oversample <= min(m, k)``.
        warm: ``m x r`` start (orthonormal or not: it is orthonormalized); None: the sketch
            alone, ``r + oversample`` columns (then this is the randomized range finder).
        niter: power iterations (0: Rayleigh–Ritz on the start block only).
        oversample: p, extra sketch columns.
        generator: CPU generator for ``Ω`` (drawn on the CPU and moved: the same on every
            device); unused when ``warm`` is given and ``oversample = 0``.

    Returns:
        ``m x r`` with orthonormal columns in ``a``'s dtype, columns by decreasing singular
        value (signs not fixed; :func:`top_left_singular` fixes them).

    Raises:
        ValueError: if the block is wider than ``min(m, k)`` or ``niter < 0``.
    """
    m, k = a.shape
    extra = oversample if warm is not None else rank + oversample
    if rank + oversample > min(m, k) or niter < 0:
        raise ValueError(
            f"subspace iteration needs r + p <= min(m, k) = {min(m, k)} and niter >= 0, got "
            f"r={rank}, p={oversample}, niter={niter}"
        )
    cols = [] if warm is None else [warm.to(a)]
    if extra > 0:
        omega = torch.randn(k, extra, dtype=a.dtype, generator=generator).to(a.device)
        cols.append(a @ omega)
    q, _ = torch.linalg.qr(torch.cat(cols, dim=1) if len(cols) > 1 else cols[0])
    for _ in range(niter):
        # Qᵀ A (q x k) rather than Aᵀ Q: the row-major product, an order of magnitude faster
        # on the CPU for a wide A (1 ms vs 14 ms for 512 x 3136, q = 8)
        q, _ = torch.linalg.qr(a @ (q.t() @ a).t())
    ub, _ = svd_left(q.t() @ a)
    return q @ ub[:, :rank]


def average_projectors(
    bases: list[torch.Tensor],
    weights: list[float],
    rank: int,
    method: Literal["svd", "randomized", "gram"] = "svd",
    generator: torch.Generator | None = None,
    oversample: int = 10,
    niter: int = 2,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Leading rank-r eigenspace of the weighted average projector ``Σ_i p_i P_i P_iᵀ``.

    Uses ``B = [sqrt(p_1) P_1, ..., sqrt(p_N) P_N]`` (``m x N r``), so ``B Bᵀ`` is the average
    projector and its top-r left singular vectors are the next shared basis (seed Algorithm 1
    line 27; with uniform ``p_i = 1/N`` this is ``[P_1..P_N]/sqrt(N)``). ``method="gram"`` takes
    the eigendecomposition of the ``Nr x Nr`` Gram matrix ``BᵀB`` and maps back with
    ``U = B V Σ^{-1}`` (eigenvalues below ``Nr · eps · λ_max`` count as zero; the columns are
    re-orthonormalized and, when the average has rank < r, completed), cheaper when
    ``N r << m``.

    Args:
        bases: N matrices ``m x r_i`` with orthonormal columns.
        weights: N non-negative aggregation weights (normalized here).
        rank: r of the result.
        method: ``"svd"`` (exact), ``"randomized"`` (seeded range finder, see
            :func:`top_left_singular`) or ``"gram"``.
        generator, oversample, niter: settings of the randomized method.
        dtype: dtype of the result.

    Returns:
        ``m x r`` orthonormal basis in ``dtype``.

    Raises:
        ValueError: on empty input, mismatched rows, or non-positive total weight.
    """
    if not bases:
        raise ValueError("average_projectors needs at least one basis")
    m = bases[0].shape[0]
    if any(b.shape[0] != m for b in bases):
        raise ValueError("all candidate bases must have the same number of rows")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError("weights must have a positive sum")
    stacked = torch.cat(
        [
            b.to(torch.float64) * (float(w) / total) ** 0.5
            for b, w in zip(bases, weights, strict=True)
        ],
        dim=1,
    )
    if method == "svd":
        return top_left_singular(stacked, rank, dtype=dtype)
    if method == "randomized":
        return top_left_singular(
            stacked, rank, "randomized", generator, oversample, niter, dtype=dtype
        )
    if method != "gram":
        raise ValueError(f"unknown method {method!r}")
    gram = stacked.t() @ stacked
    evals, evecs = torch.linalg.eigh(gram)  # ascending
    order = torch.argsort(evals, descending=True)[:rank]
    # eigenvalues within the Gram matrix's rounding are zero (the rule of numpy's matrix_rank,
    # on BᵀB): a rank-deficient average (candidates of rank r_i < r) must not turn rounding
    # noise into a direction (issue 28: 1e-10 · σ₁ on the singular values kept it)
    tol = max(gram.shape) * torch.finfo(gram.dtype).eps * max(float(evals[-1]), 0.0)
    keep = order[evals[order] > tol]
    u = stacked @ evecs[:, keep] / evals[keep].sqrt()
    # orthonormal to rounding (a direction just above the cutoff is the least accurate), and
    # completed by standard basis vectors when fewer than r directions are left
    eye = torch.eye(m, rank, dtype=u.dtype, device=u.device)
    u = torch.linalg.qr(torch.cat([u, eye], dim=1))[0][:, :rank]
    return _fix_signs(u).to(dtype).contiguous()


def gaussian_sketch(
    seed: int,
    n: int,
    width: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The test matrix Ω (``n x width``) of a randomized range finder, reproducible from a seed.

    Standard Gaussian entries drawn in float64 by a CPU generator seeded with ``seed``, cast to
    ``dtype`` and moved to ``device`` (drawn on the CPU: bit-identical on every party and
    device). Source: Halko, Martinsson & Tropp (SIAM Review 2011), Algorithm 4.1 step 1.

    Raises:
        ValueError: if ``n < 1`` or ``width < 1``.
    """
    if n < 1 or width < 1:
        raise ValueError(f"a sketch needs n >= 1 and width >= 1, got n={n}, width={width}")
    gen = torch.Generator().manual_seed(int(seed) % (2**63))
    omega = torch.randn(n, width, dtype=torch.float64, generator=gen)
    return omega.to(dtype).contiguous().to(device)


def sketch_basis(
    sketch: torch.Tensor,
    rank: int,
    previous: torch.Tensor,
    rtol: float | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Top-r left singular vectors of a sketch ``Y = G Ω`` (``m x (r+p)``): the range finder's
    basis of ``G`` (Halko, Martinsson & Tropp 2011, Algorithm 4.1, with the exact SVD of the
    small sketch in place of its QR so that the r leading directions are kept), in float64: the
    SVD of ``Y``, or when ``m <= r + p`` the eigenvectors of the ``m x m`` ``Y Yᵀ`` (as the exact
    route of :func:`top_left_singular`).

    FedLore-Sketch's server rule: ``Y`` is the weighted mean of the clients' sketches
    ``Σ p_i G_i Ω / Σ p_i = (Σ p_i G_i / Σ p_i) Ω``, the sketch of the mean gradient.

    A rank-deficient sketch keeps the previous basis for the missing directions: with ``k`` the
    numerical rank of ``Y`` (singular values above ``rtol · σ_1``), the result is the ``k``
    leading left singular vectors of ``Y`` followed by the ``r - k`` leading left singular
    vectors of ``(I - U_k U_kᵀ) P^t``, the part of ``previous`` orthogonal to them; an all-zero
    sketch (``k = 0``, e.g. no client had a finite gradient) returns ``previous`` unchanged.

    Args:
        sketch: ``m x q`` finite matrix, ``r <= q`` (computed in float64).
        rank: r, ``1 <= r <= min(m, q)``.
        previous: ``m x r`` orthonormal basis ``P^t`` (FedLore-Sketch's current basis, or a
            seeded random basis for P^0).
        rtol: relative threshold of the numerical rank (None: ``max(m, q)`` times the machine
            epsilon of ``sketch``'s dtype, the rule of ``numpy.linalg.matrix_rank``; a 16-bit
            transport passes its own epsilon).
        dtype: dtype of the result (None: ``previous``'s).

    Returns:
        ``m x r`` with orthonormal columns (deterministic signs), on ``sketch``'s device.

    Raises:
        ValueError: if ``sketch`` is not 2-D or not finite, ``rank`` is out of range, or
            ``previous`` is not ``m x r``.
    """
    if sketch.ndim != 2:
        raise ValueError(f"expected a sketch matrix, got shape {tuple(sketch.shape)}")
    m, q = sketch.shape
    if not 1 <= rank <= min(m, q):
        raise ValueError(f"rank must be in [1, min(m, q) = {min(m, q)}], got {rank}")
    if tuple(previous.shape) != (m, rank):
        raise ValueError(f"previous basis has shape {tuple(previous.shape)}, expected {(m, rank)}")
    out_dtype = dtype if dtype is not None else previous.dtype
    y = sketch.detach().to(torch.float64)
    if not bool(torch.isfinite(y).all()):
        raise ValueError("cannot take the SVD of a sketch with NaN or Inf entries")
    if m <= q:  # as top_left_singular's exact route: eigenvectors of the m x m Y Yᵀ
        evals, evecs = torch.linalg.eigh(y @ y.t())
        s, u = evals.flip(0).clamp_min(0.0).sqrt(), evecs.flip(1)
    else:
        u, s = svd_left(y)
    if rtol is None:
        rtol = max(m, q) * torch.finfo(sketch.dtype).eps
    keep = 0 if float(s[0]) == 0.0 else min(rank, int((s > rtol * s[0]).sum()))
    prev = previous.detach().to(device=y.device, dtype=torch.float64)
    if keep == 0:
        return previous.detach().to(device=sketch.device, dtype=out_dtype).clone()
    basis = _fix_signs(u[:, :keep])
    if keep < rank:
        rest = prev - basis @ (basis.t() @ prev)
        ur, _ = svd_left(rest)
        fill = ur[:, : rank - keep]
        fill = fill - basis @ (basis.t() @ fill)  # re-orthogonalize against U_k
        fill, _ = torch.linalg.qr(fill)
        basis = torch.cat([basis, _fix_signs(fill)], dim=1)
    return basis.to(out_dtype).contiguous()


def random_basis(
    seed: int,
    m: int,
    rank: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A seeded random orthonormal ``m x r`` basis, reproducible on every party.

    Gaussian ``m x r`` from a CPU generator seeded with ``seed``, QR in float64 with the sign
    fixed so that ``diag(R) > 0`` (the Haar-distributed representative), cast to ``dtype``
    (float32 by default) and moved to ``device`` (computed on the CPU: the same basis on every
    device).
    Source: seed Algorithm 4 (SharedBasis); reference notes section 5 on determinism.
    """
    if not 1 <= rank <= m:
        raise ValueError(f"rank must be in [1, {m}], got {rank}")
    gen = torch.Generator().manual_seed(int(seed) % (2**63))
    g = torch.randn(m, rank, dtype=torch.float64, generator=gen)
    q, r = torch.linalg.qr(g)
    d = torch.sign(torch.diagonal(r))
    d[d == 0] = 1.0
    return (q * d).to(dtype).contiguous().to(device)


def projector_distance(p: torch.Tensor, q: torch.Tensor) -> float:
    """Spectral norm ``||P Pᵀ - Q Qᵀ||_2`` (0 for the same subspace, 1 if some direction of one is
    orthogonal to the other); a basis-invariant subspace distance."""
    pp = p.double() @ p.double().t()
    qq = q.double() @ q.double().t()
    return float(spectral_norm(pp - qq))


def captured_energy(basis: torch.Tensor, mat: torch.Tensor) -> float:
    """Retained-energy ratio ``||P Pᵀ G||_F^2 / ||G||_F^2`` in [0, 1] (1.0 for G = 0)."""
    g = mat.double()
    total = float((g * g).sum())
    if total == 0.0:
        return 1.0
    proj = basis.double().t() @ g
    return float((proj * proj).sum()) / total
