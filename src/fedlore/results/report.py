"""``fedlore report``: for each experiment folder, write ``report.md``, ``report.csv`` and the PNG
plots of its finished (and unfinished) runs.

The statistics are :mod:`fedlore.results.tables`' (mean ± sample std over seeds), the Markdown
:mod:`fedlore.results.markdown`'s and the curves :mod:`fedlore.results.plots`'; this module finds
the experiments, titles the figures, writes the CSV and assembles the Markdown page. The names of
those modules that the report used to define are importable from here too.
"""

from __future__ import annotations

import csv
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlore import progress
from fedlore.atomic import remove_dead_shared_temps, replacing, write_text
from fedlore.results.failed_runs import failed_note, failed_per_row, failed_runs
from fedlore.results.folders import linked_folders, subfolders
from fedlore.results.markdown import (
    diagnostics_markdown,
    eval_metrics_markdown,
    seeds_cell,
    to_markdown,
)
from fedlore.results.paired import (
    NoBaselineWarning,
    baseline_label,
    missing_baseline,
    paired_table,
    section,
    unknown_baseline,
)
from fedlore.results.plots import plot
from fedlore.results.stopping import derived_note, early_stopping_markdown
from fedlore.results.store import (
    SEED_DIR,
    IncompleteRunWarning,
    NoFedloreRunError,
    RunRecord,
    config_group,
    is_experiment_dir,
    load_runs,
    run_config,
    split_by_config,
    value,
)
from fedlore.results.tables import (
    COLUMNS,
    DIAGNOSTIC_KEYS,
    FAIRNESS,
    diagnostics_table,
    eval_metrics_table,
    summary_table,
)

__all__ = [
    "COLUMNS",
    "DIAGNOSTIC_KEYS",
    "IncompleteRunWarning",
    "RunRecord",
    "diagnostics_markdown",
    "diagnostics_table",
    "load_runs",
    "plot",
    "report",
    "seeds_cell",
    "setting_title",
    "summary_table",
    "to_csv",
    "to_markdown",
]


PAIRED_COLUMNS = [
    "paired_baseline",
    "paired_score",
    "paired_seeds",
    "paired_left_out",
    "paired_delta",
    "paired_low",
    "paired_high",
    "paired_better",
    "paired_ties",
    "paired_nll_seeds",
    "paired_nll_delta",
    "paired_nll_low",
    "paired_nll_high",
]
"""The columns ``fedlore report --baseline`` adds to ``report.csv`` (:func:`paired_cells`)."""


FAIRNESS_NOTE = (
    " Worst client, client p10 and client spread (eval.clients): the global model's accuracy on "
    "each client's own test split, each client counted once: the worst client's, the 10th "
    "percentile and the sample std over the clients (points), per run, then mean ± std over "
    "seeds; – for runs that did not record them."
)
"""The sentence under the table when any row has the fairness columns."""


def paired_cells(row: dict[str, Any] | None, baseline: str) -> dict[str, Any]:
    """A :func:`~fedlore.results.paired.paired_table` row as :data:`PAIRED_COLUMNS` cells (the
    baseline's own row, ``row`` None, names the baseline only): the interval as its two ends,
    the left-out seeds joined by spaces; no interval with one seed."""
    cells: dict[str, Any] = dict.fromkeys(PAIRED_COLUMNS)
    cells["paired_baseline"] = baseline
    if row is None:
        return cells
    cells |= {
        "paired_score": row["key"],
        "paired_seeds": row["paired"],
        "paired_left_out": " ".join(str(s) for s in row["left_out"]),
        "paired_better": row["better"] if row["paired"] else None,
        "paired_ties": row["ties"] if row["paired"] else None,
        "paired_nll_seeds": row["paired_nll"],
    }
    for delta, low, high, mean, half in (
        ("paired_delta", "paired_low", "paired_high", row["delta"], row["ci"]),
        ("paired_nll_delta", "paired_nll_low", "paired_nll_high", row["delta_nll"], row["ci_nll"]),
    ):
        cells[delta] = mean
        if mean is not None and half is not None:
            cells[low], cells[high] = mean - half, mean + half
    return cells


