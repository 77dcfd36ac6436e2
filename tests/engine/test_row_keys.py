"""A method's own metrics never replace what the round loop measures: per-client metrics named
like a loop key are refused when the loop is built, aggregate metrics named so in the round
(a method that declared ``per_client_metrics = ("train_loss",)`` used to turn the row's mean
training loss into a dict of the clients' values, silently)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest

from fedlore.algorithms.fedavg import FedAvg
from fedlore.config import load_config
from fedlore.data.federation import build_federation
from fedlore.engine.loop import LOOP_KEYS, RoundLoop
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.seeding import SERVER_INIT, generator
from fedlore.types import Reply, State

SEED = 0


@dataclasses.dataclass(frozen=True)
class PerClientLoss(FedAvg):
    per_client_metrics: ClassVar[tuple[str, ...]] = ("train_loss",)


@dataclasses.dataclass(frozen=True)
class AggregateLoss(FedAvg):
    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, dict[str, Any]]:
        state, metrics = super().aggregate(state, replies, rnd)
        return state, {**metrics, "bytes_up": 0}


def _loop(cls: type[FedAvg]) -> tuple[RoundLoop, State]:
    cfg = load_config(
        None,
        ["num_clients=3", "local_steps=1", "model.kwargs={hidden: [8]}", "algorithms=[fedavg]"],
    )
    base = make_algorithm("fedavg", cfg)
    assert isinstance(base, FedAvg)
    algo = cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    fed = build_federation(cfg, SEED)
    build = model_factory(cfg, fed, SEED)
    state = algo.init_server(build(), generator(SEED, SERVER_INIT))
    transport = LocalTransport(algo, fed.client, build, SEED, ClientStore())
    return RoundLoop(algo, transport, lambda rnd: [0, 1, 2]), state


def test_per_client_metrics_named_like_a_loop_key_are_refused() -> None:
    with pytest.raises(ValueError, match=r"per_client_metrics names \['train_loss'\].*client_"):
        _loop(PerClientLoss)
    assert {"train_loss", "bytes_up", "wall_s", "local_accuracy"} <= LOOP_KEYS


def test_an_aggregate_metric_named_like_a_loop_key_is_refused_and_others_pass() -> None:
    loop, state = _loop(AggregateLoss)
    with pytest.raises(ValueError, match=r"aggregate returned the metric\(s\) \['bytes_up'\]"):
        loop.run_round(state, 0, 0)
    loop, state = _loop(FedAvg)
    _, row = loop.run_round(state, 0, 0)
    assert isinstance(row["train_loss"], float) and row["bytes_up"] > 0
