"""What the seven federated LoRA baselines share; each method module states only what differs
(which factors train, what the server computes, how a client's adapter starts, what is merged).

Wire names (adapters fp32, other tensors the model's dtype, under the default ``transport_dtype``):

* ``model.<k>``: frozen base tensors under plain ``state_dict`` names, sent at first contact (or
  when a merge method's client is too far behind for the log).
* ``dense.<k>``: every parameter that is neither adapted nor frozen (the classifier head, biases,
  norms, embeddings unless :attr:`Hyper.freeze` names them): trained with AdamW like the factors,
  sent both ways every round and averaged with the weights p_i. This is the rule FedFull, Local
  GaLore and FedLore follow for their unprojected tensors, so every method trains the same
  parameters (reference notes section 13.3; FRLoRA's code trains the head, the others are
  silent). Frozen tensors travel only at first contact, as ``model.<k>``. So do buffers by
  default: BatchNorm running statistics then stay at their first-contact values in the global
  model (clients update them locally while training and discard them), as in the LoRA papers'
  code, which trains transformers with LayerNorm only; ``average_buffers=True`` treats the
  floating-point buffers like dense parameters instead (uploaded after local training and
  averaged with p_i, as FedFull, Local GaLore and FedLore do; integer buffers such as
  ``num_batches_tracked`` keep their first-contact values).
* ``lora.<mod>.A`` (``r x n``) / ``lora.<mod>.B`` (``m x r``): adapter factors.
* ``log.<s>.<mod>.*``: round s's merge payload (FLoRA, FRLoRA), from which a client rebuilds
  the merge into its cached base with the server's function, so both stay bit-identical.

Server state: ``model.*`` (the current base with the current dense values), the global
``lora.*``, ``log.*`` and method extras; values ``changed.lora.<...>`` (the round whose
aggregate last changed that tensor, -1 at init) and ``version.<cid>`` (the round whose broadcast
the client last acted on with an accepted reply). A broadcast carries the global adapter
tensors changed since the client's version (all at first contact), so a frozen factor crosses
once (FFA-LoRA's A) and RoLoRA sends only the factor that moved.

Client state: ``cache.*`` (the frozen base as synced), ``held.<mod>.A|B`` (the global adapter
tensors as received, never the locally trained ones), value ``version``.

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

Increments (``upload_increments``, set by the run under secure aggregation and DP; only the
methods that declare :attr:`Hyper.sum_aggregable`, FedIT and FFA-LoRA, accept it): a client
uploads every trained tensor as its increment from the value it started the round from,
``lora.<mod>.<f> = X_K - X^t`` (X^t the global factor it held and started from) and
``dense.<k> = D_K - D^t`` (D^t the received dense value), under the same keys, shapes and wire
dtype as the values. The server adds their weighted mean to its current global values:
``X^{t+1} = X^t + Σ p_i ΔX_i`` (:meth:`LoraMethod.trained_means`), ``D^{t+1} = D^t + Σ p_i ΔD_i``,
which equals the mean of the values ``Σ p_i X_i`` because the p_i are normalized and every client
started from the server's X^t (the synchronization above keeps ``held.*`` equal to the server's
``lora.*``). Under a 16-bit wire the increments are rounded relative to the round's update, not to
the value; the server still rounds the new global values before it keeps them (the downlink is
lossless), so the stall of a sub-ulp change described above remains.

Round (parity with every other method, reference notes section 13): each client works on a deep
copy of the scratch model (peft mutates modules, and heterogeneous ranks need a fresh adapter),
loads base + dense strictly, injects the adapter, trains the round's factors and the dense
parameters with a fresh AdamW for K steps on the same minibatches and schedule as every method,
and uploads the trained factors and dense parameters. Aggregation weights are :meth:`Hyper.weights`
(data size by default, uniform as an option) for every method.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from fedlore.algorithms.base import Hyper, ReplySpec, local_eval_metrics, reply_metrics
from fedlore.data.client_data import ClientData
from fedlore.lora import (
    Factor,
    Target,
    adapted_copy,
    adapter_arrays,
    dense_arrays,
    find_targets,
    kaiming_a,
    merge,
    product,
    scaling,
    set_trainable,
    zeros_b,
)
from fedlore.seeding import derive_seed
from fedlore.tensors import from_wire, nbytes, select, snap, to_wire, weighted_mean, with_prefix
from fedlore.train.local import local_train
from fedlore.types import Arrays, Broadcast, Reply, Scalars, State

# purpose tags for streams derived from the client generator without consuming it, so every
# method draws the same minibatches (parity)
_FRESH, _DROPOUT = 101, 102


@dataclass(frozen=True)
class LoraMethod(Hyper, abc.ABC):
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

    rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ("head.",)
    log_rounds: int = 8
    average_buffers: bool = False

    setup_rounds: ClassVar[int] = 0
    merges: ClassVar[bool] = False
    """Whether the server merges a payload into the base every round (FLoRA, FRLoRA)."""

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
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"{type(self).__name__}: invalid {field}={getattr(self, field)!r}")

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
        if not self.upload_increments:
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
            for mod in _targets(state)
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
                f"{type(self).__name__}: every LoRA target is frozen (freeze={list(self.freeze)})"
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
        values: Scalars = {
            "lora_modules": ",".join(targets),
            "dense_keys": ",".join(dense),
            "log_from": 0,
        }
        values.update({f"changed.lora.{k}": -1 for k in adapters})
        return State({**with_prefix(base, "model."), **with_prefix(adapters, "lora.")}, values)

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        vals = state.values
        raw = vals.get(f"version.{client_id}")
        version = None if raw is None else int(raw)
        model = select(state.arrays, "model.")
        dense_keys = _dense_keys(state)
        config: Scalars = {"round": rnd, "rank": self.client_rank(client_id)}
        arrays = {"dense." + k: model[k] for k in dense_keys}
        arrays.update(with_prefix(self.down_adapters(state, rnd, client_id, version), "lora."))
        frozen = {"model." + k: v for k, v in model.items() if k not in dense_keys}
        if version is None:
            config["mode"] = "dense"
            arrays.update(frozen)
        elif self.merges:
            logs = [s for s in range(version, rnd) if vals.get(f"merged.{s}")]
            payload: Arrays = {}
            for s in logs:
                payload.update(select(state.arrays, f"log.{s}.", strip=False))
            # the client holds a cache: tensors frozen by params.freeze stay there
            base = {k: v for k, v in frozen.items() if not self.is_frozen(k[6:])}
            cost = nbytes(to_wire(payload, self.wire_dtype))  # as sent
            if version >= int(vals["log_from"]) and cost <= nbytes(base):
                config.update(mode="cached", from_round=version, logs=",".join(map(str, logs)))
                arrays.update(payload)
            else:
                config["mode"] = "dense"
                arrays.update(base)
        else:
            config.update(mode="cached", from_round=version, logs="")
        sent = {k: v for k, v in arrays.items() if not k.startswith("model.")}  # base: as held
        arrays.update(to_wire(sent, self.wire_dtype))  # lossless but for FlexLoRA's SVD factors
        return Broadcast(arrays, config)

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        arrays, values = dict(state.arrays), dict(state.values)
        for c, r in replies:
            if r is None:  # its cache may or may not have moved: dense at next contact
                values.pop(f"version.{c}", None)
        model = select(state.arrays, "model.")
        ok = [(c, _upcast(r, model)) for c, r in replies if r is not None]
        if not ok:
            return State(arrays, values), {"aggregated": 0}
        wire = self.wire_dtype
        weights = self.weights([r for _, r in ok])
        total = float(sum(weights))
        p = [w / total for w in weights]
        dense = weighted_mean([select(r.arrays, "dense.") for _, r in ok], weights)
        if self.upload_increments:  # the mean increment added to the current dense values
            dense = {k: model[k] + v.to(model[k].device, model[k].dtype) for k, v in dense.items()}
        arrays.update(with_prefix(snap(dense, wire), "model."))
        log, metrics = self.aggregate_adapters(arrays, ok, p, rnd)
        log = snap(log, wire)  # merged here exactly as the clients will merge it
        for k, v in list(arrays.items()):
            if k.startswith("lora.") and state.arrays.get(k) is not v:
                arrays[k] = snap({k: v}, wire)[k]
                values[f"changed.{k}"] = rnd
        if log:
            held = select(arrays, "lora.")
            for mod, delta in self.merge_deltas(log, held, _targets(state)).items():
                arrays[f"model.{mod}.weight"] = merge(arrays[f"model.{mod}.weight"], delta)
            arrays.update(with_prefix(log, f"log.{rnd}."))
            values[f"merged.{rnd}"] = 1
        for c, _ in ok:
            values[f"version.{c}"] = rnd
        oldest = rnd + 1 - self.log_rounds
        for key in [k for k in arrays if k.startswith("log.") and int(k.split(".")[1]) < oldest]:
            del arrays[key]
        for key in [k for k in values if k.startswith("merged.") and int(k[7:]) < oldest]:
            del values[key]
        values["log_from"] = max(0, oldest)
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
        for mod in _targets(state):
            m, n = model[f"{mod}.weight"].shape
            for f in self.trained(rnd):
                spec[f"lora.{mod}.{f}"] = ((r, n) if f == "A" else (m, r), w(torch.float32))
        return spec

    # ------------------------------------------------------------------ client
    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        rnd, rank = int(msg.config["round"]), int(msg.config["rank"])
        msg = Broadcast(_upcast(Reply(msg.arrays), dict(model.state_dict())).arrays, msg.config)
        targets = self.targets(model)
        dense = set(self.dense_keys(model, targets))
        base, held = self._synchronize(msg, state, targets, model)
        seed = rng.initial_seed()
        fresh = torch.Generator().manual_seed(derive_seed(seed, _FRESH, rnd))
        start = self.start_adapters(held, rnd, rank, targets, fresh)

        plain = {**base, **select(msg.arrays, "dense.")}
        alpha = self.client_scale(rank) * rank
        work = adapted_copy(model, plain, targets, start, rank, alpha, self.lora_dropout)
        trained = self.trained(rnd)
        params = set_trainable(work, trained, dense)
        opt = torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
        )
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # LoRA dropout draws from the client's stream
            torch.manual_seed(derive_seed(seed, _DROPOUT))
            lrs = self.round_lrs(rnd)
            stats = local_train(
                work,
                data.batches(self.batch_size, len(lrs), rng, rnd),
                opt,
                lrs,
                grad_clip=self.grad_clip,
            )
        train_s = time.perf_counter() - t0
        out = with_prefix(adapter_arrays(work, trained), "lora.")
        out.update(with_prefix(dense_arrays(work, dense), "dense."))
        if self.upload_increments:  # minus the values this round started from (module docstring)
            origin = {**with_prefix(start, "lora."), **select(msg.arrays, "dense.", strip=False)}
            out = {k: (v - origin[k].to(v.device, v.dtype)).contiguous() for k, v in out.items()}
        out = to_wire(out, self.wire_dtype)
        state_bytes = sum(
            v.numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.ndim > 0
        )
        metrics = reply_metrics(
            data.num_examples,
            train_loss=stats.mean_loss,
            skipped_steps=stats.skipped_steps,
            optimizer_state_bytes=state_bytes,
            train_s=train_s,
            **local_eval_metrics(self, work, data, rnd),  # P-local: base + the trained adapter
        )
        new_state = State(
            {**with_prefix(base, "cache."), **with_prefix(held, "held.")}, {"version": rnd}
        )
        return Reply(out, metrics), new_state

    def _synchronize(
        self, msg: Broadcast, state: State | None, targets: dict[str, Target], model: nn.Module
    ) -> tuple[Arrays, Arrays]:
        """(frozen base, held global adapter) as of this round's broadcast."""
        held = select(state.arrays, "held.") if state is not None else {}
        held.update(select(msg.arrays, "lora."))
        if msg.config["mode"] == "dense":
            return self.fill_frozen(select(msg.arrays, "model."), state, model), held
        if state is None:
            raise RuntimeError("client has no cached base but the server sent none")
        own, start = int(state.values["version"]), int(msg.config["from_round"])
        if own < start:
            raise RuntimeError(f"client cache is at round {own}; the server assumed {start}")
        base = select(state.arrays, "cache.")
        logs = [int(s) for s in str(msg.config["logs"]).split(",") if s]
        for s in logs:
            if s < own:
                continue
            for mod, delta in self.merge_deltas(
                select(msg.arrays, f"log.{s}."), held, list(targets)
            ).items():
                base[f"{mod}.weight"] = merge(base[f"{mod}.weight"], delta)
        return base, held


def _upcast(msg: Reply, model: Arrays) -> Reply:
    """``msg``'s arrays as the receiver holds them: ``lora.*`` and ``log.*`` (factors, merge
    payloads) in fp32, ``dense.<k>`` in the dtype of ``model[k]``, the rest unchanged (exact
    upcasts of a 16-bit transport; no copy when the dtypes match)."""
    dtypes: dict[str, torch.dtype] = {}
    for key in msg.arrays:
        if key.startswith(("lora.", "log.")):
            dtypes[key] = torch.float32
        elif key.startswith("dense.") and key[6:] in model:
            dtypes[key] = model[key[6:]].dtype
    return Reply(from_wire(msg.arrays, dtypes), msg.metrics)


def _targets(state: State) -> list[str]:
    return [m for m in str(state.values["lora_modules"]).split(",") if m]


def _dense_keys(state: State) -> list[str]:
    return [k for k in str(state.values["dense_keys"]).split(",") if k]


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
