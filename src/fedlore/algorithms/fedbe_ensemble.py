"""FedBE's server-side ensemble and distillation (Chen & Chao, ICLR 2021; hongyouc/FedBE): the
Gaussian over the clients' normalised updates and its samples, the teachers' sharpened mean
softmax on the unlabeled set U, the KL loss, the SWA schedule and the distillation of the student.

Pure functions of tensors and a workspace model; :class:`~fedlore.algorithms.fedbe.FedBE` (the
method: state, validation, the round's order of steps and its metrics) composes them. Steps,
defaults and deviations are in :mod:`fedlore.algorithms.fedbe`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

from fedlore.tensors import load_model_arrays, model_arrays
from fedlore.train.local import predictive_log_probs
from fedlore.types import Arrays

VAR_CLAMP = 1e-5
"""Floor of the per-coordinate variance (hongyouc/FedBE ``swag.py: SWAG_server.var_clamp``)."""
SHARPEN_FLOOR = 1e-8
"""Floor of ``p^(1/T)`` before renormalising (hongyouc/FedBE ``utils/tools.py: temp_sharpen``)."""
TEACHER_BATCH = 1024
"""Examples per teacher forward pass over U (FedBE's ``ldr_train`` batch; inference only)."""
FEDBE_SWA_START_SHARE = 500 / 1580
"""swa_start / S of FedBE's default run (20 server epochs over 10 000 images in batches of 128)."""


def update_stats(
    base: Arrays, clients: Sequence[Arrays], names: Sequence[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Moments of the clients' normalised updates, per tensor (``swag.py:
    SWAG_server.compute_mean_sq`` + ``compute_var``).

    Args:
        base: w^t by plain name.
        clients: each client's model ``w_k`` by plain name (at least one).
        names: the tensors to describe (floating point, in ``base`` and every client).

    Returns:
        name -> ``(mean, var, norm)``: ū = mean_k u_k with ``u_k = Δ_k / ||Δ_k||₂`` (0 where
        ``Δ_k = 0``) and var = ``max(mean_k u_k² - ū², 1e-5)``, both float32 of the tensor's
        shape, and the scalar ``mean_k ||Δ_k||₂`` (float32, 0-d).

    Raises:
        ValueError: when ``clients`` is empty.
    """
    if not clients:
        raise ValueError("the Gaussian over client updates needs at least one client model")
    out: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for k in names:
        w0 = base[k].float()
        deltas = torch.stack([c[k].float() - w0 for c in clients])  # [K, *shape]
        norms = torch.linalg.vector_norm(deltas.flatten(1), dim=1)  # [K]
        scale = torch.where(norms > 0, 1.0 / norms, torch.zeros_like(norms))
        u = deltas * scale.view(-1, *([1] * w0.dim()))
        mean = u.mean(0)
        var = torch.clamp(u.square().mean(0) - mean.square(), min=VAR_CLAMP)
        out[k] = (mean, var, norms.mean())
    return out


def gaussian_samples(
    base: Arrays,
    clients: Sequence[Arrays],
    names: Sequence[str],
    num: int,
    var_scale: float,
    stepsize: float,
    generator: torch.Generator,
) -> list[Arrays]:
    """FedBE's global-model samples (``swag.py: SWAG_server.construct_models``, mode
    ``"gaussian"``, ``concentrate_num = 1``).

    For each sample and tensor ``k`` of ``names`` (in order), with (ū, var, n̄) from
    :func:`update_stats` and ε ~ N(0, I) drawn from ``generator``:
    ``w^t + (ū + sqrt(var) · ε · var_scale) · stepsize · n̄``.

    Args:
        base: w^t by plain name.
        clients: the clients' models by plain name.
        names: the tensors to sample (the others are left to the caller).
        num: M, the number of samples (≥ 0).
        var_scale, stepsize: FedBE's ``var_scale`` and ``swag_stepsize``.
        generator: the only source of ε.

    Returns:
        ``num`` dicts ``{name: tensor}`` over ``names``, each in its ``base`` dtype.
    """
    stats = update_stats(base, clients, names)
    samples = []
    for _ in range(num):
        sample = {}
        for k in names:
            mean, var, norm = stats[k]
            eps = torch.randn(mean.shape, generator=generator).to(mean.device)
            step = (mean + var.sqrt() * eps * var_scale) * (stepsize * norm)
            sample[k] = (base[k].float() + step).to(base[k].dtype)
        samples.append(sample)
    return samples


def sharpen(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """Temperature sharpening (``utils/tools.py: temp_sharpen``): ``max(p^(1/T), 1e-8)``
    renormalised over the last axis.

    Args:
        probs: ``[n, C]`` probabilities.
        temperature: T > 0 (T < 1 sharpens, T = 1 leaves ``probs`` unchanged up to the floor).

    Returns:
        ``[n, C]`` float tensor whose rows sum to 1.
    """
    p = torch.clamp(probs.pow(1.0 / temperature), min=SHARPEN_FLOOR)
    return p / p.sum(-1, keepdim=True)


def ensemble_probs(
    model: nn.Module, teachers: Sequence[Arrays], x: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The teachers' mean softmax over ``x`` (``merge_logits``, method ``"mean"``).

    Each teacher is loaded into ``model`` and run in ``eval()`` mode (dropout off, BatchNorm on
    its running statistics), as FedBE's ``get_input_logits``.

    Args:
        model: the workspace; every tensor of each teacher is loaded into it.
        teachers: full ``state_dict`` arrays of each teacher (at least one).
        x: U's inputs ``[n, ...]``.

    Returns:
        ``(mean, argmax)``: ``[n, C]`` float32 mean probabilities and ``[T', n]`` int64 argmax of
        each of the T' teachers whose predictions are finite (a diverged teacher, e.g. a sample
        drawn with a huge variance, is left out); ``(None, [0, n])`` when none is finite.
    """
    total: torch.Tensor | None = None
    votes = []
    for t in teachers:
        load_model_arrays(model, t)
        probs = predictive_log_probs(model, x, TEACHER_BATCH, 0).exp()
        if not bool(torch.isfinite(probs).all()):
            continue
        total = probs if total is None else total + probs
        votes.append(probs.argmax(-1))
    if total is None:
        return None, torch.zeros(0, len(x), dtype=torch.int64, device=x.device)
    return total / len(votes), torch.stack(votes)


def fedbe_kl(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """FedBE's distillation loss (``ServerUpdate.loss_wrapper``, ``loss_type="KL"``):
    ``mean over all n·C elements of P (log P - log_softmax(logits))``.

    Args:
        logits: ``[n, C]`` student scores.
        targets: ``[n, C]`` pseudo-label probabilities P (rows sum to 1).

    Returns:
        A scalar (nats per class per example).
    """
    return F.kl_div(F.log_softmax(logits, -1), targets, reduction="sum") / targets.numel()


@torch.no_grad()
def kl_per_example(model: nn.Module, x: torch.Tensor, targets: torch.Tensor) -> float:
    """KL(targets || model) in nats per example, mean over ``x`` (``eval()`` mode)."""
    log_q = predictive_log_probs(model, x, TEACHER_BATCH, 0)
    return float(F.kl_div(log_q, targets, reduction="sum")) / max(len(x), 1)


def swa_schedule(total_steps: int, start: int, freq: int, share: float) -> tuple[int, int]:
    """The effective SWA (start, frequency) of a distillation of ``total_steps`` steps.

    The average takes the weights after step s (1-based) when ``s > start`` and
    ``s % freq == 0`` (torchcontrib ``SWA`` in automatic mode). FedBE's ``(start, freq)`` is kept
    when at least one step qualifies (``total_steps >= start + freq``); otherwise the schedule is
    stretched to the run: ``(⌊share · S⌋, max(1, ⌊freq · share · S / start⌋))`` (``share`` =
    :data:`FEDBE_SWA_START_SHARE` by default; with ``start = 0`` the frequency is kept), which
    always leaves at least one qualifying step.

    Raises:
        ValueError: for ``total_steps < 1``, ``start < 0``, ``freq < 1`` or ``share`` outside
            (0, 1).
    """
    if total_steps < 1 or start < 0 or freq < 1 or not 0 < share < 1:
        raise ValueError(f"bad SWA schedule: S={total_steps}, start={start}, freq={freq}")
    if total_steps >= start + freq:
        return start, freq
    new_start = math.floor(share * total_steps)
    new_freq = freq if start == 0 else max(1, math.floor(freq * share * total_steps / start))
    return new_start, min(new_freq, total_steps - new_start)


@dataclass(frozen=True)
class DistillResult:
    """What :func:`distill` returns.

    Attributes:
        arrays: the broadcast student (the SWA average, or the last SGD iterate without SWA),
            every ``state_dict`` tensor by plain name.
        loss: mean :func:`fedbe_kl` over the last epoch's steps.
        steps: S, minibatches drawn (optimizer steps taken plus skipped ones).
        swa_models: snapshots in the average (0 without SWA).
        skipped: steps skipped for a non-finite loss.
    """

    arrays: Arrays
    loss: float
    steps: int
    swa_models: int
    skipped: int = 0


def distill(
    model: nn.Module,
    start: Arrays,
    x: torch.Tensor,
    targets: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    weight_decay: float,
    swa: bool,
    swa_start: int,
    swa_freq: int,
    swa_start_share: float,
    generator: torch.Generator,
) -> DistillResult:
    """Train a student that starts at ``start`` on (``x``, ``targets``) (``ServerUpdate.train``).

    ``epochs`` passes over ``x`` in a fresh random order each (``torch.randperm`` from
    ``generator``), batches of ``batch_size`` with the last one partial, loss :func:`fedbe_kl`,
    ``torch.optim.SGD(lr, momentum, weight_decay)`` over the parameters that require grad, in
    ``train()`` mode; a step whose loss is not finite is skipped. Dropout draws from a seed taken
    from ``generator`` (the global RNG is restored). With ``swa``, an
    ``AveragedModel`` averages the weights on :func:`swa_schedule`'s steps and its BatchNorm
    statistics are then recomputed on ``x`` (``update_bn``).

    Args:
        model: the workspace (trained in place; its requires_grad flags are respected).
        start: every ``state_dict`` tensor of the student's start (w̄).
        x: inputs ``[n, ...]`` (n ≥ 1).
        targets: ``[n, C]`` pseudo-label probabilities.

    Returns:
        :class:`DistillResult`.
    """
    load_model_arrays(model, start)
    n = len(x)
    per_epoch = math.ceil(n / batch_size)
    total = epochs * per_epoch
    s_start, s_freq = swa_schedule(total, swa_start, swa_freq, swa_start_share)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    averaged = AveragedModel(model) if swa else None
    snapshots, step, skipped = 0, 0, 0
    last_epoch: list[float] = []
    dropout_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(dropout_seed)
        model.train()
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator)
            last_epoch = []
            for i in range(0, n, batch_size):
                idx = order[i : i + batch_size].to(x.device)
                opt.zero_grad(set_to_none=True)
                loss = fedbe_kl(model(x[idx]), targets[idx])
                step += 1
                if not bool(torch.isfinite(loss)):
                    skipped += 1
                    continue
                loss.backward()
                opt.step()
                last_epoch.append(float(loss.detach()))
                if averaged is not None and step > s_start and step % s_freq == 0:
                    averaged.update_parameters(model)
                    snapshots += 1
        if averaged is not None:
            update_bn([x[i : i + batch_size] for i in range(0, n, batch_size)], averaged)
    # no snapshot only when every step after the SWA start was skipped (non-finite losses)
    result = averaged.module if averaged is not None and snapshots else model
    mean_loss = sum(last_epoch) / len(last_epoch) if last_epoch else float("nan")
    return DistillResult(model_arrays(result), mean_loss, step, snapshots, skipped)
