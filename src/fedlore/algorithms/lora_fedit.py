"""FedIT (Zhang et al., ICASSP 2024; reference notes section 6): FedAvg on LoRA factors.

* Trained: A and B of every adapted Linear, starting from the global adapter (plus the dense
  head, see :mod:`fedlore.algorithms.lora_common`).
* Travels, per m x n matrix: down the global (A, B), r(m+n); up the client's (A_i, B_i), r(m+n).
  The frozen base crosses once, at first contact.
* Server: ``A <- Σ p_i A_i`` and ``B <- Σ p_i B_i`` key by key (factor averaging; its error
  against the ideal ``Σ p_i B_i A_i`` is ``-Σ p_i (B_i - B̄)(A_i - Ā)``, section 0). The base is
  never merged; the global model is ``W0 + s B A``.
* Secure aggregation / DP: sum-aggregable (the server needs only ``Σ p_i A_i``, ``Σ p_i B_i`` and
  the dense sums); with ``upload_increments`` the client uploads ``A_i - A``, ``B_i - B`` and the
  server adds their weighted means (:mod:`fedlore.algorithms.lora_common`).
* Round start: the global (A, B). Round 0 is PEFT's init (A Kaiming-uniform, B = 0) drawn once
  by the server, so every client starts from the same adapter.

Source: arXiv 2305.05644; JayZhang42/FederatedGPT-Shepherd ``fed_utils/model_aggregation.py``
(data-size weights, key-by-key means). Avoided bug: the FedIT path of ATP-1010/FederatedLLM
keeps only ``p_1 (A_1, B_1)`` of the first client (misspelled accumulator); here every accepted
client enters both sums.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from fedlore.algorithms.lora_common import LoraMethod
from fedlore.registry import register_algorithm
from fedlore.tensors import with_prefix
from fedlore.types import Arrays, Reply, Scalars


@register_algorithm("fedit")
@dataclass(frozen=True)
class FedIT(LoraMethod):
    """FedIT: train both factors, average each factor separately."""

    name: ClassVar[str] = "fedit"
    # server_optimizer: the server averages the factors themselves, so a server optimizer
    # steps from their averaged change (fedlore.optim.server)
    capabilities = replace(
        LoraMethod.capabilities,
        sum_aggregable=True,
        transport_16bit=True,
        server_optimizer=True,
    )

    def aggregate_adapters(
        self, arrays: Arrays, replies: list[tuple[int, Reply]], p: list[float], rnd: int
    ) -> tuple[Arrays, Scalars]:
        arrays.update(with_prefix(self.trained_means(arrays, replies, p, ("A", "B")), "lora."))
        return {}, {}
