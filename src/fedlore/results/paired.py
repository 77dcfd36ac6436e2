"""Paired comparisons against a baseline method: ``fedlore report DIR --baseline fedavg``.

Runs of one experiment that share a seed share everything the seed decides: the partition, the
model's initialization, the clients sampled and the minibatch order. The difference of two
methods' final scores on the same seed is then free of the seed-to-seed spread that a Dirichlet
partition adds (often several points), and its mean over the seeds, with a t interval, says
whether one method is ahead by more than the seeds can explain; ``mean ± std`` columns side by
side cannot say that.

For each method and the baseline: the seeds where both runs finished with a finite final score,
did not diverge (:mod:`fedlore.results.divergence`) and trained on the same federation (equal
``data_fingerprint`` in their ``config.json``, when both recorded one); the mean difference
``method - baseline`` of the headline score (perplexity for language models, RMSE for
regression, else accuracy in points) and of the test NLL, each with its 95 % Student-t interval
``mean ± t(0.975, n-1) · sd / sqrt(n)`` (none with one seed); and on how many seeds the method
was better (ties are not). The other seeds either run has are left out and counted. The
interval assumes the differences are roughly normal; with three seeds it is wide, which is the
point.
"""

from __future__ import annotations

import json
import math
from typing import Any

from scipy import stats

from fedlore.registry import did_you_mean
from fedlore.results.store import RunRecord

HEADLINE = (
    ("final_perplexity", 1.0, "perplexity", False),
    ("final_rmse", 1.0, "RMSE", False),
    ("final_accuracy", 100.0, "acc. (points)", True),
)
"""``(summary key, scale, label, higher is better)``: the first the baseline's runs recorded is
compared (a language model's token accuracy is not its headline score: perplexity is)."""

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


