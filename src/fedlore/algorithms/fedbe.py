"""FedBE (Chen & Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated Learning",
ICLR 2021): FedAvg clients, a server that distils a Bayesian model ensemble on unlabeled data.

Clients are :class:`~fedlore.algorithms.fedavg.FedAvg`'s (local SGD, upload ``update.*``). One
server step at round t, from the global weights w^t and the accepted clients' models
``w_k = w^t + Δ_k`` (reference notes Part 13; hongyouc/FedBE ``main.py``):

1. **FedAvg**: ``w̄ = w^t + Σ p_k Δ_k / Σ p_k`` (:class:`DenseServer`'s aggregate).
2. **Gaussian samples** (``swag.py: SWAG_server.construct_models``, mode ``"gaussian"``): per
   parameter tensor, the clients' normalised updates ``u_k = Δ_k / ||Δ_k||₂``, their uniform mean
   ū and variance ``max(E[u²] - ū², 1e-5)``; a sample is
   ``w^t + (ū + sqrt(var) · ε · var_scale) · swag_stepsize · mean_k ||Δ_k||₂``, ε ~ N(0, I);
   ``num_samples`` of them (:func:`gaussian_samples`).
3. **Teachers** = {w̄} + the samples + the client models (``--use_client``).
4. **Pseudo-labels** on the server's unlabeled set U: the teachers' mean softmax, sharpened with
   temperature T: ``p^(1/T)`` floored at 1e-8 and renormalised (``utils/tools.py:
   merge_logits``, ``temp_sharpen``; :func:`sharpen`).
5. **Distillation** (``models/Update.py: ServerUpdate.train``): a student that starts at w̄
   trains ``server_epochs`` epochs over U (reshuffled each epoch, batches of
   ``server_batch_size``, the last one partial) on FedBE's KL loss
   ``mean over elements of P (log P - log Q)`` (P the pseudo-labels, Q the student's softmax) by
   SGD with momentum and weight decay, with stochastic weight averaging
   (``torch.optim.swa_utils.AveragedModel``; :func:`distill`).
6. **Broadcast** the SWA student as w^{t+1} (``--use_SWA``).

Defaults and their sources (hongyouc/FedBE):

* ``num_samples`` M = 10: ``utils/options.py --num_sample_teacher``.
* ``var_scale`` 0.1, ``swag_stepsize`` 1.0: ``utils/options.py``; variance floor 1e-5:
  ``swag.py: SWAG_server(var_clamp=1e-5)`` (its second clamp at 1e-6 is then inactive).
* ``use_clients`` True: ``run.sh`` passes ``--use_client``; w̄ is a teacher unless
  ``--dont_add_fedavg`` (not passed).
* ``temperature`` T = 0.5: ``utils/options.py --temp`` (with ``--loss_type KL``).
* ``server_epochs`` 20: ``--server_ep`` (``run.sh``); ``server_batch_size`` 128: ``--server_bs``.
* ``server_lr`` 1e-3, ``server_momentum`` 0.9, ``server_weight_decay`` 1e-5: hard-coded in
  ``models/Update.py: ServerUpdate.set_opt`` (the ``--server_lr`` option, 0.01, is not read).
* ``swa_start`` 500, ``swa_freq`` 25: ``ServerUpdate.set_opt`` (torchcontrib ``SWA(swa_start=500,
  swa_freq=25, swa_lr=None)``: the learning rate stays constant; the running average takes the
  weights after optimizer step s, counted from 1, when ``s > swa_start`` and
  ``s % swa_freq == 0``).

Deviations from the FedBE code, each a choice of ours:

* **Short distillations.** FedBE's default U (10 000 CIFAR-10 images) gives S = 20 · ⌈10 000/128⌉
  = 1 580 server steps per round, so the average covers steps 525..1 575 (43 snapshots). With
  fewer than ``swa_start + swa_freq`` steps torchcontrib averages nothing and FedBE silently
  sends the plain student. We instead stretch FedBE's schedule to the S steps of the run:
  ``start = ⌊swa_start_share · S⌋`` and ``freq = max(1, ⌊swa_freq · S · swa_start_share /
  swa_start⌋)`` with ``swa_start_share = 500 / 1580`` (the share of FedBE's own run spent before
  averaging), so at least one snapshot is always averaged (:func:`swa_schedule`).
* **BatchNorm.** FedBE samples every float tensor, running statistics included, which can give
  a sample a negative running variance. We sample the parameters only; a sample's buffers (BN
  running mean and variance) are w̄'s. The student trains in ``train()`` mode (its running
  statistics follow U), and the SWA student's BN statistics are recomputed on U with
  ``torch.optim.swa_utils.update_bn``, as FedBE's ``bn_update`` does for its ResNets (a no-op for
  models without BatchNorm).
* **Zero updates.** FedBE divides by ||Δ_k|| unguarded (NaN for a tensor a client did not
  change); we take ``u_k = 0`` there. Frozen tensors (``params.freeze``) are never sampled or
  trained.
* **The loss** is computed from ``log_softmax`` (FedBE: ``softmax(...).log()``), the same value
  without the underflow.
* **Clients** run FedAvg's local SGD with the config's shared settings (parity with the other
  methods); FedBE's clients use momentum 0.9 and weight decay 2e-4 / 1e-3
  (``method.fedbe.momentum=0.9``, ``method.fedbe.weight_decay=...`` reproduce them).

Server state: ``model.*`` (w^t, as FedAvg), ``server.unlabeled`` (U's inputs ``[n_U, ...]``,
checkpointed with the state and never broadcast) and the value ``fedbe.seed`` (drawn from
``init_server``'s rng; the round's generator is ``derive_seed(fedbe.seed, round)``, so a resumed
run draws what an uninterrupted one does). The server-side model workspace is a deep copy of the
model given to ``init_server``; every tensor is loaded into it before each use.

Server metrics in each round's row: ``server_teachers`` (ensemble size: teachers with finite
predictions on U), ``server_bad_teachers`` (left out for non-finite predictions; when every
teacher is, the round keeps w̄ and logs a warning), ``server_skipped_steps`` (distillation
steps with a non-finite loss, also logged), ``server_teacher_agreement`` (mean share of U on
which a teacher's argmax equals the ensemble's), ``server_kl_fedavg`` and ``server_kl_student``
(KL(pseudo-labels || model) in nats per example, mean over U, of w̄ and of the broadcast
student), ``server_distill_loss`` (FedBE's training loss, mean over the last epoch's steps),
``server_steps`` (S) and ``server_swa_models`` (snapshots averaged).

Costs: bytes up and down are FedAvg's (the weights). The server runs ``1 + M + K`` forward passes
over U, ``S`` SGD steps, and keeps U in its checkpoint.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

from fedlore.algorithms.fedavg import FedAvg
from fedlore.registry import register_algorithm
from fedlore.seeding import derive_seed
from fedlore.tensors import load_model_arrays, model_arrays, select, with_prefix
from fedlore.train.local import predictive_log_probs
from fedlore.types import Arrays, Reply, Scalars, State

log = logging.getLogger(__name__)

UNLABELED_KEY = "server.unlabeled"
"""Server-state key of U's inputs (never broadcast: :meth:`DenseServer.broadcast` sends
``model.*`` only)."""
SEED_KEY = "fedbe.seed"
"""Server-state value: the seed of the server's per-round generators."""

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


