"""Figure 3(d) at laptop scale: FedLore's validation loss by projection rank, one table, one plot.

Reads FedLore's runs at several ranks, each under ``<root>/rank-<r>/lr-<lr>/<name>/fedlore/``
(as ``lr_grid.py ... --set rank=<r> --runs <root>/rank-<r>`` leaves them) plus, for the
config's own rank, the Table 3 runs under ``<root>/lr-<lr>/<name>/fedlore/``. Writes
``<out>/rank_sweep.md`` (final val loss / perplexity mean ± std over seeds, bytes per client and
round, optimizer state) and ``<out>/perplexity_vs_round.png`` / ``perplexity_vs_bytes.png``
(one line per rank).

Usage::

    python experiments/rank_sweep.py experiments/pretrain_ablation.yaml --ranks 8,16,32,48 \\
        --lr 5e-3 --out experiments/results/pretrain_ablation
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fedlore.config import load_config
from fedlore.results.plots import plot
from fedlore.results.store import RunRecord, load_runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--ranks", required=True, help="comma-separated ranks")
    ap.add_argument("--lr", type=float, required=True, help="FedLore's learning rate")
    ap.add_argument("--root", default="runs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [])
    runs: dict[str, list[RunRecord]] = {}
    for r in (int(x) for x in args.ranks.split(",")):
        base = Path(args.root) if r == cfg.rank else Path(args.root) / f"rank-{r}"
        exp = base / f"lr-{args.lr:g}" / cfg.name
        runs[f"r={r}"] = load_runs(exp)["fedlore"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "| rank r | r / d_model | seeds | val loss | val PPL | MB up / client / round "
        "| MB down / client / round | optimizer state (MB / client) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    hidden = int(cfg.model.kwargs.get("hidden", 128))
    for label, records in runs.items():
        r = int(label.split("=")[1])
        loss = [float(x.summary["final_loss"]) for x in records]
        ppl = [float(x.summary["final_perplexity"]) for x in records]
        contacts = [
            sum(row.get("clients", 0) for row in x.rows if row["round"] >= 0) for x in records
        ]
        up = statistics.mean(
            float(x.summary["bytes_up_total"]) / c for x, c in zip(records, contacts, strict=True)
        )
        down = statistics.mean(
            float(x.summary["bytes_down_total"]) / c for x, c in zip(records, contacts, strict=True)
        )
        state = statistics.mean(float(x.summary["optimizer_state_bytes"]) for x in records)
        sd = statistics.stdev if len(records) > 1 else (lambda _: 0.0)
        lines.append(
            f"| {r} | {r / hidden:.3g} | {len(records)} | {statistics.mean(loss):.3f} ± "
            f"{sd(loss):.3f} | {statistics.mean(ppl):.2f} ± {sd(ppl):.2f} | {up / 1e6:.3f} | "
            f"{down / 1e6:.3f} | {state / 1e6:.3f} |"
        )
    (out / "rank_sweep.md").write_text("\n".join(lines) + "\n")
    print(f"results in {out}/rank_sweep.md")
    plot(runs, out)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
