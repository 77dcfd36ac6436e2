"""FedLore vs FedFull wall time per round in one process (not a test).

Same model, data, clients and local steps for every method. The methods run side by side in one
process, interleaved round by round (round t of every method before round t+1 of any, the order
rotated each round), so machine noise hits them alike; the first round is a warm-up and the
median of the remaining rounds (three by default) is reported. Per method: wall seconds per
round, the FedLore / FedFull ratio (median of the per-round ratios), the share of client time
spent computing candidate bases (``top_left_singular``), server aggregation time per round, and
bytes per round.

    python benchmarks/round_time.py [--data fashion_mnist|digits] [--model cnn] [--rounds 4]
    python benchmarks/round_time.py --config experiments/pretrain_table3.yaml \
        --out benchmarks/results/pretrain_round_time.json     # the small LLaMA (issue 6)
    python benchmarks/round_time.py --methods fedfull,fedlore:candidate_svd=subspace,local_galore

With ``--config`` the experiment's data, model, clients, local steps, rank and optimizer are
used as they are (``--data``, ``--model``, ``--clients``, ``--local-steps`` and ``--rank`` are
ignored), every client takes part in every round, and only the first seed is measured.

A method entry ``name:key=value[:key=value]`` runs ``name`` with ``method.name.key=value`` (so
two settings of one method can be timed side by side); ``--set`` adds a config override for all.

Threads: ``torch.set_num_threads(--threads)``, 1 by default. The ratio is taken on the process's
CPU seconds per round (``time.process_time``), which other jobs on a shared machine hardly
disturb with one thread (wall seconds are reported too; on an idle machine the two agree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import fedlore.algorithms.lowrank as lowrank_mod
from fedlore.checks import setup_rounds
from fedlore.config import load_config
from fedlore.data.federation import build_federation
from fedlore.engine.loop import RoundLoop
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.seeding import SERVER_INIT, generator

METHODS = ("fedfull", "fedlore", "fedlore:candidate_svd=exact")
"""The default set (``make bench``): FedFull, FedLore at its defaults (``candidate_svd=auto``) and
FedLore with the seed's exact candidates, as in ``benchmarks/results/round_time.json``."""


