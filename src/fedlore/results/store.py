"""Reading finished runs back from disk.

Layout (written by the engine's metrics callback)::

    <output_dir>/<experiment>/<method>/seed-<s>/metrics.jsonl   one JSON object per round
    <output_dir>/<experiment>/<method>/seed-<s>/summary.json    totals for the run

A metrics row has at least ``round`` (int, 0-based), ``loss``, ``bytes_up`` and ``bytes_down``
(bytes, summed over the round's clients), ``optimizer_state_bytes`` (bytes, per client) and
``wall_s`` (seconds for the round); ``accuracy`` (fraction in [0, 1]) is absent or null on
rounds without evaluation. A summary has at least ``method``, ``seed``, ``final_accuracy``,
``best_accuracy``, ``bytes_up_total``, ``bytes_down_total``, ``optimizer_state_bytes``,
``wall_s_per_round`` and ``rounds``.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlore.config_unset import FOLDERS_RECORD, same_folder
from fedlore.results.config_labels import differing, group_labels
from fedlore.results.failed_runs import FAILED, describe, read_failure
from fedlore.results.folders import (
    SEED_DIR,
    UnreadableFolderWarning,
    is_experiment_dir,
    linked_folders,
    regular_file,
    special_file,
    subfolders,
    unreadable,
)
from fedlore.results.summary import derive_summary, lm_summary, replayed_stopping, value
from fedlore.results.typed import distrust, not_finite, written_by_fedlore

# derive_summary, lm_summary and value live in results/summary.py (the one place summaries are
# computed); they are importable from here as before
__all__ = [
    "PLATFORM_KEYS",
    "RECORD_KEYS",
    "IncompleteRunWarning",
    "NoFedloreRunError",
    "RunRecord",
    "UnreadableFolderWarning",
    "derive_summary",
    "is_experiment_dir",
    "lm_summary",
    "load_runs",
    "read_rows",
    "run_config",
    "split_by_config",
    "value",
]

PLATFORM_KEYS = ("ran_fedlore", "ran_torch", "ran_numpy", "ran_cpu", "ran_gpu")
"""``fedlore.device.PLATFORM_KEYS``, spelled here so that reading results needs no torch."""


class IncompleteRunWarning(UserWarning):
    """A run directory is incomplete (missing or unreadable files) and was skipped or repaired."""


class NoFedloreRunError(FileNotFoundError):
    """An experiment folder whose run folders all hold another tool's ``summary.json``
    (:func:`load_runs`): no fedlore run to report."""


class _NotFedlore(Exception):
    """A run folder whose ``summary.json`` holds none of the keys fedlore writes
    (:func:`fedlore.results.typed.written_by_fedlore`)."""

    def __init__(self, path: Path, note: str) -> None:
        super().__init__(note)
        self.path, self.note = path, note


@dataclass(frozen=True)
class RunRecord:
    """One run (one method, one seed) read from disk.

    Attributes:
        seed: the seed from the ``seed-<s>`` directory name.
        rows: metrics rows sorted by ``round`` (may be empty when only a summary exists).
        summary: the run's ``summary.json``, or one derived from ``rows`` (then
            ``summary["derived"]`` is True).
        path: the run directory.
    """

    seed: int
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    path: Path = field(default_factory=Path)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` file; unreadable lines (e.g. a truncated last line) are skipped
    with an :class:`IncompleteRunWarning`. Rows are returned sorted by ``round``."""
    rows: list[dict[str, Any]] = []
    for i, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:  # a line of bytes that are not UTF-8 (a damaged file) is as unreadable as bad JSON
            row = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            warnings.warn(
                f"{path}:{i}: skipping unreadable line ({e})", IncompleteRunWarning, stacklevel=2
            )
            continue
        if not isinstance(row, dict) or not isinstance(row.get("round"), int):
            warnings.warn(
                f"{path}:{i}: skipping a row without an int 'round'",
                IncompleteRunWarning,
                stacklevel=2,
            )
            continue
        rows.append(row)
    return sorted(rows, key=lambda r: int(r["round"]))


