"""Meta-BayFL's learning-rate search (seed 001, the Meta-BayFL paper, arXiv 2603.18083,
Algorithm 1 lines 7-17, Eqs. 19-20): before a stretch of local training each candidate rate
``eta_j`` trains a temporary copy of the local model for ``temp_steps`` steps, the copy is scored
on the client's meta split ``d_n^k`` (:func:`meta_split`, the text after Eq. 22), and the lowest
score wins (:func:`pick_lowest`, Eq. 20).

The meta split ``d_n^k ⊂ D_n^k`` is 20 % of the training data, used only to rank the
candidates; the client trains on all of D (``meta_split="subset"``; ``"heldout"`` removes d from
training, our earlier reading). A candidate's score is Eq. (19),
``f_{n,k}(w^i) = 1/|d| Σ_{(x,y) ∈ d} L(y, f_{w^i}(x))``: the mean negative log predictive
probability on d, the predictive being the MC average of the posterior's probabilities over
``mc_samples`` draws (``eval.mc_samples``; one deterministic pass for deterministic models), no
KL term (``meta_score="nll"``, :func:`meta_nll`, through the evaluation code of
:mod:`fedlore.train.local`). ``meta_score="elbo"`` ranks by the per-example negative ELBO on d
with one weight sample instead (NLL + beta_kl·KL/N_k, :func:`meta_loss`); with a BNN its KL/N_k
term (hundreds of nats per example on a CNN) dwarfs the NLL, so the largest rate, which shrinks
the KL fastest, wins almost every search.

The J trials run one after another (:func:`select_lr`, each a deep copy trained by
:func:`~fedlore.train.local.local_train`) or as one vectorized computation
(:func:`batched_trials`: ``torch.func.vmap`` over the stacked candidates and a vectorized AdamW
or SGD update with each candidate's rate). The search reads the method's hyperparameters
through :class:`SearchHyper`; the method is :class:`fedlore.algorithms.bayes.MetaBayFL`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fedlore.bayes import GaussianPrior, gaussian_kl, is_bayesian, log_softplus
from fedlore.data.client_data import ClientData, TensorSplit, minibatches
from fedlore.settings import LocalTraining
from fedlore.train.local import (
    LossTerm,
    is_regression,
    local_train,
    predictive_draws,
    predictive_log_probs,
    regression_nll,
    task_loss,
)

META_SPLIT_SALT = 0x6D657461
"""Seeds a client's meta-split permutation: with the client's round seed (a new d every round)
or, for ``meta_resample="fixed"``, with its id alone (the same d every round)."""

MetaSplit = Literal["subset", "heldout"]
MetaScore = Literal["nll", "elbo"]


class SearchHyper(Protocol):
    """The hyperparameters the search reads (:class:`~fedlore.algorithms.bayes.MetaBayFL`'s,
    documented there) and how it copies the local model and optimizer for a trial
    (:meth:`~fedlore.algorithms.bayes_search.BayesSearch.trial_copy`)."""

    @property
    def train(self) -> LocalTraining: ...
    @property
    def candidate_lrs(self) -> tuple[float, ...]: ...
    @property
    def temp_steps(self) -> int: ...
    @property
    def trials(self) -> Literal["batched", "sequential"]: ...
    @property
    def meta_score(self) -> MetaScore: ...
    @property
    def beta_kl(self) -> float: ...
    @property
    def prior_mu(self) -> float: ...
    @property
    def prior_sigma(self) -> float: ...
    def trial_copy(
        self, model: nn.Module, opt: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]: ...


def meta_size(n: int, fraction: float, mode: MetaSplit = "subset") -> int:
    """|d| for a client of ``n`` training examples (``n`` >= 1, >= 2 with ``mode="heldout"``):
    ``round(fraction · n)``, at least 1, and under ``"heldout"`` at most ``n - 1`` (one example
    left to fit)."""
    n_meta = max(1, round(fraction * n))
    return min(n_meta, n - 1) if mode == "heldout" else n_meta


def meta_split(
    data: ClientData, fraction: float, mode: MetaSplit = "subset", seed: int | None = None
) -> tuple[TensorSplit, TensorSplit]:
    """The client's (training data, meta split d): ``d`` holds ``round(fraction · n)`` of its n
    training examples (at least 1), drawn by a permutation seeded with ``seed`` (seed 001, text
    after Eq. 22: "20 % of the training data", ``d_n^k ⊂ D_n^k``, a new d in every round k:
    Meta-BayFL passes a seed drawn from (run seed, round, client)). ``seed=None`` draws a
    permutation fixed per client, the same d in every round and every run (our earlier
    reading, ``meta_resample="fixed"``).

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
    n_meta = meta_size(n, fraction, mode)
    fixed = META_SPLIT_SALT * 1_000_003 + data.client_id
    g = torch.Generator().manual_seed(fixed if seed is None else seed)
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