class Timer:
    """Accumulates the process's CPU seconds spent inside a wrapped function."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a, **k):
        t = time.process_time()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.process_time() - t
            self.calls += 1


class Setup:
    """One method's federation, loop and server state, with timers on its client work and its
    aggregation."""

    def __init__(self, entry: str, overrides: list[str], rounds: int, config: Path | None):
        method, *settings = entry.split(":")
        own = [f"method.{method}.{kv}" for kv in settings]
        cfg = load_config(config, [*overrides, *own, f"rounds={rounds}", f"algorithms={method}"])
        self.cfg = cfg
        fed = build_federation(cfg, 0)
        self.algo = make_algorithm(method, cfg)
        build = model_factory(cfg, fed, 0)
        transport = LocalTransport(self.algo, fed.client, build, 0, ClientStore())
        self.client = Timer(transport.send)
        transport.send = self.client  # type: ignore[method-assign]
        self.agg = Timer(self.algo.aggregate)
        object.__setattr__(self.algo, "aggregate", self.agg)
        self.loop = RoundLoop(
            self.algo,
            transport,
            lambda r: sample_clients(cfg.num_clients, cfg.num_clients, 0, r),
        )
        self.state = self.algo.init_server(build(), generator(0, SERVER_INIT))
        self.rounds = rounds
        self.rows: list[dict[str, float]] = []

    def run_round(self, rnd: int, svd: Timer) -> dict[str, float]:
        self.client.seconds = self.agg.seconds = svd.seconds = 0.0
        cpu = time.process_time()
        self.state, row = self.loop.run_round(self.state, rnd, self.rounds - 1)
        return {
            "cpu_s": time.process_time() - cpu,
            "wall_s": float(row["wall_s"]),
            "client_cpu_s": self.client.seconds,
            "svd_cpu_s": svd.seconds,
            "aggregate_cpu_s": self.agg.seconds,
            "bytes_up": float(row["bytes_up"]),
            "bytes_down": float(row["bytes_down"]),
        }


def measure(
    methods: tuple[str, ...], overrides: list[str], rounds: int, config: Path | None
) -> dict[str, Any]:
    """Run ``rounds`` rounds of every method interleaved; per method the medians over rounds
    1.. (round 0 is a warm-up) and the per-round rows."""
    svd = Timer(lowrank_mod.top_left_singular)  # every client-side basis (LowRankHyper.top_r)
    original = lowrank_mod.top_left_singular
    lowrank_mod.top_left_singular = svd
    try:
        setups = {m: Setup(m, overrides, rounds, config) for m in methods}
        for s in setups.values():  # setup exchanges (FedLore's P^0), not timed
            for rnd in range(-setup_rounds(s.algo), 0):
                s.run_round(rnd, svd)
        for rnd in range(rounds):
            k = rnd % len(methods)
            for m in methods[k:] + methods[:k]:
                setups[m].rows.append(setups[m].run_round(rnd, svd))
    finally:
        lowrank_mod.top_left_singular = original
    res: dict[str, Any] = {}
    for m, s in setups.items():
        rows = s.rows[1:] if len(s.rows) > 1 else s.rows  # drop the warm-up round
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        res[m] = {
            "wall_s_per_round": med["wall_s"],
            "client_cpu_s_per_round": med["client_cpu_s"],
            "svd_share_of_client_time": statistics.median(
                r["svd_cpu_s"] / max(r["client_cpu_s"], 1e-12) for r in rows
            ),
            "aggregate_cpu_s_per_round": med["aggregate_cpu_s"],
            "bytes_up_per_round": med["bytes_up"],
            "bytes_down_per_round": med["bytes_down"],
            "rounds": s.rows,
        }
    base = setups[methods[0]].rows[1:] or setups[methods[0]].rows
    for m, s in setups.items():
        rows = s.rows[1:] or s.rows
        res[m]["cpu_s_per_round"] = statistics.median(r["cpu_s"] for r in rows)
        for key in ("cpu_s", "wall_s"):
            res[m][f"{key}_ratio_vs_{methods[0]}"] = statistics.median(
                r[key] / b[key] for r, b in zip(rows, base, strict=True)
            )
    return res


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", default="fashion_mnist")
    p.add_argument("--model", default="cnn")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="rounds per method (first: warm-up)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default=",".join(METHODS), help="the first one is the baseline")
    p.add_argument("--set", action="append", default=[], help="an extra config override")
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
    overrides += a.set
    methods = tuple(a.methods.split(","))
    res = measure(methods, overrides, a.rounds, a.config)
    cfg = load_config(a.config, overrides)
    print(
        f"# round time: {cfg.model.name} {cfg.model.kwargs} on {cfg.data.name}, "
        f"{cfg.num_clients} clients, K={cfg.local_steps}, r={cfg.rank}, {a.threads} threads, "
        f"median of {max(a.rounds - 1, 1)} interleaved rounds {a.set or ''}"
    )
    b = methods[0]
    print(
        f"| method | CPU s / round | ratio vs {b} (CPU) | wall s / round | ratio vs {b} (wall) | "
        "SVD share of client CPU time | aggregate CPU s / round |"
    )
    print("|---|---|---|---|---|---|---|")
    for m, r in res.items():
        print(
            f"| {m} | {r['cpu_s_per_round']:.3f} | {r[f'cpu_s_ratio_vs_{b}']:.2f} | "
            f"{r['wall_s_per_round']:.3f} | {r[f'wall_s_ratio_vs_{b}']:.2f} | "
            f"{100 * r['svd_share_of_client_time']:.1f} % | {r['aggregate_cpu_s_per_round']:.4f} |"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, **res}, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
