"""Partial personalization: FedAvg in which every client keeps some tensors of the model to itself.

* **FedPer** (Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization
  Layers", arXiv:1912.00818, 2019): the *base* layers are federated with FedAvg, the
  *personalization* layers stay on each client (``personal_layers``, default ``["head.*"]``: the
  classifier every fedlore model names ``head``).
* **FedBN** (Li, Jiang, Zhang, Kamp, Dou, "FedBN: Federated Learning on Non-IID Features via Local
  Batch Normalization", ICLR 2021; ``med-air/FedBN``): FedAvg except that every BatchNorm layer's
  parameters and running statistics (``weight``, ``bias``, ``running_mean``, ``running_var``,
  ``num_batches_tracked``) stay local. The layers are found by module type
  (``nn.modules.batchnorm._BatchNorm``), not by a ``"bn"`` in their names as in the authors'
  code (fedlore's ResNets name theirs ``norm1``, ``stem_norm``).

One implementation, :class:`PartialFedAvg`; a method is the rule that names the *kept-local*
tensors L of the model (``state_dict`` names: parameters and buffers). A round:

* **server**: the global model W; its L part is the initialization and never changes. It sends
  the whole model to a client that has not replied yet (its first contact, or after a lost or
  rejected reply: value ``seen.<cid>`` unset, FedAvg's ``params.freeze`` mechanism) and only the
  shared part afterwards. The L part carries no information after the first contact (it never
  changes) and the client holds its own, so it is not sent again.
* **client**: loads the received model and lays its own L tensors over it from its state
  (``personal.<name>``; at first contact it has none and keeps the received ones, the server's
  initialization); trains every parameter as FedAvg does (SGD, K steps, its own BatchNorm
  statistics moving in training mode); uploads ``update.* = W_K - W^t`` of the shared tensors only
  and keeps its new L tensors as ``personal.*``.
* **server**: ``W_shared <- W_shared + Σ p_i Δ_i / Σ p_i`` (FedAvg's :class:`DenseServer`: its
  weights, server optimizer and robust combination act on the shared tensors only).
  ``expected_reply`` lists the shared tensors, so a reply that carries an L tensor, or lacks a
  shared one, is rejected before it reaches ``aggregate``.

L is resolved on the real model where both sides have it: by ``init_server``, which records it
in the server state (values ``local.<name>``: ``expected_reply`` and ``broadcast`` read it
there), and by each client from its own copy of the model. A pattern that matches no tensor, an L
holding every trained parameter (nothing federated: local training), an L that overlaps
``params.freeze``, and FedBN's default on a model without BatchNorm (it would be FedAvg) are
refused, naming the patterns and some tensor names.

Scores. The method's product is each client's model, its own L with the shared part; P-local
(``eval.local``) scores the model the client has just trained in the run's last round (the shared
part after its local steps and its L), as FedAvg's P-local scores its fine-tuned model. The
authors' FedBN code scores each client after the round's averaging instead (averaged shared part,
local BN); fedlore's clients are not called after the last aggregation. The global model
(G-central, G-local) holds the server's initial L: a random head under FedPer, identity
BatchNorm (running mean 0, variance 1) under FedBN, so its scores are of a model no client uses
(:attr:`~fedlore.algorithm.Capabilities.keeps_layers_local`; a run without ``eval.local`` is
warned).

Bytes: up, the shared part only; down, the whole model at a client's first contact, the shared
part afterwards. The client keeps L (a head, the BatchNorm tensors) in its state.

Secure aggregation, central and local DP (FedAvg's
:attr:`~fedlore.algorithm.Capabilities.sum_aggregable`): a reply holds the shared tensors'
increments and nothing of L, so what a client masks, the norm DP clips to C and the coordinates
that get noise are the shared tensors, every one of them and only them. A client's L is neither
clipped nor noised (it never leaves the client), and the server's stays the initialization. A
shared BatchNorm's integer ``num_batches_tracked`` (FedPer's body on a BatchNorm model) stays out
of the upload there (:meth:`~fedlore.algorithms.dense.DenseServer.uploads`); FedBN keeps every
BatchNorm tensor local anyway. P-local, the method's score, is then a measurement taken outside
the mechanism (``eval.local``, docs/explanation/privacy.md).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from fedlore.algorithm import ASYNC_UNTESTED
from fedlore.algorithms.base import ReplySpec
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.algorithms.personal import PERSONAL, personal_arrays
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import select, with_prefix
from fedlore.types import Broadcast, Reply, Scalars, State

LOCAL = "local."
"""Server-state values ``local.<name>`` = 1: the tensors the clients keep (resolved at init)."""
UPDATE = "update."
MODEL = "model."


def batchnorm_tensors(model: nn.Module) -> list[str]:
    """The ``state_dict`` names of every tensor of every BatchNorm module of ``model``
    (``nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm; their weight, bias,
    running_mean, running_var and num_batches_tracked, those the module has), in ``state_dict``
    order."""
    found: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            lead = f"{prefix}." if prefix else ""
            found.update(lead + k for k in module.state_dict())
    return [n for n in model.state_dict() if n in found]


def _some(names: list[str], k: int = 6) -> str:
    """Up to ``k`` names, for a message: ``[a, b, ...] (n tensors)``."""
    more = ", ..." if len(names) > k else ""
    return f"[{', '.join(names[:k])}{more}] ({len(names)} tensors)"


@dataclass(frozen=True)
class PartialFedAvg(FedAvg):
    """FedAvg whose clients keep the tensors L to themselves (module docstring); FedPer and FedBN
    are its two registered rules. Not registered itself.

    Attributes:
        personal_layers: glob patterns (``fnmatch.fnmatchcase``) over the model's ``state_dict``
            names (parameters and buffers) of the tensors each client keeps; None: the method's
            own rule (FedBN: every BatchNorm layer's tensors).
    """

    name: ClassVar[str] = "partial"
    # sum_aggregable (FedAvg's): the uploads are the shared tensors' increments W_K - W^t and
    # the server adds their weighted mean; L is in no upload, so secure aggregation, DP's clip
    # and noise act on the shared tensors only (module docstring)
    capabilities = replace(
        FedAvg.capabilities,
        compress_uploads=False,
        keeps_layers_local=True,
        synchronous_only=ASYNC_UNTESTED,
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    default_rule: ClassVar[str] = ""
    """What the method keeps when ``personal_layers`` is None, for messages."""
    personal_layers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        pats = self.personal_layers
        if pats is None:
            return
        if isinstance(pats, str) or not pats or not all(isinstance(p, str) and p for p in pats):
            raise ValueError(
                f"{self.name}: personal_layers must be a non-empty list of glob patterns over "
                f"the model's tensor names (e.g. ['head.*']), got {pats!r}"
            )
        object.__setattr__(self, "personal_layers", tuple(pats))  # hashable, as from a config

    # ----------------------------------------------------------------- which tensors stay

    def default_local(self, model: nn.Module) -> list[str]:
        """The kept-local tensors when ``personal_layers`` is None (the method's own rule)."""
        raise ValueError(f"{self.name}: personal_layers must name the tensors the clients keep")

    def local_names(self, model: nn.Module) -> list[str]:
        """L, the ``state_dict`` names of ``model`` the clients keep, in ``state_dict`` order.

        Raises:
            ValueError: for a pattern that matches no tensor, an L that holds every trained
                parameter (nothing would be federated) or overlaps ``params.freeze``, or the
                method's own refusal (FedBN: no BatchNorm layer), naming the patterns and some
                tensor names.
        """
        names = list(model.state_dict())
        pats = self.personal_layers
        if pats is None:
            local = self.default_local(model)
            what = self.default_rule
        else:
            unused = [p for p in pats if not any(fnmatch.fnmatchcase(n, p) for n in names)]
            if unused:
                raise ValueError(
                    f"{self.name}: personal_layers pattern(s) {unused} match no tensor of the "
                    f"model (its tensors: {_some(names)})"
                )
            local = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in pats)]
            what = f"personal_layers={list(pats)}"
        chosen = set(local)
        frozen = [n for n in local if self.is_frozen(n)]
        if frozen:
            raise ValueError(
                f"{self.name}: {what} and params.freeze={list(self.train.freeze)} both name "
                f"{_some(frozen)}: a frozen tensor never trains, so keeping it local changes "
                "nothing; drop it from one of them"
            )
        shared = [
            n for n, _ in model.named_parameters() if n not in chosen and not self.is_frozen(n)
        ]
        if not shared:
            raise ValueError(
                f"{self.name}: {what} keeps every trained parameter of the model on the clients "
                f"({_some(local)}), so nothing would be federated (that is local training); "
                "name fewer tensors"
            )
        return local

    @staticmethod
    def local_of(state: State) -> set[str]:
        """L as recorded in the server state by :meth:`init_server`."""
        return {k[len(LOCAL) :] for k in state.values if k.startswith(LOCAL)}

    # ----------------------------------------------------------------------- server side

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        """FedAvg's state (the whole model, ``params.freeze`` checked) with L resolved on
        ``model`` and recorded as values ``local.<name>`` = 1."""
        state = super().init_server(model, rng)
        local = {LOCAL + n: 1 for n in self.local_names(model)}
        return State(arrays=state.arrays, values={**state.values, **local})

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        """The whole model at a client's first contact (and after a lost or rejected reply),
        the shared part afterwards: the server's L never changes and the client has its own."""
        msg = super().broadcast(state, rnd, client_id)
        if not state.values.get(f"seen.{client_id}"):
            return msg
        local = self.local_of(state)
        shared = {k: v for k, v in msg.arrays.items() if k[len(MODEL) :] not in local}
        return Broadcast(arrays=shared, config=msg.config)

    def expected_reply(self, state: State, rnd: int, client_id: int | None = None) -> ReplySpec:
        """FedAvg's ``update.*`` of the shared tensors only: a reply that carries a kept-local
        tensor, or lacks a shared one, is invalid."""
        local = self.local_of(state)
        spec = super().expected_reply(state, rnd, client_id)
        return {k: v for k, v in spec.items() if k[len(UPDATE) :] not in local}

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        """FedAvg's step of the shared tensors (L is in no reply, so it keeps its initial
        value); every client that replied is marked ``seen.<cid>`` (it holds its own L now)."""
        new, metrics = super().aggregate(state, replies, rnd)
        seen = {f"seen.{c}": 1 for c, r in replies if r is not None}
        return State(arrays=new.arrays, values={**new.values, **seen}), metrics

    # ----------------------------------------------------------------------- client side

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """FedAvg's local steps from the received shared part and the client's own L.

        Returns:
            (``update.*`` of the shared tensors with FedAvg's metrics, P-local of the trained
            model in the last round under ``eval.local``; the client state with
            ``personal.<name>`` = its L after training, and FedAvg's ``cache.*``).

        Raises:
            RuntimeError: when the server sent no L (the client has replied before) and the
                client state holds none (it was lost).
        """
        local = self.local_names(model)
        received = select(msg.arrays, MODEL)
        own = personal_arrays(state)
        lost = [k for k in local if k not in received and k not in own]
        if lost:
            raise RuntimeError(
                f"{self.name}: the server sent no kept-local tensors {lost[:3]} (this client has "
                "replied before) and the client state holds none (it was lost)"
            )
        mine = {k: own[k] if k in own else received[k] for k in local}
        start_msg = Broadcast(
            arrays=with_prefix({**received, **mine}, MODEL), config=dict(msg.config)
        )
        start, keep = self.dense_start(start_msg, state, model)
        reply, _ = self.train_locally(start_msg, start, model, data, rng, self.loss_terms(start))
        chosen = set(local)
        trained = {
            PERSONAL + k: v.detach().clone() for k, v in model.state_dict().items() if k in chosen
        }
        return reply, State(arrays={**keep.arrays, **trained}, values=dict(keep.values))

    def dense_update(
        self, model: nn.Module, start: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """FedAvg's ``update.*`` without the kept-local tensors: they never leave the client."""
        local = set(self.local_names(model))
        full = super().dense_update(model, start)
        return {k: v for k, v in full.items() if k[len(UPDATE) :] not in local}


@register_algorithm("fedper")
@dataclass(frozen=True)
class FedPer(PartialFedAvg):
    """FedPer (Arivazhagan et al. 2019): FedAvg of the base layers, the personalization layers
    kept on each client (module docstring).

    Attributes:
        personal_layers: glob patterns (``fnmatch.fnmatchcase``) over the model's ``state_dict``
            names of the personalization layers each client keeps (default ``["head.*"]``, the
            classifier; e.g. ``["head.*", "body.2.*"]`` for the last two layers of an MLP).
        local_optimizer: FedAvg's local optimizer (default ``"sgd"``, as FedAvg's).
        momentum: SGD momentum of the local steps (0: plain SGD).
    """

    name: ClassVar[str] = "fedper"
    # capabilities: PartialFedAvg's
    personal_layers: tuple[str, ...] | None = ("head.*",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.personal_layers is None:
            raise ValueError(
                f"{self.name}: personal_layers must name the personalization layers (default "
                "['head.*'], the classifier)"
            )


@register_algorithm("fedbn")
@dataclass(frozen=True)
class FedBN(PartialFedAvg):
    """FedBN (Li et al., ICLR 2021): FedAvg with every BatchNorm layer kept on each client, its
    parameters and running statistics (module docstring).

    Attributes:
        personal_layers: None (default): the tensors of every BatchNorm module of the model,
            found by type; a model without one is refused (FedBN would be FedAvg). Glob patterns
            over the ``state_dict`` names instead name the kept tensors themselves (e.g.
            ``["*.norm*"]`` to keep a ResNet's GroupNorm layers local), as for ``fedper``.
        local_optimizer: FedAvg's local optimizer (default ``"sgd"``, as ``med-air/FedBN``).
        momentum: SGD momentum of the local steps (0: plain SGD, as ``med-air/FedBN``).
    """

    name: ClassVar[str] = "fedbn"
    default_rule: ClassVar[str] = "its default (every BatchNorm layer)"
    # capabilities: PartialFedAvg's

    def default_local(self, model: nn.Module) -> list[str]:
        """Every BatchNorm layer's tensors (:func:`batchnorm_tensors`).

        Raises:
            ValueError: when the model has none (naming some of its tensors).
        """
        found = batchnorm_tensors(model)
        if not found:
            raise ValueError(
                "fedbn: the model has no BatchNorm layer, so FedBN would be FedAvg (its tensors: "
                f"{_some(list(model.state_dict()))}); use a model with BatchNorm (mlp with "
                "norm: batch, resnet20 with norm: batch) or name the tensors to keep in "
                "method.fedbn.personal_layers"
            )
        return found
