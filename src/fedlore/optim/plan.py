"""Which weights a projected method projects, and how: the :class:`MatrixSpec` of each (its
``m x n`` view on the seed's ``left`` side or GaLore's ``right`` side) and the projection plan of
a model (:func:`projection_plan`). The bases themselves are :mod:`fedlore.optim.subspace`.

Sources: seed ``000_7a70688bd6d66f38`` Algorithm 1 (the left side, ``P`` is ``m x r``,
coordinates ``r x n``); GaLore (Zhao et al., ICML 2024) for the side rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Side = Literal["left", "right"]
SideRule = Literal["left", "right", "auto"]


@dataclass(frozen=True)
class MatrixSpec:
    """How one parameter is projected.

    Attributes:
        name: the parameter's ``state_dict`` name.
        shape: the parameter's own shape (e.g. conv ``[out, in, kh, kw]``).
        side: ``"left"`` (view = ``W.reshape(out, -1)``) or ``"right"`` (its transpose).
        m: rows of the view (the basis is ``m x r``).
        n: columns of the view (coordinates and moments are ``r x n``).
        rank: r, ``1 <= r < min(m, n)``.
    """

    name: str
    shape: tuple[int, ...]
    side: Side
    m: int
    n: int
    rank: int

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """The ``m x n`` matrix view of a tensor of this parameter's shape."""
        mat = t.reshape(self.shape[0], -1)
        return mat if self.side == "left" else mat.t()

    def unview(self, mat: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`view`: an ``m x n`` matrix back to the parameter's shape."""
        full = mat if self.side == "left" else mat.t()
        return full.reshape(self.shape)


def projection_plan(
    model: nn.Module,
    rank: int,
    side: SideRule = "left",
    exclude: tuple[str, ...] = ("head.",),
) -> dict[str, MatrixSpec]:
    """Which parameters of ``model`` are projected, and how.

    Projected: weights of ``nn.Linear`` and ``nn.Conv*`` layers (conv kernels as
    ``out x in*kh*kw``), except names starting with a prefix in ``exclude`` (the classifier head)
    and matrices with ``min(m, n) <= rank`` (a rank-r basis would cover them fully, and
    r(m+n) >= mn scalars would cost more than the dense tensor). Biases, norms, embeddings and
    the head are trained densely with AdamW and travel densely, as in GaLore.

    Args:
        model: the model (only its module types and parameter shapes are read).
        rank: r >= 1.
        side: ``"left"`` (the seed), ``"right"``, or ``"auto"`` (GaLore ``std``: right if
            ``out >= in``, else left).
        exclude: name prefixes never projected.

    Returns:
        ``state_dict`` name -> :class:`MatrixSpec`, in model order.

    Raises:
        ValueError: if ``rank < 1`` or ``side`` is unknown.
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if side not in ("left", "right", "auto"):
        raise ValueError(f"side must be 'left', 'right' or 'auto', got {side!r}")
    return plan_of(weight_matrices(model), rank, side, exclude)


def weight_matrices(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The weights of ``model``'s ``nn.Linear`` and ``nn.Conv*`` layers, ``state_dict`` name ->
    shape, in model order: what :func:`projection_plan` may project."""
    out: dict[str, tuple[int, ...]] = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d):
            out[f"{mod_name}.weight" if mod_name else "weight"] = tuple(mod.weight.shape)
    return out


def plan_of(
    matrices: dict[str, tuple[int, ...]],
    rank: int,
    side: SideRule = "left",
    exclude: tuple[str, ...] = ("head.",),
) -> dict[str, MatrixSpec]:
    """:func:`projection_plan`'s rule on given weights (name -> shape): every one whose name
    starts with no prefix in ``exclude`` and whose :func:`matrix_spec` exists."""
    plan: dict[str, MatrixSpec] = {}
    for name, shape in matrices.items():
        if any(name.startswith(p) for p in exclude):
            continue
        spec = matrix_spec(name, shape, rank, side)
        if spec is not None:
            plan[name] = spec
    return plan


def matrix_spec(
    name: str, shape: tuple[int, ...], rank: int, side: SideRule = "left"
) -> MatrixSpec | None:
    """The :class:`MatrixSpec` of one weight of ``shape`` (``out x in...``, a conv kernel viewed
    as ``out x in*kh*kw``) under ``side`` (:func:`projection_plan`'s rule), or None when
    ``min(m, n) <= rank`` (not worth projecting)."""
    out_dim, in_dim = shape[0], int(torch.Size(shape[1:]).numel())
    chosen: Side
    if side == "auto":
        chosen = "right" if out_dim >= in_dim else "left"
    else:
        chosen = side
    m, n = (out_dim, in_dim) if chosen == "left" else (in_dim, out_dim)
    if min(m, n) <= rank:
        return None
    return MatrixSpec(name, shape, chosen, m, n, rank)
