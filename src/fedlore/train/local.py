"""The one local-training loop every algorithm uses; methods extend it through hooks.

Hooks: ``loss_terms`` add to the minibatch loss (FedProx, Ditto, ELBO's KL), ``on_grad`` sees
the gradients before the optimizer step (FedLore keeps the last finite gradient for its
candidate basis). A step whose loss or gradient is not finite is skipped (no moment update, no
gradient direction) and counted in ``skipped_steps``, like a mixed-precision grad scaler; an
optimizer with a ``skip_step()`` method is told, so ProjectedAdam can still apply the round's
common weight decay (keeping Proposition 8 exact).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from fedlore.data.client_data import TensorSplit, minibatches

LossTerm = Callable[[nn.Module], torch.Tensor]
GradHook = Callable[[nn.Module, int], None]


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


def local_train(
    model: nn.Module,
    split: TensorSplit,
    optimizer: torch.optim.Optimizer,
    lrs: Sequence[float],
    batch_size: int,
    rng: torch.Generator,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    loss_terms: Sequence[LossTerm] = (),
    on_grad: Sequence[GradHook] = (),
    grad_clip: float | None = None,
) -> TrainStats:
    """Run ``len(lrs)`` local steps of ``optimizer`` on minibatches of ``split``.

    Args:
        model: trained in place (``model.train()`` is set).
        split: local training data.
        optimizer: any torch optimizer; its groups' ``lr`` is set to ``lrs[k]`` before step k.
        lrs: learning rate of each local step (length K).
        batch_size: B.
        rng: draws the minibatches (seeded by the caller from seed, round and client).
        loss_fn: ``(logits, targets) -> scalar``.
        loss_terms: extra scalar terms added to the loss (each gets the model).
        on_grad: called as ``hook(model, k)`` after backward, before the step (finite grads only).
        grad_clip: clip the global gradient norm to this value (None = no clipping).

    Returns:
        :class:`TrainStats`.
    """
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    losses: list[float] = []
    skipped = 0
    for k, (x, y) in enumerate(minibatches(split, batch_size, len(lrs), rng)):
        for g in optimizer.param_groups:
            g["lr"] = lrs[k]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        for term in loss_terms:
            loss = loss + term(model)
        if not bool(torch.isfinite(loss)):
            skipped += 1
            _skip(optimizer)
            continue
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
            _skip(optimizer)
            continue
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        for hook in on_grad:
            hook(model, k)
        optimizer.step()
        losses.append(float(loss.detach()))
    mean = sum(losses) / len(losses) if losses else float("nan")
    return TrainStats(mean_loss=mean, steps=len(lrs), skipped_steps=skipped)


def _skip(optimizer: torch.optim.Optimizer) -> None:
    """Tell an optimizer that defines ``skip_step`` (ProjectedAdam) that a step was skipped."""
    skip = getattr(optimizer, "skip_step", None)
    if callable(skip):
        skip()


@torch.no_grad()
def evaluate(model: nn.Module, split: TensorSplit, batch_size: int = 512) -> dict[str, float]:
    """Accuracy (torchmetrics, micro) and mean cross-entropy of ``model`` on ``split``.

    Returns:
        ``{"accuracy": share in [0, 1], "loss": mean NLL in nats, "num_examples": count}``.
    """
    model.eval()
    n = len(split)
    if n == 0:
        return {"accuracy": float("nan"), "loss": float("nan"), "num_examples": 0}
    logits = torch.cat([model(split.x[i : i + batch_size]) for i in range(0, n, batch_size)])
    num_classes = logits.shape[-1]
    acc = MulticlassAccuracy(num_classes=num_classes, average="micro")(logits, split.y)
    loss = F.cross_entropy(logits, split.y)
    return {"accuracy": float(acc), "loss": float(loss), "num_examples": n}
