"""FedLore vs FedFull wall time per round in one process (not a test).

Same model, data, clients and local steps for both methods. Reports, side by side in one run:
wall seconds per round (and the FedLore / FedFull ratio), the share of FedLore's client time
spent in SVD (candidate bases), and server aggregation time per round.

    python benchmarks/round_time.py [--data fashion_mnist|digits] [--model cnn] [--rounds 3]
    python benchmarks/round_time.py --config experiments/pretrain_table3.yaml \
        --out benchmarks/results/pretrain_round_time.json     # the small LLaMA (issue 6)

With ``--config`` the experiment's data, model, clients, local steps, rank and optimizer are
used as they are (``--data``, ``--model``, ``--clients``, ``--local-steps`` and ``--rank`` are
ignored), every client takes part in every round, and only the first seed is measured.

Threads: run it alone on the machine; it sets ``torch.set_num_threads(--threads)``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import fedlore.algorithms.lowrank as lowrank_mod
from fedlore.config import load_config
from fedlore.data.federation import build_federation
from fedlore.engine.loop import RoundLoop
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.run import make_algorithm, model_factory
from fedlore.seeding import SERVER_INIT, generator


class Timer:
    """Accumulates seconds spent inside a wrapped function."""

    def __init__(self, fn):  # type: ignore[no-untyped-def]
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1


def measure(
    method: str, overrides: list[str], rounds: int, config: Path | None = None
) -> dict[str, float]:
    cfg = load_config(config, [*overrides, f"rounds={rounds}", f"algorithms={method}"])
    fed = build_federation(cfg, 0)
    algo = make_algorithm(method, cfg)
    build = model_factory(cfg, fed, 0)
    store = ClientStore()
    svd = Timer(lowrank_mod.top_left_singular)  # every client-side basis (LowRankHyper.top_r)
    lowrank_mod.top_left_singular = svd  # type: ignore[assignment]
    transport = LocalTransport(algo, fed.client, build, 0, store)
    client_time = Timer(transport.send)
    transport.send = client_time  # type: ignore[method-assign]
    agg = Timer(algo.aggregate)
    object.__setattr__(algo, "aggregate", agg)
    loop = RoundLoop(
        algo, transport, lambda r: sample_clients(cfg.num_clients, cfg.num_clients, 0, r)
    )
    state = algo.init_server(build(), generator(0, SERVER_INIT))
    start = -int(getattr(algo, "setup_rounds", 0))
    for rnd in range(start, 0):  # setup exchange, not timed
        state, _ = loop.run_round(state, rnd, rounds - 1)
    svd.seconds = client_time.seconds = agg.seconds = 0.0
    walls, up, down = [], 0, 0
    for rnd in range(rounds):
        state, row = loop.run_round(state, rnd, rounds - 1)
        walls.append(row["wall_s"])
        up, down = up + row["bytes_up"], down + row["bytes_down"]
    walls = walls[1:] if len(walls) > 1 else walls  # drop the warm-up round
    return {
        "wall_s_per_round": sum(walls) / len(walls),
        "client_s_per_round": client_time.seconds / rounds,
        "svd_share_of_client_time": svd.seconds / max(client_time.seconds, 1e-12),
        "aggregate_s_per_round": agg.seconds / rounds,
        "bytes_up_per_round": up / rounds,
        "bytes_down_per_round": down / rounds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="fashion_mnist")
    p.add_argument("--model", default="cnn")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--config", type=Path, default=None, help="an experiment config to time")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/round_time.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    run_opts = ["progress=false", "checkpoint=false"]
    if a.config is None:
        overrides = [
            f"data.name={a.data}",
            f"model.name={a.model}",
            f"num_clients={a.clients}",
            f"local_steps={a.local_steps}",
            f"rank={a.rank}",
            "partition.name=iid",
            "batch_size=32",
            *run_opts,
        ]
    else:
        overrides = run_opts
    res = {
        m: measure(m, overrides, a.rounds, a.config) for m in ("fedfull", "fedlore", "local_galore")
    }
    base = res["fedfull"]["wall_s_per_round"]
    cfg = load_config(a.config, overrides)
    print(
        f"# round time: {cfg.model.name} {cfg.model.kwargs} on {cfg.data.name}, "
        f"{cfg.num_clients} clients, K={cfg.local_steps}, r={cfg.rank}, {a.threads} threads"
    )
    print(
        "| method | s / round | ratio vs FedFull | SVD share of client time | aggregate s / round |"
    )
    print("|---|---|---|---|---|")
    for m, r in res.items():
        print(
            f"| {m} | {r['wall_s_per_round']:.3f} | {r['wall_s_per_round'] / base:.2f} | "
            f"{100 * r['svd_share_of_client_time']:.1f} % | {r['aggregate_s_per_round']:.4f} |"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, **res}, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
