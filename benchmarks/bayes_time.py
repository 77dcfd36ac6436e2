"""Meta-BayFL vs FedAvg client training time per round, in one process (not a test).

Issue 7 / seed 001 Table IV: the seed reports Meta-BayFL (BNN) at 1.28x FedAvg's time per round
(11.00 s vs 8.60 s). Measured here, side by side in one run on the same config (default
``experiments/bayes_table4.yaml``: Fashion-MNIST, 5 clients, K local steps, the small CNN), every
client in every round, no evaluation: the mean local-training seconds per client per round
(reply ``train_s``) of

* FedAvg (Adam), FedProx, BayFL (the BNN alone), Meta-FL (the search alone);
* Meta-BayFL with its J candidate trials run one after another (``trials=sequential``, before)
  and vectorized over the candidates with ``torch.func.vmap`` (``trials=batched``, after);
* the MC-dropout variant (batched trials).

The first round of each method is a warm-up and is not counted.

    python benchmarks/bayes_time.py [--config experiments/bayes_table4.yaml] [--rounds 4]
    python benchmarks/bayes_time.py --set local_steps=240 \
        --out benchmarks/results/bayes_time_epoch.json        # K = about one local epoch

Threads: run it alone on the machine; it sets ``torch.set_num_threads(--threads)``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fedlore.config import load_config
from fedlore.data.federation import build_federation
from fedlore.engine.loop import RoundLoop
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.run import make_algorithm, model_factory
from fedlore.seeding import SERVER_INIT, generator

VARIANTS = {
    "fedavg": ("fedavg", []),
    "fedprox": ("fedprox", []),
    "bayfl": ("bayfl", []),
    "meta_fl": ("meta_fl", []),
    "meta_bayfl (sequential trials)": ("meta_bayfl", ["method.meta_bayfl.trials=sequential"]),
    "meta_bayfl (batched trials)": ("meta_bayfl", ["method.meta_bayfl.trials=batched"]),
    "meta_bayfl_mcd": ("meta_bayfl_mcd", []),
}


def measure(config: Path, method: str, overrides: list[str], rounds: int) -> dict[str, float]:
    """Mean client training seconds per round over rounds 1..rounds-1 (round 0 warms up)."""
    cfg = load_config(config, [*overrides, f"rounds={rounds}", f"algorithms={method}"])
    fed = build_federation(cfg, 0)
    algo = make_algorithm(method, cfg)
    build = model_factory(cfg, fed, 0)
    transport = LocalTransport(algo, fed.client, build, 0, ClientStore())
    loop = RoundLoop(
        algo, transport, lambda r: sample_clients(cfg.num_clients, cfg.num_clients, 0, r)
    )
    state = algo.init_server(build(), generator(0, SERVER_INIT))
    times, walls = [], []
    for rnd in range(rounds):
        state, row = loop.run_round(state, rnd, rounds - 1)
        if rnd > 0:
            times.append(row["client_train_s"])
            walls.append(row["wall_s"])
    return {
        "client_train_s_per_round": sum(times) / len(times),
        "wall_s_per_round": sum(walls) / len(walls),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path("experiments/bayes_table4.yaml"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bayes_time.json"))
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE config override")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    base = ["progress=false", "checkpoint=false", "eval.local=false", *a.set]
    res = {
        name: measure(a.config, method, [*base, *extra], a.rounds)
        for name, (method, extra) in VARIANTS.items()
    }
    ref = res["fedavg"]["client_train_s_per_round"]
    cfg = load_config(a.config, base)
    print(
        f"# client training time per round: {cfg.model.name} {cfg.model.kwargs} on "
        f"{cfg.data.name}, {cfg.num_clients} clients, K={cfg.local_steps}, B={cfg.batch_size}, "
        f"{a.threads} threads"
    )
    print("| method | client s / round | ratio vs FedAvg | round wall s |")
    print("|---|---|---|---|")
    for name, r in res.items():
        t = r["client_train_s_per_round"]
        print(f"| {name} | {t:.3f} | {t / ref:.2f} | {r['wall_s_per_round']:.2f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, **res}, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
