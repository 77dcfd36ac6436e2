"""The classic baselines' quoted numbers (``experiments/results/baselines/summary.json``), for
``scripts/results_tables.py``: SCAFFOLD, FedDyn and FedNova against FedAvg under equal and
unequal local work, FedPer, FedBN and FedRep against FedAvg's P-local, MOON against FedAvg's
global model, q-FFL's spread of the clients' accuracies against FedAvg's
(``experiments/drift_*.yaml``, ``experiments/partial*.yaml``,
``experiments/representation.yaml``, ``experiments/moon.yaml``, ``experiments/fairness.yaml``;
each folder's ``table.json`` is ``experiments/sweep.py``'s)."""

from __future__ import annotations

import statistics
from typing import Any

from results_common import EXP, dump_json, read

FOLDERS = (
    "drift_steps",
    "drift_epochs",
    "feddyn_alpha",
    "partial",
    "partial_bn",
    "representation",
    "representation_epochs",
    "representation_body",
    "moon",
    "moon_mu",
)
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
    the runs recorded one. Where the setting has FedPer, FedRep is compared with it the same way
    (``ahead_fedper``, ``minus_fedper``)."""
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
            pairs = _pairs(row, base_row)
            methods[row["method"]]["ahead"] = sum(1 for a, b in pairs if a > b)
            methods[row["method"]]["minus_fedavg"] = 100 * statistics.fmean(a - b for a, b in pairs)
        fedper = next((r for r in rows if _setting(r) == setting and r["method"] == "fedper"), None)
        fedrep = next((r for r in rows if _setting(r) == setting and r["method"] == "fedrep"), None)
        if fedper is not None and fedrep is not None:
            pairs = _pairs(fedrep, fedper)
            methods["fedrep"]["ahead_fedper"] = sum(1 for a, b in pairs if a > b)
            methods["fedrep"]["minus_fedper"] = 100 * statistics.fmean(a - b for a, b in pairs)
    return out


def _pairs(row: dict[str, Any], base: dict[str, Any]) -> list[tuple[float, float]]:
    """(the row's, the base's) accuracy of each seed both ran: P-local where the row recorded
    it, else the global model's."""
    key = "local_accuracy" if row["local_accuracy"] else "final_accuracy"
    return [(row["by_seed"][s][key], base["by_seed"][s][key]) for s in row["by_seed"]
            if s in base["by_seed"]]  # fmt: skip


FAIRNESS_RUNS = {
    "fedavg": ("fairness", "base", "fedavg"),
    "qffl-q-1": ("fairness", "base", "qffl"),
    "qffl-q-0": ("fairness_q", "q-0", "qffl"),
    "qffl-q-5": ("fairness_q", "q-5", "qffl"),
    "qffl-q-1-L-1": ("fairness_lipschitz", "lipschitz-1-q-1", "qffl"),
    "qffl-q-5-L-1": ("fairness_lipschitz", "lipschitz-1-q-5", "qffl"),
}
"""The fairness runs (``experiments/fairness.yaml``): key -> (folder, setting, method); q-FFL at
the paper's L = 1/lr (q = 1, its default, 0 and 5) and at L = 1 (``-L-1``)."""
FAIR_SCORES = {
    "acc": "final_accuracy",
    "cmean": "final_client_accuracy_mean",
    "cmin": "final_client_accuracy_min",
    "cp10": "final_client_accuracy_p10",
    "cstd": "final_client_accuracy_std",
}
"""Key in summary.json -> key of table.json (accuracies in percent, the std in points)."""


def fairness() -> dict[str, Any]:
    """``{run: {score: {mean, sd}, "seeds": n, "<score>_minus_fedavg": the mean difference from
    FedAvg's, seed by seed, in points, "<score>_ahead": seeds above FedAvg's}}`` for the
    :data:`FAIRNESS_RUNS`, and ``q0_max_diff``: the largest difference between q-FFL at q = 0 and
    FedAvg over seeds and scores, in points (q = 0 is FedAvg)."""
    rows = {}
    for key, (folder, setting, method) in FAIRNESS_RUNS.items():
        table = read(EXP / "baselines" / folder / "table.json")
        rows[key] = next(r for r in table if _setting(r) == setting and r["method"] == method)
    base = rows["fedavg"]["by_seed"]
    out: dict[str, Any] = {}
    for key, row in rows.items():
        entry: dict[str, Any] = {"seeds": row["seeds"]}
        for name, col in FAIR_SCORES.items():
            entry[name] = _stats(row[col], 100.0)
            if key == "fedavg":
                continue
            pairs = [(row["by_seed"][s][col], base[s][col]) for s in row["by_seed"]]
            entry[f"{name}_minus_fedavg"] = 100 * statistics.fmean(a - b for a, b in pairs)
            entry[f"{name}_ahead"] = sum(1 for a, b in pairs if a > b)
        out[key] = entry
    q0 = rows["qffl-q-0"]["by_seed"]
    out["q0_max_diff"] = 100 * max(
        abs(q0[s][col] - base[s][col]) for s in q0 for col in FAIR_SCORES.values()
    )
    return out


def baselines() -> dict[str, str]:
    """``experiments/results/baselines/summary.json`` from the sweeps' ``table.json``."""
    facts = {f: summarize(read(EXP / "baselines" / f / "table.json")) for f in FOLDERS}
    facts["fairness"] = fairness()
    return {"experiments/results/baselines/summary.json": dump_json(facts)}
