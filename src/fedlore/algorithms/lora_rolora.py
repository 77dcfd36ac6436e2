"""RoLoRA (Chen et al., ICML 2024 ES-FoMo / NeurIPS 2025; reference notes section 10):
alternate the trained factor by global round.

* Trained: B in even rounds (0, 2, ...: a B-round must come first, since with B = 0 the gradient
  of A is ``s Bᵀ G = 0``), A in odd rounds; the other factor is frozen (plus the dense head).
* Travels, per m x n matrix: up the trained factor (mr in B-rounds, rn in A-rounds). Down the
  global factors changed since the client's last round: under full participation that is the
  factor the previous round moved, i.e. the one frozen now (rn in B-rounds, mr in A-rounds; the
  paper books the same tensor as the previous round's broadcast, so every two rounds cost
  ``r(m+n)`` each way in both accountings). A client that missed rounds gets both.
* Server: the mean of the trained factor, ``B <- Σ p_i B_i`` or ``A <- Σ p_i A_i``; exact, since
  the frozen factor is identical everywhere. Global model ``W0 + s B A``.
* Round start: the global (A, B).

Source: arXiv 2409.02346 Sec. 3 (v1; uniform weights there, here the run's one rule, use
``weighting=uniform`` for the paper's). Avoided bug: ``junkangLiu0/FedLore`` ``update_RoLoRA``
keys the parity off a per-actor call counter, so clients of one round can train different
factors when an actor runs several clients; the parity here is the global round in the
broadcast, the same for every client whoever ran before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from fedlore.algorithms.lora_common import LoraMethod, factor_means
from fedlore.lora import Factor
from fedlore.registry import register_algorithm
from fedlore.tensors import with_prefix
from fedlore.types import Arrays, Reply, Scalars


@register_algorithm("rolora")
@dataclass(frozen=True)
class RoLoRA(LoraMethod):
    """RoLoRA: B-rounds and A-rounds alternate; only the trained factor is averaged."""

    name: ClassVar[str] = "rolora"
    capabilities = replace(
        LoraMethod.capabilities,
        individual_uploads=(
            "its server needs only the mean of the round's trained factor (linear in the uploads), "
            "but its clients upload values and RoLoRA is not yet offered under secure "
            "aggregation and DP (no increments path is implemented for it)"
        ),
        transport_16bit=True,
    )

    def trained(self, rnd: int) -> tuple[Factor, ...]:
        return ("B",) if rnd % 2 == 0 else ("A",)

    def aggregate_adapters(
        self, arrays: Arrays, replies: list[tuple[int, Reply]], p: list[float], rnd: int
    ) -> tuple[Arrays, Scalars]:
        arrays.update(with_prefix(factor_means(replies, p, self.trained(rnd)), "lora."))
        return {}, {}
