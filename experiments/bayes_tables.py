"""Print, or write, the Meta-BayFL tables (seed 001 Tables II-VI analogues) from the ``table.json``
files that ``experiments/sweep.py`` wrote under ``experiments/results/``.

    python experiments/bayes_tables.py [experiments/results]           # print the tables
    python experiments/bayes_tables.py [experiments/results] --write   # and write them

``--write`` writes each table beside its data as Markdown (``bayes_table2/summary.md``,
``summary_e10.md`` (10 local epochs, the cells finished so far),
``bayes_table3/summary.md``, ``summary_e10.md`` (10 local epochs),
``bayes_table4/summary_cnn.md``, ``summary_cnn_steps20.md`` (the earlier protocol's),
``summary_resnet20.md``, ``bayes_table5/summary.md``, ``summary_fmnist_e10.md`` (10 local
epochs), ``bayes_table6/summary_fmnist.md``,
``summary_fmnist_e10.md`` (10 local epochs), ``summary_digits.md``) and, as ``summary.json``
in each folder, the numbers the documentation quotes in its prose (means, differences, counts,
shares of the learning-rate searches): the pages under ``docs/results/`` include the tables
and quote the numbers, never retype them.
``tests/test_docs_results.py`` checks that the committed files are what this writes.

Cells are mean ± sample std over the seeds each sweep ran (accuracy in %, NLL in nats).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bayes_stats, bayes_lr_table beside it

from bayes_lr_table import table3, table3_e10, table3_e10_facts, table3_facts
from bayes_run_facts import table3_run_facts, table4_run_facts
from bayes_stats import (
    Record,
    find,
    load,
    lr_counts,
    mean,
    metrics,
    ms,
    paired_cell,
    paired_vs,
    span,
    std,
)

# ---------------------------------------------------------------- Table II
FRACTIONS = ("1.0", "0.5", "0.25", "0.1")
NOISES = ("0", "1e-4", "1e-3", "1e-2", "1e-1", "0.5")


def table2_pairs(root: Path, sub: str = "") -> list[tuple[str, str, Record, Record]]:
    """The (|D|, ε) cells with both methods, in the seed's order; under ``sub`` (a sweep still
    running, such as ``e10``) only the cells where both have the same seeds finished."""
    recs = load(root / "bayes_table2" / sub / "table.json")
    pairs = []
    for frac in FRACTIONS:
        for eps in NOISES:
            a = find(recs, "fedavg", **{"data.fraction": frac, "data.noise": eps})
            b = find(recs, "bayfl", **{"data.fraction": frac, "data.noise": eps})
            if a and b and (not sub or a.get("by_seed", {}).keys() == b.get("by_seed", {}).keys()):
                pairs.append((frac, eps, a, b))
    return pairs


def table2(root: Path, sub: str = "") -> list[str]:
    lines = [
        "| \\|D\\| | ε | FedAvg acc. | BayFL acc. | Δ acc. | FedAvg NLL | BayFL NLL |"
        + (" FedAvg ECE | BayFL ECE | seeds |" if sub else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|---|" if sub else ""),
    ]
    for frac, eps, a, b in table2_pairs(root, sub):
        delta = mean(b["final_accuracy"]) - mean(a["final_accuracy"])
        lines.append(
            f"| {float(frac) * 100:g} % | {eps} | {ms(a['final_accuracy'])} | "
            f"{ms(b['final_accuracy'])} | {delta:+.2f} | {ms(a['final_loss'], 1, 3)} | "
            f"{ms(b['final_loss'], 1, 3)} |"
            + (
                f" {ms(a['final_ece'], 1, 3)} | {ms(b['final_ece'], 1, 3)} | {a['seeds']} |"
                if sub
                else ""
            )
        )
    return lines


def table2_facts(root: Path, sub: str = "") -> dict[str, Any]:
    """BayFL against FedAvg over the (|D|, ε) cells: how often it is ahead, by how much."""
    pairs = table2_pairs(root, sub)
    lower_nll = lower_ece = higher_acc = within_std = 0
    diffs: list[float] = []
    stds: list[float] = []
    by_fraction: dict[str, list[float]] = {}
    at: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any]]] = {}
    for frac, eps, a, b in pairs:
        at[frac, eps] = (a, b)
        delta = mean(b["final_accuracy"]) - mean(a["final_accuracy"])
        lower_nll += mean(b["final_loss"], 1) < mean(a["final_loss"], 1)
        lower_ece += mean(b["final_ece"], 1) < mean(a["final_ece"], 1)
        higher_acc += delta > 0
        sa, sb = std(a["final_accuracy"]), std(b["final_accuracy"])
        within_std += abs(delta) < max(sa, sb)
        stds += [sa, sb]
        diffs += [
            100 * (y - x) for x, y in zip(a["final_accuracy"], b["final_accuracy"], strict=True)
        ]
        by_fraction.setdefault(f"{float(frac) * 100:g}", []).append(delta)
    return {
        "cells": len(pairs),
        "bayfl_lower_nll_cells": lower_nll,
        "bayfl_lower_ece_cells": lower_ece,
        "bayfl_higher_acc_cells": higher_acc,
        "cells_delta_within_larger_std": within_std,
        "paired_runs": len(diffs),
        "paired_runs_bayfl_ahead": sum(d > 0 for d in diffs),
        "paired_mean_diff": statistics.mean(diffs),
        "accuracy_std": span(stds),
        "delta_by_fraction": {k: span(v) for k, v in by_fraction.items()},
        # accuracy points each method loses from the clean images to the noisiest (ε 0 -> 0.5)
        "noise_drop": {
            f"{float(frac) * 100:g}": {
                m: mean(at[frac, NOISES[0]][i]["final_accuracy"])
                - mean(at[frac, NOISES[-1]][i]["final_accuracy"])
                for i, m in enumerate(("fedavg", "bayfl"))
            }
            for frac in FRACTIONS
            if (frac, NOISES[0]) in at and (frac, NOISES[-1]) in at
        },
    }


# ---------------------------------------------------------------- Table IV
ABLATIONS = {"cnn": (("cnn_temp50", "temp50", "50 trial steps"),)}
"""Table IV's ablation folders: ``sub -> (folder, key suffix, what differs)``; their rows are
the same methods under one changed setting (the sweep's ``--set``, which ``table.json`` does
not record), shown and keyed apart."""


def table4_rows(root: Path, sub: str) -> list[Record]:
    recs = load(root / "bayes_table4" / sub / "table.json")
    recs += load(root / "bayes_table4" / f"{sub}_lr1e-2" / "table.json")
    for folder, tag, what in ABLATIONS.get(sub, ()):
        rows = load(root / "bayes_table4" / folder / "table.json")
        recs += [{**r, "variant": (tag, what)} for r in rows]
    return recs


def row_lr(r: Record) -> str:
    return r["setting"].get("lr", "1e-3" if not r["lr_chosen"] else "searched")


def row_name(r: Record) -> str:
    return r["method"] + (f" ({r['variant'][1]})" if "variant" in r else "")


def row_key(r: Record) -> str:
    """The row's key in ``summary.json``: ``method``, ``method_lr<lr>``, ``method_<variant>``."""
    key = r["method"] + (f"_lr{r['setting']['lr']}" if "lr" in r["setting"] else "")
    return key + (f"_{r['variant'][0]}" if "variant" in r else "")


