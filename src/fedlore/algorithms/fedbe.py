"""FedBE (Chen & Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated Learning",
ICLR 2021): FedAvg clients, a server that distils a Bayesian model ensemble on unlabeled data.

Clients are :class:`~fedlore.algorithms.fedavg.FedAvg`'s (local SGD, upload ``update.*``). One
server step at round t, from the global weights w^t and the accepted clients' models
``w_k = w^t + Δ_k`` (reference notes Part 13; hongyouc/FedBE ``main.py``):

1. **FedAvg**: ``w̄ = w^t + Σ p_k Δ_k / Σ p_k``
   (:class:`~fedlore.algorithms.dense.DenseServer`'s aggregate).
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

This module holds the method (its state, settings and the round's order of steps); the sampler,
the pseudo-labels and the distillation it composes are in :mod:`fedlore.algorithms.fedbe_ensemble`
(their names are importable from here too).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.algorithms.fedbe_ensemble import (
    FEDBE_SWA_START_SHARE,
    SHARPEN_FLOOR,
    TEACHER_BATCH,
    VAR_CLAMP,
    DistillResult,
    distill,
    ensemble_probs,
    fedbe_kl,
    gaussian_samples,
    kl_per_example,
    sharpen,
    swa_schedule,
    update_stats,
)
from fedlore.registry import register_algorithm
from fedlore.seeding import derive_seed
from fedlore.tensors import load_model_arrays, select, with_prefix
from fedlore.types import Reply, Scalars, State

__all__ = [
    "FEDBE_SWA_START_SHARE",
    "SEED_KEY",
    "SHARPEN_FLOOR",
    "TEACHER_BATCH",
    "UNLABELED_KEY",
    "VAR_CLAMP",
    "DistillResult",
    "FedBE",
    "distill",
    "ensemble_probs",
    "fedbe_kl",
    "gaussian_samples",
    "kl_per_example",
    "sharpen",
    "swa_schedule",
    "update_stats",
]

log = logging.getLogger(__name__)

UNLABELED_KEY = "server.unlabeled"
"""Server-state key of U's inputs (never broadcast:
:meth:`~fedlore.algorithms.dense.DenseServer.broadcast` sends ``model.*`` only)."""
SEED_KEY = "fedbe.seed"
"""Server-state value: the seed of the server's per-round generators."""


@register_algorithm("fedbe")
@dataclass(frozen=True)
class FedBE(FedAvg):
    """FedBE: FedAvg clients; the server distils {w̄, M Gaussian samples, client models} on U
    into an SWA student that starts at w̄ (module docstring: steps, defaults, deviations).

    Needs the server's unlabeled set U (``server_data``; config ``data.server_fraction``).

    Hyperparameters beyond :class:`FedAvg`'s (which the clients use); the defaults are
    hongyouc/FedBE's (module docstring).

    Attributes:
        local_optimizer: the clients' local optimizer (FedAvg's; default ``"sgd"``).
        momentum: the clients' SGD momentum (FedAvg's; default 0 for parity with the other
            methods, FedBE's clients use 0.9).
        num_samples: M ≥ 0, global models sampled per round from the Gaussian over the clients'
            normalised updates (:func:`gaussian_samples`); each is a teacher (default 10,
            ``--num_sample_teacher``).
        var_scale: ≥ 0, scale of the sampled deviation ``sqrt(var) · ε`` added to the mean
            direction ū (0: every sample is ``w^t + swag_stepsize · n̄ · ū``; default 0.1).
        swag_stepsize: ≥ 0, length of a sample's step from ``w^t``, in units of the clients'
            mean update norm n̄ = mean_k ``||Δ_k||₂`` (default 1).
        use_clients: the accepted clients' models ``w^t + Δ_k`` are teachers too (default true,
            ``--use_client``).
        temperature: T > 0 of the pseudo-label sharpening ``p^(1/T)`` (T < 1 sharpens; default
            0.5, ``--temp``).
        server_epochs: passes of the student over U per round (≥ 1; default 20,
            ``--server_ep``).
        server_batch_size: examples of U per distillation step (≥ 1; the last batch of an epoch
            is partial; default 128, ``--server_bs``).
        server_lr: the student's SGD step size, constant over the distillation (> 0; default
            1e-3, hard-coded in FedBE's ``ServerUpdate.set_opt``, as are the next two).
        server_momentum: the student's SGD momentum, in [0, 1) (default 0.9).
        server_weight_decay: the student's SGD L2 weight decay (≥ 0; default 1e-5).
        swa: broadcast the stochastic-weight average of the student's iterates, with BatchNorm
            statistics recomputed on U (false: the last SGD iterate; default true,
            ``--use_SWA``).
        swa_start: optimizer steps before the average starts: it takes the weights after step
            s (counted from 1) when ``s > swa_start`` and ``s % swa_freq == 0`` (default 500);
            a distillation shorter than ``swa_start + swa_freq`` steps stretches the schedule
            (:func:`swa_schedule`).
        swa_freq: steps between two snapshots of the average (≥ 1; default 25).
        swa_start_share: the share of a short distillation's steps spent before averaging, in
            (0, 1) (default 500 / 1580, FedBE's own run: :data:`FEDBE_SWA_START_SHARE`).
    """

    # regression=False: the pseudo-labels are class probabilities
    capabilities = replace(
        FedAvg.capabilities,
        synchronous_only=(
            "its server distils the round's client models into the current global "
            "model, not a mean of deltas"
        ),
        compress_uploads=False,
        sum_aggregable=False,
        transport_16bit=False,
        server_optimizer=False,  # its server distils after averaging: it has its own optimizer
        individual_uploads=(
            "its server fits a Gaussian to the clients' norm-scaled updates Δ_k / ||Δ_k|| and "
            "distils an ensemble whose teachers include each client's own model w^t + Δ_k (FedBE's "
            "Bayesian model ensemble)"
        ),
        server_data=True,
        regression=False,
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    name: ClassVar[str] = "fedbe"
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
                "data.server_fraction > 0 (experiment_parts.start_server passes it as "
                "init_server(..., unlabeled=U))"
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
