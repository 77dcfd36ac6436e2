"""APFL and Per-FedAvg against FedAvg and Ditto (``experiments/pfl_baselines.yaml``): the table and
the quoted numbers of ``experiments/results/pfl_baselines/`` (``summary.md``, ``summary.json``),
for ``scripts/results_tables.py``; each sweep folder's ``table.json`` is ``experiments/sweep.py``'s.
"""

from __future__ import annotations

import statistics
from typing import Any

from results_baselines import _pairs, summarize
from results_common import EXP, dump_json, read, table

PFL_NAMES = {"fedavg": "FedAvg", "ditto": "Ditto", "apfl": "APFL", "perfedavg": "Per-FedAvg"}
"""The methods of ``experiments/pfl_baselines.yaml`` as the page names them."""
PFL_EXTRAS = {
    "perfedavg_hf": ("perfedavg", "Per-FedAvg (HF)"),
    "perfedavg_alpha1e-2": ("perfedavg", "Per-FedAvg, α = 0.01"),
    "apfl_fixed": ("apfl", "APFL, α fixed at 0.5"),
}
"""The extra sweeps of one method each: folder -> (method, the row's name)."""
PFL_COLUMNS = (
    ("P-local acc. (%)", "local_accuracy", 100.0, 2),
    ("P-local NLL", "local_loss", 1.0, 3),
    ("acc. (%)", "final_accuracy", 100.0, 2),
    ("G-local acc. (%)", "final_client_accuracy", 100.0, 2),
    ("NLL", "final_loss", 1.0, 3),
    ("client train s / round", "client_train_s_per_round", 1.0, 2),
)


def _paired(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """Seed-by-seed P-local (else global) accuracy of ``row`` against ``base``: on how many
    seeds it is ahead, and the mean difference in points."""
    pairs = _pairs(row, base)
    return {
        "ahead": sum(1 for a, b in pairs if a > b),
        "minus": 100 * statistics.fmean(a - b for a, b in pairs),
    }


def _seconds(row: dict[str, Any]) -> float:
    return statistics.fmean(row["client_train_s_per_round"])


def _cell(values: list[float], scale: float, digits: int) -> str:
    vals = [v * scale for v in values]
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{statistics.fmean(vals):.{digits}f} ± {sd:.{digits}f}"


def _alphas(row: dict[str, Any]) -> list[float]:
    """APFL's mixing weights α_i after the last round, every client of every seed."""
    return [
        float(a)
        for seed in row.get("final_per_client", {}).values()
        for a in (seed.get("alpha") or {}).values()
    ]


def pfl_baselines() -> dict[str, str]:
    """APFL and Per-FedAvg beside FedAvg and Ditto (``experiments/pfl_baselines.yaml``,
    ``experiments/results/pfl_baselines/<sweep>/table.json``): the table of every row
    (``summary.md``) and the numbers the page quotes (``summary.json``): each method's scores
    (:func:`summarize`), each paired with every other seed by seed, its client training time
    over FedAvg's, which method has the best mean P-local accuracy and by how much (``best_plocal``:
    the four methods at their settings; ``best_row``: every row), APFL's final mixing weights,
    and each extra sweep against its method's main row and FedAvg."""
    root = EXP / "pfl_baselines"
    main = read(root / "main" / "table.json")
    rows = {r["method"]: r for r in main}
    facts: dict[str, Any] = {"main": summarize(main)["base"]}
    for name, row in rows.items():
        entry = facts["main"][name]
        entry["name"] = PFL_NAMES[name]
        entry["vs"] = {other: _paired(row, rows[other]) for other in rows if other != name}
        entry["time_over_fedavg"] = _seconds(row) / _seconds(rows["fedavg"])
    ranked = sorted(rows, key=lambda m: facts["main"][m]["plocal"]["mean"], reverse=True)
    top = facts["main"][ranked[0]]["plocal"]["mean"]
    best = [m for m in ranked if facts["main"][m]["plocal"]["mean"] == top]  # ties: all of them
    rest = [m for m in ranked if m not in best]
    facts["best_plocal"] = {
        "methods": " and ".join(PFL_NAMES[m] for m in best),
        "tied": len(best),
        "next": PFL_NAMES[rest[0]],
        "margin": top - facts["main"][rest[0]]["plocal"]["mean"],
        "ahead_of_next": min(facts["main"][m]["vs"][rest[0]]["ahead"] for m in best),
    }
    alphas = _alphas(rows["apfl"])
    facts["apfl_alpha"] = {
        "clients": len(alphas),
        "at_zero": sum(1 for a in alphas if a == 0.0),
        "max": max(alphas),
        "mean": statistics.fmean(alphas),
    }
    table_rows = [(PFL_NAMES[m], rows[m]) for m in rows]
    for folder, (method, label) in PFL_EXTRAS.items():
        path = root / folder / "table.json"
        if not path.exists():
            continue
        row = read(path)[0]
        table_rows.append((label, row))
        facts[folder] = {
            **summarize([row])["base"][method],
            "vs_main": _paired(row, rows[method]),
            "vs_fedavg": _paired(row, rows["fedavg"]),
            "time_over_main": _seconds(row) / _seconds(rows[method]),
        }
        if method == "apfl":
            facts[folder]["alpha"] = statistics.fmean(_alphas(row))
    label, row = max(table_rows, key=lambda lr: statistics.fmean(lr[1]["local_accuracy"]))
    facts["best_row"] = {
        "name": label,
        "plocal": 100 * statistics.fmean(row["local_accuracy"]),
        "vs_fedavg": _paired(row, rows["fedavg"]),
    }
    header = ["method", *(h for h, _, _, _ in PFL_COLUMNS)]
    body = [
        [label, *(_cell(r[k], sc, d) for _, k, sc, d in PFL_COLUMNS)] for label, r in table_rows
    ]
    return {
        "experiments/results/pfl_baselines/summary.json": dump_json(facts),
        "experiments/results/pfl_baselines/summary.md": table(header, body),
    }
