"""Upload compression of FedAvg: accuracy against bytes up, for the table of the results page.

Runs ``experiments/compression.yaml`` (FedAvg on digits, 10 Dirichlet(0.5) clients, 30 rounds,
seeds 42 and 43) once per setting of :data:`SETTINGS`, each as ``fedlore run CONFIG
name=compression-<setting> <overrides> output_dir=<runs> --resume`` in its own process (a killed
driver resumes where it stopped), then writes ``experiments/results/compression/``:

* ``table.json``: per setting its overrides and, per seed, the final test accuracy and the
  run's bytes up (``summary.json`` of each run);
* ``summary.md``: upload per client and round (KB), MB up over the run, the ratio to dense, and
  the final accuracy (%) as mean ± sample std over seeds;
* ``summary.json``: the numbers the results page quotes (``<setting>.acc``, ``.sd``,
  ``.minus_dense`` in points, ``.mb_up``, ``.kb`` and ``.ratio``, dense bytes over its own).

``scripts/results_tables.py`` rewrites both summaries from ``table.json`` (:func:`summarize`), and
``tests/test_docs_results.py`` checks the committed ones against it.

    python experiments/compression.py --jobs 2 [--runs /tmp/compression-runs] [--table-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "compression.yaml"
OUT = ROOT / "experiments" / "results" / "compression"

SETTINGS: dict[str, tuple[str, list[str]]] = {
    "dense": ("FedAvg, dense fp32", []),
    "topk1-ef": (
        "top-k 1 %, error feedback",
        ["compression.kind=topk", "compression.fraction=0.01"],
    ),
    "topk1": (
        "top-k 1 %, no error feedback",
        ["compression.kind=topk", "compression.fraction=0.01", "compression.error_feedback=false"],
    ),
    "topk10-ef": (
        "top-k 10 %, error feedback",
        ["compression.kind=topk", "compression.fraction=0.1"],
    ),
    "topk10": (
        "top-k 10 %, no error feedback",
        ["compression.kind=topk", "compression.fraction=0.1", "compression.error_feedback=false"],
    ),
    "qsgd1": ("QSGD s = 1 (int8)", ["compression.kind=qsgd", "compression.levels=1"]),
    "qsgd15": ("QSGD s = 15 (int8)", ["compression.kind=qsgd", "compression.levels=15"]),
    "qsgd127": ("QSGD s = 127 (int8)", ["compression.kind=qsgd", "compression.levels=127"]),
}
"""Setting -> (its row label, its overrides)."""


def seeds() -> list[int]:
    from fedlore.config import load_config

    return list(load_config(str(CONFIG)).seeds)


def run(runs: str, setting: str) -> None:
    cmd = [sys.executable, "-m", "fedlore.cli", "run", "--resume", str(CONFIG)]
    cmd += [f"name=compression-{setting}", f"output_dir={runs}", *SETTINGS[setting][1]]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def collect(runs: str) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for setting, (label, overrides) in SETTINGS.items():
        per_seed = {}
        for seed in seeds():
            path = Path(runs) / f"compression-{setting}" / "fedavg" / f"seed-{seed}"
            summary = json.loads((path / "summary.json").read_text())
            per_seed[str(seed)] = {
                "final_accuracy": summary["final_accuracy"],
                "bytes_up_total": summary["bytes_up_total"],
                "rounds": summary["rounds"],
            }
        table[setting] = {"label": label, "overrides": overrides, "by_seed": per_seed}
    return table


def summarize(table: dict[str, Any]) -> tuple[str, dict[str, dict[str, float]]]:
    """The Markdown table and the quoted numbers of ``table`` (:func:`collect`'s)."""
    dense = statistics.mean(r["bytes_up_total"] for r in table["dense"]["by_seed"].values())
    dense_acc = statistics.mean(
        100 * r["final_accuracy"] for r in table["dense"]["by_seed"].values()
    )
    lines = [
        "| upload | KB / client / round | MB up (run) | × smaller | final acc. (%) |",
        "|---|---|---|---|---|",
    ]
    facts: dict[str, dict[str, float]] = {}
    for setting, row in table.items():
        runs = list(row["by_seed"].values())
        mb = statistics.mean(r["bytes_up_total"] for r in runs) / 1e6
        kb = 1e3 * mb / (runs[0]["rounds"] * 10)  # 10 clients a round
        acc = [100 * r["final_accuracy"] for r in runs]
        spread = statistics.stdev(acc) if len(acc) > 1 else 0.0
        sd = f" ± {spread:.1f}" if len(acc) > 1 else ""
        ratio = dense / (mb * 1e6)
        facts[setting] = {
            "acc": statistics.mean(acc),
            "sd": spread,
            "minus_dense": statistics.mean(acc) - dense_acc,
            "mb_up": mb,
            "ratio": ratio,
            "kb": kb,
        }
        lines.append(
            f"| {row['label']} | {kb:.2f} | {mb:.2f} | {ratio:.1f} | "
            f"{statistics.mean(acc):.1f}{sd} |"
        )
    return "\n".join(lines) + "\n", facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--runs", default="runs/compression", help="the runs' output_dir")
    ap.add_argument("--table-only", action="store_true", help="tabulate finished runs only")
    args = ap.parse_args(argv)
    if not args.table_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda s: run(args.runs, s), SETTINGS))
    table = collect(args.runs)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "table.json").write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    text, facts = summarize(table)
    (OUT / "summary.md").write_text(text, encoding="utf-8")
    (OUT / "summary.json").write_text(
        json.dumps(facts, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
