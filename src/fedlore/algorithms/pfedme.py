"""pFedMe (T. Dinh, Tran, Nguyen, NeurIPS 2020): personalization with Moreau envelopes.

Client i keeps a local copy ``w_i`` (started at the received ``w^t``) and a personalized model
``theta``. Each of the round's ``local_steps`` = R iterations draws **one** minibatch b and

1. approximately solves ``theta_hat(w_i) = argmin_theta f_i(theta; b) + (lam / 2) ||theta - w_i||²``
   by ``inner_steps`` = K SGD steps of size ``personal_lr`` (pFedMe Eq. 7; the shared
   :func:`~fedlore.train.local.local_train` with the proximal term of
   :func:`~fedlore.algorithms.personal.prox_term` anchored at the current ``w_i``);
2. moves ``w_i <- w_i - lr · lam · (w_i - theta)`` (Algorithm 1 line 8).

The client uploads ``Δ_i = w_i - w^t``; the server mixes ``w^{t+1} = (1 - beta) w^t + beta ·
Σ p_i w_i`` (Algorithm 1 line 12), i.e. it steps ``beta · Σ p_i Δ_i``. ``theta`` starts each
round at ``w^t`` (CharlieDinh/pFedMe ``userpFedMe.py``: the broadcast overwrites it).

Personal state: a detached **copy** of ``theta`` after the round's last iteration is kept under
``personal.*`` and is what P-local scores. The official code's snapshot aliases the live
parameters and is overwritten by ``w_i`` before it is scored (reference notes Part 7.5; issue #5
of CharlieDinh/pFedMe); the copy avoids that.

Defaults (CharlieDinh/pFedMe ``README.md``, MNIST non-convex, and ``main.py``): ``lam = 15``,
``inner_steps = 5``, ``personal_lr = 0.09``, ``beta = 1``; the global step ``lr`` is the run's
common ``lr`` (the README uses 0.005). ``lr · lam`` and ``personal_lr · lam`` must stay below 2
(each update is then a contraction towards its proximal target; refused otherwise). The code's
extra L2 term ``mu · theta`` (mu = 1e-3, not in the paper) is ``l2`` (default 0, the paper's
objective). Unlike the official code, only the sampled clients train (every client computes in
every round there), so bytes and time are the ones of a real partial-participation federation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from fedlore.algorithm import ASYNC_UNTESTED
from fedlore.algorithms.base import reply_metrics
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.algorithms.personal import BetaMixing, Personalized, keep_personal, prox_term
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import load_model_arrays
from fedlore.train.local import local_train
from fedlore.types import Broadcast, Reply, State


@register_algorithm("pfedme")
@dataclass(frozen=True)
class PFedMe(BetaMixing, Personalized, FedAvg):
    """pFedMe (module docstring). Hyperparameters beyond FedAvg's (``lr`` is eta, the step of
    ``w_i``):

    Attributes:
        lam: lambda, the Moreau-envelope regularization (> 0; default 15).
        inner_steps: K, SGD steps on ``theta`` per minibatch (default 5).
        personal_lr: eta_p, their step size (default 0.09).
        beta: the server's mixing weight (> 0; 1 = plain averaging, the default; the README's
            tuned runs use 2).
        l2: the official code's extra ``l2 · ||theta||² / 2`` (default 0, the paper).
        local_optimizer: not read by pFedMe (inherited from FedAvg): ``theta``'s steps are
            plain SGD at ``personal_lr`` and ``w_i``'s update is Algorithm 1 line 8.
        momentum: not read by pFedMe (inherited from FedAvg; no step of pFedMe has momentum).
    """

    name: ClassVar[str] = "pfedme"
    capabilities = replace(
        FedAvg.capabilities,
        synchronous_only=ASYNC_UNTESTED,
        compress_uploads=False,
        sum_aggregable=False,
        transport_16bit=False,
        individual_uploads=(
            "its server only mixes w^t + beta · Σ p_i Δ_i (linear in the uploads; the personalized "
            "theta stays on the client), but pFedMe is not yet offered under "
            "secure aggregation and DP (no test covers it there)"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    lam: float = 15.0
    inner_steps: int = 5
    personal_lr: float = 0.09
    beta: float = 1.0
    l2: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "lam": self.lam > 0,
            "inner_steps": self.inner_steps >= 1,
            "personal_lr": self.personal_lr > 0,
            "beta": self.beta > 0,
            "l2": self.l2 >= 0,
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"pfedme: invalid {field}={getattr(self, field)!r}")
        # both updates contract towards their target only when step * lam < 2
        for what, step in (("lr", self.train.lr), ("personal_lr", self.personal_lr)):
            if step * self.lam >= 2.0:
                raise ValueError(
                    f"pfedme: {what} * lam = {step} * {self.lam} = {step * self.lam:g} >= 2: the "
                    f"{'w_i' if what == 'lr' else 'theta'} update overshoots its proximal target "
                    "and diverges; lower the step or lam (the sources keep it below 1)"
                )

    def round_work(self, num_examples: int, steps: int) -> int:
        """``inner_steps`` SGD steps on theta per local step (the step of w is no optimizer's:
        a closed-form move toward theta)."""
        return steps * self.inner_steps

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """R iterations of (K proximal steps on ``theta``, one step of ``w_i``); upload
        ``w_i - w^t``, keep a copy of ``theta``."""
        start, keep = self.dense_start(msg, state, model)
        rnd = int(msg.config["round"])
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        w = {k: v.clone() for k, v in start.items()}
        opt = torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=self.personal_lr
        )
        terms = []
        if self.l2 > 0:
            terms.append(prox_term({k: torch.zeros_like(v) for k, v in start.items()}, self.l2))
        lrs = self.round_lrs(rnd, data.num_examples)
        losses: list[float] = []
        skipped = 0
        t0 = time.perf_counter()
        for k, batch in enumerate(data.batches(self.train.batch_size, len(lrs), rng, rnd)):
            stats = local_train(
                model,
                [batch] * self.inner_steps,
                opt,
                [self.personal_lr * lrs[k] / self.train.lr] * self.inner_steps,
                loss_terms=[prox_term(w, self.lam), *terms],
                grad_clip=self.train.grad_clip,
            )
            skipped += stats.skipped_steps
            losses.append(stats.mean_loss)
            theta = model.state_dict()
            with torch.no_grad():
                for name in trained:
                    w[name] = w[name] - lrs[k] * self.lam * (w[name] - theta[name])
        train_s = time.perf_counter() - t0
        new = State(arrays={**keep.arrays, **keep_personal(model)}, values=dict(keep.values))
        personal = self.personal_eval_metrics(new, model, data, rnd)
        # the upload is w_i; buffers (BatchNorm statistics) come from theta
        load_model_arrays(model, {**model.state_dict(), **{k: w[k] for k in trained}})
        finite = [x for x in losses if x == x]
        metrics = reply_metrics(
            data.num_examples,
            train_loss=sum(finite) / len(finite) if finite else float("nan"),
            skipped_steps=skipped,
            train_s=train_s,
            **personal,
        )
        return Reply(arrays=self.dense_update(model, start), metrics=metrics), new
