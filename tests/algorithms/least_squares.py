"""Two clients with conflicting least-squares problems, the drift-correction methods' test bed
(imported by ``test_scaffold.py``, ``test_feddyn.py`` and ``test_fednova.py``; not a test module).

Each client ``cid`` fits y = x·w_cid + noise with its own w, so the clients' optima disagree and
the global optimum of ``Σ_i p_i · ½ mean_i (x·w - y)²`` is known in closed form
(:func:`optimum`). With many full-batch local steps FedAvg settles off it (client drift).
"""

from __future__ import annotations

import torch
from torch import nn

from fedlore.algorithms.fedavg import FedAvg
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.validate import validate_reply
from fedlore.types import Broadcast, Reply, State


def regression(cid: int, n: int = 32, d: int = 3) -> ClientData:
    """Client ``cid``: y = x·w_cid + noise, each client with its own w (non-IID)."""
    g = torch.Generator().manual_seed(10 + cid)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) * (1 + 2 * cid) + cid
    y = x @ w + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return ClientData(cid, TensorSplit(x, y), TensorSplit(x[:0], y[:0]))


def linear_model() -> nn.Linear:
    """The same float64 linear model (no bias) every call."""
    torch.manual_seed(0)
    return nn.Linear(3, 1, bias=False).double()


def make_algo(cls: type[FedAvg], **extra: object) -> FedAvg:
    """``cls`` with lr 0.05, 20 local steps, full batches of 32 and uniform weights."""
    common = {"lr": 0.05, "local_steps": 20, "batch_size": 32, "weighting": "uniform"}
    return cls.of(**{**common, **extra})


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


def frozen_bias_rounds(algo: FedAvg, rounds: int = 2) -> tuple[State, list[Broadcast], State]:
    """``algo`` (made with ``freeze=("bias",)``) on client 0 alone for ``rounds`` rounds of a
    linear model with a bias: the server's last state, each round's broadcast and the client's
    last state. Every reply passes the engine's check against ``expected_reply``; from the
    second round the server sends no frozen tensor and the client takes the bias from its
    cache."""
    torch.manual_seed(0)
    state = algo.init_server(nn.Linear(3, 1).double(), torch.Generator())
    kept: State | None = None
    sent: list[Broadcast] = []
    for rnd in range(rounds):
        sent.append(algo.broadcast(state, rnd, 0))
        torch.manual_seed(rnd + 1)  # a client model of other weights: the broadcast sets them
        model = nn.Linear(3, 1).double()
        reply, kept = algo.client_update(sent[-1], kept, model, regression(0), torch.Generator())
        assert validate_reply(reply, algo.expected_reply(state, rnd, 0)) is None
        state, _ = algo.aggregate(state, [(0, reply)], rnd)
    assert kept is not None
    return state, sent, kept


def minibatch_update(algo: FedAvg, seed: int, global_seed: int) -> torch.Tensor:
    """Client 1's upload ``update.weight`` after one round of ``algo`` on minibatches (its
    ``batch_size`` below 32), its generator seeded ``seed`` and torch's global one
    ``global_seed``: a client's draws must come from its own generator only."""
    state = algo.init_server(linear_model(), torch.Generator())
    model = linear_model()
    msg = algo.broadcast(state, 0, 1)
    torch.manual_seed(global_seed)
    rng = torch.Generator().manual_seed(seed)
    reply, _ = algo.client_update(msg, None, model, regression(1), rng)
    return reply.arrays["update.weight"]


def assert_draws_from_its_generator(algo: FedAvg) -> None:
    """The same client generator gives the same upload whatever the global generator; another
    seed other minibatches, another upload."""
    first = minibatch_update(algo, 3, global_seed=1)
    assert torch.equal(first, minibatch_update(algo, 3, global_seed=2))
    assert not torch.allclose(first, minibatch_update(algo, 4, global_seed=1))


def checkpointed_states(
    method: str, prefix: str, out: object
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """A 3-client, 2-round digits run of ``method`` killed after round 0 (in ``out``): the
    server's ``prefix`` arrays and each client's, as the checkpoint holds them (what a
    resumed run continues from)."""
    from pathlib import Path

    from fedlore.config import load_config
    from fedlore.engine.callbacks import Checkpointer
    from fedlore.engine.rundir import run_dir
    from fedlore.experiment import run_one
    from fedlore.tensors import select

    cfg = load_config(
        None,
        [
            f"name={method}_ckpt",
            "num_clients=3",
            "rounds=2",
            "local_steps=2",
            "batch_size=16",
            "model.kwargs={hidden: [8]}",
            "partition.min_size=10",
            "progress=false",
            f"output_dir={out}",
        ],
    )
    assert run_one(cfg, method, 3, stop_after=0) is None
    _, server, store = Checkpointer.load(Path(run_dir(cfg, method, 3)) / "checkpoint.pt")
    clients = [select(st["arrays"], prefix) for st in store.to_dict().values()]
    return select(server.arrays, prefix), clients
