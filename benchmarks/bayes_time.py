"""Meta-BayFL vs FedAvg client training time per round, in one process (not a test).

Issue 7 / seed 001 Table IV: the seed reports Meta-BayFL (BNN) at 1.28x FedAvg's time per round
(11.00 s vs 8.60 s). Measured here, side by side in one run on the same config (default
``experiments/bayes_table4.yaml``: Fashion-MNIST, 5 clients, K local steps, the small CNN), every
client in every round, no evaluation: the mean process CPU seconds of ``client_update`` per
client per round (search, training, the update; the reply's wall ``train_s`` beside it) of

* FedAvg (Adam), FedProx, BayFL (the BNN alone), Meta-FL (the search alone);
* BayFL and Meta-BayFL with the local reparameterization estimator
  (``method.<name>.bnn_estimator=local``, Kingma et al. 2015) as their own rows;
* Meta-BayFL with its J candidate trials run one after another (``trials=sequential``, the
  default) and vectorized over the candidates with ``torch.func.vmap`` (``trials=batched``);
* the MC-dropout variant.

Protocol: the first round of each method is a warm-up and is not counted; the methods run
interleaved round by round (round t of every method, then round t + 1), the whole run is
repeated ``--repeats`` times (default 3), and the MEDIAN of the repetitions is reported, with
the median of the per-repetition ratios to FedAvg. CPU time, not wall time, because the machine
is shared: a process waiting for a core does not accrue CPU time (cache and memory contention
still show), so the ratios hold under load where wall-clock ratios swung from 0.8 to 6.9.
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
import time
from pathlib import Path
from typing import Any

import torch

from fedlore.config import load_config
from fedlore.data.federation import Federation, build_federation
from fedlore.engine.loop import RoundLoop
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment_parts import make_algorithm, model_factory
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


class Runner:
    """One variant's run: its algorithm, clients and server state, stepped a round at a time,
    recording each client's process CPU seconds (``time.process_time``; time spent waiting for
    a core while other processes run does not count) and the wall seconds of its training.

    Raises:
        ValueError: when the installed code refuses a setting (e.g. an unknown method field).
    """

    def __init__(
        self,
        config: Path,
        method: str,
        overrides: list[str],
        rounds: int,
        feds: dict[str, Federation],
    ) -> None:
        cfg = load_config(config, [*overrides, f"rounds={rounds}", f"algorithms={method}"])
        self.algo = make_algorithm(method, cfg)  # refuses unknown fields before any work
        key = cfg.data.model_dump_json() + cfg.partition.model_dump_json() + str(cfg.num_clients)
        if key not in feds:  # every variant shares the data; built once
            feds[key] = build_federation(cfg, 0)
        fed = feds[key]
        build = model_factory(cfg, fed, 0)
        self.cpu = 0.0
        client_update = self.algo.client_update

        def timed(*args: Any) -> Any:
            t = time.process_time()
            try:
                return client_update(*args)
            finally:
                self.cpu += time.process_time() - t

        object.__setattr__(self.algo, "client_update", timed)  # a frozen dataclass
        self.transport = LocalTransport(self.algo, fed.client, build, 0, ClientStore())
        self.clients = cfg.num_clients
        self.rounds = rounds
        self.loop = RoundLoop(
            self.algo, self.transport, lambda r: sample_clients(self.clients, self.clients, 0, r)
        )
        self.state = self.algo.init_server(build(), generator(0, SERVER_INIT))
        self.cpu_rounds: list[float] = []
        self.train_rounds: list[float] = []

    def step(self, rnd: int) -> None:
        """Run round ``rnd``; rounds after the first (a warm-up) are recorded."""
        self.cpu = 0.0
        self.state, row = self.loop.run_round(self.state, rnd, self.rounds - 1)
        if rnd > 0:
            self.cpu_rounds.append(self.cpu / self.clients)
            self.train_rounds.append(float(row["client_train_s"]))

    def result(self) -> dict[str, float]:
        """Mean client CPU seconds and mean client training (wall) seconds per round."""
        return {
            "client_cpu_s_per_round": sum(self.cpu_rounds) / len(self.cpu_rounds),
            "client_train_s_per_round": sum(self.train_rounds) / len(self.train_rounds),
        }


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
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
    for rep in range(a.repeats):
        runners: dict[str, Runner] = {}
        for name in names:
            if name in refused:
                continue
            method, extra = VARIANTS[name]
            try:
                runners[name] = Runner(a.config, method, [*base, *extra], a.rounds, feds)
            except ValueError as e:
                refused[name] = str(e)
        for rnd in range(a.rounds):  # interleaved: every variant's round rnd, then rnd + 1
            for runner in runners.values():
                runner.step(rnd)
        for name, runner in runners.items():
            runs[name].append(runner.result())
            t = runs[name][-1]["client_cpu_s_per_round"]
            print(f"# repetition {rep + 1}/{a.repeats}: {name}: {t:.3f} CPU s", flush=True)
    res: dict[str, Any] = {}
    for name in names:
        if name in refused:
            res[name] = {"refused": refused[name]}
            continue
        cpu = [r["client_cpu_s_per_round"] for r in runs[name]]
        ratios = [
            t / r["client_cpu_s_per_round"] for t, r in zip(cpu, runs[REFERENCE], strict=True)
        ]
        res[name] = {
            "client_cpu_s_per_round": statistics.median(cpu),
            "ratio_vs_fedavg": statistics.median(ratios),
            "client_train_s_per_round": statistics.median(
                r["client_train_s_per_round"] for r in runs[name]
            ),
            "client_cpu_s_repeats": cpu,
            "ratio_repeats": ratios,
        }
    cfg = load_config(a.config, base)
    print(
        f"# client training time per client per round, median of {a.repeats} interleaved "
        f"repetitions: {cfg.model.name} {cfg.model.kwargs} on {cfg.data.name}, "
        f"{cfg.num_clients} clients, K={cfg.local_steps}, B={cfg.batch_size}, "
        f"{a.threads} thread(s)"
    )
    print("| method | client CPU s / round | ratio vs FedAvg | client wall s / round |")
    print("|---|---|---|---|")
    for name, r in res.items():
        if "refused" in r:
            print(f"| {name} | n/a | n/a | n/a |")
            continue
        print(
            f"| {name} | {r['client_cpu_s_per_round']:.3f} | {r['ratio_vs_fedavg']:.2f} "
            f"| {r['client_train_s_per_round']:.3f} |"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"args": {k: str(v) for k, v in vars(a).items()}, **res}
    a.out.write_text(json.dumps(out, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
