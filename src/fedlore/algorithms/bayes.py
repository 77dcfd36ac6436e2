"""Meta-BayFL (seed 001, Algorithm 1) and its comparators: BayFL, the MC-dropout variants and
Meta-FL. One class, three switches:

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
round starts from the global posterior with a fresh optimizer, for ``local_steps`` steps like
every other method; an "epoch" is ``ceil(N_k / batch_size)`` of them. Server: FedAvg of the
variational parameters weighted by n_k (seed Eq. 22 uses equal weights: ``weighting: uniform``,
as every seed-table config sets).

The learning-rate search follows the seed's text (Algorithm 1, Eqs. 19-20 and the text after
Eq. 22): the meta split ``d_n^k ⊂ D_n^k`` is 20 % of the training data, used only to rank the
candidates; the client trains on all of D (``meta_split="subset"``; ``"heldout"`` removes d from
training, our earlier reading). A candidate's score is Eq. (19),
``f_{n,k}(w^i) = 1/|d| Σ_{(x,y) ∈ d} L(y, f_{w^i}(x))``: the mean negative log predictive
probability on d, the predictive being the MC average of the posterior's probabilities over
``mc_samples`` draws (``eval.mc_samples``; one deterministic pass for deterministic models), no
KL term (``meta_score="nll"``). ``meta_score="elbo"`` ranks by the per-example negative ELBO on
d with one weight sample instead (NLL + beta_kl·KL/N_k); with a BNN its KL/N_k term (hundreds of
nats per example on a CNN) dwarfs the NLL, so the largest rate, which shrinks the KL fastest,
wins almost every search.

Communication: the BNN sends (mu, rho), twice the deterministic parameter count (seed §V-D).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedlore.algorithms.base import local_eval_metrics, reply_metrics
from fedlore.algorithms.fedavg import FedFull, optimizer_state_bytes
from fedlore.bayes.layers import (
    ESTIMATORS,
    GaussianPrior,
    add_mc_dropout,
    bayesianize,
    gaussian_kl,
    inverse_softplus,
    is_bayesian,
    kl_divergence,
    log_softplus,
    sampling,
    seeded,
)
from fedlore.data.client_data import ClientData, TensorSplit, minibatches
from fedlore.registry import register_algorithm
from fedlore.train.local import (
    LossTerm,
    is_regression,
    local_train,
    predictive_draws,
    predictive_log_probs,
    regression_nll,
    task_loss,
)
from fedlore.types import Broadcast, Reply, State

Aggregation = Literal["mean", "sigma", "moment", "precision"]

META_SPLIT_SALT = 0x6D657461
"""Seeds a client's fixed meta-split permutation (with its id), the same every round."""


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


MetaSplit = Literal["subset", "heldout"]
MetaScore = Literal["nll", "elbo"]


def meta_split(
    data: ClientData, fraction: float, mode: MetaSplit = "subset"
) -> tuple[TensorSplit, TensorSplit]:
    """The client's (training data, meta split d): ``d`` holds ``round(fraction · n)`` of its n
    training examples (at least 1), drawn by a permutation fixed per client, so d is the same
    every round (seed, text after Eq. 22: "20 % of the training data", ``d_n^k ⊂ D_n^k``).

    ``mode="subset"`` (the seed): the client trains on all of D, d is a subset of it, used only
    to rank learning rates. ``mode="heldout"``: d is removed from training (at least 1 example
    left to fit).

    Raises:
        ValueError: when the client has no training example, or fewer than 2 with
            ``mode="heldout"``.
    """
    n = data.num_examples
    need = 2 if mode == "heldout" else 1
    if n < need:
        raise ValueError(
            f"client {data.client_id} has {n} training example(s); the learning-rate search "
            + (
                "with a held-out meta split needs at least 2 (one to fit, one for d)"
                if mode == "heldout"
                else "needs at least 1"
            )
        )
    n_meta = max(1, round(fraction * n))
    if mode == "heldout":
        n_meta = min(n_meta, n - 1)
    g = torch.Generator().manual_seed(META_SPLIT_SALT * 1_000_003 + data.client_id)
    perm = torch.randperm(n, generator=g)
    d = data.train.subset(perm[:n_meta])
    if mode == "heldout":
        return data.train.subset(perm[n_meta:]), d
    return data.train, d


