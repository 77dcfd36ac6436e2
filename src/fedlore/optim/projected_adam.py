"""Adam whose moments live in the coordinates of bases handed to it (never computes a basis),
and projected SGD (:class:`ProjectedSGD`, the same update with the raw projected gradient).

For a projected parameter with view ``G`` (``m x n``) and basis ``P`` (``m x r``), one step is
(seed Algorithm 1 lines 14–18, with the decoupled decay of Proposition 8):

    R = Pᵀ G                                   (r x n)
    M <- b1 M + (1 - b1) R ;  V <- b2 V + (1 - b2) R ⊙ R
    N = (M / (1 - b1^k)) / (sqrt(V / (1 - b2^k)) + eps)
    D = -lr_k * scale * N ;   a_k = 1 - lr_k * weight_decay
    W <- a_k W + P D ;        Z <- a_k Z + D

``Z`` (the coordinate increment, ``r x n``) is what a FedLore client uploads: after K steps
``W_K = (Π a_k) W_0 + P Z`` exactly (Proposition 8), also with a learning-rate schedule inside
the round because ``Z`` accumulates the lr-weighted directions (Appendix D). Our ``Z`` therefore
includes ``-lr * scale`` (the paper's ``ΔZ`` times ``-ηα`` for a constant lr).

Dense (unprojected) parameters get plain AdamW with the same betas, eps, lr and decoupled decay.
Moments start at zero when the optimizer is made; FedLore makes a fresh one every round.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fedlore.optim.subspace import MatrixSpec


class ProjectedAdam(torch.optim.Optimizer):
    """Adam with per-parameter projection onto given bases.

    Args:
        dense: parameters updated with ordinary AdamW.
        projected: ``(parameter, spec, basis)`` triples; ``basis`` is ``spec.m x spec.rank``
            with orthonormal columns.
        lr: learning rate (the training loop may change ``param_groups[i]["lr"]`` each step).
        betas: (b1, b2).
        eps: added to ``sqrt(V_hat)``.
        weight_decay: decoupled decay coefficient lambda (0 = none).
        scale: alpha, the multiplier of projected updates (dense ones are not scaled).

    Raises:
        ValueError: if a basis has the wrong shape or a parameter appears twice.
    """

    def __init__(
        self,
        dense: Iterable[nn.Parameter],
        projected: Iterable[tuple[nn.Parameter, MatrixSpec, torch.Tensor]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        scale: float = 1.0,
    ) -> None:
        dense = list(dense)
        proj = list(projected)
        self.specs: dict[nn.Parameter, MatrixSpec] = {}
        self.bases: dict[nn.Parameter, torch.Tensor] = {}
        self.coords: dict[nn.Parameter, torch.Tensor] = {}
        for p, spec, basis in proj:
            if tuple(basis.shape) != (spec.m, spec.rank):
                raise ValueError(
                    f"basis for {spec.name} has shape {tuple(basis.shape)}, "
                    f"expected {(spec.m, spec.rank)}"
                )
            self.specs[p] = spec
            self.bases[p] = basis.to(p.dtype)
            self.coords[p] = torch.zeros(spec.rank, spec.n, dtype=p.dtype, device=p.device)
        groups = []
        if dense:
            groups.append({"params": dense, "projected": False})
        if proj:
            groups.append({"params": [p for p, _, _ in proj], "projected": True})
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(groups, defaults)
        self.scale = scale

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every group (called by the loop for a schedule)."""
        for g in self.param_groups:
            g["lr"] = lr

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step on every parameter that has a gradient."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                spec = self.specs.get(p) if group["projected"] else None
                if spec is not None:
                    g = self.bases[p].t() @ spec.view(g)  # R = Pᵀ G, r x n
                step_dir = self.direction(p, g, b1, b2, eps)
                decay = 1.0 - lr * wd
                if spec is None:
                    if wd:
                        p.mul_(decay)
                    p.add_(step_dir, alpha=-lr)
                    continue
                d = step_dir * (-lr * self.scale)
                upd = self.bases[p] @ d  # P D, m x n
                if p.is_contiguous():  # in place through the view: no copy of the weight
                    w = spec.view(p)
                    if decay != 1.0:
                        w.mul_(decay)
                    w.add_(upd)
                else:
                    p.copy_(spec.unview(decay * spec.view(p) + upd))
                self.coords[p].mul_(decay).add_(d)
        return loss

    def direction(
        self, p: torch.Tensor, g: torch.Tensor, b1: float, b2: float, eps: float
    ) -> torch.Tensor:
        """The step direction N of parameter ``p`` from its (projected) gradient ``g``: Adam's
        bias-corrected ``m_hat / (sqrt(v_hat) + eps)``, updating the moments in ``self.state``."""
        st = self.state[p]
        if not st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(g)
            st["exp_avg_sq"] = torch.zeros_like(g)
        st["step"] += 1
        k = st["step"]
        st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        m_hat = st["exp_avg"] / (1 - b1**k)
        v_hat = st["exp_avg_sq"] / (1 - b2**k)
        return m_hat / (v_hat.sqrt() + eps)

    @torch.no_grad()
    def skip_step(self) -> None:
        """A skipped step (non-finite loss or gradient): no moment update and no gradient
        direction, but the common decay ``a_k = 1 - lr_k * weight_decay`` is still applied to
        every weight and to ``Z``, so ``W_K = (Π a_k) W_0 + P Z`` keeps holding with the same
        ``a`` the server uses (Proposition 8)."""
        for group in self.param_groups:
            decay = 1.0 - group["lr"] * group["weight_decay"]
            if decay == 1.0:
                continue
            for p in group["params"]:
                p.mul_(decay)
                if p in self.coords:
                    self.coords[p].mul_(decay)

    def state_bytes(self) -> int:
        """Bytes of the optimizer's moment tensors (``exp_avg``, ``exp_avg_sq``), all parameters."""
        total = 0
        for st in self.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def basis_bytes(self) -> int:
        """Bytes of the bases held for projected parameters."""
        return sum(b.numel() * b.element_size() for b in self.bases.values())


class ProjectedSGD(ProjectedAdam):
    """Projected SGD in the bases handed to it: the same update as :class:`ProjectedAdam` with
    the direction ``N = R = Pᵀ G`` itself (no moments, no state), i.e. for a projected parameter

        W <- a_k W - lr_k · scale · P Pᵀ G ;   Z <- a_k Z - lr_k · scale · Pᵀ G

    and ``p <- a_k p - lr_k g`` for dense parameters, with ``a_k = 1 - lr_k · weight_decay``.
    This is the inner optimizer of the seed's theory (Theorem 3, Theorem 6, Proposition 4:
    ``W <- W - γ Π ∇f_i(W)``). ``betas`` and ``eps`` are accepted and unused.
    """

    def direction(
        self, p: torch.Tensor, g: torch.Tensor, b1: float, b2: float, eps: float
    ) -> torch.Tensor:
        """``g`` (the projected gradient); SGD keeps no state."""
        return g
