"""FedDyn (Acar, Zhao, Matas Navarro, Mattina, Whatmough, Saligrama, "Federated Learning Based on
Dynamic Regularization", ICLR 2021): FedAvg whose clients' local objectives carry a dynamic
regularizer that makes their stationary points agree with the global objective's.

Client ``k`` holds its gradient state ``h_k`` (the paper's ``∇L_k(θ_k^{t-1})``; zero at its first
contact) in its client state; the server holds the global model ``θ`` and its own state ``h``
(zero at the start). A round (the paper's Algorithm 1):

* the server sends ``θ^{t-1}`` (only the model: FedAvg's bytes down);
* the client starts at ``θ^{t-1}`` and takes the run's K local steps on
  ``L_k(θ) - <h_k, θ - θ^{t-1}> + (α / 2) ||θ - θ^{t-1}||²`` (the paper's linear term anchored at
  ``θ^{t-1}``: the same gradient ``∇L_k(θ) - h_k + α (θ - θ^{t-1})``, and a reported
  ``train_loss`` that starts at the task loss), an approximate minimization as in the paper's
  experiments;
* it keeps ``h_k <- h_k - α (θ_k^t - θ^{t-1})`` (the first-order condition of its objective at
  ``θ_k^t``) and uploads ``Δ_k = θ_k^t - θ^{t-1}`` (``update.*``, FedAvg's bytes up);
* the server sets ``h <- h - α (|P| / N) Σ_{k ∈ P} p_k Δ_k / Σ_{k ∈ P} p_k`` over the round's
  accepted clients ``P`` (``N`` the federation's clients, ``num_clients``) and
  ``θ^t = θ^{t-1} + mean Δ - h / α``, the mean of the ``θ_k^t`` corrected by ``h``.

Weights ``p_k``: under ``weighting: uniform`` (the paper's) ``p_k = 1``, so ``h`` moves by
``(α / N) Σ_{k ∈ P} Δ_k`` and ``θ^t = (1 / |P|) Σ θ_k^t - h / α``, Algorithm 1 to the letter, and
``h`` stays the mean of all N clients' ``h_k``. Under ``num_examples`` (fedlore's default),
``p_k = n_k``: the model's mean is FedAvg's example-weighted one, and ``h`` moves by the same
weighted mean scaled by ``|P| / N`` (SCAFFOLD's rule for its ``c``), so under full participation
``h`` is the example-weighted mean of the ``h_k`` and the fixed point (``h = 0``,
``h_k = ∇L_k(θ)``) is the example-weighted optimum ``Σ_k n_k ∇L_k(θ) = 0`` (with a uniform ``h``
it would be the uniform one). The authors' code (``alpemreacar/FedDyn``, ``train_FedDyn``)
reaches the weighted objective otherwise, with a uniform server and a per-client
``α_k = α n̄ / n_k`` (``n̄`` the mean size over all clients, which no fedlore client knows).
``h`` leaves out a straggler's ``work_share`` (the model's mean keeps it, as FedAvg's does): the
client moves its ``h_k`` by its whole ``Δ_k``.

Defaults and details, checked against the authors' code: ``α = 0.01`` (``alpha_coef = 1e-2`` in
both of its examples, CIFAR-10 and synthetic); local SGD whose ``optim.weight_decay`` is an L2
term, as its ``weight_decay`` (it puts ``α θ`` into SGD's weight decay and the rest of the
quadratic into a linear term; here both are one loss term, so ``optim.grad_clip`` clips them
with the task gradient, where the authors' clip comes before SGD's decay adds ``α θ``); the
server's model ``θ^t`` (``cld_model``, the one broadcast) is the global model fedlore evaluates
(the authors' scripts also report the plain mean of the clients' models). ``h`` and ``h_k`` cover
the parameters that train (a frozen tensor, a buffer such as BatchNorm's running statistics, is
plainly averaged). ``local_optimizer`` stays FedAvg's setting (SGD by default, as the authors';
``adamw`` is accepted: the state update is the objective's first-order condition, whatever
minimizes it, though AdamW's decoupled decay then joins the objective).

Bytes per round: FedAvg's each way (the model down, ``Δ_k`` up); the client keeps one
model-sized ``h_k`` and the server one ``h``. A client keeps its new ``h_k`` even when its reply
is rejected or lost (it cannot know), which leaves ``h`` short of that change, as SCAFFOLD's
``c``. Not offered under DP, nor with a robust aggregate, 16-bit transport or a server optimizer:
each would put into ``h`` something other than what the clients' ``h_k`` moved by (a clipped and
noised sum, rounded deltas, a trimmed mean), and ``h``, a running sum the model subtracts as
``h / α``, keeps that error for good. Secure aggregation alone would give the server the sum it
needs (``Σ p_k Δ_k``, ``Σ p_k`` and ``|P|``), but no test covers FedDyn under it yet, so it is
refused with DP (one capability field).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import nn

from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import from_wire, select, with_prefix
from fedlore.train.local import LossTerm, parameter_term
from fedlore.types import Broadcast, Reply, Scalars, State

DYN = "dyn."
"""The gradient states: the server's ``h`` (server state) and client ``k``'s ``h_k`` (client
state), by parameter name."""


def dynamic_term(
    anchor: dict[str, torch.Tensor], grad: dict[str, torch.Tensor], alpha: float
) -> LossTerm:
    """FedDyn's regularizer ``Σ_p -<h_p, θ_p - a_p> + (α / 2) ||θ_p - a_p||²`` over the parameters
    named in ``anchor`` (``a``: the round's ``θ^{t-1}``; ``h``: the client's ``grad``): its
    gradient adds ``α (θ - a) - h`` to the task gradient; its value is 0 at the anchor."""
    fixed = {k: v.detach().clone() for k, v in anchor.items()}
    held = {k: v.detach().clone() for k, v in grad.items()}

    def part(name: str, p: nn.Parameter) -> torch.Tensor:
        d = p - fixed[name].to(p)
        return (0.5 * alpha * d.pow(2) - held[name].to(p) * d).sum()

    return parameter_term(fixed, part)


@register_algorithm("feddyn")
@dataclass(frozen=True)
class FedDyn(FedAvg):
    """FedDyn (module docstring). Hyperparameters beyond FedAvg's:

    Attributes:
        alpha: α > 0, the dynamic regularizer's weight: the quadratic ``(α / 2) ||θ - θ^{t-1}||²``
            of the local objective, the step ``h_k <- h_k - α Δ_k`` of the client's gradient
            state, and the server's correction ``θ^t = mean θ_k - h / α``. Default 0.01, the
            authors' (``alpha_coef = 1e-2`` in ``alpemreacar/FedDyn``'s examples).
        num_clients: N, the federation's clients (config ``num_clients``): ``h`` moves by
            ``(|P| / N)`` times the round's mean ``-α Δ_k``.
    """

    name: ClassVar[str] = "feddyn"
    capabilities = replace(
        FedAvg.capabilities,
        synchronous_only=(
            "its server's gradient state h assumes every delta is of the current round's model"
        ),
        compress_uploads=False,
        sum_aggregable=False,
        transport_16bit=False,
        robust_aggregate=False,
        server_optimizer=False,
        individual_uploads=(
            "its server state h, a running sum of the uploads that the model subtracts as "
            "h / alpha, must move as the clients' own states h_k do: DP's clipped, noised sum "
            "would stay in it for good, and under secure aggregation alone (whose sum would "
            "do) FedDyn is not tested yet"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    alpha: float = 0.01
    num_clients: int = field(default=10, metadata={"config": "num_clients"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.alpha > 0:
            raise ValueError(
                "feddyn: alpha must be > 0 (the dynamic regularizer's weight; the server "
                f"divides h by it), got {self.alpha!r}"
            )
        if self.num_clients < 1:
            raise ValueError(f"feddyn: num_clients must be >= 1, got {self.num_clients}")

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        state = super().init_server(model, rng)
        zeros = {
            n: torch.zeros_like(p.detach())
            for n, p in model.named_parameters()
            if not self.is_frozen(n)
        }
        return State(arrays={**state.arrays, **with_prefix(zeros, DYN)}, values=dict(state.values))

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """K local steps on the regularized objective from ``θ^{t-1}``; returns (``update.*`` =
        Δ_k with FedAvg's metrics, the client state with ``dyn.*`` = the new h_k)."""
        start, keep = self.dense_start(msg, state, model)
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        held = select(state.arrays, DYN) if state is not None else {}
        anchor = {k: start[k].detach().to(p).clone() for k, p in trained.items()}
        mine = {
            k: held[k].to(p) if k in held else torch.zeros_like(p.detach())
            for k, p in trained.items()
        }
        terms = [*self.loss_terms(start), dynamic_term(anchor, mine, self.alpha)]
        reply, _ = self.train_locally(msg, start, model, data, rng, terms)
        now = dict(model.named_parameters())
        new = {k: (mine[k] - self.alpha * (now[k].detach() - anchor[k])).contiguous() for k in mine}
        kept = State(arrays={**keep.arrays, **with_prefix(new, DYN)}, values=dict(keep.values))
        return reply, kept

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        """FedAvg's mean of the ``θ_k`` (``θ^{t-1} + mean Δ``), then
        ``h <- h - α (|P| / N) Σ p_k Δ_k / Σ p_k`` (``p_k`` 1 or ``n_k`` by ``weighting``,
        without a straggler's work share) and ``θ^t = mean θ_k - h / α``. A round without an
        accepted reply changes nothing."""
        new, metrics = super().aggregate(state, replies, rnd)
        ok = [r for _, r in replies if r is not None]
        if not ok:
            return new, metrics
        h = select(state.arrays, DYN)
        dtypes = {k: v.dtype for k, v in select(state.arrays, "model.").items()}
        uniform = self.train.weighting == "uniform"
        p = [1.0 if uniform else float(r.num_examples) for r in ok]
        scale = self.alpha * len(ok) / (self.num_clients * sum(p))
        for r, w in zip(ok, p, strict=True):
            delta = from_wire(select(r.arrays, "update."), dtypes)
            h = {k: v - (scale * w) * delta[k].to(v) for k, v in h.items()}
        model = select(new.arrays, "model.")
        fixed = {k: model[k] - h[k].to(model[k]) / self.alpha for k in h}
        arrays = {**new.arrays, **with_prefix(fixed, "model."), **with_prefix(h, DYN)}
        return State(arrays=arrays, values=new.values), metrics
