"""``fedlore tune --workers W``: wall seconds of one search at several W, side by side (not a test).

The same search (``experiments/quickstart.yaml``: digits, MLP; or ``--config``'s; FedAvg, the
random sampler over ``lr`` and ``local_steps``, ``--trials`` trials, ``threads: auto``) runs at
each W in a fresh folder; with the random sampler every W trains the same trials, so the times
compare the same work. Reported: seconds, the speed-up over W = 1, and whether the trials'
parameters match W = 1's. A machine shared with other work gives the ratios only a rough
meaning: say how loaded it was.
With ``--rebuilt``, W = 1 also runs with every trial building its federation again (as one
worker did before it kept the one it built, :func:`fedlore.data.federation.keeping_built`;
several workers keep theirs in their own processes), the versions in turns ``--repeat`` times.

    python benchmarks/tune_workers.py [--trials 4] [--workers 1 2] [--rounds 5]
    python benchmarks/tune_workers.py --workers 1 --rebuilt --repeat 2
    python benchmarks/tune_workers.py --workers 1 --rebuilt --config experiments/fmnist_dir01.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

from fedlore import progress
from fedlore.config import apply_overrides, read_yaml, validate
from fedlore.tune import plan_search
from fedlore.tune_study import run_search

BASE = Path("experiments/quickstart.yaml")


def one_search(
    out: Path, trials: int, workers: int, rounds: int, rebuilt: bool = False, base: Path = BASE
) -> tuple[float, list[object]]:
    """Seconds and the trials' parameters of one search at ``workers`` (``rebuilt``: one worker
    builds the federation again for every trial)."""
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
    raw = apply_overrides(read_yaml(base), overrides)
    search = plan_search(validate(raw), raw, str(base), tuple(overrides))
    keep = (
        mock.patch("fedlore.data.federation.keeping_built", contextlib.nullcontext)
        if rebuilt
        else contextlib.nullcontext()
    )
    start = time.perf_counter()
    with keep:
        outcome = run_search(search)
    return time.perf_counter() - start, [r.params for r in outcome.rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--config", type=Path, default=BASE, help="the experiment searched")
    parser.add_argument("--rebuilt", action="store_true", help="also each W rebuilding per trial")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each version, in turns")
    args = parser.parse_args()
    progress.enable(False)
    print(f"CPUs {os.cpu_count()}, load average {os.getloadavg()[0]:.2f} at the start")
    # several workers always keep theirs (each in its own process): rebuilt is one worker's
    versions = [
        (w, r)
        for w in args.workers
        for r in ((True, False) if args.rebuilt and w == 1 else (False,))
    ]
    results: dict[tuple[int, bool], list[tuple[float, list[object]]]] = {v: [] for v in versions}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for w, rebuilt in versions:
                out = Path(tmp) / f"w{w}-{'rebuilt' if rebuilt else 'kept'}-{i}"
                done = one_search(out, args.trials, w, args.rounds, rebuilt, args.config)
                results[w, rebuilt].append(done)
    base = results[versions[0]]
    base_s, base_params = min(s for s, _ in base), base[0][1]
    print("| workers | federation | seconds | speed-up over the first (best) | same trials |")
    print("|---|---|---|---|---|")
    for (w, rebuilt), runs in results.items():
        secs = ", ".join(f"{s:.1f}" for s, _ in runs)
        same = all(p == base_params for _, p in runs)
        how = "rebuilt per trial" if rebuilt else "kept"
        print(f"| {w} | {how} | {secs} | {base_s / min(s for s, _ in runs):.2f} | {same} |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
