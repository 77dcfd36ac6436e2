"""LoRA-FAIR (Bian et al., ICCV 2025; reference notes section 9): FedIT's factor means plus a
server-side residual ΔB that turns ``(B̄ + ΔB) Ā`` towards the ideal ``Σ p_k B_k A_k``.

* Trained: A and B from the global (Ā, B̄') (plus the dense head).
* Travels, per m x n matrix: down (Ā, B̄'), r(m+n); up (A_k, B_k), r(m+n).
* Server: ``Ā = Σ p_k A_k``, ``B̄ = Σ p_k B_k``, ``ΔW = Σ p_k B_k A_k`` (float64; no ``s``, the
  cosine does not see it), then ``ΔB* = argmin 1 - cos(ΔW, (B̄ + ΔB) Ā) + λ ||ΔB||²`` by
  ``fair_steps`` steps of plain SGD from ΔB = 0 (per module; one SGD over the summed loss is the
  same thing), keeping the best iterate, so the objective, and hence the direction gap
  ``1 - cos``, never ends above that of ΔB = 0. Broadcast ``(Ā, B̄ + ΔB*)``; the base is never
  merged; the global model is ``W0 + s (B̄ + ΔB*) Ā``.
* Round start: the corrected global adapter ("Avg-Initial").

Source: arXiv 2411.14961 (official ``jmbian/LoRA-FAIR`` not retrievable); solver as in
``junkangLiu0/FedLore`` ``lora_fair.py`` (the seed authors' code: ΔB from zeros, flattened
cosine, SGD lr 0.1, 200 iterations, λ = 0.01, as called from ``main_FedLore.py``). Avoided
pitfall: the derivative vision code starts ΔB at a Xavier draw, which a few iterations leave as
an arbitrary perturbation of B; ΔB starts at zero here and the reported
``fair_gap_before``/``fair_gap_after`` (mean ``1 - cos`` over modules) show what it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from fedlore.algorithms.lora_common import LoraMethod, factor_means, reply_modules
from fedlore.registry import register_algorithm
from fedlore.types import Arrays, Reply, Scalars


def direction_gap(ideal: torch.Tensor, approx: torch.Tensor, cosine: str = "flat") -> torch.Tensor:
    """``1 - cos(ideal, approx)``: over the flattened matrices (``"flat"``) or the mean of the
    column-wise cosines (``"column"``). Both ``m x n``."""
    if cosine == "flat":
        return 1.0 - F.cosine_similarity(ideal.flatten(), approx.flatten(), dim=0)
    return 1.0 - F.cosine_similarity(ideal, approx, dim=0).mean()


def fair_correction(
    ideal: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    lam: float,
    lr: float,
    steps: int,
    cosine: str = "flat",
) -> tuple[torch.Tensor, float, float]:
    """LoRA-FAIR's residual ΔB for one module, in float64.

    Args:
        ideal: ``Σ p_k B_k A_k`` (``m x n``).
        b: ``B̄`` (``m x r``).
        a: ``Ā`` (``r x n``).
        lam: λ, weight of ``||ΔB||²``.
        lr: SGD step.
        steps: SGD iterations.
        cosine: ``"flat"`` or ``"column"``.

    Returns:
        (ΔB ``m x r`` in ``b``'s dtype, gap ``1 - cos`` at ΔB = 0, gap at the returned ΔB).
    """
    ideal64, b64, a64 = ideal.double(), b.double(), a.double()
    delta = torch.zeros_like(b64, requires_grad=True)
    opt = torch.optim.SGD([delta], lr=lr)
    best_obj, best = float("inf"), torch.zeros_like(b64)
    with torch.enable_grad():
        for k in range(steps + 1):
            obj = direction_gap(ideal64, (b64 + delta) @ a64, cosine) + lam * delta.pow(2).sum()
            value = float(obj.detach())
            if value < best_obj:
                best_obj, best = value, delta.detach().clone()
            if k == steps:
                break
            opt.zero_grad()
            obj.backward()
            opt.step()
    with torch.no_grad():
        before = float(direction_gap(ideal64, b64 @ a64, cosine))
        after = float(direction_gap(ideal64, (b64 + best) @ a64, cosine))
    return best.to(b.dtype), before, after


@register_algorithm("lora_fair")
@dataclass(frozen=True)
class LoRAFAIR(LoraMethod):
    """LoRA-FAIR: factor means with a direction-correcting residual on B.

    Attributes:
        fair_lambda: λ of ``||ΔB||²`` (paper setting 0.01).
        fair_lr: SGD step of the server solver.
        fair_steps: SGD iterations.
        fair_cosine: ``"flat"`` (whole matrix) or ``"column"`` (mean column-wise cosine).
    """

    name: ClassVar[str] = "lora_fair"
    fair_lambda: float = 0.01
    fair_lr: float = 0.1
    fair_steps: int = 200
    fair_cosine: Literal["flat", "column"] = "flat"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fair_lambda < 0 or self.fair_lr <= 0 or self.fair_steps < 0:
            raise ValueError(
                f"LoRAFAIR: invalid fair_lambda={self.fair_lambda!r}, fair_lr={self.fair_lr!r} "
                f"or fair_steps={self.fair_steps!r}"
            )
        if self.fair_cosine not in ("flat", "column"):
            raise ValueError(f"LoRAFAIR: invalid fair_cosine={self.fair_cosine!r}")

    def aggregate_adapters(
        self, arrays: Arrays, replies: list[tuple[int, Reply]], p: list[float], rnd: int
    ) -> tuple[Arrays, Scalars]:
        means = factor_means(replies, p, ("A", "B"))
        gaps = []
        for mod in reply_modules(replies):
            ideal = torch.zeros((), dtype=torch.float64)
            for (_, r), pk in zip(replies, p, strict=True):
                b, a = r.arrays[f"lora.{mod}.B"].double(), r.arrays[f"lora.{mod}.A"].double()
                ideal = ideal + pk * (b @ a)
            delta, before, after = fair_correction(
                ideal,
                means[f"{mod}.B"],
                means[f"{mod}.A"],
                self.fair_lambda,
                self.fair_lr,
                self.fair_steps,
                self.fair_cosine,
            )
            arrays[f"lora.{mod}.A"] = means[f"{mod}.A"]
            arrays[f"lora.{mod}.B"] = (means[f"{mod}.B"] + delta).contiguous()
            gaps.append((before, after))
        n = max(len(gaps), 1)
        return {}, {
            "fair_gap_before": sum(g[0] for g in gaps) / n,
            "fair_gap_after": sum(g[1] for g in gaps) / n,
        }
