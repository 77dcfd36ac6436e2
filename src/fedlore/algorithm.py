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

An algorithm may declare ``min_clients_per_round`` (default 1): a config that samples fewer
clients per round is refused when the method is built (:func:`fedlore.checks.check_min_clients`;
FedMask's overlap rule keeps nothing with fewer than ``min_overlap`` clients).

An algorithm may declare ``needs_server_data = True`` (default False): it trains on the server's
unlabeled set U (``data.server_fraction``; FedBE's distillation). The run then calls
``init_server(model, rng, unlabeled=U)`` with U's inputs ``[n_U, ...]`` (never labels) through
:func:`fedlore.experiment_parts.start_server`, which refuses a config without U with a
``ConfigError`` naming ``data.server_fraction``. Such a method keeps U in its server ``State``
(so it is checkpointed and resumed with it) under a key that ``broadcast`` never sends
(``server.unlabeled``). Every method of a config is trained on the same clients' data whether or
not it uses U: U is held out of the clients' data for all of them.

The algorithm object holds only hyperparameters (a frozen dataclass; a server workspace, below,
is the one exception). The model handed to ``init_server`` and ``client_update`` is a scratch
workspace: an algorithm must load every parameter and buffer it relies on from the message or the
client state, so a reply never depends on which clients used the workspace before. A method
whose model differs from the registered one (a Bayesian or MC-dropout twin,
:mod:`fedlore.algorithms.bayes`) converts the workspace in place, idempotently, in
``init_server`` and ``client_update``; ``global_arrays`` then names the converted model's tensors.

A personalized method (pFedMe, Ditto, FedFomo, pFedBayes, FedMask) keeps each client's personal
model in that client's state under ``personal.*`` (never in a reply) and mixes in
:class:`fedlore.algorithms.personal.Personalized`, whose ``evaluate_personal(state, model, data)``
scores the personal model of a client state on the client's own test split (P-local) without
reading the global model.

``aggregate`` receives no model. A server that needs one (FedBE distils into a student) may keep
a deep copy of the model handed to ``init_server`` as its server-side scratch workspace, under
the same rule: it loads every tensor it relies on from the server state before each use, so the
result of ``aggregate`` depends only on (state, replies, round), and a resumed run, whose
``init_server`` ran on a fresh model, gives the same result. Randomness in ``aggregate`` comes
from a seed drawn from ``init_server``'s rng and stored in the state, combined with the round.
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
        """Build the round-0 server state from the initial model weights. A method with
        ``needs_server_data`` also takes ``unlabeled``: the server's U (see the module doc)."""
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