def pick_lowest(candidates: tuple[float, ...], scores: list[float]) -> float:
    """The candidate with the lowest score (seed Eq. 20); non-finite scores never win, ties go to
    the earlier candidate, and when no score is finite the smallest candidate (the most
    cautious step) is returned.

    Raises:
        ValueError: on length mismatch or no candidates.
    """
    if not candidates or len(candidates) != len(scores):
        raise ValueError(f"{len(candidates)} candidates but {len(scores)} scores")
    finite = [(s, i) for i, s in enumerate(scores) if math.isfinite(s)]
    if not finite:
        return min(candidates)
    return candidates[min(finite)[1]]


def combine_gaussians(
    mus: list[torch.Tensor], rhos: list[torch.Tensor], weights: list[float], rule: Aggregation
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine clients' posteriors ``N(mu_i, softplus(rho_i)²)`` element-wise (reference notes
    Part 0.6, weights a_i normalized here):

    * ``mean`` (A): average mu and rho (what FedAvg of the raw parameters does);
    * ``sigma`` (B): average mu and sigma, ``rho = softplus⁻¹(Σ a_i sigma_i)``;
    * ``moment`` (C): moment-match the mixture ``Σ a_i q_i``:
      ``sigma² = Σ a_i (sigma_i² + mu_i²) - mu²``;
    * ``precision`` (D): conflation, ``tau = Σ a_i / sigma_i²``,
      ``mu = Σ a_i mu_i / sigma_i² / tau``, ``sigma = tau^-1/2``.

    Computed in float64 (sigma through log-softplus, so a client's sigma is exact down to
    rho = -708; below that it counts as the smallest positive float64).

    Returns:
        (mu, rho), each of the inputs' shape and dtype.

    Raises:
        ValueError: for an unknown ``rule``.
    """
    w = torch.tensor(weights, dtype=torch.float64, device=mus[0].device)
    w = w / w.sum()
    shape = (-1,) + (1,) * mus[0].dim()
    a = w.view(shape)
    mu = torch.stack([m.double() for m in mus])
    rho = torch.stack([r.double() for r in rhos])
    tiny = torch.finfo(torch.float64).tiny
    sigma = log_softplus(rho).exp().clamp_min(tiny)  # exact down to rho = -708
    if rule == "mean":
        out_mu, out_rho = (a * mu).sum(0), (a * rho).sum(0)
    elif rule == "sigma":
        out_mu = (a * mu).sum(0)
        out_rho = inverse_softplus((a * sigma).sum(0).clamp_min(tiny))
    elif rule == "moment":
        out_mu = (a * mu).sum(0)
        spread = (a * (mu - out_mu) ** 2).sum(0)  # Σ a (σ² + μ²) - μ̄², without cancellation
        out_rho = inverse_softplus(((a * sigma**2).sum(0) + spread).sqrt().clamp_min(tiny))
    elif rule == "precision":
        prec = a / sigma**2
        tau = prec.sum(0)
        out_mu = (prec * mu).sum(0) / tau
        out_rho = inverse_softplus(tau.rsqrt().clamp_min(tiny))
    else:
        raise ValueError(f"unknown posterior aggregation {rule!r}")
    return out_mu.to(mus[0].dtype), out_rho.to(rhos[0].dtype)


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
        beta_kl: weight of KL / N_k in the ELBO (1 = the ELBO itself).
        prior_mu, prior_sigma: the Gaussian prior N(mu0, sigma0²) (default N(0, 1)).
        rho_init: initial rho of every weight (-5: sigma 0.0067).
        dropout: MC-dropout rate before every Linear (``posterior="mcdropout"``).
        conv_dropout: MC-dropout rate before every Conv2d but the first (0: none).
        posterior_aggregation: ``"mean"`` (A), ``"sigma"`` (B), ``"moment"`` (C) or
            ``"precision"`` (D) of :func:`combine_gaussians`; deterministic tensors always
            average.
        trials: ``"sequential"`` (default) trains the J temporary copies one after another;
            ``"batched"`` runs them as one vectorized computation (:func:`batched_trials`,
            ``torch.func.vmap`` over the candidates; models with BatchNorm or a gradient clip
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
    """

    name: ClassVar[str] = "meta_bayfl"
    individual_uploads: ClassVar[str] = (
        "its server can combine each client's Gaussian posterior (mu_i, rho_i) nonlinearly "
        "(posterior_aggregation sigma, moment or precision), and the run reports each client's "
        "searched learning rate (lr_chosen) on its own; only the default mean rule is a "
        "weighted sum"
    )
    per_client_metrics: ClassVar[tuple[str, ...]] = ("lr_chosen",)
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
        ``*_mu`` / ``*_rho`` pair is combined by :func:`combine_gaussians` on the clients'
        absolute parameters ``W^t + Δ_i`` and returned as a step from ``W^t``. The deltas'
        combination follows ``robust.aggregate`` (:meth:`DenseServer.combine_deltas`)."""
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
            meta_split(data, self.meta_fraction, self.meta_split) if search else (data.train, None)
        )
        n_fit = len(fit)
        terms = [elbo_kl_term(self.beta_kl, n_fit)] if is_bayesian(model) else []
        opt = self.make_optimizer(model)
        base = self.round_lrs(rnd)
        search_seed = int(torch.randint(0, 2**62, (1,), generator=rng))
        epoch = max(1, math.ceil(n_fit / min(self.batch_size, n_fit)))
        starts = {"per_epoch": range(0, len(base), epoch), "per_round": [0], "none": [0]}
        cuts = [*starts[self.lr_search], len(base)]
        chosen: list[float] = []
        losses: list[float] = []
        skipped = 0
        t0 = time.perf_counter()
        with seeded(rng), sampling(model, True):
            batches = dataclasses.replace(data, train=fit).batches(
                self.batch_size, len(base), rng, rnd
            )
            for i, (a, b) in enumerate(itertools.pairwise(cuts)):
                lr = self.lr
                if search and meta is not None:
                    lr, _ = self.select_lr(model, opt, fit, meta, terms, search_seed + i)
                    chosen.append(lr)
                seg = [lr * x / self.lr for x in base[a:b]]
                stats = local_train(
                    model, batches, opt, seg, loss_terms=terms, grad_clip=self.grad_clip
                )
                skipped += stats.skipped_steps
                if math.isfinite(stats.mean_loss):
                    losses.extend([stats.mean_loss] * (stats.steps - stats.skipped_steps))
        train_s = time.perf_counter() - t0
        extra: dict[str, float | int] = {}
        if terms:
            with torch.no_grad():
                extra["kl"] = float(kl_divergence(model))
        if chosen:
            extra["lr_chosen"] = max(set(chosen), key=lambda x: (chosen.count(x), -chosen.index(x)))
            extra["lr_searches"] = len(chosen)
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

    def select_lr(
        self,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        fit: TensorSplit,
        meta: TensorSplit,
        terms: list[LossTerm],
        seed: int,
    ) -> tuple[float, list[float]]:
        """Seed Algorithm 1 lines 10-15: for each candidate eta_j, copy the current local model
        and optimizer state, take ``temp_steps`` steps with eta_j on minibatches of ``fit``, and
        score the copy on ``meta`` by :meth:`candidate_score` (seed Eq. 19). Every candidate
        sees the same minibatches and the same weight samples (common random numbers), in
        training and in scoring; the copies are discarded (reference notes Part 16 #4).

        A copy is scored in the channels-last layout (:func:`scoring_layout`): the same
        numbers up to float rounding (so the same choice but for near-ties), and a CNN's
        ``S · |d|`` forward passes, most of a search's time, run about twice as fast on CPU.

        Returns:
            (the lowest-scoring candidate by :func:`pick_lowest`, the J scores).
        """
        if self.trials == "batched" and batchable(model, opt, self.grad_clip):
            scores = batched_trials(self, model, opt, fit, meta, seed)
            return pick_lowest(self.candidate_lrs, scores), scores
        opt_state = opt.state_dict()
        scores = []
        for lr in self.candidate_lrs:
            trial = copy.deepcopy(model)
            trial_opt = self.make_optimizer(trial)
            trial_opt.load_state_dict(copy.deepcopy(opt_state))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                g = torch.Generator().manual_seed(seed)
                local_train(
                    trial,
                    minibatches(fit, self.batch_size, self.temp_steps, g),
                    trial_opt,
                    [lr] * self.temp_steps,
                    loss_terms=terms,
                    grad_clip=self.grad_clip,
                )
                scores.append(self.candidate_score(scoring_layout(trial), meta, terms))
        return pick_lowest(self.candidate_lrs, scores), scores

    def candidate_score(self, model: nn.Module, meta: TensorSplit, terms: list[LossTerm]) -> float:
        """The score of a temporary copy on d (lower is better): ``meta_score="nll"``, seed
        Eq. (19) with the MC predictive (:func:`meta_nll`, S = ``mc_samples``);
        ``meta_score="elbo"``, the per-example negative ELBO (:func:`meta_loss`)."""
        if self.meta_score == "elbo":
            return meta_loss(model, meta, terms)
        return meta_nll(model, meta, self.mc_samples)


def scoring_layout(model: nn.Module) -> nn.Module:
    """``model`` with its 4-D (convolution) tensors in the channels-last memory format, in
    place (a model without any is returned as it is). The values are unchanged, and so are the
    weight samples (:class:`~fedlore.bayes.BayesConv2d` draws in its means' layout); the
    convolution and pooling kernels differ, so outputs agree to float rounding. On CPU (oneDNN)
    the forward pass of the seed's small CNN takes about 0.45x the time (issue 19,
    ``benchmarks/bayes_time.py``).

    Returns:
        ``model`` itself.
    """
    if any(p.dim() == 4 for p in model.parameters()):
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model


def meta_nll(model: nn.Module, meta: TensorSplit, mc_samples: int, batch_size: int = 512) -> float:
    """Seed Eq. (19): ``1/|d| Σ_{(x,y) ∈ d} -log p̄(y | x)``, the mean NLL over d of the model's
    predictive ``p̄ = (1/S) Σ_s softmax(f(x; w_s))`` with S = ``mc_samples`` draws from the fixed
    evaluation seed (the same draws for every candidate), one pass with sampling off for a
    deterministic model or S = 0 (:func:`~fedlore.train.local.predictive_log_probs`; BatchNorm in
    eval mode). No KL term. Regression (real targets): the predictive is the mixture
    ``(1/S) Σ_s N(f(x; w_s), I)`` (:func:`~fedlore.train.local.regression_nll`).

    Computed without gradients (a ``no_grad`` block, not the decorator: mutation testing,
    ``make mutation``, skips decorated functions; so does :func:`meta_loss`).

    Returns:
        A float (nats per example); NaN when the predictions are not finite (a diverged trial).
    """
    with torch.no_grad():
        if is_regression(meta.y):  # the predictive mixture of N(f_s(x), I), as the likelihood
            draws = predictive_draws(model, meta.x, batch_size, mc_samples)
            if not bool(torch.isfinite(draws).all()):
                return float("nan")
            return float(regression_nll(draws, meta.y).mean())
        log_probs = predictive_log_probs(model, meta.x, batch_size, mc_samples)
        if not bool(torch.isfinite(log_probs).all()):
            return float("nan")
        return float(F.nll_loss(log_probs, meta.y))


def meta_loss(
    model: nn.Module, meta: TensorSplit, terms: list[LossTerm], batch_size: int = 512
) -> float:
    """The ``meta_score="elbo"`` score of a temporary copy on the meta split d: the mean loss
    over d (one stochastic pass with the layers' current sampling flags; BatchNorm in eval mode)
    plus the ELBO's KL terms, i.e. the per-example negative ELBO (reference notes Part 16 #5, our
    earlier reading; ``terms`` is empty for deterministic models, leaving seed Eq. 19 with one
    pass).

    Returns:
        A float (nats per example); NaN/inf when the trial diverged.
    """
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(meta), batch_size):
            x, y = meta.x[i : i + batch_size], meta.y[i : i + batch_size]
            total += float(task_loss(model(x), y)) * len(y)
        out = total / len(meta)
        for term in terms:
            out += float(term(model))
    return out


def batchable(model: nn.Module, opt: torch.optim.Optimizer, grad_clip: float | None) -> bool:
    """Whether :func:`batched_trials` applies: no buffers (BatchNorm's running statistics
    cannot be updated under ``vmap``), no gradient clip, and an AdamW or plain SGD optimizer."""
    if grad_clip is not None or any(True for _ in model.buffers()):
        return False
    if isinstance(opt, torch.optim.AdamW):
        return True
    return isinstance(opt, torch.optim.SGD) and all(
        g.get("momentum", 0) == 0 for g in opt.param_groups
    )


def batched_trials(
    algo: MetaBayFL,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    fit: TensorSplit,
    meta: TensorSplit,
    seed: int,
) -> list[float]:
    """The J candidate trials of :meth:`MetaBayFL.select_lr` as one computation: the trained
    parameters are stacked J times and every step is ``vmap`` over the candidates of
    ``grad(loss)`` (``randomness="same"``: every candidate sees the same weight sample, as in the
    sequential trials), followed by a vectorized AdamW (or SGD) update with each candidate's
    learning rate, continuing the local optimizer's moments. A candidate whose loss or gradient
    turns non-finite stops updating (like a skipped step). The KL is computed from the stacked
    (mu, rho) with the prior of :class:`MetaBayFL`.

    Returns:
        The J meta-split scores (:meth:`MetaBayFL.candidate_score`: seed Eq. 19's predictive
        NLL, or the per-example negative ELBO), NaN for a diverged trial.
    """
    from torch.func import functional_call, grad_and_value, vmap

    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    j = len(algo.candidate_lrs)
    params = {k: p.detach().unsqueeze(0).repeat(j, *([1] * p.dim())) for k, p in named}
    adam = isinstance(opt, torch.optim.AdamW)
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    v2 = {k: torch.zeros_like(v) for k, v in params.items()}
    step0 = 0
    for k, p in named:  # continue the local optimizer's state
        st = opt.state.get(p, {})
        if "exp_avg" in st:
            m[k] += st["exp_avg"]
            v2[k] += st["exp_avg_sq"]
            step0 = int(st["step"])
    prior = GaussianPrior(algo.prior_mu, algo.prior_sigma)
    bayes = is_bayesian(model)
    n_fit = len(fit)

    def kl(p: dict[str, torch.Tensor]) -> torch.Tensor:
        """KL of every Bayesian layer, frozen (mu, rho) included, as kl_divergence(model)."""
        total = torch.zeros(())
        for key in p:
            if key.endswith("_rho"):
                mu = p[key[: -len("_rho")] + "_mu"]
                total = total + gaussian_kl(mu, log_softplus(p[key]), prior.mu, prior.sigma)
        return total

    def objective(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        full = {**p, **frozen}
        loss = task_loss(functional_call(model, full, (x,)), y)
        return loss + algo.beta_kl * kl(full) / n_fit if bayes else loss

    def data_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return task_loss(functional_call(model, {**p, **frozen}, (x,)), y)

    step_fn = vmap(grad_and_value(objective), in_dims=(0, None, None), randomness="same")
    loss_fn = vmap(data_loss, in_dims=(0, None, None), randomness="same")
    kl_fn = vmap(lambda p: kl({**p, **frozen}), in_dims=(0,))
    device = named[0][1].device if named else torch.device("cpu")
    lrs = torch.tensor(algo.candidate_lrs, dtype=torch.float32, device=device)
    alive = torch.ones(j, dtype=torch.bool, device=device)
    b1, b2 = algo.betas
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        t = step0
        for x, y in minibatches(fit, algo.batch_size, algo.temp_steps, g):
            grads, losses = step_fn(params, x, y)
            finite = torch.isfinite(losses)
            for gk in grads.values():
                finite &= torch.isfinite(gk.flatten(1)).all(1)
            alive &= finite
            t += 1
            for k in params:
                shape = (j,) + (1,) * (params[k].dim() - 1)
                lr = (lrs * alive).view(shape)
                gk = torch.where(alive.view(shape), grads[k], torch.zeros_like(grads[k]))
                if not adam:  # torch SGD: weight decay is added to the gradient (coupled)
                    params[k] = params[k] - lr * (gk + algo.weight_decay * params[k])
                    continue
                params[k] = params[k] * (1 - lr * algo.weight_decay)
                m[k] = torch.where(alive.view(shape), b1 * m[k] + (1 - b1) * gk, m[k])
                v2[k] = torch.where(alive.view(shape), b2 * v2[k] + (1 - b2) * gk * gk, v2[k])
                denom = (v2[k] / (1 - b2**t)).sqrt() + algo.eps
                params[k] = params[k] - lr / (1 - b1**t) * m[k] / denom
        model.eval()
        if algo.meta_score == "elbo":  # as meta_loss: a weight draw per chunk of 512, then KL
            n_meta = len(meta)
            chunks = [
                loss_fn(params, meta.x[i : i + 512], meta.y[i : i + 512]) * len(meta.y[i : i + 512])
                for i in range(0, n_meta, 512)
            ]
            scores = torch.stack(chunks).sum(0) / n_meta
            if bayes:
                scores = scores + algo.beta_kl * kl_fn(params) / n_fit
    if algo.meta_score == "nll":
        scores = batched_meta_nll(model, params, frozen, meta, algo.mc_samples)
    return [
        float(sc) if ok and math.isfinite(float(sc)) else float("nan")
        for sc, ok in zip(scores, alive, strict=True)
    ]


def batched_meta_nll(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    frozen: dict[str, torch.Tensor],
    meta: TensorSplit,
    mc_samples: int,
    batch_size: int = 512,
) -> torch.Tensor:
    """:func:`meta_nll` of J stacked candidates (``params`` with a leading dimension J) in one
    ``vmap``: the same draws from the evaluation seed in the same order (a weight sample per
    forward pass of ``batch_size`` examples), shared by all candidates (``randomness="same"``),
    so each score equals the sequential one up to float rounding.

    Returns:
        ``[J]`` mean NLL of each candidate's predictive on d (NaN where not finite).
    """
    from torch.func import functional_call, vmap

    from fedlore.bayes.layers import is_stochastic
    from fedlore.train.local import EVAL_SAMPLING_SEED

    def forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, {**p, **frozen}, (x,))

    fwd = vmap(forward, in_dims=(0, None), randomness="same")
    n = len(meta)
    regression = is_regression(meta.y)

    def one_pass() -> torch.Tensor:  # [J, n, K] log-probabilities (regression: outputs) of a draw
        chunks = [fwd(params, meta.x[i : i + batch_size]).float() for i in range(0, n, batch_size)]
        out = torch.cat(chunks, dim=1)
        return out.reshape(out.shape[0], n, -1) if regression else F.log_softmax(out, -1)

    if regression:  # [S, J, n, d] draws -> the mixture NLL of each candidate
        model.eval()
        with torch.no_grad():
            stochastic = mc_samples >= 1 and is_stochastic(model)
            with sampling(model, stochastic), torch.random.fork_rng(devices=[]):
                torch.manual_seed(EVAL_SAMPLING_SEED)
                draws = torch.stack([one_pass() for _ in range(mc_samples if stochastic else 1)])
            return torch.stack(
                [regression_nll(draws[:, j], meta.y).mean() for j in range(draws.shape[1])]
            )

    model.eval()
    with torch.no_grad():
        if mc_samples < 1 or not is_stochastic(model):
            with sampling(model, False):
                log_probs = one_pass()
        else:
            with sampling(model, True), torch.random.fork_rng(devices=[]):
                torch.manual_seed(EVAL_SAMPLING_SEED)
                draws = torch.stack([one_pass() for _ in range(mc_samples)])
            log_probs = torch.logsumexp(draws, 0) - math.log(mc_samples)
        picked = log_probs.gather(-1, meta.y.view(1, -1, 1).expand(log_probs.shape[0], -1, 1))
        return -picked.squeeze(-1).mean(-1)


@register_algorithm("bayfl")
@dataclass(frozen=True)
class BayFL(MetaBayFL):
    """BayFL: the BNN trained on the ELBO with a fixed learning rate, FedAvg of (mu, rho)
    (reference notes Part 2)."""

    name: ClassVar[str] = "bayfl"
    individual_uploads: ClassVar[str] = (
        "its server can combine each client's Gaussian posterior (mu_i, rho_i) nonlinearly "
        "(posterior_aggregation sigma: softplus scales, moment: mixture moments, precision: 1 / "
        "sigma_i² weights); its default mean rule, FedAvg of (mu, rho), is not yet offered "
        "under secure aggregation and DP"
    )
    lr_search: Literal["per_epoch", "per_round", "none"] = "none"


@register_algorithm("meta_bayfl_mcd")
@dataclass(frozen=True)
class MetaBayFLMCDropout(MetaBayFL):
    """Meta-BayFL with MC dropout in place of the BNN (seed Table IV; reference notes Part 6)."""

    name: ClassVar[str] = "meta_bayfl_mcd"
    individual_uploads: ClassVar[str] = (
        "its clients each search a learning rate on their own meta split and the run reports "
        "every client's choice (lr_chosen) on its own; the server's FedAvg of the MC-dropout "
        "model's deltas is not yet offered under secure aggregation and DP"
    )
    posterior: Literal["bnn", "mcdropout", "none"] = "mcdropout"


@register_algorithm("fedavg_mcd")
@dataclass(frozen=True)
class FedAvgMCDropout(MetaBayFL):
    """FedAvg + MC dropout with a fixed learning rate (separates dropout from the search)."""

    name: ClassVar[str] = "fedavg_mcd"
    individual_uploads: ClassVar[str] = (
        "its server only adds the weighted mean of the MC-dropout model's deltas, as FedAvg "
        "does (linear in the uploads), but this comparator of Meta-BayFL is not yet offered "
        "under secure aggregation and DP (no test covers it there)"
    )
    posterior: Literal["bnn", "mcdropout", "none"] = "mcdropout"
    lr_search: Literal["per_epoch", "per_round", "none"] = "none"


@register_algorithm("meta_fl")
@dataclass(frozen=True)
class MetaFL(MetaBayFL):
    """Meta-FL (Rahman et al., IEEE TVT 2024; reference notes Part 3): the deterministic model
    with the same per-client learning-rate search, cross-entropy loss."""

    name: ClassVar[str] = "meta_fl"
    individual_uploads: ClassVar[str] = (
        "its clients each search a learning rate on their own meta split and the run reports "
        "every client's choice (lr_chosen) on its own; the server's FedAvg of the deterministic "
        "model's deltas is not yet offered under secure aggregation and DP"
    )
    posterior: Literal["bnn", "mcdropout", "none"] = "none"
