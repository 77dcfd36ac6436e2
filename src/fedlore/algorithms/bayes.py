"""The Meta-BayFL family of methods: Meta-BayFL (seed 001,
``../shared/seeds/001_31a14a9c13b184af.txt``, Algorithm 1) and its comparators BayFL, the
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
import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms import meta_lr
from fedlore.algorithms.base import local_eval_metrics, reply_metrics
from fedlore.algorithms.fedavg import FedFull, optimizer_state_bytes
from fedlore.algorithms.meta_lr import MetaScore, MetaSplit, meta_split
from fedlore.bayes import (
    ESTIMATORS,
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
from fedlore.seeding import derive_seed
from fedlore.train.local import LossTerm, local_train
from fedlore.types import Broadcast, Reply, State


def elbo_kl_term(beta_kl: float, num_examples: int) -> LossTerm:
    """The KL part of the per-example negative ELBO: ``model -> beta_kl · KL(q || p) / N_k``
    (reference notes Part 0.3; the mean NLL is the task loss).

    Raises:
        ValueError: when ``num_examples`` < 1.
    """
    if num_examples < 1:
        raise ValueError(f"the ELBO needs N_k >= 1 training examples, got {num_examples}")

    def term(model: nn.Module) -> torch.Tensor:
        return beta_kl * kl_divergence(model) / num_examples

    return term


@register_algorithm("meta_bayfl")
@dataclass(frozen=True)
class MetaBayFL(FedFull):
    """Meta-BayFL and its comparators (module docstring). Hyperparameters beyond :class:`Hyper`:

    Attributes:
        posterior: ``"bnn"``, ``"mcdropout"`` or ``"none"``.
        lr_search: ``"per_epoch"``, ``"per_round"`` or ``"none"`` (fixed ``lr``).
        candidate_lrs: eta_1..eta_J (default {1e-2, 1e-3, 1e-4}, seed Table III and the
            authors' supplementary code, with Adam).
        temp_steps: T_temp, steps of each temporary copy (reference notes Part 1.7).
        meta_fraction: share of the training split that forms d (seed: 20 %).
        meta_split: ``"subset"`` (the seed: d ⊂ D, the client trains on all of D) or
            ``"heldout"`` (d is removed from training).
        meta_score: ``"nll"`` (the seed's Eq. 19: mean NLL of the MC predictive on d, S =
            ``mc_samples``) or ``"elbo"`` (per-example negative ELBO on d, one weight sample).
        local_optimizer: ``"adamw"`` (Adam when ``weight_decay`` = 0, the authors' choice) or
            ``"sgd"`` (the seed's update, Eq. 21).
        momentum: SGD momentum coefficient (≥ 0), read only with ``local_optimizer="sgd"``
            (0, the default: the seed's plain update); a non-zero value makes
            ``trials="batched"`` fall back to sequential trials.
        beta_kl: weight of KL / N_k in the ELBO (1 = the ELBO itself).
        prior_mu: mu0, the mean of the Gaussian prior N(mu0, sigma0²) of every weight and bias
            of the BNN, in the ELBO's KL(q || p) (``posterior="bnn"`` only; default 0, with
            ``prior_sigma`` the N(0, 1) of reference notes Part 16 #8).
        prior_sigma: sigma0 > 0, the prior's standard deviation (``posterior="bnn"`` only;
            default 1).
        rho_init: initial rho of every weight (-5: sigma 0.0067).
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
            ``benchmarks/bayes_time.py``.
        bnn_estimator: how the BNN's Linear layers sample, in training, in the search and in
            the MC predictive: ``"weights"`` (default, the seed's: one weight draw per forward
            pass) or ``"local"`` (the local reparameterization trick of Kingma, Salimans &
            Welling 2015: pre-activations drawn per example, lower-variance gradients;
            convolutions keep weight sampling; :class:`~fedlore.bayes.BayesLinear`). Only with
            ``posterior="bnn"``.
        meta_resample: ``"round"`` (default, seed 001: a new meta split d_n^k ⊂ D_n^k in every
            round k, drawn from (run seed, round, client)) or ``"fixed"`` (one d per client for
            the whole run and every seed, our earlier reading).
    """

    name: ClassVar[str] = "meta_bayfl"
    capabilities = replace(
        FedFull.capabilities,
        sum_aggregable=False,
        transport_16bit=False,
        individual_uploads=(
            "its server can combine each client's Gaussian posterior (mu_i, rho_i) nonlinearly "
            "(posterior_aggregation sigma, moment or precision), and the run reports each client's "
            "searched learning rate (lr_chosen) on its own; only the default mean rule is a "
            "weighted sum"
        ),
    )
    per_client_metrics: ClassVar[tuple[str, ...]] = ("lr_chosen", "lr_picks")
    posterior: Literal["bnn", "mcdropout", "none"] = "bnn"
    lr_search: Literal["per_epoch", "per_round", "none"] = "per_epoch"
    candidate_lrs: tuple[float, ...] = (1e-2, 1e-3, 1e-4)
    temp_steps: int = 5
    meta_fraction: float = 0.2
    meta_split: MetaSplit = "subset"
    meta_score: MetaScore = "nll"
    local_optimizer: Literal["adamw", "sgd"] = "adamw"
    beta_kl: float = 1.0
    prior_mu: float = 0.0
    prior_sigma: float = 1.0
    rho_init: float = -5.0
    dropout: float = 0.5
    conv_dropout: float = 0.0
    posterior_aggregation: Aggregation = "mean"
    trials: Literal["batched", "sequential"] = "sequential"
    bnn_estimator: Literal["weights", "local"] = "weights"
    meta_resample: Literal["round", "fixed"] = "round"

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "posterior": self.posterior in ("bnn", "mcdropout", "none"),
            "lr_search": self.lr_search in ("per_epoch", "per_round", "none"),
            "candidate_lrs": bool(self.candidate_lrs)
            and all(isinstance(x, int | float) and x > 0 for x in self.candidate_lrs),
            "temp_steps": self.temp_steps >= 1,
            "meta_fraction": 0.0 < self.meta_fraction < 1.0,
            "meta_split": self.meta_split in ("subset", "heldout"),
            "meta_score": self.meta_score in ("nll", "elbo"),
            "beta_kl": self.beta_kl >= 0,
            "prior_sigma": self.prior_sigma > 0 and math.isfinite(self.prior_sigma),
            "prior_mu": math.isfinite(self.prior_mu),
            "rho_init": math.isfinite(self.rho_init),
            "dropout": 0.0 <= self.dropout < 1.0,
            "conv_dropout": 0.0 <= self.conv_dropout < 1.0,
            "posterior_aggregation": self.posterior_aggregation
            in ("mean", "sigma", "moment", "precision"),
            "trials": self.trials in ("batched", "sequential"),
            "bnn_estimator": self.bnn_estimator in ESTIMATORS,
            "meta_resample": self.meta_resample in ("round", "fixed"),
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"{self.name}: invalid {field}={getattr(self, field)!r}")
        if self.bnn_estimator != "weights" and self.posterior != "bnn":
            raise ValueError(
                f"{self.name}: invalid bnn_estimator={self.bnn_estimator!r}: the estimator of a "
                f"BNN, but posterior={self.posterior!r}"
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
        (:meth:`~fedlore.algorithms.fedavg.DenseServer.combine_deltas`)."""
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
        # a held-out d needs 2 examples: a client with fewer trains at the fixed lr
        need = 2 if self.meta_split == "heldout" else 1
        search = self.lr_search != "none" and data.num_examples >= need
        fit, meta = (
            meta_split(data, self.meta_fraction, self.meta_split, self.meta_seed(rng))
            if search
            else (data.train, None)
        )
        n_fit = len(fit)
        terms = [elbo_kl_term(self.beta_kl, n_fit)] if is_bayesian(model) else []
        opt = self.make_optimizer(model)
        base = self.round_lrs(rnd, n_fit)
        schedule = self.lr_schedule(n_fit)
        first = max(rnd, 0) * len(base)  # the run's index of this round's first local step
        search_seed = int(torch.randint(0, 2**62, (1,), generator=rng))
        epoch = max(1, math.ceil(n_fit / min(self.train.batch_size, n_fit)))
        starts = {"per_epoch": range(0, len(base), epoch), "per_round": [0], "none": [0]}
        cuts = [*starts[self.lr_search], len(base)]
        chosen: list[float] = []
        losses: list[float] = []
        skipped = 0
        t0 = time.perf_counter()
        with seeded(rng), sampling(model, True):
            batches = dataclasses.replace(data, train=fit).batches(
                self.train.batch_size, len(base), rng, rnd
            )
            for i, (a, b) in enumerate(itertools.pairwise(cuts)):
                lr = self.train.lr
                if search and meta is not None:
                    # trial step s stands for local step a + s: the schedule's factor there
                    factors = [
                        schedule.at(first + a + s) / self.train.lr for s in range(self.temp_steps)
                    ]
                    lr, _ = self.select_lr(model, opt, fit, meta, terms, search_seed + i, factors)
                    chosen.append(lr)
                seg = [lr * x / self.train.lr for x in base[a:b]]
                stats = local_train(
                    model, batches, opt, seg, loss_terms=terms, grad_clip=self.train.grad_clip
                )
                skipped += stats.skipped_steps
                if math.isfinite(stats.mean_loss):
                    losses.extend([stats.mean_loss] * (stats.steps - stats.skipped_steps))
        train_s = time.perf_counter() - t0
        extra: dict[str, float | int | str] = {}
        if terms:
            with torch.no_grad():
                extra["kl"] = float(kl_divergence(model))
        if chosen:
            extra["lr_chosen"] = max(set(chosen), key=lambda x: (chosen.count(x), -chosen.index(x)))
            extra["lr_searches"] = len(chosen)
            extra["lr_picks"] = ",".join(f"{lr:g}" for lr in chosen)  # every search, in order
        metrics = reply_metrics(
            data.num_examples,  # n_k, the aggregation weight (d is part of the client's data)
            train_loss=sum(losses) / len(losses) if losses else float("nan"),
            skipped_steps=skipped,
            optimizer_state_bytes=optimizer_state_bytes(opt),
            train_s=train_s,
            **extra,
            **local_eval_metrics(self, model, data, rnd),
        )
        return Reply(arrays=self.dense_update(model, start), metrics=metrics), keep

    def meta_seed(self, rng: torch.Generator) -> int | None:
        """The seed of this round's meta split d_n^k (``meta_resample="round"``: from the
        client's round generator, itself seeded by (run seed, round, client), without drawing
        from it), or None for the one fixed d per client (``"fixed"``)."""
        if self.meta_resample == "fixed":
            return None
        return derive_seed(rng.initial_seed(), meta_lr.META_SPLIT_SALT)

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
