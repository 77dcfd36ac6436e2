"""Two clients with conflicting least-squares problems, the drift-correction methods' test bed
(imported by ``test_scaffold.py`` and ``test_feddyn.py``; not a test module).

Each client ``cid`` fits y = x·w_cid + noise with its own w, so the clients' optima disagree and
the global optimum of ``Σ_i p_i · ½ mean_i (x·w - y)²`` is known in closed form
(:func:`optimum`). With many full-batch local steps FedAvg settles off it (client drift).
"""

from __future__ import annotations

import torch
from torch import nn

from fedlore.algorithms.fedavg import FedAvg
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.types import Broadcast, Reply, State


def regression(cid: int, n: int = 32, d: int = 3) -> ClientData:
    """Client ``cid``: y = x·w_cid + noise, each client with its own w (non-IID)."""
    g = torch.Generator().manual_seed(10 + cid)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) * (1 + 2 * cid) + cid
    y = x @ w + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return ClientData(cid, TensorSplit(x, y), TensorSplit(x[:0], y[:0]))


def linear_model() -> nn.Module:
    """The same float64 linear model (no bias) every call."""
    torch.manual_seed(0)
    return nn.Linear(3, 1, bias=False).double()


def make_algo(cls: type[FedAvg], **extra: object) -> FedAvg:
    """``cls`` with lr 0.05, 20 local steps, full batches of 32 and uniform weights."""
    common = {"lr": 0.05, "local_steps": 20, "batch_size": 32, "weighting": "uniform"}
    return cls.of(**{**common, **extra})  # type: ignore[arg-type]


def train(algo: FedAvg, rounds: int, sizes: tuple[int, int] = (32, 32)) -> torch.Tensor:
    """Full participation of the two regression clients (of ``sizes`` examples), in process:
    the final global weight."""
    model = linear_model()
    state = algo.init_server(model, torch.Generator())
    kept: dict[int, State | None] = {0: None, 1: None}
    for rnd in range(rounds):
        replies: list[tuple[int, Reply | None]] = []
        for cid in (0, 1):
            msg: Broadcast = algo.broadcast(state, rnd, cid)
            reply, kept[cid] = algo.client_update(
                msg,
                kept[cid],
                linear_model(),
                regression(cid, sizes[cid]),
                torch.Generator().manual_seed(rnd),
            )
            replies.append((cid, reply))
        state, _ = algo.aggregate(state, replies, rnd)
    return state.arrays["model.weight"].flatten()


def optimum(sizes: tuple[int, int], uniform: bool) -> torch.Tensor:
    """argmin Σ_i p_i · ½ mean_i (x·w - y)², p_i = 1 or n_i."""
    clients = [regression(c, n) for c, n in zip((0, 1), sizes, strict=True)]
    p = [1.0 if uniform else float(n) for n in sizes]
    hessian = sum(
        w * d.train.x.T @ d.train.x / len(d.train) for w, d in zip(p, clients, strict=True)
    )
    rhs = sum(w * d.train.x.T @ d.train.y / len(d.train) for w, d in zip(p, clients, strict=True))
    return torch.linalg.solve(hessian, rhs)
