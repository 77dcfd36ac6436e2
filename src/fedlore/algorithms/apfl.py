"""APFL (Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv 2003.13461,
2020): each client mixes a local model with its copy of the global one.

Client i keeps a local model ``v_i`` and a mixing weight ``α_i``; its personalized model is
``v̄_i = α_i v_i + (1 - α_i) w_i``, with ``w_i`` its copy of the global model. Each local step
(Algorithm 1) draws one minibatch ξ and, from the step's values:

1. ``w_i <- w_i - η ∇f_i(w_i; ξ)``: the global copy trains exactly as
   :class:`~fedlore.algorithms.fedavg.FedAvg`'s (the same minibatches, optimizer, clipping and
   skipped steps; the round's upload is ``Δ_i = w_i - w^t`` and the server is FedAvg's);
2. ``v_i <- v_i - η ∇_v f_i(v̄_i; ξ) = v_i - η α_i ∇f_i(v̄_i; ξ)``: the gradient of the loss at
   the mixed model with respect to ``v`` (the chain rule through ``v̄ = α v + (1 - α) w``);
3. with ``adaptive_alpha``, ``α_i <- clip(α_i - η_α ∇_α f_i(v̄_i; ξ), 0, 1)`` with
   ``∇_α f_i(v̄_i) = ⟨v_i - w_i, ∇f_i(v̄_i; ξ)⟩`` (the paper's adaptive mixing weight; without
   it α stays at ``alpha``, the paper's fixed-α runs).

Steps 2 and 3 run in the hook :func:`~fedlore.train.local.local_train` calls between the
backward pass and the step of ``w_i``, on the same minibatch (an identically seeded stream), so
``w_i``, ``v_i`` and ``α_i`` all move from the step's values. A step whose ``w``-gradient is not
finite is skipped for all three (FedAvg skips it); one whose gradient at ``v̄`` is not finite
leaves ``v`` and α where they are and counts in ``skipped_steps``. The gradient at ``v̄`` is
clipped to ``optim.grad_clip`` as ``w``'s is. ``v_i``'s steps are plain SGD at the step's rate η
(what the paper runs for both models); ``w_i``'s are FedAvg's local optimizer (default plain SGD).

State kept by a client between rounds (``client_state_bytes``): ``v_i`` (``personal.*``: the
model's parameters and buffers; the forward passes at ``v̄`` use and update ``v``'s buffers) and
``α_i`` (``apfl.alpha``, a 0-d tensor of the model's dtype). A client's first contact starts
``v_i`` at the received global model and ``α_i`` at ``alpha``.

P-local (``eval.local``) scores the client's personalized model after its round,
``α_i v_i + (1 - α_i) w_i`` with the ``w_i`` it has just trained (the paper's ``v̄_i``; the
authors' FedTorch validates the personal model at the same point, before the averaging), with
``v_i``'s buffers. With ``alpha = 0`` and ``adaptive_alpha = false`` the personalized model is
``w_i`` itself: APFL is FedAvg (the same global model and the same P-local scores).

Defaults: ``alpha = 0.5``, the authors' FedTorch default and README example (``-pa 0.5``);
``adaptive_alpha = true`` (the paper's method; FedTorch's flag is off by default);
``alpha_lr``: None, each step's η as in the paper's α step. Deviations of FedTorch, not followed:
it mixes the two models' outputs rather than their weights, updates α once per round (its first
step), with the gradient ``⟨v - w, α ∇f(v) + (1 - α) ∇f(w)⟩`` of that output mixture and an extra
``0.02 α`` term. Bytes per round: FedAvg's (a dense model down, a dense delta up).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from fedlore.algorithm import ASYNC_UNTESTED
from fedlore.algorithms.base import local_eval_due, local_eval_metrics
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.algorithms.personal import personal_arrays
from fedlore.algorithms.weight_grads import Batch, clip_, loss_and_grads, trained_names
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import all_finite, load_model_arrays, with_prefix
from fedlore.types import Broadcast, Reply, Scalars, State

ALPHA = "apfl.alpha"
"""The client-state key of ``α_i`` (a 0-d tensor)."""


@dataclass
class _Personal:
    """What one client's round of APFL moves besides ``w``: ``v`` (parameters that train, by
    name), ``v``'s other tensors (buffers, frozen parameters), ``α`` and the round's counts."""

    v: dict[str, torch.Tensor]
    fixed: dict[str, torch.Tensor]
    alpha: torch.Tensor
    losses: list[torch.Tensor]
    skipped: int = 0


@register_algorithm("apfl")
@dataclass(frozen=True)
class APFL(FedAvg):
    """APFL (module docstring). Hyperparameters beyond FedAvg's (``lr`` is η, the step of
    ``w_i`` and ``v_i``):

    Attributes:
        alpha: the mixing weight α_i in [0, 1] every client starts from (default 0.5; 0: the
            personalized model is the global copy, 1: the local model alone).
        adaptive_alpha: each client updates its α_i by gradient descent on its loss at the
            mixed model, clipped to [0, 1] (default true, the paper's APFL); false: α_i stays at
            ``alpha``.
        alpha_lr: η_α, the step of α_i (> 0; None: each local step's η, as in the paper).
        local_optimizer: the optimizer of ``w_i``'s local steps (FedAvg's, default ``"sgd"``);
            ``v_i``'s steps are always plain SGD.
        momentum: SGD momentum of ``w_i``'s local steps (``local_optimizer="sgd"`` only).
    """

    name: ClassVar[str] = "apfl"
    capabilities = replace(
        FedAvg.capabilities,
        synchronous_only=ASYNC_UNTESTED,
        compress_uploads=False,
        sum_aggregable=False,
        transport_16bit=False,
        individual_uploads=(
            "its server only adds the weighted mean of the deltas of the clients' global copies "
            "w_i (linear in the uploads; v_i and alpha_i stay on the clients), but APFL is not yet "
            "offered under secure aggregation and DP (no test covers it there)"
        ),
    )
    per_client_metrics: ClassVar[tuple[str, ...]] = ("alpha",)
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    alpha: float = 0.5
    adaptive_alpha: bool = True
    alpha_lr: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"apfl: alpha must be in [0, 1] (a mixing weight), got {self.alpha}")
        if self.alpha_lr is not None and not self.alpha_lr > 0:
            raise ValueError(f"apfl: alpha_lr must be > 0, got {self.alpha_lr}")

    def round_work(self, num_examples: int, steps: int) -> int:
        """Two SGD steps per local step: ``w_i``'s optimizer's and ``v_i``'s, taken by hand with
        a gradient of its own (α's step is a scalar's, not counted)."""
        return 2 * steps

    def trained_model_metrics(self, model: nn.Module, data: ClientData, rnd: int) -> Scalars:
        """None for ``w_i`` alone: APFL's P-local is the mixed model (scored below)."""
        return {}

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """FedAvg's round of ``w_i`` with ``v_i`` and ``α_i`` stepped beside it (module
        docstring).

        Returns:
            (FedAvg's reply plus ``personal_loss`` (mean loss at ``v̄``), ``alpha`` (the client's
            α_i after the round) and, in the last round, P-local of ``v̄_i``; the client state
            ``personal.*`` = ``v_i``, ``apfl.alpha`` = ``α_i``).
        """
        same_batches = torch.Generator().set_state(rng.get_state())
        start, keep = self.dense_start(msg, state, model)
        rnd = int(msg.config["round"])
        p = self.start_personal(state, start, model)
        lrs = self.round_lrs(rnd, data.num_examples)
        batches = data.batches(self.train.batch_size, len(lrs), same_batches, rnd)
        hook = self.personal_step(p, batches, lrs)
        reply, _ = self.train_locally(
            msg, start, model, data, rng, self.loss_terms(start), on_grad=[hook]
        )
        v_model = {**p.fixed, **p.v}
        new = State(
            arrays={**keep.arrays, **with_prefix(v_model, "personal."), ALPHA: p.alpha.clone()},
            values=dict(keep.values),
        )
        finite = [x for x in (torch.stack(p.losses).tolist() if p.losses else []) if x == x]
        metrics = {
            **reply.metrics,
            "personal_loss": sum(finite) / len(finite) if finite else float("nan"),
            "alpha": float(p.alpha),
            "skipped_steps": int(reply.metrics.get("skipped_steps", 0)) + p.skipped,
        }
        if local_eval_due(self, rnd):
            metrics.update(local_eval_metrics(self, self.mixed(model, p), data, rnd))
        return Reply(arrays=reply.arrays, metrics=metrics), new

    def start_personal(
        self, state: State | None, start: dict[str, torch.Tensor], model: nn.Module
    ) -> _Personal:
        """``v_i`` (the client's, or the received model at first contact) split into the tensors
        that train and the rest, and ``α_i`` (the client's, or ``alpha``), as copies."""
        names = set(trained_names(model))
        held = personal_arrays(state) or start
        ref = next(iter(model.parameters()))
        v = {k: t.detach().to(ref.device, copy=True) for k, t in held.items()}
        kept = None if state is None else state.arrays.get(ALPHA)
        alpha = (
            torch.tensor(self.alpha, dtype=ref.dtype, device=ref.device)
            if kept is None
            else kept.detach().clone().to(ref.device)
        )
        return _Personal(
            v={k: t for k, t in v.items() if k in names},
            fixed={k: t for k, t in v.items() if k not in names},
            alpha=alpha,
            losses=[],
        )

    def personal_step(
        self,
        p: _Personal,
        batches: Iterable[Batch],
        lrs: list[float],
    ) -> Callable[[nn.Module, int], None]:
        """The hook that takes steps 2 and 3 of local step ``k`` (module docstring) while the
        model holds ``w_i`` and its clipped gradient, before ``w_i``'s step: minibatch ``k`` of
        ``batches`` (the stream ``w_i`` trains on, drawn again), rate ``lrs[k]``."""
        stream = iter(batches)
        drawn = -1  # the index of the batch last drawn (a skipped w-step calls no hook)
        batch: Batch | None = None

        def step(model: nn.Module, k: int) -> None:
            nonlocal drawn, batch
            while drawn < k:
                batch = next(stream)
                drawn += 1
            assert batch is not None
            w = {n: q.detach() for n, q in model.named_parameters() if n in p.v}
            a = p.alpha
            with torch.no_grad():
                mixed = {n: (a * p.v[n] + (1 - a) * w[n]).requires_grad_(True) for n in p.v}
            loss, g = loss_and_grads(model, mixed, p.fixed, batch)
            if not all_finite([loss, *g.values()]):
                p.skipped += 1
                return
            clip_(list(g.values()), self.train.grad_clip)
            lr = lrs[k]
            with torch.no_grad():
                if self.adaptive_alpha:  # ⟨v - w, ∇f(v̄)⟩ at the step's v and w
                    grad_a = sum((((p.v[n] - w[n]) * g[n]).sum() for n in p.v), torch.zeros_like(a))
                    step_a = lr if self.alpha_lr is None else self.alpha_lr
                    new_a = torch.clamp(a - step_a * grad_a, 0.0, 1.0)
                for n in p.v:
                    p.v[n].sub_(lr * a * g[n])
                if self.adaptive_alpha:
                    p.alpha = new_a
            p.losses.append(loss)

        return step

    def mixed(self, model: nn.Module, p: _Personal) -> nn.Module:
        """``model`` loaded with the personalized model ``α v + (1 - α) w`` (``w``: the model's
        trained parameters) and ``v``'s other tensors."""
        with torch.no_grad():
            w = {n: q.detach() for n, q in model.named_parameters() if n in p.v}
            mix = {n: p.alpha * p.v[n] + (1 - p.alpha) * w[n] for n in p.v}
        load_model_arrays(model, {**p.fixed, **mix})
        return model