def to_csv(
    table: list[dict[str, Any]],
    path: Path,
    metrics: tuple[list[str], list[dict[str, Any]]] = ([], []),
    paired: tuple[str, list[dict[str, Any]]] | None = None,
) -> None:
    """Write :func:`summary_table` rows to ``path`` with the :data:`COLUMNS` header; missing
    statistics are empty cells, numbers are written at full precision.

    ``metrics`` is :func:`eval_metrics_table`'s ``(keys, rows)``: each key adds the columns
    ``<key>_mean``, ``<key>_std`` and ``<key>_n`` (the seeds with a finite value), after
    :data:`COLUMNS`, joined to the summary rows by method. ``paired`` is ``(baseline row,
    paired_table rows)`` (``fedlore report --baseline``): :data:`PAIRED_COLUMNS` last, joined
    by method (the difference in the scale of :data:`fedlore.results.paired.HEADLINE`: points
    for accuracy)."""
    keys, rows = metrics
    extra = [f"{key}_{stat}" for key in keys for stat in ("mean", "std", "n")]
    # best_<metric> of each early-stopping metric a run watched (its row's runs' values)
    best = sorted({k for r in table for k in r if k.startswith("best_") and k not in COLUMNS})
    by_method = {r["method"]: r for r in rows}
    pairs = {r["method"]: r for r in paired[1]} if paired is not None else {}
    out = []
    for r in table:
        cells = {k: r.get(k) for k in [*COLUMNS, *best]}
        scored = by_method.get(r["method"], {})
        for key in keys:
            mean, std, n = scored.get(key, (None, None, 0))
            cells |= {f"{key}_mean": mean, f"{key}_std": std, f"{key}_n": n}
        if paired is not None:
            cells |= paired_cells(pairs.get(r["method"]), paired[0])
        out.append({k: "" if v is None else v for k, v in cells.items()})
    header = COLUMNS + extra + best + (PAIRED_COLUMNS if paired is not None else [])
    with replacing(path, "w", newline="", shared=True) as f:  # a failure leaves the old file
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(out)


def setting_title(name: str, runs: dict[str, list[RunRecord]]) -> str:
    """A figure title: the experiment ``name`` and the settings all its runs share, e.g.
    ``quickstart: digits, dirichlet α=0.5, 10 clients, 30 rounds, mlp``."""
    configs = [c for rs in runs.values() for r in rs if (c := run_config(r)) is not None]

    def shared(key: str) -> Any:
        vals = {json.dumps(c.get(key), default=str) for c in configs}
        return configs[0].get(key) if configs and len(vals) == 1 else None

    parts: list[str] = []
    if (data := shared("data.name")) is not None:
        parts.append(str(data))
    if (part := shared("partition.name")) is not None:
        alpha = shared("partition.alpha")
        parts.append(f"{part} α={alpha:g}" if part == "dirichlet" and alpha is not None else part)
    for key, unit in (("num_clients", "clients"), ("rounds", "rounds")):
        if (v := shared(key)) is not None:
            parts.append(f"{v} {unit}")
    if (p := shared("participation")) is not None and p != 1.0:
        parts.append(f"participation {p:g}")
    if (model := shared("model.name")) is not None:
        parts.append(str(model))
    return f"{name}: {', '.join(parts)}" if parts else name


def _report_file(name: str) -> bool:
    """Whether ``name`` is a file a report writes (``report.md``, ``report.csv``, a plot)."""
    return name in ("report.md", "report.csv") or name.endswith(".png")


