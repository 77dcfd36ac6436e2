"""Proposition 8 of the seed (line ~1588) on the real FedLore code.

With a shared basis P fixed within a round and common decay factors a_k, each client ends at
``W_K = a W + P Z_i`` and the server's ``a W + P Σ p_i Z_i`` equals the weighted average of the
clients' endpoint models, also with a cosine schedule inside the round and decoupled decay.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlore.algorithms.fedlore import FedLore
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.settings import LocalTraining
from fedlore.tensors import model_arrays, select
from fedlore.types import Reply, State

IN, H1, H2, K = 12, 10, 9, 3
SIZES = [20, 33, 47]


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, H1)
        self.fc2 = nn.Linear(H1, H2)
        self.head = nn.Linear(H2, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TwoLayer()


def make_clients() -> list[ClientData]:
    out = []
    for c, n in enumerate(SIZES):
        g = torch.Generator().manual_seed(100 + c)
        x = torch.randn(n, IN, generator=g) * (1 + c) + c  # different input distributions
        y = torch.randint(0, K, (n,), generator=g)
        split = TensorSplit(x, y)
        out.append(ClientData(c, split, split))
    return out


def run_round(algo: FedLore, state: State, rnd: int, clients, client_states, model):
    """One round by hand; returns (new state, endpoints, replies, start models)."""
    endpoints, replies, starts = {}, [], {}
    for c in clients:
        msg = algo.broadcast(state, rnd, c.client_id)
        reply, cstate = algo.client_update(
            msg,
            client_states.get(c.client_id),
            model,
            c,
            torch.Generator().manual_seed(7 + c.client_id),
        )
        client_states[c.client_id] = cstate
        starts[c.client_id] = select(cstate.arrays, "cache.")
        endpoints[c.client_id] = model_arrays(model)
        replies.append((c.client_id, reply))
    new_state, _ = algo.aggregate(state, list(replies), rnd)
    return new_state, endpoints, dict(replies), starts


def weighted_endpoint(endpoints: dict[int, dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    total = float(sum(SIZES))
    return torch.stack([endpoints[c][key].double() * (SIZES[c] / total) for c in endpoints]).sum(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    ("schedule", "weight_decay"), [("cosine", 0.1), ("constant", 0.0), ("cosine", 0.0)]
)
def test_aggregate_equals_weighted_endpoint_average(schedule: str, weight_decay: float) -> None:
    algo = FedLore(
        train=LocalTraining(
            local_steps=5,
            schedule=schedule,
            rounds=3,
            weight_decay=weight_decay,
            lr=1e-2,
            batch_size=8,
        ),
        rank=2,
        init_basis="random",
    )
    model = make_model()
    state = algo.init_server(model, torch.Generator().manual_seed(1))
    plan = algo.plan(model)
    assert set(plan) == {"fc1.weight", "fc2.weight"}
    clients = make_clients()
    cstates: dict[int, State] = {}
    for rnd in range(2):  # round 1 starts from caches synced with the increments of round 0
        w0 = algo.global_arrays(state)
        state, endpoints, _, starts = run_round(algo, state, rnd, clients, cstates, model)
        for c in starts:
            for k, v in w0.items():
                assert torch.equal(starts[c][k], v), (rnd, c, k)
        new = algo.global_arrays(state)
        for key in new:
            avg = weighted_endpoint(endpoints, key)
            assert rel_err(new[key], avg) < 1e-5, (rnd, key)
            # clients really moved apart (otherwise the check is vacuous)
            spread = max(rel_err(endpoints[c][key], avg) for c in endpoints)
            assert spread > 1e-4, (rnd, key, spread)
        # the global change of a projected matrix is not a plain average of unrelated deltas:
        # with decay it contains (a - 1) W, a full-rank term
        for key in plan:
            delta = (new[key].double() - w0[key].double()).double()
            rank = int(torch.linalg.matrix_rank(delta, atol=1e-4 * float(delta.abs().max())))
            if weight_decay > 0:
                assert rank > algo.rank
            else:
                assert rank <= algo.rank


@pytest.mark.parametrize(
    ("schedule", "weight_decay"), [("constant", 0.0), ("cosine", 0.0), ("cosine", 0.1)]
)
def test_uploaded_coordinates_reproduce_endpoint(schedule: str, weight_decay: float) -> None:
    """W_K = a W_0 + P Z for every client (a = 1 without decay)."""
    algo = FedLore(
        train=LocalTraining(
            local_steps=5,
            schedule=schedule,
            rounds=3,
            weight_decay=weight_decay,
            lr=1e-2,
            batch_size=8,
        ),
        rank=2,
        init_basis="random",
    )
    model = make_model()
    state = algo.init_server(model, torch.Generator().manual_seed(1))
    plan = algo.plan(model)
    bases = select(state.arrays, "bank.0.")
    rnd = 1  # a round inside the cosine schedule (lr varies within the round)
    a = algo.round_decay(rnd)
    if weight_decay == 0:
        assert a == 1.0
    else:
        lrs = algo.round_lrs(rnd)
        assert len(set(lrs)) == (1 if schedule == "constant" else len(lrs))
        assert a == pytest.approx(float(torch.tensor([1 - lr * weight_decay for lr in lrs]).prod()))
    for c in make_clients():
        msg = algo.broadcast(state, rnd, c.client_id)
        assert msg.config["mode"] == "dense"
        w0 = select(msg.arrays, "model.")
        reply, _ = algo.client_update(msg, None, model, c, torch.Generator().manual_seed(3))
        assert isinstance(reply, Reply)
        assert reply.metrics["skipped_steps"] == 0
        wk = model_arrays(model)
        for k, s in plan.items():
            z = reply.arrays["update." + k]
            assert z.shape == (s.rank, s.n)
            recon = s.unview(a * s.view(w0[k]).double() + bases[k].double() @ z.double())
            assert rel_err(recon, wk[k]) < 1e-5, (c.client_id, k)
            # the endpoint really moved
            assert rel_err(wk[k], w0[k]) > 1e-4
        # the dense part is uploaded as the endpoint itself
        for k in ("fc1.bias", "head.weight"):
            assert torch.equal(reply.arrays["dense." + k], wk[k])
