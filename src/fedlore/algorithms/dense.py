"""The server side of every method whose clients upload dense deltas (:class:`DenseServer`):
FedAvg's broadcast of the global model and its aggregate ``W <- W + Σ p_i Δ_i / Σ p_i``, with
the robust combinations, the server optimizers, frozen tensors sent once, and the client-side
helpers that load ``W^t`` and take the delta. Mixed into FedFull, FedAvg and FedProx
(:mod:`fedlore.algorithms.fedavg`), their subclasses (MOON, FedPer, FedBN, FedRep, APFL,
Per-FedAvg, q-FFL, ...) and Local GaLore.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedlore.algorithms.base import ReplySpec
from fedlore.optim.server import STEPS
from fedlore.robust import combine_updates
from fedlore.tensors import (
    from_wire,
    load_model_arrays,
    model_arrays,
    nonnegative_variances,
    select,
    to_wire,
    with_prefix,
)
from fedlore.types import Broadcast, Reply, Scalars, State


class DenseServer:
    """Server side of every method whose clients upload dense deltas ``update.*``: broadcast
    ``model.*``, aggregate ``W <- W + Σ p_i Δ_i / Σ p_i``. Mixed into a :class:`Hyper` dataclass.

    ``robust_aggregate`` (``median`` / ``trimmed_mean``) replaces the weighted mean of the
    deltas by a robust one (:meth:`combine_deltas`), for every subclass that averages deltas.

    Frozen tensors (:attr:`~fedlore.settings.LocalTraining.freeze`) are sent only until a client
    has replied once (``seen.<cid>``); the client keeps them as ``cache.*``, never uploaded.
    """

    def combine_deltas(
        self, updates: list[dict[str, torch.Tensor]], weights: list[float]
    ) -> dict[str, torch.Tensor]:
        """``Σ p_i Δ_i / Σ p_i``, or the coordinate-wise median / trimmed mean, Krum, Multi-Krum
        or Bulyan of the Δ_i under ``robust_aggregate`` (:func:`fedlore.robust.combine_updates`;
        a Bulyan round left with fewer than 4f + 3 replies by rejections runs with the largest
        f it tolerates)."""
        t = self.train  # type: ignore[attr-defined]
        f = t.num_byzantine
        if t.robust_aggregate == "bulyan":
            f = min(f, max(0, (len(updates) - 3) // 4))
        return combine_updates(
            updates, weights, t.robust_aggregate, t.trim_fraction, f, t.multi_krum_keep
        )

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        self.check_freeze(model)  # type: ignore[attr-defined]
        return State(arrays=with_prefix(model_arrays(model), "model."))

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        model = select(state.arrays, "model.", strip=False)
        if state.values.get(f"seen.{client_id}"):
            model = {k: v for k, v in model.items() if not self.is_frozen(k[6:])}  # type: ignore[attr-defined]
        return Broadcast(arrays=model, config={"round": rnd})

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        values = dict(state.values)
        for c, r in replies:
            if r is None:  # its cache may be gone: send the frozen tensors again
                values.pop(f"seen.{c}", None)
        ok = [(c, r) for c, r in replies if r is not None]
        if not ok:
            return State(arrays=dict(state.arrays), values=values), {"aggregated": 0}
        weights = self.weights([r for _, r in ok])  # type: ignore[attr-defined]
        model = select(state.arrays, "model.")
        ups = [self.received_update(r.arrays, model) for _, r in ok]
        mean = self.mean_update(model, ups, weights)
        step, moments = self.server_step(state, mean, values)
        new = {k: v + step[k].to(v.dtype) if k in step else v for k, v in model.items()}
        new = nonnegative_variances(new)  # DP noise or a server optimizer could take one below 0
        if self.train.freeze:  # type: ignore[attr-defined]
            values.update({f"seen.{c}": 1 for c, _ in ok})
        arrays = {**with_prefix(new, "model."), **moments}
        return State(arrays=arrays, values=values), {"aggregated": len(ok)}

    def server_step(
        self, state: State, mean: dict[str, torch.Tensor], values: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The global model's step from the aggregated delta ``mean`` by the server optimizer,
        and its moments to keep (``sopt.*`` arrays; their step count goes into ``values``).
        Plain FedAvg (``sgd`` at lr 1) returns ``mean`` itself and keeps nothing."""
        opt = self.server_opt()  # type: ignore[attr-defined]
        if opt.is_identity:
            return mean, {}
        t = int(state.values.get(STEPS, 0)) + 1
        values[STEPS] = t
        prev = {k: v for k, v in state.arrays.items() if k.startswith("sopt.")}
        return opt.step(mean, prev, t)

    def mean_update(
        self,
        model: dict[str, torch.Tensor],
        updates: list[dict[str, torch.Tensor]],
        weights: list[float],
    ) -> dict[str, torch.Tensor]:
        """The step the global model takes: ``Σ p_i Δ_i / Σ p_i`` (FedAvg). Methods that combine
        some tensors otherwise (Bayesian posteriors) override this.

        Args:
            model: the global tensors W^t by plain name.
            updates: each accepted client's ``Δ_i`` by plain name.
            weights: the p_i (not normalized).
        """
        return self.combine_deltas(updates, weights)

    def received_update(
        self, arrays: dict[str, torch.Tensor], model: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A reply's ``Δ_i`` by plain name at the dtypes of the global tensors ``model``
        (16-bit uploads upcast; FedFull decodes a compressed upload)."""
        return from_wire(select(arrays, "update."), {k: v.dtype for k, v in model.items()})

    def global_arrays(self, state: State) -> dict[str, torch.Tensor]:
        return select(state.arrays, "model.")

    def expected_reply(self, state: State, rnd: int, client_id: int | None = None) -> ReplySpec:
        return {
            "update." + k: (tuple(v.shape), self.wire_spec(v.dtype))  # type: ignore[attr-defined]
            for k, v in select(state.arrays, "model.").items()
            if self.uploads(k, v.dtype)
        }

    def uploads(self, name: str, dtype: torch.dtype) -> bool:
        """Whether a delta holds model tensor ``name`` of ``dtype``: one not frozen, and under
        ``upload_increments`` (secure aggregation, DP) no integer buffer (BatchNorm's
        ``num_batches_tracked``: it cannot be clipped, noised or summed in fixed point, keeps the
        server's value as in the LoRA methods, and BatchNorm with a momentum never reads it)."""
        frozen = self.is_frozen(name)  # type: ignore[attr-defined]
        increments = self.train.upload_increments  # type: ignore[attr-defined]
        return not frozen and (dtype.is_floating_point or not increments)

    def dense_start(
        self, msg: Broadcast, state: State | None, model: nn.Module
    ) -> tuple[dict[str, torch.Tensor], State]:
        """Client side: load W^t (broadcast + cached frozen tensors) into ``model``, mark the
        frozen parameters, and return (W^t by plain name, the client state to keep).

        Raises:
            RuntimeError: when the server left out frozen tensors the client does not hold.
        """
        start = self.fill_frozen(select(msg.arrays, "model."), state, model)  # type: ignore[attr-defined]
        frozen = [k for k in start if self.is_frozen(k)]  # type: ignore[attr-defined]
        load_model_arrays(model, start)
        self.set_frozen(model)  # type: ignore[attr-defined]
        keep = State(arrays={"cache." + k: start[k] for k in frozen}) if frozen else State()
        return start, keep

    def dense_delta(
        self, model: nn.Module, start: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``W_K - W^t`` of the tensors a client uploads (:meth:`uploads`), by plain name at the
        model's dtype: new contiguous tensors, computed from the model's own tensors."""
        return {
            k: (v.detach() - start[k].to(v.dtype)).contiguous()
            for k, v in model.state_dict().items()
            if self.uploads(k, v.dtype)
        }

    def dense_update(
        self, model: nn.Module, start: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``update.* = W_K - W^t`` (:meth:`dense_delta`) in the wire dtype
        (``transport_dtype``; the model's by default)."""
        delta = self.dense_delta(model, start)
        return with_prefix(to_wire(delta, self.wire_dtype), "update.")  # type: ignore[attr-defined]
