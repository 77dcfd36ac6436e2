"""The report's early-stopping section (``early_stopping``, :mod:`fedlore.engine.early_stopping`):
for every run whose summary records it, the metric watched, the round the run stopped after, its
best round and value, and whether its final values are that round's (``restore_best``)."""

from __future__ import annotations

from typing import Any

from fedlore.results.store import RunRecord

RUN_COLUMNS = [
    "early_stopping_metric",
    "stopped_round",
    "best_round",
    "restored_best",
    "dp_audit_epsilon_low",
    "dp_audit_epsilon_high",
    "dp_audit_epsilon_all_iterates_low",
    "dp_audit_epsilon_all_iterates_high",
]
"""Summary keys of each run that ``report.csv`` carries as they are, not as a statistic over
seeds (:func:`run_cells`): early stopping's outcome (with ``best_<metric>``, a column per
watched metric) and the canary audit's confidence intervals."""


def run_cells(records: list[RunRecord]) -> dict[str, Any]:
    """The :data:`RUN_COLUMNS` cells of one report row, and ``best_<metric>`` for each metric
    its runs watched (:func:`per_run`)."""
    cells = {key: per_run(records, key) for key in RUN_COLUMNS}
    watched = {m for r in records if isinstance(m := r.summary.get("early_stopping_metric"), str)}
    return cells | {f"best_{m}": per_run(records, f"best_{m}") for m in sorted(watched)}


def per_run(records: list[RunRecord], key: str) -> str | None:
    """The summary value ``key`` of each run of a report row as one cell: None (an empty cell)
    when no run has one; the value when every run has the same (one seed's, say); else each
    run's in seed order, separated by spaces, ``null`` for a run without one. Numbers at full
    precision (``inf`` for an infinite estimate), booleans ``true`` / ``false``."""
    values = [r.summary.get(key) for r in sorted(records, key=lambda r: r.seed)]
    if all(v is None for v in values):
        return None
    words = [_word(v) for v in values]
    return words[0] if len(set(words)) == 1 else " ".join(words)


def _word(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)  # a float at full precision (repr), inf as "inf"


def early_stopping_markdown(runs: dict[str, list[RunRecord]]) -> str:
    """A Markdown table with one line per run that watched a metric (empty when none did):
    ``stopped`` is the round it stopped after (``–``: it ran every round), ``best`` its best
    round (rounds count from 0), ``final`` which round the summary's ``final_*`` are of. A
    seed marked ``(derived)`` has no readable ``summary.json``: its outcome is the rule replayed
    over ``metrics.jsonl`` (:func:`fedlore.results.summary.replayed_stopping`)."""
    lines = []
    for label, records in runs.items():
        for r in sorted(records, key=lambda r: r.seed):
            s = r.summary
            metric = s.get("early_stopping_metric")
            if metric is None:
                continue
            stopped, best = s.get("stopped_round"), s.get("best_round")
            value = s.get(f"best_{metric}")
            last = int(s.get("rounds", 0)) - 1
            final = best if s.get("restored_best") else last
            note = " (test set)" if s.get("early_stopping_on_test") else ""
            derived = " (derived)" if s.get("early_stopping_derived") else ""
            lines.append(
                f"| {label} | {r.seed}{derived} | {metric}{note} | {_round(stopped)} | "
                f"{_round(best)} | {'–' if value is None else f'{value:.4g}'} | {_round(final)} |"
            )
    if not lines:
        return ""
    head = (
        "| method | seed | metric | stopped after round | best round | best value | "
        "final values of round |\n|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(lines) + "\n"


DERIVED_NOTE = (
    " A seed marked (derived) has no readable summary.json (missing or damaged): its rule was "
    "replayed over its metrics.jsonl with the settings of its config.json, and with "
    "`restore_best` its final values in the tables above are those of the best round it keeps."
)
"""The sentence under the early-stopping table when a seed's outcome was derived."""


def derived_note(runs: dict[str, list[RunRecord]]) -> str:
    """:data:`DERIVED_NOTE` when any run's early-stopping outcome was derived, else empty."""
    derived = any(r.summary.get("early_stopping_derived") for rs in runs.values() for r in rs)
    return DERIVED_NOTE if derived else ""


def _round(v: object) -> str:
    return "–" if v is None else str(v)
