"""fedlore vs Apple's pfl-research (``pfl`` 0.6.0, PyTorch backend) on identical FedAvg work.

Issue 30, item 3 (a benchmark, not a test). Two tasks on the quickstart's federation settings
(``experiments/quickstart.yaml``: 10 clients, every client in every round, K = 10 local steps of
batch 32, seed 42):

* ``digits``: sklearn digits, Dirichlet(0.5) labels (the quickstart's: clients of unequal
  sizes), fedlore's MLP (64-128-128-10), 30 rounds, local SGD lr 0.1;
* ``fmnist``: Fashion-MNIST, IID clients (as ``benchmarks/round_time.py``), fedlore's McMahan et
  al. CNN (1.66 M parameters), 10 rounds, local SGD lr 0.05.

fedlore runs its ``fedavg`` method (FedAvg with plain local SGD) through
:func:`fedlore.experiment.run_one`, the code path of ``fedlore run``; pfl runs
``FederatedAveraging`` on its ``SimulatedBackend``. The work is the same:

* data: pfl's users are fedlore's clients (their training splits from ``build_federation``); both
  score fedlore's central test set;
* initial weights: pfl's ``PyTorchModel`` wraps a model built by fedlore's ``model_factory`` (the
  initial state of every fedlore run of the seed); a digest of the weights pfl starts from is
  compared with fedlore's;
* minibatches: fedlore's client c draws round t's K batches from ``generator(seed, CLIENT, t, c)``
  (``ClientData.batches``: epoch-wise permutations; an epoch's last batch may be short). pfl's
  dataset of user c in round t yields exactly these K batches, drawn by the same call (pfl's own
  ``Dataset`` slices a user's data in stored order, unshuffled). A digest of every batch either
  side consumed (inputs and labels, per round and client) is compared;
* local optimizer: fedlore's settings, read from its ``fedavg`` object: ``torch.optim.SGD`` at its
  lr, momentum 0 and weight decay 0 (``--method fedfull``: AdamW with fedlore's betas, eps and
  weight decay, lr 3e-3), new for every client and round on both sides; constant lr, no clipping;
  the loss is the mean cross-entropy on both sides;
* aggregation: weighted by the clients' training-set sizes (fedlore ``weighting: num_examples``,
  pfl ``WeightByDatapoints``), then pfl's central optimizer, SGD with lr 1.0, adds the weighted
  mean of the deltas to the model: plain FedAvg on both sides. fedlore sums the weighted deltas
  in float64 and casts the mean to float32; pfl's stock sum is float32 and multiplies by the
  reciprocal of the total weight. Here a pfl postprocessor (``Float64Deltas``, before the
  weighting) gives pfl fedlore's arithmetic, so the two compute the same floats; with pfl's
  float32 sum the first round's models differed by 1.5e-8 and training grew it (Fashion-MNIST
  on Dirichlet(0.5) clients, one thread, 10 rounds: weights 4e-3 apart, 52 test predictions
  differing, accuracies 0.15 % apart);
* each framework's own overheads stay: fedlore screens the uploads (finite, shapes, norms) and
  writes a metrics row per round; pfl builds a user dataset and context per user and round.
  Left out on both sides: fedlore's per-round checkpoint (pfl writes none by default) and pfl's
  scoring of every user's data before and after local training, which it does whenever
  ``iteration % evaluation_frequency == 0``, so always in round 0 (fedlore scores no client by
  default); both score the central test set once, after the last round, untimed.

Accuracy check: the final test accuracies must agree within one test image or 0.1 %, whichever
is larger (on the 360 digits test images one image, 0.28 %; on Fashion-MNIST's 10,000, 10
images). With the same thread count on both sides the two compute the same floats and the final
weights are bit-identical (max abs weight difference 0); a different thread count can change
float sums in torch's kernels, which training then grows, hence the tolerance. The number of
test images whose predicted class differs and the largest weight difference are reported. The
script exits 1 when the accuracies disagree or the initial weights or minibatches differ.

Timing: each framework runs in a fresh subprocess, one at a time (alternating which goes first,
repeat by repeat), ``--repeats`` times. A round is timed from the end of the previous round to its
own end, so everything the framework does per round counts; round 0 is a warm-up (first-call
costs) and is not reported; fedlore's central evaluation after the last round is timed and taken
out. Per run: the median wall seconds per round; reported: the median over repeats, and
fedlore / pfl of those medians. Beside it, the process CPU seconds (all threads) / wall seconds
over the timed rounds: about the number of cores kept busy (spinning OpenMP threads count too).

Threads: each framework's default, as a user gets it: fedlore's ``threads: auto``, pfl's torch
default (the pfl process imports torch and pfl before fedlore's data and model code, so fedlore's
``OMP_WAIT_POLICY=PASSIVE`` default does not reach pfl's OpenMP runtime either). The count each
used is reported. ``--threads N`` sets ``OMP_NUM_THREADS=N`` for both (same count on both sides).

    python benchmarks/peer_pfl.py                          # both tasks, 3 repeats (a few minutes)
    python benchmarks/peer_pfl.py --tasks digits --rounds 2 --repeats 1    # a smoke test
    python benchmarks/peer_pfl.py --threads 1              # both on one thread

pfl is not a dependency of fedlore (pyproject extra ``peer``, see the message when it is
missing: exit 2). Run on an otherwise idle machine: the timings of a shared one are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Only the standard library at module level: a worker chooses its own import order (see Threads).
from peer_pfl_workers import ADAMW_LR, FRAMEWORKS, INSTALL, ROOT, SEED, TASKS, worker


def pfl_problem() -> str | None:
    """None when pfl imports (in a fresh process, its PyTorch parts), else why not."""
    import importlib.util

    if importlib.util.find_spec("pfl") is None:
        return "no module named 'pfl'"
    code = (
        "import pfl.model.pytorch, pfl.algorithm, pfl.aggregate.simulate, "
        "pfl.data.federated_dataset"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode:
        return (res.stderr.strip().splitlines() or ["import failed"])[-1]
    return None


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "machine": platform.machine()}
    for pkg in ("torch", "pfl", "fedlore", "dp-accounting"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def run_one_framework(
    a: argparse.Namespace, fw: str, task: str, rounds: int, lr: float, workdir: Path
) -> dict[str, Any]:
    """One worker subprocess; its result (exits 1 with its output when it fails)."""
    env = dict(os.environ)
    if a.threads is not None:
        env["OMP_NUM_THREADS"] = str(a.threads)
    env["PFL_PYTORCH_DEVICE"] = "cpu"  # fedlore runs on the CPU here (device=cpu)
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        fw,
        "--tasks",
        task,
        "--rounds",
        str(rounds),
        "--lr",
        str(lr),
        "--method",
        a.method,
        "--workdir",
        str(workdir),
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-30:])
        print(f"peer_pfl: the {fw} run of {task} failed (exit {res.returncode}):\n{tail}")
        raise SystemExit(1)
    result: dict[str, Any] = json.loads((workdir / "result.json").read_text())
    return result


def compare(fed_dir: Path, pfl_dir: Path) -> dict[str, Any]:
    """Largest weight difference and differing test predictions of two final models."""
    import torch

    f = torch.load(fed_dir / "final.pt")
    p = torch.load(pfl_dir / "final.pt")
    if set(f["weights"]) != set(p["weights"]):
        names = sorted(set(f["weights"]) ^ set(p["weights"]))
        raise SystemExit(f"peer_pfl: the two final models differ in their tensors: {names}")
    diff = max(
        float((f["weights"][k].double() - p["weights"][k].double()).abs().max())
        for k in f["weights"]
    )
    return {
        "max_abs_weight_diff": diff,
        "predictions_differing": int((f["predictions"] != p["predictions"]).sum()),
    }


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {list(TASKS)}")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default: per task)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--method", choices=("fedavg", "fedfull"), default="fedavg")
    p.add_argument("--lr", type=float, default=None, help="local lr (default: per task/method)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both sides")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/peer_pfl.json")
    p.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.task = a.tasks
        worker(a)
        return
    tasks = a.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or a.repeats < 1 or (a.rounds is not None and a.rounds < 2):
        p.error(f"unknown tasks {unknown}" if unknown else "need --repeats >= 1, --rounds >= 2")
    problem = pfl_problem()
    if problem is not None:
        print(f"{INSTALL} [{problem}]")
        raise SystemExit(2)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        t: {fw: [] for fw in FRAMEWORKS} for t in tasks
    }
    pairs: dict[str, list[dict[str, Any]]] = {t: [] for t in tasks}
    with tempfile.TemporaryDirectory(prefix="peer_pfl-") as tmp:
        for rep in range(a.repeats):
            order = FRAMEWORKS if rep % 2 == 0 else FRAMEWORKS[::-1]
            for task in tasks:
                rounds = a.rounds or TASKS[task].rounds
                lr = a.lr or (TASKS[task].sgd_lr if a.method == "fedavg" else ADAMW_LR)
                dirs = {}
                for fw in order:
                    dirs[fw] = Path(tmp) / f"{task}-{fw}-{rep}"
                    dirs[fw].mkdir()
                    r = run_one_framework(a, fw, task, rounds, lr, dirs[fw])
                    r.update(rounds_total=rounds, lr=lr, repeat=rep)
                    runs[task][fw].append(r)
                    print(
                        f"[{rep + 1}/{a.repeats}] {task} {fw}: {r['s_per_round']:.4f} s/round, "
                        f"{r['threads']} threads, CPU/wall {r['cpu_per_wall']:.2f}, "
                        f"accuracy {r['accuracy']:.4f}",
                        file=sys.stderr,
                    )
                pairs[task].append(compare(dirs["fedlore"], dirs["pfl"]))
    failures: list[str] = []
    report: dict[str, Any] = {}
    for task in tasks:
        f_runs, p_runs = runs[task]["fedlore"], runs[task]["pfl"]
        n_test = f_runs[0]["n_test"]
        tol = max(1.0 / n_test, 0.001)
        for rep, (fr, pr) in enumerate(zip(f_runs, p_runs, strict=True)):
            if fr["init_digest"] != pr["init_digest"]:
                failures.append(f"{task} repeat {rep + 1}: the initial weights differ")
            if fr["batch_digest"] != pr["batch_digest"] or fr["batches"] != pr["batches"]:
                failures.append(
                    f"{task} repeat {rep + 1}: the minibatches differ "
                    f"({fr['batches']} vs {pr['batches']} batches)"
                )
            if fr["buffers"] or pr["buffers"]:
                failures.append(f"{task}: the model has buffers, which pfl does not average")
            if not abs(fr["accuracy"] - pr["accuracy"]) <= tol + 1e-9:
                why = ""
                if fr["threads"] != pr["threads"]:
                    why = (
                        f"; they ran on {fr['threads']} and {pr['threads']} threads, which can "
                        "change float sums (rerun with --threads N on an idle machine)"
                    )
                failures.append(
                    f"{task} repeat {rep + 1}: accuracies disagree: fedlore "
                    f"{fr['accuracy']:.4f}, pfl {pr['accuracy']:.4f} (tolerance {tol:.4f}){why}"
                )
        per: dict[str, dict[str, Any]] = {
            fw: {
                "s_per_round": median([r["s_per_round"] for r in rs]),
                "cpu_s_per_round": median([r["cpu_s_per_round"] for r in rs]),
                "cpu_per_wall": median([r["cpu_per_wall"] for r in rs]),
                "threads": sorted({t for r in rs for t in r["threads"]}),
                "accuracy": [r["accuracy"] for r in rs],
                "process_wall_s": median([r["process_wall_s"] for r in rs]),
                "runs": rs,
            }
            for fw, rs in (("fedlore", f_runs), ("pfl", p_runs))
        }
        report[task] = {
            "title": TASKS[task].title,
            "rounds": f_runs[0]["rounds_total"],
            "timed_rounds": f_runs[0]["timed_rounds"],
            "lr": f_runs[0]["lr"],
            "n_test": n_test,
            "accuracy_tolerance": tol,
            **per,
            "ratio_fedlore_over_pfl": per["fedlore"]["s_per_round"] / per["pfl"]["s_per_round"],
            "cpu_ratio_fedlore_over_pfl": per["fedlore"]["cpu_s_per_round"]
            / per["pfl"]["cpu_s_per_round"],
            "agreement": pairs[task],
        }
    print(
        f"# fedlore vs pfl {versions()['pfl']}: FedAvg ({a.method}), 10 clients, K=10, B=32, "
        f"seed {SEED}; median of {a.repeats} fresh-process runs each; "
        f"{os.cpu_count()} CPUs; threads: "
        + (f"OMP_NUM_THREADS={a.threads} for both" if a.threads else "each framework's default")
    )
    print(
        "| task | rounds (timed) | fedlore s / round | pfl s / round | fedlore / pfl | "
        "fedlore threads, CPU/wall | pfl threads, CPU/wall | test accuracy fedlore / pfl | "
        "test predictions differing | max abs weight diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for task, r in report.items():
        f, q = r["fedlore"], r["pfl"]
        worst = max(pairs[task], key=lambda c: c["predictions_differing"])
        acc = max(  # the repeat whose accuracies are furthest apart
            zip(f["accuracy"], q["accuracy"], strict=True), key=lambda fp: abs(fp[0] - fp[1])
        )
        print(
            f"| {r['title']} | {r['rounds']} ({r['timed_rounds']}) | {f['s_per_round']:.4f} | "
            f"{q['s_per_round']:.4f} | {r['ratio_fedlore_over_pfl']:.2f} | "
            f"{','.join(map(str, f['threads']))}, {f['cpu_per_wall']:.2f} | "
            f"{','.join(map(str, q['threads']))}, {q['cpu_per_wall']:.2f} | "
            f"{acc[0]:.4f} / {acc[1]:.4f} | "
            f"{worst['predictions_differing']} of {r['n_test']} | "
            f"{max(c['max_abs_weight_diff'] for c in pairs[task]):.2e} |"
        )
    out = {
        "args": {k: str(v) for k, v in vars(a).items() if k not in ("worker", "workdir")},
        "versions": versions(),
        "cpus": os.cpu_count(),
        "tasks": report,
        "checks_passed": not failures,
        "failures": failures,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))
    print(f"results in {a.out}")
    if failures:
        print("peer_pfl: NOT identical work or disagreeing results:\n  " + "\n  ".join(failures))
        raise SystemExit(1)
    print("checks: same initial weights, same minibatches, accuracies agree")


if __name__ == "__main__":
    main()