def table4(root: Path, sub: str) -> list[str]:
    rows = table4_rows(root, sub)
    base = find(rows, "fedavg")
    paired = any(r.get("by_seed") for r in rows)  # a sweep that recorded each seed's values
    at = f" at {row_lr(base)}" if base else ""
    extra = f" Δ acc. vs fedavg{at}, paired (95 % CI), ahead |" if paired else ""
    lines = [
        "| method | lr | acc. (%) |" + extra + " NLL | ECE | P-local acc. (%) "
        "| client train s / round | lr chosen |",
        "|---|---|---|" + ("---|" if paired else "") + "---|---|---|---|---|",
    ]
    for r in rows:
        cell = f" {paired_cell(paired_vs(r, base))} |" if paired else ""
        lines.append(
            f"| {row_name(r)} | {row_lr(r)} | {ms(r['final_accuracy'])} |{cell}"
            f" {ms(r['final_loss'], 1, 3)} | {ms(r['final_ece'], 1, 3)} "
            f"| {ms(r['local_accuracy'])} | {ms(r['client_train_s_per_round'], 1, 3)} "
            f"| {lr_counts(r)} |"
        )
    return lines


def table4_facts(root: Path) -> dict[str, Any]:
    """Every row's means, keyed ``method`` (the base rate or searched) or ``method_lr<lr>``."""
    out: dict[str, Any] = {}
    for sub in ("cnn", "cnn_steps20", "resnet20"):
        rows: dict[str, Any] = {}
        records = table4_rows(root, sub)
        base = find(records, "fedavg")
        for r in records:
            key = row_key(r)
            rows[key] = metrics(r)
            if (p := paired_vs(r, base)) is not None:
                rows[key]["vs_fedavg"] = p
            if "variant" in r:  # against the same method without the change, seed by seed
                plain = next((x for x in records if x["method"] == r["method"]), None)
                if (p := paired_vs(r, plain)) is not None:
                    rows[key][f"vs_{r['method']}"] = p
        out[sub] = rows
    return out