def _report_experiment(
    exp_dir: Path,
    keys: Sequence[str] | None,
    write: bool = True,
    baseline: str | None = None,
    runs: dict[str, list[RunRecord]] | None = None,
    out: Path | None = None,
) -> str:
    """One experiment's report text; with ``write``, its files in ``out`` (default
    ``exp_dir``)."""
    out = exp_dir if out is None else out
    if runs is None:
        runs = split_by_config(load_runs(exp_dir))  # runs of different configs never pool
    table = summary_table(runs)
    failed = failed_runs(exp_dir)  # --keep-going's failures: named and counted, not pooled
    per_row = failed_per_row(
        failed,
        {label: [r.path for r in rs] for label, rs in runs.items()},
        exp_dir,
        lambda path: config_group(RunRecord(0, [], {}, path))[0],
    )
    for row in table:
        row["failed_runs"] = per_row.get(row["method"], 0)
    diag = diagnostics_table(runs)
    if keys is None:
        keys = [
            k
            for k in DIAGNOSTIC_KEYS
            if any(value(x, k) is not None for rs in runs.values() for r in rs for x in r.rows)
        ]
    metric_keys, metrics = eval_metrics_table(runs)
    pngs = []
    if write:
        out.mkdir(parents=True, exist_ok=True)
        gone = remove_dead_shared_temps(out, _report_file)  # what a killed report left
        if gone:
            progress.tell("removed what a killed write left in %s: %s", out, ", ".join(gone))
        pngs = plot(runs, out, keys=keys, title=setting_title(exp_dir.name, runs))
        to_csv(table, out / "report.csv", (metric_keys, metrics), _paired(runs, baseline))
    images = "\n\n".join(f"![{p.stem.replace('_', ' ')}]({p.name})" for p in pngs)
    held = {s for rs in runs.values() for r in rs if (s := r.summary.get("data_test_split"))}
    text = (
        f"# {exp_dir.name}\n\n{to_markdown(table)}\n"
        + failed_note(failed)
        + "".join(f"Test set: {s}.\n\n" for s in sorted(held))  # no test split of its own
        + "Mean ± sample std (ddof=1) over seeds (no ± with one seed); MB = 10^6 bytes, totals "
        "per run; optimizer state per client (moment tensors); client state the most one client "
        "keeps between rounds (control variates, personal layers, moments carried over; not "
        "measured under secure aggregation or DP); peak device memory (CUDA runs) the "
        "largest peak of one client's update; s / round without evaluation, from round 1 on; "
        "rejected client replies and skipped local steps (non-finite loss or gradient) per run. "
        "Seeds: unfinished runs (no summary yet) and runs whose summary cannot be read show their "
        "last written round (with early stopping's restore_best, the best round it keeps); "
        "diverged runs "
        "(a training loss gone non-finite, or test predictions not finite or blown up) are left "
        "out of the final values. Runs of different configs under one name get a row each, "
        "named by the settings that differ (between methods too, a method's own overrides "
        "aside)."
        + (
            FAIRNESS_NOTE
            if any(r.get(f"{c}_mean") is not None for r in table for c, _ in FAIRNESS)
            else ""
        )
        + "\n\n"
    )
    if baseline:
        text += section(runs, baseline)
    if metrics:
        text += (
            "## Evaluation metrics\n\n"
            f"{eval_metrics_markdown(metric_keys, metrics)}\n"
            "The runs' eval.metrics at their last evaluation (central test set; selection_ the "
            "selection split, client_ the clients' pooled test splits, local_ P-local: each "
            "client's own model on its test split, weighted by test size), mean ± std over "
            "seeds.\n\n"
        )
    stops = early_stopping_markdown(runs)
    if stops:
        text += (
            f"## Early stopping\n\n{stops}\n"
            "Rounds count from 0; a run stops after `early_stopping.patience` evaluations "
            "without an improvement of its metric; with `restore_best` its final values are "
            "those of its best round. A metric marked (test set) was watched on a test set the "
            f"report shows (allow_test): those scores are optimistic.{derived_note(runs)}\n\n"
        )
    if diag:
        text += (
            "## Diagnostics\n\n"
            f"{diagnostics_markdown(diag)}\n"
            "Each value is averaged over a run's measured rounds, then mean ± std over seeds; "
            "rounds, seconds and candidate-gradient MB uploaded are per run "
            "(see fedlore.diagnostics).\n\n"
        )
    if not write:
        return text
    text += f"{images}\n"
    write_text(out / "report.md", text, shared=True)  # each finishing run writes it
    return text


