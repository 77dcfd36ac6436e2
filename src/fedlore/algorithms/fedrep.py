"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for
Personalized Federated Learning", ICML 2021, Algorithm 1; official code ``lgcollins/FedRep``,
``models/Update.py`` ``LocalUpdate.train``): FedPer's split of the model, the head (``head.*``)
kept on each client and the body, the representation φ, federated; but the client trains the two
one after the other instead of jointly.

A round of client i (Algorithm 1), on :class:`~fedlore.algorithms.partial.PartialFedAvg`'s
bookkeeping (the whole model at a client's first contact, the body afterwards; the client's own
head laid over what it receives; ``expected_reply`` the body's tensors only):

* **head**: τ_h steps on the head with the body frozen at the received φ^t, from the client's
  own head h_i (the received initialization at first contact);
* **body**: then τ_b steps on the body from φ^t with the new head frozen;
* **upload** ``update.* = φ_i - φ^t`` (the body only) and keep h_i (``personal.head.*``);
* **server**: ``φ^{t+1} = φ^t + Σ p_i Δ_i / Σ p_i``, FedAvg's mean of the body, as FedPer's.

τ_h and τ_b. A FedRep round is the run's local work, as every method's: K = ``local_steps`` SGD
steps, or under ``local_epochs`` E passes, ``E⌈n_i/B⌉`` steps for a client of n_i examples, on
the same minibatches in the same order at the same learning rates. FedRep splits it: the first
τ_h steps train the head, the last τ_b the body, ``τ_h + τ_b = K``. This is the official code's
shape: ``local_ep`` epochs in all, the first ``local_ep - local_rep_ep`` on the head, the last
``local_rep_ep`` on the representation; its scripts run ``local_ep 11``, ``local_rep_ep 1`` on
CIFAR (the paper's 10 epochs of the head and 1 of the body) and 15 / 5 on FEMNIST.

* under ``local_epochs`` E: ``τ_b = body_epochs ⌈n_i/B⌉`` (default ``body_epochs`` 1, the
  authors' ``local_rep_ep``), ``τ_h = (E - body_epochs)⌈n_i/B⌉``; ``local_epochs=11`` is the
  paper's round. Refused unless ``body_epochs < E`` (the head needs an epoch).
* under ``local_steps`` K: ``τ_b = body_steps`` (default ``⌈K / 11⌉``, the body's 1 in the
  authors' 11), ``τ_h = K - τ_b``. Refused unless ``body_steps < K``: ``local_steps=1`` leaves
  no step for one of the two.

Setting the count of the other unit (``body_epochs`` under ``local_steps``, ``body_steps`` under
``local_epochs``) is refused, naming the one to set. A straggler's partial work
(``clients.partial_work``) ends its round early: the head's steps come first, so it uploads a
body that moved less, or not at all.

Each phase has a fresh local optimizer (FedAvg's, SGD by default) over the tensors it trains,
and starts by dropping the gradients of the tensors it does not train (the head's last one
would otherwise stay beside the body's, seen by a gradient hook of the body's steps).
The official code keeps one SGD over all the parameters; with gradients set to None between
steps (torch 2's ``zero_grad``) that is the same optimizer, each parameter being stepped in its
own phase only. (Under the torch 1 of the time ``zero_grad`` zeroed the frozen part's gradients
instead, so as we read it the frozen head still moved by momentum and weight decay during the
body's epochs; fedlore does not repeat that.) The model stays in training mode in both phases,
as in the official code, so the body's BatchNorm statistics also move during the head's steps
(they are the body's: uploaded).
fedlore keeps the run's optimizer settings (SGD at the run's lr, momentum 0, no weight decay by
default; the official code's SGD has momentum 0.5 and weight decay 1e-4) so that FedRep gets the
same optimizer as the FedAvg it is compared with. The official code's last round trains the head
alone for ``max(10, local_ep - local_rep_ep)`` epochs before scoring; fedlore's P-local scores
the model each client has just trained in the run's last round, as for FedPer.

Scores, bytes and the global model are FedPer's (:mod:`fedlore.algorithms.partial`): the global
model holds the server's initial head (``keeps_layers_local``), P-local (``eval.local``) is the
method's score; up the body, down the whole model at first contact and the body afterwards; the
client keeps its head in its state. So is its privacy: under secure aggregation, central and local
DP only the body's increment is masked, clipped and noised; the head never leaves the client, and
the two phases' losses stay inside ``train_loss``, which those modes do not send.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from fedlore.algorithms.base import reply_metrics
from fedlore.algorithms.fedavg import optimizer_state_bytes
from fedlore.algorithms.partial import FedPer
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.settings import steps_for_epochs
from fedlore.train.local import GradHook, LossTerm, TrainStats, local_train
from fedlore.types import Broadcast, Reply

PAPER_ROUND = 11
"""The authors' round in epochs: 10 of the head, then 1 of the body (``local_ep 11``,
``local_rep_ep 1``); under ``local_steps`` the body's default share is 1 step in 11."""


@register_algorithm("fedrep")
@dataclass(frozen=True)
class FedRep(FedPer):
    """FedRep (Collins et al., ICML 2021): FedPer's split, the head trained first with the body
    frozen, then the body with the head frozen; only the body is uploaded (module docstring).

    Attributes:
        personal_layers: glob patterns (``fnmatch.fnmatchcase``) over the model's ``state_dict``
            names of the head each client keeps (default ``["head.*"]``, the classifier, as
            FedPer's); every other tensor is the federated body.
        body_steps: τ_b under ``local_steps`` K: the round's last ``body_steps`` steps train the
            body, the first ``K - body_steps`` the head; None (default): ``⌈K / 11⌉``, the
            body's 1 epoch in the authors' 11. At least 1, below K; refused under
            ``local_epochs``.
        body_epochs: τ_b under ``local_epochs`` E, in passes over the client's data: the round's
            last ``body_epochs ⌈n/B⌉`` steps train the body, the first
            ``(E - body_epochs) ⌈n/B⌉`` the head; None (default): 1, the authors'
            ``local_rep_ep``. At least 1, below E; refused under ``local_steps``.
        local_optimizer: the local optimizer of each phase, fresh per phase (default ``"sgd"``,
            as FedAvg's and the authors').
        momentum: SGD momentum of the local steps (0: plain SGD).
    """

    name: ClassVar[str] = "fedrep"
    # capabilities: FedPer's (the body's increments, averaged; sum-aggregable)
    body_steps: int | None = None
    body_epochs: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("body_steps", "body_epochs"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"fedrep: {key} must be >= 1 (the body trains), got {value!r}")
        t = self.train
        if t.local_steps is not None:
            if self.body_epochs is not None:
                raise ValueError(
                    f"fedrep: body_epochs={self.body_epochs} counts passes over a client's data, "
                    f"read under local_epochs; this run sizes its rounds by local_steps="
                    f"{t.local_steps}: set method.fedrep.body_steps instead (the steps of the "
                    "round that train the body; default ceil(local_steps / 11))"
                )
            body = self.body_share(t.local_steps)
            if body >= t.local_steps:
                raise ValueError(
                    f"fedrep: local_steps={t.local_steps} with body_steps={body} leaves no step "
                    "for the head (a round trains the head for its first local_steps - "
                    "body_steps steps, then the body for the last body_steps): use "
                    "local_steps >= 2 and body_steps < local_steps"
                )
            return
        assert t.local_epochs is not None  # the settings hold one of the two
        if self.body_steps is not None:
            raise ValueError(
                f"fedrep: body_steps={self.body_steps} counts steps, read under local_steps; "
                f"this run sizes its rounds by local_epochs={t.local_epochs}: set "
                "method.fedrep.body_epochs instead (the passes of the round that train the "
                "body; default 1)"
            )
        epochs = self.body_epochs or 1
        if epochs >= t.local_epochs:
            raise ValueError(
                f"fedrep: local_epochs={t.local_epochs} with body_epochs={epochs} leaves no "
                "epoch for the head (a round trains the head for its first local_epochs - "
                "body_epochs passes, then the body for the last body_epochs; the authors' round "
                f"is local_epochs={PAPER_ROUND}, body_epochs=1): use local_epochs > body_epochs"
            )

    def body_share(self, local_steps: int) -> int:
        """τ_b under ``local_steps`` K: ``body_steps``, or ``⌈K / 11⌉`` by default."""
        return self.body_steps if self.body_steps is not None else math.ceil(local_steps / 11)

    def phases(self, num_examples: int) -> tuple[int, int]:
        """(τ_h, τ_b): the head's and the body's steps in a round of a client of
        ``num_examples`` training examples (module docstring); ``τ_h + τ_b = K``."""
        t = self.train
        if t.local_steps is not None:
            body = self.body_share(t.local_steps)
            return t.local_steps - body, body
        assert t.local_epochs is not None
        per_epoch = steps_for_epochs(1, num_examples, t.batch_size)
        body = (self.body_epochs or 1) * per_epoch
        return t.local_epochs * per_epoch - body, body

    def train_locally(
        self,
        msg: Broadcast,
        start: dict[str, torch.Tensor],
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
        terms: list[LossTerm],
        on_grad: Sequence[GradHook] = (),
    ) -> tuple[Reply, list[float]]:
        """The round's K steps on its K minibatches, the first τ_h on the head (body frozen),
        the last τ_b on the body (head frozen), each phase with a fresh optimizer; the reply
        (``update.*`` of the body, FedAvg's metrics over both phases) and the round's step
        sizes. A straggler's shorter round (``STEP_BUDGET``) cuts the body's steps first."""
        rnd = int(msg.config["round"])
        lrs = self.round_lrs(rnd, data.num_examples)
        head_steps = min(self.phases(data.num_examples)[0], len(lrs))
        head = set(self.local_names(model))
        batches = iter(data.batches(self.train.batch_size, len(lrs), rng, rnd))
        stats: list[TrainStats] = []
        state_bytes = 0
        t0 = time.perf_counter()
        for trains_head, rates in ((True, lrs[:head_steps]), (False, lrs[head_steps:])):
            for name, p in model.named_parameters():
                trains = (name in head) == trains_head and not self.is_frozen(name)
                p.requires_grad_(trains)
                if not trains:  # the head's last gradient is none of the body's steps'
                    p.grad = None
            if not rates:
                continue
            opt = self.make_optimizer(model)
            stats.append(
                local_train(model, batches, opt, rates, loss_terms=terms, on_grad=on_grad,
                            grad_clip=self.train.grad_clip)
            )  # fmt: skip
            state_bytes = max(state_bytes, optimizer_state_bytes(opt))
        train_s = time.perf_counter() - t0
        self.set_frozen(model)
        done = [(s.mean_loss, s.steps - s.skipped_steps) for s in stats]
        finite = sum(n for _, n in done)
        metrics = reply_metrics(
            data.num_examples,
            train_loss=sum(m * n for m, n in done if n) / finite if finite else float("nan"),
            skipped_steps=sum(s.skipped_steps for s in stats),
            optimizer_state_bytes=state_bytes,
            train_s=train_s,
            **self.trained_model_metrics(model, data, rnd),
        )
        return Reply(arrays=self.dense_update(model, start), metrics=metrics), lrs
