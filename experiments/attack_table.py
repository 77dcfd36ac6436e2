"""Byzantine-robust aggregation under attack (issue 34): run ``experiments/attacks.yaml`` over
every aggregate x attack x share of attackers with ``experiments/sweep.py`` (resumable), then
write the table of final accuracies.

    python experiments/attack_table.py [--jobs 2] [--table-only]

Grid: ``robust.aggregate`` in {mean, median, trimmed_mean, krum, multi_krum, bulyan} x
``attack.kind`` in {label_flip, sign_flip, scale, gaussian} x ``attack.fraction`` in {0.1, 0.3}
(3 or 9 of the 30 clients, and ``robust.num_byzantine`` set to that number, so the aggregates
know f), plus every aggregate without an attack. ``trimmed_mean`` drops the attackers' share at
each end (``robust.trim_fraction`` = the fraction). Writes ``experiments/results/attacks/``:
``<fraction>/table.json`` per sweep (sweep.py), ``summary.md``, mean ± std over the config's
seeds of the global model's final test accuracy (%); "n/a" where an aggregate cannot run (Bulyan
needs n ≥ 4f + 3 clients), and ``summary.json``, the means the results page quotes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "attacks.yaml"
OUT = ROOT / "experiments" / "results" / "attacks"
AGGREGATES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "bulyan")
ATTACKS = ("label_flip", "sign_flip", "scale", "gaussian")
SHARES = {"0.1": 3, "0.3": 9}  # attack.fraction -> f of 30 clients


def sweeps() -> dict[str, list[str]]:
    """Output folder -> sweep.py arguments."""
    out = {
        "none": [
            "--vary",
            f"robust.aggregate={','.join(AGGREGATES)}",
            "--set",
            "robust.num_byzantine=3",
        ]
    }
    for share, f in SHARES.items():
        out[share] = [
            "--vary", f"robust.aggregate={','.join(AGGREGATES)}",
            "--vary", f"attack.kind={','.join(ATTACKS)}",
            "--set", f"attack.fraction={share}", "--set", f"robust.num_byzantine={f}",
            "--set", f"robust.trim_fraction={share}",
            # a root of their own: the run names carry only the --vary settings
            "--runs", f"runs/attacks-{int(float(share) * 100)}",
        ]  # fmt: skip
    return out


def cell(records: list[dict], **setting: str) -> str:
    for r in records:
        if all(r["setting"].get(k) == v for k, v in setting.items()):
            xs = [100 * x for x in r["final_accuracy"]]
            if not xs:
                return "n/a"
            if len(xs) == 1:
                return f"{xs[0]:.1f}"
            return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}"
    return "n/a"


def mean_of(records: list[dict], **setting: str) -> float | None:
    for r in records:
        if all(r["setting"].get(k) == v for k, v in setting.items()) and r["final_accuracy"]:
            return 100 * statistics.mean(r["final_accuracy"])
    return None


def facts() -> dict:
    """``{aggregate: {"none" | "<attack>_<percent>": mean accuracy %}}``, the numbers the
    results page quotes (absent where the aggregate could not run)."""
    none = load(OUT / "none" / "table.json")
    out: dict = {}
    for agg in AGGREGATES:
        row = {"none": mean_of(none, **{"robust.aggregate": agg})}
        for share in SHARES:
            recs = load(OUT / share / "table.json")
            for a in ATTACKS:
                key = f"{a}_{int(float(share) * 100)}"
                row[key] = mean_of(recs, **{"robust.aggregate": agg, "attack.kind": a})
        out[agg] = {k: v for k, v in row.items() if v is not None}
    return out


def table() -> str:
    none = load(OUT / "none" / "table.json")
    head = "| aggregate | no attack | " + " | ".join(
        f"{a.replace('_', ' ')} {int(float(s) * 100)} %" for s in SHARES for a in ATTACKS
    )
    lines = [head + " |", "|---" * (2 + len(SHARES) * len(ATTACKS)) + "|"]
    for agg in AGGREGATES:
        row = [agg, cell(none, **{"robust.aggregate": agg})]
        for share in SHARES:
            recs = load(OUT / share / "table.json")
            row += [cell(recs, **{"robust.aggregate": agg, "attack.kind": a}) for a in ATTACKS]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default="2")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args(argv)
    for folder, extra in sweeps().items():
        cmd = [sys.executable, str(ROOT / "experiments" / "sweep.py"), str(CONFIG), *extra,
               "--jobs", args.jobs, "--out", str(OUT / folder)]  # fmt: skip
        if args.table_only:
            cmd.append("--table-only")
        subprocess.run(cmd, check=True, cwd=ROOT)
    text = table()
    (OUT / "summary.md").write_text(text, encoding="utf-8")
    summary = json.dumps(facts(), indent=1, sort_keys=True) + "\n"
    (OUT / "summary.json").write_text(summary, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