def select_lr(
    hyper: SearchHyper,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    fit: TensorSplit,
    meta: TensorSplit,
    terms: list[LossTerm],
    seed: int,
    factors: Sequence[float] | None = None,
) -> tuple[float, list[float]]:
    """Seed Algorithm 1 lines 10-15: for each candidate eta_j, copy the current local model
    and optimizer state (``hyper.trial_copy``), take ``temp_steps`` steps with eta_j on
    minibatches of ``fit``, and score the copy on ``meta`` by :func:`candidate_score` (seed
    Eq. 19). Step s of a trial runs at ``eta_j * factors[s]``: the learning-rate schedule's
    factor at the local step that trial step stands for (None: 1, a constant schedule), so
    candidates are compared at the rates training would use after the choice. Every candidate
    sees the same minibatches and the same weight samples (common random numbers), in
    training and in scoring; the copies are discarded (reference notes Part 16 #4).

    A copy is scored in the channels-last layout (:func:`scoring_layout`): the same
    numbers up to float rounding (so the same choice but for near-ties), and a CNN's
    ``S · |d|`` forward passes, most of a search's time, run about twice as fast on CPU.
    With ``trials="batched"`` and a :func:`batchable` model and optimizer, the trials are
    :func:`batched_trials`.

    Returns:
        (the lowest-scoring candidate by :func:`pick_lowest`, the J scores).
    """
    factors = trial_factors(hyper.temp_steps, factors)
    if hyper.trials == "batched" and batchable(model, opt, hyper.train.grad_clip):
        scores = batched_trials(hyper, model, opt, fit, meta, seed, factors)
        return pick_lowest(hyper.candidate_lrs, scores), scores
    scores = []
    for lr in hyper.candidate_lrs:
        trial, trial_opt = hyper.trial_copy(model, opt)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            g = torch.Generator().manual_seed(seed)
            local_train(
                trial,
                minibatches(fit, hyper.train.batch_size, hyper.temp_steps, g),
                trial_opt,
                [lr * f for f in factors],
                loss_terms=terms,
                grad_clip=hyper.train.grad_clip,
            )
            scores.append(candidate_score(hyper, scoring_layout(trial), meta, terms))
    return pick_lowest(hyper.candidate_lrs, scores), scores


def trial_factors(temp_steps: int, factors: Sequence[float] | None) -> list[float]:
    """The schedule factor of each of a trial's ``temp_steps`` steps (None: all 1).

    Raises:
        ValueError: when ``factors`` does not hold one finite positive factor per trial step.
    """
    if factors is None:
        return [1.0] * temp_steps
    out = [float(f) for f in factors]
    if len(out) != temp_steps or not all(math.isfinite(f) and f > 0 for f in out):
        raise ValueError(f"need {temp_steps} finite positive schedule factors, got {out}")
    return out


