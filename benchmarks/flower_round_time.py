"""Flower engines vs the in-process transport: wall seconds per round on one config (not a test).

Runs the same config (``experiments/quickstart.yaml``: digits, MLP, N clients, K local steps,
FedLore and FedFull) three ways in one go: in-process (``engine=local``), Flower's Simulation
Engine (Ray backend), and a loopback deployment (SuperLink + N SuperNodes, ``flwr run .``).
Per-round wall time excludes evaluation and the first (warm-up) round; the ratio is against the
in-process transport.

    python benchmarks/flower_round_time.py [--clients 4] [--rounds 4] [--skip-deployment]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from fedlore.config import Config, load_config
from fedlore.flower.loopback import LoopbackFederation
from fedlore.flower.simulation import run_simulated
from fedlore.run import run_dir, run_one


def per_round(cfg: Config, method: str) -> float:
    rows = [json.loads(x) for x in (run_dir(cfg, method, 42) / "metrics.jsonl").open()]
    walls = [r["wall_s"] for r in rows if r["round"] >= 1]  # drop setup and warm-up rounds
    return sum(walls) / len(walls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--skip-deployment", action="store_true")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/flower_round_time.json"))
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedlore-bench-"))
    common = [
        f"num_clients={a.clients}",
        f"rounds={a.rounds}",
        f"local_steps={a.local_steps}",
        "progress=false",
        "checkpoint=false",
    ]
    base = Path("experiments/quickstart.yaml")

    def cfg_for(engine: str) -> Config:
        return load_config(base, [*common, f"output_dir={work / engine}"])

    res: dict[str, dict[str, float]] = {}
    for method in ("fedlore", "fedfull"):
        row: dict[str, float] = {}
        local = cfg_for("local")
        run_one(local, method, 42)
        row["local"] = per_round(local, method)
        sim = cfg_for("sim")
        run_simulated(sim, method, 42)
        row["flower_sim"] = per_round(sim, method)
        if not a.skip_deployment:
            dep = cfg_for("dep")
            fed = LoopbackFederation(work / f"fed-{method}", num_nodes=a.clients)
            try:
                fed.start()
                fed.submit(base, method, 42, " ".join([*common, f"output_dir={work / 'dep'}"]))
                summary = run_dir(dep, method, 42) / "summary.json"
                deadline = time.monotonic() + 600
                while not summary.exists() and time.monotonic() < deadline:
                    time.sleep(1)
            finally:
                fed.close()
            row["flower_deployment"] = per_round(dep, method)
        res[method] = row
    print(f"# Flower vs in-process: digits, {a.clients} clients, K={a.local_steps}, wall s/round")
    print("| method | in-process | Flower simulation (ratio) | loopback deployment (ratio) |")
    print("|---|---|---|---|")
    for m, r in res.items():
        dep_cell = (
            f"{r['flower_deployment']:.3f} ({r['flower_deployment'] / r['local']:.1f}x)"
            if "flower_deployment" in r
            else "–"
        )
        print(
            f"| {m} | {r['local']:.3f} | {r['flower_sim']:.3f} "
            f"({r['flower_sim'] / r['local']:.1f}x) | {dep_cell} |"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
