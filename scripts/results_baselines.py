"""The classic baselines' quoted numbers (``experiments/results/baselines/summary.json``), for
``scripts/results_tables.py``: SCAFFOLD, FedDyn and FedNova against FedAvg under equal and
unequal local work, FedPer and FedBN against FedAvg (``experiments/drift_*.yaml``,
``experiments/partial*.yaml``; each folder's ``table.json`` is ``experiments/sweep.py``'s)."""

from __future__ import annotations

import statistics
from typing import Any

from results_common import EXP, dump_json, read

FOLDERS = ("drift_steps", "drift_epochs", "feddyn_alpha", "partial", "partial_bn")
SCORES = {
    "acc": ("final_accuracy", 100.0),
    "nll": ("final_loss", 1.0),
    "glocal": ("final_client_accuracy", 100.0),
    "plocal": ("local_accuracy", 100.0),
    "mb_up": ("bytes_up_total", 1e-6),
}
"""Key in summary.json -> (key of table.json, scale)."""


def _setting(row: dict[str, Any]) -> str:
    """``base``, or the swept settings by their last name, ``local_steps-5``, ``alpha-0_1`` (no
    dots: the ``{result}`` role splits its path at them)."""
    parts = [f"{k.split('.')[-1]}-{v}".replace(".", "_") for k, v in sorted(row["setting"].items())]
    return "-".join(parts) or "base"


def _stats(values: list[float], scale: float) -> dict[str, float]:
    vals = [v * scale for v in values]
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return {"mean": statistics.fmean(vals), "sd": sd}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``{setting: {method: {score: {mean, sd}, "seeds": n, "ahead": seeds above FedAvg,
    "minus_fedavg": mean difference in points}}}``; a score no run recorded is left out; the
    comparison with FedAvg is of the final (global) accuracy, or of the P-local accuracy where
    the runs recorded one."""
    out: dict[str, Any] = {}
    for row in rows:
        entry: dict[str, Any] = {"seeds": row["seeds"]}
        for name, (key, scale) in SCORES.items():
            vals = [v for v in row[key] if v is not None]
            if vals:
                entry[name] = _stats(vals, scale)
        out.setdefault(_setting(row), {})[row["method"]] = entry
    for setting, methods in out.items():
        base_row = next(
            (r for r in rows if _setting(r) == setting and r["method"] == "fedavg"), None
        )
        if base_row is None:  # a sweep of one method's setting: nothing to compare with
            continue
        for row in (r for r in rows if _setting(r) == setting and r["method"] != "fedavg"):
            key = "local_accuracy" if row["local_accuracy"] else "final_accuracy"
            pairs = [
                (row["by_seed"][s][key], base_row["by_seed"][s][key])
                for s in row["by_seed"]
                if s in base_row["by_seed"]
            ]
            methods[row["method"]]["ahead"] = sum(1 for a, b in pairs if a > b)
            methods[row["method"]]["minus_fedavg"] = 100 * statistics.fmean(a - b for a, b in pairs)
    return out


def baselines() -> dict[str, str]:
    """``experiments/results/baselines/summary.json`` from the four sweeps' ``table.json``."""
    facts = {f: summarize(read(EXP / "baselines" / f / "table.json")) for f in FOLDERS}
    return {"experiments/results/baselines/summary.json": dump_json(facts)}
