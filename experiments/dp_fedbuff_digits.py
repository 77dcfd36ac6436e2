"""DP-FedBuff against synchronous DP-FedAvg at the same σ and the same client updates.

Protocol (``experiments/dp_fedbuff_digits.yaml``: FedAvg on the FedBuff how-to's 20 digits
clients, lognormal speeds, uniform weights, C = 1, δ = 1e-5), for each seed and for σ = 1
and σ = 4:

* ``sync``: 30 synchronous rounds of 10 sampled clients (300 client updates), ε amplified by
  sampling (``dp_epsilon``) and against the server that knows the sample
  (``dp_epsilon_sample_known``);
* ``buff10``: FedBuff, K = 10 of C = 10 in flight, 30 steps (300 updates: the same noise on
  the mean per step as a synchronous round);
* ``buff5``: FedBuff, K = 5, 60 steps (300 updates);
* ``buff5cap``: as ``buff5`` with ``dp.max_contributions = 20`` (ε bounded before the run);
* ``sync`` and ``buff5`` once more without DP (the cost of the noise).

Reported per run: the final accuracy and the mean of the last 5 evaluations (one draw of OS
noise per run makes the final one jumpy), the simulated clock at the end, and ε.

Each FedBuff run's ε is the largest over its clients (no amplification:
:mod:`fedlore.privacy.buffer_dp`). Usage: ``python experiments/dp_fedbuff_digits.py
experiments/dp_fedbuff_digits.yaml`` (runs in process, one after another; a few seconds each
on one core). Writes ``experiments/results/dp_fedbuff_digits/table.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from fedlore.config import load_config
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one

ARMS = {
    "sync": [],
    "buff10": ["asynchronous.buffer=10", "asynchronous.concurrency=10"],
    "buff5": ["asynchronous.buffer=5", "asynchronous.concurrency=10", "rounds=60"],
    "buff5cap": ["asynchronous.buffer=5", "asynchronous.concurrency=10", "rounds=60",
                 "dp.max_contributions=20"],
}  # fmt: skip
PLAIN = {"sync": [], "buff5": ARMS["buff5"]}
"""Arms run once more without DP (the cost of the noise)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--root", default="runs/dp-fedbuff-digits")
    ap.add_argument("--seeds", default="42,43,44")
    ap.add_argument("--sigmas", default="1,4")
    args = ap.parse_args()
    out = Path("experiments/results/dp_fedbuff_digits")
    out.mkdir(parents=True, exist_ok=True)
    table: list[dict[str, Any]] = []
    sigmas = [float(x) for x in args.sigmas.split(",")]
    runs = [(g, a) for g in sigmas for a in ARMS] + [(None, a) for a in PLAIN]
    for seed in [int(x) for x in args.seeds.split(",")]:
        for sigma, arm in runs:
            if sigma is None:  # no DP: the same federation's accuracy without noise or clip
                over = [*PLAIN[arm], "dp.clip_norm=null", "dp.noise_multiplier=null"]
                where = f"{args.root}/nodp/{arm}"
            else:
                over = [*ARMS[arm], f"dp.noise_multiplier={sigma:g}"]
                where = f"{args.root}/s{sigma:g}/{arm}"
            cfg = load_config(args.config, [*over, f"output_dir={where}"])
            s = run_one(cfg, "fedavg", seed, resume=True)
            assert s is not None
            rows = [json.loads(x) for x in (run_dir(cfg, "fedavg", seed) / "metrics.jsonl").open()]
            scores = [r["accuracy"] for r in rows if "accuracy" in r][-5:]
            table.append({
                "arm": arm, "sigma": sigma, "seed": seed, "steps": s["rounds"],
                "client_updates": s["rounds"] * (cfg.asynchronous.buffer or 10),
                "final_accuracy": s["final_accuracy"],
                "last5_accuracy": sum(scores) / len(scores),
                "sim_time_s": rows[-1].get("sim_time_s"),
                "dp_epsilon": s.get("dp_epsilon"),
                "dp_epsilon_sample_known": s.get("dp_epsilon_sample_known"),
            })  # fmt: skip
            print(table[-1], flush=True)
            (out / "table.json").write_text(json.dumps(table, indent=1) + "\n")
    for sigma, arm in runs:
        got = [r for r in table if r["arm"] == arm and r["sigma"] == sigma]
        acc = [r["last5_accuracy"] for r in got]
        eps = [r["dp_epsilon"] or 0.0 for r in got]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        mean = statistics.mean(acc)
        print(
            f"σ={sigma} {arm}: last-5 accuracy {mean:.3f} ± {sd:.3f}, "
            f"ε {min(eps):.2f}-{max(eps):.2f}"
        )


if __name__ == "__main__":
    main()
