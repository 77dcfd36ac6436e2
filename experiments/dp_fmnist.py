"""Issue 20 item 5: accuracy vs ε under user-level central DP, at equal ε for every method.

Protocol: for each method and each ε, seed 42 runs at every clip norm C of the grid (the same
grid for every method); the C with the best final accuracy on the selection split
(``data.selection_fraction``: training images held out of every client, never the test set)
wins, ties to the smaller C; the chosen C then runs on the other seeds. A non-private reference
(no clipping, no noise) runs every seed. Reported: test accuracy mean ± std over seeds at the
chosen C, the noise multiplier σ each method needed for that ε (solved over its own exchanges),
the upload size per client per round, and the selection grid.

The expectation under test (issue 20): a low-rank upload has far fewer coordinates, so at the
same noise multiplier its signal-to-noise ratio is higher. The table's "noise / signal" column
gives the ratio of the expected noise norm on the mean update, σ C √L / m, to the largest
possible mean update norm C, i.e. σ √L / m for L upload coordinates and m = 100 clients.

Usage::

    python experiments/dp_fmnist.py experiments/dp_fmnist.yaml --jobs 2 \\
        --out experiments/results/dp_fmnist

Each run is ``fedlore run CONFIG algorithms=<m> seeds=<s> dp.epsilon=<e> dp.clip_norm=<C>
output_dir=<root>/eps-<e>/clip-<C> --resume`` in its own process; a killed driver resumes where
it stopped. Writes ``<out>/table.md``, ``<out>/table.json`` and
``<out>/accuracy_vs_epsilon.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fedlore.config import load_config

REFERENCE = "none"
"""The ε label of the non-private reference runs."""


def run_root(root: str, eps: str, clip: float | None) -> str:
    if eps == REFERENCE:
        return f"{root}/nodp"
    return f"{root}/eps-{eps}/clip-{clip:g}"


def launch(config: str, root: str, method: str, seed: int, eps: str, clip: float | None) -> Path:
    out = run_root(root, eps, clip)
    cmd = [
        sys.executable,
        "-m",
        "fedlore.cli",
        "run",
        "--resume",
        config,
        f"algorithms={method}",
        f"seeds={seed}",
        f"output_dir={out}",
        "progress=false",
    ]
    if eps == REFERENCE:
        cmd += ["dp.clip_norm=null", "dp.epsilon=null"]
    else:
        cmd += [f"dp.epsilon={eps}", f"dp.clip_norm={clip:g}"]
    run_logged(cmd, Path(root) / "logs" / f"{method}-{seed}-eps{eps}-clip{clip}.log")
    return Path(out)


def run_logged(cmd: list[str], log: Path) -> None:
    """Run ``cmd`` (a ``python -m fedlore.cli run`` line) on one thread, appending its output to
    ``log`` after a dated header (a rerun, resuming, keeps the earlier log).

    Raises:
        RuntimeError: naming the command and the log when it fails.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with log.open("a") as fh:
        fh.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(['python', *cmd[1:]])}\n")
        fh.flush()
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({rc}); see {log}")


