"""The federated LoRA methods' client round: :class:`LoraClient`, the client half of
:class:`~fedlore.algorithms.lora_common.LoraMethod`, for all seven methods; each method's hooks
say which factors train and how a client's adapter starts.

Parity with every other method (reference notes section 13): each client synchronizes its cached
frozen base (the broadcast's base at first contact, else its cache with every logged merge of
FLoRA / FRLoRA since its version merged in with the server's own function,
:func:`~fedlore.algorithms.sync.replay_steps`: the replay of FedLore's clients, seed
the FedLore paper Algorithm 1 lines 6-10), works on a deep copy of the
scratch model (peft mutates modules, and heterogeneous ranks need a fresh adapter), loads base +
dense strictly, injects the adapter, trains the round's factors and the dense parameters with a
fresh AdamW for K steps on the same minibatches and schedule as every method, and uploads the
trained factors and dense parameters (their increments under ``upload_increments``) at the wire
dtype.

Client state: ``cache.*`` (the frozen base as synced), ``held.<mod>.A|B`` (the global adapter
tensors as received, never the locally trained ones), value ``version``.
"""

from __future__ import annotations

import abc
import time

import torch
from torch import nn

from fedlore.algorithms.base import Hyper, local_eval_metrics, reply_metrics
from fedlore.algorithms.sync import replay_steps, split_names, upcast
from fedlore.data.client_data import ClientData
from fedlore.lora import (
    Factor,
    Target,
    adapted_copy,
    adapter_arrays,
    dense_arrays,
    merge,
    set_trainable,
)
from fedlore.seeding import derive_seed
from fedlore.tensors import select, to_wire, with_prefix
from fedlore.train.local import local_train
from fedlore.types import Arrays, Broadcast, Reply, State

# purpose tags for streams derived from the client generator without consuming it, so every
# method draws the same minibatches (parity)
_FRESH, _DROPOUT = 101, 102


class LoraClient(Hyper, abc.ABC):
    """The client side of the LoRA methods (module docstring), a base of
    :class:`~fedlore.algorithms.lora_common.LoraMethod`, which defines the hooks and the
    settings it reads (``lora_dropout``)."""

    lora_dropout: float

    @abc.abstractmethod
    def targets(self, model: nn.Module) -> dict[str, Target]:
        """The adapted Linears."""

    @abc.abstractmethod
    def dense_keys(self, model: nn.Module, targets: dict[str, Target]) -> list[str]:
        """Plain names of the tensors that train and travel densely."""

    @abc.abstractmethod
    def client_scale(self, rank: int) -> float:
        """s_k of a client of rank ``rank``."""

    @abc.abstractmethod
    def trained(self, rnd: int) -> tuple[Factor, ...]:
        """The factors clients train and upload in round ``rnd``."""

    @abc.abstractmethod
    def start_adapters(
        self,
        held: Arrays,
        rnd: int,
        rank: int,
        targets: dict[str, Target],
        fresh: torch.Generator,
    ) -> Arrays:
        """A client's adapter at the start of local training."""

    @abc.abstractmethod
    def merge_deltas(self, log: Arrays, held: Arrays, modules: list[str]) -> Arrays:
        """``<mod>`` -> fp32 ΔW merged into the base from one round's payload."""

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        rnd, rank = int(msg.config["round"]), int(msg.config["rank"])
        msg = Broadcast(received(msg.arrays, dict(model.state_dict())), msg.config)
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
            params,
            lr=self.train.lr,
            betas=self.train.betas,
            eps=self.train.eps,
            weight_decay=self.train.weight_decay,
        )
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # LoRA dropout draws from the client's stream
            torch.manual_seed(derive_seed(seed, _DROPOUT))
            lrs = self.round_lrs(rnd, data.num_examples)
            stats = local_train(
                work,
                data.batches(self.train.batch_size, len(lrs), rng, rnd),
                opt,
                lrs,
                grad_clip=self.train.grad_clip,
            )
        train_s = time.perf_counter() - t0
        out = with_prefix(adapter_arrays(work, trained), "lora.")
        out.update(with_prefix(dense_arrays(work, dense), "dense."))
        if self.train.upload_increments:  # minus the values this round started from (lora_common)
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
        """(frozen base, held global adapter) as of this round's broadcast: the broadcast's base,
        or the cached one with every logged merge since its version merged in as the server
        merged it (:func:`~fedlore.algorithms.sync.replay_steps`; RuntimeError as it raises)."""
        held = select(state.arrays, "held.") if state is not None else {}
        held.update(select(msg.arrays, "lora."))
        if msg.config["mode"] == "dense":
            return self.fill_frozen(select(msg.arrays, "model."), state, model), held
        logs = {int(s) for s in split_names(msg.config["logs"])}
        base, steps = replay_steps(msg, state, int(msg.config["round"]), logs)
        for _, payload in steps:
            for mod, delta in self.merge_deltas(payload, held, list(targets)).items():
                base[f"{mod}.weight"] = merge(base[f"{mod}.weight"], delta)
        return base, held


def received(arrays: Arrays, model: Arrays) -> Arrays:
    """``arrays`` as the receiver holds them (:func:`~fedlore.algorithms.sync.upcast`): factors
    and merge payloads (``lora.*``, ``log.*``) in fp32, ``dense.<k>`` in ``model[k]``'s dtype."""
    return upcast(arrays, model, fp32=("lora.", "log."), roles=("dense.",))
