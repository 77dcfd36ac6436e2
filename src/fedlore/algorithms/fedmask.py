"""FedMask (Li, Sun, Zeng, Zhang, Li, Chen, SenSys 2021): personalized binary masks over fixed
weights; only the masks travel.

Sources: the paper's abstract ("each device learns a sparse binary mask (i.e., 1 bit per network
parameter) while keeping the parameters of each local model unchanged; only these binary masks
are communicated"), and an unofficial reimplementation (``clinets/fedmask*.py``,
``servers/fedmask*.py``) as summarized in the reference notes, Part 12 (Part 15's table row).
Nothing here was checked against the authors' code.

Model (:func:`maskify`, applied in place and idempotently by :meth:`FedMask.prepare_model`):
every ``nn.Linear`` / ``nn.Conv2d`` (or only the last ``masked_layers`` of them) becomes a
:class:`MaskedLinear` / :class:`MaskedConv2d` whose ``weight`` and ``bias`` are fixed buffers
(W, b: derived from the run's seeded initial model, the same on every client) and whose only
parameters are scores ``weight_score`` (and ``bias_score``) of W's (b's) shape. The forward pass
uses ``W ⊙ keep ⊙ m`` with the hard mask ``m = 1[sigmoid(s) > 0.5] = 1[s > 0]`` and the
straight-through gradient ``dL/ds = dL/dm · sigmoid'(s)`` (value of the hard mask, gradient of
the soft one, :func:`hard_mask`). ``keep`` is a bool pruning buffer (all True unless
``persistent_prune``). Every other tensor (unmasked layers, normalization parameters) is frozen
at its initial value: only masks are learned, only masks travel after a client's first contact.

Round t, client k (:meth:`FedMask.client_update`):

1. load the fixed tensors (from the broadcast at first contact, then from the client's own state:
   they are never re-sent), the client's ``keep`` and the round's aggregated mask A^t **into the
   score logits** (s = A^t, Part 12: "loads it into its score parameters"; since sigmoid(0) = 0.5
   does not exceed 0.5, exactly the positions with A^t > 0 start active);
2. train the scores with the shared :func:`~fedlore.train.local.local_train` (K steps, AdamW or
   SGD at the common ``lr`` schedule, a fresh optimizer each round);
3. in the client's first round only, one-shot prune: per masked tensor keep the top
   ``sparse_factor`` share of the scores (``round(sparse_factor · n)``, at least 1; ties go to the
   lower index) and zero the rest (Part 12 item 2.2: 20 % **kept**, 80 % pruned). Zeroed scores sit
   at the threshold (mask 0) and may come back in later rounds, the literal reading; with
   ``persistent_prune`` the pruned positions stay off for good (``keep``, gradient 0), the reading
   under which the paper's sparse-computation claim holds;
4. upload ``m_k = keep ⊙ 1[s > 0]`` packed one bit per entry (:func:`pack_mask`, big-endian
   ``numpy.packbits``, uint8 ``[ceil(n / 8)]`` per masked tensor under ``mask.<tensor>``);
5. keep the trained model (fixed tensors, own scores, keep) as ``personal.*``: the personal
   model, scored P-local (:class:`~fedlore.algorithms.personal.Personalized`; the default
   ``load_personal`` applies: it is the converted model's plain ``state_dict``).

Server (:meth:`FedMask.aggregate`, :func:`overlap_mean`): per position
``A = Σ p_i m_i / Σ p_i`` where at least ``min_overlap`` (2) accepted clients hold a 1, else 0
(Part 12 item 2.5; p_i per ``weighting``, so ``weighting: uniform`` is the plain mean count / N).
A^0 = ``score_init`` everywhere (every mask on: the first round starts from the dense W). Every
sampled client receives the same A. With a single accepted reply no position reaches the
overlap of 2 and A is all 0 (a dead network): FedMask needs >= 2 clients per round.

Communication per round, with n masked entries (weights and biases of the masked layers) and f
fixed elements: up ``Σ_tensors ceil(n_t / 8)`` bytes per client (1 bit per entry); down ``4 n``
bytes per client (A travels as float32, real-valued as in the reimplementation), plus ``4 f``
bytes of fixed tensors at a client's first contact only (again after a lost reply). The 64-32-10
MLP (n = f = 2410): 302 bytes up; 9 640 bytes down, 19 280 at first contact.

Choices where the sources are silent (Part 12 item 5 lists them as unverified):

* masked layers: all Linear and Conv2d (the abstract's "1 bit per network parameter", "only
  these binary masks are communicated"); ``masked_layers: N`` masks the last N only (the
  reference's recollection), the others stay fixed;
* biases are masked too (``mask_bias``), again "1 bit per network parameter"; with fixed,
  always-on random biases the masked head's small logits are dominated by its bias (measured:
  a constant prediction on digits);
* fixed weights ``fixed_weights: signed_constant``: the signs of the seeded initial weights
  times the Kaiming-He scale sqrt(2 / fan_in), the supermask initialization of Zhou et al. 2019
  and Ramanujan et al. 2020; ``init`` keeps the registered initial weights as they are.
  Measured on digits (64-32-10 MLP, masks trained centrally, 425 Adam steps at 3e-2):
  ``init`` reaches 0.50 accuracy at loss 2.13 (the default init's logits are too small to
  express a confident prediction), ``signed_constant`` 0.84 at loss 1.28;
* ``score_init`` 0.05: a small positive logit (all masks on) that K Adam steps can flip in the
  first round; at 1.0 (A^0 as the overlap mean of all-ones masks) a round of K = 5 steps at
  lr 3e-2 flips nothing and the first round's pruning ranks near-ties.

Models with BatchNorm: the running statistics are buffers that local training updates; they stay
in the client's state (local, like FedBN) and the global model keeps the initial ones, so its
central evaluation is meaningful only for models without running statistics (MLP, CNN, GroupNorm
ResNets).

This module holds the method (settings, server and client steps); the masked layers and the model
conversion are in :mod:`fedlore.algorithms.fedmask_layers`, the bit packing and the overlap rule
in :mod:`fedlore.algorithms.fedmask_bits` (their names are importable from here too).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithm import Capabilities
from fedlore.algorithms.base import Hyper, ReplySpec, reply_metrics
from fedlore.algorithms.fedavg import local_optimizer, optimizer_state_bytes
from fedlore.algorithms.fedmask_bits import overlap_mean, pack_mask, unpack_mask
from fedlore.algorithms.fedmask_layers import (
    KEEP,
    SCORE,
    MaskedConv2d,
    MaskedLayer,
    MaskedLinear,
    hard_mask,
    masked_layers,
    maskify,
)
from fedlore.algorithms.personal import Personalized, keep_personal, personal_arrays
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.tensors import load_model_arrays, model_arrays, select, with_prefix
from fedlore.train.local import local_train
from fedlore.types import Broadcast, Reply, Scalars, State

__all__ = [
    "KEEP",
    "SCORE",
    "FedMask",
    "MaskedConv2d",
    "MaskedLayer",
    "MaskedLinear",
    "hard_mask",
    "masked_layers",
    "maskify",
    "overlap_mean",
    "pack_mask",
    "unpack_mask",
]


@register_algorithm("fedmask")
@dataclass(frozen=True)
class FedMask(Personalized, Hyper):
    """FedMask (module docstring). Hyperparameters beyond :class:`Hyper`:

    Attributes:
        sparse_factor: share of each masked tensor's scores kept by the first-round one-shot
            pruning (0.2: the unofficial reimplementation's ``sparse_factor``; Part 12 reads it
            as "keep the top p fraction ... and zero the rest", so 20 % stay, 80 % are pruned).
            1.0 disables pruning.
        masked_layers: mask only the last N Linear/Conv2d layers (0: all; the default, see the
            module docstring for why).
        mask_bias: mask the biases of the masked layers too (default; else they stay fixed and
            on).
        score_init: A^0, the initial score of every entry (> 0: every mask starts on; 0.05, our
            choice, module docstring).
        fixed_weights: ``"signed_constant"`` (default) or ``"init"`` (:func:`maskify`).
        persistent_prune: keep the first round's pruned positions off for good (default False:
            the pruned scores are only zeroed, Part 12's literal wording).
        min_overlap: the fewest clients that must hold a 1 for a position to survive
            aggregation (2, Part 12).
        local_optimizer: ``"adamw"`` (Adam when ``weight_decay`` is 0) or ``"sgd"`` over the
            scores, at the common ``lr``.
        momentum: SGD momentum.

    ``params.freeze`` is refused: every tensor but the mask scores is fixed anyway.
    ``caps().min_clients`` = ``min_overlap``: a run with fewer clients per round is refused
    (no position could reach the overlap; the network would be dead).
    """

    name: ClassVar[str] = "fedmask"
    capabilities = replace(
        Hyper.capabilities,
        individual_uploads=(
            "its server keeps a mask position only where at least min_overlap clients hold a 1 (a "
            "count over the individual masks, not a weighted sum), and the masks travel bit-packed "
            "as uint8 bytes, whose sum means nothing"
        ),
    )
    sparse_factor: float = 0.2
    masked_layers: int = 0
    mask_bias: bool = True
    score_init: float = 0.05
    fixed_weights: Literal["init", "signed_constant"] = "signed_constant"
    persistent_prune: bool = False
    min_overlap: int = 2
    local_optimizer: Literal["adamw", "sgd"] = "adamw"
    momentum: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "sparse_factor": 0.0 < self.sparse_factor <= 1.0,
            "masked_layers": self.masked_layers >= 0,
            "score_init": math.isfinite(self.score_init) and self.score_init > 0,
            "fixed_weights": self.fixed_weights in ("init", "signed_constant"),
            "min_overlap": self.min_overlap >= 1,
            "local_optimizer": self.local_optimizer in ("adamw", "sgd"),
            "momentum": 0.0 <= self.momentum < 1.0,
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"{self.name}: invalid {field}={getattr(self, field)!r}")
        if self.train.freeze:
            raise ValueError(
                f"fedmask trains only mask scores over fixed weights; params.freeze="
                f"{list(self.train.freeze)} does not apply to it (leave it empty)"
            )

    def caps(self) -> Capabilities:
        """``min_clients`` is ``min_overlap``: the fewest clients a round needs (else no
        position survives)."""
        return replace(super().caps(), min_clients=self.min_overlap)

    # -- model ----------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Convert the workspace model in place, idempotently (:func:`maskify`, every score
        ``score_init``: the initial aggregated mask A^0 has every entry on)."""
        return maskify(
            model, self.masked_layers, self.score_init, self.mask_bias, self.fixed_weights
        )

    # -- server ---------------------------------------------------------------------------

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        """``model.*``: the converted initial model (W, scores = A^0 = ``score_init``, keep =
        True)."""
        return State(arrays=with_prefix(model_arrays(self.prepare_model(model)), "model."))

    @staticmethod
    def masked_tensors(state: State) -> dict[str, tuple[int, ...]]:
        """Masked tensor name (``<layer>.weight``, ``<layer>.bias``) -> its shape, read from the
        server state's scores."""
        return {
            k[: -len(SCORE)]: tuple(v.shape)
            for k, v in select(state.arrays, "model.").items()
            if k.endswith(SCORE)
        }

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        """``mask.<tensor>``: the aggregated mask A (float32, the tensor's shape) for every
        client; plus ``model.<name>`` for every fixed tensor (W, b, unmasked layers) until the
        client has replied once (``seen.<cid>``). Scores and pruning sets never go down."""
        model = select(state.arrays, "model.")
        arrays = {"mask." + t: model[t + SCORE] for t in self.masked_tensors(state)}
        if not state.values.get(f"seen.{client_id}"):
            fixed = {k: v for k, v in model.items() if not k.endswith((SCORE, KEEP))}
            arrays.update(with_prefix(fixed, "model."))
        return Broadcast(arrays=arrays, config={"round": rnd})

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        """A = :func:`overlap_mean` of the accepted clients' unpacked masks, per tensor, stored
        as the global scores. Without accepted replies the state is unchanged. A client whose
        reply was lost gets the fixed tensors again (its state may be gone).

        Metrics: ``aggregated`` (replies), ``global_density`` (share of A > 0),
        ``client_density`` (mean share of ones in the uploaded masks)."""
        values = dict(state.values)
        for c, r in replies:
            if r is None:
                values.pop(f"seen.{c}", None)
        ok = [(c, r) for c, r in replies if r is not None]
        if not ok:
            return State(arrays=dict(state.arrays), values=values), {"aggregated": 0}
        weights = self.weights([r for _, r in ok])
        arrays = dict(state.arrays)
        active = total = ones = 0
        for t, shape in self.masked_tensors(state).items():
            masks = [unpack_mask(r.arrays["mask." + t], shape) for _, r in ok]
            # the aggregated scores keep the model's dtype (float32, or float64 under fp64)
            score_dtype = state.arrays[f"model.{t}{SCORE}"].dtype
            agg = overlap_mean(masks, weights, self.min_overlap).to(score_dtype)
            arrays[f"model.{t}{SCORE}"] = agg
            active += int((agg > 0).sum())
            total += agg.numel()
            ones += sum(int(m.sum()) for m in masks)
        values.update({f"seen.{c}": 1 for c, _ in ok})
        metrics: Scalars = {
            "aggregated": len(ok),
            "global_density": active / total,
            "client_density": ones / (total * len(ok)),
        }
        return State(arrays=arrays, values=values), metrics

    def global_arrays(self, state: State) -> dict[str, torch.Tensor]:
        """The converted model with scores A (and keep all True): evaluating it scores
        ``W ⊙ 1[A > 0]``."""
        return select(state.arrays, "model.")

    def expected_reply(self, state: State, rnd: int, client_id: int | None = None) -> ReplySpec:
        """``mask.<tensor>``: uint8 ``[ceil(numel / 8)]`` for every masked tensor."""
        return {
            "mask." + t: ((math.ceil(math.prod(shape) / 8),), torch.uint8)
            for t, shape in self.masked_tensors(state).items()
        }

    # -- client ---------------------------------------------------------------------------

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """A fresh optimizer over the scores (the only trainable tensors)."""
        return local_optimizer(self, model, self.local_optimizer, self.momentum)

    def start(self, msg: Broadcast, state: State | None, model: nn.Module) -> bool:
        """Load the round's start into the converted ``model``: the fixed tensors (the client's
        own copy, else the broadcast's), its pruning sets (all True at first contact) and the
        aggregated mask into the scores (s = A).

        Returns:
            whether this is the client's first round (no personal model yet: prune after it).

        Raises:
            RuntimeError: when the server sent no fixed tensors and the client holds none (its
                state was lost).
            KeyError: when the broadcast lacks a mask.
        """
        own = personal_arrays(state)
        sent = select(msg.arrays, "model.")
        masks = select(msg.arrays, "mask.")
        arrays: dict[str, torch.Tensor] = {}
        for name, t in model.state_dict().items():
            if name.endswith(SCORE):
                arrays[name] = masks[name[: -len(SCORE)]]
            elif name.endswith(KEEP):
                arrays[name] = own.get(name, torch.ones_like(t, dtype=torch.bool))
            elif name in own:
                arrays[name] = own[name]
            elif name in sent:
                arrays[name] = sent[name]
            else:
                raise RuntimeError(
                    f"fedmask: the server sent no fixed tensor {name!r} and the client holds "
                    "none (its state was lost)"
                )
        load_model_arrays(model, arrays)
        return not own

    def prune(self, model: nn.Module) -> None:
        """One-shot pruning: per masked tensor keep the top ``round(sparse_factor · n)`` scores
        (at least 1; a stable sort, so ties go to the lower index), set its ``keep`` to that set
        and zero the other scores."""
        with torch.no_grad():
            for layer in masked_layers(model).values():
                for t in layer.masked:
                    score: torch.Tensor = getattr(layer, t + SCORE)
                    keep_buf: torch.Tensor = getattr(layer, t + KEEP)
                    s = score.flatten()
                    k = max(1, round(self.sparse_factor * s.numel()))
                    order = torch.sort(s, descending=True, stable=True).indices
                    keep = torch.zeros_like(s, dtype=torch.bool)
                    keep[order[:k]] = True
                    score.masked_fill_(~keep.view_as(score), 0.0)
                    if self.persistent_prune:
                        keep_buf.copy_(keep.view_as(keep_buf))

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """Steps 1-5 of the module docstring. Reply: ``mask.<tensor>`` (packed bits) and metrics
        (``density``: share of ones in the uploaded masks; P-local scores in the last round when
        ``local_eval``). New state: ``personal.*``, the converted model after training (fixed
        tensors, own scores and pruning sets)."""
        model = self.prepare_model(model)
        first = self.start(msg, state, model)
        opt = self.make_optimizer(model)
        rnd = int(msg.config["round"])
        lrs = self.round_lrs(rnd, data.num_examples)
        t0 = time.perf_counter()
        stats = local_train(
            model,
            data.batches(self.train.batch_size, len(lrs), rng, rnd),
            opt,
            lrs,
            grad_clip=self.train.grad_clip,
        )
        if first and self.sparse_factor < 1.0:
            self.prune(model)
        train_s = time.perf_counter() - t0
        bits = {
            f"{name}.{t}": m
            for name, layer in masked_layers(model).items()
            for t, m in layer.binary_masks().items()
        }
        arrays = {"mask." + k: pack_mask(b) for k, b in bits.items()}
        keep = State(arrays=keep_personal(model))
        ones = sum(int(b.sum()) for b in bits.values())
        metrics = reply_metrics(
            data.num_examples,
            train_loss=stats.mean_loss,
            skipped_steps=stats.skipped_steps,
            optimizer_state_bytes=optimizer_state_bytes(opt),
            train_s=train_s,
            density=ones / sum(b.numel() for b in bits.values()),
            **self.personal_eval_metrics(keep, model, data, rnd),
        )
        return Reply(arrays=arrays, metrics=metrics), keep