def summary(root: str, name: str, method: str, seed: int, eps: str, clip: float | None) -> Any:
    path = Path(run_root(root, eps, clip)) / name / method / f"seed-{seed}" / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def exchanges(root: str, name: str, method: str, seed: int, eps: str, clip: float | None) -> int:
    """Rows of a run's metrics.jsonl: its rounds plus its setup exchanges."""
    path = Path(run_root(root, eps, clip)) / name / method / f"seed-{seed}" / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def score(s: dict[str, Any] | None) -> float:
    v = None if s is None else s.get("final_selection_accuracy")
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else -math.inf


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--methods", default="fedlore_sketch,fedfull,fedit,ffa_lora")
    ap.add_argument("--epsilons", default="2,8")
    ap.add_argument("--clips", default="0.1,0.3,1.0")
    ap.add_argument("--seeds", default="42,43,44")
    ap.add_argument("--reference-seeds", default="42,43,44")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--root", default=None, help="runs folder (default: the config's)")
    ap.add_argument("--out", default="experiments/results/dp_fmnist")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    cfg = load_config(args.config)
    root = args.root or cfg.output_dir
    methods = args.methods.split(",")
    epsilons = args.epsilons.split(",")
    clips = [float(c) for c in args.clips.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    ref_seeds = [int(s) for s in args.reference_seeds.split(",") if s]
    first = seeds[0]

    Job = tuple[str, int, str, float | None]  # method, seed, epsilon, clip (None: no DP)

    def run_all(jobs: list[Job]) -> None:
        if args.table_only or not jobs:
            return
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(launch, args.config, root, *j) for j in jobs]
            for f in futures:
                f.result()

    grid: list[Job] = [(m, first, e, c) for e in epsilons for m in methods for c in clips]
    run_all(grid)
    chosen: dict[tuple[str, str], float] = {}
    for m in methods:
        for e in epsilons:
            scores = {c: score(summary(root, cfg.name, m, first, e, c)) for c in clips}
            chosen[(m, e)] = max(clips, key=lambda c: (scores[c], -c))
    rest: list[Job] = [
        (m, s, e, chosen[(m, e)]) for e in epsilons for m in methods for s in seeds[1:]
    ]
    rest += [(m, s, REFERENCE, None) for m in methods for s in ref_seeds]
    run_all(rest)
    write_table(args, cfg.name, root, methods, epsilons, clips, seeds, ref_seeds, chosen)


def write_table(
    args: argparse.Namespace,
    name: str,
    root: str,
    methods: list[str],
    epsilons: list[str],
    clips: list[float],
    seeds: list[int],
    ref_seeds: list[int],
    chosen: dict[tuple[str, str], float],
) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for m in methods:
        for e in [*epsilons, REFERENCE]:
            clip = chosen.get((m, e))
            run_seeds = ref_seeds if e == REFERENCE else seeds
            sums = [summary(root, name, m, s, e, clip) for s in run_seeds]
            done = [s for s in sums if s is not None]
            accs = [100 * s["final_accuracy"] for s in done if s.get("final_accuracy") is not None]
            row: dict[str, Any] = {
                "method": m,
                "epsilon": e,
                "clip_norm": clip,
                "seeds": len(done),
                "accuracy_mean": statistics.mean(accs) if accs else None,
                "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            }
            if done:
                s0 = done[0]
                contacts = s0["rounds"] * 100  # 100 clients per training round
                uploads = exchanges(root, name, m, run_seeds[0], e, clip) * 100  # setup included
                row["upload_bytes_per_client_round"] = s0["bytes_up_total"] / contacts
                row["noise_multiplier"] = s0.get("dp_noise_multiplier")
                row["epsilon_spent"] = s0.get("dp_epsilon")
                row["clipped_share"] = (
                    s0["dp_clipped_total"] / uploads if "dp_clipped_total" in s0 else None
                )
                coords = row["upload_bytes_per_client_round"] / 4
                row["upload_coordinates"] = coords
                if row["noise_multiplier"] is not None:
                    row["noise_to_signal"] = row["noise_multiplier"] * math.sqrt(coords) / 100
            if e != REFERENCE:
                row["selection_grid"] = {
                    f"{c:g}": score(summary(root, name, m, seeds[0], e, c)) for c in clips
                }
            rows.append(row)
    (out / "table.json").write_text(json.dumps(rows, indent=2))
    lines = [
        "| method | ε (δ = 1e-5) | chosen C | test acc. (%) | seeds | σ | upload coords / client "
        "/ round | noise / signal | clipped share | selection acc. over C grid |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = (
            "–"
            if r["accuracy_mean"] is None
            else f"{r['accuracy_mean']:.2f} ± {r['accuracy_std']:.2f}"
        )
        grid = r.get("selection_grid")
        grid_s = (
            ", ".join(
                f"{c}: {100 * v:.1f}" if math.isfinite(v) else f"{c}: –" for c, v in grid.items()
            )
            if grid
            else "–"
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    r["method"],
                    "∞ (no DP)" if r["epsilon"] == REFERENCE else str(r["epsilon"]),
                    "–" if r["clip_norm"] is None else f"{r['clip_norm']:g}",
                    acc,
                    str(r["seeds"]),
                    "–" if r.get("noise_multiplier") is None else f"{r['noise_multiplier']:.3g}",
                    "–"
                    if r.get("upload_coordinates") is None
                    else f"{r['upload_coordinates']:,.0f}",
                    "–" if r.get("noise_to_signal") is None else f"{r['noise_to_signal']:.3g}",
                    "–" if r.get("clipped_share") is None else f"{r['clipped_share']:.2f}",
                    grid_s,
                ]
            )
            + " |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, methods, epsilons, out / "accuracy_vs_epsilon.png")
    print(f"results in {out}")


def plot(rows: list[dict[str, Any]], methods: list[str], epsilons: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [*epsilons, REFERENCE]
    xs = list(range(len(labels)))
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for m in methods:
        pts = [
            next((r for r in rows if r["method"] == m and r["epsilon"] == e), None) for e in labels
        ]
        ys = [p["accuracy_mean"] if p and p["accuracy_mean"] is not None else math.nan for p in pts]
        es = [p["accuracy_std"] if p and p["accuracy_mean"] is not None else 0.0 for p in pts]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=m)
    ax.set_xticks(xs, [f"ε = {e}" if e != REFERENCE else "no DP" for e in labels])
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Fashion-MNIST, 1,000 clients, 100 per round, δ = 1e-5")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    main()
