"""The Algorithm protocol: four methods over explicit state and plain messages.

Methods (side: takes -> returns):

* ``init_server`` (server): model, rng -> State
* ``broadcast`` (server): State, round, client id -> Broadcast
* ``client_update`` (client): Broadcast, client State or None, model, data, rng -> (Reply, State)
* ``aggregate`` (server): State, [(client id, Reply or None)], round -> (State, metrics)

An algorithm may declare ``per_client_metrics`` (default none): reply metrics the round loop
records per client (``{client id: value}``) in each round's row, e.g. Meta-BayFL's chosen
learning rate. An algorithm may declare ``setup_rounds`` (default 0): that many exchanges run
before round 0, numbered -setup_rounds .. -1 (FedLore's gradient-based P^0); they are counted in
the byte totals.

The algorithm object holds only hyperparameters (a frozen dataclass). The model handed to
``init_server`` and ``client_update`` is a scratch workspace: an algorithm must load every
parameter and buffer it relies on from the message or the client state, so a reply never depends
on which clients used the workspace before. A method whose model differs from the registered one
(a Bayesian or MC-dropout twin, :mod:`fedlore.algorithms.bayes`) converts the workspace in place,
idempotently, in ``init_server`` and ``client_update``; ``global_arrays`` then names the
converted model's tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from fedlore.types import Broadcast, Reply, Scalars, State

if TYPE_CHECKING:
    from fedlore.data.client_data import ClientData


@runtime_checkable
class Algorithm(Protocol):
    """A federated method. Implementations are frozen dataclasses of hyperparameters."""

    name: ClassVar[str]

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        """Build the round-0 server state from the initial model weights."""
        ...

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        """The message client ``client_id`` receives at round ``rnd`` (0-based)."""
        ...

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """Local training. ``state`` is None at a client's first contact."""
        ...

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        """Combine round ``rnd``'s replies into the next server state.

        ``replies`` has one entry per sampled client; ``None`` marks a client whose reply was
        lost or rejected (it must not enter the model).
        """
        ...

    def global_arrays(self, state: State) -> dict[str, torch.Tensor]:
        """The global model's parameters and buffers (names of ``model.state_dict()``)."""
        ...

    def expected_reply(
        self, state: State, rnd: int, client_id: int | None = None
    ) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Key -> (shape, dtype) of a valid reply at round ``rnd`` from ``client_id``; used to
        reject bad uploads. Methods whose reply shapes differ per client (heterogeneous LoRA
        ranks) need the id; the others ignore it."""
        ...
