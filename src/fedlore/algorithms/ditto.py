"""Ditto (Li, Hu, Beirami, Smith, ICML 2021): FedAvg plus a personal model per client.

Composition: the global model trains exactly as :class:`~fedlore.algorithms.fedavg.FedAvg`
(local SGD from the received ``w^t``, upload ``Δ_k = w_k - w^t``, server ``w + Σ p_k Δ_k``);
then the client's personal model ``v_k`` takes ``personal_steps`` SGD steps on
``F_k(v) + (lam / 2) ||v - w^t||²`` (Ditto Eq. 2, Algorithm 1 line 7), the proximal term of
:func:`~fedlore.algorithms.personal.prox_term` anchored at the **received** ``w^t`` (reference
notes Part 8.5: never at the client's trained ``w_k``), on the same minibatches as the global
steps (litian96/ditto ``flearn/trainers_MTL/ditto.py`` takes one batch for both updates).

``v_k`` lives in the client state under ``personal.*`` and changes only in rounds the client
takes part in; a client's first contact starts it at the received global model (the official
code starts every ``v_k`` at ``w^0``; a client first sampled later starts at that round's
global model here). P-local scores ``v_k`` (reference notes Part 8.4).

Defaults: ``lam = 1`` (litian96/ditto ``run_fashion_clean_ditto_lam1.sh``, the Fashion-MNIST
run; FL-bench's default too); PFLlib's default 0 turns Ditto into local training and is refused.
The official code averages the Δ_k uniformly over clients sampled with probability ∝ n_k; this
library samples uniformly and weights by n_k (``weighting``), the same expectation.

Bytes per round: a dense model down and a dense delta up, as FedAvg; the client additionally
stores one model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from fedlore.algorithm import ASYNC_UNTESTED
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.algorithms.personal import Personalized, keep_personal, personal_arrays, prox_term
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import load_model_arrays, select
from fedlore.train.local import Schedule, local_train
from fedlore.types import Broadcast, Reply, Scalars, State


@register_algorithm("ditto")
@dataclass(frozen=True)
class Ditto(Personalized, FedAvg):
    """Ditto (module docstring). Hyperparameters beyond FedAvg's:

    Attributes:
        lam: lambda of the personal objective's proximal term (> 0; default 1).
        personal_steps: SGD steps of ``v_k`` per round (None: ``local_steps``, Ditto's
            interleaved update takes one per global step).
        personal_lr: step size of ``v_k`` (None: the global ``lr``, as in the official code).
        local_optimizer: the optimizer of the global model's local steps (FedAvg's, default
            ``"sgd"``); the personal model's steps are always plain SGD.
        momentum: SGD momentum of the global model's local steps (``local_optimizer="sgd"``
            only; 0: plain SGD).
    """

    name: ClassVar[str] = "ditto"
    capabilities = replace(
        FedAvg.capabilities,
        synchronous_only=ASYNC_UNTESTED,
        compress_uploads=False,
        sum_aggregable=False,
        transport_16bit=False,
        individual_uploads=(
            "its server only adds the weighted mean of the FedAvg deltas (linear in the uploads; "
            "the personal models v_k stay on the clients), but Ditto is not yet offered under "
            "secure aggregation and DP (no test covers it there)"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    lam: float = 1.0
    personal_steps: int | None = None
    personal_lr: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.lam > 0:
            raise ValueError(f"ditto: lam must be > 0 (lam = 0 is local training), got {self.lam}")
        if self.personal_steps is not None and self.personal_steps < 1:
            raise ValueError(f"ditto: personal_steps must be >= 1, got {self.personal_steps}")
        if self.personal_lr is not None and not self.personal_lr > 0:
            raise ValueError(f"ditto: personal_lr must be > 0, got {self.personal_lr}")

    def trained_model_metrics(self, model: nn.Module, data: ClientData, rnd: int) -> Scalars:
        """None for the global side: Ditto's P-local is the personal ``v_k`` (scored below)."""
        return {}

    def round_work(self, num_examples: int, steps: int) -> int:
        """``steps`` of the global model and the personal model's ``personal_steps`` (all of
        them: a straggler's budget cuts the global steps only)."""
        return steps + (self.personal_steps or self.local_steps(num_examples))

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """The FedAvg update of ``w``, then ``personal_steps`` proximal steps of ``v_k``.

        Returns:
            (FedAvg's reply plus ``personal_loss`` and P-local of ``v_k`` in the last round,
            the client state with ``personal.*`` = the new ``v_k``).
        """
        same_batches = torch.Generator().set_state(rng.get_state())
        reply, keep = super().client_update(msg, state, model, data, rng)
        rnd = int(msg.config["round"])
        received = self.fill_frozen(select(msg.arrays, "model."), state, model)
        v = personal_arrays(state) or received
        load_model_arrays(model, v)
        self.set_frozen(model)
        steps = self.personal_steps or self.local_steps(data.num_examples)
        scale = (self.personal_lr or self.train.lr) / self.train.lr
        # v's steps follow the schedule over the run's rounds x personal_steps: placed on the
        # global steps' schedule (rounds x K), personal_steps above K would run past its end
        # (rate min_lr_ratio, 0 under cosine by default) halfway through the run
        t = self.train
        personal = Schedule(t.lr, t.schedule, t.rounds * steps, t.min_lr_ratio)
        base = personal.round_lrs(max(rnd, 0), steps)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=self.train.lr)
        t0 = time.perf_counter()
        stats = local_train(
            model,
            data.batches(self.train.batch_size, steps, same_batches, rnd),
            opt,
            [scale * lr for lr in base],
            loss_terms=[prox_term(received, self.lam)],
            grad_clip=self.train.grad_clip,
        )
        personal_s = time.perf_counter() - t0
        new = State(arrays={**keep.arrays, **keep_personal(model)}, values=dict(keep.values))
        metrics = {
            **reply.metrics,
            "personal_loss": stats.mean_loss,
            "train_s": float(reply.metrics.get("train_s", 0.0)) + personal_s,
            **self.personal_eval_metrics(new, model, data, rnd),
        }
        return Reply(arrays=reply.arrays, metrics=metrics), new
