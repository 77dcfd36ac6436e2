"""Three clients of four Gaussian clusters in R^8 and an in-process run over them, the test bed of
the methods that keep part of the model on the clients (imported by ``test_partial.py``,
``test_fedrep.py`` and ``test_moon.py``; not a test module).

``labels``: client ``cid`` names cluster c as class (c + cid) mod 4, a concept shift only a
personal head can follow; ``features``: every client names them alike but sees its inputs scaled
and shifted its own way. The model is the MLP with one hidden layer of 12 (``body.0`` Linear,
``body.1`` BatchNorm under ``norm="batch"``) and its ``head``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedlore.algorithm import Algorithm
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.loop import RoundLoop
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.engine.validate import validate_reply
from fedlore.models import build_model
from fedlore.models.mlp import MLP
from fedlore.seeding import generator
from fedlore.tensors import select
from fedlore.types import Broadcast, Reply, State

D, C, N = 8, 4, 3
HEAD = {"head.weight", "head.bias"}
BN = {f"body.1.{k}" for k in ("weight", "bias", "running_mean", "running_var")} | {
    "body.1.num_batches_tracked"
}


def model(norm: str = "none", seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    net = build_model("mlp", (D,), C, hidden=[12], norm=norm)
    assert isinstance(net, MLP)  # its body and head are what the tests read
    return net


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
        self.got: list[dict[int, Reply]] = []
        self.rows: list[dict[str, object]] = []
        self.clients: list[dict[int, State]] = []
        run = self

        class Spy(LocalTransport):
            def send(
                self, rnd: int, messages: dict[int, Broadcast]
            ) -> dict[int, Reply | BaseException]:
                run.sent.append(dict(messages))
                out = super().send(rnd, messages)
                replies = {c: r for c, r in out.items() if isinstance(r, Reply)}
                assert len(replies) == len(out), out  # every client of these runs answers
                run.got.append(replies)
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


SERVER_SETTINGS: tuple[dict[str, object], ...] = (
    {"transport_dtype": "bf16"},
    {"robust_aggregate": "median"},
    {"server_optimizer": "adam", "server_eta": 0.01},
)
"""The FedAvg server settings a method built on it keeps: 16-bit uploads, a robust mean, a
server optimizer (:func:`check_fedavg_server`)."""


def check_fedavg_server(
    algo: Algorithm,
    settings: dict[str, object],
    shared: set[str],
    kept: Callable[[State], dict[str, torch.Tensor]],
) -> None:
    """One round of ``algo`` (built with ``settings``, one of :data:`SERVER_SETTINGS`) over the
    N clients: every reply is valid and what each client keeps (``kept`` of its state) stays
    fp32; the server moves the ``shared`` tensors only, all fp32; a bf16 upload is bf16, the
    median is the coordinate-wise median of the deltas, the server optimizer keeps moments of
    exactly the shared tensors."""
    state = algo.init_server(model(), generator(0, 2))
    replies: list[tuple[int, Reply | None]] = []
    ups: dict[str, list[torch.Tensor]] = {}
    for c in range(N):
        msg = algo.broadcast(state, 0, c)
        reply, new_state = algo.client_update(msg, None, model(), client(c), generator(0, 3, c))
        assert validate_reply(reply, algo.expected_reply(state, 0, c)) is None
        assert all(v.dtype == torch.float32 for v in kept(new_state).values())
        replies.append((c, reply))
        for k, v in reply.arrays.items():
            ups.setdefault(k.removeprefix("update."), []).append(v)
    new, _ = algo.aggregate(state, replies, 0)
    before = select(state.arrays, "model.")
    assert set(ups) == shared
    assert all(torch.equal(new.arrays["model." + k], before[k]) for k in set(before) - shared)
    assert all(v.dtype == torch.float32 for v in select(new.arrays, "model.").values())
    if "transport_dtype" in settings:
        assert all(v.dtype == torch.bfloat16 for vs in ups.values() for v in vs)
    if "robust_aggregate" in settings:
        for k in shared:
            median = torch.stack(ups[k]).median(dim=0).values
            torch.testing.assert_close(new.arrays["model." + k], before[k] + median)
    if "server_optimizer" in settings:
        moments = {k.split(".", 2)[2] for k in new.arrays if k.startswith("sopt.m.")}
        assert moments == shared
