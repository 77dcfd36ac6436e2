"""``fedlore tune --workers W``: wall seconds of one search at several W, side by side (not a test).

The same search (``experiments/quickstart.yaml``: digits, MLP, FedAvg; the random sampler over
``lr`` and ``local_steps``, ``--trials`` trials, ``threads: auto``) runs at each W in a fresh
folder; with the random sampler every W trains the same trials, so the times compare the same
work. Reported: seconds, the speed-up over W = 1, and whether the trials' parameters match W = 1's.
A machine shared with other work gives the ratios only a rough meaning: say how loaded it was.

    python benchmarks/tune_workers.py [--trials 4] [--workers 1 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from fedlore import progress
from fedlore.config import apply_overrides, read_yaml, validate
from fedlore.tune import plan_search
from fedlore.tune_study import run_search

BASE = Path("experiments/quickstart.yaml")


def one_search(out: Path, trials: int, workers: int, rounds: int) -> tuple[float, list[object]]:
    """Seconds and the trials' parameters of one search at ``workers``."""
    overrides = [
        f"output_dir={out}",
        "algorithms=[fedavg]",
        f"rounds={rounds}",
        "progress=false",
        "data.selection_fraction=0.2",
        "tune.space={lr: 'log:1e-3:0.3', local_steps: 'int:5:20'}",
        "tune.sampler=random",
        f"tune.trials={trials}",
        f"tune.workers={workers}",
    ]
    raw = apply_overrides(read_yaml(BASE), overrides)
    search = plan_search(validate(raw), raw, str(BASE), tuple(overrides))
    start = time.perf_counter()
    outcome = run_search(search)
    return time.perf_counter() - start, [r.params for r in outcome.rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    progress.enable(False)
    print(f"CPUs {os.cpu_count()}, load average {os.getloadavg()[0]:.2f} at the start")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in args.workers:
            results[w] = one_search(Path(tmp) / f"w{w}", args.trials, w, args.rounds)
    base_s, base_params = results[args.workers[0]]
    print(f"| workers | seconds | speed-up over {args.workers[0]} | same trials |")
    print("|---|---|---|---|")
    for w, (secs, params) in results.items():
        print(f"| {w} | {secs:.1f} | {base_s / secs:.2f} | {params == base_params} |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
