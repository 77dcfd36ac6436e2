"""Paired comparisons against a baseline method: ``fedlore report DIR --baseline fedavg``.

Runs of one experiment that share a seed share everything the seed decides: the partition, the
model's initialization, the clients sampled and the minibatch order. The difference of two
methods' final scores on the same seed is then free of the seed-to-seed spread that a Dirichlet
partition adds (often several points), and its mean over the seeds, with a t interval, says
whether one method is ahead by more than the seeds can explain; ``mean ± std`` columns side by
side cannot say that.

For each method and the baseline: the seeds where both runs have a finite final score (a
diverged run has none and is left out, and counted), the mean difference ``method - baseline``
of the headline score (accuracy in points; perplexity or RMSE for language and regression
runs) and of the NLL, its 95 % Student-t interval ``mean ± t(0.975, n-1) · sd / sqrt(n)``
(none with one seed), and on how many seeds the method was ahead. The interval assumes the
differences are roughly normal; with three seeds it is wide, which is the point.
"""

from __future__ import annotations

import math
from typing import Any

from scipy import stats

from fedlore.registry import did_you_mean
from fedlore.results.store import RunRecord

HEADLINE = (
    ("final_accuracy", 100.0, "acc. (points)", True),
    ("final_perplexity", 1.0, "perplexity", False),
    ("final_rmse", 1.0, "RMSE", False),
)
"""``(summary key, scale, label, higher is better)``: the first the baseline's runs recorded is
compared."""

LEVEL = 0.95
"""Coverage of the intervals."""


def baseline_label(runs: dict[str, list[RunRecord]], baseline: str) -> str | None:
    """The row of ``runs`` that ``baseline`` names: the label itself, or the one row of that
    method when its runs split by config (``fedavg [lr=0.01]``); None when no row is of it.

    Raises:
        ValueError: when several rows are runs of ``baseline`` under different configs,
            listing them (name one, quoted, as the baseline).
    """
    if baseline in runs:
        return baseline
    rows = [label for label in runs if label.split(" [", 1)[0] == baseline]
    if len(rows) > 1:
        raise ValueError(
            f"--baseline {baseline}: its runs differ in config here ({', '.join(rows)}); "
            "name one of these rows"
        )
    return rows[0] if rows else None


def _finite(record: RunRecord, key: str) -> float | None:
    if record.summary.get("derived"):  # unfinished: its last round, not a final score
        return None
    v = record.summary.get(key)
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def paired_stats(diffs: list[float]) -> tuple[float, float | None]:
    """Mean of ``diffs`` and the half-width of its :data:`LEVEL` Student-t interval (None for
    fewer than two differences)."""
    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    return mean, float(stats.t.ppf(0.5 + LEVEL / 2, n - 1)) * sd / math.sqrt(n)


def paired_table(runs: dict[str, list[RunRecord]], baseline: str) -> list[dict[str, Any]]:
    """Each row of ``runs`` but the baseline's against it, seed by seed.

    Args:
        runs: label -> runs over seeds (:func:`~fedlore.results.store.split_by_config`).
        baseline: a label of ``runs``, or a method with one row (:func:`baseline_label`).

    Returns:
        Per row: ``method``, ``key`` and ``label`` of the headline score, ``higher_better``,
        ``paired`` (seeds compared), ``unpaired`` (seeds of the row without a finite pair),
        ``delta`` and ``ci`` (mean difference and interval half-width, in the scale of
        :data:`HEADLINE`), ``ahead`` (seeds where the row is better), ``delta_nll`` and
        ``ci_nll``. An empty list when no row is of ``baseline`` or it has no finite score.
    """
    label = baseline_label(runs, baseline)
    if label is None:
        return []
    base = {r.seed: r for r in runs[label]}
    found = [h for h in HEADLINE if any(_finite(r, h[0]) is not None for r in base.values())]
    if not found:
        return []
    key, scale, name, higher = found[0]
    table = []
    for method, records in runs.items():
        if method == label:
            continue
        diffs, nll = [], []
        for r in records:
            other = base.get(r.seed)
            mine, theirs = _finite(r, key), _finite(other, key) if other else None
            if mine is None or theirs is None or other is None:
                continue
            diffs.append((mine - theirs) * scale)
            a, b = _finite(r, "final_loss"), _finite(other, "final_loss")
            if a is not None and b is not None:
                nll.append(a - b)
        row: dict[str, Any] = {
            "method": method,
            "key": key,
            "label": name,
            "higher_better": higher,
            "paired": len(diffs),
            "unpaired": len(records) - len(diffs),
            "delta": None,
            "ci": None,
            "ahead": sum(1 for d in diffs if (d > 0 if higher else d < 0)),
            "delta_nll": None,
            "ci_nll": None,
        }
        if diffs:
            row["delta"], row["ci"] = paired_stats(diffs)
        if nll:
            row["delta_nll"], row["ci_nll"] = paired_stats(nll)
        table.append(row)
    return table


def _signed(mean: float | None, half: float | None, digits: int) -> tuple[str, str]:
    if mean is None:
        return "–", "–"
    if half is None:
        return f"{mean:+.{digits}f}", "–"
    return f"{mean:+.{digits}f}", f"[{mean - half:+.{digits}f}, {mean + half:+.{digits}f}]"


def paired_markdown(table: list[dict[str, Any]], baseline: str) -> str:
    """:func:`paired_table` as a Markdown table, with a sentence on how to read it."""
    if not table:
        return ""
    name, ci = table[0]["label"], f"{LEVEL:.0%} CI"
    lines = [
        f"| method | seeds paired | Δ {name} | {ci} | better on | Δ NLL | {ci} |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table:
        delta, ci = _signed(row["delta"], row["ci"], 2)
        dn, cn = _signed(row["delta_nll"], row["ci_nll"], 3)
        paired = str(row["paired"]) + (f" ({row['unpaired']} left out)" if row["unpaired"] else "")
        better = f"{row['ahead']} of {row['paired']}" if row["paired"] else "–"
        lines.append(f"| {row['method']} | {paired} | {delta} | {ci} | {better} | {dn} | {cn} |")
    direction = "higher" if table[0]["higher_better"] else "lower"
    return (
        "\n".join(lines)
        + f"\n\nΔ = method − {baseline} on the same seed (same partition, initialization and "
        f"sampling), averaged over the seeds both finished; the interval is Student's t at "
        f"{LEVEL:.0%} (none with one seed). An interval that excludes 0 is a difference the "
        f"seeds do not explain. Better: {direction} {name}. Seeds left out: a run of the pair "
        "missing, unfinished or diverged.\n"
    )


def unknown_baseline(baseline: str, labels: list[str]) -> str:
    """The message for a baseline no experiment has."""
    methods = sorted({label.split(" [", 1)[0] for label in labels})
    return (
        f"--baseline {baseline}: no runs of it here{did_you_mean(baseline, methods)}; "
        f"the methods here: {', '.join(methods)}"
    )
