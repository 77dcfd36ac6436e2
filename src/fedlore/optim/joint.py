"""The shared signal of several matrices that share their columns: AJIVE's two spectral steps.

AJIVE (Angle-based Joint and Individual Variation Explained; Feng, Jiang, Hannig & Marron,
"Angle-based joint and individual variation explained", *Journal of Multivariate Analysis* 166,
2018) splits blocks ``X_1 .. X_N`` (``d_i x n``: different rows, the same ``n`` columns) into a
part whose row space all blocks share and individual parts:

1. *signal extraction*: per block, the row space of its rank-``k_i`` truncated SVD, an
   orthonormal ``U_i`` (``n x k_i``, the top ``k_i`` right singular vectors of ``X_i``;
   :func:`signal_basis`);
2. *joint space*: the SVD of the stacked signal bases. With weights ``p_i`` (``Σ p_i = 1``) and
   ``S = [sqrt(p_1) U_1, ..., sqrt(p_N) U_N]`` (``n x Σ k_i``), a unit direction ``u`` has
   ``||Sᵀ u||² = Σ_i p_i cos² θ_i(u)``, the weighted mean squared cosine of its angles ``θ_i``
   to the blocks' signal spaces: 1 for a direction in every block's signal space, ``p_i`` for
   one in block i's alone. The joint basis ``J`` (``n x r_J``) is the left singular vectors of
   ``S`` whose squared singular values reach ``cos² θ_max`` (:func:`joint_basis`), and block
   i's joint part is ``X_i J Jᵀ`` (:func:`joint_part`).

AJIVE's own threshold of step 2 comes from perturbation bounds (Wedin's bound with resampled
noise and a random-direction bound, Feng et al. §2.2); here it is an angle ``θ_max`` the
caller chooses (FedGaLore's ``joint_angle``). With ``N = 2`` and equal weights the squared
singular values are ``(1 + cos φ_j) / 2 = cos²(φ_j / 2)`` for the principal angles ``φ_j``
between the two signal spaces, so a direction is joint when the two spaces are within
``2 θ_max`` of each other along it.

Legend: ``d`` rows of a block, ``n`` shared columns, ``k`` signal rank, ``r_J`` joint rank.
Everything is computed in float64 and returned in the input's dtype.
"""

from __future__ import annotations

import math

import torch

from fedlore.optim.subspace import _fix_signs
from fedlore.optim.svd import svd_left, svd_right


def signal_basis(block: torch.Tensor, rank: int, rtol: float | None = None) -> torch.Tensor:
    """AJIVE step 1: the leading right singular vectors of ``block`` (``d x n``), ``n x k`` with
    ``k = min(rank, numerical rank)``; a zero block gives ``n x 0``.

    Args:
        block: ``d x n`` finite matrix.
        rank: the largest signal rank kept (>= 1).
        rtol: singular values at or below ``rtol · σ_1`` count as zero (None:
            ``max(d, n)`` times float64's machine epsilon, numpy's ``matrix_rank`` rule).

    Returns:
        ``n x k`` with orthonormal columns (deterministic signs), float64.

    Raises:
        ValueError: if ``block`` is not 2-D or not finite, or ``rank < 1``.
    """
    if block.ndim != 2:
        raise ValueError(f"expected a matrix, got shape {tuple(block.shape)}")
    if rank < 1:
        raise ValueError(f"signal rank must be >= 1, got {rank}")
    x = block.detach().to(torch.float64)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("cannot take the signal of a block with NaN or Inf entries")
    s, vh = svd_right(x)
    if s.numel() == 0 or float(s[0]) == 0.0:
        return x.new_zeros(x.shape[1], 0)
    tol = (max(x.shape) * torch.finfo(torch.float64).eps) if rtol is None else rtol
    keep = min(rank, int((s > tol * s[0]).sum()))
    return _fix_signs(vh[:keep].t()).contiguous()


def joint_basis(
    bases: list[torch.Tensor], weights: list[float], max_angle: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """AJIVE step 2: the joint row space of blocks with signal bases ``bases``.

    Args:
        bases: N matrices ``n x k_i`` with orthonormal columns (``k_i`` may be 0).
        weights: N non-negative weights p_i (normalized here).
        max_angle: θ_max in degrees, in [0, 90): a direction is joint when the weighted mean of
            its squared cosines to the signal spaces is at least ``cos² θ_max``.

    Returns:
        ``(J, s2)``: ``J`` ``n x r_J`` orthonormal (float64, deterministic signs; ``n x 0``
        when nothing is shared) and ``s2`` every squared singular value of the stack, largest
        first (``Σ p_i cos² θ_i`` of each singular direction).

    Raises:
        ValueError: on no bases, mismatched rows, a non-positive total weight or an angle
            outside [0, 90).
    """
    if not bases:
        raise ValueError("joint_basis needs at least one block")
    n = bases[0].shape[0]
    if any(b.shape[0] != n for b in bases):
        raise ValueError("every signal basis must have the same number of rows (shared columns)")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError("weights must have a positive sum")
    if not 0.0 <= max_angle < 90.0:
        raise ValueError(f"max_angle must be in [0, 90) degrees, got {max_angle!r}")
    scaled = [
        b.to(torch.float64) * math.sqrt(float(w) / total)
        for b, w in zip(bases, weights, strict=True)
    ]
    stack = torch.cat(scaled, dim=1)
    if stack.shape[1] == 0:
        return stack.new_zeros(n, 0), stack.new_zeros(0)
    u, s = svd_left(stack)
    s2 = s * s
    floor = math.cos(math.radians(max_angle)) ** 2
    keep = int((s2 >= floor * (1.0 - 1e-12)).sum())  # a rounding below the floor still counts
    return _fix_signs(u[:, :keep]).contiguous() if keep else stack.new_zeros(n, 0), s2


def joint_part(block: torch.Tensor, joint: torch.Tensor) -> torch.Tensor:
    """``X J Jᵀ``: the part of ``block`` (``d x n``) in the joint row space ``J`` (``n x r_J``),
    in float64 (zeros when ``r_J = 0``)."""
    x = block.to(torch.float64)
    j = joint.to(device=x.device, dtype=torch.float64)
    return (x @ j) @ j.t()
