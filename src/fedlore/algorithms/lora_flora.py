"""FLoRA (Wang et al., NeurIPS 2024; reference notes section 11): stack the clients' adapters,
merge the stack into the base, restart from fresh adapters.

* Trained: a fresh rank-r_k adapter each round (A_k Kaiming-uniform from the client's stream,
  B_k = 0; ``client_ranks`` for heterogeneous ranks; plus the dense head).
* Travels, per m x n matrix: up (A_k, B_k), r_k(m+n); down last round's stack, (Σ_k r_k)(m+n),
  to every client (a client that missed rounds gets each missed stack, or the dense base when
  that is smaller or the log is gone).
* Server: ``A_stack = [p_1 s_1 A_1; p_2 s_2 A_2; ...]`` (rows), ``B_stack = [B_1, B_2, ...]``
  (columns), both in client-id order, so ``B_stack A_stack = Σ_k p_k s_k B_k A_k`` exactly for any
  mix of ranks; merged into the base in fp32 on the server and, from the same payload with the
  same function, on every client.
* Round start: the merged base and a fresh adapter (never the previous round's).

Source: arXiv 2409.05976; ATP-1010/FederatedLLM ``fed_utils/model_aggregation.py`` (weights on
A only, heterogeneous ``alpha_k = 2 r_k``: ``alpha_rule="proportional"`` here). Avoided bugs: the
official stacked config assumes ``Σ r_k = r · num_clients`` (breaks under partial participation)
and ``junkangLiu0/FedLore`` ``apply_weights_FLORA`` builds the stack with ``alpha = 2r`` at rank
``r·N``, shrinking the merged update N-fold; here each client's own ``p_k s_k`` is folded into its
A block, so the merge scale is exact whatever the ranks and participants.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch

from fedlore.algorithms.lora_common import reply_modules
from fedlore.algorithms.lora_hetero import HeteroRankMethod
from fedlore.lora import Target, kaiming_a, product, zeros_b
from fedlore.registry import register_algorithm
from fedlore.types import Arrays, Reply, Scalars


@register_algorithm("flora")
@dataclass(frozen=True)
class FLoRA(HeteroRankMethod):
    """FLoRA: noise-free stacking of heterogeneous adapters, merged every round."""

    name: ClassVar[str] = "flora"
    capabilities = replace(
        HeteroRankMethod.capabilities,
        individual_uploads=(
            "its server stacks each client's factors p_k s_k A_k and B_k into a rank-Σ r_k adapter "
            "that it merges and broadcasts, so every client's own factors go to all clients"
        ),
        transport_16bit=True,
    )
    merges: ClassVar[bool] = True
    alpha_rule: Literal["fixed", "proportional"] = "proportional"

    def init_adapters(
        self, base: Arrays, targets: dict[str, Target], rng: torch.Generator
    ) -> Arrays:
        return {}  # no global adapter: every round starts fresh

    def start_adapters(
        self,
        held: Arrays,
        rnd: int,
        rank: int,
        targets: dict[str, Target],
        fresh: torch.Generator,
    ) -> Arrays:
        out: Arrays = {}
        for mod, t in targets.items():  # loaded into the client's model (on its device)
            out[f"{mod}.A"] = kaiming_a(rank, t.n, fresh)
            out[f"{mod}.B"] = zeros_b(t.m, rank)
        return out

    def aggregate_adapters(
        self, arrays: Arrays, replies: list[tuple[int, Reply]], p: list[float], rnd: int
    ) -> tuple[Arrays, Scalars]:
        mods = reply_modules(replies)
        log: Arrays = {}
        for mod in mods:
            a_blocks, b_blocks = [], []
            for (_, r), pk in zip(replies, p, strict=True):
                a = r.arrays[f"lora.{mod}.A"]
                a_blocks.append(a.float() * (pk * self.client_scale(a.shape[0])))
                b_blocks.append(r.arrays[f"lora.{mod}.B"].float())
            log[f"{mod}.A"] = torch.cat(a_blocks, dim=0).contiguous()
            log[f"{mod}.B"] = torch.cat(b_blocks, dim=1).contiguous()
        ranks = [int(r.arrays[f"lora.{mods[0]}.A"].shape[0]) for _, r in replies]
        return log, {"stack_rank": sum(ranks)}

    def merge_deltas(self, log: Arrays, held: Arrays, modules: list[str]) -> Arrays:
        return {mod: product(log[f"{mod}.B"], log[f"{mod}.A"]) for mod in modules}
