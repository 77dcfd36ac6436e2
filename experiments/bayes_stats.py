"""The cells and statistics of the Meta-BayFL tables (``experiments/bayes_tables.py``): the
sweeps' ``table.json`` rows read, mean ± std cells, the search's rate shares, and a row against
FedAvg seed by seed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from fedlore.results.paired import paired_stats

Record = dict[str, Any]


def load(path: Path) -> list[Record]:
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


def std(values: list[float], scale: float = 100.0) -> float:
    return statistics.stdev(values) * scale if len(values) > 1 else 0.0


def find(records: list[Record], method: str, **setting: str) -> Record | None:
    for r in records:
        if r["method"] == method and all(r["setting"].get(k) == v for k, v in setting.items()):
            return r
    return None


def lr_counts(rec: Record | None) -> str:
    if not rec or not rec.get("lr_chosen"):
        return "–"
    total = sum(rec["lr_chosen"].values())
    return ", ".join(
        f"{k}: {100 * v / total:.0f} %" for k, v in sorted(rec["lr_chosen"].items(), reverse=True)
    )


def lr_shares(rec: Record | None) -> dict[str, float]:
    """``{"1e-2": 88.0, ...}``: each chosen rate's share of the searches in %, keyed without a
    dot (the documentation's ``{result}`` role reads dotted paths)."""
    if not rec or not rec.get("lr_chosen"):
        return {}
    total = sum(rec["lr_chosen"].values())
    return {
        f"{float(k):.0e}".replace("e-0", "e-"): 100 * v / total for k, v in rec["lr_chosen"].items()
    }


def metrics(rec: Record) -> dict[str, Any]:
    """Mean and std of every column of one row (accuracies in %), and its search shares."""
    out: dict[str, Any] = {}
    for key, scale in (
        ("final_accuracy", 100.0),
        ("final_loss", 1.0),
        ("final_ece", 1.0),
        ("final_client_accuracy", 100.0),
        ("local_accuracy", 100.0),
        ("local_loss", 1.0),
        ("client_train_s_per_round", 1.0),
    ):
        if rec.get(key):
            out[key] = mean(rec[key], scale)
            out[f"{key}_std"] = std(rec[key], scale)
    shares = lr_shares(rec)
    if shares:
        out["lr_share"] = shares
    return out


def span(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values)}


def paired_vs(rec: Record, base: Record | None) -> dict[str, Any] | None:
    """``rec``'s final accuracy minus ``base``'s, seed by seed (the sweeps' ``by_seed``; a
    diverged run's seed is left out), in points: ``delta``, the 95 % Student-t interval ``low``
    / ``high`` (None with one seed), ``ahead`` and ``n`` (seeds both finished); None without
    per-seed values."""
    if base is None or rec is base or not rec.get("by_seed") or not base.get("by_seed"):
        return None

    def score(values: dict[str, Any]) -> float | None:
        return None if values.get("diverged") else values.get("final_accuracy")

    diffs = [
        100 * (mine - theirs)
        for s, v in rec["by_seed"].items()
        if (mine := score(v)) is not None
        and (theirs := score(base["by_seed"].get(s, {}))) is not None
    ]
    if not diffs:
        return None
    delta, half = paired_stats(diffs)
    low, high = (None, None) if half is None else (delta - half, delta + half)
    n, ahead = len(diffs), sum(d > 0 for d in diffs)
    return {"delta": delta, "low": low, "high": high, "ahead": ahead, "n": n}


def paired_cell(p: dict[str, Any] | None) -> str:
    if p is None:
        return "–"
    if p["n"] == 1:
        return f"{p['delta']:+.2f} (1 seed)"
    return f"{p['delta']:+.2f} [{p['low']:+.2f}, {p['high']:+.2f}], {p['ahead']} of {p['n']}"
