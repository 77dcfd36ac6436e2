"""What Meta-BayFL (:mod:`fedlore.algorithms.bayes`) and Bayesian FedLore
(:mod:`fedlore.algorithms.fedlore_bayes`) share: the ELBO's KL term (:func:`elbo_kl_term`), the
hyperparameters of the mean-field BNN and of the per-client learning-rate search
(:class:`BayesSearch`), and one round of local training with a search before every local epoch
(:func:`train_with_search`, seed 001 the Meta-BayFL paper, arXiv 2603.18083 Algorithm 1
lines 7-17). The search itself (the meta split d, the trials, their scores) is
:mod:`fedlore.algorithms.meta_lr`.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import nn

from fedlore.algorithms import meta_lr
from fedlore.algorithms.base import Hyper
from fedlore.algorithms.meta_lr import MetaScore, MetaSplit
from fedlore.bayes import ESTIMATORS, kl_divergence
from fedlore.data.client_data import TensorSplit
from fedlore.seeding import derive_seed
from fedlore.settings import steps_for_epochs
from fedlore.train.local import GradHook, LossTerm, Schedule, TrainStats, local_train


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


SEARCH_SETTINGS = (
    "candidate_lrs",
    "temp_steps",
    "meta_fraction",
    "meta_split",
    "meta_score",
    "meta_resample",
    "trials",
)
"""The settings only the learning-rate search reads (``trials``: Meta-BayFL's), refused with
``lr_search="none"`` when not at their defaults: they would change nothing."""


@dataclass(frozen=True)
class BayesSearch(Hyper):
    """The BNN's and the learning-rate search's hyperparameters, shared by Meta-BayFL and
    Bayesian FedLore.

    Attributes:
        lr_search: ``"per_epoch"`` (seed 001 Algorithm 1 lines 7-17: a search before every
            local epoch), ``"per_round"`` (one search at the round's start) or ``"none"`` (the
            fixed ``lr``; the search's own settings, ``candidate_lrs``, ``temp_steps``,
            ``meta_fraction``, ``meta_split``, ``meta_score``, ``meta_resample`` and
            ``trials``, are then refused unless at their defaults: they would change nothing).
        candidate_lrs: eta_1..eta_J, distinct and > 0 (default {1e-2, 1e-3, 1e-4}, seed
            Table III and the authors' supplementary code, with Adam).
        temp_steps: T_temp, steps of each temporary copy (reference notes Part 1.7).
        meta_fraction: share of the training split that forms d (seed: 20 %).
        meta_split: ``"subset"`` (the seed: d ⊂ D, the client trains on all of D) or
            ``"heldout"`` (d is removed from training).
        meta_score: ``"nll"`` (the seed's Eq. 19: mean NLL of the MC predictive on d, S =
            ``mc_samples``) or ``"elbo"`` (per-example negative ELBO on d, one weight sample).
        beta_kl: weight of KL / N_k in the ELBO (1 = the ELBO itself).
        prior_mu: mu0, the mean of the Gaussian prior N(mu0, sigma0²) of every weight and bias
            of the BNN, in the ELBO's KL(q || p) (default 0, with ``prior_sigma`` the N(0, 1) of
            reference notes Part 16 #8).
        prior_sigma: sigma0 > 0, the prior's standard deviation (default 1).
        rho_init: initial rho of every weight (-5: sigma 0.0067).
        bnn_estimator: how the BNN's Linear layers sample, in training, in the search and in
            the MC predictive: ``"weights"`` (default, the seed's: one weight draw per forward
            pass) or ``"local"`` (the local reparameterization trick of Kingma, Salimans &
            Welling 2015: pre-activations drawn per example, lower-variance gradients;
            convolutions keep weight sampling; :class:`~fedlore.bayes.BayesLinear`).
        meta_resample: ``"round"`` (default, seed 001: a new meta split d_n^k ⊂ D_n^k in every
            round k, drawn from (run seed, round, client)) or ``"fixed"`` (one d per client for
            the whole run and every seed, our earlier reading).
    """

    lr_search: Literal["per_epoch", "per_round", "none"] = "per_epoch"
    candidate_lrs: tuple[float, ...] = (1e-2, 1e-3, 1e-4)
    temp_steps: int = 5
    meta_fraction: float = 0.2
    meta_split: MetaSplit = "subset"
    meta_score: MetaScore = "nll"
    beta_kl: float = 1.0
    prior_mu: float = 0.0
    prior_sigma: float = 1.0
    rho_init: float = -5.0
    bnn_estimator: Literal["weights", "local"] = "weights"
    meta_resample: Literal["round", "fixed"] = "round"

    def __post_init__(self) -> None:
        super().__post_init__()
        lrs = self.candidate_lrs
        checks = {  # name: (valid, what a valid value is)
            "lr_search": (
                self.lr_search in ("per_epoch", "per_round", "none"),
                "one of per_epoch, per_round, none",
            ),
            "candidate_lrs": (
                bool(lrs) and all(isinstance(x, int | float) and x > 0 for x in lrs),
                "one or more learning rates, each > 0",
            ),
            "temp_steps": (self.temp_steps >= 1, "at least 1 trial step"),
            "meta_fraction": (
                0.0 < self.meta_fraction < 1.0,
                "the share of a client's training data in d, strictly between 0 and 1",
            ),
            "meta_split": (self.meta_split in ("subset", "heldout"), "subset or heldout"),
            "meta_score": (self.meta_score in ("nll", "elbo"), "nll or elbo"),
            "beta_kl": (self.beta_kl >= 0, ">= 0"),
            "prior_sigma": (
                self.prior_sigma > 0 and math.isfinite(self.prior_sigma),
                "finite and > 0",
            ),
            "prior_mu": (math.isfinite(self.prior_mu), "finite"),
            "rho_init": (math.isfinite(self.rho_init), "finite"),
            "bnn_estimator": (self.bnn_estimator in ESTIMATORS, " or ".join(ESTIMATORS)),
            "meta_resample": (self.meta_resample in ("round", "fixed"), "round or fixed"),
        }
        who = getattr(self, "name", type(self).__name__)
        for name, (ok, valid) in checks.items():
            if not ok:
                raise ValueError(f"{who}: invalid {name}={getattr(self, name)!r}: must be {valid}")
        repeated = sorted({x for x in lrs if lrs.count(x) > 1})
        if repeated:
            raise ValueError(
                f"{who}: invalid candidate_lrs={lrs!r}: {', '.join(f'{x:g}' for x in repeated)} "
                "listed more than once; a search tries each candidate once, list each rate once"
            )
        idle = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name in SEARCH_SETTINGS and getattr(self, f.name) != f.default
        ]
        if idle and self.lr_search == "none":
            raise ValueError(
                f"{who}: {', '.join(idle)} with lr_search='none': only the learning-rate search "
                "reads it and none runs (every client trains at the fixed lr on all of its "
                "data), so it would change nothing; set lr_search=per_epoch or per_round, or "
                "leave it out"
            )

    def searches(self, num_examples: int) -> bool:
        """Whether a client with ``num_examples`` training examples searches (a held-out d needs
        2 examples: a client with fewer trains at the fixed lr)."""
        need = 2 if self.meta_split == "heldout" else 1
        return self.lr_search != "none" and num_examples >= need

    def fit_size(self, num_examples: int) -> int:
        """The examples a client of ``num_examples`` trains on: all of them, or without d
        (``meta_split="heldout"``, a client that searches)."""
        if self.meta_split == "heldout" and self.searches(num_examples):
            return num_examples - meta_lr.meta_size(num_examples, self.meta_fraction, "heldout")
        return num_examples

    def round_steps(self, num_examples: int) -> int:
        """K on the examples the client trains on (:meth:`fit_size`)."""
        return self.local_steps(self.fit_size(num_examples))

    def round_work(self, num_examples: int, steps: int) -> int:
        """``steps`` and the trial steps of the round's searches: J candidates x ``temp_steps``
        per search, one search before each local epoch (``ceil(steps / epoch)``, an epoch of
        ``ceil(|fit| / B)`` steps, as :func:`train_with_search` cuts them) or one per round.
        Batched trials run the J copies as one model, but the same J x ``temp_steps`` steps of
        work; scoring d is a forward pass, not counted (:meth:`Hyper.round_work`)."""
        if not self.searches(num_examples):
            return steps
        if self.lr_search == "per_round":
            searches = 1
        else:
            epoch = steps_for_epochs(1, self.fit_size(num_examples), self.train.batch_size)
            searches = math.ceil(steps / epoch)
        return steps + searches * len(self.candidate_lrs) * self.temp_steps

    def meta_seed(self, rng: torch.Generator) -> int | None:
        """The seed of this round's meta split d_n^k (``meta_resample="round"``: from the
        client's round generator, itself seeded by (run seed, round, client), without drawing
        from it), or None for the one fixed d per client (``"fixed"``)."""
        if self.meta_resample == "fixed":
            return None
        return derive_seed(rng.initial_seed(), meta_lr.META_SPLIT_SALT)

    def trial_copy(
        self, model: nn.Module, opt: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A temporary copy of the local model and its optimizer (one deep copy of both, so the
        copy's optimizer steps the copy's parameters, its state included), for one trial of the
        search."""
        return copy.deepcopy((model, opt))


@dataclass
class SearchedRound:
    """What :func:`train_with_search` did.

    Attributes:
        stats: the round's mean loss over its finite steps, steps and skipped steps.
        chosen: the rate each search chose, in order (empty without a search).
    """

    stats: TrainStats
    chosen: list[float] = field(default_factory=list)

    def metrics(self) -> dict[str, float | int | str]:
        """The reply metrics of the searches: ``lr_chosen`` (the most frequent choice, the
        earliest on a tie), ``lr_searches`` and ``lr_picks`` (every choice, comma-separated);
        none without a search."""
        chosen = self.chosen
        if not chosen:
            return {}
        return {
            "lr_chosen": max(set(chosen), key=lambda x: (chosen.count(x), -chosen.index(x))),
            "lr_searches": len(chosen),
            "lr_picks": ",".join(f"{lr:g}" for lr in chosen),
        }


class SearchingHyper(meta_lr.SearchHyper, Protocol):
    """What :func:`train_with_search` reads of a method: the search's hyperparameters and
    :meth:`BayesSearch.select_lr`-style selection (MetaBayFL and FedLoreBayes)."""

    @property
    def lr_search(self) -> Literal["per_epoch", "per_round", "none"]: ...
    def select_lr(
        self,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        fit: TensorSplit,
        meta: TensorSplit,
        terms: list[LossTerm],
        seed: int,
        factors: list[float] | None = None,
    ) -> tuple[float, list[float]]: ...
    def lr_schedule(self, num_examples: int | None = None) -> Schedule: ...


def train_with_search(
    hyper: SearchingHyper,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    base: Sequence[float],
    fit: TensorSplit,
    meta: TensorSplit | None,
    terms: list[LossTerm],
    search_seed: int,
    rnd: int,
    on_grad: Sequence[GradHook] = (),
) -> SearchedRound:
    """One round's ``len(base)`` local steps of ``opt`` on ``batches`` with a learning-rate
    search before every local epoch (``lr_search="per_epoch"``, seed 001 Algorithm 1 line 7:
    an epoch is ``ceil(|fit| / B)`` steps), once at the start (``"per_round"``), or never
    (``"none"``, or ``meta`` None).

    ``base`` holds the round's rates at ``train.lr`` (the schedule's); a stretch chosen ``eta``
    trains at ``eta · base[k] / train.lr``. Each trial step runs at its candidate times the
    schedule's factor at the local step it stands for (``first + a + s``, ``first`` the run's
    index of this round's first step, at most the run's last step), so candidates are compared
    at the rates training uses.
    Search i uses the seed ``search_seed + i``. ``on_grad`` hooks run in the real steps only
    (never in a trial).
    """
    lr0 = hyper.train.lr
    n_fit = len(fit)
    schedule = hyper.lr_schedule(n_fit)
    # the run's index of this round's first local step: K steps per round (a straggler's
    # ``base`` may be cut short, clients.partial_work), and the run's last step bounds every
    # index a trial stands for (a trial past the run's end would otherwise run at the rate
    # after the schedule, 0 under cosine with min_lr_ratio 0)
    first = max(rnd, 0) * hyper.train.steps(n_fit)
    last = schedule.total_steps - 1
    epoch = steps_for_epochs(1, n_fit, hyper.train.batch_size)
    starts = {"per_epoch": range(0, len(base), epoch), "per_round": [0], "none": [0]}
    cuts = [*starts[hyper.lr_search], len(base)]
    chosen: list[float] = []
    losses: list[float] = []
    skipped = 0
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        lr = lr0
        if meta is not None:
            # trial step s stands for local step a + s: the schedule's factor there
            steps = [min(first + a + s, last) for s in range(hyper.temp_steps)]
            factors = [schedule.at(k) / lr0 for k in steps]
            lr, _ = hyper.select_lr(model, opt, fit, meta, terms, search_seed + i, factors)
            chosen.append(lr)
        seg = [lr * x / lr0 for x in base[a:b]]
        stats = local_train(
            model,
            batches,
            opt,
            seg,
            loss_terms=terms,
            on_grad=on_grad,
            grad_clip=hyper.train.grad_clip,
        )
        skipped += stats.skipped_steps
        if math.isfinite(stats.mean_loss):
            losses.extend([stats.mean_loss] * (stats.steps - stats.skipped_steps))
    mean = sum(losses) / len(losses) if losses else float("nan")
    return SearchedRound(TrainStats(mean, len(base), skipped), chosen)
