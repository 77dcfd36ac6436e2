"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020): FedAvg on the MAML objective.

Each client minimizes ``F_i(w) = f_i(w - α ∇f_i(w))``, the loss after one gradient step of size
α from ``w`` (the paper's Eq. 3). Each of a round's local steps draws independent minibatches D,
D' (and D'') and, from the client's current ``w``:

1. the inner step ``w̃ = w - α ∇f_i(w; D)``;
2. the outer step (Algorithm 1)

   * ``variant: fo`` (Per-FedAvg (FO), the default): ``w <- w - β ∇f_i(w̃; D')``, the MAML
     gradient with its Hessian term dropped;
   * ``variant: hf`` (Per-FedAvg (HF)): ``w <- w - β (I - α ∇²f_i(w; D'')) ∇f_i(w̃; D')``, the
     MAML gradient with the Hessian on a third minibatch. The paper estimates the
     Hessian-vector product by a gradient difference ``(∇f(w + δu) - ∇f(w - δu)) / 2δ``; here it
     is the exact product by automatic differentiation
     (:func:`~fedlore.algorithms.weight_grads.hessian_vector`), that difference's limit δ -> 0.

The outer step is taken by FedAvg's local optimizer (default plain SGD, the paper's; with
``optim.grad_clip`` clipping the outer direction), at β following the run's learning-rate
schedule; the inner step is plain SGD at the constant α and is not clipped (it defines the
objective). A step whose losses or gradients are not finite is skipped. The client uploads
``Δ_i = w_i - w^t`` and the server is FedAvg's. D follows the run's minibatches of the round
(``ClientData.batches``, the client's stream where it has one); D' and D'' come from per-round
permutations drawn from the client's round generator: under ``local_epochs`` each of them
passes E times over the client's data, K = E ceil(n / B) outer steps a round.

Personalization and P-local (``eval.local``): the paper's evaluation personalizes the global
model by one step of size α on the client's data and scores it. In the run's last round each
client takes ``adapt_steps`` SGD steps of size α (minibatches of B from its training split) from
the global model it **received** that round and scores the result on its test split; the
training of the round is the same with or without it (its minibatches come from a stream of
their own). The global model after the last averaging reaches no client, as in the reference
implementations (CharlieDinh/pFedMe ``serverperavg.py`` evaluates the broadcast model, adapted,
before the round's training). Nothing is kept between rounds (``client_state_bytes`` 0).

Defaults: ``alpha``: None, the run's ``lr`` (the sources take the inner step from the client's
learning rate: pFedMe's ``userperavg.py``, PFLlib); ``beta``: None, the run's ``lr`` too;
``variant: fo``; ``adapt_steps: 1`` (the paper's one step). Deviation of pFedMe's code, not
followed: its evaluation adapts by two steps (α, then β), the first on a test batch.
Bytes per round: FedAvg's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithm import ASYNC_UNTESTED
from fedlore.algorithms.base import local_eval_due, local_eval_metrics, reply_metrics
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg, optimizer_state_bytes
from fedlore.algorithms.weight_grads import (
    clip_,
    grads_of,
    hessian_vector,
    loss_and_grads,
    loss_at,
)
from fedlore.data.client_data import ClientData, minibatches
from fedlore.registry import register_algorithm
from fedlore.tensors import all_finite, load_model_arrays
from fedlore.train.local import local_train
from fedlore.types import Broadcast, Reply, State


@register_algorithm("perfedavg")
@dataclass(frozen=True)
class PerFedAvg(FedAvg):
    """Per-FedAvg (module docstring). Hyperparameters beyond FedAvg's:

    Attributes:
        alpha: α, the inner (personalization) step size (> 0; None: the run's ``lr``), also the
            step of the evaluation-time adaptation.
        beta: β, the outer (meta) step size (> 0; None: the run's ``lr``), scaled by the run's
            learning-rate schedule.
        variant: ``"fo"`` (first order: the Hessian term dropped) or ``"hf"`` (the Hessian-vector
            product on a third minibatch D'').
        adapt_steps: SGD steps of size α from the received global model before P-local is
            scored (>= 1; the paper's 1).
        local_optimizer: the optimizer of the outer step (FedAvg's, default ``"sgd"``).
        momentum: SGD momentum of the outer step (``local_optimizer="sgd"`` only).
    """

    name: ClassVar[str] = "perfedavg"
    capabilities = replace(
        FedAvg.capabilities,
        synchronous_only=ASYNC_UNTESTED,
        compress_uploads=False,
        sum_aggregable=False,
        transport_16bit=False,
        individual_uploads=(
            "its server only adds the weighted mean of the meta-trained deltas (linear in the "
            "uploads), but Per-FedAvg is not yet offered under secure aggregation and DP (no "
            "test covers it there)"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    alpha: float | None = None
    beta: float | None = None
    variant: Literal["fo", "hf"] = "fo"
    adapt_steps: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("alpha", "beta"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"perfedavg: {field} must be > 0, got {value}")
        if self.variant not in ("fo", "hf"):
            raise ValueError(f"perfedavg: variant must be 'fo' or 'hf', got {self.variant!r}")
        if self.adapt_steps < 1:
            raise ValueError(f"perfedavg: adapt_steps must be >= 1, got {self.adapt_steps}")

    def round_work(self, num_examples: int, steps: int) -> int:
        """Two SGD steps per local step: the inner step to ``w̃`` (by hand, at α) and the outer
        step (HF's Hessian-vector product is no step; the last round's ``adapt_steps`` before
        P-local are an evaluation's, not counted)."""
        return 2 * steps

    @property
    def inner_lr(self) -> float:
        """α (``alpha``, or the run's ``lr``)."""
        return self.train.lr if self.alpha is None else self.alpha

    @property
    def outer_scale(self) -> float:
        """β over the run's ``lr``: the factor of each scheduled rate (1 when ``beta`` is None)."""
        return 1.0 if self.beta is None else self.beta / self.train.lr

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """K outer steps of Per-FedAvg from the received ``w^t`` (module docstring).

        Returns:
            (``update.* = w_K - w^t`` with ``train_loss`` (mean loss at ``w̃`` on D'),
            ``inner_loss`` (mean loss at ``w`` on D) and, in the last round, P-local of the
            adapted global model; the client state FedAvg keeps: frozen tensors' cache, if any).
        """
        seeds = torch.randint(0, 2**62, (3,), generator=rng).tolist()
        start, keep = self.dense_start(msg, state, model)
        rnd = int(msg.config["round"])
        lrs = self.round_lrs(rnd, data.num_examples)
        k, b = len(lrs), self.train.batch_size
        streams = [
            data.batches(b, k, rng, rnd),
            minibatches(data.train, b, k, torch.Generator().manual_seed(seeds[0])),
        ]
        if self.variant == "hf":
            streams.append(minibatches(data.train, b, k, torch.Generator().manual_seed(seeds[1])))
        opt = self.make_optimizer(model)
        params: dict[str, torch.Tensor] = {
            n: q for n, q in model.named_parameters() if q.requires_grad
        }
        inner: list[torch.Tensor] = []
        outer: list[torch.Tensor] = []
        skipped = 0
        t0 = time.perf_counter()
        model.train()
        for step, batches in enumerate(zip(*streams, strict=True)):
            losses, direction = self.meta_gradient(model, params, batches)
            if not all_finite([*losses, *direction.values()]):
                skipped += 1
                continue
            clip_(list(direction.values()), self.train.grad_clip)
            for g in opt.param_groups:
                g["lr"] = lrs[step] * self.outer_scale
            for n, q in params.items():
                q.grad = direction[n]
            opt.step()
            opt.zero_grad(set_to_none=True)
            inner.append(losses[0])
            outer.append(losses[1])
        train_s = time.perf_counter() - t0
        upload = self.dense_update(model, start)
        metrics = reply_metrics(
            data.num_examples,
            train_loss=_mean(outer),
            inner_loss=_mean(inner),
            skipped_steps=skipped,
            optimizer_state_bytes=optimizer_state_bytes(opt),
            train_s=train_s,
        )
        if local_eval_due(self, rnd):
            adapt = torch.Generator().manual_seed(seeds[2])
            metrics.update(
                local_eval_metrics(self, self.adapted(model, start, data, adapt), data, rnd)
            )
        return Reply(arrays=upload, metrics=metrics), keep

    def meta_gradient(
        self,
        model: nn.Module,
        params: dict[str, torch.Tensor],
        batches: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """One outer step's direction at the model's current weights ``w`` (``params``, the
        parameters that train): ``∇f(w̃; D')`` (FO) or ``(I - α ∇²f(w; D'')) ∇f(w̃; D')`` (HF),
        with ``w̃ = w - α ∇f(w; D)``; and the losses ``f(w; D)``, ``f(w̃; D')``."""
        alpha = self.inner_lr
        loss_in = loss_at(model, params, {}, batches[0])
        g_in = grads_of(loss_in, params)
        with torch.no_grad():
            tilde = {n: (w - alpha * g_in[n]).requires_grad_(True) for n, w in params.items()}
        loss_out, g_out = loss_and_grads(model, tilde, {}, batches[1])
        if self.variant == "hf":
            hv = hessian_vector(model, params, {}, batches[2], g_out)
            g_out = {n: g - alpha * hv[n] for n, g in g_out.items()}
        return [loss_in.detach(), loss_out], g_out

    def adapted(
        self,
        model: nn.Module,
        start: dict[str, torch.Tensor],
        data: ClientData,
        rng: torch.Generator,
    ) -> nn.Module:
        """``model`` loaded with the received global model ``start`` after ``adapt_steps`` plain
        SGD steps of size α on minibatches of the client's training split (the personalized
        model P-local scores)."""
        load_model_arrays(model, start)
        opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=self.inner_lr)
        batches = minibatches(data.train, self.train.batch_size, self.adapt_steps, rng)
        local_train(model, batches, opt, [self.inner_lr] * self.adapt_steps)
        return model


def _mean(losses: list[torch.Tensor]) -> float:
    """The mean of the steps' losses (read once; NaN when every step was skipped)."""
    if not losses:
        return float("nan")
    values = torch.stack(losses).tolist()
    return sum(values) / len(values)
