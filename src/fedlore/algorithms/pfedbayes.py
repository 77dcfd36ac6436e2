"""pFedBayes (Zhang, Li, Li, Guo, Shao, ICML 2022): personalized FL by variational inference.

Every Linear/Conv2d is mean-field Gaussian (:func:`fedlore.bayes.bayesianize`). The server holds
the global posterior ``v = (mu, rho)``. Client i holds a **personal** posterior ``q_i``
(``personal.*`` in its state, persistent, started at ``v`` on first contact) and, for the
round, a local copy ``z_i`` of the global one, started at the received ``v^t``. Each of the
round's ``local_steps`` = R iterations draws one minibatch b and

1. takes ``inner_steps`` Adam steps on ``q_i`` minimising
   ``mean_b NLL(y | x, theta ~ q_i) + zeta · KL(q_i || sg(z_i)) / N_i`` (one reparameterized
   draw per step; the shared :func:`~fedlore.train.local.local_train` with a KL loss term);
2. takes one Adam step on ``z_i`` minimising ``zeta · KL(sg(q_i) || z_i) / N_i``.

``sg`` is stop-gradient: ``z`` is fixed in the personal step and ``q`` in the global step
(reference notes Part 10.5). The client uploads ``z_i - v^t``; the server mixes
``v^{t+1} = (1 - beta) v^t + beta · Σ p_i z_i``. Deterministic tensors of the model (norm
layers), which no KL moves, are copied from ``q_i`` into ``z_i`` before the upload.

Sources: no official code; the loop follows the two public reimplementations (AllenBeau/pFedBayes
``userpFedbayes.py``, BernieZhang15/PFL_framework ``clientpFedBayes.py``) as summarized in the
reference notes Part 10; the KL per example (``/ N_i``) follows PFL_framework, the batch-mean NLL
both. Defaults (AllenBeau ``README.md``, MNIST): ``zeta = 10``, ``rho_init = -2.5``,
``personal_lr`` = ``lr`` = 1e-3 with Adam, ``inner_steps = 5``, ``beta = 1`` (the
reimplementations average without mixing).

P-local scores ``q_i`` with the MC predictive; G-central/G-local score ``v``. Bytes: (mu, rho),
twice a deterministic model, each way.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithm import ASYNC_UNTESTED
from fedlore.algorithms.base import reply_metrics
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedFull, optimizer_state_bytes
from fedlore.algorithms.personal import BetaMixing, Personalized, keep_personal, personal_arrays
from fedlore.bayes import (
    ESTIMATORS,
    GaussianPrior,
    bayesianize,
    posterior_kl,
    sampling,
    seeded,
)
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import load_model_arrays
from fedlore.train.local import local_train
from fedlore.types import Broadcast, Reply, State


@register_algorithm("pfedbayes")
@dataclass(frozen=True)
class PFedBayes(BetaMixing, Personalized, FedFull):
    """pFedBayes (module docstring). ``lr`` is the step of ``z_i`` (Adam); hyperparameters
    beyond :class:`~fedlore.algorithms.base.Hyper`:

    Attributes:
        zeta: weight of the KL between personal and global posterior (> 0; default 10).
        inner_steps: personal steps per minibatch (default 5).
        personal_lr: step of ``q_i`` (None: ``lr``).
        beta: server mixing weight (> 0; default 1).
        rho_init: initial rho of the global posterior (sigma = softplus(-2.5) = 0.079).
        bnn_estimator: how the Linear layers sample, in training and in the MC predictive:
            ``"weights"`` (default: one weight draw per forward pass, as the pFedBayes
            reimplementations) or ``"local"`` (local reparameterization, Kingma, Salimans &
            Welling 2015; convolutions keep weight sampling; :class:`~fedlore.bayes.BayesLinear`).
        local_optimizer: the optimizer of both ``q_i``'s and ``z_i``'s steps, each a fresh one
            per round: ``"adamw"`` (Adam when ``weight_decay`` is 0, as the reimplementations)
            or ``"sgd"``.
        momentum: SGD momentum of those steps (``local_optimizer="sgd"`` only; 0: plain SGD).
    """

    name: ClassVar[str] = "pfedbayes"
    capabilities = replace(
        FedFull.capabilities,
        synchronous_only=ASYNC_UNTESTED,
        compress_uploads=False,
        sum_aggregable=False,
        transport_16bit=False,
        individual_uploads=(
            "its server only mixes the posterior deltas, v^t + beta · Σ p_i (z_i - v^t) (linear in "
            "the uploads; the personal posteriors q_i stay on the clients), but pFedBayes is not "
            "yet offered under secure aggregation and DP (no test covers it there)"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    zeta: float = 10.0
    inner_steps: int = 5
    personal_lr: float | None = None
    beta: float = 1.0
    rho_init: float = -2.5
    bnn_estimator: Literal["weights", "local"] = "weights"

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "zeta": self.zeta > 0,
            "inner_steps": self.inner_steps >= 1,
            "personal_lr": self.personal_lr is None or self.personal_lr > 0,
            "beta": self.beta > 0,
            "rho_init": math.isfinite(self.rho_init),
            "bnn_estimator": self.bnn_estimator in ESTIMATORS,
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"pfedbayes: invalid {field}={getattr(self, field)!r}")

    def round_work(self, num_examples: int, steps: int) -> int:
        """``inner_steps`` Adam steps on q_i and one on z_i per local step."""
        return steps * (self.inner_steps + 1)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Bayesianize the scratch model in place (idempotent; sampling by ``bnn_estimator``);
        the prior is unused (the KL is to the global posterior)."""
        return bayesianize(model, GaussianPrior(0.0, 1.0), self.rho_init, self.bnn_estimator)

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        """The global posterior ``v^0``: means = the initial weights, rho = ``rho_init``."""
        return super().init_server(self.prepare_model(model), rng)

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """R iterations of (K steps on ``q_i``, one step on ``z_i``); upload ``z_i - v^t``."""
        model = self.prepare_model(model)
        start, keep = self.dense_start(msg, state, model)
        z = copy.deepcopy(model)  # the local copy of the global posterior, at v^t
        load_model_arrays(model, personal_arrays(state) or start)  # q_i
        rnd = int(msg.config["round"])
        n = data.num_examples
        lrs = self.round_lrs(rnd, data.num_examples)
        scale = (self.personal_lr or self.train.lr) / self.train.lr
        opt_q = self.make_optimizer(model)
        opt_z = self.make_optimizer(z)
        zeta = self.zeta

        def kl_to_z(q: nn.Module) -> torch.Tensor:  # z has requires_grad off here: sg(z)
            return zeta * posterior_kl(q, z) / n

        losses: list[float] = []
        skipped = 0
        t0 = time.perf_counter()
        with seeded(rng), sampling(model, True):
            for k, batch in enumerate(data.batches(self.train.batch_size, len(lrs), rng, rnd)):
                z.requires_grad_(False)
                stats = local_train(
                    model,
                    [batch] * self.inner_steps,
                    opt_q,
                    [scale * lrs[k]] * self.inner_steps,
                    loss_terms=[kl_to_z],
                    grad_clip=self.train.grad_clip,
                )
                skipped += stats.skipped_steps
                losses.append(stats.mean_loss)
                z.requires_grad_(True)
                self.set_frozen(z)
                skipped += self.global_step(model, z, opt_z, lrs[k], n)
        train_s = time.perf_counter() - t0
        new = State(arrays={**keep.arrays, **keep_personal(model)}, values=dict(keep.values))
        personal = self.personal_eval_metrics(new, model, data, rnd)
        with torch.no_grad():  # deterministic tensors no KL moves follow q_i
            q_sd = model.state_dict()
            for name, t in z.state_dict().items():
                if not name.endswith(("_mu", "_rho")):
                    t.copy_(q_sd[name])
            kl = float(posterior_kl(model, z))
        finite = [x for x in losses if math.isfinite(x)]
        metrics = reply_metrics(
            n,
            train_loss=sum(finite) / len(finite) if finite else float("nan"),
            skipped_steps=skipped,
            kl=kl,
            optimizer_state_bytes=optimizer_state_bytes(opt_q) + optimizer_state_bytes(opt_z),
            train_s=train_s,
            **personal,
        )
        return Reply(arrays=self.dense_update(z, start), metrics=metrics), new

    def global_step(
        self, q: nn.Module, z: nn.Module, opt: torch.optim.Optimizer, lr: float, n: int
    ) -> int:
        """One step of ``z`` on ``zeta · KL(sg(q) || z) / n``; returns 1 if it was skipped
        (a non-finite loss or gradient), else 0."""
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        q.requires_grad_(False)
        try:
            loss = self.zeta * posterior_kl(q, z) / n
        finally:
            self.set_frozen(q)
        if not bool(torch.isfinite(loss)):
            return 1
        loss.backward()
        if not all(
            bool(torch.isfinite(p.grad).all()) for p in z.parameters() if p.grad is not None
        ):
            opt.zero_grad(set_to_none=True)
            return 1
        opt.step()
        return 0
