"""How long a Flower simulation runs on after its ServerApp has finished (not a test).

Flower's worker and reply threads wait up to 1 s at a time before they look whether the
simulation has ended; ``run_simulated`` replaces those waits with 0.02 s slices
(:mod:`fedlore.flower.sim_threads`). This runs the same short simulation (the quickstart on
digits, 3 clients, 2 rounds, one Ray actor) with fedlore's threads and with Flower's own
(``prompt_threads`` left out: Flower's 0.1 s delivery poll too), the two interleaved, and
reports per arm the median seconds from the ServerApp's end to ``run_simulated``'s return
(the tail) and of the whole call. One Ray serves every run, as in ``fedlore run``.

    python benchmarks/sim_ending.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fedlore.flower.app as app
import fedlore.flower.simulation as simulation
from fedlore.config import load_config
from fedlore.flower.simulation import ray_session, run_simulated

BASE = Path("experiments/quickstart.yaml")
ARMS = ("fedlore", "flower")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sim_ending.json"))
    a = p.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fedlore-bench-"))
    common = ["num_clients=3", "rounds=2", "local_steps=2", "progress=false",
              "checkpoint=false", "flower.num_cpus=2", "flower.client_cpus=2"]  # fmt: skip
    ended: list[float] = []
    own_main: Callable[..., Any] = app.server_main

    def timed_main(*args: Any, **kwargs: Any) -> Any:
        try:
            return own_main(*args, **kwargs)
        finally:
            ended.append(time.perf_counter())

    app.server_main = timed_main
    own_threads = simulation.prompt_threads
    runs: dict[str, dict[str, list[float]]] = {arm: {"tail": [], "total": []} for arm in ARMS}
    with ray_session():
        for rep in range(a.repeats + 1):  # the first round of runs starts Ray: not counted
            for arm in ARMS:
                simulation.prompt_threads = (
                    own_threads if arm == "fedlore" else contextlib.nullcontext  # type: ignore[assignment]
                )
                cfg = load_config(BASE, [*common, f"output_dir={work / f'{arm}-{rep}'}"])
                t0 = time.perf_counter()
                run_simulated(cfg, "fedavg", 42)
                t1 = time.perf_counter()
                if rep:
                    runs[arm]["tail"].append(t1 - ended[-1])
                    runs[arm]["total"].append(t1 - t0)
    simulation.prompt_threads = own_threads
    med = {arm: {k: statistics.median(v) for k, v in r.items()} for arm, r in runs.items()}
    print(f"# a 2-round simulation's end, median of {a.repeats} (s)")
    print("| threads | after the ServerApp | whole run |")
    print("|---|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {med[arm]['tail']:.3f} | {med[arm]['total']:.2f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"repeats": a.repeats, "median": med, "runs": runs}, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
