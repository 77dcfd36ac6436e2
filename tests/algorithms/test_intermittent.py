"""Intermittent FedLore clients (issue: FedLore at scale, item 2).

A client absent for 1, 5 or 50 rounds catches up either from the server's log of (Δ^s, P^s, a_s)
increments or from the dense model, whichever costs fewer bytes; afterwards its cache equals the
server model exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlore.algorithms.fedlore import FedLore
from fedlore.checks import setup_rounds
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.loop import RoundLoop
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.seeding import generator
from fedlore.settings import LocalTraining
from fedlore.tensors import nbytes, select
from fedlore.types import State

IN, HID, NCLS, RANK = 24, 20, 3, 2
RETURNER = 0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, HID)
        self.head = nn.Linear(HID, NCLS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def build() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net()


def data(cid: int) -> ClientData:
    g = torch.Generator().manual_seed(100 + cid)
    x = torch.randn(40, IN, generator=g) + cid
    y = torch.randint(0, NCLS, (40,), generator=g)
    return ClientData(cid, TensorSplit(x, y), TensorSplit(x[:4], y[:4]))


def log_option_bytes(state: State, version: int, rnd: int) -> int:
    """What the increment log would cost a client whose cache is W^version and which holds
    P^version: Δ^s for s in [version, rnd), P^s for s in (version, rnd), P^rnd, dense rest."""
    plan_keys = {k[5:] for k in state.values if k.startswith("plan.")}
    total = sum(nbytes(select(state.arrays, f"log.{s}.")) for s in range(version, rnd))
    total += sum(nbytes(select(state.arrays, f"bank.{s}.")) for s in range(version + 1, rnd + 1))
    model = select(state.arrays, "model.")
    return total + nbytes({k: v for k, v in model.items() if k not in plan_keys})


@pytest.mark.parametrize("gap", [1, 5, 50])
@pytest.mark.parametrize("log_rounds", [60, 3])
def test_returning_client_syncs_exactly_with_the_cheaper_option(gap: int, log_rounds: int) -> None:
    algo = FedLore(
        train=LocalTraining(local_steps=2, batch_size=8, lr=1e-2, rounds=gap + 3),
        rank=RANK,
        log_rounds=log_rounds,
    )
    back = gap + 1  # present in round 0, absent in rounds 1..gap, back in round gap+1

    def sampler(rnd: int) -> list[int]:
        return [0, 1, 2] if rnd <= 0 or rnd == back else [1, 2]

    store = ClientStore()
    transport = LocalTransport(algo, data, build, 7, store)
    loop = RoundLoop(algo, transport, sampler)
    state = algo.init_server(build(), generator(7, 2))
    for rnd in range(-setup_rounds(algo), back):
        state, row = loop.run_round(state, rnd, back)
        assert row["rejected"] == 0
    kept = store.get(RETURNER)
    assert kept is not None and kept.values["version"] == 0  # its cache is still W^0

    msg = algo.broadcast(state, back, RETURNER)
    dense_state = State(state.arrays, {k: v for k, v in state.values.items()})
    del dense_state.values[f"version.{RETURNER}"]
    dense_bytes = nbytes(algo.broadcast(dense_state, back, RETURNER).arrays)
    if gap < log_rounds:  # the log still reaches back to round 0
        expected = min(dense_bytes, log_option_bytes(state, 0, back))
    else:  # older than the log: only the dense model will do
        expected = dense_bytes
    assert nbytes(msg.arrays) == expected
    assert msg.config["mode"] == ("dense" if expected == dense_bytes else "log")
    if gap == 1:
        assert msg.config["mode"] == "log"  # one missed increment is far cheaper than W
    if gap >= log_rounds:
        assert msg.config["mode"] == "dense"

    global_before = {k: v.clone() for k, v in algo.global_arrays(state).items()}
    state, row = loop.run_round(state, back, back)
    assert row["rejected"] == 0 and RETURNER in row["accepted_clients"]
    kept = store.get(RETURNER)
    assert kept is not None
    cache = select(kept.arrays, "cache.")
    assert cache.keys() == global_before.keys()
    for k, v in global_before.items():
        assert torch.equal(cache[k], v), k  # bit-identical reconstruction of W^back
