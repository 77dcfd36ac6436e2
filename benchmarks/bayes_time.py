"""Meta-BayFL vs FedAvg client training time per round, in one process (not a test).

Issue 7 / seed 001 Table IV: the seed reports Meta-BayFL (BNN) at 1.28x FedAvg's time per round
(11.00 s vs 8.60 s). Measured here, side by side in one run on the same config (default
``experiments/bayes_table4.yaml``: Fashion-MNIST, 5 clients, K local steps, the small CNN), every
client in every round, no evaluation: the mean local-training seconds per client per round
(reply ``train_s``) of

* FedAvg (Adam), FedProx, BayFL (the BNN alone), Meta-FL (the search alone);
* BayFL and Meta-BayFL with the local reparameterization estimator
  (``method.<name>.bnn_estimator=local``, Kingma et al. 2015) as their own rows;
* Meta-BayFL with its J candidate trials run one after another (``trials=sequential``, the
  default) and vectorized over the candidates with ``torch.func.vmap`` (``trials=batched``);
* the MC-dropout variant.

Protocol: the first round of each method is a warm-up and is not counted; the methods are
measured interleaved (one measurement of every method, then the next repetition), ``--repeats``
times (default 3), and the MEDIAN of the repetitions is reported, with the median of the
per-repetition ratios to FedAvg (interleaving keeps the ratios meaningful on a noisy machine).
A variant whose settings the installed code refuses (an older checkout) is reported as n/a.

    python benchmarks/bayes_time.py [--config experiments/bayes_table4.yaml] [--rounds 4]
    python benchmarks/bayes_time.py --rounds 3 --set local_steps=240 \
        --out benchmarks/results/bayes_time_epoch.json        # K = about one local epoch

Threads: ``torch.set_num_threads(--threads)`` (default 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from fedlore.config import load_config
from fedlore.data.federation import Federation, build_federation
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
    "bayfl (local estimator)": ("bayfl", ["method.bayfl.bnn_estimator=local"]),
    "meta_fl": ("meta_fl", []),
    "meta_bayfl (sequential trials)": ("meta_bayfl", ["method.meta_bayfl.trials=sequential"]),
    "meta_bayfl (batched trials)": ("meta_bayfl", ["method.meta_bayfl.trials=batched"]),
    "meta_bayfl (local estimator)": ("meta_bayfl", ["method.meta_bayfl.bnn_estimator=local"]),
    "meta_bayfl_mcd": ("meta_bayfl_mcd", []),
}
REFERENCE = "fedavg"


def measure(
    config: Path, method: str, overrides: list[str], rounds: int, feds: dict[str, Federation]
) -> dict[str, float]:
    """Mean client training seconds per client per round over rounds 1..rounds-1 (round 0 warms
    up), and the mean round wall seconds.

    Raises:
        ValueError: when the installed code refuses a setting (e.g. an unknown method field).
    """
    cfg = load_config(config, [*overrides, f"rounds={rounds}", f"algorithms={method}"])
    algo = make_algorithm(method, cfg)  # refuses unknown fields before any work
    key = cfg.data.model_dump_json() + cfg.partition.model_dump_json() + str(cfg.num_clients)
    if key not in feds:  # every variant shares the data; built once
        feds[key] = build_federation(cfg, 0)
    fed = feds[key]
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
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bayes_time.json"))
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE config override")
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    base = ["progress=false", "checkpoint=false", "eval.local=false", *a.set]
    wanted = [n.strip() for n in a.only.split(",") if n.strip()] or list(VARIANTS)
    names = [REFERENCE, *[n for n in wanted if n != REFERENCE]]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    refused: dict[str, str] = {}
    feds: dict[str, Federation] = {}
    for rep in range(a.repeats):  # interleaved: every variant once, then the next repetition
        for name in names:
            if name in refused:
                continue
            method, extra = VARIANTS[name]
            try:
                runs[name].append(measure(a.config, method, [*base, *extra], a.rounds, feds))
            except ValueError as e:
                refused[name] = str(e)
                continue
            t = runs[name][-1]["client_train_s_per_round"]
            print(f"# repetition {rep + 1}/{a.repeats}: {name}: {t:.3f} s", flush=True)
    res: dict[str, Any] = {}
    ref_runs = runs[REFERENCE]
    for name in names:
        if name in refused:
            res[name] = {"refused": refused[name]}
            continue
        times = [r["client_train_s_per_round"] for r in runs[name]]
        ratios = [t / r["client_train_s_per_round"] for t, r in zip(times, ref_runs, strict=True)]
        res[name] = {
            "client_train_s_per_round": statistics.median(times),
            "wall_s_per_round": statistics.median(r["wall_s_per_round"] for r in runs[name]),
            "ratio_vs_fedavg": statistics.median(ratios),
            "client_train_s_repeats": times,
            "ratio_repeats": ratios,
        }
    cfg = load_config(a.config, base)
    print(
        f"# client training time per client per round, median of {a.repeats} interleaved "
        f"repetitions: {cfg.model.name} {cfg.model.kwargs} on {cfg.data.name}, "
        f"{cfg.num_clients} clients, K={cfg.local_steps}, B={cfg.batch_size}, "
        f"{a.threads} thread(s)"
    )
    print("| method | client s / round | ratio vs FedAvg | round wall s |")
    print("|---|---|---|---|")
    for name, r in res.items():
        if "refused" in r:
            print(f"| {name} | n/a | n/a | n/a |")
            continue
        print(
            f"| {name} | {r['client_train_s_per_round']:.3f} | {r['ratio_vs_fedavg']:.2f} "
            f"| {r['wall_s_per_round']:.2f} |"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"args": {k: str(v) for k, v in vars(a).items()}, **res}
    a.out.write_text(json.dumps(out, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
