"""Digests of what fedlore computes, to prove that a refactor changes no behaviour (issue 31).

A fixed set of small runs goes through the command line's entry point (``fedlore.cli.main``, the
one interface a refactor keeps), and every ``metrics.jsonl`` row is kept without its timings
(keys ending in ``_s``: wall, eval, diagnostics and client seconds; ``peak_memory_bytes``). Per
run: the SHA-256 of those rows (canonical JSON, floats as Python writes them, so the last bit
counts) and the rows themselves.

    python scripts/behaviour_digests.py --record   # before the first move: writes the fixture
    python scripts/behaviour_digests.py --check    # after it: every digest must be the same

``--check`` compares digests exactly: run it on the machine that recorded them (float sums
depend on torch's build, the CPU kernels and the thread count; the fixture records them).
``tests/test_behaviour.py`` repeats the runs and compares the rows within float tolerance, so a
change of behaviour fails on any machine; its docstring says when the fixture was re-recorded on
purpose and how that was checked.

The set (each with its config overrides, :data:`RUNS`): the quickstart (5 rounds); Fashion-MNIST
partial participation with FedLore and diagnostics; one round of every LoRA method on the vision
config; Meta-BayFL and the personalized / Bayesian methods for one round; FedAvg with secure
aggregation and DP (reproducible noise); FedLore-Sketch; a kill-and-resume (a ``fedlore run``
process stopped by SIGTERM after its second round, then ``--resume``: its digest must equal the
uninterrupted run's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "behaviour_digests.json"

COMMON = ["progress=false", "seeds=[42]", "threads=1"]

RUNS: dict[str, tuple[str | None, list[str]]] = {
    "quickstart": ("experiments/quickstart.yaml", ["rounds=5"]),
    "fmnist_partial_fedlore": (
        "experiments/fmnist_partial.yaml",
        [
            "rounds=2",
            "num_clients=20",
            "participation=0.2",
            "local_steps=2",
            "algorithms=[fedlore]",
            "eval.every=1",
            "diagnostics.every=1",
        ],
    ),
    "vision_lora": (
        "experiments/vision_table1.yaml",
        [
            "rounds=1",
            "num_clients=4",
            "participation=1.0",
            "local_steps=1",
            "eval.every=1",
            "algorithms=[fedit,ffa_lora,flexlora,lora_fair,rolora,flora,frlora]",
        ],
    ),
    "bayes_personalized": (
        "experiments/bayes_table6.yaml",
        ["rounds=1", "local_steps=2", "eval.every=1", "eval.mc_samples=2", "checkpoint=false"],
    ),
    "fedavg_secagg_dp": (
        None,
        [
            "data.name=digits",
            "model.name=mlp",
            "num_clients=6",
            "rounds=2",
            "local_steps=2",
            "algorithms=[fedavg]",
            "secure_aggregation=true",
            "dp.clip_norm=1.0",
            "dp.noise_multiplier=0.5",
            "dp.reproducible_noise=true",
            "weighting=uniform",
        ],
    ),
    "fedlore_sketch": (
        None,
        [
            "data.name=digits",
            "model.name=mlp",
            "num_clients=6",
            "rounds=3",
            "local_steps=3",
            "algorithms=[fedlore_sketch]",
            "rank=4",
        ],
    ),
    "kill_and_resume": (
        None,
        [
            "data.name=digits",
            "model.name=mlp",
            "num_clients=6",
            "rounds=6",
            "local_steps=20",
            "algorithms=[fedlore]",
            "checkpoint=true",
        ],
    ),
}
"""name -> (config file or None for the defaults, overrides)."""


ADDED_SINCE = frozenset({"client_state_bytes"})
"""Row keys the round loop records since the fixture was written: measurements of what the
runs computed (the bytes each client keeps between rounds), not results of it; left out so the
fixture still compares every computed value (their own tests check them)."""


def strip_timings(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without what depends on the machine's speed (nor :data:`ADDED_SINCE`)."""
    return {
        k: v
        for k, v in row.items()
        if not k.endswith("_s") and k != "peak_memory_bytes" and k not in ADDED_SINCE
    }


def collect(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every run folder's ``metrics.jsonl`` under ``out`` (``<name>/<method>/seed-<s>``), rows
    without timings, keyed by ``<method>/seed-<s>``."""
    found: dict[str, list[dict[str, Any]]] = {}
    for f in sorted(out.rglob("metrics.jsonl")):
        key = f"{f.parent.parent.name}/{f.parent.name}"
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        found[key] = [strip_timings(r) for r in rows]
    return found


def digest(rows: dict[str, list[dict[str, Any]]]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def _argv(name: str, out: Path) -> list[str]:
    config, overrides = RUNS[name]
    return [*([config] if config else []), *COMMON, *overrides, f"output_dir={out}", f"name={name}"]


def run_in_process(name: str, out: Path) -> dict[str, list[dict[str, Any]]]:
    """Run ``name`` through ``fedlore.cli.main`` into ``out``; the rows it wrote."""
    from fedlore.cli import main

    code = main(["run", *_argv(name, out)])
    if code not in (0, None):
        raise SystemExit(f"{name}: fedlore run exited with {code}")
    return collect(out / name)


def kill_and_resume(out: Path) -> dict[str, list[dict[str, Any]]]:
    """The kill-and-resume run: a ``fedlore run`` subprocess is sent SIGTERM once its second
    round is in ``metrics.jsonl``, then resumed in this process."""
    name = "kill_and_resume"
    argv = _argv(name, out)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedlore.cli", "run", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        metrics = next(iter((out / name).rglob("metrics.jsonl")), None)
        if metrics is not None and len(metrics.read_text().splitlines()) >= 2:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    code = proc.wait()
    if code not in (143, 0):
        raise SystemExit(f"{name}: the killed run exited with {code}, not 143")
    from fedlore.cli import main

    if main(["run", *argv, "--resume"]) not in (0, None):
        raise SystemExit(f"{name}: --resume failed")
    return collect(out / name)


def run_all(out: Path, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """name -> {"digest", "rows"} for the runs ``names`` (default: all)."""
    result: dict[str, dict[str, Any]] = {}
    for name in names or list(RUNS):
        rows = kill_and_resume(out) if name == "kill_and_resume" else run_in_process(name, out)
        result[name] = {"digest": digest(rows), "rows": rows}
    return result


def platform() -> dict[str, str]:
    import torch

    return {"torch": str(torch.__version__), "cpu": torch.backends.cpu.get_cpu_capability()}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", action="store_true", help=f"write {FIXTURE.name}")
    mode.add_argument("--check", action="store_true", help="compare with the recorded digests")
    p.add_argument(
        "--only", nargs="*", help="these runs only (with --record: the others' records kept)"
    )
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="fedlore-digests-") as tmp:
        got = run_all(Path(tmp), a.only)
    if a.record:
        runs = got
        if a.only:  # re-record these runs, keep the others' records as they are
            runs = {**json.loads(FIXTURE.read_text())["runs"], **got}
        FIXTURE.write_text(json.dumps({"platform": platform(), "runs": runs}, indent=1) + "\n")
        for name, r in got.items():
            print(f"{name}: {r['digest'][:16]}")
        print(f"recorded in {FIXTURE}")
        return 0
    want = json.loads(FIXTURE.read_text())
    if want["platform"] != platform():
        print(f"note: recorded on {want['platform']}, checking on {platform()}")
    bad = [n for n, r in got.items() if want["runs"][n]["digest"] != r["digest"]]
    for name, r in got.items():
        same = "same" if name not in bad else "CHANGED"
        print(f"{name}: {r['digest'][:16]} {same}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
