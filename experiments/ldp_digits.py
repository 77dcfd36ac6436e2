"""Local against central DP at the same noise multiplier on the quickstart's digits federation.

Protocol (``experiments/ldp_digits.yaml``): FedAvg on 10 Dirichlet(0.5) digits clients, every
client in every round, uniform weights; for each seed of the config three runs that differ only
in ``dp``: no DP (``dp.clip_norm=null``), ``dp.mode=central`` and ``dp.mode=local``, both at the
config's σ and C. Reported per run: the final test accuracy, ``dp_epsilon`` and σ from its
``summary.json``. With full participation both modes spend the same ε at the same σ; they differ
in where the noise goes (once on the sum, or on each of the 10 uploads: √10 times the noise on
the mean).

Usage::

    python experiments/ldp_digits.py experiments/ldp_digits.yaml
    python scripts/results_tables.py    # the table and numbers docs/results/dp.md quotes

Each run is ``fedlore run CONFIG seeds=<s> output_dir=<root>/<mode> [dp...] --resume`` in its own
process, one after another (6 short runs on one core); rerunning resumes. Writes
``experiments/results/ldp_digits/table.json``: one record per (mode, seed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dp_fmnist import run_logged  # experiments/ is the script's folder: on sys.path

from fedlore.config import load_config

MODES = {
    "none": ["dp.clip_norm=null", "dp.noise_multiplier=null"],
    "central": ["dp.mode=central"],
    "local": ["dp.mode=local"],
}
"""Each mode's overrides of the config (whose ``dp`` section sets σ and C)."""


def launch(config: str, root: Path, mode: str, seed: int) -> None:
    cmd = [sys.executable, "-m", "fedlore.cli", "run", "--resume", config, f"seeds={seed}",
           f"output_dir={root / mode}", "progress=false", *MODES[mode]]  # fmt: skip
    run_logged(cmd, root / "logs" / f"{mode}-{seed}.log")


def record(root: Path, cfg: Any, method: str, mode: str, seed: int) -> dict[str, Any]:
    path = root / mode / cfg.name / method / f"seed-{seed}" / "summary.json"
    s = json.loads(path.read_text())
    return {
        "mode": mode,
        "seed": seed,
        "method": method,
        "clients_per_round": cfg.clients_per_round(),
        "rounds": s["rounds"],
        "final_accuracy": s["final_accuracy"],
        "dp_epsilon": s.get("dp_epsilon"),
        "dp_noise_multiplier": s.get("dp_noise_multiplier"),
        "dp_clip_norm": s.get("dp_clip_norm"),
        "dp_delta": s.get("dp_delta"),
        "dp_mode": s.get("dp_mode"),
        "dp_clipped_total": s.get("dp_clipped_total"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--root", default=None, help="runs folder (default: the config's)")
    ap.add_argument("--out", default="experiments/results/ldp_digits")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    cfg = load_config(args.config)
    root = Path(args.root or cfg.output_dir)
    (method,) = cfg.algorithms
    jobs = [(mode, seed) for seed in cfg.seeds for mode in MODES]
    if not args.table_only:
        for mode, seed in jobs:
            launch(args.config, root, mode, seed)
    rows = [record(root, cfg, method, mode, seed) for mode, seed in jobs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(f"{r['mode']:8s} seed {r['seed']}: accuracy {100 * r['final_accuracy']:.1f} %, "
              f"ε {r['dp_epsilon']}")  # fmt: skip
    print(f"results in {out}")


if __name__ == "__main__":
    main()
