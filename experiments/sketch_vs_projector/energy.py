"""Retained energy beside accuracy for the sketch_vs_projector tables (issue 20 item 2).

For each setting's ``table.json`` (written by ``experiments/lr_grid.py``), reads every seed's
``metrics.jsonl`` at the chosen rate and reports the mean over measured rounds of
``diag.retained_energy`` (⟨G, A G⟩ / ‖G‖², the share of the round-start global gradient G the
round's basis keeps) and of ``diag.rho2``, mean ± std over seeds, with the final accuracy or
perplexity. Usage::

    python experiments/sketch_vs_projector/energy.py \\
        experiments/results/sketch_vs_projector/quickstart --runs runs --name sketch_quickstart
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def seed_means(path: Path, key: str) -> float | None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.mean(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--name", required=True)
    args = ap.parse_args()
    table = json.loads((Path(args.results) / "table.json").read_text())
    rows = [{"method": m, **v} for m, v in table["methods"].items()]
    lines = [
        "| method | lr | final score (mean ± std) | retained energy (mean ± std over seeds) | ρ² |",
        "|---|---|---|---|---|",
    ]
    out = []
    for row in rows:
        method, lr = row["method"], row["lr"]
        folder = Path(args.runs) / f"lr-{lr:g}" / args.name / method
        energies, rhos = [], []
        for seed_dir in sorted(folder.glob("seed-*")):
            m = seed_dir / "metrics.jsonl"
            if not m.exists():
                continue
            e, r = seed_means(m, "diag.retained_energy"), seed_means(m, "diag.rho2")
            if e is not None:
                energies.append(e)
            if r is not None:
                rhos.append(r)
        e_m = statistics.mean(energies) if energies else None
        e_s = statistics.stdev(energies) if len(energies) > 1 else 0.0
        r_m = statistics.mean(rhos) if rhos else None
        score = row.get("mean")
        std = row.get("std")
        score_s = "–" if score is None else f"{score:.4g} ± {std or 0:.2g}"
        e_str = "–" if e_m is None else f"{e_m:.3f} ± {e_s:.3f}"
        r_str = "–" if r_m is None else f"{r_m:.3f}"
        lines.append(
            f"| {method} | {lr:g} | {score_s} | {e_str} ({len(energies)} seeds) | {r_str} |"
        )
        out.append(
            {
                "method": method,
                "lr": lr,
                "retained_energy": e_m,
                "retained_energy_std": e_s,
                "rho2": r_m,
                "seeds": len(energies),
            }
        )
    (Path(args.results) / "energy.json").write_text(json.dumps(out, indent=2))
    (Path(args.results) / "energy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
