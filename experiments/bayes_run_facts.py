"""The numbers the Meta-BayFL results pages quote from the runs themselves rather than from a
sweep's ``table.json``: run time, one seed's last rounds, the first search of each round.
``experiments/bayes_tables.py --write`` puts them in the tables' ``summary.json`` (keys
``runs``), read from the committed runs under ``experiments/runs/`` beside
``experiments/results/``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TABLE4_CNN = "bayes_table4/cnn/bayes_table4-base"
"""Table IV on the CNN at 10 local epochs: seven methods, seeds 42-44."""
TABLE3_E10 = {"bayfl": "bayes_table3/bayfl", "meta_bayfl": "bayes_table3/meta"}
"""Table III at 10 local epochs: BayFL over three noise levels and three rates, Meta-BayFL over
the three noise levels, seeds 42-44."""


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def summaries(folder: Path) -> list[dict[str, Any]]:
    """The ``summary.json`` of every finished run below ``folder``."""
    return [json.loads(p.read_text()) for p in sorted(folder.rglob("seed-*/summary.json"))]


def hours(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """How many runs, their run time in all and the shortest and longest one, in hours."""
    each = [r["wall_s_total"] / 3600 for r in runs]
    return {"n": len(each), "total": sum(each), "min": min(each), "max": max(each)}


def table4_run_facts(runs_root: Path) -> dict[str, Any]:
    """Table IV (CNN, 10 local epochs): its run time (in all, and each method's shortest and
    longest run in minutes); Meta-BayFL's seed 44 (the seed whose
    average collapsed) in its last round (training loss two rounds before and at the end,
    accuracy, P-local accuracy, how many clients' most frequent pick was 1e-2); and how
    often Meta-BayFL with MC dropout picked 1e-2 in the first search of a client's round."""
    base = runs_root / TABLE4_CNN
    if not base.is_dir():
        return {}
    seed44 = rows(base / "meta_bayfl" / "seed-44")
    last = seed44[-1]
    first = [
        picks.split(",")[0]
        for run in sorted((base / "meta_bayfl_mcd").glob("seed-*"))
        for row in rows(run)
        for picks in row["lr_picks"].values()
    ]
    minutes = {}
    for method in sorted(p.name for p in base.iterdir() if p.is_dir()):
        each = [r["wall_s_total"] / 60 for r in summaries(base / method)]
        minutes[method] = {"min": min(each), "max": max(each)}
    return {
        "hours": hours(summaries(base)),
        "minutes": minutes,
        "meta_bayfl_seed44": {
            "loss_from": seed44[-3]["train_loss"],
            "loss_to": last["train_loss"],
            "accuracy": 100 * last["accuracy"],
            "local_accuracy": 100 * last["local_accuracy"],
            "last_1e-2": sum(lr == 0.01 for lr in last["lr_chosen"].values()),
            "clients": len(last["lr_chosen"]),
        },
        "mcd_first_search": {"1e-2": first.count("0.01"), "of": len(first)},
    }


def table3_run_facts(runs_root: Path) -> dict[str, Any]:
    """Table III at 10 local epochs: each method's run time."""
    return {
        method: hours(found)
        for method, sub in TABLE3_E10.items()
        if (found := summaries(runs_root / sub))
    }
