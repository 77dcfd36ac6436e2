"""Bayesian FedLore (issue 35): Meta-BayFL's mean-field BNN clients (seed 001,
the Meta-BayFL paper, arXiv 2603.18083) communicating through FedLore's shared, refreshed
low-rank basis (seed 000, the FedLore paper, Algorithm 1).

Why. Seed 001 names its own cost (§V-D): a BNN client uploads its posterior's means and scales
``(mu, rho)``, twice FedAvg's bytes per round, and it leaves "Bayesian compression" to future
work. Seed 000's shared basis is such a compression: a matrix's round update travels as its
``r x n`` coordinates in a basis ``P^t`` (``m x r``) every client shares, and the basis is
refreshed from the clients' ``m x r`` candidates, ``r (m + n)`` numbers up and down per matrix
where a dense upload is ``m n``.

What. Every ``BayesLinear`` / ``BayesConv2d`` layer's ``weight_mu`` and (``scales="project"``,
the default) ``weight_rho`` are projected matrices of FedLore, each with its own basis (the
seed's rule: ``min(m, n) > r``, the ``params.exclude`` prefixes, the head by default, stay
dense); biases (their mu and rho), the head and matrices the rank covers travel densely as in
FedLore. Per projected matrix and round a client uploads ``ΔZ_i`` (``r x n``) and its candidate
``P_i`` (``m x r``), ``r (m + n)`` numbers; the server averages the coordinates, applies
``W^{t+1} = W^t + P^t Δ^t`` to mu and to rho alike (FedAvg of (mu, rho), BayFL's ``mean``
combination, restricted to the shared subspace) and refreshes each basis (seed 000 lines 25-27).
``scales="dense"`` sends every rho matrix densely (only the means are compressed).

The client (seed 001 Algorithm 1 lines 6-19 inside seed 000 Algorithm 1 lines 6-22): synchronize
the cached global posterior, then train ``local_steps`` (or ``local_epochs``) steps of projected
Adam on the per-example negative ELBO ``mean NLL(y | x, w_s) + beta_kl · KL(q || p) / N_k`` (one
weight sample per minibatch, :func:`~fedlore.algorithms.bayes_search.elbo_kl_term`) with Adam's
moments in the basis coordinates, choosing the learning rate before every local epoch as
Meta-BayFL does (:func:`~fedlore.algorithms.bayes_search.train_with_search`: each candidate
trains a deep copy of the model and of the projected optimizer for ``temp_steps`` steps and is
scored by the MC-predictive NLL on the round's meta split d ⊂ D). The candidate ``P_i`` of a
matrix is the top-r left singular subspace of its last finite ELBO gradient (mu's gradient for a
mean matrix, rho's for a scale matrix). The setup exchange's P^0 comes from one minibatch
gradient of the NLL at W^0 with one weight sample.

Choices the seeds leave open, each ours: rho's matrices get their own bases (their gradients are
not the means'; a shared basis would save ``m r`` numbers per matrix down and up but train rho
in the means' directions); the server combines posteriors by the mean of (mu, rho) only (the
nonlinear combinations of :func:`~fedlore.bayes.combine_gaussians` would leave the subspace);
trials are sequential (no vmap over a projected optimizer). Weight samples come from torch's
global generator seeded from the client's round generator, so a round is reproducible.

Registered: ``fedlore_bayes`` (with the search) and ``fedlore_bayfl`` (``lr_search="none"``,
BayFL's fixed rate).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms import meta_lr
from fedlore.algorithms.bayes_search import BayesSearch, elbo_kl_term, train_with_search
from fedlore.algorithms.fedlore import FedLore
from fedlore.algorithms.lowrank import ProjectedResult, train_projected
from fedlore.algorithms.meta_lr import meta_split
from fedlore.bayes import (
    BayesConv2d,
    BayesLinear,
    GaussianPrior,
    bayesianize,
    kl_divergence,
    sampling,
    seeded,
)
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.optim.projected_adam import ProjectedAdam
from fedlore.optim.subspace import MatrixSpec
from fedlore.registry import register_algorithm
from fedlore.train.local import GradHook, LossTerm, TrainStats
from fedlore.types import Arrays, Broadcast, Reply, State


@register_algorithm("fedlore_bayes")
@dataclass(frozen=True)
class FedLoreBayes(BayesSearch, FedLore):
    """Bayesian FedLore (module docstring): FedLore's settings, the BNN's and the search's of
    :class:`~fedlore.algorithms.bayes_search.BayesSearch`, and

    Attributes:
        scales: ``"project"`` (default: every projected layer's ``weight_rho`` is a projected
            matrix with its own basis, ``r (m + n)`` numbers per round like the means) or
            ``"dense"`` (the rho matrices train and travel densely; only the means are
            projected).
    """

    name: ClassVar[str] = "fedlore_bayes"
    capabilities = replace(
        FedLore.capabilities,
        individual_uploads=(
            "its bases are the SVD of the stack of the clients' candidate bases P_i (FedLore's "
            "rule), which needs each P_i on its own, and the run reports each client's searched "
            "learning rate"
        ),
    )
    per_client_metrics: ClassVar[tuple[str, ...]] = ("lr_chosen", "lr_picks")
    trials: ClassVar[Literal["batched", "sequential"]] = "sequential"
    scales: Literal["project", "dense"] = "project"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scales not in ("project", "dense"):
            raise ValueError(f"{self.name}: invalid scales={self.scales!r}")

    # -- model ----------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The registered model as a mean-field BNN (means = its initial weights, rho =
        ``rho_init``), in place and idempotently (:func:`~fedlore.bayes.bayesianize`)."""
        prior = GaussianPrior(self.prior_mu, self.prior_sigma)
        return bayesianize(model, prior, self.rho_init, self.bnn_estimator)

    def projectable(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """Each Bayesian layer's ``weight_mu`` and, with ``scales="project"``, ``weight_rho``
        (name -> shape, in model order; a model not converted yet is read as converted)."""
        if not any(isinstance(m, BayesLinear | BayesConv2d) for m in model.modules()):
            model = self.prepare_model(copy.deepcopy(model))
        kinds = ("weight_mu", "weight_rho") if self.scales == "project" else ("weight_mu",)
        out: dict[str, tuple[int, ...]] = {}
        for mod_name, mod in model.named_modules():
            if isinstance(mod, BayesLinear | BayesConv2d):
                for kind in kinds:
                    key = f"{mod_name}.{kind}" if mod_name else kind
                    out[key] = tuple(getattr(mod, kind).shape)
        return out

    # -- server and client ----------------------------------------------------------------

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        """FedLore's server state of the converted model (means, scales, bases)."""
        return super().init_server(self.prepare_model(model), rng)

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """FedLore's client round (:class:`~fedlore.algorithms.fedlore_client.FedLoreClient`) on
        the converted model, its weight samples drawn from torch's generator seeded by ``rng``
        (the setup exchange's gradient included)."""
        model = self.prepare_model(model)
        with seeded(rng), sampling(model, True):
            return super().client_update(msg, state, model, data, rng)

    def train_round(
        self,
        model: nn.Module,
        data: ClientData,
        plan: dict[str, MatrixSpec],
        bases: Arrays,
        rng: torch.Generator,
        rnd: int,
        state: State | None,
    ) -> ProjectedResult:
        """The round's steps of projected Adam on the ELBO, a learning-rate search before every
        local epoch (module docstring); the reply also carries ``kl`` and the searches'
        ``lr_chosen``, ``lr_searches`` and ``lr_picks``."""
        search = self.searches(data.num_examples)
        fit, meta = (
            meta_split(data, self.meta_fraction, self.meta_split, self.meta_seed(rng))
            if search
            else (data.train, None)
        )
        terms = [elbo_kl_term(self.beta_kl, len(fit))]
        base = self.round_lrs(rnd, len(fit))
        search_seed = int(torch.randint(0, 2**62, (1,), generator=rng))
        batches = dataclasses.replace(data, train=fit).batches(
            self.train.batch_size, len(base), rng, rnd
        )
        done: list[dict[str, float | int | str]] = []

        def run(
            net: nn.Module,
            it: Iterable[tuple[torch.Tensor, torch.Tensor]],
            opt: ProjectedAdam,
            lrs: list[float],
            hooks: list[GradHook],
        ) -> TrainStats:
            out = train_with_search(
                self, net, opt, it, lrs, fit, meta, terms, search_seed, rnd, on_grad=hooks
            )
            done.append(out.metrics())
            return out.stats

        res = train_projected(
            self, model, batches, plan, bases, base, keep_last_grad=self.rule.refreshes, runner=run
        )
        with torch.no_grad():
            extra: dict[str, float | int | str] = {"kl": float(kl_divergence(model)), **done[0]}
        return replace(res, extra=extra)

    def select_lr(
        self,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        fit: TensorSplit,
        meta: TensorSplit,
        terms: list[LossTerm],
        seed: int,
        factors: list[float] | None = None,
    ) -> tuple[float, list[float]]:
        """Seed 001 Algorithm 1 lines 10-15 with the projected optimizer: each candidate trains
        a copy of the model and of the optimizer (moments in the shared coordinates) and is
        scored on ``meta`` (:func:`fedlore.algorithms.meta_lr.select_lr`)."""
        return meta_lr.select_lr(self, model, opt, fit, meta, terms, seed, factors)


@register_algorithm("fedlore_bayfl")
@dataclass(frozen=True)
class FedLoreBayFL(FedLoreBayes):
    """Bayesian FedLore at a fixed learning rate (BayFL's, no search)."""

    name: ClassVar[str] = "fedlore_bayfl"
    capabilities = replace(
        FedLoreBayes.capabilities,
        individual_uploads=(
            "its bases are the SVD of the stack of the clients' candidate bases P_i of the means "
            "and scales (FedLore's rule), which needs each P_i on its own"
        ),
    )
    lr_search: Literal["per_epoch", "per_round", "none"] = "none"
