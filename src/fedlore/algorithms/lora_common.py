"""What the seven federated LoRA baselines share; each method module states only what differs
(which factors train, what the server computes, how a client's adapter starts, what is merged).

Wire names (adapters fp32, other tensors the model's dtype, under the default ``transport_dtype``):

* ``model.<k>``: frozen base tensors under plain ``state_dict`` names, sent at first contact (or
  when a merge method's client is too far behind for the log).
* ``dense.<k>``: every parameter that is neither adapted nor frozen (the classifier head, biases,
  norms, embeddings unless :attr:`~fedlore.settings.LocalTraining.freeze` names them): trained with
  AdamW like the factors, sent both ways every round and averaged with the weights p_i. This is the
  rule FedFull, Local GaLore and FedLore follow for their unprojected tensors, so every method
  trains the same parameters (reference notes section 13.3; FRLoRA's code trains the head, the
  others are silent). Frozen tensors travel only at first contact, as ``model.<k>``. So do buffers
  by default: BatchNorm running statistics then stay at their first-contact values in the global
  model (clients update them locally while training and discard them), as in the LoRA papers'
  code, which trains transformers with LayerNorm only; ``average_buffers=True`` treats the
  floating-point buffers like dense parameters instead (uploaded after local training and
  averaged with p_i, as FedFull, Local GaLore and FedLore do; a running variance that DP's
  noise or the server's step takes below 0 is clamped at 0, as FedAvg's server does; integer
  buffers such as ``num_batches_tracked`` keep their first-contact values).
* ``lora.<mod>.A`` (``r x n``) / ``lora.<mod>.B`` (``m x r``): adapter factors.
* ``log.<s>.<mod>.*``: round s's merge payload (FLoRA, FRLoRA), from which a client rebuilds
  the merge into its cached base with the server's function, so both stay bit-identical.

Server state: ``model.*`` (the current base with the current dense values), the global
``lora.*`` and method extras; values ``changed.lora.<...>`` (the round whose aggregate last
changed that tensor, -1 at init), ``lora_modules`` and ``dense_keys`` (lists, spelled by
:func:`~fedlore.algorithms.sync.join_names`). A broadcast carries the global adapter tensors
changed since the client's version (all at first contact), so a frozen factor crosses once
(FFA-LoRA's A) and RoLoRA sends only the factor that moved. The client versions, the merge log
and the choice between the log and the base are the sync protocol's
(:mod:`fedlore.algorithms.sync`, format :data:`~fedlore.algorithms.sync.LORA_LOG`:
``version.<cid>`` (the round whose broadcast the client last acted on with an accepted reply),
``log.<s>.*`` with ``merged.<s>``, ``log_from``). The client round and the client's state:
:mod:`fedlore.algorithms.lora_client`.

16-bit transport (``transport_dtype: fp16 | bf16``): the methods' protocol sends values (factors,
dense tensors, merge payloads), and so does it under a 16-bit wire: uploads ``lora.*`` and
``dense.*`` are cast to the 16-bit dtype and upcast by the server (factors to fp32, dense tensors
to the model's dtype) before aggregation; the server rounds every global value it will send
(``lora.*`` it changed, the averaged ``dense`` tensors, the merge payload ``log.<s>.*``, the
initial adapter and dense tensors) to the 16-bit grid *before* it keeps or merges it, so the
downlink cast is lossless and a client's ``held.*`` and merged ``cache.*`` stay bit-identical to
the server's. Values are rounded, not increments: a factor or dense tensor whose per-round
change is below half a 16-bit ulp of its value does not move (the uploaded value already rounds
back). FlexLoRA's per-client SVD factors are computed at broadcast and rounded there. The frozen
base ``model.*`` (first contact, a merge client too far behind) stays at the model's dtype.

Increments (``upload_increments``, set by the run under secure aggregation and DP; only the methods
that declare :attr:`~fedlore.algorithm.Capabilities.sum_aggregable`, FedIT and FFA-LoRA, accept it):
a client uploads every trained tensor as its increment from the value it started the round from,
``lora.<mod>.<f> = X_K - X^t`` (X^t the global factor it held and started from) and
``dense.<k> = D_K - D^t`` (D^t the received dense value), under the same keys, shapes and wire
dtype as the values. The server adds their weighted mean to its current global values:
``X^{t+1} = X^t + Σ p_i ΔX_i`` (:meth:`LoraMethod.trained_means`), ``D^{t+1} = D^t + Σ p_i ΔD_i``,
which equals the mean of the values ``Σ p_i X_i`` because the p_i are normalized and every client
started from the server's X^t (the synchronization above keeps ``held.*`` equal to the server's
``lora.*``). Under a 16-bit wire the increments are rounded relative to the round's update, not to
the value; the server still rounds the new global values before it keeps them (the downlink is
lossless), so the stall of a sub-ulp change described above remains.

Round (parity with every other method, reference notes section 13): the client round,
:mod:`fedlore.algorithms.lora_client`. Aggregation weights are :meth:`Hyper.weights` (data size
by default, uniform as an option) for every method.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import nn

from fedlore.algorithms.base import ReplySpec
from fedlore.algorithms.lora_client import LoraClient, received
from fedlore.algorithms.sync import (
    LORA_LOG,
    LogFormat,
    Offer,
    SyncState,
    cheaper,
    join_names,
    split_names,
)
from fedlore.lora import (
    Factor,
    Target,
    find_targets,
    kaiming_a,
    merge,
    product,
    scaling,
    zeros_b,
)
from fedlore.optim.server import STEPS
from fedlore.tensors import (
    nbytes,
    nonnegative_variances,
    select,
    snap,
    to_wire,
    weighted_mean,
    with_prefix,
)
from fedlore.types import Arrays, Broadcast, Reply, Scalars, State


@dataclass(frozen=True)
class LoraMethod(LoraClient, abc.ABC):
    """Hyperparameters shared by the LoRA baselines, and the protocol they share.

    Attributes:
        rank: r (the run's ``rank``; seed Appendix B: 8).
        lora_alpha: PEFT lora_alpha; scaling ``s = lora_alpha / r`` (default 16: s = 2 at r = 8,
            the FLoRA/FRLoRA/FlexLoRA code defaults ``alpha = 2r``).
        lora_dropout: LoRA dropout (default 0: deterministic; > 0 draws from a stream derived
            from the client's generator).
        target_modules: adapted Linear names (peft suffix rule, e.g. ``["query", "key",
            "value", "dense"]``); empty = every ``nn.Linear`` outside ``exclude`` (the same
            matrices FedLore projects, less convolutions).
        exclude: parameter-name prefixes never adapted (the classifier head): they train
            densely like every other non-adapted, non-frozen parameter.
        log_rounds: merge methods keep this many rounds of merge payloads for clients that
            missed rounds (older ones get the dense base).
        average_buffers: also upload and average the floating-point buffers (BatchNorm running
            statistics) every round, like the dense parameters (default: they keep their
            first-contact values, module docstring).
    """

    rank: int = field(default=8, metadata={"config": "rank"})
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    exclude: tuple[str, ...] = field(default=("head.",), metadata={"config": "params.exclude"})
    log_rounds: int = 8
    average_buffers: bool = False

    capabilities = replace(LoraClient.capabilities, adapts=True)
    merges: ClassVar[bool] = False
    """Whether the server merges a payload into the base every round (FLoRA, FRLoRA)."""
    sync_log: ClassVar[LogFormat | None] = LORA_LOG

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "rank": self.rank >= 1,
            "lora_alpha": self.lora_alpha > 0,
            "lora_dropout": 0.0 <= self.lora_dropout < 1.0,
            "target_modules": all(isinstance(t, str) and t for t in self.target_modules),
            "exclude": all(isinstance(p, str) and p for p in self.exclude),
            "log_rounds": self.log_rounds >= 1,
        }
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"{type(self).__name__}: invalid {key}={getattr(self, key)!r}")

    # ------------------------------------------------------------------ method hooks
    def client_rank(self, client_id: int) -> int:
        """r_k of a client (homogeneous: ``rank``)."""
        return self.rank

    def ranks(self) -> set[int]:
        """Every client rank in use."""
        return {self.rank}

    def max_rank(self) -> int:
        """The largest client rank."""
        return max(self.ranks())

    def client_scale(self, rank: int) -> float:
        """s_k of a client of rank ``rank``: ``lora_alpha / rank``."""
        return scaling(self.lora_alpha, rank)

    def trained(self, rnd: int) -> tuple[Factor, ...]:
        """The factors clients train and upload in round ``rnd``."""
        return ("A", "B")

    def init_adapters(
        self, base: Arrays, targets: dict[str, Target], rng: torch.Generator
    ) -> Arrays:
        """Round-0 global adapter ``<mod>.A|B``: PEFT init from the server generator (A Kaiming-
        uniform, B zero) at the largest rank, identical for every client."""
        out: Arrays = {}
        device = next(iter(base.values())).device
        for mod, t in targets.items():
            out[f"{mod}.A"] = kaiming_a(self.max_rank(), t.n, rng, device)
            out[f"{mod}.B"] = zeros_b(t.m, self.max_rank(), device)
        return out

    def down_adapters(self, state: State, rnd: int, client_id: int, version: int | None) -> Arrays:
        """Adapter tensors sent to a client (``<mod>.A|B``): the global ones changed since the
        round of its cache (all of them at first contact)."""
        out = {}
        for k, v in select(state.arrays, "lora.").items():
            changed = int(state.values.get(f"changed.lora.{k}", -1))
            if version is None or changed >= version:
                out[k] = v
        return out

    def start_adapters(
        self,
        held: Arrays,
        rnd: int,
        rank: int,
        targets: dict[str, Target],
        fresh: torch.Generator,
    ) -> Arrays:
        """A client's adapter at the start of local training (default: the global one)."""
        return dict(held)

    @abc.abstractmethod
    def aggregate_adapters(
        self, arrays: Arrays, replies: list[tuple[int, Reply]], p: list[float], rnd: int
    ) -> tuple[Arrays, Scalars]:
        """The method's server step (each method module defines it): update the server's arrays
        (a copy, mutate it) from the accepted replies.

        Args:
            arrays: the new server arrays (replace ``lora.*`` entries, add extras).
            replies: (client id, reply) in client-id order.
            p: normalized aggregation weights p_i.
            rnd: the round.

        Returns:
            (merge payload ``<mod>.*`` for merge methods, else {}; metrics).
        """

    def trained_means(
        self,
        arrays: Arrays,
        replies: list[tuple[int, Reply]],
        p: list[float],
        factors: tuple[Factor, ...],
    ) -> Arrays:
        """The averaged global factors ``<mod>.<f>`` (``f`` in ``factors``; fp32, the factors'
        shapes): ``Σ p_i X_i`` of the uploaded values (:func:`factor_means`, FedIT's key-by-key
        mean), or with ``upload_increments`` ``X^t + Σ p_i ΔX_i``, the current global factor
        ``arrays["lora.<mod>.<f>"]`` plus the weighted mean of the uploaded increments (module
        docstring; the same value when the p_i are normalized, as ``p`` is).

        Args:
            arrays: the server arrays holding the current global ``lora.*``.
            replies: (client id, reply) of the accepted clients.
            p: normalized aggregation weights p_i.
            factors: which factors were trained and uploaded.
        """
        means = factor_means(replies, p, factors)
        if not self.train.upload_increments:
            return means
        out: Arrays = {}
        for k, step in means.items():
            now = arrays[f"lora.{k}"]
            out[k] = now + step.to(now.device, now.dtype)
        return out

    def merge_deltas(self, log: Arrays, held: Arrays, modules: list[str]) -> Arrays:
        """``<mod>`` -> fp32 ΔW merged into the base from one round's payload ``<mod>.*``;
        ``held`` holds the global adapter tensors (only ones that never change may be used)."""
        return {}

    def global_deltas(self, state: State) -> Arrays:
        """``<mod>`` -> fp32 ΔW of the global model on top of ``model.*`` (default ``s B A`` of the
        global adapter)."""
        s = self.client_scale(self.rank)
        adapters = select(state.arrays, "lora.")
        return {
            mod: product(adapters[f"{mod}.B"], adapters[f"{mod}.A"], s)
            for mod in adapted_modules(state)
            if f"{mod}.A" in adapters
        }

    def targets(self, model: nn.Module) -> dict[str, Target]:
        """The adapted Linears: :func:`~fedlore.lora.find_targets` without frozen ones.

        Raises:
            ValueError: when nothing is left to adapt.
        """
        found = find_targets(model, self.target_modules, self.exclude)
        out = {k: t for k, t in found.items() if not self.is_frozen(f"{k}.weight")}
        if not out:
            raise ValueError(
                f"{type(self).__name__}: every LoRA target is frozen "
                f"(freeze={list(self.train.freeze)})"
            )
        return out

    def dense_keys(self, model: nn.Module, targets: dict[str, Target]) -> list[str]:
        """Plain names of the tensors that travel densely every round: the parameters neither
        adapted nor frozen, and with ``average_buffers`` the floating-point buffers."""
        adapted = {f"{t}.weight" for t in targets}
        keys = [
            k for k, _ in model.named_parameters() if k not in adapted and not self.is_frozen(k)
        ]
        if self.average_buffers:
            keys += [
                k
                for k, b in model.named_buffers()
                if b.is_floating_point() and not self.is_frozen(k)
            ]
        return keys

    # ------------------------------------------------------------------ server
    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        self.check_freeze(model)
        targets = self.targets(model)
        for t in targets.values():
            if self.max_rank() > min(t.m, t.n):
                raise ValueError(
                    f"{type(self).__name__}: rank {self.max_rank()} exceeds min(m, n) = "
                    f"{min(t.m, t.n)} of {t.name}"
                )
        base = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        dense = self.dense_keys(model, targets)
        adapters = snap(self.init_adapters(base, targets, rng), self.wire_dtype)
        base.update(snap({k: base[k] for k in dense}, self.wire_dtype))  # sent as dense.*
        values: Scalars = {"lora_modules": join_names(targets), "dense_keys": join_names(dense)}
        SyncState(LORA_LOG, floor=0).encode({}, values)  # log_from
        values.update({f"changed.lora.{k}": -1 for k in adapters})
        return State({**with_prefix(base, "model."), **with_prefix(adapters, "lora.")}, values)

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        sync = SyncState.decode(state, LORA_LOG)
        version = sync.client(client_id).version
        model = select(state.arrays, "model.")
        dense_keys = _dense_keys(state)
        config: Scalars = {"round": rnd, "rank": self.client_rank(client_id)}
        arrays = {"dense." + k: model[k] for k in dense_keys}
        arrays.update(with_prefix(self.down_adapters(state, rnd, client_id, version), "lora."))
        frozen = {"model." + k: v for k, v in model.items() if k not in dense_keys}
        if version is None:
            config["mode"] = "dense"
            arrays.update(frozen)
        elif self.merges:  # the cheaper of the merge log and the base
            # the client holds a cache: tensors frozen by params.freeze stay there
            base = {k: v for k, v in frozen.items() if not self.is_frozen(k[6:])}
            replay = None
            if sync.covers(version, rnd):
                payload, _ = sync.replay(version, rnd)
                logs = join_names(sync.rounds(version, rnd))
                cost = nbytes(to_wire(payload, self.wire_dtype))  # as sent
                cfg: Scalars = {"mode": "cached", "from_round": version, "logs": logs}
                replay = Offer(payload, cfg, cost)
            offer = cheaper(replay, Offer(base, {"mode": "dense"}, nbytes(base)))
            config.update(offer.config)
            arrays.update(offer.arrays)
        else:
            config.update(mode="cached", from_round=version, logs="")
        sent = {k: v for k, v in arrays.items() if not k.startswith("model.")}  # base: as held
        arrays.update(to_wire(sent, self.wire_dtype))  # lossless but for FlexLoRA's SVD factors
        return Broadcast(arrays, config)

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        arrays, values = dict(state.arrays), dict(state.values)
        sync = SyncState.decode(state, LORA_LOG)
        for c, r in replies:
            if r is None:  # its cache may or may not have moved: dense at next contact
                sync.forget(c)
        model = select(state.arrays, "model.")
        ok = [(c, Reply(received(r.arrays, model), r.metrics)) for c, r in replies if r is not None]
        if not ok:
            sync.encode(arrays, values)
            return State(arrays, values), {"aggregated": 0}
        wire = self.wire_dtype
        weights = self.weights([r for _, r in ok])
        total = float(sum(weights))
        p = [w / total for w in weights]
        dense = weighted_mean([select(r.arrays, "dense.") for _, r in ok], weights)
        if self.train.upload_increments:  # the mean increment added to the current dense values
            dense = {k: model[k] + v.to(model[k].device, model[k].dtype) for k, v in dense.items()}
        arrays.update(with_prefix(snap(dense, wire), "model."))
        log, metrics = self.aggregate_adapters(arrays, ok, p, rnd)
        opt = self.server_opt()
        if not opt.is_identity:  # FedIT, FFA-LoRA: from the averaged factors and dense tensors
            moved = [f"model.{k}" for k in dense]
            moved += [  # the factors the method averaged (FFA-LoRA's frozen A stays as it is)
                k
                for k, v in arrays.items()
                if k.startswith("lora.") and k in state.arrays and v is not state.arrays[k]
            ]
            before = {k: state.arrays[k] for k in moved}
            change = {k: arrays[k].to(v.dtype) - v for k, v in before.items()}
            t = int(values.get(STEPS, 0)) + 1
            values[STEPS] = t
            step, moments = opt.step(change, select(arrays, "sopt.", strip=False), t)
            arrays.update(moments)
            arrays.update(snap({k: v + step[k].to(v.dtype) for k, v in before.items()}, wire))
        # average_buffers: a running variance that DP's noise or the server's step takes below 0
        # is clamped at 0 (post-processing; values travel, so the clients receive the clamp)
        arrays.update(nonnegative_variances({f"model.{k}": arrays[f"model.{k}"] for k in dense}))
        log = snap(log, wire)  # merged here exactly as the clients will merge it
        for k, v in list(arrays.items()):
            if k.startswith("lora.") and state.arrays.get(k) is not v:
                arrays[k] = snap({k: v}, wire)[k]
                values[f"changed.{k}"] = rnd
        if log:
            held = select(arrays, "lora.")
            for mod, delta in self.merge_deltas(log, held, adapted_modules(state)).items():
                arrays[f"model.{mod}.weight"] = merge(arrays[f"model.{mod}.weight"], delta)
            sync.record(rnd, log)
        for c, _ in ok:
            sync.acknowledge(c, rnd)
        sync.trim(rnd + 1 - self.log_rounds)
        sync.encode(arrays, values)
        return State(arrays, values), {"aggregated": len(ok), **metrics}

    def global_arrays(self, state: State) -> dict[str, torch.Tensor]:
        """``model.*`` with ``W + ΔW`` of :meth:`global_deltas` merged in fp32 (plain names)."""
        model = select(state.arrays, "model.")
        for mod, delta in self.global_deltas(state).items():
            model[f"{mod}.weight"] = merge(model[f"{mod}.weight"], delta)
        return model

    def expected_reply(self, state: State, rnd: int, client_id: int | None = None) -> ReplySpec:
        """Keys, shapes and dtypes of a valid reply.

        Raises:
            ValueError: with heterogeneous ranks and no ``client_id`` (the shapes depend on it).
        """
        if client_id is None:
            if len(self.ranks()) > 1:
                raise ValueError(
                    f"{type(self).__name__}: heterogeneous client ranks {sorted(self.ranks())} "
                    "give replies of different shapes; call expected_reply(state, rnd, client_id)"
                )
            client_id = 0
        r = self.client_rank(client_id)
        model = select(state.arrays, "model.")
        w = self.wire_spec
        spec: ReplySpec = {
            "dense." + k: (tuple(model[k].shape), w(model[k].dtype)) for k in _dense_keys(state)
        }
        for mod in adapted_modules(state):
            m, n = model[f"{mod}.weight"].shape
            for f in self.trained(rnd):
                spec[f"lora.{mod}.{f}"] = ((r, n) if f == "A" else (m, r), w(torch.float32))
        return spec

    # ------------------------------------------------------------------ client


def adapted_modules(state: State) -> list[str]:
    """The adapted module names of a server state (value ``lora_modules``)."""
    return split_names(state.values["lora_modules"])


def _dense_keys(state: State) -> list[str]:
    return split_names(state.values["dense_keys"])


def factor_means(
    replies: list[tuple[int, Reply]], p: list[float], factors: tuple[Factor, ...]
) -> Arrays:
    """Weighted means ``Σ p_i X_i`` of the uploaded factors (``<mod>.A|B``, float64 sums)."""
    keys = [f".{f}" for f in factors]
    items = [
        {k: v for k, v in select(r.arrays, "lora.").items() if k.endswith(tuple(keys))}
        for _, r in replies
    ]
    return weighted_mean(items, p)


def reply_modules(replies: list[tuple[int, Reply]]) -> list[str]:
    """The adapted module names of (validated, hence identically keyed) replies, in key order."""
    keys = replies[0][1].arrays
    return list(dict.fromkeys(k[5:-2] for k in keys if k.startswith("lora.")))
