"""Attack clients for testing a defence in simulation (``attack.*`` settings): a seeded share of
the federation's clients is malicious for the whole run and either trains on flipped labels or
uploads a corrupted update.

* ``label_flip``: the attacker's training labels y become C - 1 - y (C classes), a data
  poisoning attack (Tolpegin et al., "Data Poisoning Attacks Against Federated Learning
  Systems", ESORICS 2020); its update is otherwise honest.
* ``sign_flip``: the attacker uploads -s·Δ of its honest delta Δ (s = ``attack.scale``; 1 is the
  plain sign flip of Damaskinos et al. / Allen-Zhu et al.'s "bit flip" attacks).
* ``scale``: it uploads s·Δ (the boosted update of Bagdasaryan et al., "How To Backdoor
  Federated Learning", AISTATS 2020, without the backdoor).
* ``gaussian``: it uploads Gaussian noise N(0, s²) of Δ's shape (Fang et al., "Local Model
  Poisoning Attacks to Byzantine-Robust Federated Learning", USENIX Security 2020, use it as a
  baseline).

The attackers are ``round(fraction · N)`` clients chosen by a permutation seeded with the run
seed (:data:`fedlore.seeding.ATTACK`), the same for every method and round; the noise of
``gaussian`` is seeded per (seed, round, client). Update attacks corrupt the ``update.*`` dense
deltas, so they apply to the methods whose server averages dense deltas (the
``robust_aggregate`` capability); ``label_flip`` works for every classification method. Attacks
run on the in-process engine (``engine: local``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from fedlore.data.client_data import ClientData
from fedlore.engine.transport import Transport
from fedlore.seeding import ATTACK, generator
from fedlore.types import Broadcast, Reply

log = logging.getLogger(__name__)

UPDATE_ATTACKS = ("sign_flip", "scale", "gaussian")
"""The attacks that corrupt the uploaded update (the others poison the data)."""


def choose_attackers(num_clients: int, fraction: float, seed: int) -> frozenset[int]:
    """The ``round(fraction · num_clients)`` attacker ids, a seeded permutation's first ones."""
    count = round(fraction * num_clients)
    order = torch.randperm(num_clients, generator=generator(seed, ATTACK))
    return frozenset(int(c) for c in order[:count])


def flip_labels(data: ClientData, num_classes: int) -> ClientData:
    """``data`` with every training label y replaced by C - 1 - y (the test split untouched).

    Raises:
        ValueError: for real-valued targets (a regression task has no labels to flip).
    """
    if data.train.y.is_floating_point():
        raise ValueError("attack.kind=label_flip needs class labels; this task's targets are real")
    train = replace(data.train, y=(num_classes - 1) - data.train.y)
    return replace(data, train=train)


def corrupt(reply: Reply, kind: str, scale: float, rng: torch.Generator) -> Reply:
    """The attacker's reply: its floating ``update.*`` tensors corrupted by ``kind``."""
    arrays = dict(reply.arrays)
    for key, t in reply.arrays.items():
        if not key.startswith("update.") or not t.is_floating_point():
            continue
        if kind == "sign_flip":
            arrays[key] = -scale * t
        elif kind == "scale":
            arrays[key] = scale * t
        elif kind == "gaussian":
            noise = torch.randn(t.shape, generator=rng, dtype=torch.float32)
            arrays[key] = (scale * noise).to(t.device, t.dtype)
        else:
            raise ValueError(f"unknown update attack {kind!r}; choose one of {UPDATE_ATTACKS}")
    return Reply(arrays=arrays, metrics=dict(reply.metrics))


class AttackingTransport:
    """Wraps a transport: the attackers' replies are corrupted before the server sees them."""

    def __init__(
        self, inner: Transport, attackers: frozenset[int], kind: str, scale: float, seed: int
    ) -> None:
        self.inner, self.attackers, self.kind, self.scale, self.seed = (
            inner,
            attackers,
            kind,
            scale,
            seed,
        )

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        replies = self.inner.send(rnd, messages)
        for cid, reply in replies.items():
            if cid in self.attackers and isinstance(reply, Reply):
                rng = generator(self.seed, ATTACK, rnd, cid)
                replies[cid] = corrupt(reply, self.kind, self.scale, rng)
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def attacked(
    factory: Callable[..., Transport],
    kind: str,
    fraction: float,
    scale: float,
    num_clients: int,
    num_classes: int,
) -> Callable[..., Transport]:
    """``factory`` (``(algorithm, client_data, model_factory, seed, store) -> Transport``) with
    the attack applied: the attackers' data flipped, or their replies corrupted."""
    if kind == "none" or fraction <= 0:
        return factory

    def make(algo: Any, client_data: Callable[[int], ClientData], *rest: Any) -> Transport:
        seed = int(rest[1])
        bad = choose_attackers(num_clients, fraction, seed)
        log.info("attack %s: clients %s are malicious", kind, sorted(bad))
        data = client_data
        if kind == "label_flip":

            def data(cid: int) -> ClientData:
                own = client_data(cid)
                return flip_labels(own, num_classes) if cid in bad else own

        inner = factory(algo, data, *rest)
        if kind in UPDATE_ATTACKS:
            return AttackingTransport(inner, bad, kind, scale, seed)
        return inner

    return make
