"""FRLoRA (Yan et al., ICLR 2025; reference notes section 12): merge the round's residual
product into the base and restart every round from the principal-component adapter of W0.

* Init: per adapted W0, ``s B0 A0`` = its rank-r truncated SVD (``B0 = U_r sqrt(S_r/s)``,
  ``A0 = sqrt(S_r/s) Vh_r``), and the residual base ``W_res = W0 - s B0 A0`` (fp32 merge), so the
  initial model is W0 up to rounding.
* Trained: A and B from (A0, B0) every round (the paper; ``freeze_a=True`` trains only B, as the
  released code does), plus the dense head, which is kept across rounds.
* Travels, per m x n matrix: up (A_i, B_i), r(m+n) (mr with ``freeze_a``); down the previous
  round's (Ā, B̄), r(m+n) (mr), from which the client rebuilds the merge with its held (A0, B0).
  (A0, B0) cross once, at first contact.
* Server: ``Ā = Σ p_i A_i``, ``B̄ = Σ p_i B_i``, ``W_res <- W_res + s (B̄ Ā - B0 A0)`` in fp32
  (the residual merge); the global model is ``W_res + s B0 A0 = W0 + Σ_t ΔW_t``, whose rank can
  grow past r over rounds.
* Round start: (A0, B0), never recomputed.

Source: ICLR 2025 paper (abstract); IAMJackYan/FRLoRA ``fed_global.py`` (``ours_init``,
``global_aggregate``), ``trainer.py``. Avoided bugs: the released trainer freezes ``lora_A``
(contradicting the paper's higher-rank updates; here both train unless ``freeze_a``); its
optimizer moments persist across rounds and act after B is reset to B0 (here a fresh AdamW each
round); ``junkangLiu0/FedLore`` "FRLoRA" is a different algorithm (SVD of averaged products, no
merge) that drops the uploaded heads (here the head is averaged and kept).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from fedlore.algorithms.lora_common import LoraMethod, factor_means
from fedlore.lora import Factor, Target, merge, principal_factors, product
from fedlore.registry import register_algorithm
from fedlore.types import Arrays, Reply, Scalars


@register_algorithm("frlora")
@dataclass(frozen=True)
class FRLoRA(LoraMethod):
    """FRLoRA: residual merge each round, restart from the principal components of W0.

    Attributes:
        freeze_a: train only B (the released code's behaviour) instead of both factors.
    """

    name: ClassVar[str] = "frlora"
    capabilities = replace(
        LoraMethod.capabilities,
        individual_uploads=(
            "its server needs only the factor means Ā and B̄ (linear in the uploads), but they are "
            "its merge payload relative to the fixed (A0, B0), its clients upload values, and "
            "FRLoRA is not yet offered under secure aggregation and DP (no increments path is "
            "implemented for it)"
        ),
        transport_16bit=True,
    )
    merges: ClassVar[bool] = True
    freeze_a: bool = False

    def trained(self, rnd: int) -> tuple[Factor, ...]:
        return ("B",) if self.freeze_a else ("A", "B")

    def init_adapters(
        self, base: Arrays, targets: dict[str, Target], rng: torch.Generator
    ) -> Arrays:
        """(A0, B0) from the SVD of each W0; ``base`` is turned into W_res in place."""
        s = self.client_scale(self.rank)
        out: Arrays = {}
        for mod in targets:
            w0 = base[f"{mod}.weight"]
            b0, a0 = principal_factors(w0, self.rank, s)
            base[f"{mod}.weight"] = merge(w0, -product(b0, a0, s))
            out[f"{mod}.A"], out[f"{mod}.B"] = a0, b0
        return out

    def aggregate_adapters(
        self, arrays: Arrays, replies: list[tuple[int, Reply]], p: list[float], rnd: int
    ) -> tuple[Arrays, Scalars]:
        return factor_means(replies, p, self.trained(rnd)), {}

    def merge_deltas(self, log: Arrays, held: Arrays, modules: list[str]) -> Arrays:
        s = self.client_scale(self.rank)
        out: Arrays = {}
        for mod in modules:
            a0, b0 = held[f"{mod}.A"], held[f"{mod}.B"]
            a_bar = log.get(f"{mod}.A", a0)
            out[mod] = product(log[f"{mod}.B"], a_bar, s) - product(b0, a0, s)
        return out
