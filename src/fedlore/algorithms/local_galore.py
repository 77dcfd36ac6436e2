"""Local GaLore in federated training (seed Appendix E, Algorithm 2).

Each client builds its own basis ``P_i`` per projected matrix from the top-r left singular
vectors of a round-start gradient on a separate construction minibatch (line 4–6), runs K steps
of Adam in ``P_i`` coordinates with moments reset (lines 8–18), and uploads the dense update
``ΔW_i = W_K - W^t`` (line 20–21); the server adds the weighted mean (line 24). The projection
side and the set of projected tensors follow the same rule as FedLore
(:func:`fedlore.optim.subspace.projection_plan`). Bytes per matrix: mn up, mn down.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from fedlore.algorithms.base import construction_gradients, local_eval_metrics, reply_metrics
from fedlore.algorithms.dense import DenseServer
from fedlore.algorithms.lowrank import LowRankHyper, ProjectedResult, train_projected
from fedlore.data.client_data import ClientData
from fedlore.optim.subspace import MatrixSpec
from fedlore.registry import register_algorithm
from fedlore.types import Arrays, Broadcast, Reply, Scalars, State


@dataclass(frozen=True)
class GaLoreRound:
    """A Local GaLore client round's inputs (:meth:`LocalGaLore.round_setup`)."""

    start: Arrays
    keep: State
    plan: dict[str, MatrixSpec]
    bases: Arrays
    rnd: int
    lrs: list[float]
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]]


@register_algorithm("local_galore")
@dataclass(frozen=True)
class LocalGaLore(DenseServer, LowRankHyper):
    """Per-client gradient-SVD bases with dense uploads (the subspace-fragmentation baseline)."""

    name: ClassVar[str] = "local_galore"
    capabilities = replace(
        LowRankHyper.capabilities,
        individual_uploads=(
            "its server only adds the weighted mean of the dense deltas ΔW_i (linear in the "
            "uploads; the per-client bases P_i never leave the clients), but Local GaLore is not "
            "yet offered under secure aggregation and DP (no test covers it there)"
        ),
        robust_aggregate=True,
        server_optimizer=True,
        projects="client",
    )

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        self.checked_plan(model)
        return super().init_server(model, rng)

    def client_bases(self, grads: Arrays, rng: torch.Generator) -> Arrays:
        """Algorithm 2 lines 4–6: per projected matrix, the top-r left singular vectors of its
        gradient view ``m x n`` (``m x r``); the first r standard basis vectors if the gradient
        is not finite."""
        bases = {}
        for k, g in grads.items():
            finite = bool(torch.isfinite(g).all())
            bases[k] = (
                self.top_r(g, self.rank, rng, g.dtype)
                if finite
                else torch.eye(g.shape[0], self.rank, dtype=g.dtype, device=g.device)
            )
        return bases

    def diagnostic_bases(
        self, state: State, rnd: int, grads: Arrays | None, rng: torch.Generator
    ) -> Arrays:
        """The bases a client would build from gradient views ``grads`` (the diagnostic batch
        stands in for its construction minibatch)."""
        if grads is None:
            raise ValueError("Local GaLore's bases are per client: pass the client's gradients")
        return self.client_bases(grads, rng)

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        r = self.round_setup(msg, state, model, data, rng)
        res = train_projected(self, model, r.batches, r.plan, r.bases, r.lrs)
        metrics = self.round_metrics(res, model, data, r.rnd)
        return Reply(self.dense_update(model, r.start), metrics), r.keep

    def round_setup(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> GaLoreRound:
        """A client round's inputs: the dense start, the kept state, the plan, the client's
        own bases from one construction minibatch, the round's learning rates and batches
        (FedGaLore's client starts the same way)."""
        start, keep = self.dense_start(msg, state, model)
        plan = self.plan(model)
        grads = construction_gradients(model, data.train, self.train.batch_size, rng, list(plan))
        bases = self.client_bases({k: s.view(grads[k]) for k, s in plan.items()}, rng)
        rnd = int(msg.config["round"])
        lrs = self.round_lrs(rnd, data.num_examples)
        batches = data.batches(self.train.batch_size, len(lrs), rng, rnd)
        return GaLoreRound(start, keep, plan, bases, rnd, lrs, batches)

    def round_metrics(
        self, res: ProjectedResult, model: nn.Module, data: ClientData, rnd: int, **extra: float
    ) -> Scalars:
        """The reply's metrics of a round of :func:`train_projected` (``extra`` added)."""
        return reply_metrics(
            data.num_examples,
            train_loss=res.stats.mean_loss,
            skipped_steps=res.stats.skipped_steps,
            optimizer_state_bytes=res.state_bytes,
            basis_bytes=res.basis_bytes,
            train_s=res.train_s,
            **extra,
            **local_eval_metrics(self, model, data, rnd),
        )
