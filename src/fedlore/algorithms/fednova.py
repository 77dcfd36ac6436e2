"""FedNova (Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020): FedAvg whose server normalizes each
client's update by the local work that made it.

When clients take different numbers of local steps τ_i (``local_epochs``: E ⌈n_i / B⌉ steps, or
a straggler's cut round), FedAvg's ``x <- x + Σ p_i Δ_i`` weights client i by ``p_i ‖a_i‖₁``
in effect, and converges to a stationary point of ``Σ_i p_i ‖a_i‖₁ F_i / Σ_j p_j ‖a_j‖₁``
instead of ``Σ p_i F_i`` (the paper's objective inconsistency, Theorem 1). FedNova removes the
bias. A round (the paper's Section 5, from its general update rule of Section 4):

* the server sends ``x``; client i takes τ_i local SGD steps from ``y = x`` (heavy-ball
  momentum ρ = ``momentum`` and a proximal term ``(mu / 2) ‖y - x‖²`` optional, the paper's
  general form) and uploads ``Δ_i = y - x`` (``update.*``, as FedAvg) and, as the reply metric
  ``a_norm``, the scalar ``A_i = η ‖a_i‖₁``: the step-size-weighted l1 norm of its aggregation
  vector, ``Δ_i = -η G_i a_i`` for the stacked gradients ``G_i``;
* the server takes the normalized gradients ``d_i = -Δ_i / A_i`` and steps
  ``x <- x - τ_eff η Σ p_i d_i / Σ p_i`` with ``τ_eff η = Σ p_i A_i / Σ p_i`` over the round's
  accepted clients: ``x <- x + (Σ p_j A_j / Σ p_j) Σ p_i (Δ_i / A_i) / Σ p_i``. The result
  goes through the server optimizer as FedAvg's mean delta does (``server.lr`` is a global
  step size on top; ``server.optimizer: momentum`` plays the reference code's ``gmf``).

``A_i`` is computed from the steps actually taken: a local step's update is linear in its
gradient, so ``A_i`` is ``-(y_τ - x)`` of the same recursion driven by the unit gradient,
``v_k = ρ v_{k-1} + 1 + μ e_k``, ``e_{k+1} = e_k - η_k v_k`` (``e = y - x``, ``v_0 = 0``; the
proximal gradient ``μ (y - x)`` goes through the momentum buffer, as it does in the local
optimizer), over the step sizes η_k of the round's schedule and only the steps that were taken
(a step skipped for a non-finite loss or gradient moves neither). That is exactly the paper's
``η ‖a_i‖₁`` in its three cases: ``η τ_i`` for SGD, ``η Σ_{k=1}^{τ_i} (1 - ρ^k) / (1 - ρ)``
for momentum SGD, ``η Σ_{k=0}^{τ_i - 1} (1 - ημ)^k`` for proximal SGD; with a schedule it is
the sum of the step sizes taken (as SCAFFOLD's ``Σ_k η_k``). Weight decay is part of the
gradient (of the local objective ``F_i + (λ / 2) ‖y‖²``, the same for every client) and gradient
clipping part of the step's gradient; neither enters ``A_i``.

With every ``A_i`` equal (the same K and schedule for all, ``local_steps``) FedNova is FedAvg.
The weights ``p_i`` are ``n_i`` (the paper's ``n_i / n``) or 1 by ``weighting``, with no
straggler discount: a straggler's fewer steps are what the normalization accounts for (its small
``A_i`` lowers ``τ_eff``). A reply whose ``a_norm`` is not a finite number > 0 (a round of zero
step sizes: nothing learnt) does not enter the step. The normalization applies to the trained
parameters; buffers (BatchNorm's running statistics, counters), which no SGD step moves, are
averaged as FedAvg averages them.

``τ_eff = Σ p_i ‖a_i‖₁`` is the paper's choice for SGD and momentum. Its reference code
(``JYWa/FedNova``, ``distoptim/FedNova.py``) uses ``Σ p_i τ_i`` instead when ``mu`` > 0, a
larger global step; here ``τ_eff`` is ``Σ p_i ‖a_i‖₁`` in every case. Its momentum buffer also
leaves the proximal gradient out; here the local optimizer is fedlore's ``torch.optim.SGD``
with the proximal term in the loss, and ``A_i`` follows that recursion.

Bytes per round: FedAvg's (the model down, ``Δ_i`` up) plus the one float in the reply
metrics, which travels beside ``num_examples`` and, as it, is not counted in ``bytes_up``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.algorithms.personal import prox_term
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import from_wire, select, with_prefix
from fedlore.train.local import LossTerm
from fedlore.types import Broadcast, Reply, Scalars, State

log = logging.getLogger(__name__)

A_NORM = "a_norm"
"""Reply metric: the client's ``A_i = η ‖a_i‖₁`` of the round."""
NORMALIZED = "fednova.normalized"
"""Server state value: the JSON list of the trained parameters' names (the tensors whose
deltas are normalized; the others are buffers)."""