@register_algorithm("fedbe")
@dataclass(frozen=True)
class FedBE(FedAvg):
    """FedBE: FedAvg clients; the server distils {w̄, M Gaussian samples, client models} on U
    into an SWA student that starts at w̄ (module docstring: steps, defaults, deviations).

    Needs the server's unlabeled set U (``needs_server_data``; config ``data.server_fraction``).

    Attributes (besides :class:`FedAvg`'s, which the clients use):
        num_samples: M, Gaussian samples per round (≥ 0).
        var_scale: scale of the sampled deviation from the mean direction (≥ 0).
        swag_stepsize: scale of the sampled step, in units of the mean update norm (≥ 0).
        use_clients: the client models are teachers too.
        temperature: T of the pseudo-label sharpening (> 0).
        server_epochs, server_batch_size: passes over U and examples per server step.
        server_lr, server_momentum, server_weight_decay: the student's SGD.
        swa: broadcast the SWA average (else the last SGD iterate).
        swa_start, swa_freq, swa_start_share: the SWA schedule (:func:`swa_schedule`).
    """

    supports_regression: ClassVar[bool] = False  # pseudo-labels are class probabilities
    name: ClassVar[str] = "fedbe"
    individual_uploads: ClassVar[str] = (
        "its server fits a Gaussian to the clients' norm-scaled updates Δ_k / ||Δ_k|| and "
        "distils an ensemble whose teachers include each client's own model w^t + Δ_k (FedBE's "
        "Bayesian model ensemble)"
    )
    needs_server_data: ClassVar[bool] = True
    num_samples: int = 10
    var_scale: float = 0.1
    swag_stepsize: float = 1.0
    use_clients: bool = True
    temperature: float = 0.5
    server_epochs: int = 20
    server_batch_size: int = 128
    server_lr: float = 1e-3
    server_momentum: float = 0.9
    server_weight_decay: float = 1e-5
    swa: bool = True
    swa_start: int = 500
    swa_freq: int = 25
    swa_start_share: float = FEDBE_SWA_START_SHARE

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "num_samples": self.num_samples >= 0,
            "var_scale": self.var_scale >= 0,
            "swag_stepsize": self.swag_stepsize >= 0,
            "temperature": self.temperature > 0,
            "server_epochs": self.server_epochs >= 1,
            "server_batch_size": self.server_batch_size >= 1,
            "server_lr": self.server_lr > 0,
            "server_momentum": 0 <= self.server_momentum < 1,
            "server_weight_decay": self.server_weight_decay >= 0,
            "swa_start": self.swa_start >= 0,
            "swa_freq": self.swa_freq >= 1,
            "swa_start_share": 0 < self.swa_start_share < 1,
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"FedBE: invalid {field}={getattr(self, field)!r}")

    def init_server(
        self, model: nn.Module, rng: torch.Generator, unlabeled: torch.Tensor | None = None
    ) -> State:
        """FedAvg's state plus U (``server.unlabeled``) and the server seed (``fedbe.seed``);
        keeps a deep copy of ``model`` as the server's workspace.

        Args:
            model: the initial model (copied, not kept).
            rng: draws ``fedbe.seed``.
            unlabeled: U's inputs ``[n_U, ...]`` (n_U ≥ 1).

        Raises:
            ValueError: without U (naming ``data.server_fraction``), or from ``params.freeze``.
        """
        if unlabeled is None or len(unlabeled) == 0:
            raise ValueError(
                "FedBE distils on the server's unlabeled set U, and none was given: set "
                "data.server_fraction > 0 (run.start_server passes it as init_server(..., "
                "unlabeled=U))"
            )
        state = super().init_server(model, rng)
        object.__setattr__(self, "_workspace", copy.deepcopy(model))
        device = next(iter(state.arrays.values())).device  # the server's model's
        arrays = {**state.arrays, UNLABELED_KEY: unlabeled.detach().to(device).contiguous().clone()}
        seed = int(torch.randint(0, 2**32, (1,), generator=rng))
        return State(arrays=arrays, values={**state.values, SEED_KEY: seed})

    def workspace(self) -> nn.Module:
        """The server's scratch model (a copy of the model given to ``init_server``).

        Raises:
            RuntimeError: when ``init_server`` was never called on this object.
        """
        ws: nn.Module | None = getattr(self, "_workspace", None)
        if ws is None:
            raise RuntimeError("FedBE.aggregate needs init_server to run first on this object")
        return ws

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        """FedAvg, then the Bayesian-ensemble distillation on U (module docstring).

        With no accepted reply the state is FedAvg's (unchanged model); U and the seed are kept.
        """
        fedavg, metrics = super().aggregate(state, replies, rnd)
        keep = {UNLABELED_KEY: state.arrays[UNLABELED_KEY]}
        ok = [r for _, r in replies if r is not None]
        if not ok:
            return State({**fedavg.arrays, **keep}, fedavg.values), metrics
        ws = self.workspace()
        self.set_frozen(ws)
        base = select(state.arrays, "model.")
        wbar = select(fedavg.arrays, "model.")
        clients = []
        for r in ok:
            upd = select(r.arrays, "update.")
            clients.append({k: v + upd[k].to(v.dtype) if k in upd else v for k, v in base.items()})
        names = [n for n, p in ws.named_parameters() if not self.is_frozen(n)]
        g = torch.Generator().manual_seed(derive_seed(int(state.values[SEED_KEY]), rnd))
        samples = gaussian_samples(
            base, clients, names, self.num_samples, self.var_scale, self.swag_stepsize, g
        )
        teachers = [wbar, *({**wbar, **s} for s in samples)]
        if self.use_clients:
            teachers += clients
        x = state.arrays[UNLABELED_KEY]
        mean, votes = ensemble_probs(ws, teachers, x)
        if mean is None:  # every teacher diverged: nothing to distil, broadcast w̄
            log.warning("fedbe round %d: no teacher has finite predictions on U; FedAvg kept", rnd)
            return State({**fedavg.arrays, **keep}, fedavg.values), {
                **metrics,
                "server_teachers": 0,
                "server_bad_teachers": len(teachers),
            }
        targets = sharpen(mean, self.temperature)
        load_model_arrays(ws, wbar)
        kl_fedavg = kl_per_example(ws, x, targets)
        out = distill(ws, wbar, x, targets, generator=g, **self._distill_kwargs())
        load_model_arrays(ws, out.arrays)
        if out.skipped:
            log.warning(
                "fedbe round %d: %d of %d distillation steps skipped (non-finite loss)",
                rnd,
                out.skipped,
                out.steps,
            )
        extra: dict[str, Any] = {
            "server_teachers": len(votes),
            "server_bad_teachers": len(teachers) - len(votes),
            "server_skipped_steps": out.skipped,
            "server_teacher_agreement": float((votes == mean.argmax(-1)).float().mean()),
            "server_kl_fedavg": kl_fedavg,
            "server_kl_student": kl_per_example(ws, x, targets),
            "server_distill_loss": out.loss,
            "server_steps": out.steps,
            "server_swa_models": out.swa_models,
        }
        model = {k: out.arrays[k].to(v.dtype) for k, v in wbar.items()}
        arrays = {**fedavg.arrays, **with_prefix(model, "model."), **keep}
        return State(arrays, fedavg.values), {**metrics, **extra}

    def _distill_kwargs(self) -> dict[str, Any]:
        return {
            "epochs": self.server_epochs,
            "batch_size": self.server_batch_size,
            "lr": self.server_lr,
            "momentum": self.server_momentum,
            "weight_decay": self.server_weight_decay,
            "swa": self.swa,
            "swa_start": self.swa_start,
            "swa_freq": self.swa_freq,
            "swa_start_share": self.swa_start_share,
        }
