"""FedSLoP (He, Huang & Geng, "FedSLoP: Memory-Efficient Federated Learning with Low-Rank
Gradient Projection", arXiv 2604.24012, April 2026; code ``pkumelon/FedSLoP``, commit b7af998).

Sources, and what each gave. The paper's body (its algorithm box and numbered equations) is not
in the stored corpora this module was written from; only its abstract is (arxiv.org/abs and
arxiv.org/html/2604.24012v2, first section). So the update below is written from the
authors' public code and README, and the equations carry our own labels (S1)–(S6), each with
the file it comes from:

* the abstract: "stochastic low-rank subspace projections of gradients, thereby reducing the
  dimension of communicated and stored updates", "random subspace momentum methods";
* the README (Introduction): "at each communication round, the algorithm samples a fresh
  low-dimensional (Stiefel) subspace and constrains local stochastic gradients and momentum
  updates to this subspace. This reduces the effective dimension of optimizer state and update
  directions";
* ``code/algorithm.py``, class ``FedSLopAlgorithm`` (the authors' reference of the algorithm):
  ``P_t`` from a Gaussian matrix and QR, re-drawn every round from the seed ``random_state + t``;
  client momentum kept as ``r`` coordinates ``m_k^r`` that continue in the next round under the
  new ``P_{t+1}`` (its docstring, in Chinese); ``g_r = P_tᵀ g``, ``m <- μ m + g_r``,
  ``θ <- θ - η P_t m``; server momentum ``v <- μ v + (θ̄ - θ)``, ``θ <- θ + v``;
* ``code/experiment_mnist_federated_torch.py``, ``run_round_fedslop_torch`` (what produced the
  paper's MNIST numbers): one basis per weight matrix ``W`` (``out x in``) on its *input* side,
  ``A`` (``in x r``) from the QR of a Gaussian seeded by ``seed + 1000 t + layer``, the gradient
  projected as ``G A Aᵀ``; heavy-ball momentum ``v <- μ v + G_proj``, ``W <- W - η v``, kept per
  client across rounds; biases with plain momentum SGD; the server averages the clients' deltas
  (``server_lr`` 1, no server momentum); README runs: ``--fedslop_momentum 0.8``, lr 0.018.

Per projected matrix W (view ``m x n``, rank r; the view is ``Wᵀ`` by default, ``side="right"``,
so ``P`` spans the input dimension as in the authors' experiment code), round t:

* (S1) ``P^t = SharedBasis(s^t)``: a Haar-random orthonormal ``m x r`` basis (Gaussian, QR,
  ``diag(R) > 0``) from the round's seed ``s^t``, the same on the server and every client
  (FedLore-Random's :class:`~fedlore.algorithms.basis_rules.SeededRule`: only the seed travels);
* (S2) ``R = P^tᵀ G`` (``r x n``), ``G`` the view of the minibatch gradient at the local iterate;
* (S3) ``B <- μ B + R`` (``B``: the client's momentum, ``r x n``);
* (S4) ``W <- a_k W - η_k α P^t B``, ``Z <- a_k Z - η_k α B`` (``a_k = 1 - η_k λ``;
  :class:`~fedlore.optim.projected_adam.ProjectedMomentum`);
* (S5) upload ``Z_i`` (``r x n``): after K steps ``W_i^K = a W^t + P^t Z_i`` exactly, because
  every step moves W inside ``span(P^t)``; the server applies ``W^{t+1} = a W^t + P^t Σ p_i Z_i``
  and clients catch up from its increment log (FedLore-Random's server, bit-identical caches);
* (S6) the momentum crosses the subspace change into round t+1 by :attr:`FedSLoP.carry`:
  ``"keep"`` (default) keeps the coordinates ``B`` and applies them in ``P^{t+1}``, as
  ``FedSLopAlgorithm`` does; ``"project"`` maps them to ``P^{t+1}ᵀ P^t B``, the coordinates of
  the old direction's projection on the new subspace; ``"reset"`` starts from zero.

Unprojected tensors (biases, norms, the head) take ``b <- μ b + g``, ``D <- a_k D - η_k b`` with
full-shape buffers kept across rounds (the experiment code's bias rule), and travel as FedLore's.

Choices the sources leave open, and ours:

* Where the code and the abstract differ on the upload, the abstract wins: ``FedSLopAlgorithm``
  and the experiment code upload dense deltas (its docstring: communication the same as
  FedAvg-M), the abstract reduces "the dimension of communicated ... updates". Since the
  round's change lies in ``span(P^t)``, FedSLoP uploads the exact coordinates ``Z_i`` (``rn``
  per matrix) and downloads ``Σ p_i Z_i`` plus a seed.
* The momentum across rounds: the experiment code keeps a full-shape ``v`` (``mn`` per matrix,
  not the memory saving the paper claims, and an update outside ``span(P^t)``); the reference
  class keeps ``r``-dimensional coordinates and reuses them in the new basis. We keep ``r x n``
  coordinates, ``carry="keep"`` by default (the reference class and GaLore's convention),
  ``"project"`` and ``"reset"`` as options.
* The server: plain averaging (the experiment code) by default; the reference class's server
  momentum is ``server.optimizer: momentum`` with ``server.betas: [μ, ...]`` (FedLore's server
  step in the shared coordinates).
* The side (input dimension) and the basis law (Gaussian + QR) follow the experiment code; the
  scale ``α`` is 1 (neither source scales ``P Pᵀ``); the rank is the run's ``rank`` (the
  README's 112 of 128 and 784 input features); ``params.exclude`` keeps the head dense (the
  experiment code projects it too); μ = 0.8 (the README's runs; the code's default is 0.9).
* The inner optimizer is always the heavy ball: ``optim.name``, ``optim.betas`` and
  ``optim.eps`` do not apply.

Capabilities: FedLore-Random's: every upload is ``Z_i`` or an unprojected tensor, aggregated
linearly (secure aggregation and DP), 16-bit transport, server optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms.fedlore import FedLoreRandom
from fedlore.algorithms.lowrank import (
    OptState,
    ProjectedResult,
    optimizer_arrays,
    optimizer_from,
)
from fedlore.optim.projected_adam import ProjectedAdam, ProjectedMomentum
from fedlore.optim.subspace import MatrixSpec, SideRule
from fedlore.registry import register_algorithm
from fedlore.tensors import select
from fedlore.types import Arrays, State

MOMENTUM = "mom."
"""Client state prefix of the momentum buffers kept across rounds (``mom.momentum_buffer.<k>``)."""


def carried_momentum(
    buffer: torch.Tensor, old: torch.Tensor, new: torch.Tensor, carry: str
) -> torch.Tensor | None:
    """(S6): a projected momentum ``B`` (``r x n``, coordinates in the old basis ``old``,
    ``m x r``) as the next round starts in ``new`` (``m x r``): ``B`` itself (``"keep"``),
    ``newᵀ old B`` (``"project"``) or None (``"reset"``: from zero).

    Raises:
        ValueError: for an unknown ``carry``.
    """
    if carry == "keep":
        return buffer
    if carry == "project":
        rot = new.to(buffer.dtype).t() @ old.to(buffer.dtype)  # r x r
        return (rot @ buffer).contiguous()
    if carry == "reset":
        return None
    raise ValueError(f"unknown carry rule {carry!r}")


@register_algorithm("fedslop")
@dataclass(frozen=True)
class FedSLoP(FedLoreRandom):
    """FedSLoP: a fresh seeded random subspace per round, heavy-ball momentum in its coordinates
    carried across rounds, exact low-rank uploads (module docstring).

    Attributes:
        side: projection side rule; ``"right"`` by default: the basis spans each weight's input
            dimension (``in x r``), as the authors' experiment code projects ``G A Aᵀ``.
        momentum: μ in [0, 1), the heavy-ball coefficient of ``B <- μ B + Pᵀ G`` (and of the
            unprojected tensors' buffers); 0.8, the authors' README runs.
        carry: how a client's momentum crosses the round's change of subspace (S6):
            ``"keep"`` (its ``r x n`` coordinates reused in the new basis, the authors'
            ``FedSLopAlgorithm``), ``"project"`` (mapped to ``P^{t+1}ᵀ P^t B``) or
            ``"reset"`` (zero every round, for every tensor).
    """

    name: ClassVar[str] = "fedslop"
    # capabilities: FedLore-Random's (the same uploads and server; only the client optimizer
    # differs)
    side: SideRule = "right"
    momentum: float = 0.8
    carry: Literal["keep", "project", "reset"] = "keep"
    not_applicable: ClassVar[dict[str, str]] = {
        "optimizer": "its inner optimizer is always the heavy ball; momentum sets it",
        "betas": "Adam's betas; the heavy ball's coefficient is momentum",
        "eps": "Adam's epsilon; the heavy ball has none",
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"FedSLoP: momentum must be in [0, 1), got {self.momentum!r}")
        if self.carry not in ("keep", "project", "reset"):
            raise ValueError(f"FedSLoP: invalid carry={self.carry!r}")

    def projected_optimizer(
        self,
        dense: list[nn.Parameter],
        projected: list[tuple[nn.Parameter, MatrixSpec, torch.Tensor]],
    ) -> ProjectedAdam:
        """(S2)–(S4): :class:`~fedlore.optim.projected_adam.ProjectedMomentum` with μ, the
        run's lr and weight decay and this method's scale."""
        return ProjectedMomentum(
            dense,
            projected,
            lr=self.train.lr,
            momentum=self.momentum,
            weight_decay=self.train.weight_decay,
            scale=self.scale,
        )

    @property
    def keeps_optimizer_state(self) -> bool:
        """Every rule but ``"reset"`` keeps the momentum."""
        return self.carry != "reset"

    def optimizer_start(
        self, state: State | None, plan: dict[str, MatrixSpec], bases: Arrays
    ) -> dict[str, OptState] | None:
        """The momentum the round continues from: the client's buffers (copies) with each
        projected one carried from the basis it was built in (the client's ``basis.*``, its last
        round's) into this round's ``bases`` by :attr:`carry` (S6); None at first contact and
        under ``"reset"``."""
        if state is None or self.carry == "reset":
            return None
        start = optimizer_from(state, MOMENTUM)
        old = select(state.arrays, "basis.")
        for k in plan:
            buf = start.get(k, {}).get("momentum_buffer")
            if isinstance(buf, torch.Tensor) and k in old:
                carried = carried_momentum(buf, old[k], bases[k], self.carry)
                if carried is not None:
                    start[k]["momentum_buffer"] = carried
        return start

    def optimizer_keep(self, res: ProjectedResult) -> State:
        """Every buffer of the round's last step (``mom.momentum_buffer.<name>``), kept for the
        client's next round; nothing under ``"reset"``."""
        if self.carry == "reset":
            return State()
        return optimizer_arrays(res.opt_state, MOMENTUM)