# ---------------------------------------------------------------- Table V
def table5(root: Path, sub: str = "") -> list[str]:
    recs = load(root / "bayes_table5" / sub / "table.json")
    lines = [
        "| clients | acc. (%) | NLL | ECE | P-local acc. (%) | lr chosen |",
        "|---|---|---|---|---|---|",
    ]
    for r in recs:
        lines.append(
            f"| {r['setting']['num_clients']} | {ms(r['final_accuracy'])} | "
            f"{ms(r['final_loss'], 1, 3)} | {ms(r['final_ece'], 1, 3)} | "
            f"{ms(r['local_accuracy'])} | {lr_counts(r)} |"
        )
    return lines


def table5_facts(root: Path) -> dict[str, Any]:
    """The earlier protocol's rows (``clients``: 20 local steps) and seed 001's (``e10``: 10
    local epochs, issue 33), by number of clients."""
    out = {}
    for key, sub in (("clients", ""), ("e10", "fmnist_e10")):
        recs = load(root / "bayes_table5" / sub / "table.json")
        out[key] = {r["setting"]["num_clients"]: metrics(r) for r in recs}
    recs = load(root / "bayes_table5" / "fmnist_e10" / "table.json")
    out["e10_by_seed"] = {  # final accuracy (%) of each seed: a seed at chance is told apart
        r["setting"]["num_clients"]: {
            seed: 100 * one["final_accuracy"] for seed, one in r["by_seed"].items()
        }
        for r in recs
    }
    return out


# ---------------------------------------------------------------- Table VI
TABLE6_NAMES = {
    "fedavg": "FedAvg",
    "bayfl": "BNN (BayFL)",
    "pfedbayes": "pFedBayes",
    "fedmask": "FedMask",
    "fedbe": "FedBE",
    "meta_bayfl": "Meta-BayFL",
    "pfedme": "pFedMe",
    "ditto": "Ditto",
    "fedfomo": "FedFomo",
}
# the extra sweeps of Table VI: folder suffix, the label the table adds, the key the facts use
TABLE6_EXTRAS = (
    ("lr1e-2", ", Adam 1e-2", "adam1e-2"),
    ("fedavg_adam", ", Adam 1e-2", "adam1e-2"),
    ("variants_pfedme", ", personal_lr 0.02", "variant"),
    ("variants_fedmask", ", sparse_factor 0.5", "variant"),
)


def table6_rows(root: Path, data: str) -> list[tuple[Record, str, str]]:
    """Table VI: the main sweep, then the rows at a matched learning rate (Adam 1e-2) and the
    pFedMe / FedMask variants, as ``(record, label suffix, facts key)``."""
    base = root / "bayes_table6"
    rows = [(r, "", r["method"]) for r in load(base / data / "table.json")]
    for extra, tag, key in TABLE6_EXTRAS:
        rows += [
            (r, tag, f"{r['method']}_{key}") for r in load(base / f"{data}_{extra}" / "table.json")
        ]
    return rows


