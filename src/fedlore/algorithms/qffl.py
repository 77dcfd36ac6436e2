"""q-FFL, trained by q-FedAvg (Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in
Federated Learning", ICLR 2020, Algorithm 2): FedAvg whose server weighs each client by its loss
to the power q, so that the clients the global model serves worst pull hardest.

The objective (the paper's q-FFL) is

    min_w f_q(w) = Σ_k p_k / (q + 1) · F_k^{q+1}(w),

``F_k`` the loss of client k, ``p_k`` its weight. ``q = 0`` is FedAvg's objective ``Σ p_k F_k``;
a larger q weighs the clients of large loss more (their accuracies spread less, the paper's
notion of fairness), and ``q -> ∞`` tends to the worst client's loss alone (minimax, AFL).

A round (Algorithm 2, q-FedAvg):

* the server sends ``w^t``; a sampled client k computes ``F_k(w^t)``, its loss on its whole
  training split before it trains (``loss_at="start"``: one forward pass over the split, in eval
  mode, the task loss of local training: cross-entropy, or the Gaussian NLL of a regression
  model), then takes the round's local SGD steps to ``w̄_k``;
* with ``ΔW_k = L (w^t - w̄_k)``: ``Δ_k = F_k^q ΔW_k`` and
  ``h_k = q F_k^{q-1} ‖ΔW_k‖² + L F_k^q``;
* the server steps ``w^{t+1} = w^t - Σ_k p_k Δ_k / Σ_k p_k h_k``.

``L`` estimates the Lipschitz constant of the clients' gradients (``ΔW_k`` stands for a gradient
of ``F_k``: after one full-batch local step at ``η = 1/L`` it is ``∇F_k(w^t)``, and the round is
the paper's q-FedSGD, Algorithm 1); ``h_k`` bounds the Lipschitz constant of the gradient of
``F_k^{q+1}/(q+1)`` at ``w^t``, so ``1 / Σ h_k`` is a step size the server adapts to the round,
with none of its own to tune. ``lipschitz`` None takes ``L = 1 / lr``, the inverse of the local
learning rate, as the authors' code (``litian96/fair_flearn``, ``flearn/trainers/qffedavg.py``)
and Flower's ``QFedAvg`` do; under a schedule ``L`` stays ``1 / lr`` (the paper trains at a
constant rate). With K local steps ``ΔW_k`` is about the sum of K gradients, and the
``q F^{q-1} ‖ΔW_k‖²`` terms shrink the step accordingly (the round metric ``qffl_step_share``);
``lipschitz = 1 / (K lr)`` reads ``ΔW_k`` as their mean instead.

The weights ``p_k``. The paper samples client k with probability ``p_k`` and sums over the
round's clients unweighted; fedlore samples uniformly (:mod:`fedlore.engine.sampling`), so the
``p_k`` enter the sums instead: ``n_k`` or 1 by ``weighting`` (times a straggler's work share,
as FedAvg's). Both estimate the full-participation step ``Σ_k p_k Δ_k / Σ_k p_k h_k``. Under
``weighting: uniform`` the server's step is the paper's formula to the letter. At ``q = 0``,
``Δ_k = ΔW_k`` and ``h_k = L``, so ``w^{t+1} = Σ p_k w̄_k / Σ p_k`` whatever L: FedAvg's weighted
mean of the client models (their plain mean under ``uniform``).

What travels. The client uploads FedAvg's delta ``update.* = w̄_k - w^t`` and, as the reply
metric ``qffl_loss``, ``F_k(w^t)``; the server forms ``ΔW_k``, ``Δ_k`` and ``h_k`` from them,
the paper's client-side arithmetic moved to the server (the same step). A client's ``Δ_k``
scales with ``F_k^q``, which at q = 5 spans orders of magnitude across clients: uploaded as
such, the norm screen (``robust.norm_screen``, 1000 × the round's median) would reject the
worst-off client's, the one q-FFL exists for, and a 16-bit transport would overflow it. The
plain delta has neither problem, and ``transport_dtype`` fp16 / bf16 applies to it as to
FedAvg's. Bytes: FedAvg's, plus the one float beside ``num_examples``.

``F_k = 0`` (a client whose training split the model fits exactly: a loss that is 0 in
floating point). ``q F_k^{q-1}`` is 0 · ∞ at q = 0 and ∞ for ``0 < q < 1``. At q = 0 the term is
absent (q multiplies it: FedAvg). For ``0 < q < 1`` it is taken as its limit, 0: for a
nonnegative loss with ``L``-Lipschitz gradients, ``‖∇F_k‖² <= 2 L F_k``, so
``q F_k^{q-1} ‖∇F_k‖² <= 2 q L F_k^q -> 0``; the client contributes ``Δ_k = 0`` and ``h_k = 0``.
For ``q >= 1`` the formula is finite and kept (``0^0 = 1``: ``h_k = ‖ΔW_k‖²`` at q = 1). A round
whose clients all have ``F_k = 0`` (q > 0) leaves the trained tensors where they are (every
``Δ_k`` is 0). The authors' code and Flower's add 1e-10 to every loss instead; here the losses
are used as they are. The server computes with ``(F_k / max_j F_j)^q`` (the ratio is exact
algebra: ``max F^q`` cancels), so a large q does not overflow a float.

Buffers (BatchNorm's running statistics, counters), which no gradient moves, are averaged as
FedAvg averages them; ``Δ_k``, ``h_k`` and the q-weighting concern the trained parameters.

Options beside the paper: ``loss_at="local"`` takes ``F_k`` from the round's local steps (the
mean of their minibatch losses, the reply's ``train_loss``), as Flower's ``QFedAvg``
(``flwr.serverapp.strategy``) reads ``train_loss``: no extra pass, but a loss measured along
the local trajectory, below ``F_k(w^t)`` once local training helps. Flower's older strategy
(``flwr.server.strategy.QFedAvg``) takes one loss for all clients, the server's central
evaluation, which removes the reweighting; it is not offered.

Refused, each by the capability record: secure aggregation and DP (the server reads each
client's loss; ``Σ Δ_k`` and ``Σ h_k`` would sum, but DP would need a sensitivity for them,
which grow as ``F_k^q`` without bound), robust aggregates (the server's weights are the
clients' own reported losses), server optimizers (``1 / Σ h_k`` is the method's own step size),
upload compression (untested). Local steps are SGD (``L = 1/η`` reads them as gradient steps);
momentum, which the paper does not use, is allowed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.data.corpus import IGNORE_INDEX
from fedlore.device import autocast
from fedlore.registry import register_algorithm
from fedlore.tensors import from_wire, select, with_prefix
from fedlore.train.local import task_loss
from fedlore.types import Broadcast, Reply, Scalars, State

LOSS = "qffl_loss"
"""Reply metric: the client's ``F_k``, its loss at the round's start (``loss_at="start"``) or
the mean loss of its local steps (``"local"``)."""
TRAINED = "qffl.trained"
"""Server state value: the JSON list of the trained parameters' names (the tensors the
q-weighted step moves; the others are buffers)."""


def split_loss(model: nn.Module, split: TensorSplit, batch_size: int = 512) -> float:
    """``F_k(w)``: the mean task loss (:func:`~fedlore.train.local.task_loss`, the loss of local
    training) of ``model`` over the whole ``split``, in eval mode (dropout off, BatchNorm's
    running statistics) and the training forward's precision (bf16 autocast under ``precision:
    bf16``, else the model's dtype), summed in float64: per example, per counted token for a
    language model. NaN when nothing counts."""
    model.eval()
    with torch.no_grad():  # a block, not a decorator: mutmut mutates the body
        total = torch.zeros((), dtype=torch.float64, device=split.x.device)
        count = 0
        for i in range(0, len(split), batch_size):
            x, y = split.x[i : i + batch_size], split.y[i : i + batch_size]
            tokens = y.dim() == 2 and not y.is_floating_point()
            n = int((y != IGNORE_INDEX).sum()) if tokens else int(y.shape[0])
            if n == 0:
                continue
            with autocast(x.device):
                loss = task_loss(model(x), y)
            total += loss.double() * n
            count += n
    return float(total) / count if count else float("nan")


def qffl_scales(
    losses: Sequence[float],
    sq_norms: Sequence[float],
    weights: Sequence[float],
    q: float,
    lipschitz: float,
) -> list[float]:
    """The factor ``s_k`` of each client's delta ``w̄_k - w^t`` in q-FedAvg's step, so that
    ``Σ p_k s_k (w̄_k - w^t) / Σ p_k = -Σ p_k Δ_k / Σ p_k h_k``:
    ``s_k = L F_k^q / (Σ_j p_j h_j / Σ_j p_j)`` with ``h_j = q F_j^{q-1} ‖ΔW_j‖² + L F_j^q``
    (module docstring), computed with ``F / max F`` so that no power overflows.

    Args:
        losses: each client's ``F_k`` (finite, >= 0).
        sq_norms: each client's ``‖ΔW_k‖² = L² ‖w̄_k - w^t‖²`` over the trained parameters.
        weights: the ``p_k`` (not normalized, > 0).
        q: the fairness parameter, >= 0.
        lipschitz: L, > 0.

    Returns:
        The ``s_k``: all 1 at q = 0 (FedAvg); all 0 when q > 0 and every ``F_k`` is 0.
    """
    if q == 0:
        return [1.0] * len(losses)
    top = max(losses)
    if top == 0:  # every Δ_k = F_k^q ΔW_k is 0: no step
        return [0.0] * len(losses)
    ratios = [f / top for f in losses]
    lead = [  # q F^{q-1} ‖ΔW‖² / top^q; its limit 0 where F = 0 and q < 1
        0.0 if r == 0.0 and q < 1 else q * r ** (q - 1) * sq / top
        for r, sq in zip(ratios, sq_norms, strict=True)
    ]
    powers = [r**q for r in ratios]  # F^q / top^q, in [0, 1]
    h = [b + lipschitz * a for a, b in zip(powers, lead, strict=True)]  # h_k / top^q
    h_mean = sum(p * x for p, x in zip(weights, h, strict=True)) / sum(weights)
    return [lipschitz * a / h_mean for a in powers]


@register_algorithm("qffl")
@dataclass(frozen=True)
class QFFL(FedAvg):
    """q-FFL by q-FedAvg (module docstring). Hyperparameters beyond FedAvg's:

    Attributes:
        q: the fairness parameter, >= 0: 0 is FedAvg; a larger q weighs the clients of large
            loss more. Default 1, the value the paper reports for its Synthetic and Sent140 data
            (5 for Vehicle). Flower's ``QFedAvg`` defaults to 0.1 (0.2 in its older strategy).
        lipschitz: L, the Lipschitz estimate of the clients' gradients (> 0); None: ``1 / lr``,
            the inverse of the local learning rate, the paper's and its code's choice.
        loss_at: where a client measures its ``F_k``: ``"start"`` (the paper's ``F_k(w^t)``, the
            received model's loss on the client's whole training split, one forward pass) or
            ``"local"`` (the mean loss of the round's local steps, as Flower's ``QFedAvg``
            reads ``train_loss``; no extra pass).
        local_optimizer: ``"sgd"`` only (``L = 1/η`` reads the local steps as gradient steps).
    """

    name: ClassVar[str] = "qffl"
    capabilities = replace(
        FedAvg.capabilities,
        synchronous_only=(
            "its server rescales each delta by the client's loss at the current round's model"
        ),
        compress_uploads=False,
        sum_aggregable=False,
        robust_aggregate=False,
        server_optimizer=False,
        individual_uploads=(
            "its server weighs each client's delta by that client's own loss to the power q, "
            "a reply metric it reads per client; the paper's Δ_k and h_k would sum, but no test "
            "covers q-FFL under secure aggregation, and DP would need a sensitivity for Δ_k "
            "and h_k, which grow as F_k^q without bound"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    q: float = 1.0
    lipschitz: float | None = None
    loss_at: Literal["start", "local"] = "start"
    local_optimizer: Literal["adamw", "sgd"] = "sgd"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local_optimizer != "sgd":
            raise ValueError(
                "qffl: local_optimizer must be 'sgd' (the Lipschitz estimate L = 1/lr reads "
                f"the local steps as gradient steps), got {self.local_optimizer!r}"
            )
        if not (isinstance(self.q, int | float) and math.isfinite(self.q) and self.q >= 0):
            raise ValueError(
                f"qffl: q must be a finite number >= 0 (0: FedAvg; the objective "
                f"Σ p_k F_k^(q+1) / (q+1) is defined for q >= 0), got {self.q!r}"
            )
        if self.lipschitz is not None and not (
            math.isfinite(self.lipschitz) and self.lipschitz > 0
        ):
            raise ValueError(
                "qffl: lipschitz must be a finite number > 0 (or None: 1 / lr), got "
                f"{self.lipschitz!r}"
            )
        if self.loss_at not in ("start", "local"):
            raise ValueError(f"qffl: loss_at must be 'start' or 'local', got {self.loss_at!r}")

    @property
    def lipschitz_estimate(self) -> float:
        """L: ``lipschitz``, or ``1 / lr``."""
        return 1.0 / self.train.lr if self.lipschitz is None else float(self.lipschitz)

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        state = super().init_server(model, rng)
        trained = [n for n, _ in model.named_parameters() if not self.is_frozen(n)]
        return State(
            arrays=dict(state.arrays), values={**state.values, TRAINED: json.dumps(trained)}
        )

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """``F_k(w^t)`` (under ``loss_at="start"``), then FedAvg's local steps; returns
        (``update.*`` = ``w̄_k - w^t`` with FedAvg's metrics and ``qffl_loss`` = ``F_k``, FedAvg's
        client state). The pass that measures ``F_k`` counts in ``train_s``."""
        start, keep = self.dense_start(msg, state, model)
        t0 = time.perf_counter()
        at_start = split_loss(model, data.train) if self.loss_at == "start" else None
        measure_s = time.perf_counter() - t0
        reply, _ = self.train_locally(msg, start, model, data, rng, self.loss_terms(start))
        metrics = dict(reply.metrics)
        metrics[LOSS] = at_start if at_start is not None else metrics["train_loss"]
        metrics["train_s"] = float(metrics["train_s"]) + measure_s
        return Reply(arrays=reply.arrays, metrics=metrics), keep

    def reply_problem(self, state: State, rnd: int, client_id: int, reply: Reply) -> str | None:
        """Why a reply is no q-FFL upload: its ``qffl_loss`` missing, not a number, not finite
        or negative (the round loop rejects it with this reason)."""
        why = super().reply_problem(state, rnd, client_id, reply)
        if why is not None:
            return why
        f = reply.metrics.get(LOSS)
        if not isinstance(f, int | float) or isinstance(f, bool) or not math.isfinite(f) or f < 0:
            return f"{LOSS} must be a finite number >= 0 (the client's loss F_k), got {f!r}"
        return None

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        """``w^{t+1} = w^t - Σ p_k Δ_k / Σ p_k h_k`` on the trained parameters through FedAvg's
        server (each delta scaled by :func:`qffl_scales`, then FedAvg's weighted mean; buffers
        averaged unscaled). Metrics: the round's largest ``qffl_loss`` (``qffl_loss_max``) and
        ``qffl_step_share`` = ``Σ p_k L F_k^q / Σ p_k h_k`` in (0, 1], the share of the
        loss-weighted mean step that the ``q F^{q-1} ‖ΔW‖²`` terms leave (1 at q = 0)."""
        ok = [r for _, r in replies if r is not None]
        if not ok:
            return super().aggregate(state, replies, rnd)
        trained = set(json.loads(str(state.values[TRAINED])))
        dtypes = {k: v.dtype for k, v in select(state.arrays, "model.").items()}
        deltas = [from_wire(select(r.arrays, "update."), dtypes) for r in ok]
        lip = self.lipschitz_estimate
        # ‖ΔW_k‖² = L² ‖w̄_k - w^t‖² over the trained parameters, in float64
        sq = [lip * lip * _sq_norm(d, trained) for d in deltas]
        p = self.weights(ok)
        losses = [float(r.metrics[LOSS]) for r in ok]
        scales = iter(qffl_scales(losses, sq, p, self.q, lip))
        share_num = 0.0
        scaled: list[tuple[int, Reply | None]] = []
        done = iter(zip(deltas, p, strict=True))
        for c, r in replies:
            if r is None:
                scaled.append((c, None))
                continue
            d, w = next(done)
            s = next(scales)
            share_num += w * s
            ups = {k: v * s if k in trained else v for k, v in d.items()}
            scaled.append((c, Reply(arrays=with_prefix(ups, "update."), metrics=r.metrics)))
        new, metrics = super().aggregate(state, scaled, rnd)
        return new, {
            **metrics,
            "qffl_loss_max": max(losses),
            "qffl_step_share": share_num / sum(p),
        }


def _sq_norm(tensors: dict[str, torch.Tensor], names: set[str]) -> float:
    """``Σ ‖t‖²`` over the tensors named in ``names``, in float64."""
    return sum(float(v.detach().double().pow(2).sum()) for k, v in tensors.items() if k in names)
