"""MOON (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021; official code
``QinbinLi/MOON``, ``main.py`` ``train_net_fedcon``): FedAvg whose clients add a model-contrastive
term to their local loss, pulling the representation their model learns toward the global
model's and away from their own previous model's.

The representation z is the input of the model's ``head`` module (every fedlore classifier
names its output layer ``head``), captured by a forward pre-hook: no change to the model. The
authors' models end with a projection MLP whose output feeds the last layer (``l3``) and is
their z: the same place. A model without a ``head`` module is refused.

Client i's local objective in round t (Eq. 4) is ``ℓ_sup(w; x, y) + μ ℓ_con``, with (Eq. 3)

    ℓ_con = -log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) ),

``z = R_w(x)`` from the model being trained, ``z_glob = R_{w^t}(x)`` from the received global
model and ``z_prev = R_{w_i^{t-1}}(x)`` from the client's own model after its previous round,
both frozen; ``sim`` is the cosine similarity (along the last dimension: per token for a language
model), and ℓ_con is averaged over the minibatch (the official code: cross entropy of
``[sim_glob, sim_prev] / τ`` against class 0). z_glob and z_prev come from copies of the model in
evaluation mode (BatchNorm's running statistics, no dropout), without gradients, as the official
code's ``global_net`` and previous nets (``eval()``, ``requires_grad = False``).

First contact. A client without a previous model uses the global model for it,
``z_prev = z_glob``: then ``ℓ_con = log 2`` whatever w, with no gradient, and the round is
FedAvg's (its ``train_loss`` carries ``μ log 2``). The MOON author's Flower baseline does this
(``adap/flower`` ``baselines/moon/moon/client.py``: ``prev_net`` is a copy of the received model
at a client's first fit). The original code (``main.py``) starts from an empty model pool, so
round 0 has no negative and ``ℓ_con = -log 1 = 0``: the same gradient, none. They differ for a
client first sampled after round 0 under partial participation: the original code's pool then
holds that client's own untrained network (``init_nets`` builds one per party); fedlore's client
has none and uses the global model. A pool of one previous model (``model_buffer_size`` 1, the
paper's and the code's default).

Defaults: ``τ = 0.5`` (the paper's and the code's ``--temperature``, from SimCLR) and ``μ = 1``
(the code's ``--mu`` default and the paper's choice on CIFAR-100 and Tiny-ImageNet; it picked 5
on CIFAR-10, and its README tunes μ over {0.001, 0.01, 0.1, 1, 5, 10}). The local optimizer is
FedAvg's (SGD at the run's lr, momentum and weight decay), not the code's SGD with momentum 0.9
and weight decay 1e-5, so that MOON gets the same optimizer as the FedAvg it is compared with.

Client state: ``prev.*``, the whole model (parameters and buffers) after local training, one
model-sized copy per client: counted in the client store's memory (``store.max_memory_mb``,
spilled past it), checkpointed, kept in Flower's ``Context.state``. A client keeps it even when
its reply is rejected or lost (it cannot know), as the Flower baseline saves it after training.
Each local step costs two more forward passes (the frozen copies), without backward.

Bytes: FedAvg's each way. The server is FedAvg's, so 16-bit uploads, the robust aggregates and
the server optimizers apply (tested), and so do secure aggregation, central and local DP: the
upload is FedAvg's increment of the model, clipped, noised and masked as FedAvg's, while the
previous model stays in the client state (it is never uploaded) and the contrastive term reaches
no one (it is inside ``train_loss``, which those modes do not send). Upload compression is
refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from fedlore.algorithm import ASYNC_UNTESTED
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import load_model_arrays, select, with_prefix
from fedlore.types import Broadcast, Reply, State

PREV = "prev."
"""Client state: the client's model after its previous round (``prev.<state_dict name>``)."""


def representation_layer(model: nn.Module) -> nn.Module:
    """The module whose input is MOON's representation z: the model's ``head``.

    Raises:
        ValueError: when the model has no ``head`` module, naming its top-level modules.
    """
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Module):
        names = [n for n, _ in model.named_children()]
        raise ValueError(
            "moon: the model has no `head` module; MOON contrasts the representation z, the "
            "input of the model's output layer, which it finds as the module named `head` "
            f"(as every fedlore classifier names it); this model's modules: {names[:8]}"
        )
    return head


def contrastive_loss(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, temperature: float
) -> torch.Tensor:
    """MOON's ℓ_con (Eq. 3), averaged over the examples (and positions) of a minibatch:
    ``-log(e^{s_g/τ} / (e^{s_g/τ} + e^{s_p/τ}))`` with ``s_g = cos(z, z_glob)`` and
    ``s_p = cos(z, z_prev)`` along the last dimension."""
    pos = F.cosine_similarity(z, z_glob, dim=-1)
    neg = F.cosine_similarity(z, z_prev, dim=-1)
    logits = torch.stack([pos, neg], dim=-1).reshape(-1, 2) / temperature
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, target)