def candidate_score(
    hyper: SearchHyper, model: nn.Module, meta: TensorSplit, terms: list[LossTerm]
) -> float:
    """The score of a temporary copy on d (lower is better): ``meta_score="nll"``, seed
    Eq. (19) with the MC predictive (:func:`meta_nll`, S = ``mc_samples``);
    ``meta_score="elbo"``, the per-example negative ELBO (:func:`meta_loss`)."""
    if hyper.meta_score == "elbo":
        return meta_loss(model, meta, terms)
    return meta_nll(model, meta, hyper.train.mc_samples)


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
    hyper: SearchHyper,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    fit: TensorSplit,
    meta: TensorSplit,
    seed: int,
    factors: Sequence[float] | None = None,
) -> list[float]:
    """The J candidate trials of :func:`select_lr` as one computation: the trained
    parameters are stacked J times and every step is ``vmap`` over the candidates of
    ``grad(loss)`` (``randomness="same"``: every candidate sees the same weight sample, as in the
    sequential trials), followed by a vectorized AdamW (or SGD) update with each candidate's
    learning rate, continuing the local optimizer's moments. A candidate whose loss or gradient
    turns non-finite stops updating (like a skipped step). The KL is computed from the stacked
    (mu, rho) with the prior (``prior_mu``, ``prior_sigma``) of ``hyper``.

    The AdamW update is written out here, over the stacked [J, ...] tensors, rather than torch's
    functional ``torch.optim.adamw.adamw`` (which takes one learning rate per call, so J calls
    over each candidate's slices): torch's (a ``lerp`` for the first moment, ``sqrt(v) /
    sqrt(1 - b2^t)``, an ``addcdiv``) rounds differently, and moves 11 of 24 test searches'
    scores by 1-2 float32 ulps (relative 2.3e-7 at most, no chosen rate changed; issue 31), no
    closer to the sequential scores; this one keeps earlier batched searches bit for bit.

    Returns:
        The J meta-split scores (:func:`candidate_score`: seed Eq. 19's predictive
        NLL, or the per-example negative ELBO), NaN for a diverged trial.
    """
    from torch.func import functional_call, grad_and_value, vmap

    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    j = len(hyper.candidate_lrs)
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
    prior = GaussianPrior(hyper.prior_mu, hyper.prior_sigma)
    bayes = is_bayesian(model)
    n_fit = len(fit)

    def kl(p: dict[str, torch.Tensor]) -> torch.Tensor:
        """KL of every Bayesian layer, frozen (mu, rho) included, as kl_divergence(model)."""
        device = next((t.device for t in p.values()), torch.device("cpu"))
        total = torch.zeros((), device=device)
        for key in p:
            if key.endswith("_rho"):
                mu = p[key[: -len("_rho")] + "_mu"]
                total = total + gaussian_kl(mu, log_softplus(p[key]), prior.mu, prior.sigma)
        return total

    def objective(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        full = {**p, **frozen}
        loss = task_loss(functional_call(model, full, (x,)), y)
        return loss + hyper.beta_kl * kl(full) / n_fit if bayes else loss

    def data_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return task_loss(functional_call(model, {**p, **frozen}, (x,)), y)

    step_fn = vmap(grad_and_value(objective), in_dims=(0, None, None), randomness="same")
    loss_fn = vmap(data_loss, in_dims=(0, None, None), randomness="same")
    kl_fn = vmap(lambda p: kl({**p, **frozen}), in_dims=(0,))
    device = named[0][1].device if named else torch.device("cpu")
    lrs = torch.tensor(hyper.candidate_lrs, dtype=torch.float32, device=device)
    step_factors = trial_factors(hyper.temp_steps, factors)
    alive = torch.ones(j, dtype=torch.bool, device=device)
    b1, b2 = hyper.train.betas
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        t = step0
        batches = minibatches(fit, hyper.train.batch_size, hyper.temp_steps, g)
        for si, (x, y) in enumerate(batches):
            grads, losses = step_fn(params, x, y)
            finite = torch.isfinite(losses)
            for gk in grads.values():
                finite &= torch.isfinite(gk.flatten(1)).all(1)
            alive &= finite
            t += 1
            for k in params:
                shape = (j,) + (1,) * (params[k].dim() - 1)
                rate = lrs if step_factors[si] == 1.0 else lrs * step_factors[si]
                lr = (rate * alive).view(shape)
                gk = torch.where(alive.view(shape), grads[k], torch.zeros_like(grads[k]))
                if not adam:  # torch SGD: weight decay is added to the gradient (coupled)
                    params[k] = params[k] - lr * (gk + hyper.train.weight_decay * params[k])
                    continue
                params[k] = params[k] * (1 - lr * hyper.train.weight_decay)
                m[k] = torch.where(alive.view(shape), b1 * m[k] + (1 - b1) * gk, m[k])
                v2[k] = torch.where(alive.view(shape), b2 * v2[k] + (1 - b2) * gk * gk, v2[k])
                denom = (v2[k] / (1 - b2**t)).sqrt() + hyper.train.eps
                params[k] = params[k] - lr / (1 - b1**t) * m[k] / denom
        model.eval()
        if hyper.meta_score == "elbo":  # as meta_loss: a weight draw per chunk of 512, then KL
            n_meta = len(meta)
            chunks = [
                loss_fn(params, meta.x[i : i + 512], meta.y[i : i + 512]) * len(meta.y[i : i + 512])
                for i in range(0, n_meta, 512)
            ]
            scores = torch.stack(chunks).sum(0) / n_meta
            if bayes:
                scores = scores + hyper.beta_kl * kl_fn(params) / n_fit
    if hyper.meta_score == "nll":
        scores = batched_meta_nll(model, params, frozen, meta, hyper.train.mc_samples)
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
    ``vmap``: the predictive of :func:`~fedlore.train.local.predictive_log_probs` (regression:
    :func:`~fedlore.train.local.predictive_draws`) with that ``vmap`` as its forward pass, so
    the same draws from the evaluation seed in the same order (a weight sample per forward pass
    of ``batch_size`` examples), shared by all candidates (``randomness="same"``), and each
    score equals the sequential one up to float rounding.

    Returns:
        ``[J]`` mean NLL of each candidate's predictive on d (NaN where not finite).
    """
    from torch.func import functional_call, vmap

    def forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, {**p, **frozen}, (x,))

    fwd = vmap(forward, in_dims=(0, None), randomness="same")

    def stacked(x: torch.Tensor) -> torch.Tensor:  # [J, B, ...]: every candidate's outputs
        return fwd(params, x)

    with torch.no_grad():
        if is_regression(meta.y):  # [S, J, n, d] draws -> the mixture NLL of each candidate
            draws = predictive_draws(model, meta.x, batch_size, mc_samples, stacked, dim=1)
            return torch.stack(
                [regression_nll(draws[:, j], meta.y).mean() for j in range(draws.shape[1])]
            )
        log_probs = predictive_log_probs(model, meta.x, batch_size, mc_samples, stacked, dim=1)
        picked = log_probs.gather(-1, meta.y.view(1, -1, 1).expand(log_probs.shape[0], -1, 1))
        return -picked.squeeze(-1).mean(-1)
