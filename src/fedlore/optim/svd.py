"""Singular vectors that do not fail: ``torch.linalg.svd`` with a fallback that always converges.

LAPACK's divide-and-conquer SVD (``gesdd``, what ``torch.linalg.svd`` calls on the CPU) can fail
to converge on a rank-deficient matrix with many (numerically) zero singular values, depending
on the LAPACK build and the CPU's kernels: the quickstart's FedLore run of seed 43 met it in a
128 x 64 client gradient of rank 54 on an AVX-512 machine, and that client's update was lost.
The fallback factors ``A = QR`` (Householder QR, economy) and takes the eigenvectors of the small
Gram matrix ``R Rᵀ`` (symmetric ``eigh``, which converges): ``A Aᵀ = Q (R Rᵀ) Qᵀ``, so the
left singular vectors are ``Q W`` and the singular values the square roots of the eigenvalues,
exact up to rounding of the squared spectrum: a singular value to about ``sqrt(eps) * s_max``,
so directions below that (numerically zero ones) come back as an arbitrary orthonormal
completion (:func:`~fedlore.optim.subspace.top_left_singular` takes this route for every wide
matrix). A matrix the SVD handles takes the SVD, so results do not change where it converges.
"""

from __future__ import annotations

import torch


def svd_left(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left singular vectors and singular values of ``a`` (``m x k``), economy size
    (``min(m, k)`` columns), singular values descending; see the module docstring for when the
    fallback runs. Columns belonging to zero singular values are an orthonormal basis of the
    rest of the space, as any SVD's are."""
    try:
        u, s, _ = torch.linalg.svd(a, full_matrices=False)
        return u, s
    except torch.linalg.LinAlgError:  # gesdd did not converge
        return _gram_left(a)


def svd_right(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Singular values and right singular vectors ``Vh`` (``min(m, k) x k``) of ``a``, as
    :func:`svd_left` of ``aᵀ``: ``(s, vh)``."""
    v, s = svd_left(a.t())
    return s, v.t()


def svd_triplets(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U, S, Vh)`` of ``a``, economy size. In the fallback ``Vh = S⁻¹ Uᵀ A`` row by row, a
    zero row where a singular value is 0 (``U S Vh`` is still ``A``)."""
    try:
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        return u, s, vh
    except torch.linalg.LinAlgError:
        u, s = _gram_left(a)
    proj = u.t() @ a
    nonzero = s > 0
    vh = torch.where(nonzero[:, None], proj / torch.where(nonzero, s, 1.0)[:, None], 0.0)
    return u, s, vh


def spectral_norm(a: torch.Tensor) -> torch.Tensor:
    """``||a||_2``, the largest singular value of the matrix ``a`` (a 0-dim tensor on its
    device): ``torch.linalg.matrix_norm(a, ord=2)``, or where its SVD does not converge the
    fallback's largest value (exact to rounding: the top of the squared spectrum is)."""
    try:
        return torch.linalg.matrix_norm(a, ord=2)
    except torch.linalg.LinAlgError:
        return _gram_left(a)[1][0]


def _gram_left(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fallback: ``U = Q W`` and ``s = sqrt(λ)`` from ``A = QR`` and ``R Rᵀ = W Λ Wᵀ`` (for
    a wide ``a``, ``A Aᵀ = W Λ Wᵀ`` itself).

    Raises:
        torch.linalg.LinAlgError: for a matrix with NaN or Inf entries, as the SVD would.
    """
    if not bool(torch.isfinite(a).all()):
        raise torch.linalg.LinAlgError("svd: the matrix has NaN or Inf entries")
    m, k = a.shape
    if m >= k:
        q, r = torch.linalg.qr(a)  # q: m x k, r: k x k
        evals, w = torch.linalg.eigh(r @ r.t())
        u = q @ w.flip(1)
    else:
        evals, w = torch.linalg.eigh(a @ a.t())
        u = w.flip(1)
    return u, evals.flip(0).clamp_min(0.0).sqrt()