def frozen_copy(model: nn.Module, arrays: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A copy of ``model`` (with ``arrays`` loaded, every tensor, when given) in evaluation
    mode, its parameters without gradients."""
    twin = copy.deepcopy(model)
    if arrays is not None:
        load_model_arrays(twin, arrays)
    twin.eval()
    for p in twin.parameters():
        p.requires_grad_(False)
        p.grad = None
    return twin


def representation(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """z of ``model`` for inputs ``x``: the input of its ``head`` in one forward pass."""
    seen: list[torch.Tensor] = []
    handle = representation_layer(model).register_forward_pre_hook(
        lambda _m, args: seen.append(args[0])
    )
    try:
        model(x)
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError("moon: the model's forward pass did not call its `head`")
    return seen[-1]


class Contrast:
    """The loss term ``μ ℓ_con`` of the minibatch the trained model has just seen: hooks on the
    model record its input x and its representation z in each training forward pass; the term
    computes z_glob and z_prev of x from the frozen copies (z_glob again at first contact).
    :meth:`close` removes the hooks."""

    def __init__(
        self, model: nn.Module, glob: nn.Module, prev: nn.Module | None, mu: float, tau: float
    ) -> None:
        self.glob, self.prev, self.mu, self.tau = glob, prev, mu, tau
        self.seen: dict[str, torch.Tensor] = {}
        self.handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._record("x")),
            representation_layer(model).register_forward_pre_hook(self._record("z")),
        ]

    def _record(self, key: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if module.training:  # the training forward, not a P-local evaluation
                self.seen[key] = args[0]

        return hook

    def __call__(self, model: nn.Module) -> torch.Tensor:
        if "x" not in self.seen or "z" not in self.seen:
            raise RuntimeError("moon: no training forward pass recorded x and z before its term")
        x, z = self.seen.pop("x"), self.seen.pop("z")
        with torch.no_grad():
            z_glob = representation(self.glob, x)
            z_prev = z_glob if self.prev is None else representation(self.prev, x)
        return self.mu * contrastive_loss(z, z_glob, z_prev, self.tau)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.seen.clear()


@register_algorithm("moon")
@dataclass(frozen=True)
class Moon(FedAvg):
    """MOON (Li, He, Song, CVPR 2021): FedAvg whose local loss adds ``μ ℓ_con``, the
    model-contrastive term on the representation z, the input of the model's ``head`` (module
    docstring).

    Attributes:
        mu: μ > 0, the weight of ℓ_con in the local loss (Eq. 4); default 1, the official code's
            default and the paper's choice on CIFAR-100 and Tiny-ImageNet (5 on CIFAR-10).
        temperature: τ > 0, dividing both cosine similarities of ℓ_con (Eq. 3); default 0.5,
            the paper's.
        local_optimizer: FedAvg's local optimizer (default ``"sgd"``).
        momentum: SGD momentum of the local steps (0: plain SGD).
    """

    name: ClassVar[str] = "moon"
    # sum_aggregable (FedAvg's): its uploads are FedAvg's increments and its server FedAvg's;
    # the previous model (z_prev's source) stays in the client state, never uploaded
    capabilities = replace(
        FedAvg.capabilities,
        compress_uploads=False,
        synchronous_only=ASYNC_UNTESTED,
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    mu: float = 1.0
    temperature: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.mu > 0:
            raise ValueError(
                f"moon: mu must be > 0 (the contrastive term's weight; 0 is FedAvg), got "
                f"{self.mu!r}"
            )
        if not self.temperature > 0:
            raise ValueError(
                f"moon: temperature must be > 0 (it divides the similarities), got "
                f"{self.temperature!r}"
            )

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        """FedAvg's state, once the model is known to have a ``head`` (else refused)."""
        representation_layer(model)
        return super().init_server(model, rng)

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """FedAvg's local steps on ``ℓ_sup + μ ℓ_con`` from the received model, z_prev from the
        client's previous model (``prev.*``; the global model at first contact).

        Returns:
            (``update.*`` with FedAvg's metrics; the client state with ``prev.*`` = the model
            after training, and FedAvg's ``cache.*``).
        """
        representation_layer(model)
        start, keep = self.dense_start(msg, state, model)
        glob = frozen_copy(model)  # the received model, loaded by dense_start
        held = select(state.arrays, PREV) if state is not None else {}
        prev = frozen_copy(model, held) if held else None
        term = Contrast(model, glob, prev, self.mu, self.temperature)
        try:
            reply, _ = self.train_locally(msg, start, model, data, rng,
                                          [*self.loss_terms(start), term])  # fmt: skip
        finally:
            term.close()
        mine = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return reply, State({**keep.arrays, **with_prefix(mine, PREV)}, dict(keep.values))