def _recorded(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``config.json`` (None when it is missing, cannot be read or is no regular
    file: :func:`fedlore.results.folders.regular_file`)."""
    if not regular_file(run_dir / "config.json"):
        return None
    try:
        raw = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _eval_metrics(recorded: dict[str, Any] | None) -> list[str]:
    """The run's ``eval.metrics``, from its ``config.json`` (none when it cannot be read)."""
    try:
        names = (recorded or {})["eval"]["metrics"]
    except (KeyError, TypeError):
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _load_run(method: str, seed: int, run_dir: Path) -> RunRecord | None:
    if {p.name for p in run_dir.iterdir()} == {"run.lock"}:  # a folder a run reserved only
        return None
    metrics_path, summary_path = run_dir / "metrics.jsonl", run_dir / "summary.json"
    _check_fedlore(summary_path, metrics_path)  # before anything is said of the folder
    if special_file(metrics_path):  # a link (to /proc/self/mem, ...) or a FIFO: never read
        warnings.warn(
            f"{metrics_path}: {NOT_REGULAR}, not read; the run has no metrics rows",
            IncompleteRunWarning,
            stacklevel=3,
        )
    rows = read_rows(metrics_path) if regular_file(metrics_path) else []
    summary: dict[str, Any] | None = None
    recorded = _recorded(run_dir)
    if regular_file(summary_path):
        try:
            loaded = json.loads(summary_path.read_text())
            summary = loaded if isinstance(loaded, dict) and loaded else None  # {}: no summary
        except (json.JSONDecodeError, UnicodeDecodeError):  # torn, or bytes that are not UTF-8
            loaded = None
        if loaded is not None and summary is None and recorded is None:
            warnings.warn(  # nothing says which run or config it is: no row of its own
                f"{run_dir}: an incomplete run, left out: its summary.json holds no summary "
                f"({json.dumps(loaded)[:20]}) and it has no readable config.json",
                IncompleteRunWarning,
                stacklevel=3,
            )
            return None
        if summary is not None and (wrong := distrust(summary, method, seed, rows, recorded,
                                                      _eval_metrics(recorded))):  # fmt: skip
            warnings.warn(f"{summary_path}: {wrong}", IncompleteRunWarning, stacklevel=3)
        if summary is not None and (nan := not_finite(summary, rows)):  # a "–" that says why
            warnings.warn(f"{summary_path}: {nan}", IncompleteRunWarning, stacklevel=3)
        if summary is not None and (other := _of_another_run(summary, method, seed)) is not None:
            warnings.warn(  # its rows are the other run's too: no row of them under this name
                f"{summary_path}: the summary of {other}, not of {method} seed {seed} (copied "
                "from another folder?); leaving the run out",
                IncompleteRunWarning,
                stacklevel=3,
            )
            return None
    if summary is None:  # one warning says what is wrong and what the report does instead
        special = special_file(summary_path)
        damaged = summary_path.is_file() or special
        what = f"{summary_path}: unreadable" if damaged else f"{run_dir}: no summary.json"
        if special:  # counted as damaged: never read
            what = f"{summary_path}: {NOT_REGULAR}, not read"
        if not rows:
            warnings.warn(
                f"{what} and no metrics rows; skipping the run", IncompleteRunWarning, stacklevel=3
            )
            return None
        extra = _eval_metrics(recorded)
        summary = derive_summary(method, seed, rows, extra)
        # early stopping: its rule replayed, with restore_best the kept round's final values
        replayed_stopping(summary, rows, (recorded or {}).get("early_stopping"), extra)
        kept = (
            f" (its final values those of round {summary['best_round']}, the best round its "
            "early stopping keeps, replayed from config.json)"
            if summary.get("restored_best")
            else ""
        )
        warnings.warn(
            f"{what}{'' if damaged else ' (unfinished run?)'}; deriving the run from its "
            f"{len(rows)} metrics rows{kept}",
            IncompleteRunWarning,
            stacklevel=3,
        )
        if damaged:  # finished, perhaps, but its summary cannot be read
            summary["unreadable_summary"] = True
    elif not rows:
        warnings.warn(
            f"{run_dir}: no metrics rows; the run appears in tables but not in plots",
            IncompleteRunWarning,
            stacklevel=3,
        )
    elif _lacks_final_accuracy(summary, rows):
        warnings.warn(
            f"{summary_path}: no final_accuracy number although its rounds were scored "
            "(edited or damaged?); the run is left out of the final accuracy column",
            IncompleteRunWarning,
            stacklevel=3,
        )
    if rows and (short := _rows_short(summary, rows)) is not None:
        warnings.warn(
            f"{metrics_path}: {short} (cut or edited?); the run's table row is its summary's, "
            "but its curves and plots are incomplete",
            IncompleteRunWarning,
            stacklevel=3,
        )
    return RunRecord(seed=seed, rows=rows, summary=summary, path=run_dir)


def _check_fedlore(summary_path: Path, metrics_path: Path) -> None:
    """Raise :class:`_NotFedlore` when ``summary_path`` holds a JSON object with keys, none of
    them one fedlore writes (another tool's ``{"acc": 0.9}``); an unreadable or empty summary is
    a fedlore run's damage, said by :func:`_load_run`."""
    if not regular_file(summary_path):
        return
    try:
        summary = json.loads(summary_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return
    if not isinstance(summary, dict) or not summary:
        return
    if any(written_by_fedlore(k) for k in summary):
        return
    keys = ", ".join(sorted(summary)[:4]) + (", ..." if len(summary) > 4 else "")
    raise _NotFedlore(
        summary_path,
        f"{summary_path}: not a fedlore run, left out: its summary holds none of the keys "
        f"fedlore writes ({keys})"
        + ("; remove it to derive the run from its metrics rows" if metrics_path.is_file() else ""),
    )


NOT_REGULAR = "a symbolic link or special file, not a regular file"
"""What a run's file that :func:`fedlore.results.folders.regular_file` refuses is called."""


def _of_another_run(summary: dict[str, Any], method: str, seed: int) -> str | None:
    """``"<method> seed <s>"`` when ``summary`` names another method or seed than its folder's
    (None when it names these, or none)."""
    named = (summary.get("method", method), summary.get("seed", seed))
    return None if named == (method, seed) else f"{named[0]} seed {named[1]}"


def _rows_short(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str | None:
    """What a finished run's rows lack against the rounds its summary counts (each of rounds
    0 .. rounds-1 once), as words; None when they hold them all or the summary counts none."""
    rounds = summary.get("rounds")
    if summary.get("derived") or not isinstance(rounds, int) or isinstance(rounds, bool):
        return None
    have = [int(r["round"]) for r in rows if 0 <= int(r["round"]) < rounds]
    if len(set(have)) < rounds:
        return f"rows of {len(set(have))} of the {rounds} rounds its summary counts"
    if len(have) > rounds:
        return f"a round twice among the {rounds} rounds its summary counts"
    return None


def _lacks_final_accuracy(summary: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    """A finished run's summary without a finite ``final_accuracy`` while its last evaluated
    round has one (a diverged run's is not a score: it says so itself)."""
    if summary.get("diverged") or summary.get("derived"):
        return False
    scored = [r["accuracy"] for r in rows if isinstance(r.get("accuracy"), int | float)]
    v = summary.get("final_accuracy")
    finite = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    return bool(scored) and math.isfinite(scored[-1]) and not finite


RECORD_KEYS = (
    "name", "data_fingerprint", FOLDERS_RECORD, "ran_on", "ran_threads", "hyper", *PLATFORM_KEYS,
)  # fmt: skip
"""``config.json`` keys that record a run rather than set it (``name``: the folder's, which a
copy under another name keeps; the data fingerprint differs from seed to seed; ``hyper``
repeats the method's settings; ``data_folders`` names the folders of ``data.root`` and
``data.tokenizer``, which :func:`run_config` holds in their place; ``ran_*``: where and how it
ran)."""


def _flat(tree: dict[str, Any]) -> dict[str, Any]:
    """A ``config.json`` as dotted keys (``method`` and empty sections kept whole)."""
    out: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and k != "method" and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(tree, "")
    return out


@functools.cache
def _defaults() -> dict[str, Any]:
    """The default config, flattened: a setting added to fedlore after a run was made is
    missing from its ``config.json`` and was, in effect, at its default."""
    from fedlore.config import Config  # lazily: pydantic models, only for reports

    return _flat(Config().model_dump(mode="json"))


EVAL_ONLY = ("eval.metrics",)
"""Settings that add scores to the rows without changing what a run trains: runs that differ
only in them are one group of :func:`split_by_config`."""


def run_config(record: RunRecord) -> dict[str, Any] | None:
    """The settings a run was made with (its ``config.json`` without :data:`RECORD_KEYS`,
    flattened to dotted keys, a setting it lacks at its default; ``data.root`` and
    ``data.tokenizer`` as the folders they name, :func:`fedlore.config_unset.same_folder`), or
    None when it has none or it cannot be read."""
    path = record.path / "config.json"
    if not regular_file(path):
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict):
        return None
    out = {**_defaults(), **_flat({k: v for k, v in raw.items() if k not in RECORD_KEYS})}
    same_folder(out, raw.get(FOLDERS_RECORD))  # data.root=good/, /home/me/good: one folder
    return out


def config_group(record: RunRecord) -> tuple[str, dict[str, Any] | None]:
    """The group of :func:`split_by_config` a run belongs to: its settings without
    :data:`EVAL_ONLY` (None when unreadable) and their JSON text, equal for runs of one group."""
    cfg = run_config(record)
    if cfg is not None:
        cfg = {k: v for k, v in cfg.items() if k not in EVAL_ONLY}
    return json.dumps(cfg, sort_keys=True, default=str), cfg


PER_METHOD = ("method", "dp_noise_multiplier")
"""``config.json`` keys that hold the run's own method's settings (``method``: its overrides;
``dp_noise_multiplier``: σ as solved from the shared ``dp.*`` settings for the method's
exchanges, its setup exchanges among them): the methods compared under one name differ in them
by design, so they never mark rows of different methods (:func:`split_by_config`)."""


def split_by_config(runs: dict[str, list[RunRecord]]) -> dict[str, list[RunRecord]]:
    """The runs of each method grouped by the settings they were made with: runs of different
    configs left under one experiment name are never pooled. A method whose runs all share one
    config keeps its name; otherwise each group is named ``method [key=value, ...]`` by the keys
    that differ between its groups (runs without a readable config form a group
    ``method [config unknown]``; ``fedlore.results.config_labels``). Methods
    run with different shared settings (another data set, other rounds: two commands under one
    ``name``) are marked the same way, every row by the settings outside :data:`PER_METHOD`
    that differ between the methods' runs, so rows of different experiments never sit side by
    side as if comparable. A setting a run's record lacks counts at its default, and the
    settings of :data:`EVAL_ONLY` do not split."""
    grouped: dict[str, dict[str, list[RunRecord]]] = {}
    configs: dict[str, dict[str, Any] | None] = {}
    for method, records in runs.items():
        groups = grouped.setdefault(method, {})
        for r in records:
            key, cfg = config_group(r)
            groups.setdefault(key, []).append(r)
            configs[key] = cfg
    every = [c for groups in grouped.values() for k in groups if (c := configs[k]) is not None]
    across = differing(every, PER_METHOD) if len(grouped) > 1 else set()
    out: dict[str, list[RunRecord]] = {}
    for method, groups in grouped.items():
        if len(groups) == 1 and not across:
            out[method] = runs[method]
            continue
        labels = group_labels(method, {k: configs[k] for k in groups}, across)
        for key, members in groups.items():
            out[labels[key]] = sorted(members, key=lambda r: r.seed)
    return out


def load_runs(exp_dir: Path) -> dict[str, list[RunRecord]]:
    """Load every run of one experiment.

    Args:
        exp_dir: ``<output_dir>/<experiment>``, holding ``<method>/seed-<s>/`` directories.

    Returns:
        method name (the directory name) -> runs sorted by seed; methods sorted by name.
        Incomplete runs are repaired (summary derived from metrics) or skipped, each with an
        :class:`IncompleteRunWarning`; a run that failed under ``--keep-going``
        (:mod:`fedlore.results.failed_runs`) is left out with one, and so are run folders of
        another tool (a ``summary.json`` without any key fedlore writes).

    Raises:
        NoFedloreRunError: if every run folder of ``exp_dir`` is another tool's (then nothing
            is said of each).
        FileNotFoundError: if ``exp_dir`` does not exist or holds no readable run.
    """
    exp_dir = Path(exp_dir)
    if not exp_dir.is_dir():
        raise FileNotFoundError(f"experiment directory not found: {exp_dir}")
    runs: dict[str, list[RunRecord]] = {}
    foreign: list[tuple[Path, str]] = []
    failed: list[str] = []  # runs of fedlore run --keep-going that raised
    links = linked_folders(exp_dir)
    for method_dir in subfolders(exp_dir):  # no symbolic link is followed (results.folders)
        records = []
        links += [p for p in linked_folders(method_dir) if SEED_DIR.match(p.name)]
        for run_dir in subfolders(method_dir):
            m = SEED_DIR.match(run_dir.name)
            if m is None:
                continue
            failure = read_failure(run_dir)
            if failure is not None:  # --keep-going's: cut short, never pooled with finished runs
                warnings.warn(
                    f"{run_dir}: {describe(failure)}; left out of the table ({FAILED} holds its "
                    "traceback; `fedlore run ... --resume` retries it)",
                    IncompleteRunWarning,
                    stacklevel=2,
                )
                failed.append(f"{method_dir.name} seed {m.group(1)}")
                continue
            try:
                record = _load_run(method_dir.name, int(m.group(1)), run_dir)
            except OSError as e:  # a run folder or file this user cannot read
                unreadable(run_dir, e)
                continue
            except _NotFedlore as e:  # said below, once it is known whether any run is fedlore's
                foreign.append((e.path, e.note))
                continue
            if record is not None:
                records.append(record)
        if records:
            runs[method_dir.name] = sorted(records, key=lambda r: r.seed)
    if links:
        shown = ", ".join(str(p.relative_to(exp_dir)) for p in links[:4])
        warnings.warn(
            f"{exp_dir}: {len(links)} symbolic link(s) to folders not followed ({shown}"
            f"{', ...' if len(links) > 4 else ''}); report the folders they point to",
            UnreadableFolderWarning,
            stacklevel=2,
        )
    if not runs and foreign:
        raise NoFedloreRunError(
            f"report: {exp_dir} holds no fedlore run: the summary.json of its "
            f"{len(foreign)} run folder(s) holds none of the keys fedlore writes (method, seed, "
            f"final_accuracy, ...), e.g. {foreign[0][0]}; give a folder fedlore "
            "wrote (output_dir/<name>)"
        )
    for _, note in foreign:
        warnings.warn(note, IncompleteRunWarning, stacklevel=2)
    if not runs and failed:
        raise FileNotFoundError(
            f"no finished run in {exp_dir}: every run failed ({', '.join(failed)}; each "
            f"folder's {FAILED} says why); `fedlore run ... --resume` retries them after a fix"
        )
    if not runs:
        raise FileNotFoundError(
            f"no runs found in {exp_dir}: expected <method>/seed-<s>/metrics.jsonl "
            "(and summary.json) below it"
        )
    return runs
