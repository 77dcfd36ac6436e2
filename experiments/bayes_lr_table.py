"""Seed 001's Table III analogue (a fixed learning rate against Meta-BayFL's search) for
``experiments/bayes_tables.py``: the tables and the facts the docs quote, under the earlier local
protocol (20 local steps: ``bayes_table3/bayfl``, ``meta``) and at the seed's 10 local epochs
(``bayfl_e10``, ``meta_e10``), and on digits (``bayes_table3_digits``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bayes_stats import Record, find, load, lr_counts, mean, metrics, ms, span


# ---------------------------------------------------------------- Table III
def table3(root: Path, folder: str = "bayes_table3") -> list[str]:
    bay = load(root / folder / "bayfl" / "table.json")
    meta = load(root / folder / "meta" / "table.json")
    before = load(root / folder / "meta_before" / "table.json")
    lines = [
        "| ε | method | acc. (%) | NLL | ECE | lr chosen (share of searches) |",
        "|---|---|---|---|---|---|",
    ]
    for eps in ("1e-3", "1e-2", "1e-1"):
        for lr in ("1e-4", "1e-3", "1e-2"):
            r = find(bay, "bayfl", **{"data.noise": eps, "lr": lr})
            if r:
                lines.append(
                    f"| {eps} | BayFL, lr = {lr} | {ms(r['final_accuracy'])} | "
                    f"{ms(r['final_loss'], 1, 3)} | {ms(r['final_ece'], 1, 3)} | – |"
                )
        for name, recs in (("Meta-BayFL", meta), ("Meta-BayFL, earlier protocol", before)):
            r = find(recs, "meta_bayfl", **{"data.noise": eps})
            if r:
                lines.append(
                    f"| {eps} | {name} | {ms(r['final_accuracy'])} "
                    f"| {ms(r['final_loss'], 1, 3)} | {ms(r['final_ece'], 1, 3)} | {lr_counts(r)} |"
                )
    return lines


def table3_facts(root: Path, folder: str = "bayes_table3") -> dict[str, Any]:
    """Meta-BayFL against BayFL at each fixed rate, per input noise ε (and, where recorded,
    Meta-BayFL under the earlier local protocol)."""
    bay = load(root / folder / "bayfl" / "table.json")
    meta = load(root / folder / "meta" / "table.json")
    before = load(root / folder / "meta_before" / "table.json")
    eps_facts: dict[str, Any] = {}
    gains: dict[str, list[float]] = {"1e-4": [], "1e-3": [], "1e-2": []}
    share_1e3: list[float] = []
    for eps in ("1e-3", "1e-2", "1e-1"):
        m = find(meta, "meta_bayfl", **{"data.noise": eps})
        if not m:
            continue
        row: dict[str, Any] = {"meta_bayfl": metrics(m)}
        for lr in gains:
            r = find(bay, "bayfl", **{"data.noise": eps, "lr": lr})
            if r:
                row[f"bayfl_{lr}"] = metrics(r)
                gains[lr].append(mean(m["final_accuracy"]) - mean(r["final_accuracy"]))
        share_1e3.append(row["meta_bayfl"]["lr_share"].get("1e-3", 0.0))
        b = find(before, "meta_bayfl", **{"data.noise": eps})
        if b:
            row["meta_bayfl_before"] = metrics(b)
        eps_facts[eps] = row
    return {
        "eps": eps_facts,
        "meta_gain_over_bayfl": {lr: span(v) for lr, v in gains.items() if v},
        "meta_share_1e-3": span(share_1e3),
    }


def table3_e10(root: Path) -> list[str]:
    """Table III at seed 001's 10 local epochs (``bayes_table3/bayfl_e10``, ``meta_e10``), with
    each row's accuracy under the earlier protocol (20 local steps, ``bayfl`` / ``meta``)."""
    base = root / "bayes_table3"
    lines = [
        "| ε | method | acc. (%) | NLL | ECE | acc. at 20 steps (%) | lr chosen |",
        "|---|---|---|---|---|---|---|",
    ]
    for eps, name, now, before in table3_e10_rows(base):
        lines.append(
            f"| {eps} | {name} | {ms(now['final_accuracy'])} | {ms(now['final_loss'], 1, 3)} "
            f"| {ms(now['final_ece'], 1, 3)} | {ms(before['final_accuracy']) if before else '–'} "
            f"| {lr_counts(now)} |"
        )
    return lines


def table3_e10_rows(base: Path) -> list[tuple[str, str, Record, Record | None]]:
    """``(ε, row name, record at 10 epochs, record at 20 steps)`` in the table's order."""
    bay, meta = load(base / "bayfl_e10" / "table.json"), load(base / "meta_e10" / "table.json")
    bay20, meta20 = load(base / "bayfl" / "table.json"), load(base / "meta" / "table.json")
    rows = []
    for eps in ("1e-3", "1e-2", "1e-1"):
        for lr in ("1e-4", "1e-3", "1e-2"):
            if r := find(bay, "bayfl", **{"data.noise": eps, "lr": lr}):
                before = find(bay20, "bayfl", **{"data.noise": eps, "lr": lr})
                rows.append((eps, f"BayFL, lr = {lr}", r, before))
        if r := find(meta, "meta_bayfl", **{"data.noise": eps}):
            rows.append((eps, "Meta-BayFL", r, find(meta20, "meta_bayfl", **{"data.noise": eps})))
    return rows


def table3_e10_facts(root: Path) -> dict[str, Any]:
    """Each fixed rate at 10 epochs beside 20 steps, per ε, the best fixed rate, and how many
    runs ended at chance (accuracy under 11 %: the posterior collapsed to the prior)."""
    out: dict[str, Any] = {}
    for eps, name, now, before in table3_e10_rows(root / "bayes_table3"):
        key = "meta_bayfl" if name == "Meta-BayFL" else f"bayfl_{now['setting']['lr']}"
        row = metrics(now)
        row["chance_runs"] = sum(a < 0.11 for a in now["final_accuracy"])
        row["runs"] = len(now["final_accuracy"])
        if before:
            row["before"] = metrics(before)
            row["change"] = row["final_accuracy"] - row["before"]["final_accuracy"]
        out.setdefault(eps, {})[key] = row
    for rows in out.values():
        fixed = {k: v["final_accuracy"] for k, v in rows.items() if k.startswith("bayfl_")}
        rows["best_fixed"] = max(fixed, key=lambda k: fixed[k]) if fixed else None
    return out
