"""The report's early-stopping section (``early_stopping``, :mod:`fedlore.engine.early_stopping`):
for every run whose summary records it, the metric watched, the round the run stopped after, its
best round and value, and whether its final values are that round's (``restore_best``)."""

from __future__ import annotations

from fedlore.results.store import RunRecord


def early_stopping_markdown(runs: dict[str, list[RunRecord]]) -> str:
    """A Markdown table with one line per run that watched a metric (empty when none did):
    ``stopped`` is the round it stopped after (``–``: it ran every round), ``best`` its best
    round (rounds count from 0), ``final`` which round the summary's ``final_*`` are of."""
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
            lines.append(
                f"| {label} | {r.seed} | {metric}{note} | {_round(stopped)} | {_round(best)} | "
                f"{'–' if value is None else f'{value:.4g}'} | {_round(final)} |"
            )
    if not lines:
        return ""
    head = (
        "| method | seed | metric | stopped after round | best round | best value | "
        "final values of round |\n|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(lines) + "\n"


def _round(v: object) -> str:
    return "–" if v is None else str(v)
