"""Print the README's Meta-BayFL tables (seed 001 Tables II-VI analogues) from the ``table.json``
files that ``experiments/sweep.py`` wrote under ``experiments/results/``.

    python experiments/bayes_tables.py [experiments/results]

Cells are mean ± sample std over the seeds each sweep ran (accuracy in %, NLL in nats).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else []


def ms(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    xs = [v * scale for v in values]
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def mean(values: list[float], scale: float = 100.0) -> float:
    return statistics.mean(values) * scale


def find(records: list[dict[str, Any]], method: str, **setting: str) -> dict[str, Any] | None:
    for r in records:
        if r["method"] == method and all(r["setting"].get(k) == v for k, v in setting.items()):
            return r
    return None


def lr_counts(rec: dict[str, Any] | None) -> str:
    if not rec or not rec.get("lr_chosen"):
        return "–"
    total = sum(rec["lr_chosen"].values())
    return ", ".join(
        f"{k}: {100 * v / total:.0f} %" for k, v in sorted(rec["lr_chosen"].items(), reverse=True)
    )


def table2(root: Path) -> None:
    recs = load(root / "bayes_table2" / "table.json")
    print("| \\|D\\| | ε | FedAvg acc. | BayFL acc. | Δ acc. | FedAvg NLL | BayFL NLL |")
    print("|---|---|---|---|---|---|---|")
    for frac in ("1.0", "0.5", "0.25", "0.1"):
        for eps in ("0", "1e-4", "1e-3", "1e-2", "1e-1", "0.5"):
            a = find(recs, "fedavg", **{"data.fraction": frac, "data.noise": eps})
            b = find(recs, "bayfl", **{"data.fraction": frac, "data.noise": eps})
            if not a or not b:
                continue
            delta = mean(b["final_accuracy"]) - mean(a["final_accuracy"])
            print(
                f"| {float(frac) * 100:g} % | {eps} | {ms(a['final_accuracy'])} | "
                f"{ms(b['final_accuracy'])} | {delta:+.2f} | {ms(a['final_loss'], 1, 3)} | "
                f"{ms(b['final_loss'], 1, 3)} |"
            )


def table3(root: Path) -> None:
    bay = load(root / "bayes_table3" / "bayfl" / "table.json")
    meta = load(root / "bayes_table3" / "meta" / "table.json")
    print("| ε | method | acc. (%) | NLL | ECE | lr chosen (share of searches) |")
    print("|---|---|---|---|---|---|")
    for eps in ("1e-3", "1e-2", "1e-1"):
        for lr in ("1e-4", "1e-3", "1e-2"):
            r = find(bay, "bayfl", **{"data.noise": eps, "lr": lr})
            if r:
                print(
                    f"| {eps} | BayFL, lr = {lr} | {ms(r['final_accuracy'])} | "
                    f"{ms(r['final_loss'], 1, 3)} | {ms(r['final_ece'], 1, 3)} | – |"
                )
        r = find(meta, "meta_bayfl", **{"data.noise": eps})
        if r:
            print(
                f"| {eps} | Meta-BayFL | {ms(r['final_accuracy'])} | {ms(r['final_loss'], 1, 3)} "
                f"| {ms(r['final_ece'], 1, 3)} | {lr_counts(r)} |"
            )


def table4(root: Path, sub: str) -> None:
    recs = load(root / "bayes_table4" / sub / "table.json")
    extra = load(root / "bayes_table4" / f"{sub}_lr1e-2" / "table.json")
    print(
        "| method | lr | acc. (%) | NLL | ECE | P-local acc. (%) | client train s / round "
        "| lr chosen |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in recs + extra:
        lr = r["setting"].get("lr", "1e-3" if not r["lr_chosen"] else "searched")
        print(
            f"| {r['method']} | {lr} | {ms(r['final_accuracy'])} | {ms(r['final_loss'], 1, 3)} "
            f"| {ms(r['final_ece'], 1, 3)} | {ms(r['local_accuracy'])} | "
            f"{ms(r['client_train_s_per_round'], 1, 3)} | {lr_counts(r)} |"
        )


def table5(root: Path) -> None:
    recs = load(root / "bayes_table5" / "table.json")
    print("| clients | acc. (%) | NLL | ECE | P-local acc. (%) | lr chosen |")
    print("|---|---|---|---|---|---|")
    for r in recs:
        print(
            f"| {r['setting']['num_clients']} | {ms(r['final_accuracy'])} | "
            f"{ms(r['final_loss'], 1, 3)} | {ms(r['final_ece'], 1, 3)} | "
            f"{ms(r['local_accuracy'])} | {lr_counts(r)} |"
        )


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


def table6(root: Path, data: str) -> None:
    """Table VI: the main sweep, then the rows at a matched learning rate (Adam 1e-2) and the
    pFedMe / FedMask variants."""
    base = root / "bayes_table6"
    rows = [(r, "") for r in load(base / data / "table.json")]
    for extra, tag in (
        ("lr1e-2", ", Adam 1e-2"),
        ("fedavg_adam", ", Adam 1e-2"),
        ("variants_pfedme", ", personal_lr 0.02"),
        ("variants_fedmask", ", sparse_factor 0.5"),
    ):
        rows += [(r, tag) for r in load(base / f"{data}_{extra}" / "table.json")]
    print(
        "| method | loss (NLL) | acc. (%) | ECE | G-local acc. (%) | P-local acc. (%) "
        "| P-local NLL | client train s / round |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r, tag in rows:
        name = TABLE6_NAMES.get(r["method"], r["method"]) + tag
        print(
            f"| {name} | {ms(r['final_loss'], 1, 3)} | {ms(r['final_accuracy'])} "
            f"| {ms(r['final_ece'], 1, 3)} | {ms(r['final_client_accuracy'])} "
            f"| {ms(r['local_accuracy'])} | {ms(r['local_loss'], 1, 3)} "
            f"| {ms(r['client_train_s_per_round'], 1, 3)} |"
        )


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "experiments/results")
    for title, fn in (
        ("Table II", lambda: table2(root)),
        ("Table III", lambda: table3(root)),
        ("Table IV (CNN)", lambda: table4(root, "cnn")),
        ("Table IV (ResNet-20)", lambda: table4(root, "resnet20")),
        ("Table V", lambda: table5(root)),
        ("Table VI (Fashion-MNIST)", lambda: table6(root, "fmnist")),
        ("Table VI (digits)", lambda: table6(root, "digits")),
    ):
        print(f"\n### {title}\n")
        fn()


if __name__ == "__main__":
    main()
