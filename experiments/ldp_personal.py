"""FedPer (and FedAvg beside it) under no DP, central DP and local DP at the same σ and C.

Protocol (``experiments/ldp_personal.yaml``): the federation of ``ldp_digits.yaml`` (digits over
50 Dirichlet(0.5) clients, every client in every round, uniform weights, MLP 64-16-10), FedAvg
and FedPer with SGD at lr 0.1; for each seed three runs that differ only in ``dp``, as
``experiments/ldp_digits.py`` runs them (:data:`ldp_digits.MODES`). Reported per run and
method: P-local (``local_accuracy``: each client's model after its last round on its own test
split, pooled), the global model's test accuracy (G-central; FedPer's holds the server's random
head, so it is no score of the method), ``dp_epsilon`` and σ, C, δ from its ``summary.json``.

Usage::

    python experiments/ldp_personal.py experiments/ldp_personal.yaml
    python scripts/results_tables.py    # the table and numbers docs/results/dp.md quotes

Each mode and seed is ``fedlore run CONFIG seeds=<s> output_dir=<root>/<mode> [dp...] --resume``
in its own process, one after another (9 runs of the two methods on one core); rerunning
resumes. Writes ``experiments/results/ldp_personal/table.json``: one record per (mode, seed,
method).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import ldp_digits  # experiments/ is the script's folder: on sys.path
from ldp_digits import MODES, launch

from fedlore.config import load_config


def record(root: Path, cfg: Any, method: str, mode: str, seed: int) -> dict[str, Any]:
    """``ldp_digits.record``'s fields with the P-local score beside them."""
    row = ldp_digits.record(root, cfg, method, mode, seed)
    s = json.loads((root / mode / cfg.name / method / f"seed-{seed}" / "summary.json").read_text())
    return {**row, "local_accuracy": s["local_accuracy"], "local_clients": s["local_clients"]}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--root", default=None, help="runs folder (default: the config's)")
    ap.add_argument("--out", default="experiments/results/ldp_personal")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    cfg = load_config(args.config)
    root = Path(args.root or cfg.output_dir)
    jobs = [(mode, seed) for seed in cfg.seeds for mode in MODES]
    if not args.table_only:
        for mode, seed in jobs:
            launch(args.config, root, mode, seed)
    rows = [
        record(root, cfg, method, mode, seed) for mode, seed in jobs for method in cfg.algorithms
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(f"{r['method']:7s} {r['mode']:8s} seed {r['seed']}: P-local "
              f"{100 * r['local_accuracy']:.1f} %, G-central {100 * r['final_accuracy']:.1f} %, "
              f"ε {r['dp_epsilon']}")  # fmt: skip
    print(f"results in {out}")


if __name__ == "__main__":
    main()