def _paired(
    runs: dict[str, list[RunRecord]], baseline: str | None
) -> tuple[str, list[dict[str, Any]]] | None:
    """The ``paired`` argument of :func:`to_csv`: None without a baseline, or when this
    experiment has no paired table against it (the Markdown's section says why)."""
    if not baseline:
        return None
    try:
        label = baseline_label(runs, baseline)
    except ValueError:
        return None  # its runs split by config: a row must be named
    rows = paired_table(runs, baseline) if label is not None else []
    return (label, rows) if label is not None and rows else None


@progress.command()  # a note on a folder it cannot read: once per report
def report(
    path: Path,
    keys: Sequence[str] | None = None,
    write: bool = True,
    baseline: str | None = None,
    out: Path | None = None,
) -> str:
    """Write ``report.md``, ``report.csv`` and the PNG plots for one or several experiments.

    Args:
        path: an experiment directory (``runs/quickstart``) or an output directory holding
            several experiments (``runs``); each experiment gets its own files.
        keys: extra numeric metrics-row keys to plot against the round (see :func:`plot`).
        write: False: write nothing, only return the text (without the plots' image links;
            ``fedlore report`` prints it when the folder cannot be written).
        baseline: a method (or a row label, when its runs split by config): each report gets a
            section comparing every other method with it seed by seed
            (:mod:`fedlore.results.paired`).
        out: where the files go instead of each experiment's own folder (one it cannot write:
            results shared read-only, say): ``out`` itself for an experiment folder, and
            ``out/<experiment>/`` for each experiment of an output folder. Nothing is written
            in ``path`` then.

    Returns:
        The Markdown text (experiments concatenated, in name order).

    Raises:
        FileNotFoundError: if ``path`` is missing or holds no runs.
        ValueError: if no experiment has runs of ``baseline``, or its runs split by config and
            it names none of the rows.
    """
    path = Path(path)
    if not path.is_dir():
        what = "not a directory" if path.exists() else "directory not found"
        raise FileNotFoundError(f"report: {what}: {path} (give an experiment's output folder)")
    if is_experiment_dir(path):
        experiments = [path]
    else:  # no symbolic link below path is followed, no unreadable folder stops the search
        experiments = [d for d in subfolders(path) if is_experiment_dir(d)]
    if not experiments:
        hint = ""
        if is_experiment_dir(path.parent) or SEED_DIR.match(path.name):  # a method's or a run's
            up = path.parent if is_experiment_dir(path.parent) else path.parent.parent
            kind = "a method's" if up == path.parent else "a run's"
            hint = f"; it is {kind} folder: report its experiment, `fedlore report {up}`"
        elif links := linked_folders(path):  # runs elsewhere: name the links left alone
            names = ", ".join(p.name for p in links[:4]) + (", ..." if len(links) > 4 else "")
            hint = (
                f"; symbolic links to folders are not followed ({names}): report the folder "
                "a link points to"
            )
        raise FileNotFoundError(
            f"report: no runs found in {path}: expected <experiment>/<method>/seed-<s>/ "
            f"or <method>/seed-<s>/ below it{hint}"
        )
    if out is not None:
        _check_out(Path(out), path, experiments)
    runs = _fedlore_experiments(path, experiments)
    experiments = list(runs)
    if baseline is not None:  # refused when no experiment has it (each says why it lacks it)
        problems, found, lacking = [], False, []
        for d, r in runs.items():
            try:
                label = baseline_label(r, baseline)
            except ValueError as e:  # its runs split by config there: name a row
                problems.append(str(e))
                continue
            found = found or label is not None
            if label is None:
                lacking.append(d.name)
        if not found:
            raise ValueError(
                problems[0]
                if problems
                else unknown_baseline(baseline, [k for r in runs.values() for k in r])
            )
        if lacking:  # one line, beside the reports, not only in each one's section
            warnings.warn(missing_baseline(baseline, lacking, len(runs)), NoBaselineWarning, 2)
    return "\n".join(
        _report_experiment(d, keys, write, baseline, runs[d], _out_of(d, path, out))
        for d in experiments
    )


