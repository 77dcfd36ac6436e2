"""FedAvg (McMahan et al., AISTATS 2017) and FedFull (FedAvg with local AdamW on all weights).

Server: broadcast the dense global model; aggregate ``W <- W + Σ p_i Δ_i`` with the clients'
dense deltas. Client: a fresh optimizer each round (parity with FedLore's moment reset,
reference notes section 2), K local steps, upload ``update.* = W_K - W^t``.
Bytes per m x n matrix: mn up and mn down.

16-bit transport (``transport_dtype``, FedFull, FedAvg and FedProx): the uploaded deltas are cast
to fp16/bf16 (an increment: the rounding error is relative to the round's update) and the server
upcasts them to the model's dtype before averaging. The broadcast is the full model, a value, and
stays at the model's dtype: rounding it would move every weight by up to half a 16-bit ulp of the
weight itself (2^-9 relative in bf16, more than a late round's whole update), each round.

Secure aggregation and DP (issue 20, :attr:`~fedlore.algorithm.Capabilities.sum_aggregable`):
FedFull, FedAvg, FedProx and the subclasses that keep their server (MOON, FedPer, FedBN, FedRep)
are sum-aggregable. Every reply array is an increment ``update.<k> = W_K - W^t`` and the server
needs only ``Σ p_i Δ_i`` and ``Σ p_i``, so ``upload_increments=True`` changes nothing in what they
compute, except that integer buffers stay out of the upload
(:meth:`~fedlore.algorithms.dense.DenseServer.uploads`). The robust combinations
(``robust_aggregate: median | trimmed_mean``) rank each client's delta coordinate by coordinate
and need the individual uploads: with ``upload_increments`` they are refused.

Upload compression (``compression: topk | qsgd``, FedFull, FedAvg and FedProx;
:mod:`fedlore.compression`): the client encodes ``Δ_i + e_i`` (top-k values and indices, or
QSGD's norm and integer codes) and keeps its error-feedback memory ``e_i`` as ``ef.*`` in its
client state; the server checks the encoding (:meth:`FedFull.reply_problem`), decodes, and
averages as above (a robust aggregate and the server optimizer act on the decoded deltas).
Refused with ``upload_increments``: top-k's supports differ per client, so no masked sum of
the uploads is the sum of the deltas, and QSGD is not offered there (untested).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms.base import Hyper, ReplySpec, local_eval_metrics, reply_metrics
from fedlore.algorithms.dense import DenseServer
from fedlore.algorithms.personal import prox_term
from fedlore.checks import check_compression
from fedlore.compression import Codec, compress_update, decode_update, update_problem, update_spec
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import select, with_prefix
from fedlore.train.local import GradHook, LossTerm, local_train
from fedlore.types import Broadcast, Reply, Scalars, State

UNCOMPRESSED: dict[str, str] = dict.fromkeys(
    ("compression", "compression_fraction", "compression_levels", "error_feedback"),
    "its clients upload uncompressed; compression is implemented for fedfull, fedavg and fedprox",
)
"""``not_applicable`` of FedFull's subclasses whose uploads are not FedFull's (their
``capabilities`` withdraw ``compress_uploads``)."""


def local_optimizer(
    hyper: Hyper, model: nn.Module, kind: Literal["adamw", "sgd"], momentum: float = 0.0
) -> torch.optim.Optimizer:
    """A fresh optimizer over ``model``'s trainable parameters (its state starts empty every
    round): SGD with ``momentum`` or AdamW, at ``hyper``'s lr, betas, eps and weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(
            params, lr=hyper.train.lr, momentum=momentum, weight_decay=hyper.train.weight_decay
        )
    return torch.optim.AdamW(
        params,
        lr=hyper.train.lr,
        betas=hyper.train.betas,
        eps=hyper.train.eps,
        weight_decay=hyper.train.weight_decay,
    )


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's per-parameter state tensors (Adam's two moments; scalars such as
    the step count are not counted)."""
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    )


@register_algorithm("fedfull")
@dataclass(frozen=True)
class FedFull(DenseServer, Hyper):
    """FedAvg whose clients run AdamW (``local_optimizer="adamw"``) or SGD on every parameter.

    Attributes:
        local_optimizer: the clients' local optimizer, built fresh every round over the trained
            parameters (its state starts empty): ``"adamw"`` (``torch.optim.AdamW`` with the
            run's ``lr``, ``betas``, ``eps`` and decoupled ``weight_decay``; Adam when
            ``weight_decay`` is 0) or ``"sgd"`` (``torch.optim.SGD`` with ``momentum`` and
            ``weight_decay`` as torch's L2 term added to the gradient).
        momentum: heavy-ball momentum coefficient (≥ 0) of ``torch.optim.SGD`` (no dampening,
            no Nesterov); read only with ``local_optimizer="sgd"`` (0: plain SGD). Its buffer
            starts at zero every round.
        compression: how each client encodes its delta's floating tensors
            (:mod:`fedlore.compression`): ``none`` (dense), ``topk`` (the
            ``compression_fraction`` largest-magnitude entries per tensor as values + int32
            indices) or ``qsgd`` (per tensor its norm and one signed int8 / int16 code per entry,
            unbiased stochastic rounding to ``compression_levels`` levels, drawn from the
            client's round generator). The server validates and decodes the upload, then
            averages as without compression. Refused under secure aggregation and DP.
        compression_fraction: top-k's share of each tensor's entries sent, in (0, 1]:
            ``k = ceil(fraction * numel)`` (at least one entry per tensor).
        compression_levels: QSGD's s, the levels of ``|v_i| / ||v||`` in [1, 32767]; codes are
            int8 up to 127, int16 above.
        error_feedback: whether a client keeps what its upload left out, ``Δ + e - decoded``,
            in its state (``ef.*``) and adds it to its next delta (Stich et al. 2018); None: on
            for ``topk`` (biased), off for ``qsgd`` (unbiased).
    """

    name: ClassVar[str] = "fedfull"
    # sum_aggregable: the uploads are the deltas W_K - W^t (increments already) and the server
    # adds their weighted mean (module docstring); robust_aggregate: DenseServer averages dense
    # deltas, so a coordinate-wise median or trimmed mean applies, and a server optimizer
    capabilities = replace(
        Hyper.capabilities,
        sum_aggregable=True,
        transport_16bit=True,
        robust_aggregate=True,
        server_optimizer=True,
        compress_uploads=True,
        synchronous_only="",  # FedBuff adds staleness-weighted deltas (engine/buffered.py)
    )
    # the settings read only at some values of another (run_record.unread_given)
    read_only_with: ClassVar[dict[str, tuple[str, tuple[object, ...]]]] = {
        "compression_fraction": ("compression", ("topk",)),
        "compression_levels": ("compression", ("qsgd",)),
        "error_feedback": ("compression", ("topk", "qsgd")),
    }
    # None standing for a value another setting decides (run_record.resolve_none)
    none_means: ClassVar[dict[str, tuple[str, dict[str, bool]]]] = {
        "error_feedback": ("compression", {"topk": True, "qsgd": False})
    }
    local_optimizer: Literal["adamw", "sgd"] = "adamw"
    momentum: float = 0.0
    compression: Literal["none", "topk", "qsgd"] = field(
        default="none", metadata={"config": "compression.kind"}
    )
    compression_fraction: float = field(default=0.01, metadata={"config": "compression.fraction"})
    compression_levels: int = field(default=127, metadata={"config": "compression.levels"})
    error_feedback: bool | None = field(
        default=None, metadata={"config": "compression.error_feedback"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_compression(type(self), self.compression, self.train.upload_increments)
        if not 0 < self.compression_fraction <= 1:
            raise ValueError(
                f"{type(self).__name__}: compression_fraction must be in (0, 1], got "
                f"{self.compression_fraction!r}"
            )
        if not 1 <= self.compression_levels <= 32767:
            raise ValueError(
                f"{type(self).__name__}: compression_levels must be in [1, 32767] (int16 codes), "
                f"got {self.compression_levels!r}"
            )
        if self.train.upload_increments and self.train.robust_aggregate != "mean":
            raise ValueError(
                f"{type(self).__name__}: invalid upload_increments=True with robust_aggregate="
                f"{self.train.robust_aggregate!r}: the "
                f"{self.train.robust_aggregate} ranks or compares "
                "each client's delta on its own, not only their weighted sum (use 'mean')"
            )

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """A fresh local optimizer (its moments start at zero every round)."""
        return local_optimizer(self, model, self.local_optimizer, self.momentum)

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        start, keep = self.dense_start(msg, state, model)
        reply, _ = self.train_locally(msg, start, model, data, rng, self.loss_terms(start))
        codec = self.codec()
        if codec is None:
            return reply, keep
        memory = select(state.arrays, "ef.") if state is not None else {}
        delta = select(reply.arrays, "update.")
        sent, kept = compress_update(codec, delta, memory, rng, self.feedback)
        keep = State({**keep.arrays, **with_prefix(kept, "ef.")}, dict(keep.values))
        return Reply(with_prefix(sent, "update."), reply.metrics), keep

    def codec(self) -> Codec | None:
        """The upload's :class:`~fedlore.compression.Codec` (None: ``compression: none``);
        floating values travel in the ``transport_dtype``."""
        if self.compression == "none":
            return None
        return Codec(
            self.compression, self.compression_fraction, self.compression_levels, self.wire_dtype
        )

    @property
    def feedback(self) -> bool:
        """Whether the clients keep an error-feedback memory (``error_feedback``; None: top-k)."""
        return self.compression == "topk" if self.error_feedback is None else self.error_feedback

    def dense_update(
        self, model: nn.Module, start: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``update.*`` as :class:`DenseServer` sends it; under ``compression`` the delta at the
        model's dtype, which :meth:`client_update` then encodes."""
        if self.compression == "none":
            return super().dense_update(model, start)
        return with_prefix(self.dense_delta(model, start), "update.")

    def uploaded(
        self, model: dict[str, torch.Tensor]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name: (shape, dtype)}`` of the global tensors ``model`` that a delta holds."""
        return {k: (tuple(v.shape), v.dtype) for k, v in model.items() if self.uploads(k, v.dtype)}

    def expected_reply(self, state: State, rnd: int, client_id: int | None = None) -> ReplySpec:
        """``update.*`` as :class:`DenseServer` expects it, or the encoded parts (``<name>.values``
        and ``.index``, or ``.norm`` and ``.code``; :func:`~fedlore.compression.update_spec`)."""
        codec = self.codec()
        if codec is None:
            return super().expected_reply(state, rnd, client_id)
        spec = update_spec(codec, self.uploaded(select(state.arrays, "model.")))
        return {"update." + k: v for k, v in spec.items()}

    def reply_problem(self, state: State, rnd: int, client_id: int, reply: Reply) -> str | None:
        """Why a reply of the expected shapes and dtypes is still no upload (the round loop
        rejects it then): a top-k index out of range or repeated, a QSGD norm negative or not
        finite, a code beyond the levels; None without compression."""
        codec = self.codec()
        if codec is None:
            return None
        like = self.uploaded(select(state.arrays, "model."))
        why = update_problem(codec, select(reply.arrays, "update."), like)
        return None if why is None else f"update.{why}"

    def received_update(
        self, arrays: dict[str, torch.Tensor], model: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The decoded ``Δ_i`` under ``compression`` (at the model's dtypes), else
        :meth:`DenseServer.received_update`."""
        codec = self.codec()
        if codec is None:
            return super().received_update(arrays, model)
        return decode_update(codec, select(arrays, "update."), self.uploaded(model))

    def train_locally(
        self,
        msg: Broadcast,
        start: dict[str, torch.Tensor],
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
        terms: list[LossTerm],
        on_grad: Sequence[GradHook] = (),
    ) -> tuple[Reply, list[float]]:
        """The round's local steps from ``start`` (loaded in ``model``) with the extra loss
        ``terms`` (and ``on_grad`` hooks, called before each step that is not skipped): the
        reply (``update.*`` and the metrics) and the round's step sizes."""
        opt = self.make_optimizer(model)
        rnd = int(msg.config["round"])
        lrs = self.round_lrs(rnd, data.num_examples)
        t0 = time.perf_counter()
        stats = local_train(
            model,
            data.batches(self.train.batch_size, len(lrs), rng, rnd),
            opt,
            lrs,
            loss_terms=terms,
            on_grad=on_grad,
            grad_clip=self.train.grad_clip,
        )
        train_s = time.perf_counter() - t0
        metrics = reply_metrics(
            data.num_examples,
            train_loss=stats.mean_loss,
            skipped_steps=stats.skipped_steps,
            optimizer_state_bytes=optimizer_state_bytes(opt),
            train_s=train_s,
            **self.trained_model_metrics(model, data, rnd),
        )
        return Reply(arrays=self.dense_update(model, start), metrics=metrics), lrs

    def trained_model_metrics(self, model: nn.Module, data: ClientData, rnd: int) -> Scalars:
        """P-local scores of the model the client just trained (last round, ``local_eval``);
        a method whose personal model is another one (Ditto) reports that one instead."""
        return local_eval_metrics(self, model, data, rnd)

    def loss_terms(self, start: dict[str, torch.Tensor]) -> list[LossTerm]:
        """Extra terms of the local objective (none; FedProx adds its proximal term)."""
        return []


@register_algorithm("fedavg")
@dataclass(frozen=True)
class FedAvg(FedFull):
    """FedAvg with local SGD (McMahan et al. 2017), the deterministic baseline of Meta-BayFL."""

    name: ClassVar[str] = "fedavg"
    # capabilities: FedFull's (its deltas and server)
    local_optimizer: Literal["adamw", "sgd"] = "sgd"


@register_algorithm("fedprox")
@dataclass(frozen=True)
class FedProx(FedAvg):
    """FedProx (Li et al., MLSys 2020): FedAvg whose clients minimise
    ``h_k(w) = F_k(w) + (mu / 2) ||w - w^t||²`` over the trained tensors, with ``w^t`` the
    round's global weights (litian96/FedProx ``PerturbedGradientDescent``: the step adds
    ``mu (w - w^t)`` to the gradient).

    ``mu`` defaults to 0.01, inside the authors' tuning grid {0.001, 0.01, 0.1, 0.5, 1}
    (reference notes Part 5; PFLlib's default 0 would make it FedAvg, so 0 is refused).

    Attributes:
        mu: weight of the proximal term ``(mu / 2) ||w - w^t||²`` added to every local step's
            loss, summed over the trained parameters (so each step's gradient gains
            ``mu (w - w^t)``); > 0, default 0.01 (inside the authors' grid
            {0.001, 0.01, 0.1, 0.5, 1}).
    """

    name: ClassVar[str] = "fedprox"
    # capabilities: FedAvg's (its deltas and server; the proximal term acts on the client only)
    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.mu > 0:
            raise ValueError(f"FedProx: mu must be > 0 (mu = 0 is FedAvg), got {self.mu!r}")

    def loss_terms(self, start: dict[str, torch.Tensor]) -> list[LossTerm]:
        """``(mu / 2) Σ ||w - w^t||²`` over the parameters that train."""
        return [prox_term(start, self.mu)]
