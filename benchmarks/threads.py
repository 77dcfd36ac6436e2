"""Wall time of a run by thread setting, on an idle machine and beside a competing process.

Issue 19: with torch's default thread count (one per CPU) and OpenMP's spinning wait, the
quickstart took 8 min 34 s beside a competing process and 20 s with ``OMP_NUM_THREADS=1``.
Issue 30: ``threads: auto`` then took the CPUs minus the 1-minute load average, which counted
fedlore's own start-up and the job that had just ended, so runs started one after another on an
idle 2-core machine got one thread; it now samples the per-CPU counters for 0.25 s
(:func:`fedlore.device.busy_cpus`). Compared here, each as a fresh ``fedlore run`` subprocess of
the same config (default: the quickstart, ``--rounds`` rounds, FedLore and FedFull, no
checkpoints), started right after the previous one ended (the issue's situation):

* ``auto``: the default (``threads: auto``, waiting threads passive); the count it chose (from
  the run's ``config.json``, ``ran_threads``) is reported;
* ``one thread``: ``OMP_NUM_THREADS=1``;
* ``all CPUs``: ``OMP_NUM_THREADS`` = the CPU count (waiting threads passive);
* ``before``: what fedlore did before issue 19, torch's default count (one thread per CPU)
  with OpenMP's default spinning wait (torch is imported before fedlore, so fedlore's
  ``OMP_WAIT_POLICY=PASSIVE`` default does not reach it, and ``threads`` = the CPU count).

Each setting runs idle and beside a competitor (``--competitors`` processes, each a one-thread
torch matmul loop at normal priority, started before and stopped after the run), interleaved,
``--repeats`` times; the median wall seconds are reported with the ratio to the best setting in
the same condition (the target: ``auto`` within a few per cent of the best in both).

    python benchmarks/threads.py [--config experiments/quickstart.yaml] [--rounds 5]
    python benchmarks/threads.py --set data.name=fashion_mnist model.name=cnn --rounds 3 \
        --out benchmarks/results/threads_cnn.json     # a CNN, where threads matter more

Run it with nothing else on the machine (the "idle" rows mean it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPETITOR = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(256, 256)\n"
    "while True:\n"
    "    a = torch.tanh(a @ a / 16)\n"
)

BEFORE = (
    "import sys, torch\n"  # torch (and its OpenMP runtime) first: fedlore's default comes late
    "from fedlore.cli import main\n"
    "sys.argv = ['fedlore'] + sys.argv[1:]\n"
    "raise SystemExit(main())\n"
)


SETTINGS = ("auto", "one thread", "all CPUs", "before")


def run(
    setting: str, config: str, rounds: int, cpus: int, out: Path, extra: list[str]
) -> tuple[float, int | None]:
    """Wall seconds of one ``fedlore run`` subprocess under ``setting``, and the thread count
    the run recorded (``ran_threads`` of its ``config.json``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    args = [
        config,
        f"rounds={rounds}",
        "algorithms=[fedlore,fedfull]",
        "progress=false",
        "checkpoint=false",
        f"output_dir={out}",
        *extra,
        "--overwrite",
    ]
    if setting in ("one thread", "all CPUs"):
        env["OMP_NUM_THREADS"] = "1" if setting == "one thread" else str(cpus)
        cmd = [sys.executable, "-m", "fedlore.cli", "run", *args]
    elif setting == "auto":
        cmd = [sys.executable, "-m", "fedlore.cli", "run", *args, "threads=auto"]
    else:
        cmd = [sys.executable, "-c", BEFORE, "run", *args, f"threads={cpus}"]
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    chosen = [
        json.loads(f.read_text()).get("ran_threads")
        for f in out.rglob("config.json")
        if f.stat().st_mtime >= time.time() - wall - 1
    ]
    return wall, max((c for c in chosen if c is not None), default=None)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/quickstart.yaml")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--competitors", type=int, default=1)
    p.add_argument("--set", nargs="*", default=[], help="config overrides for every run")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/threads.json"))
    a = p.parse_args()
    from fedlore.device import available_cpus

    cpus = available_cpus()
    settings = SETTINGS
    times: dict[str, dict[str, list[float]]] = {
        c: {s: [] for s in settings} for c in ("idle", "busy")
    }
    chose: dict[str, list[int | None]] = {"idle": [], "busy": []}
    work = Path(tempfile.mkdtemp(prefix="fedlore-threads-"))
    for _ in range(a.repeats):
        for cond in ("idle", "busy"):
            hogs = []
            if cond == "busy":
                hogs = [
                    subprocess.Popen([sys.executable, "-c", COMPETITOR])
                    for _ in range(a.competitors)
                ]
                time.sleep(2.0)
            try:
                for s in settings:
                    wall, n = run(s, a.config, a.rounds, cpus, work, a.set)
                    times[cond][s].append(wall)
                    if s == "auto":
                        chose[cond].append(n)
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
    res: dict[str, object] = {
        "args": {k: str(v) for k, v in vars(a).items()},
        "cpus": cpus,
    }
    print(
        f"# {a.config} {' '.join(a.set)}, {a.rounds} rounds, FedLore + FedFull, {cpus} CPUs, "
        f"median of {a.repeats}; busy = {a.competitors} competing process(es)"
    )
    print("| condition | auto chose | " + " | ".join(settings) + " |")
    print("|---|---|" + "---|" * len(settings))
    for cond, by in times.items():
        med = {s: statistics.median(v) for s, v in by.items()}
        best = min(med.values())
        res[cond] = {s: {"wall_s": med[s], "runs": by[s], "ratio": med[s] / best} for s in by}
        res[cond]["auto_threads"] = chose[cond]  # type: ignore[index]
        cells = " | ".join(f"{med[s]:.1f} s ({med[s] / best:.2f})" for s in settings)
        print(f"| {cond} | {chose[cond]} | {cells} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
