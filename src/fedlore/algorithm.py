"""The Algorithm protocol: four methods over explicit state and plain messages.

Methods (side: takes -> returns):

* ``init_server`` (server): model, rng -> State
* ``broadcast`` (server): State, round, client id -> Broadcast
* ``client_update`` (client): Broadcast, client State or None, model, data, rng -> (Reply, State)
* ``aggregate`` (server): State, [(client id, Reply or None)], round -> (State, metrics)

What a method can do is one frozen record, :class:`Capabilities`, in the class attribute
``capabilities`` (the base :class:`~fedlore.algorithms.base.Hyper` holds the defaults). A subclass
changes it with :func:`dataclasses.replace`::

    capabilities = replace(FedAvg.capabilities, sum_aggregable=False, server_data=True)

Inheritance is plain and explicit: a class that does not assign ``capabilities`` in its own body
has its parent's record, every field of it, and a class that assigns one has exactly what its
``replace(...)`` says. So a subclass that uploads other tensors than its parent, or uses them
otherwise on the server, must withdraw the claims that no longer hold (typically
``sum_aggregable=False, transport_16bit=False``); ``tests/algorithms/test_capabilities.py``
holds every registered method's record. A value that depends on hyperparameters (FedLore's
``setup_rounds``, FedMask's ``min_clients``) comes from the instance method ``caps()``, which
returns the class record by default and is overridden as
``replace(super().caps(), setup_rounds=...)``. :mod:`fedlore.checks` is the one reader of the
fields; everything else asks its functions (``checks.setup_rounds(algo)``, ...).

A method with ``server_data`` trains on the server's unlabeled set U (``data.server_fraction``;
FedBE's distillation). The run then calls ``init_server(model, rng, unlabeled=U)`` with U's
inputs ``[n_U, ...]`` (never labels) through :func:`fedlore.experiment_parts.start_server`, which
refuses a config without U with a ``ConfigError`` naming ``data.server_fraction``. Such a method
keeps U in its server ``State`` (so it is checkpointed and resumed with it) under a key that
``broadcast`` never sends (``server.unlabeled``). Every method of a config is trained on the same
clients' data whether or not it uses U: U is held out of the clients' data for all of them.

Setup exchanges (``setup_rounds`` > 0) run before round 0, numbered -setup_rounds .. -1
(FedLore's gradient-based P^0); they are counted in the byte totals.

A method may add a *query exchange* after aggregation (HeteroFL's static batch norm): an
optional ``query(state, round, client id) -> Broadcast | None`` and ``absorb_query(state,
[(client id, Reply or None)], round) -> (State, metrics)``. On the rounds that evaluate the
global model (and the last), the round loop sends each of the round's clients its query (None:
none) over the transport, whose ``client_update`` answers it, and hands the replies to
``absorb_query``; its bytes are counted in the round's ``bytes_up`` / ``bytes_down`` and alone
in ``query_bytes_up`` / ``query_bytes_down``.

Besides its capabilities a method declares ``per_client_metrics`` (default none): reply metrics
the round loop records per client (``{client id: value}``) in each round's row, e.g.
Meta-BayFL's chosen learning rate.

The server checks every reply against ``expected_reply`` (keys, shapes, dtypes, finite values)
before ``aggregate`` sees it. A method whose uploads need more than that may define
``reply_problem(state, rnd, client_id, reply) -> str | None`` (optional, not part of the
protocol): the round loop calls it on each reply that passed and rejects the reply with the
reason it returns (FedFull's compressed uploads: top-k indices in range and distinct, QSGD codes
within the levels, norms >= 0), so ``aggregate`` never decodes a malformed one.

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
reading the global model. FedPer and FedBN (:mod:`fedlore.algorithms.partial`) keep only some
tensors of the model per client (``personal.<name>``, the rest is the global model's), score the
model a client has just trained P-local, and declare ``keeps_layers_local``; so does FedRep
(:mod:`fedlore.algorithms.fedrep`), which trains FedPer's head and body one after the other.
APFL (:mod:`fedlore.algorithms.apfl`) keeps a local model and a mixing weight per client
(``personal.*``, ``apfl.alpha``) but its personalized model mixes in the client's trained copy of
the global model, so it scores P-local in ``client_update`` instead of through ``Personalized``;
Per-FedAvg (:mod:`fedlore.algorithms.perfedavg`) keeps nothing and scores the received global
model after a step of personalization.

``aggregate`` receives no model. A server that needs one (FedBE distils into a student) may keep
a deep copy of the model handed to ``init_server`` as its server-side scratch workspace, under
the same rule: it loads every tensor it relies on from the server state before each use, so the
result of ``aggregate`` depends only on (state, replies, round), and a resumed run, whose
``init_server`` ran on a fresh model, gives the same result. Randomness in ``aggregate`` comes
from a seed drawn from ``init_server``'s rng and stored in the state, combined with the round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from fedlore.types import Broadcast, Reply, Scalars, State

if TYPE_CHECKING:
    from fedlore.data.client_data import ClientData


@dataclass(frozen=True)
class Capabilities:
    """What a method can do: one record per method class (see the module doc for how it is
    inherited and changed). Read only by :mod:`fedlore.checks`.

    Attributes:
        setup_rounds: exchanges the method runs before round 0, numbered -setup_rounds .. -1
            (FedLore's gradient-based P^0: 1; a random or fixed P^0: 0).
        sum_aggregable: the server needs only the weighted sums ``Σ p_i x_i`` and ``Σ p_i`` of
            the uploads ``x_i`` (every reply array), so the method runs under secure aggregation
            and central DP (:mod:`fedlore.privacy`) and accepts ``upload_increments``.
        individual_uploads: why a method that is not ``sum_aggregable`` needs each client's
            upload (the reason a run under ``secure_aggregation`` or ``dp``, or
            ``upload_increments=True``, is refused with).
        no_dp: why a ``sum_aggregable`` method still refuses DP (central and local): the
            reason ``dp`` is refused with while ``secure_aggregation`` alone runs (SCAFFOLD:
            its control variate would keep every round's noise); empty: DP applies.
        transport_16bit: the method casts what it sends to ``transport_dtype``, so a 16-bit
            setting (``fp16``, ``bf16``) is accepted; otherwise only ``fp32``.
        robust_aggregate: the server averages dense deltas, so ``robust.aggregate: median |
            trimmed_mean`` applies to it; otherwise only ``mean``.
        server_optimizer: the server adds the step of :class:`fedlore.optim.server.ServerOpt`
            to the global model, taken from its averaged dense delta (``server.*``: FedAvgM,
            FedAdagrad, FedAdam, FedYogi); otherwise only ``sgd`` at lr 1 (FedAvg's step).
        compress_uploads: the method's clients can encode their dense deltas with
            ``compression`` (top-k with error feedback, QSGD; :mod:`fedlore.compression`) and its
            server decodes them before averaging; otherwise only ``compression: none``.
        server_data: the method trains on the server's unlabeled set U (``init_server`` takes
            ``unlabeled``; the config must hold U out with ``data.server_fraction``).
        regression: the method is defined for regression data (False: it needs class
            probabilities, e.g. FedBE's pseudo-labels).
        min_clients: the fewest clients per round the method needs (FedMask: ``min_overlap``);
            a config that samples fewer is refused.
        projects: the matrices the method trains in a low-rank subspace (its ``plan(model)``,
            each with a ``rank``), with one basis per matrix for all clients (``"shared"``:
            FedLore and its variants) or one per client (``"client"``: Local GaLore); None: it
            projects nothing. The diagnostics measure the bases accordingly.
        adapts: the method trains LoRA adapters on the matrices its ``targets(model)`` names
            (each of its ``rank``) instead of the matrices themselves.
        keeps_layers_local: every client keeps some tensors of the model to itself and never
            uploads them (FedPer's and FedRep's head, FedBN's BatchNorm layers;
            :mod:`fedlore.algorithms.partial`), so the server's copy of them stays at its
            initialization: the global model's scores (G-central, G-local) are of a model no
            client uses, and the method's result is each client's model, scored P-local
            (``eval.local``; a run without it is warned).
        synchronous_only: why the method refuses buffered asynchronous aggregation
            (``asynchronous.buffer``, FedBuff: :mod:`fedlore.engine.buffered`), which adds a
            staleness-weighted mean of deltas computed from older global models; empty: it
            runs under it (FedFull, FedAvg, FedProx).
    """

    setup_rounds: int = 0
    sum_aggregable: bool = False
    individual_uploads: str = (
        "its server uses each client's upload on its own, not only their weighted sum"
    )
    no_dp: str = ""
    transport_16bit: bool = False
    robust_aggregate: bool = False
    server_optimizer: bool = False
    compress_uploads: bool = False
    server_data: bool = False
    regression: bool = True
    min_clients: int = 1
    projects: Literal["shared", "client"] | None = None
    adapts: bool = False
    keeps_layers_local: bool = False
    synchronous_only: str = (
        "its server does not step by a weighted mean of plain model deltas, which is all that "
        "buffered asynchronous aggregation (FedBuff) combines"
    )


ASYNC_UNTESTED = (
    "buffered asynchronous aggregation (FedBuff) is implemented and tested for fedfull, fedavg "
    "and fedprox only"
)
"""The ``synchronous_only`` of FedAvg's subclasses with no deeper reason of their own."""


@runtime_checkable
class Algorithm(Protocol):
    """A federated method. Implementations are frozen dataclasses of hyperparameters."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    """What the method can do (:class:`Capabilities`); ``caps()`` is the record that counts."""
    per_client_metrics: ClassVar[tuple[str, ...]]
    """Reply metrics the round loop records per client (empty: none)."""

    def caps(self) -> Capabilities:
        """This method's :class:`Capabilities`: the class record with the fields that depend on
        hyperparameters (``setup_rounds``, ``min_clients``) filled in."""
        ...

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        """Build the round-0 server state from the initial model weights. A method with
        ``server_data`` (:class:`Capabilities`) also takes ``unlabeled``: the server's U (see
        the module doc)."""
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
