"""Heterogeneous client ranks for the LoRA baselines that support them (FlexLoRA, FLoRA).

Client k trains a rank-r_k adapter; its reply shapes depend on k, so
:meth:`~fedlore.algorithms.lora_common.LoraMethod.expected_reply` needs the client id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedlore.algorithms.lora_common import LoraMethod
from fedlore.lora import scaling


@dataclass(frozen=True)
class HeteroRankMethod(LoraMethod):
    """A LoRA method whose clients may have different ranks (FlexLoRA, FLoRA).

    Attributes:
        client_ranks: r_k of client k is ``client_ranks[k % len(client_ranks)]`` (empty: every
            client uses ``rank``), e.g. FLoRA's ``[64, 32, 16, 16, 8, 8, 4, 4, 4, 4]``.
        alpha_rule: ``"fixed"``: ``alpha_k = lora_alpha`` (PEFT, so ``s_k = lora_alpha / r_k``);
            ``"proportional"``: ``alpha_k = lora_alpha * r_k / rank`` (equal ``s_k =
            lora_alpha / rank``, FLoRA's heterogeneous ``alpha_k = 2 r_k``).
    """

    client_ranks: tuple[int, ...] = ()
    alpha_rule: Literal["fixed", "proportional"] = "fixed"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not all(isinstance(r, int) and r >= 1 for r in self.client_ranks):
            raise ValueError(f"{type(self).__name__}: invalid client_ranks={self.client_ranks!r}")
        if self.alpha_rule not in ("fixed", "proportional"):
            raise ValueError(f"{type(self).__name__}: invalid alpha_rule={self.alpha_rule!r}")

    def client_rank(self, client_id: int) -> int:
        if not self.client_ranks:
            return self.rank
        return int(self.client_ranks[client_id % len(self.client_ranks)])

    def ranks(self) -> set[int]:
        return set(self.client_ranks) or {self.rank}

    def client_scale(self, rank: int) -> float:
        if self.alpha_rule == "proportional":
            return scaling(self.lora_alpha, self.rank)
        return scaling(self.lora_alpha, rank)
