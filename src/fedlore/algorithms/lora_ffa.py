"""FFA-LoRA (Sun et al., ICLR 2024; reference notes section 7): freeze A, train and send B.

* Trained: B only (plus the dense head); A keeps its random init for the whole run.
* Travels, per m x n matrix: down B, mr; up B_i, mr. A (rn) crosses once, at first contact,
  with the frozen base.
* Server: ``B <- Σ p_i B_i``. Exact: ``Σ p_i B_i A = B̄ A`` because A is the same tensor on
  every client. Global model ``W0 + s B A``.
* Secure aggregation / DP: sum-aggregable (the server needs only ``Σ p_i B_i`` and the dense
  sums); with ``upload_increments`` the client uploads ``B_i - B`` and the server adds their
  weighted mean (:mod:`fedlore.algorithms.lora_common`).
* Round start: the global B and the fixed A.

Source: arXiv 2403.12313 (no official code; re-implementations ``junkangLiu0/FedLore``
``update_FFA_LoRA`` and ``IAMJackYan/FRLoRA`` ``FFALORATrainer``). Avoided pitfall: per-client
seeding of A breaks exactness; A is drawn once by the server from the run's generator and
broadcast, so it is bit-identical everywhere (and, unlike ``junkangLiu0/FedLore``, never
uploaded).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from fedlore.algorithms.lora_common import LoraMethod
from fedlore.lora import Factor
from fedlore.registry import register_algorithm
from fedlore.tensors import with_prefix
from fedlore.types import Arrays, Reply, Scalars


@register_algorithm("ffa_lora")
@dataclass(frozen=True)
class FFALoRA(LoraMethod):
    """FFA-LoRA: A frozen at its shared random init, B trained and averaged."""

    name: ClassVar[str] = "ffa_lora"
    # server_optimizer: the server averages the factors themselves, so a server optimizer
    # steps from their averaged change (fedlore.optim.server)
    capabilities = replace(
        LoraMethod.capabilities,
        sum_aggregable=True,
        transport_16bit=True,
        server_optimizer=True,
    )

    def trained(self, rnd: int) -> tuple[Factor, ...]:
        return ("B",)

    def aggregate_adapters(
        self, arrays: Arrays, replies: list[tuple[int, Reply]], p: list[float], rnd: int
    ) -> tuple[Arrays, Scalars]:
        arrays.update(with_prefix(self.trained_means(arrays, replies, p, ("B",)), "lora."))
        return {}, {}
