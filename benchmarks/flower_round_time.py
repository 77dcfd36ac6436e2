"""Flower engines vs the in-process transport: wall seconds per round on one config (not a test).

Runs the same config (``experiments/quickstart.yaml``: digits, MLP, N clients, K local steps,
FedLore and FedFull) on the in-process transport (``engine=local``), Flower's Simulation Engine
(Ray backend, ``flower.num_cpus=2``, one CPU and one torch thread per virtual client) and, with
``--deployment``, a loopback deployment (SuperLink + N SuperNodes, ``flwr run .``; minutes per
run, every message starts a fresh ClientApp process). Methods and engines are interleaved, each
measure is repeated ``--repeats`` times (default 3) and the median is reported; per-round wall
time is the mean over rounds >= 1 (round 0 is FedLore's setup exchange and warms up), the ratio
is the engine's median over the in-process median. The machine is shared: read the ratios.

    python benchmarks/flower_round_time.py [--clients 4] [--rounds 4] [--repeats 3] [--deployment]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedlore.config import Config, load_config
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.flower.loopback import LoopbackFederation
from fedlore.flower.simulation import run_simulated

METHODS = ("fedlore", "fedfull")
BASE = Path("experiments/quickstart.yaml")


def per_round(cfg: Config, method: str) -> float:
    """Mean wall seconds of rounds >= 1 of a finished run."""
    rows = [json.loads(x) for x in (run_dir(cfg, method, 42) / "metrics.jsonl").open()]
    walls = [r["wall_s"] for r in rows if r["round"] >= 1]  # drop setup and warm-up rounds
    return sum(walls) / len(walls)


def deployed(work: Path, method: str, clients: int, overrides: list[str]) -> None:
    """One loopback deployment of ``method``; returns when its summary is written (or 600 s)."""
    fed = LoopbackFederation(work / f"fed-{method}", num_nodes=clients)
    try:
        fed.start()
        fed.submit(BASE, method, 42, " ".join(overrides))
        cfg = load_config(BASE, overrides)
        summary = run_dir(cfg, method, 42) / "summary.json"
        deadline = time.monotonic() + 600
        while not summary.exists() and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        fed.close()


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--deployment", action="store_true", help="also time a loopback deployment (slow)"
    )
    p.add_argument("--skip-deployment", action="store_true", help="the default; kept for scripts")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/flower_round_time.json"))
    a = p.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fedlore-bench-"))
    common = [
        f"num_clients={a.clients}",
        f"rounds={a.rounds}",
        f"local_steps={a.local_steps}",
        "progress=false",
        "checkpoint=false",
        "flower.num_cpus=2",
        "flower.client_cpus=1",
    ]
    engines = ["local", "flower_sim"] + (["flower_deployment"] if a.deployment else [])
    runs: dict[str, dict[str, list[float]]] = {m: {e: [] for e in engines} for m in METHODS}
    for rep in range(a.repeats):
        for method in METHODS:
            for engine in engines:
                overrides = [*common, f"output_dir={work / f'{engine}-{rep}'}"]
                cfg = load_config(BASE, overrides)
                if engine == "local":
                    run_one(cfg, method, 42)
                elif engine == "flower_sim":
                    run_simulated(cfg, method, 42)
                else:
                    deployed(work / f"dep-{rep}", method, a.clients, overrides)
                runs[method][engine].append(per_round(cfg, method))
    res: dict[str, dict[str, object]] = {}
    for m in METHODS:
        med = {e: statistics.median(v) for e, v in runs[m].items()}
        res[m] = {
            **med,
            **{f"{e}_ratio": med[e] / med["local"] for e in engines if e != "local"},
            "runs": runs[m],
        }
    print(
        f"# Flower vs in-process: digits, {a.clients} clients, K={a.local_steps}, "
        f"wall s/round (median of {a.repeats})"
    )
    print("| method | in-process | Flower simulation (ratio) | loopback deployment (ratio) |")
    print("|---|---|---|---|")
    for m in METHODS:
        r = {e: statistics.median(v) for e, v in runs[m].items()}
        dep = (
            f"{r['flower_deployment']:.3f} ({r['flower_deployment'] / r['local']:.1f}x)"
            if "flower_deployment" in r
            else "–"
        )
        sim = f"{r['flower_sim']:.3f} ({r['flower_sim'] / r['local']:.2f}x)"
        print(f"| {m} | {r['local']:.3f} | {sim} | {dep} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"clients": a.clients, "rounds": a.rounds, "local_steps": a.local_steps}
    a.out.write_text(json.dumps({"settings": settings, "repeats": a.repeats, **res}, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
