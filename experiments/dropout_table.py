"""Accuracy against client dropout (issue 34): the compact table and the numbers the results page
quotes, from the sweep of ``experiments/dropout.yaml``:

    python experiments/sweep.py experiments/dropout.yaml --vary clients.dropout=0,0.2,0.4,0.6 \\
        --jobs 2 --out experiments/results/dropout
    python experiments/dropout_table.py

Writes ``experiments/results/dropout/summary.md`` (final test accuracy %, mean ± std over the
config's seeds, per method and dropout rate) and ``summary.json``
(``{method: {rate in %: mean}}``, e.g. ``fedlore.60``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "experiments" / "results" / "dropout"
METHODS = ("fedfull", "fedlore", "meta_bayfl")


def main() -> None:
    records = json.loads((OUT / "table.json").read_text())
    rates = sorted({r["setting"]["clients.dropout"] for r in records}, key=float)
    lines = [
        "| method | " + " | ".join(f"dropout {float(x):g}" for x in rates) + " |",
        "|---" * (1 + len(rates)) + "|",
    ]
    facts: dict[str, dict[str, float]] = {}
    for m in METHODS:
        cells = []
        for x in rates:
            rec = next(
                (r for r in records if r["method"] == m and r["setting"]["clients.dropout"] == x),
                None,
            )
            xs = [100 * a for a in rec["final_accuracy"]] if rec else []
            if not xs:
                cells.append("–")
                continue
            facts.setdefault(m, {})[str(round(float(x) * 100))] = statistics.mean(xs)
            sd = f" ± {statistics.stdev(xs):.1f}" if len(xs) > 1 else ""
            cells.append(f"{statistics.mean(xs):.1f}{sd}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    (OUT / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (OUT / "summary.json").write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
