"""Adam whose moments live in the coordinates of bases handed to it (never computes a basis),
projected SGD (:class:`ProjectedSGD`, the same update with the raw projected gradient) and
projected heavy-ball momentum (:class:`ProjectedMomentum`, FedSLoP's).

For a projected parameter with view ``G`` (``m x n``) and basis ``P`` (``m x r``), one step is
(seed Algorithm 1 lines 14–18, with the decoupled decay of Proposition 8)::

    R = Pᵀ G                                   (r x n)
    M <- b1 M + (1 - b1) R ;  V <- b2 V + (1 - b2) R ⊙ R
    N = (M / (1 - b1^k)) / (sqrt(V / (1 - b2^k)) + eps)
    D = -lr_k * scale * N ;   a_k = 1 - lr_k * weight_decay
    W <- a_k W + P D ;        Z <- a_k Z + D

``Z`` (the coordinate increment, ``r x n``) is what a FedLore client uploads: after K steps
``W_K = (Π a_k) W_0 + P Z`` exactly (Proposition 8), also with a learning-rate schedule inside
the round because ``Z`` accumulates the lr-weighted directions (Appendix D). Our ``Z`` therefore
includes ``-lr * scale`` (the paper's ``ΔZ`` times ``-ηα`` for a constant lr).

Dense (unprojected) parameters get plain AdamW with the same betas, eps, lr and decoupled decay
(the operation sequence of PyTorch's multi-tensor ``foreach`` AdamW, which FedFull's clients run
on CUDA; on the CPU PyTorch picks its per-tensor loop, the same arithmetic).
Moments start at zero when the optimizer is made; FedLore makes a fresh one every round. A
method that keeps its moments across rounds (FedGaLore, FedSLoP) puts them into ``state`` after
making the optimizer (:func:`fedlore.algorithms.lowrank.train_projected`'s ``start``): each
step continues from what it finds there.

Cost per projected matrix and step (issue 19): two ``r·m·n`` products (``Pᵀ G``, and ``P D``
added in place into the weight by one ``addmm_``), no ``m x n`` temporary (the weight is written
through its view; a non-contiguous parameter goes through one copy), and the moment arithmetic on
``r x n`` tensors batched over all projected matrices with ``torch._foreach_*`` ops.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

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
        dense: Iterable[torch.Tensor],
        projected: Iterable[tuple[torch.Tensor, MatrixSpec, torch.Tensor]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        scale: float = 1.0,
    ) -> None:
        dense = list(dense)
        proj = list(projected)
        self.specs: dict[torch.Tensor, MatrixSpec] = {}
        self.bases: dict[torch.Tensor, torch.Tensor] = {}
        self.coords: dict[torch.Tensor, torch.Tensor] = {}
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

    def __getstate__(self) -> dict[str, Any]:
        """torch's optimizer state (defaults, state, groups) and the projection: the specs,
        bases and accumulated coordinates ``Z`` by parameter, ``scale`` and a subclass's own
        settings, so that ``copy.deepcopy((model, opt))`` gives an optimizer of the copied model
        that continues exactly where this one stands (Bayesian FedLore's learning-rate trials)."""
        state = dict(super().__getstate__())
        keep = ("specs", "bases", "coords", "scale", "momentum")
        state.update({k: v for k, v in self.__dict__.items() if k in keep})
        return state

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every group (called by the loop for a schedule)."""
        for g in self.param_groups:
            g["lr"] = lr

    @torch.no_grad()
    def step(self, closure=None):
        """One step on every parameter that has a gradient (the module docstring's update)."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if group["projected"]:
                self._projected_step(group)
            else:
                self._dense_step(group)
        return loss

    def _projected_step(self, group: dict[str, Any]) -> None:
        """``R = Pᵀ G``; ``D`` from :meth:`directions`; ``W <- a W + P D`` (one in-place
        ``addmm_`` into the weight's view); ``Z <- a Z + D`` (batched)."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        specs = [self.specs[p] for p in params]
        bases = [self.bases[p] for p in params]
        rs = [torch.mm(b.t(), s.view(p.grad)) for p, s, b in zip(params, specs, bases, strict=True)]
        ds = self.directions(params, rs, group)
        decay = 1.0 - group["lr"] * group["weight_decay"]
        for p, s, b, d in zip(params, specs, bases, ds, strict=True):
            if p.is_contiguous():  # the view shares the weight's storage: written in place
                s.view(p).addmm_(b, d, beta=decay)
            else:
                p.copy_(s.unview(torch.addmm(s.view(p), b, d, beta=decay)))
        zs = [self.coords[p] for p in params]
        if decay != 1.0:
            torch._foreach_mul_(zs, decay)
        torch._foreach_add_(zs, ds)

    def directions(
        self, params: list[torch.Tensor], rs: list[torch.Tensor], group: dict[str, Any]
    ) -> list[torch.Tensor]:
        """The coordinate steps ``D = -lr_k · scale · N`` (``r x n`` each) of projected
        parameters ``params`` from their projected gradients ``rs`` (``Pᵀ G``; overwritten:
        the result lives in their buffers). Adam: ``N`` is the bias-corrected
        ``m_hat / (sqrt(v_hat) + eps)`` of the module docstring (see :meth:`_moments`)."""
        ms, denom, corr = self._moments(params, rs, group)
        torch._foreach_zero_(rs)  # R is spent: D goes into its buffers
        lr = group["lr"] * self.scale
        torch._foreach_addcdiv_(rs, ms, denom, [-lr * c for c in corr])
        return rs

    def _moments(
        self, params: list[torch.Tensor], gs: list[torch.Tensor], group: dict[str, Any]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
        """Adam's moment update for ``params`` from gradients ``gs`` (projected or dense),
        batched with ``torch._foreach_*`` ops as in PyTorch's multi-tensor AdamW:
        ``M <- b1 M + (1 - b1) g``, ``V <- b2 V + (1 - b2) g ⊙ g`` (state ``exp_avg``,
        ``exp_avg_sq``, ``step`` per parameter, made at the first step).

        Returns:
            ``(M list, denominators sqrt(V / (1 - b2^k)) + eps, 1 / (1 - b1^k) per
            parameter)``: ``N = M · corr / denom`` without ``m_hat`` / ``v_hat`` tensors (the
            bias corrections are scalars, folded into the denominator and the step size).
        """
        b1, b2 = group["betas"]
        states = [self.state[p] for p in params]
        for st, g in zip(states, gs, strict=True):
            if not st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(g)
                st["exp_avg_sq"] = torch.zeros_like(g)
            st["step"] += 1
        ms = [st["exp_avg"] for st in states]
        vs = [st["exp_avg_sq"] for st in states]
        torch._foreach_lerp_(ms, gs, 1 - b1)  # M <- b1 M + (1 - b1) g
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)  # V <- b2 V + (1 - b2) g ⊙ g
        # sqrt(V / (1 - b2^k)) + eps = sqrt(V) / sqrt(1 - b2^k) + eps
        denom = list(torch._foreach_sqrt(vs))
        torch._foreach_div_(denom, [math.sqrt(1 - b2 ** st["step"]) for st in states])
        torch._foreach_add_(denom, group["eps"])
        return ms, denom, [1 / (1 - b1 ** st["step"]) for st in states]

    def _dense_step(self, group: dict[str, Any]) -> None:
        """AdamW on the dense parameters with a gradient, batched (the ``foreach`` sequence of
        PyTorch's multi-tensor AdamW): ``p <- a_k p - lr_k · m_hat / (sqrt(v_hat) + eps)``."""
        params = self._decayed_dense(group)
        if not params:
            return
        ms, denom, corr = self._moments(params, [p.grad for p in params], group)
        torch._foreach_addcdiv_(params, ms, denom, [-group["lr"] * c for c in corr])

    @staticmethod
    def _decayed_dense(group: dict[str, Any]) -> list[Any]:
        """The dense parameters of ``group`` that have a gradient, each already multiplied by
        the step's decoupled decay ``a_k = 1 - lr_k · weight_decay`` (batched)."""
        params = [p for p in group["params"] if p.grad is not None]
        decay = 1.0 - group["lr"] * group["weight_decay"]
        if params and decay != 1.0:
            torch._foreach_mul_(params, decay)
        return params

    def skip_step(self) -> None:
        """A skipped step (non-finite loss or gradient): no moment update and no gradient
        direction, but the common decay ``a_k = 1 - lr_k * weight_decay`` is still applied to
        every weight and to ``Z``, so ``W_K = (Π a_k) W_0 + P Z`` keeps holding with the same
        ``a`` the server uses (Proposition 8). (A ``no_grad`` block, not the decorator:
        mutation testing, ``make mutation``, skips decorated functions.)"""
        with torch.no_grad():
            for group in self.param_groups:
                decay = 1.0 - group["lr"] * group["weight_decay"]
                if decay == 1.0:
                    continue
                torch._foreach_mul_(list(group["params"]), decay)
                zs = [self.coords[p] for p in group["params"] if p in self.coords]
                if zs:
                    torch._foreach_mul_(zs, decay)

    def state_bytes(self) -> int:
        """Bytes of the optimizer's moment tensors (``exp_avg``, ``exp_avg_sq``), all parameters
        (step counters, scalars or 0-d tensors, are not counted)."""
        total = 0
        for st in self.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.ndim > 0:
                    total += v.numel() * v.element_size()
        return total

    def basis_bytes(self) -> int:
        """Bytes of the bases held for projected parameters."""
        return sum(b.numel() * b.element_size() for b in self.bases.values())


class ProjectedSGD(ProjectedAdam):
    """Projected SGD in the bases handed to it: the same update as :class:`ProjectedAdam` with
    the direction ``N = R = Pᵀ G`` itself (no moments, no state), i.e. for a projected parameter::

        W <- a_k W - lr_k · scale · P Pᵀ G ;   Z <- a_k Z - lr_k · scale · Pᵀ G

    and ``p <- a_k p - lr_k g`` for dense parameters, with ``a_k = 1 - lr_k · weight_decay``.
    This is the inner optimizer of the seed's theory (Theorem 3, Theorem 6, Proposition 4:
    ``W <- W - γ Π ∇f_i(W)``). ``betas`` and ``eps`` are accepted and unused.
    """

    def directions(
        self, params: list[torch.Tensor], rs: list[torch.Tensor], group: dict[str, Any]
    ) -> list[torch.Tensor]:
        """``D = -lr_k · scale · R`` (in the buffers of ``rs``); SGD keeps no state."""
        torch._foreach_mul_(rs, -group["lr"] * self.scale)
        return rs

    def _dense_step(self, group: dict[str, Any]) -> None:
        """``p <- a_k p - lr_k g`` for every dense parameter with a gradient (batched)."""
        params = self._decayed_dense(group)
        if params:
            torch._foreach_add_(params, [p.grad for p in params], alpha=-group["lr"])


class ProjectedMomentum(ProjectedAdam):
    """Heavy-ball momentum SGD in the bases handed to it (FedSLoP's local optimizer,
    :mod:`fedlore.algorithms.fedslop`). For a projected parameter with basis ``P``::

        R = Pᵀ G ;  B <- μ B + R ;  D = -lr_k · scale · B
        W <- a_k W + P D ;        Z <- a_k Z + D

    and ``b <- μ b + g ; p <- a_k p - lr_k b`` for dense parameters, with
    ``a_k = 1 - lr_k · weight_decay``: the buffer of ``torch.optim.SGD`` (no dampening, no
    Nesterov; a zero buffer makes the first step ``B = R``), kept in the ``r x n`` coordinates
    of ``P`` (state ``momentum_buffer``). A buffer already in the optimizer's state when it is
    made (FedSLoP's momentum carried across rounds) is continued, not reset. ``betas`` and
    ``eps`` are not used.

    Args:
        dense, projected, lr, weight_decay, scale: as :class:`ProjectedAdam`.
        momentum: μ in [0, 1) (0: :class:`ProjectedSGD`).

    Raises:
        ValueError: if ``momentum`` is outside [0, 1), or as :class:`ProjectedAdam`.
    """

    def __init__(
        self,
        dense: Iterable[torch.Tensor],
        projected: Iterable[tuple[torch.Tensor, MatrixSpec, torch.Tensor]],
        lr: float = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        scale: float = 1.0,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        super().__init__(dense, projected, lr=lr, weight_decay=weight_decay, scale=scale)
        self.momentum = momentum

    def _buffers(self, params: list[torch.Tensor], gs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``B <- μ B + g`` for each parameter (state ``momentum_buffer``, zero when absent)."""
        bufs = []
        for p, g in zip(params, gs, strict=True):
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(g)
            bufs.append(st["momentum_buffer"])
        torch._foreach_mul_(bufs, self.momentum)
        torch._foreach_add_(bufs, gs)
        return bufs

    def directions(
        self, params: list[torch.Tensor], rs: list[torch.Tensor], group: dict[str, Any]
    ) -> list[torch.Tensor]:
        """``D = -lr_k · scale · B`` with ``B <- μ B + R`` (in the buffers of ``rs``)."""
        bufs = self._buffers(params, rs)
        torch._foreach_zero_(rs)  # R is in the buffer now: D goes into its place
        torch._foreach_add_(rs, bufs, alpha=-group["lr"] * self.scale)
        return rs

    def _dense_step(self, group: dict[str, Any]) -> None:
        """``b <- μ b + g ; p <- a_k p - lr_k b`` for every dense parameter with a gradient."""
        params = self._decayed_dense(group)
        if params:
            bufs = self._buffers(params, [p.grad for p in params])
            torch._foreach_add_(params, bufs, alpha=-group["lr"])
