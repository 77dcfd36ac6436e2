"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020): FedAvg with control
variates that correct the client drift of non-IID local training.

The server holds the global model ``x`` and a control variate ``c``; client ``i`` holds its own
``c_i`` (zero at its first contact) in its client state. A round (the paper's Algorithm 1, with
its option II for ``c_i``):

* the server sends ``x`` and ``c``;
* the client starts at ``y = x`` and takes K local SGD steps ``y <- y - η_k (g_i(y) - c_i + c)``:
  its minibatch gradient corrected by ``c - c_i`` (here the gradient of the loss term
  ``<y, c - c_i>``, so gradient clipping and weight decay act as on any other method's step);
* it sets ``c_i+ = c_i - c + (x - y) / Σ_k η_k`` (option II; ``K η_l`` in the paper, the sum of
  the step sizes taken under a schedule or a straggler's cut round, without a step skipped for
  a non-finite loss, which moved nothing), keeps ``c_i+``, and
  uploads ``Δy = y - x`` (``update.*``) and ``Δc_i = c_i+ - c_i`` (``dcontrol.*``);
* the server steps ``x`` with the mean of the ``Δy`` as FedAvg does (``server.lr`` is the
  paper's global step size η_g; the mean is weighted by ``weighting``, uniform in the paper) and
  moves ``c`` by the round's ``Δc_i`` averaged with the same weights ``p_i`` (1 or ``n_i``, no
  straggler discount: a ``c_i`` is an estimate, not a share of work), scaled by ``|S| / N``:
  ``c <- c + (|S| / N) Σ p_i Δc_i / Σ p_i`` over the round's accepted clients, ``N`` the
  federation's clients (``num_clients``). Under uniform weights that is the paper's
  ``c <- c + (1 / N) Σ_{i ∈ S} Δc_i``; under ``num_examples`` weights it keeps ``c`` the
  weighted mean of the ``c_i`` under full participation, so the fixed point is the weighted
  optimum FedAvg's ``x`` step aims at (with the uniform mean it would be the uniform one).

With one local step (K = 1), ``c_i+`` is the client's minibatch gradient at ``x`` whatever
``c`` and ``c_i`` were; with full participation the server's ``c`` is the mean of the
``c_i`` (each starts at 0). The control variates cover the parameters that train (a frozen
tensor, a buffer such as BatchNorm's running statistics, has no gradient to correct).

A client keeps ``c_i+`` even when the server rejects its reply (it cannot know), so ``c`` misses
that change until the client's next accepted reply.

Bytes per round: the model and ``c`` down, ``Δy`` and ``Δc_i`` up (twice FedAvg's each way);
the client keeps one model-sized ``c_i``. Local steps are SGD (the option-II estimate
``(x - y) / Σ η`` assumes them; momentum, which the paper does not use, is allowed).

Secure aggregation (:attr:`~fedlore.algorithm.Capabilities.sum_aggregable`): both uploads are
increments and the server needs only their weighted means (the secure round hands it the mean
of ``[Δy, Δc_i]`` once per contributor, weight 1: ``x`` moves by the mean Δy and ``c`` by
``(|S| / N)`` times the mean Δc_i, as above). DP, central or local, is refused
(:attr:`~fedlore.algorithm.Capabilities.no_dp`): ``c`` is a running sum of the noised means.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms.base import ReplySpec
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import select, with_prefix
from fedlore.train.local import LossTerm, parameter_term
from fedlore.types import Broadcast, Reply, Scalars, State

CONTROL = "control."
"""Server ``c`` (state and broadcast) and client ``c_i`` (client state) arrays."""
DCONTROL = "dcontrol."
"""The reply's ``Δc_i = c_i+ - c_i``."""


def correction_term(shift: dict[str, torch.Tensor]) -> LossTerm:
    """The loss term ``Σ_p <p, shift_p>`` over the parameters named in ``shift``: its gradient
    adds ``shift_p`` (SCAFFOLD's ``c - c_i``) to each parameter's gradient."""

    return parameter_term(shift, lambda name, p: (p * shift[name].to(p.dtype)).sum())


@register_algorithm("scaffold")
@dataclass(frozen=True)
class Scaffold(FedAvg):
    """SCAFFOLD (module docstring). Hyperparameters beyond FedAvg's:

    Attributes:
        num_clients: N, the federation's clients (config ``num_clients``): the server's ``c``
            moves by ``(1 / N) Σ Δc_i``.
        local_optimizer: ``"sgd"`` only (the control variates' option-II estimate assumes
            SGD steps).
    """

    name: ClassVar[str] = "scaffold"
    # sum_aggregable: the server needs the weighted means of the Δy and of the Δc_i, both
    # increments (module docstring); no_dp: c keeps every round's mean Δc_i for good
    capabilities = replace(
        FedAvg.capabilities,
        synchronous_only=(
            "its control variates assume synchronous rounds: every client's update "
            "is of the current round's model"
        ),
        compress_uploads=False,
        transport_16bit=False,
        robust_aggregate=False,
        no_dp=(
            "its control variate c adds every round's mean Δc_i for good, so DP's noise on it "
            "would pile up in c as a random walk that every client's corrected steps follow, "
            "and one clip over Δy and Δc_i together would let the gradient-scale Δc_i take the "
            "budget (DP would need its own sensitivity for each part)"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    num_clients: int = field(default=10, metadata={"config": "num_clients"})
    local_optimizer: Literal["adamw", "sgd"] = "sgd"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local_optimizer != "sgd":
            raise ValueError(
                "scaffold: local_optimizer must be 'sgd' (the control variates' option-II "
                f"estimate (x - y) / Σ lr assumes SGD steps), got {self.local_optimizer!r}"
            )
        if self.num_clients < 1:
            raise ValueError(f"scaffold: num_clients must be >= 1, got {self.num_clients}")

    def _controlled(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Zeros shaped as the parameters that train (the control variates' support)."""
        return {
            n: torch.zeros_like(p.detach())
            for n, p in model.named_parameters()
            if not self.is_frozen(n)
        }

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        state = super().init_server(model, rng)
        zeros = with_prefix(self._controlled(model), CONTROL)
        return State(arrays={**state.arrays, **zeros}, values=dict(state.values))

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        msg = super().broadcast(state, rnd, client_id)
        c = select(state.arrays, CONTROL, strip=False)
        return Broadcast(arrays={**msg.arrays, **c}, config=msg.config)

    def expected_reply(self, state: State, rnd: int, client_id: int | None = None) -> ReplySpec:
        spec = super().expected_reply(state, rnd, client_id)
        for k, v in select(state.arrays, CONTROL).items():
            spec[DCONTROL + k] = (tuple(v.shape), self.wire_spec(v.dtype))
        return spec

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """K corrected SGD steps from ``x``; returns (``update.*`` = Δy and ``dcontrol.*`` =
        Δc_i with FedAvg's metrics, the client state with ``control.*`` = c_i+)."""
        start, keep = self.dense_start(msg, state, model)
        c = select(msg.arrays, CONTROL)
        held = select(state.arrays, CONTROL) if state is not None else {}
        mine = {k: held[k].to(v) if k in held else torch.zeros_like(v) for k, v in c.items()}
        shift = {k: c[k] - mine[k] for k in c}
        terms = [*self.loss_terms(start), correction_term(shift)]
        steps: list[int] = []  # the steps taken: a step skipped for a non-finite loss moved nothing

        def record(_model: nn.Module, k: int) -> None:
            steps.append(k)

        reply, lrs = self.train_locally(msg, start, model, data, rng, terms, on_grad=[record])
        taken = float(sum(lrs[k] for k in steps))
        trained = dict(model.named_parameters())
        new = {
            k: mine[k] - c[k] + (start[k].to(v) - trained[k].detach().to(v)) / taken
            if taken > 0
            else mine[k]  # no step taken: nothing learnt about the client's drift
            for k, v in c.items()
        }
        delta = {k: (new[k] - mine[k]).contiguous() for k in c}
        arrays = {**reply.arrays, **with_prefix(delta, DCONTROL)}
        kept = State(arrays={**keep.arrays, **with_prefix(new, CONTROL)}, values=dict(keep.values))
        return Reply(arrays=arrays, metrics=reply.metrics), kept

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        """FedAvg's step of ``x``, then ``c <- c + (|S| / N) Σ p_i Δc_i / Σ p_i`` over the
        accepted replies (``p_i`` 1 or ``n_i`` by ``weighting``: the paper's
        ``(1 / N) Σ Δc_i`` under uniform weights)."""
        new, metrics = super().aggregate(state, replies, rnd)
        c = select(state.arrays, CONTROL)
        ok = [r for _, r in replies if r is not None]
        if ok:
            uniform = self.train.weighting == "uniform"
            p = [1.0 if uniform else float(r.num_examples) for r in ok]
            scale = len(ok) / (self.num_clients * sum(p))
            for r, w in zip(ok, p, strict=True):
                dc = select(r.arrays, DCONTROL)
                c = {k: v + (scale * w) * dc[k].to(v) for k, v in c.items()}
        return State(arrays={**new.arrays, **with_prefix(c, CONTROL)}, values=new.values), metrics
