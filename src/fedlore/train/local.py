"""The one local-training loop every algorithm uses, and the one evaluation of a model on a split;
methods extend the loop through hooks.

Hooks: ``loss_terms`` add to the minibatch loss (FedProx, Ditto, ELBO's KL), ``on_grad`` sees
the gradients before the optimizer step (FedLore keeps the last finite gradient for its
candidate basis). A step whose loss or gradient is not finite is skipped (no moment update, no
gradient direction) and counted in ``skipped_steps``, like a mixed-precision grad scaler; an
optimizer with a ``skip_step()`` method is told, so ProjectedAdam can still apply the round's
common weight decay (keeping Proposition 8 exact).

Precision (:mod:`fedlore.device`): under ``precision: bf16`` each step's forward pass and loss
run in bfloat16 autocast, on the CPU as on CUDA; the backward follows the forward's dtypes, the
parameters and their gradients stay fp32, and so do the optimizer step and every projection.
Per step the loop copies nothing of the model and waits on the device once (the finiteness of
the loss and of all gradients together, one fused pass: :class:`FiniteCheck`), whatever the
number of tensors; the losses are read once, after the last step.

Evaluation (:func:`evaluate`: classifiers, language models, regression) scores the predictive
of :func:`predictive_passes`: one pass with sampling off, or S weight draws from a fixed seed for
a model with stochastic layers. Meta-BayFL's learning-rate search scores its candidates through
the same functions (:mod:`fedlore.algorithms.meta_lr`, seed 001 Eq. 19).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedlore.data.client_data import TensorSplit
from fedlore.data.corpus import IGNORE_INDEX
from fedlore.device import autocast
from fedlore.tensors import all_finite
from fedlore.train.metrics import classification_metrics

LossTerm = Callable[[nn.Module], torch.Tensor]
GradHook = Callable[[nn.Module, int], None]


def parameter_term(
    names: Iterable[str], part: Callable[[str, nn.Parameter], torch.Tensor]
) -> LossTerm:
    """The loss term ``model -> Σ part(name, p)`` over the model's parameters whose names are
    in ``names`` (a zero on the model's device when none is), summed in the model's parameter
    order: the shape of SCAFFOLD's and FedDyn's terms."""
    chosen = set(names)

    def term(model: nn.Module) -> torch.Tensor:
        total = torch.zeros((), device=next(model.parameters()).device)
        for name, p in model.named_parameters():
            if name in chosen:
                total = total + part(name, p)
        return total

    return term


@dataclass(frozen=True)
class Schedule:
    """Learning rate as a function of the global local-step index (round * K + k).

    Attributes:
        lr: base learning rate.
        kind: ``"constant"`` or ``"cosine"`` (decay from ``lr`` to ``min_ratio * lr`` over
            ``total_steps``; Loshchilov & Hutter 2017 without restarts).
        total_steps: rounds x local steps of the run.
        min_ratio: final lr as a share of ``lr``.
    """

    lr: float
    kind: str = "constant"
    total_steps: int = 1
    min_ratio: float = 0.0

    def at(self, step: int) -> float:
        """Learning rate at global local-step ``step`` (0-based)."""
        if self.kind == "constant":
            return self.lr
        if self.kind == "cosine":
            frac = min(max(step, 0), self.total_steps) / max(self.total_steps, 1)
            cos = 0.5 * (1.0 + math.cos(math.pi * frac))
            return self.lr * (self.min_ratio + (1.0 - self.min_ratio) * cos)
        raise ValueError(f"unknown schedule {self.kind!r}")

    def round_lrs(self, rnd: int, local_steps: int) -> list[float]:
        """The K learning rates of round ``rnd``."""
        return [self.at(rnd * local_steps + k) for k in range(local_steps)]


@dataclass(frozen=True)
class TrainStats:
    """What one call of :func:`local_train` did.

    Attributes:
        mean_loss: mean minibatch loss over the finite steps (NaN if none).
        steps: steps attempted.
        skipped_steps: steps skipped for a non-finite loss or gradient.
    """

    mean_loss: float
    steps: int
    skipped_steps: int


HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def is_regression(targets: torch.Tensor) -> bool:
    """Whether targets are real values (a regression task): floating-point targets are, class
    and token ids (int64) are not. The task loss and every metric are chosen by this."""
    return bool(targets.is_floating_point())


def gaussian_nll(pred: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of real targets under ``N(pred, I)``, the unit-noise Gaussian
    likelihood of a regression model (on standardized targets):
    ``mean_b [½ ||y_b - ŷ_b||² + ½ d log 2π]``, i.e. half the squared error summed over the d
    target dimensions plus a constant; its gradient in ``ŷ`` is ``(ŷ - y) / B``.

    Args:
        pred: ``[B, d]`` (or ``[B]``) predictions.
        targets: ``[B]`` or ``[B, d]`` real targets (cast to ``pred``'s dtype).

    Returns:
        Scalar, nats per example.

    Raises:
        ValueError: when the shapes hold different numbers of values per example.
    """
    b = int(targets.shape[0])
    p, y = pred.reshape(b, -1), targets.reshape(b, -1).to(pred.dtype)
    if p.shape != y.shape:
        raise ValueError(
            f"regression outputs {tuple(pred.shape)} do not match targets {tuple(targets.shape)}"
        )
    return 0.5 * (p - y).pow(2).sum(-1).mean() + HALF_LOG_2PI * y.shape[1]


def task_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The task loss chosen by the data: mean cross-entropy of a classifier or a causal language
    model (integer targets), or the unit-noise Gaussian NLL of a regression model (real targets,
    :func:`gaussian_nll`; ½ the squared error plus a constant). Every method's local training,
    the ELBO's likelihood term and the construction gradients use it.

    Args:
        logits: ``[B, K]`` class scores, ``[B, L, V]`` next-token scores, or ``[B, d]``
            regression outputs.
        targets: ``[B]`` classes, ``[B, L]`` next-token ids with :data:`IGNORE_INDEX` where a
            position does not count (padding, a sequence's last position), or ``[B]``/``[B, d]``
            real targets.

    Returns:
        Scalar: the mean NLL in nats over the counted targets (NaN when none counts, so the
        step is skipped).
    """
    if is_regression(targets):
        return gaussian_nll(logits, targets)
    if logits.dim() == 3:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    return F.cross_entropy(logits, targets)


def local_train(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    lrs: Sequence[float],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = task_loss,
    loss_terms: Sequence[LossTerm] = (),
    on_grad: Sequence[GradHook] = (),
    grad_clip: float | None = None,
) -> TrainStats:
    """Run ``len(lrs)`` local steps of ``optimizer``, one per minibatch of ``batches``.

    Args:
        model: trained in place (``model.train()`` is set).
        batches: at least K ``(inputs, targets)`` minibatches, e.g.
            :meth:`fedlore.data.client_data.ClientData.batches` (seeded by the caller from seed,
            round and client); only the first K are read.
        optimizer: any torch optimizer; its groups' ``lr`` is set to ``lrs[k]`` before step k.
        lrs: learning rate of each local step (length K).
        loss_fn: ``(logits, targets) -> scalar`` (default :func:`task_loss`).
        loss_terms: extra scalar terms added to the loss (each gets the model).
        on_grad: called as ``hook(model, k)`` after backward, before the step (finite grads only).
        grad_clip: clip the global gradient norm to this value (None = no clipping).

    Returns:
        :class:`TrainStats`.
    """
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    check = FiniteCheck(params)
    losses: list[torch.Tensor] = []
    skipped = 0
    for k, (x, y) in zip(range(len(lrs)), batches, strict=False):
        for g in optimizer.param_groups:
            g["lr"] = lrs[k]
        optimizer.zero_grad(set_to_none=True)
        with autocast(x.device):  # bf16 forward under precision=bf16; masters stay fp32
            loss = loss_fn(model(x), y)
            for term in loss_terms:
                loss = loss + term(model)
        # the loss and every gradient checked at once, after the backward: one wait on the
        # device per step; a non-finite loss's gradients are dropped unseen, as if never made
        loss.backward()
        if not check(loss, [d for p in params if (d := p.grad) is not None]):
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
            _skip(optimizer)
            continue
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        for hook in on_grad:
            hook(model, k)
        optimizer.step()
        losses.append(loss.detach())  # read once, after the last step
    values = torch.stack(losses).tolist() if losses else []
    mean = sum(values) / len(values) if values else float("nan")
    return TrainStats(mean_loss=mean, steps=len(lrs), skipped_steps=skipped)


_FUSED_CHECK = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
"""The gradient scaler's fused check (``torch.amp.GradScaler``): one kernel over a list of
tensors that sets a flag when any element is not finite and multiplies them in place by a scale,
which is 1 here: the kernel then writes every value back unchanged."""


class FiniteCheck:
    """Whether a local step's loss and gradients are all finite, in one pass and one wait on
    the device: the gradient scaler's fused check (``torch.amp.GradScaler`` unscales by 1,
    leaving every gradient bit for bit as it was), or :func:`fedlore.tensors.all_finite` where
    the fused check does not apply (complex or sparse gradients, several devices, a torch
    without it). Either answers as ``torch.isfinite(t).all()`` over every tensor would.

    Args:
        params: the trained parameters (their device and dtypes choose the check).
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        devices = {p.device for p in params}
        self.fused = (
            _FUSED_CHECK is not None
            and len(devices) == 1
            and all(p.is_floating_point() and p.layout == torch.strided for p in params)
        )
        if self.fused:
            device = next(iter(devices))  # the kernel takes a float32 flag and scale
            self.found = torch.zeros(1, device=device, dtype=torch.float32)
            self.one = torch.ones(1, device=device, dtype=torch.float32)

    def __call__(self, loss: torch.Tensor, grads: list[torch.Tensor]) -> bool:
        """Whether ``loss`` (any shape) and every tensor of ``grads`` are finite (the fused
        check writes each value back unchanged, the loss's too: its graph is spent)."""
        if self.fused and _FUSED_CHECK is not None:
            try:
                _FUSED_CHECK([loss.detach(), *grads], self.found, self.one)
            except (RuntimeError, TypeError):  # e.g. a sparse gradient: from now on as below
                self.fused = False
            else:
                if not bool(self.found.item()):
                    return True
                self.found.zero_()  # the flag is cleared only after a non-finite step
                return False
        return all_finite([loss.detach(), *grads])


def _skip(optimizer: torch.optim.Optimizer) -> None:
    """Tell an optimizer that defines ``skip_step`` (ProjectedAdam) that a step was skipped."""
    skip = getattr(optimizer, "skip_step", None)
    if callable(skip):
        skip()


EVAL_LOGITS_ELEMENTS = 2**24
"""Language models: at most this many logits (batch x positions x vocabulary, 64 MiB in fp32)
per evaluation forward pass."""


EVAL_SAMPLING_SEED = 20170


Forward = Callable[[torch.Tensor], torch.Tensor]
"""A forward pass ``inputs -> outputs`` (a model, or a ``vmap`` of one over stacked parameters)."""


def mc_samples_drawn(model: nn.Module, mc_samples: int) -> int:
    """S, the weight draws of ``model``'s predictive: ``mc_samples`` for a model with stochastic
    layers (:mod:`fedlore.bayes`), 0 (one pass with sampling off) for a deterministic model or
    ``mc_samples < 1``."""
    from fedlore.bayes.model import is_stochastic

    return mc_samples if mc_samples >= 1 and is_stochastic(model) else 0


def predictive_passes(
    model: nn.Module, one_pass: Callable[[], torch.Tensor], mc_samples: int
) -> torch.Tensor:
    """``one_pass()`` under each weight draw of ``model``'s predictive, stacked: ``[S, ...]`` for
    S = :func:`mc_samples_drawn` >= 1 draws from the fixed evaluation seed (the same draws for
    every model evaluated, the global RNG restored), else ``[1, ...]`` from one pass with
    sampling off (the posterior means; dropout off). The model is put in ``eval()`` mode either
    way (BatchNorm frozen); the sampling switch is independent of it."""
    from fedlore.bayes.model import sampling

    model.eval()
    draws = mc_samples_drawn(model, mc_samples)
    if draws == 0:
        with sampling(model, False):
            return one_pass().unsqueeze(0)
    with sampling(model, True), torch.random.fork_rng(devices=[]):
        torch.manual_seed(EVAL_SAMPLING_SEED)
        return torch.stack([one_pass() for _ in range(draws)])


def chunked(forward: Forward, x: torch.Tensor, batch_size: int, dim: int = 0) -> torch.Tensor:
    """``forward`` over ``x`` in chunks of ``batch_size`` examples, the float32 outputs joined
    along ``dim`` (the outputs' examples dimension)."""
    n = int(x.shape[0])
    return torch.cat([forward(x[i : i + batch_size]).float() for i in range(0, n, batch_size)], dim)


@torch.no_grad()
def predictive_log_probs(
    model: nn.Module,
    x: torch.Tensor,
    batch_size: int = 512,
    mc_samples: int = 0,
    forward: Forward | None = None,
    dim: int = 0,
) -> torch.Tensor:
    """Log predictive probabilities ``log p(y | x)`` of a classifier.

    A model with stochastic layers (:mod:`fedlore.bayes`) and ``mc_samples = S >= 1`` gives the
    MC predictive ``log (1/S) Σ_s softmax(f(x; w_s))`` (reference notes Part 0.4), computed as
    ``logsumexp_s log_softmax - log S``, from the draws of :func:`predictive_passes`. Otherwise
    one pass with sampling off (the posterior means; dropout off).

    Args:
        model: maps ``[B, ...]`` to logits ``[B, K]``.
        x: inputs ``[n, ...]``.
        batch_size: examples per forward pass.
        mc_samples: S (0: deterministic pass).
        forward: what maps the inputs to logits (default ``model``; e.g. a ``vmap`` over J
            stacked copies of its parameters, whose logits are ``[J, B, K]``).
        dim: the examples dimension of ``forward``'s logits.

    Returns:
        ``[n, K]`` (``forward``'s layout) float tensor of log probabilities.
    """
    fwd = model if forward is None else forward
    passes = predictive_passes(
        model, lambda: F.log_softmax(chunked(fwd, x, batch_size, dim), -1), mc_samples
    )
    if mc_samples_drawn(model, mc_samples) == 0:
        return passes[0]
    return torch.logsumexp(passes, 0) - math.log(passes.shape[0])


@torch.no_grad()
def predictive_draws(
    model: nn.Module,
    x: torch.Tensor,
    batch_size: int = 512,
    mc_samples: int = 0,
    forward: Forward | None = None,
    dim: int = 0,
) -> torch.Tensor:
    """A regression model's predictions under its predictive: ``[S, n, d]`` outputs of the
    weight draws of :func:`predictive_passes` (S >= 1 from the fixed evaluation seed for a model
    with stochastic layers and ``mc_samples = S >= 1``, else ``[1, n, d]`` from one pass with
    sampling off). ``forward`` and ``dim`` as in :func:`predictive_log_probs` (J stacked copies:
    ``[S, J, n, d]``)."""
    fwd = model if forward is None else forward
    n = int(x.shape[0])

    def one_pass() -> torch.Tensor:
        out = chunked(fwd, x, batch_size, dim)
        return out.reshape(*out.shape[:dim], n, -1)

    return predictive_passes(model, one_pass, mc_samples)


def regression_nll(draws: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example NLL ``[n]`` of real targets under the predictive mixture
    ``(1/S) Σ_s N(y; f_s(x), I)`` of the draws ``[S, n, d]`` (unit observation noise, as the
    training likelihood :func:`gaussian_nll`), computed with ``logsumexp``."""
    yy = y.reshape(draws.shape[1], -1).to(draws.dtype)
    log_lik = -0.5 * (draws - yy).pow(2).sum(-1) - HALF_LOG_2PI * yy.shape[1]
    return -(torch.logsumexp(log_lik, 0) - math.log(draws.shape[0]))


def regression_metrics(draws: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """RMSE and NLL of a regression predictive.

    Args:
        draws: ``[S, n, d]`` predictions (:func:`predictive_draws`).
        y: ``[n]`` or ``[n, d]`` real targets.

    Returns:
        ``rmse`` (root mean squared error of the predictive mean over all n·d values, in target
        units), ``loss`` (mean NLL of the predictive mixture, :func:`regression_nll`) and
        ``num_examples``; NaN when a prediction is not finite (a diverged model).
    """
    n = int(draws.shape[1])
    if not bool(torch.isfinite(draws).all()):
        nan = float("nan")
        return {"rmse": nan, "loss": nan, "num_examples": n}
    yy = y.reshape(n, -1).to(draws.dtype)
    rmse = float((draws.mean(0) - yy).pow(2).mean().sqrt())
    return {"rmse": rmse, "loss": float(regression_nll(draws, y).mean()), "num_examples": n}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    split: TensorSplit,
    batch_size: int = 512,
    mc_samples: int = 0,
    metrics: Sequence[str] = (),
) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` on ``split``; perplexity for a language model.

    Classifiers (logits ``[B, K]``): accuracy (torchmetrics, micro), mean NLL per example and ECE
    of the predictive distribution (:func:`predictive_log_probs`: the MC predictive over
    ``mc_samples`` draws for a model with stochastic layers, else one deterministic pass).
    Language models (logits ``[B, L, V]``, targets ``[B, L]``): NLL summed over every target
    that is not :data:`IGNORE_INDEX` divided by their count, perplexity ``exp`` of that mean
    (seed 000, "Evaluation and reproducibility"), and next-token top-1 accuracy over the same
    tokens. Batches are cut to at most :data:`EVAL_LOGITS_ELEMENTS` logits.

    Regression models (real targets): ``rmse`` and ``loss``, the mean NLL of the predictive
    (:func:`regression_metrics`), instead of accuracy.

    ``metrics`` (``eval.metrics``) adds classifier metrics of :mod:`fedlore.train.metrics`,
    computed on the same predictive; refused for language and regression models.

    Returns:
        ``{"accuracy": share in [0, 1], "loss": mean NLL in nats, "num_examples": count}``, plus
        ``"ece"`` for a classifier, ``"perplexity"`` and ``"num_tokens"`` (counted targets) for a
        language model; ``{"rmse", "loss", "num_examples"}`` for regression. NaN values when
        nothing counts.
    """
    model.eval()
    n = len(split)
    if n == 0:
        nan = float("nan")
        return {"accuracy": nan, "loss": nan, "num_examples": 0, **dict.fromkeys(metrics, nan)}
    if metrics and (is_regression(split.y) or split.y.dim() != 1):
        raise ValueError(
            f"eval.metrics {list(metrics)} score classifiers; this model's targets are "
            f"{'real numbers' if is_regression(split.y) else 'token sequences'}"
        )
    if is_regression(split.y):
        return regression_metrics(predictive_draws(model, split.x, batch_size, mc_samples), split.y)
    if split.y.dim() == 1:
        return classification_metrics(
            predictive_log_probs(model, split.x, batch_size, mc_samples), split.y, metrics
        )
    nll, correct, tokens = 0.0, 0, 0
    per_row = split.x.shape[1] * int(model(split.x[:1]).shape[-1])  # logits of one sequence
    step = max(1, min(batch_size, EVAL_LOGITS_ELEMENTS // per_row))
    for i in range(0, n, step):
        y = split.y[i : i + step].flatten()
        keep = y != IGNORE_INDEX
        logits = model(split.x[i : i + step]).flatten(0, 1)[keep]
        nll += float(F.cross_entropy(logits, y[keep], reduction="sum"))
        correct += int((logits.argmax(-1) == y[keep]).sum())
        tokens += int(keep.sum())
    if tokens == 0:
        nan = float("nan")
        return {"accuracy": nan, "loss": nan, "perplexity": nan, "num_examples": n, "num_tokens": 0}
    mean = nll / tokens
    return {
        "accuracy": correct / tokens,
        "loss": mean,
        "perplexity": math.exp(mean) if mean < 700 else float("inf"),
        "num_examples": n,
        "num_tokens": tokens,
    }
