"""Losses and gradients at weights held apart from the model, for the methods whose local step is
more than one optimizer step on one set of weights: APFL's gradient at the mixed model
``v̄ = α v + (1 - α) w`` (:mod:`fedlore.algorithms.apfl`), Per-FedAvg's gradient at the
inner-stepped weights ``w - α ∇f(w)`` and its Hessian-vector product
(:mod:`fedlore.algorithms.perfedavg`).

The model is called with :func:`torch.func.functional_call`: the named tensors replace the
model's own for one forward pass, everything else (frozen parameters, buffers) is the model's or
the ``fixed`` tensors given. Buffers that a forward pass in training mode updates (BatchNorm's
running statistics) are updated in place in whichever tensors the pass used. The forward pass
runs in the training precision's autocast, as :func:`~fedlore.train.local.local_train`'s does,
and the loss is :func:`~fedlore.train.local.task_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedlore.device import autocast
from fedlore.train.local import task_loss

Named = dict[str, torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]


def trained_names(model: nn.Module) -> list[str]:
    """Names of the parameters of ``model`` that train (``requires_grad``), in its order."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def leaves(arrays: Named) -> Named:
    """Detached copies of ``arrays`` that require a gradient (new leaves of the graph)."""
    return {k: v.detach().clone().requires_grad_(True) for k, v in arrays.items()}


def loss_at(model: nn.Module, weights: Named, fixed: Named, batch: Batch) -> torch.Tensor:
    """The task loss of ``model`` with ``weights`` (and ``fixed``) in place of its own tensors
    on ``batch``; the graph reaches ``weights`` (those that require a gradient)."""
    x, y = batch
    with autocast(x.device):  # bf16 forward under precision=bf16, as local_train's
        return task_loss(torch.func.functional_call(model, {**fixed, **weights}, (x,)), y)


def grads_of(loss: torch.Tensor, weights: Named, create_graph: bool = False) -> Named:
    """``∂ loss / ∂ weights`` by name (zeros for a tensor the loss does not reach)."""
    got = torch.autograd.grad(
        loss, list(weights.values()), create_graph=create_graph, allow_unused=True
    )
    return {
        k: torch.zeros_like(w) if g is None else g
        for (k, w), g in zip(weights.items(), got, strict=True)
    }


def loss_and_grads(
    model: nn.Module, weights: Named, fixed: Named, batch: Batch
) -> tuple[torch.Tensor, Named]:
    """The task loss at ``weights`` on ``batch`` and its gradient in each of them (detached).

    Args:
        model: the architecture (its own tensors stand in for those not named).
        weights: name -> tensor requiring a gradient (e.g. from :func:`leaves`).
        fixed: name -> tensor used without a gradient (buffers, frozen parameters).
        batch: ``(inputs, targets)``.
    """
    loss = loss_at(model, weights, fixed, batch)
    return loss.detach(), {k: g.detach() for k, g in grads_of(loss, weights).items()}


def hessian_vector(
    model: nn.Module, weights: Named, fixed: Named, batch: Batch, vector: Named
) -> Named:
    """``∇²f(w; batch) u``: the Hessian of the task loss at ``weights`` on ``batch`` times the
    vector ``u`` (by name, same shapes), exactly, by differentiating ``⟨∇f(w), u⟩`` once more
    (Pearlmutter 1994; the limit of Per-FedAvg (HF)'s gradient difference as δ -> 0)."""
    loss = loss_at(model, weights, fixed, batch)
    g = grads_of(loss, weights, create_graph=True)
    dot = sum(
        ((g[k] * vector[k].detach()).sum() for k in weights), torch.zeros((), device=loss.device)
    )
    if not dot.requires_grad:  # the gradient is constant in w (a linear model's): H u = 0
        return {k: torch.zeros_like(w) for k, w in weights.items()}
    return {k: h.detach() for k, h in grads_of(dot, weights).items()}


def clip_(grads: Sequence[torch.Tensor], max_norm: float | None) -> None:
    """Scale ``grads`` in place so that their joint L2 norm is at most ``max_norm`` (None: leave
    them), with :func:`torch.nn.utils.clip_grad_norm_`'s coefficient
    ``min(1, max_norm / (norm + 1e-6))`` and without a wait on the device."""
    if max_norm is None or not grads:
        return
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