def table6(root: Path, data: str) -> list[str]:
    lines = [
        "| method | loss (NLL) | acc. (%) | ECE | G-local acc. (%) | P-local acc. (%) "
        "| P-local NLL | client train s / round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, tag, _ in table6_rows(root, data):
        method: str = r["method"]
        name = TABLE6_NAMES.get(method, method) + tag
        lines.append(
            f"| {name} | {ms(r['final_loss'], 1, 3)} | {ms(r['final_accuracy'])} "
            f"| {ms(r['final_ece'], 1, 3)} | {ms(r['final_client_accuracy'])} "
            f"| {ms(r['local_accuracy'])} | {ms(r['local_loss'], 1, 3)} "
            f"| {ms(r['client_train_s_per_round'], 1, 3)} |"
        )
    return lines


def table6_facts(root: Path) -> dict[str, Any]:
    """Every row's means per data set, and the spans the reading quotes."""
    out: dict[str, Any] = {}
    gap: list[float] = []
    fedmask_acc: list[float] = []
    fedmask_local: list[float] = []
    for data in ("fmnist", "digits"):
        rows = {key: metrics(r) for r, _, key in table6_rows(root, data)}
        main = [(r, key) for r, tag, key in table6_rows(root, data) if not tag]
        best_baseline = max(
            (rows[key]["final_accuracy"] for r, key in main if r["method"] != "meta_bayfl"),
            default=0.0,
        )
        gap += [rows[key]["local_accuracy"] - rows[key]["final_client_accuracy"] for _, key in main]
        for key in ("fedmask", "fedmask_variant"):
            if key in rows:
                fedmask_acc.append(rows[key]["final_accuracy"])
                fedmask_local.append(rows[key]["local_accuracy"])
        fedavg_s = rows["fedavg"]["client_train_s_per_round"]
        out[data] = {
            "rows": rows,
            "best_baseline_accuracy": best_baseline,
            "pfedbayes_time_over_fedavg": rows["pfedbayes"]["client_train_s_per_round"] / fedavg_s,
        }
    e10 = root / "bayes_table6" / "fmnist_e10" / "table.json"
    if e10.is_file():  # seed 001's local protocol (issue 33): 10 local epochs a round
        out["fmnist_e10"] = {"rows": {r["method"]: metrics(r) for r in load(e10)}}
    out["plocal_minus_glocal_main_rows"] = span(gap)
    out["fedmask_accuracy"] = span(fedmask_acc)
    out["fedmask_plocal_accuracy"] = span(fedmask_local)
    return out


# ---------------------------------------------------------------- outputs
TABLES: tuple[tuple[str, str, Callable[[Path], list[str]]], ...] = (
    ("Table II", "bayes_table2/summary.md", table2),
    (
        "Table II (10 local epochs, the cells finished so far)",
        "bayes_table2/summary_e10.md",
        lambda root: table2(root, "e10"),
    ),
    ("Table III", "bayes_table3/summary.md", table3),
    ("Table III (10 local epochs)", "bayes_table3/summary_e10.md", table3_e10),
    ("Table IV (CNN)", "bayes_table4/summary_cnn.md", lambda root: table4(root, "cnn")),
    (
        "Table IV (CNN, earlier protocol: 20 local steps)",
        "bayes_table4/summary_cnn_steps20.md",
        lambda root: table4(root, "cnn_steps20"),
    ),
    (
        "Table IV (ResNet-20)",
        "bayes_table4/summary_resnet20.md",
        lambda root: table4(root, "resnet20"),
    ),
    ("Table V", "bayes_table5/summary.md", table5),
    (
        "Table V (Fashion-MNIST, 10 local epochs)",
        "bayes_table5/summary_fmnist_e10.md",
        lambda root: table5(root, "fmnist_e10"),
    ),
    (
        "Table VI (Fashion-MNIST)",
        "bayes_table6/summary_fmnist.md",
        lambda root: table6(root, "fmnist"),
    ),
    ("Table VI (digits)", "bayes_table6/summary_digits.md", lambda root: table6(root, "digits")),
    (
        "Table VI (Fashion-MNIST, 10 local epochs)",
        "bayes_table6/summary_fmnist_e10.md",
        lambda root: table6(root, "fmnist_e10"),
    ),
    # seed 001's local protocol (issue 33: 10 local epochs, a search before each, a new d every
    # round), on digits
    (
        "Table III (digits, 10 local epochs)",
        "bayes_table3_digits/summary.md",
        lambda root: table3(root, "bayes_table3_digits"),
    ),
    (
        "Table IV (digits, 10 local epochs)",
        "bayes_table4/summary_digits_e10.md",
        lambda root: table4(root, "digits_e10"),
    ),
    (
        "Table V (digits, 10 local epochs)",
        "bayes_table5/summary_digits_e10.md",
        lambda root: table5(root, "digits_e10"),
    ),
    (
        "Table VI (digits, 10 local epochs)",
        "bayes_table6/summary_digits_e10.md",
        lambda root: table6(root, "digits_e10"),
    ),
)
FACTS: tuple[tuple[str, Callable[[Path], dict[str, Any]]], ...] = (
    ("bayes_table2/summary.json", lambda root: {**table2_facts(root), "e10": e10_progress(root)}),
    (
        "bayes_table3/summary.json",
        lambda root: {
            **table3_facts(root),
            "e10": {**table3_e10_facts(root), "runs": table3_run_facts(root.parent / "runs")},
        },
    ),
    (
        "bayes_table4/summary.json",
        lambda root: {**table4_facts(root), "runs": table4_run_facts(root.parent / "runs")},
    ),
    ("bayes_table5/summary.json", table5_facts),
    ("bayes_table6/summary.json", table6_facts),
    ("bayes_table3_digits/summary.json", lambda root: epochs_facts(root)),
)


def e10_progress(root: Path) -> dict[str, Any]:
    """Table II's rerun at 10 local epochs while it runs (``bayes_table2/e10``, the sweep's
    ``--table-only`` over the runs finished so far): the complete cells' facts, and how many of
    the grid's runs (every cell, both methods, the config's three seeds) have finished."""
    recs = load(root / "bayes_table2" / "e10" / "table.json")
    out = table2_facts(root, "e10") if table2_pairs(root, "e10") else {"cells": 0}
    out["runs_finished"] = sum(r["seeds"] for r in recs)
    out["runs_in_grid"] = len(FRACTIONS) * len(NOISES) * 2 * 3
    return out


def epochs_facts(root: Path) -> dict[str, Any]:
    """The reruns under seed 001's local protocol on digits (issue 33): Table III with the
    earlier protocol beside it, the rows of Tables IV-VI, and Table VI's rows before (20 local
    steps, ``bayes_table6/digits``) and after."""
    out: dict[str, Any] = {"table3": table3_facts(root, "bayes_table3_digits")}
    out["table4"] = {r["method"]: metrics(r) for r in table4_rows(root, "digits_e10")}
    out["table5"] = {
        r["setting"]["num_clients"]: metrics(r)
        for r in load(root / "bayes_table5" / "digits_e10" / "table.json")
    }
    before = {
        r["method"]: metrics(r) for r in load(root / "bayes_table6" / "digits" / "table.json")
    }
    after = {
        r["method"]: metrics(r) for r in load(root / "bayes_table6" / "digits_e10" / "table.json")
    }
    out["table6"] = {m: {"before": before.get(m), "after": a} for m, a in after.items()}
    return out


def dump_json(data: Any) -> str:
    """The committed form of a facts file: sorted keys, floats as Python writes them."""
    return json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def outputs(root: Path) -> dict[str, str]:
    """``{path relative to root: text}`` of every file ``--write`` writes."""
    out = {path: "\n".join(fn(root)) + "\n" for _, path, fn in TABLES}
    out.update({path: dump_json(fn(root)) for path, fn in FACTS})
    return out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    write = "--write" in args
    rest = [a for a in args if a != "--write"]
    root = Path(rest[0] if rest else "experiments/results")
    for title, _, fn in TABLES:
        print(f"\n### {title}\n")
        print("\n".join(fn(root)))
    if write:
        for path, text in outputs(root).items():
            (root / path).write_text(text, encoding="utf-8")
            print(f"wrote {root / path}")


if __name__ == "__main__":
    main()