def _score(record: RunRecord, key: str) -> float | None:
    """The run's final ``key`` when it counts: finished, not diverged, finite."""
    if record.summary.get("derived") or record.summary.get("diverged"):
        return None  # unfinished (its last round, not a final score) or blown up
    v = record.summary.get(key)
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _fingerprint(record: RunRecord) -> str | None:
    """The digest of the federation the run trained on (``config.json``), None if unrecorded."""
    try:
        raw = json.loads((record.path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    fp = raw.get("data_fingerprint") if isinstance(raw, dict) else None
    return fp if isinstance(fp, str) else None


def paired_stats(diffs: list[float]) -> tuple[float, float | None]:
    """Mean of ``diffs`` and the half-width of its :data:`LEVEL` Student-t interval (None for
    fewer than two differences)."""
    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    return mean, float(stats.t.ppf(0.5 + LEVEL / 2, n - 1)) * sd / math.sqrt(n)


def headline(records: list[RunRecord]) -> tuple[str, float, str, bool] | None:
    """The :data:`HEADLINE` entry ``records`` are compared by: the first they hold a score of."""
    found = [h for h in HEADLINE if any(_score(r, h[0]) is not None for r in records)]
    return found[0] if found else None


def paired_table(runs: dict[str, list[RunRecord]], baseline: str) -> list[dict[str, Any]]:
    """Each row of ``runs`` but the baseline's against it, seed by seed.

    Args:
        runs: label -> runs over seeds (:func:`~fedlore.results.store.split_by_config`).
        baseline: a label of ``runs``, or a method with one row (:func:`baseline_label`).

    Returns:
        Per row: ``method``, ``key`` and ``label`` of the headline score, ``higher_better``,
        ``paired`` (seeds compared), ``left_out`` (seeds of either run without a pair, sorted),
        ``delta`` and ``ci`` (mean difference and interval half-width, in the scale of
        :data:`HEADLINE`), ``better`` and ``ties`` (seeds where the row is better, equal),
        ``paired_nll``, ``delta_nll`` and ``ci_nll``. An empty list when no row is of
        ``baseline``, it has no score, or it is the only row.
    """
    label = baseline_label(runs, baseline)
    if label is None:
        return []
    base = {r.seed: r for r in runs[label]}
    found = headline(list(base.values()))
    if found is None:
        return []
    key, scale, name, higher = found
    table = []
    for method, records in runs.items():
        if method == label:
            continue
        diffs, nll, used = [], [], []
        for r in records:
            other = base.get(r.seed)
            if other is None:
                continue
            mine, theirs = _score(r, key), _score(other, key)
            a, b = _fingerprint(r), _fingerprint(other)
            if mine is None or theirs is None or (a is not None and b is not None and a != b):
                continue
            used.append(r.seed)
            diffs.append((mine - theirs) * scale)
            a_nll, b_nll = _score(r, "final_loss"), _score(other, "final_loss")
            if a_nll is not None and b_nll is not None:
                nll.append(a_nll - b_nll)
        row: dict[str, Any] = {
            "method": method,
            "key": key,
            "label": name,
            "higher_better": higher,
            "paired": len(diffs),
            "left_out": sorted(({r.seed for r in records} | set(base)) - set(used)),
            "delta": None,
            "ci": None,
            "better": sum(1 for d in diffs if (d > 0 if higher else d < 0)),
            "ties": sum(1 for d in diffs if d == 0),
            "paired_nll": len(nll),
            "delta_nll": None,
            "ci_nll": None,
        }
        if diffs:
            row["delta"], row["ci"] = paired_stats(diffs)
        if nll:
            row["delta_nll"], row["ci_nll"] = paired_stats(nll)
        table.append(row)
    return table


def _fmt(x: float, points: bool) -> str:
    return f"{x:+.2f}" if points else f"{x:+.3g}"  # NLL, perplexity, RMSE: 3 significant digits


def _cells(mean: float | None, half: float | None, points: bool) -> tuple[str, str]:
    if mean is None:
        return "–", "–"
    if half is None:
        return _fmt(mean, points), "–"
    return _fmt(mean, points), f"[{_fmt(mean - half, points)}, {_fmt(mean + half, points)}]"


def paired_markdown(table: list[dict[str, Any]], baseline: str) -> str:
    """:func:`paired_table` as a Markdown table, with a sentence on how to read it."""
    if not table:
        return ""
    name, ci = table[0]["label"], f"{LEVEL:.0%} CI"
    points = table[0]["key"] == "final_accuracy"
    lines = [
        f"| method | seeds paired | Δ {name} | {ci} | better on | Δ NLL | {ci} |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table:
        delta, ci_cell = _cells(row["delta"], row["ci"], points)
        dn, cn = _cells(row["delta_nll"], row["ci_nll"], False)
        if row["delta_nll"] is not None and row["paired_nll"] != row["paired"]:
            dn += f" ({row['paired_nll']} seeds)"
        left = row["left_out"]
        paired = str(row["paired"]) + (f" ({len(left)} left out)" if left else "")
        better = "–"
        if row["paired"]:
            better = f"{row['better']} of {row['paired']}"
            better += f" ({row['ties']} tied)" if row["ties"] else ""
        lines.append(
            f"| {row['method']} | {paired} | {delta} | {ci_cell} | {better} | {dn} | {cn} |"
        )
    direction = "higher" if table[0]["higher_better"] else "lower"
    return (
        "\n".join(lines)
        + f"\n\nΔ = method − {baseline} on the same seed (same partition, initialization and "
        "sampling), averaged over the seeds both runs finished; the interval is Student's t at "
        f"{LEVEL:.0%} (none with one seed). An interval that excludes 0 is a difference the "
        f"seeds do not explain. Better: {direction} {name} (better on counts these seeds; "
        "ties are not better); for the test NLL lower is better. Left out: the seeds either "
        "run lacks, has not finished or diverged on, or that trained on other data (a "
        "different data fingerprint).\n"
    )


def section(runs: dict[str, list[RunRecord]], baseline: str) -> str:
    """The report's ``## Paired against <baseline>`` section for one experiment: the table,
    or one line saying why there is none (no such row, its runs split by config, no other
    method, no finished score)."""
    head = f"## Paired against {baseline}\n\n"
    try:
        label = baseline_label(runs, baseline)
    except ValueError as e:
        return head + f"{str(e).removeprefix(f'--baseline {baseline}: ').capitalize()}.\n\n"
    if label is None:
        return head + f"No row {baseline} here (rows: {', '.join(runs)}).\n\n"
    if len(runs) == 1:
        return head + f"{label} is the only row here: nothing to compare with it.\n\n"
    table = paired_table(runs, baseline)
    if not table:
        return head + f"No finished run of {label} has a final score here.\n\n"
    return head + paired_markdown(table, label) + "\n"


def unknown_baseline(baseline: str, labels: list[str]) -> str:
    """The message for a baseline no experiment has."""
    methods = sorted({label.split(" [", 1)[0] for label in labels})
    rows = sorted(set(labels) - set(methods))
    return (
        f"--baseline {baseline}: no runs of it here{did_you_mean(baseline, [*methods, *rows])}; "
        f"the methods here: {', '.join(methods)}"
        + (f"; rows of split configs: {', '.join(rows)}" if rows else "")
    )


class NoBaselineWarning(UserWarning):
    """``fedlore report --baseline M`` over several experiments, some without runs of ``M``:
    their reports have no paired table (:func:`missing_baseline` names them)."""


def missing_baseline(baseline: str, lacking: list[str], experiments: int) -> str:
    """The one line naming the experiments (of ``experiments``) with no runs of ``baseline``."""
    return (
        f"--baseline {baseline}: no runs of it in {len(lacking)} of the {experiments} "
        f"experiments, so their reports compare nothing with it: {', '.join(lacking)}"
    )