def a_norm(lrs: Sequence[float], momentum: float = 0.0, mu: float = 0.0) -> float:
    """``η ‖a‖₁`` of local steps of sizes ``lrs`` with heavy-ball ``momentum`` ρ (torch's SGD:
    ``v_k = ρ v_{k-1} + g_k``, ``y_{k+1} = y_k - η_k v_k``) and proximal weight ``mu``: the sum
    of the coefficients of the gradients in ``x - y_τ``, i.e. ``-(y_τ - x)`` when every gradient
    is 1 (the recursion is linear in the gradients; the proximal gradient is ``mu (y_k - x)``).

    ``Σ η_k`` for plain SGD; ``η Σ_{k=1}^τ (1 - ρ^k) / (1 - ρ)`` with momentum and constant η;
    ``η Σ_{k=0}^{τ-1} (1 - η mu)^k`` with the proximal term (the paper's ``a_i`` cases)."""
    e = v = 0.0
    for lr in lrs:
        v = momentum * v + 1.0 + mu * e
        e -= lr * v
    return -e


@register_algorithm("fednova")
@dataclass(frozen=True)
class FedNova(FedAvg):
    """FedNova (module docstring): FedAvg with normalized averaging. Hyperparameters beyond
    FedAvg's:

    Attributes:
        mu: the proximal weight μ of the paper's general local solver: every local step's loss
            gains ``(mu / 2) ‖y - x‖²`` over the trained parameters (its gradient
            ``mu (y - x)``), and ``‖a_i‖₁`` follows; ≥ 0, default 0 (plain local SGD, the
            paper's FedNova).
        momentum: heavy-ball momentum ρ of the local SGD, in [0, 1) (0: plain SGD);
            ``‖a_i‖₁ = Σ_{k=1}^{τ_i} (1 - ρ^k) / (1 - ρ)``.
        local_optimizer: ``"sgd"`` only (``‖a_i‖₁`` is defined for SGD steps).
    """

    name: ClassVar[str] = "fednova"
    capabilities = replace(
        FedAvg.capabilities,
        synchronous_only="it normalizes each delta by the step counts of one synchronous round",
        compress_uploads=False,
        sum_aggregable=False,
        robust_aggregate=False,
        individual_uploads=(
            "its server divides each client's delta by that client's own ‖a_i‖₁ (a reply "
            "metric) before the weighted mean; the quotients and the ‖a_i‖₁ would sum, but "
            "FedNova is not yet offered under secure aggregation and DP (no test covers it, "
            "and DP would need a sensitivity for ‖a_i‖₁)"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    mu: float = 0.0
    local_optimizer: Literal["adamw", "sgd"] = "sgd"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local_optimizer != "sgd":
            raise ValueError(
                "fednova: local_optimizer must be 'sgd' (the aggregation vector a_i, and so "
                f"the normalization, is defined for SGD steps), got {self.local_optimizer!r}"
            )
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"fednova: momentum must be in [0, 1), got {self.momentum!r}")
        if not self.mu >= 0.0:
            raise ValueError(
                f"fednova: mu must be >= 0 (the proximal weight; 0: plain SGD), got {self.mu!r}"
            )

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        state = super().init_server(model, rng)
        trained = [n for n, _ in model.named_parameters() if not self.is_frozen(n)]
        values = {**state.values, NORMALIZED: json.dumps(trained)}
        return State(arrays=dict(state.arrays), values=values)

    def loss_terms(self, start: dict[str, torch.Tensor]) -> list[LossTerm]:
        """``(mu / 2) Σ ‖y - x‖²`` over the parameters that train when ``mu`` > 0."""
        return [prox_term(start, self.mu)] if self.mu > 0 else []

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """τ_i local SGD steps from ``x``; returns (``update.*`` = Δ_i with FedAvg's metrics
        and ``a_norm`` = ``η ‖a_i‖₁`` of the steps taken, FedAvg's client state)."""
        start, keep = self.dense_start(msg, state, model)
        taken: list[int] = []

        def record(_model: nn.Module, k: int) -> None:
            taken.append(k)

        reply, lrs = self.train_locally(
            msg, start, model, data, rng, self.loss_terms(start), on_grad=[record]
        )
        norm = a_norm([lrs[k] for k in taken], self.momentum, self.mu)
        return Reply(arrays=reply.arrays, metrics={**reply.metrics, A_NORM: norm}), keep

    def weights(self, replies: list[Reply]) -> list[float]:
        """The paper's ``p_i``: ``n_i``, or 1 under ``weighting: uniform`` (not normalized), with
        no straggler discount (the normalization accounts for a straggler's fewer steps)."""
        if self.train.weighting == "uniform":
            return [1.0] * len(replies)
        return [float(r.num_examples) for r in replies]

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        """``x <- x + τ_eff η Σ p_i (Δ_i / A_i) / Σ p_i`` through FedAvg's server (its server
        optimizer, its buffer averaging), ``τ_eff η = Σ p_i A_i / Σ p_i`` over the accepted
        replies with a usable ``A_i``; the round's ``tau_eff_lr`` (``τ_eff η``) is a metric."""
        usable: list[tuple[int, Reply | None]] = [
            (c, r if r is not None and _usable(c, r, rnd) else None) for c, r in replies
        ]
        ok = [r for _, r in usable if r is not None]
        if not ok:
            return super().aggregate(state, usable, rnd)
        p = self.weights(ok)
        norms = [float(r.metrics[A_NORM]) for r in ok]
        tau_eff = sum(w * a for w, a in zip(p, norms, strict=True)) / sum(p)
        trained = set(json.loads(str(state.values[NORMALIZED])))
        dtypes = {k: v.dtype for k, v in select(state.arrays, "model.").items()}
        scaled: list[tuple[int, Reply | None]] = []
        for c, r in usable:
            if r is None:
                scaled.append((c, None))
                continue
            s = tau_eff / float(r.metrics[A_NORM])
            ups = from_wire(select(r.arrays, "update."), dtypes)
            ups = {k: v * s if k in trained else v for k, v in ups.items()}
            scaled.append((c, Reply(arrays=with_prefix(ups, "update."), metrics=r.metrics)))
        new, metrics = super().aggregate(state, scaled, rnd)
        return new, {**metrics, "tau_eff_lr": tau_eff}


def _usable(client: int, reply: Reply, rnd: int) -> bool:
    """Whether ``reply`` carries an ``a_norm`` the server can divide by (a finite number > 0);
    one that is missing, not finite or negative is logged (0, a round of zero step sizes that
    learnt nothing, is not)."""
    a = reply.metrics.get(A_NORM)
    if isinstance(a, int | float) and not isinstance(a, bool) and math.isfinite(a) and a >= 0:
        return a > 0
    log.warning("round %d: client %s sent no usable %s (%r): left out", rnd, client, A_NORM, a)
    return False
