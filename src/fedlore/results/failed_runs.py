"""The runs of an experiment that failed under ``fedlore run --keep-going``, as a report names
them.

A failed run's folder holds :data:`FAILED` (written by :mod:`fedlore.engine.failed`: the
error's type, message, round and traceback) and no ``summary.json``. The report leaves it out of
the table, whose means would otherwise pool a run cut short with finished ones, and names it:
one warning line per failed run (:func:`fedlore.results.store.load_runs`) and a line under the
table of ``report.md`` (:func:`failed_note`); the seeds cell of the row it would have joined says
``2 (+1 failed)`` (:func:`failed_per_row`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedlore.results.folders import SEED_DIR, subfolders

FAILED = "failed.json"
"""The record of a failed run in its folder (:mod:`fedlore.engine.failed`)."""


def read_failure(folder: Path) -> dict[str, Any] | None:
    """The :data:`FAILED` record of ``folder`` while it holds no finished run (a run that
    finished since has no failure); None without one, or when it is no readable JSON object."""
    path = folder / FAILED
    if (folder / "summary.json").exists() or not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def describe(raw: dict[str, Any]) -> str:
    """A failure record in words: ``failed at round R (Type: message)``."""
    rnd = raw.get("round")
    at = "" if rnd is None else f" at round {rnd}"
    return f"failed{at} ({raw.get('error', 'error')}: {raw.get('message', '')})"


def failed_note(failed: list[tuple[str, int, dict[str, Any]]]) -> str:
    """The line ``report.md`` gives the failed runs (``(method, seed, record)``, in order);
    empty without any."""
    if not failed:
        return ""
    named = "; ".join(f"{m} seed {s} {describe(raw)}" for m, s, raw in failed)
    return (
        f"Failed runs, left out of the table ({len(failed)}; `fedlore run ... --resume` retries "
        f"them, each folder's {FAILED} holds the traceback): {named}.\n\n"
    )


def failed_runs(exp_dir: Path) -> list[tuple[str, int, dict[str, Any]]]:
    """``(method, seed, record)`` of every failed run of the experiment folder ``exp_dir``
    (:func:`read_failure`), by method and seed; folders that cannot be read are left to the
    report's own warnings."""
    out = []
    try:
        for method_dir in subfolders(exp_dir):
            for run_dir in subfolders(method_dir):
                m = SEED_DIR.match(run_dir.name)
                if m is not None and (raw := read_failure(run_dir)) is not None:
                    out.append((method_dir.name, int(m.group(1)), raw))
    except OSError:
        return out
    return sorted(out, key=lambda f: (f[0], f[1]))


def failed_per_row(
    failed: list[tuple[str, int, dict[str, Any]]],
    rows: dict[str, list[Path]],
    exp_dir: Path,
    group: Callable[[Path], str],
) -> dict[str, int]:
    """How many failed runs each table row would have held: ``rows`` maps a row's label (a
    method, or ``method [key=value, ...]`` when its runs were made with different settings) to
    its run folders, and ``group`` gives a run folder's settings group
    (:func:`fedlore.results.store.config_group`). A failed run counts for the row of its own
    method whose runs share its settings; one made with settings no finished run has counts for
    none (the note under the table names it all the same)."""
    counts: dict[str, int] = {}
    for method, seed, _ in failed:
        key = group(exp_dir / method / f"seed-{seed}")
        for label, folders in rows.items():
            mine = label == method or label.startswith(f"{method} [")
            if mine and folders and group(folders[0]) == key:
                counts[label] = counts.get(label, 0) + 1
                break
    return counts
