"""Three clients of four Gaussian clusters in R^8 and an in-process run over them, the test bed of
the methods that keep part of the model on the clients (imported by ``test_partial.py``,
``test_fedrep.py`` and ``test_moon.py``; not a test module).

``labels``: client ``cid`` names cluster c as class (c + cid) mod 4, a concept shift only a
personal head can follow; ``features``: every client names them alike but sees its inputs scaled
and shifted its own way. The model is the MLP with one hidden layer of 12 (``body.0`` Linear,
``body.1`` BatchNorm under ``norm="batch"``) and its ``head``.
"""

from __future__ import annotations

import torch
from torch import nn

from fedlore.algorithm import Algorithm
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.loop import RoundLoop
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.models import build_model
from fedlore.seeding import generator
from fedlore.types import Broadcast, Reply, State

D, C, N = 8, 4, 3
HEAD = {"head.weight", "head.bias"}
BN = {f"body.1.{k}" for k in ("weight", "bias", "running_mean", "running_var")} | {
    "body.1.num_batches_tracked"
}


def model(norm: str = "none", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", (D,), C, hidden=[12], norm=norm)


def client(cid: int, kind: str = "labels", seed: int = 0, n: int = 48, m: int = 48) -> ClientData:
    """Client ``cid``'s n training and m test examples (module docstring)."""
    g = torch.Generator().manual_seed(1000 * seed + cid)
    means = torch.randn(C, D, generator=torch.Generator().manual_seed(seed)) * 1.5
    c = torch.randint(0, C, (n + m,), generator=g)
    x = means[c] + torch.randn(n + m, D, generator=g)
    y = c
    if kind == "labels":
        y = (c + cid) % C
    else:
        x = x * torch.tensor([1.0, 6.0, 0.15, 3.0])[cid] + 4.0 * (cid - 1.5)
    return ClientData(cid, TensorSplit(x[:n], y[:n]), TensorSplit(x[n:], y[n:]))


class Run:
    """A federation run in process: every round's server state, broadcasts, replies and rows."""

    def __init__(
        self, algo: Algorithm, norm: str, schedule: list[list[int]], kind: str = "labels",
        seed: int = 0,
    ) -> None:  # fmt: skip
        self.store = ClientStore()
        self.sent: list[dict[int, Broadcast]] = []
        self.got: list[dict[int, Reply | BaseException]] = []
        self.rows: list[dict[str, object]] = []
        self.clients: list[dict[int, State]] = []
        run = self

        class Spy(LocalTransport):
            def send(
                self, rnd: int, messages: dict[int, Broadcast]
            ) -> dict[int, Reply | BaseException]:
                run.sent.append(dict(messages))
                out = super().send(rnd, messages)
                run.got.append(dict(out))
                return out

        transport = Spy(algo, lambda c: client(c, kind, seed), lambda: model(norm, seed),
                        seed, self.store)  # fmt: skip
        self.states = [algo.init_server(model(norm, seed), generator(seed, 2))]
        loop = RoundLoop(algo, transport, lambda rnd: schedule[rnd])
        for rnd in range(len(schedule)):
            state, row = loop.run_round(self.states[-1], rnd, len(schedule) - 1)
            assert row["accepted"] == len(schedule[rnd]), row
            self.states.append(state)
            self.rows.append(row)
            self.clients.append({c: self.store.get(c) for c in self.store.client_ids()})  # type: ignore[misc]
