"""LoRA-FAIR (Bian et al., ICCV 2025; reference notes section 9): FedIT's factor means plus a
server-side residual ΔB that turns ``(B̄ + ΔB) Ā`` towards the ideal ``Σ p_k B_k A_k``.

* Trained: A and B from the global (Ā, B̄') (plus the dense head).
* Travels, per m x n matrix: down (Ā, B̄'), r(m+n); up (A_k, B_k), r(m+n).
* Server: ``Ā = Σ p_k A_k``, ``B̄ = Σ p_k B_k``, ``ΔW = Σ p_k B_k A_k`` (float64; no ``s``, the
  cosine does not see it), then ``ΔB* = argmin 1 - cos(ΔW, (B̄ + ΔB) Ā) + λ ||ΔB||²`` per module
  (one solve over the summed loss is the same thing), from ΔB = 0, solved to its optimum:
  ``fair_solver="lbfgs"`` (default) profiles out the scale (below) and runs L-BFGS with a
  strong-Wolfe line search in float64 until the gradient's largest entry is below
  ``fair_grad_tol`` or ``fair_max_steps`` iterations;
  ``fair_solver="sgd"`` is the paper's plain SGD at ``fair_lr`` with the stopping rule of the
  LoRA-FAIR vision codebase (stop once ``|Δloss| < fair_tol`` for ``fair_patience`` = 5
  iterations in a row, at most ``fair_max_steps`` = 1,000). Either way the best iterate is kept,
  so the objective never ends above that of ΔB = 0. Broadcast ``(Ā, B̄ + ΔB*)``; the base is
  never merged; the global model is ``W0 + s (B̄ + ΔB*) Ā``.
* Round start: the corrected global adapter ("Avg-Initial").

Why not a fixed number of SGD steps (the seed authors' code: 200 steps at lr 0.1): the cosine is
scale-invariant, so along the radial direction of ``(B̄ + ΔB)`` only the small ``λ||ΔB||²`` pulls,
and SGD creeps there at a rate ``2 λ lr`` per step. With a small B̄ (early rounds) 200 steps stop
far from the minimum with ``(B̄ + ΔB) Ā`` several times the norm of ``ΔW``, i.e. a global update
several times too large, while the minimum has an ordinary size; at lr 0.1 the iterates can also
overshoot and never improve on ΔB = 0. Plain L-BFGS on ΔB fares little better: the angular
curvature grows like ``1 / ||(B̄ + ΔB) Ā||²`` while the radial one is ``2 λ``, a condition number
of ~1e8 for B ~ 1e-3. The default solver therefore minimises over the scale in closed form:
writing ``B̄ + ΔB = ρ V`` with ``ρ > 0``, the cosine depends on V alone and
``min_ρ λ ||ρ V - B̄||² = λ (||B̄||² - <V, B̄>₊² / ||V||²)`` at ``ρ* = <V, B̄>₊ / ||V||²``, so the
exact reduced objective ``g(V) = 1 - cos(ΔW, V Ā) + λ (||B̄||² - <V, B̄>₊² / ||V||²)`` is
invariant to the scale of V and well conditioned; L-BFGS runs on it from ``V = B̄ / ||B̄||`` (ΔB
= 0) and returns ``ΔB = ρ* V - B̄``. It matches SciPy's BFGS on the unreduced objective to about
1e-6 in the corrected update (``tests/algorithms/test_lora_methods.py``). With ``B̄ = 0`` (no
client moved B) there is nothing to turn and no minimiser (the infimum is approached as ΔB → 0),
so ΔB = 0. When the best direction V leans away from B̄ (``<V, B̄> ≤ 0``, e.g. clients whose
factors point in opposite directions) the profiled minimum sits at ρ → 0, a vanishing adapter
that the objective prefers but never attains; the solver then minimises the raw objective over
ΔB with L-BFGS from ΔB = 0 as well and keeps the better finite point, which then is a nearly
vanishing B (the objective's own verdict, not a solver failure: FedIT's B̄ has nearly cancelled,
and no scale of (B̄ + ΔB) Ā turns it closer to ΔW). Such modules are counted each round as
``fair_degenerate``.

Source: arXiv 2411.14961 (official ``jmbian/LoRA-FAIR`` not retrievable); objective as in
``junkangLiu0/FedLore`` ``lora_fair.py`` (the seed authors' code: ΔB from zeros, flattened
cosine, λ = 0.01, as called from ``main_FedLore.py``). Avoided pitfall: the derivative vision
code starts ΔB at a Xavier draw, which a few iterations leave as an arbitrary perturbation of B;
ΔB starts at zero here and the reported ``fair_gap_before``/``fair_gap_after`` (mean ``1 - cos``
over modules), ``fair_objective`` and ``fair_iterations`` show what it did.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch

from fedlore.algorithms.lora_common import LoraMethod, factor_means, reply_modules
from fedlore.registry import register_algorithm
from fedlore.types import Arrays, Reply, Scalars


def direction_gap(ideal: torch.Tensor, approx: torch.Tensor, cosine: str = "flat") -> torch.Tensor:
    """``1 - cos(ideal, approx)``: over the flattened matrices (``"flat"``) or the mean of the
    column-wise cosines (``"column"``). Both ``m x n``.

    The cosine is scale-invariant at every scale: norms are clamped only at the dtype's
    smallest positive number (``F.cosine_similarity`` clamps at 1e-8, which breaks the
    invariance of corrected updates below that norm); a zero matrix has cosine 0, and its
    gradient is 0, not NaN.
    """
    tiny = torch.finfo(approx.dtype).tiny
    if cosine == "flat":
        a, b = ideal.flatten(), approx.flatten()
        norm_a = a.pow(2).sum().clamp_min(tiny).sqrt()
        norm_b = b.pow(2).sum().clamp_min(tiny).sqrt()
        return 1.0 - (a * b).sum() / (norm_a * norm_b)
    norm_a = ideal.pow(2).sum(0).clamp_min(tiny).sqrt()
    norm_b = approx.pow(2).sum(0).clamp_min(tiny).sqrt()
    return 1.0 - ((ideal * approx).sum(0) / (norm_a * norm_b)).mean()


FairSolver = Literal["lbfgs", "sgd"]


def _lbfgs(
    param: torch.Tensor, objective: Callable[[], torch.Tensor], max_steps: int, grad_tol: float
) -> int:
    """Minimize ``objective()`` over ``param`` in place with L-BFGS (strong-Wolfe line search,
    at most ``max_steps`` iterations, stopping when the gradient's max-norm is below
    ``grad_tol``); returns the iterations taken."""
    opt = torch.optim.LBFGS(
        [param],
        lr=1.0,
        max_iter=max_steps,
        tolerance_grad=grad_tol,
        tolerance_change=1e-20,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        obj = objective()
        obj.backward()
        return obj

    opt.step(closure)
    return int(opt.state[param].get("n_iter", 0))


@dataclass(frozen=True)
class FairResult:
    """Outcome of :func:`fair_correction` for one module.

    Attributes:
        delta: ΔB (``m x r``, in B̄'s dtype).
        gap_before: ``1 - cos`` at ΔB = 0.
        gap_after: ``1 - cos`` at ``delta``.
        objective: ``1 - cos + λ ||ΔB||²`` at ``delta``.
        iterations: solver iterations taken.
        degenerate: the best direction leans away from B̄ (``<V, B̄> ≤ 0``), where the
            objective has no minimiser and prefers a vanishing adapter (module docstring).
    """

    delta: torch.Tensor
    gap_before: float
    gap_after: float
    objective: float
    iterations: int
    degenerate: bool = False


def fair_objective(
    ideal: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    delta: torch.Tensor,
    lam: float,
    cosine: str = "flat",
) -> torch.Tensor:
    """LoRA-FAIR's server objective ``1 - cos(ΔW, (B̄ + ΔB) Ā) + λ ||ΔB||_F²`` (reference notes
    section 9, step 4), a scalar tensor (differentiable in ``delta``)."""
    return direction_gap(ideal, (b + delta) @ a, cosine) + lam * delta.pow(2).sum()


def fair_correction(
    ideal: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    lam: float,
    solver: FairSolver = "lbfgs",
    lr: float = 0.1,
    max_steps: int = 1000,
    tol: float = 1e-6,
    patience: int = 5,
    grad_tol: float = 1e-10,
    cosine: str = "flat",
) -> FairResult:
    """LoRA-FAIR's residual ΔB for one module, minimised in float64 from ΔB = 0.

    Args:
        ideal: ``Σ p_k B_k A_k`` (``m x n``).
        b: ``B̄`` (``m x r``).
        a: ``Ā`` (``r x n``).
        lam: λ, weight of ``||ΔB||²``.
        solver: ``"lbfgs"`` (L-BFGS on the scale-profiled objective of the module docstring,
            strong-Wolfe line search, history 20; stops when the largest gradient entry is
            below ``grad_tol``, nothing changes by more than 1e-20, or after ``max_steps``
            iterations) or ``"sgd"`` (plain
            SGD at ``lr``; stops once ``|Δloss| < tol`` for ``patience`` iterations in a row, or
            after ``max_steps``: the LoRA-FAIR vision codebase's rule).
        lr: SGD step (``solver="sgd"``).
        max_steps: iteration limit (0: ΔB = 0, i.e. FedIT).
        tol, patience: SGD stopping rule.
        grad_tol: L-BFGS first-order tolerance.
        cosine: ``"flat"`` or ``"column"`` (:func:`direction_gap`).

    Returns:
        :class:`FairResult`; ``delta`` is the best iterate seen (never worse than ΔB = 0).

    Raises:
        ValueError: for an unknown solver.
    """
    if solver not in ("lbfgs", "sgd"):
        raise ValueError(f"unknown LoRA-FAIR solver {solver!r}")
    ideal64, b64, a64 = ideal.double(), b.double(), a.double()
    delta = torch.zeros_like(b64, requires_grad=True)
    best_obj, best = float("inf"), torch.zeros_like(b64)
    iterations = 0
    degenerate = False

    def value() -> torch.Tensor:
        return fair_objective(ideal64, b64, a64, delta, lam, cosine)

    def remember(obj: torch.Tensor) -> None:
        nonlocal best_obj, best
        v = float(obj.detach())
        if v < best_obj:  # NaN never wins
            best_obj, best = v, delta.detach().clone()

    with torch.enable_grad():
        remember(value())
        b_sq = float(b64.pow(2).sum())
        if max_steps > 0 and solver == "lbfgs" and b_sq > 0:
            # V = B̄ / ||B̄|| (ΔB = 0): g is invariant to the scale of V, so a unit start keeps
            # the problem equally well conditioned for any size of B̄
            v = (b64 / math.sqrt(b_sq)).requires_grad_(True)

            def reduced() -> torch.Tensor:
                dot = (v * b64).sum().clamp_min(0.0)
                profile = lam * (b_sq - dot * dot / v.pow(2).sum())
                return direction_gap(ideal64, v @ a64, cosine) + profile

            iterations = _lbfgs(v, reduced, max_steps, grad_tol)
            with torch.no_grad():
                vv = v.detach()
                dot = float((vv * b64).sum())
                rho = max(dot, 0.0) / float(vv.pow(2).sum())
                delta.copy_(rho * vv - b64)
            remember(value())
            if dot <= 0.0:  # the degenerate side, module docstring: solve the raw objective
                degenerate = True
                delta.data.zero_()
                iterations += _lbfgs(delta, value, max_steps, grad_tol)
                remember(value())
        elif max_steps > 0 and solver == "sgd":
            sgd = torch.optim.SGD([delta], lr=lr)
            prev, calm = None, 0
            for k in range(max_steps):
                obj = value()
                remember(obj)
                now = float(obj.detach())
                calm = calm + 1 if prev is not None and abs(prev - now) < tol else 0
                if calm >= patience:
                    break
                prev = now
                sgd.zero_grad()
                obj.backward()
                sgd.step()
                iterations = k + 1
            remember(value())
    with torch.no_grad():
        before = float(direction_gap(ideal64, b64 @ a64, cosine))
        after = float(direction_gap(ideal64, (b64 + best) @ a64, cosine))
    return FairResult(best.to(b.dtype), before, after, best_obj, iterations, degenerate)


@register_algorithm("lora_fair")
@dataclass(frozen=True)
class LoRAFAIR(LoraMethod):
    """LoRA-FAIR: factor means with a direction-correcting residual on B.

    Attributes:
        fair_lambda: λ of ``||ΔB||²`` (paper setting 0.01).
        fair_solver: ``"lbfgs"`` (default: solved to the optimum) or ``"sgd"`` (the paper's
            plain SGD with the vision codebase's stopping rule); see :func:`fair_correction`.
        fair_lr: SGD step (``fair_solver="sgd"``; the seed authors' 0.1).
        fair_max_steps: iteration limit of either solver (0: no correction, FedIT's means).
        fair_tol: ``fair_solver="sgd"`` only: an iteration is calm when the objective changed
            by less than this (absolute, in units of the objective ``1 - cos + λ ||ΔB||²``);
            SGD stops after ``fair_patience`` calm iterations in a row (the vision codebase's
            rule).
        fair_patience: ``fair_solver="sgd"`` only: calm iterations in a row that stop SGD
            (≥ 1; the vision codebase's 5).
        fair_grad_tol: L-BFGS stops once the largest gradient entry is below it.
        fair_cosine: ``"flat"`` (whole matrix) or ``"column"`` (mean column-wise cosine).
    """

    name: ClassVar[str] = "lora_fair"
    capabilities = replace(
        LoraMethod.capabilities,
        individual_uploads=(
            "its server fits its residual ΔB to the ideal product Σ p_k B_k A_k, a sum over "
            "clients of the product of each client's two uploaded factors, not a sum of the uploads"
        ),
        transport_16bit=True,
    )
    fair_lambda: float = 0.01
    fair_solver: FairSolver = "lbfgs"
    fair_lr: float = 0.1
    fair_max_steps: int = 1000
    fair_tol: float = 1e-6
    fair_patience: int = 5
    fair_grad_tol: float = 1e-10
    fair_cosine: Literal["flat", "column"] = "flat"

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "fair_lambda": self.fair_lambda >= 0,
            "fair_solver": self.fair_solver in ("lbfgs", "sgd"),
            "fair_lr": self.fair_lr > 0,
            "fair_max_steps": self.fair_max_steps >= 0,
            "fair_tol": self.fair_tol >= 0,
            "fair_patience": self.fair_patience >= 1,
            "fair_grad_tol": self.fair_grad_tol > 0,
            "fair_cosine": self.fair_cosine in ("flat", "column"),
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"LoRAFAIR: invalid {field}={getattr(self, field)!r}")

    def aggregate_adapters(
        self, arrays: Arrays, replies: list[tuple[int, Reply]], p: list[float], rnd: int
    ) -> tuple[Arrays, Scalars]:
        means = factor_means(replies, p, ("A", "B"))
        gaps = []
        for mod in reply_modules(replies):
            products = [
                pk * (r.arrays[f"lora.{mod}.B"].double() @ r.arrays[f"lora.{mod}.A"].double())
                for (_, r), pk in zip(replies, p, strict=True)
            ]
            ideal = products[0]
            for prod in products[1:]:
                ideal = ideal + prod
            res = fair_correction(
                ideal,
                means[f"{mod}.B"],
                means[f"{mod}.A"],
                self.fair_lambda,
                solver=self.fair_solver,
                lr=self.fair_lr,
                max_steps=self.fair_max_steps,
                tol=self.fair_tol,
                patience=self.fair_patience,
                grad_tol=self.fair_grad_tol,
                cosine=self.fair_cosine,
            )
            arrays[f"lora.{mod}.A"] = means[f"{mod}.A"]
            arrays[f"lora.{mod}.B"] = (means[f"{mod}.B"] + res.delta).contiguous()
            gaps.append(res)
        n = max(len(gaps), 1)
        return {}, {
            "fair_gap_before": sum(g.gap_before for g in gaps) / n,
            "fair_gap_after": sum(g.gap_after for g in gaps) / n,
            "fair_objective": sum(g.objective for g in gaps) / n,
            "fair_iterations": max((g.iterations for g in gaps), default=0),
            "fair_degenerate": sum(g.degenerate for g in gaps),
        }