def _fedlore_experiments(
    path: Path, experiments: list[Path]
) -> dict[Path, dict[str, list[RunRecord]]]:
    """The runs of each of ``experiments`` (:func:`load_runs`, split by config); below a folder
    of experiments, one that holds no fedlore run (another tool's folder) is left out with a
    note.

    Raises:
        NoFedloreRunError: when no experiment holds a fedlore run: one line naming ``path``.
    """
    if experiments == [path]:  # an experiment's own folder: its error is the one line
        return {path: split_by_config(load_runs(path))}
    runs, others = {}, []
    for d in experiments:
        try:
            runs[d] = split_by_config(load_runs(d))
        except NoFedloreRunError:
            others.append(d.name)
    if not runs:
        raise NoFedloreRunError(
            f"report: {path} holds no fedlore run: the summary.json files of its folders "
            f"({', '.join(others[:4])}{', ...' if len(others) > 4 else ''}) hold none of the "
            "keys fedlore writes; give a folder fedlore wrote (output_dir or output_dir/<name>)"
        )
    for name in others:
        warnings.warn(
            f"{path / name}: not a fedlore experiment, left out: the summary.json of each of its "
            "run folders holds none of the keys fedlore writes",
            IncompleteRunWarning,
            stacklevel=3,
        )
    return runs


def _check_out(out: Path, path: Path, experiments: list[Path]) -> None:
    """Refuse an ``--out`` whose report files would land among other results: another
    experiment's folder (its own report would be replaced), a folder inside a reported
    experiment's (among its method folders), or a run's folder or anything inside one.

    Raises:
        ValueError: naming ``out`` and what it is.
    """
    mine = {d.resolve() for d in experiments}
    for folder in (out, *out.parents):
        if (folder / "metrics.jsonl").is_file() or (folder / "summary.json").is_file():
            raise ValueError(f"report: --out {out} is inside the run folder {folder}: give a "
                             "folder of its own")  # fmt: skip
    targets = [out] if is_experiment_dir(path) else [out / d.name for d in experiments]
    for t in targets:
        inside = next((f for f in t.parents if f.resolve() in mine), None)
        if inside is not None:  # among the reported runs' folders (the folder itself is fine)
            raise ValueError(
                f"report: --out would write into {t}, inside the experiment folder {inside} "
                "(among its method folders): give a folder of its own, or leave --out out to "
                "write the experiment's own report"
            )
        for folder in (t, *t.parents):  # the experiment folder itself, or one of its folders
            if folder.is_dir() and is_experiment_dir(folder) and folder.resolve() not in mine:
                raise ValueError(
                    f"report: --out would write into {t}, in another experiment's folder "
                    f"{folder} (among its results; its own report.md would be replaced): give "
                    "a folder of its own"
                )


def _out_of(exp_dir: Path, path: Path, out: Path | None) -> Path | None:
    """Where :func:`report` writes ``exp_dir``'s files: its own folder (None), ``out`` when
    ``path`` is the experiment, else ``out/<experiment>``."""
    if out is None:
        return None
    return Path(out) if exp_dir == path else Path(out) / exp_dir.name
