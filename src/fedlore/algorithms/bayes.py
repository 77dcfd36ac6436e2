"""The Meta-BayFL family of methods: Meta-BayFL (seed 001,
the Meta-BayFL paper, arXiv 2603.18083, Algorithm 1) and its comparators BayFL, the
MC-dropout variants and Meta-FL, trained on the ELBO of Eq. 17 (:func:`elbo_kl_term`). One class,
three switches:

* ``posterior``: ``"bnn"`` (every Linear/Conv2d mean-field Gaussian,
  :func:`fedlore.bayes.bayesianize`, trained on the ELBO), ``"mcdropout"`` (dropout before the
  Linear layers, Gal & Ghahramani 2016, cross-entropy), or ``"none"`` (the deterministic model,
  cross-entropy);
* ``lr_search``: ``"per_epoch"`` (seed Algorithm 1 lines 7-17: before every local epoch each
  candidate learning rate trains a temporary copy for ``temp_steps`` steps, is scored on the
  client's meta split d, and the lowest loss trains the epoch), ``"per_round"`` (one search at
  the round's start, the authors' code, reference notes Part 1.3), or ``"none"`` (the fixed
  ``lr``);
* ``posterior_aggregation``: how the server combines (mu, rho) (reference notes Part 0.6).

Registered methods:

============================  ==========  ===========
name                          posterior   lr_search
============================  ==========  ===========
``meta_bayfl``                bnn         per_epoch
``bayfl``                     bnn         none
``meta_bayfl_mcd``            mcdropout   per_epoch
``fedavg_mcd``                mcdropout   none
``meta_fl``                   none        per_epoch
============================  ==========  ===========

Client objective (reference notes Part 0.3, our adopted reading; seed Eqs. 3 and 17): the
per-example negative ELBO ``L_b = mean_b NLL(y | x, w_s) + beta_kl · KL(q || p) / N_k`` with one
weight sample ``w_s`` per minibatch and ``N_k = |D_n^k|`` the client's training examples. Each
round starts from the global posterior with a fresh optimizer, for ``local_epochs`` passes over
the client's data (seed Algorithm 1 line 7, "for each local training epoch t"; the seed-001
configs set it) or ``local_steps`` steps like every other method; an "epoch" is
``ceil(N_k / batch_size)`` steps, and ``lr_search="per_epoch"`` searches before each, so a round
of E epochs holds E searches. Each trial step runs at its candidate rate times the
learning-rate schedule's factor at the local step it stands for, and the epoch then trains at
the chosen rate times the same factors. Server: FedAvg of the
variational parameters weighted by n_k (seed Eq. 22 uses equal weights: ``weighting: uniform``,
as every seed-table config sets).

The learning-rate search (Algorithm 1 lines 7-17, Eqs. 19-20: the meta split, the trials, their
scores) is :mod:`fedlore.algorithms.meta_lr`; the closed-form Gaussian math, the server's
combination of posteriors included, is :mod:`fedlore.bayes.posterior`.

Communication: the BNN sends (mu, rho), twice the deterministic parameter count (seed §V-D).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms import meta_lr
from fedlore.algorithms.base import local_eval_metrics, reply_metrics
from fedlore.algorithms.bayes_search import BayesSearch, elbo_kl_term, train_with_search
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedFull, optimizer_state_bytes
from fedlore.algorithms.meta_lr import meta_split
from fedlore.bayes import (
    Aggregation,
    GaussianPrior,
    add_mc_dropout,
    bayesianize,
    combine_gaussians,
    is_bayesian,
    kl_divergence,
    sampling,
    seeded,
)
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.registry import register_algorithm
from fedlore.train.local import LossTerm
from fedlore.types import Broadcast, Reply, State

__all__ = ["BayFL", "FedAvgMCDropout", "MetaBayFL", "MetaBayFLMCDropout", "MetaFL", "elbo_kl_term"]


POSTERIOR_SETTINGS = {
    "bnn": ("beta_kl", "prior_mu", "prior_sigma", "rho_init"),
    "mcdropout": ("dropout", "conv_dropout"),
}
"""The settings only one posterior reads, refused under another when not at their defaults:
they would change nothing (``bnn_estimator`` has a check of its own)."""


@register_algorithm("meta_bayfl")
@dataclass(frozen=True)
class MetaBayFL(BayesSearch, FedFull):
    """Meta-BayFL and its comparators (module docstring). Hyperparameters beyond :class:`Hyper`
    and the BNN's and search's of :class:`~fedlore.algorithms.bayes_search.BayesSearch`:

    Attributes:
        posterior: ``"bnn"``, ``"mcdropout"`` or ``"none"``; a setting of one posterior (the
            BNN's ``beta_kl``, ``prior_mu``, ``prior_sigma``, ``rho_init``, MC dropout's
            ``dropout``, ``conv_dropout``) is refused under another unless at its default.
        local_optimizer: ``"adamw"`` (Adam when ``weight_decay`` = 0, the authors' choice) or
            ``"sgd"`` (the seed's update, Eq. 21).
        momentum: SGD momentum coefficient (≥ 0), read only with ``local_optimizer="sgd"``
            (0, the default: the seed's plain update); a non-zero value makes
            ``trials="batched"`` fall back to sequential trials.
        dropout: MC-dropout rate before every Linear (``posterior="mcdropout"``).
        conv_dropout: MC-dropout rate before every Conv2d but the first (0: none).
        posterior_aggregation: ``"mean"`` (A), ``"sigma"`` (B), ``"moment"`` (C) or
            ``"precision"`` (D) of :func:`~fedlore.bayes.combine_gaussians`; deterministic
            tensors always average.
        trials: ``"sequential"`` (default) trains the J temporary copies one after another;
            ``"batched"`` runs them as one vectorized computation
            (:func:`~fedlore.algorithms.meta_lr.batched_trials`, ``torch.func.vmap`` over the
            candidates; models with BatchNorm or a gradient clip
            fall back to sequential). Both draw the same weight samples and give the same scores
            up to float rounding while every trial step is finite (a batched trial stops at its
            first non-finite step; a sequential one skips it). Batched is slower on CPU for
            conv nets (``vmap`` turns each conv into a grouped conv): see
            ``benchmarks/bayes_time.py``. The BNN's ``bnn_estimator`` applies only with
            ``posterior="bnn"``.
    """

    name: ClassVar[str] = "meta_bayfl"
    capabilities = replace(
        FedFull.capabilities,
        synchronous_only=(
            "the Meta-BayFL family's server (Gaussian posteriors in its Bayesian variants) is "
            "not tested under FedBuff, which is for fedfull, fedavg and fedprox only"
        ),
        compress_uploads=False,
        sum_aggregable=False,
        transport_16bit=False,
        individual_uploads=(
            "its server can combine each client's Gaussian posterior (mu_i, rho_i) nonlinearly "
            "(posterior_aggregation sigma, moment or precision), and the run reports each client's "
            "searched learning rate (lr_chosen) on its own; only the default mean rule is a "
            "weighted sum"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    per_client_metrics: ClassVar[tuple[str, ...]] = ("lr_chosen", "lr_picks")
    posterior: Literal["bnn", "mcdropout", "none"] = "bnn"
    local_optimizer: Literal["adamw", "sgd"] = "adamw"
    dropout: float = 0.5
    conv_dropout: float = 0.0
    posterior_aggregation: Aggregation = "mean"
    trials: Literal["batched", "sequential"] = "sequential"

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "posterior": self.posterior in ("bnn", "mcdropout", "none"),
            "dropout": 0.0 <= self.dropout < 1.0,
            "conv_dropout": 0.0 <= self.conv_dropout < 1.0,
            "posterior_aggregation": self.posterior_aggregation
            in ("mean", "sigma", "moment", "precision"),
            "trials": self.trials in ("batched", "sequential"),
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{self.name}: invalid {name}={getattr(self, name)!r}")
        if self.bnn_estimator != "weights" and self.posterior != "bnn":
            raise ValueError(
                f"{self.name}: invalid bnn_estimator={self.bnn_estimator!r}: the estimator of a "
                f"BNN, but posterior={self.posterior!r}"
            )
        for owner, names in POSTERIOR_SETTINGS.items():
            idle = [
                f"{f.name}={getattr(self, f.name)!r}"
                for f in dataclasses.fields(self)
                if f.name in names and getattr(self, f.name) != f.default
            ]
            if idle and self.posterior != owner:
                raise ValueError(
                    f"{self.name}: {', '.join(idle)} with posterior={self.posterior!r}: only "
                    f"posterior={owner!r} reads it, so it would change nothing; leave it out"
                )

    # -- model ----------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Make the registered model this method's, in place and idempotently (the scratch
        workspace of :class:`~fedlore.algorithm.Algorithm` is converted on first use): Bayesian
        (means = the deterministic initial weights, rho = ``rho_init``, sampling by
        ``bnn_estimator``), with MC dropout, or unchanged."""
        if self.posterior == "bnn":
            prior = GaussianPrior(self.prior_mu, self.prior_sigma)
            return bayesianize(model, prior, self.rho_init, self.bnn_estimator)
        if self.posterior == "mcdropout":
            return add_mc_dropout(model, self.dropout, self.conv_dropout)
        return model

    # -- server ---------------------------------------------------------------------------

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        """The global (mu, rho) and deterministic tensors of the converted initial model."""
        return super().init_server(self.prepare_model(model), rng)

    def mean_update(
        self,
        model: dict[str, torch.Tensor],
        updates: list[dict[str, torch.Tensor]],
        weights: list[float],
    ) -> dict[str, torch.Tensor]:
        """FedAvg of the deltas; with ``posterior_aggregation`` other than ``mean``, each
        ``*_mu`` / ``*_rho`` pair is combined by :func:`~fedlore.bayes.combine_gaussians` on the
        clients' absolute parameters ``W^t + Δ_i`` and returned as a step from ``W^t``. The
        deltas' combination follows ``robust.aggregate``
        (:meth:`~fedlore.algorithms.dense.DenseServer.combine_deltas`)."""
        mean = self.combine_deltas(updates, weights)
        if self.posterior_aggregation == "mean":
            return mean
        for key in [k for k in mean if k.endswith("_rho")]:
            mu_key = key[: -len("_rho")] + "_mu"
            if mu_key not in mean:
                continue
            mus = [model[mu_key] + u[mu_key] for u in updates]
            rhos = [model[key] + u[key] for u in updates]
            mu, rho = combine_gaussians(mus, rhos, weights, self.posterior_aggregation)
            mean[mu_key] = mu - model[mu_key]
            mean[key] = rho - model[key]
        return mean

    # -- client ---------------------------------------------------------------------------

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """Seed Algorithm 1 lines 6-19 for one client: start from the global (mu, rho), train
        ``local_steps`` steps on the ELBO (or CE), choosing the learning rate before every
        epoch (or once, or never), upload ``W_K - W^t``."""
        model = self.prepare_model(model)
        start, keep = self.dense_start(msg, state, model)
        rnd = int(msg.config["round"])
        search = self.searches(data.num_examples)
        fit, meta = (
            meta_split(data, self.meta_fraction, self.meta_split, self.meta_seed(rng))
            if search
            else (data.train, None)
        )
        terms = [elbo_kl_term(self.beta_kl, len(fit))] if is_bayesian(model) else []
        opt = self.make_optimizer(model)
        base = self.round_lrs(rnd, len(fit))
        search_seed = int(torch.randint(0, 2**62, (1,), generator=rng))
        t0 = time.perf_counter()
        with seeded(rng), sampling(model, True):
            batches = dataclasses.replace(data, train=fit).batches(
                self.train.batch_size, len(base), rng, rnd
            )
            done = train_with_search(
                self, model, opt, batches, base, fit, meta, terms, search_seed, rnd
            )
        train_s = time.perf_counter() - t0
        extra: dict[str, float | int | str] = {}
        if terms:
            with torch.no_grad():
                extra["kl"] = float(kl_divergence(model))
        extra.update(done.metrics())
        metrics = reply_metrics(
            data.num_examples,  # n_k, the aggregation weight (d is part of the client's data)
            train_loss=done.stats.mean_loss,
            skipped_steps=done.stats.skipped_steps,
            optimizer_state_bytes=optimizer_state_bytes(opt),
            train_s=train_s,
            **extra,
            **local_eval_metrics(self, model, data, rnd),
        )
        return Reply(arrays=self.dense_update(model, start), metrics=metrics), keep

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
        """Seed Algorithm 1 lines 10-15: the J temporary trials from the current local model and
        optimizer state, each step at the candidate rate times the schedule's ``factors``,
        scored on ``meta`` (:func:`fedlore.algorithms.meta_lr.select_lr`).

        Returns:
            (the lowest-scoring candidate, the J scores).
        """
        return meta_lr.select_lr(self, model, opt, fit, meta, terms, seed, factors)

    def candidate_score(self, model: nn.Module, meta: TensorSplit, terms: list[LossTerm]) -> float:
        """The score of a temporary copy on d, lower is better (seed Eq. 19 or the per-example
        negative ELBO: :func:`fedlore.algorithms.meta_lr.candidate_score`)."""
        return meta_lr.candidate_score(self, model, meta, terms)


@register_algorithm("bayfl")
@dataclass(frozen=True)
class BayFL(MetaBayFL):
    """BayFL: the BNN trained on the ELBO with a fixed learning rate, FedAvg of (mu, rho)
    (reference notes Part 2)."""

    name: ClassVar[str] = "bayfl"
    capabilities = replace(
        MetaBayFL.capabilities,
        individual_uploads=(
            "its server can combine each client's Gaussian posterior (mu_i, rho_i) nonlinearly "
            "(posterior_aggregation sigma: softplus scales, moment: mixture moments, precision: 1 "
            "/ sigma_i² weights); its default mean rule, FedAvg of (mu, rho), is not yet offered "
            "under secure aggregation and DP"
        ),
    )
    lr_search: Literal["per_epoch", "per_round", "none"] = "none"


@register_algorithm("meta_bayfl_mcd")
@dataclass(frozen=True)
class MetaBayFLMCDropout(MetaBayFL):
    """Meta-BayFL with MC dropout in place of the BNN (seed Table IV; reference notes Part 6)."""

    name: ClassVar[str] = "meta_bayfl_mcd"
    capabilities = replace(
        MetaBayFL.capabilities,
        individual_uploads=(
            "its clients each search a learning rate on their own meta split and the run reports "
            "every client's choice (lr_chosen) on its own; the server's FedAvg of the MC-dropout "
            "model's deltas is not yet offered under secure aggregation and DP"
        ),
    )
    posterior: Literal["bnn", "mcdropout", "none"] = "mcdropout"


@register_algorithm("fedavg_mcd")
@dataclass(frozen=True)
class FedAvgMCDropout(MetaBayFL):
    """FedAvg + MC dropout with a fixed learning rate (separates dropout from the search)."""

    name: ClassVar[str] = "fedavg_mcd"
    capabilities = replace(
        MetaBayFL.capabilities,
        individual_uploads=(
            "its server only adds the weighted mean of the MC-dropout model's deltas, as FedAvg "
            "does (linear in the uploads), but this comparator of Meta-BayFL is not yet offered "
            "under secure aggregation and DP (no test covers it there)"
        ),
    )
    posterior: Literal["bnn", "mcdropout", "none"] = "mcdropout"
    lr_search: Literal["per_epoch", "per_round", "none"] = "none"


@register_algorithm("meta_fl")
@dataclass(frozen=True)
class MetaFL(MetaBayFL):
    """Meta-FL (Rahman et al., IEEE TVT 2024; reference notes Part 3): the deterministic model
    with the same per-client learning-rate search, cross-entropy loss."""

    name: ClassVar[str] = "meta_fl"
    capabilities = replace(
        MetaBayFL.capabilities,
        individual_uploads=(
            "its clients each search a learning rate on their own meta split and the run reports "
            "every client's choice (lr_chosen) on its own; the server's FedAvg of the "
            "deterministic model's deltas is not yet offered under secure aggregation and DP"
        ),
    )
    posterior: Literal["bnn", "mcdropout", "none"] = "none"
