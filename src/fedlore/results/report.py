"""``fedlore report``: mean ± std tables over seeds, CSV, Markdown and plots for finished runs.

Statistics are over seeds: the mean and the sample standard deviation (ddof=1) when there are
at least two seeds, else a std of 0. Accuracies are reported in percent, traffic in MB
(10^6 bytes), optimizer state in bytes (rendered as KB/MB), round time in seconds.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlore.atomic import replacing, write_text
from fedlore.results.plots import BYTES_PER_MB, mean_std, plot
from fedlore.results.store import (
    IncompleteRunWarning,
    RunRecord,
    is_experiment_dir,
    load_runs,
    run_config,
    split_by_config,
    value,
)

__all__ = [
    "COLUMNS",
    "IncompleteRunWarning",
    "RunRecord",
    "load_runs",
    "plot",
    "report",
    "summary_table",
    "to_csv",
    "to_markdown",
]

COLUMNS = [
    "method",
    "n_seeds",
    "final_accuracy_pct_mean",
    "final_accuracy_pct_std",
    "best_accuracy_pct_mean",
    "best_accuracy_pct_std",
    "mb_up_mean",
    "mb_down_mean",
    "optimizer_state_bytes_mean",
    "peak_memory_bytes_mean",
    "wall_s_per_round_mean",
    "wall_s_per_round_std",
    "rejected_total_mean",
    "skipped_steps_total_mean",
    "final_loss_mean",
    "final_loss_std",
    "final_perplexity_mean",
    "final_perplexity_std",
    "best_perplexity_mean",
    "final_ece_mean",
    "final_ece_std",
    "client_accuracy_pct_mean",
    "client_accuracy_pct_std",
    "local_accuracy_pct_mean",
    "local_accuracy_pct_std",
    "client_train_s_per_round_mean",
    "final_rmse_mean",
    "final_rmse_std",
    "client_rmse_mean",
    "local_rmse_mean",
    "dp_epsilon_mean",
    "dp_noise_multiplier_mean",
    "dp_clip_norm_mean",
    "dp_delta",
    "dp_clipped_total_mean",
    "no_privacy_runs",
]
"""Keys of every :func:`summary_table` row, in CSV column order (the perplexity columns are
empty for classifiers; ECE, G-local and P-local accuracy and client training time are empty for
runs that did not record them)."""


def _summary_values(records: list[RunRecord], key: str, scale: float = 1.0) -> list[float]:
    out = []
    for r in records:
        v = r.summary.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v) * scale)
    return out


def _stat(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return mean_std(values)


def summary_table(runs: dict[str, list[RunRecord]]) -> list[dict[str, Any]]:
    """One row per method with mean ± std over its seeds.

    Args:
        runs: method -> runs over seeds (from :func:`load_runs`).

    Returns:
        Rows with the keys in :data:`COLUMNS`: ``n_seeds``; final and best accuracy in percent
        (mean, std); final loss and perplexity (mean, std) and best perplexity (language
        models); final ECE, G-local accuracy (the global model on the clients' test splits,
        ``eval.clients``) and P-local accuracy (each client's own, personal or last local, model
        on its test split, ``eval.local``) in percent, and client training seconds per round
        where the runs recorded them; mean total MB up and down per run; mean per-client
        optimizer-state bytes; seconds per round (mean, std). A statistic is None when no seed
        reports it.
    """
    table = []
    for method, records in runs.items():
        final_m, final_s = _stat(_summary_values(records, "final_accuracy", 100.0))
        best_m, best_s = _stat(_summary_values(records, "best_accuracy", 100.0))
        wall_m, wall_s = _stat(_summary_values(records, "wall_s_per_round"))
        loss_m, loss_s = _stat(_summary_values(records, "final_loss"))
        ppl_m, ppl_s = _stat(_summary_values(records, "final_perplexity"))
        ece_m, ece_s = _stat(_summary_values(records, "final_ece"))
        local_m, local_s = _stat(_summary_values(records, "local_accuracy", 100.0))
        glocal_m, glocal_s = _stat(_summary_values(records, "final_client_accuracy", 100.0))
        rmse_m, rmse_s = _stat(_summary_values(records, "final_rmse"))
        table.append(
            {
                "method": method,
                "n_seeds": len(records),
                "final_accuracy_pct_mean": final_m,
                "final_accuracy_pct_std": final_s,
                "best_accuracy_pct_mean": best_m,
                "best_accuracy_pct_std": best_s,
                "mb_up_mean": _stat(_summary_values(records, "bytes_up_total", 1 / BYTES_PER_MB))[
                    0
                ],
                "mb_down_mean": _stat(
                    _summary_values(records, "bytes_down_total", 1 / BYTES_PER_MB)
                )[0],
                "optimizer_state_bytes_mean": _stat(
                    _summary_values(records, "optimizer_state_bytes")
                )[0],
                "peak_memory_bytes_mean": _stat(_summary_values(records, "peak_memory_bytes"))[0],
                "wall_s_per_round_mean": wall_m,
                "wall_s_per_round_std": wall_s,
                "rejected_total_mean": _stat(_summary_values(records, "rejected_total"))[0],
                "skipped_steps_total_mean": _stat(_summary_values(records, "skipped_steps_total"))[
                    0
                ],
                "final_loss_mean": loss_m,
                "final_loss_std": loss_s,
                "final_perplexity_mean": ppl_m,
                "final_perplexity_std": ppl_s,
                "best_perplexity_mean": _stat(_summary_values(records, "best_perplexity"))[0],
                "final_ece_mean": ece_m,
                "final_ece_std": ece_s,
                "client_accuracy_pct_mean": glocal_m,
                "client_accuracy_pct_std": glocal_s,
                "local_accuracy_pct_mean": local_m,
                "local_accuracy_pct_std": local_s,
                "client_train_s_per_round_mean": _stat(
                    _summary_values(records, "client_train_s_per_round")
                )[0],
                "diverged_runs": sum(
                    1
                    for r in records
                    if r.summary.get("diverged")
                    or ("final_perplexity" in r.summary and r.summary["final_perplexity"] is None)
                ),
                "unfinished_runs": sum(1 for r in records if r.summary.get("derived")),
                "language_model": any("final_perplexity" in r.summary for r in records),
                "final_rmse_mean": rmse_m,
                "final_rmse_std": rmse_s,
                "client_rmse_mean": _stat(_summary_values(records, "final_client_rmse"))[0],
                "local_rmse_mean": _stat(_summary_values(records, "local_rmse"))[0],
                "regression": any("final_rmse" in r.summary for r in records),
                "dp_epsilon_mean": _stat(_summary_values(records, "dp_epsilon"))[0],
                "dp_noise_multiplier_mean": _stat(_summary_values(records, "dp_noise_multiplier"))[
                    0
                ],
                "dp_clipped_total_mean": _stat(_summary_values(records, "dp_clipped_total"))[0],
                "dp_clip_norm_mean": _stat(_summary_values(records, "dp_clip_norm"))[0],
                "dp_delta": next(
                    (r.summary["dp_delta"] for r in records if "dp_delta" in r.summary), None
                ),
                "no_privacy_runs": sum(1 for r in records if r.summary.get("privacy")),
            }
        )
    return table


def seeds_cell(row: dict[str, Any]) -> str:
    """The seeds column: how many runs, and how many of them are unfinished (no summary.json:
    their values are those of the last round written) or diverged (a training loss gone
    non-finite, or a model that blew up, :mod:`fedlore.results.divergence`: their final values
    are left out of the statistics)."""
    notes = []
    if row.get("unfinished_runs"):
        notes.append(f"{row['unfinished_runs']} unfinished")
    if row.get("diverged_runs"):
        notes.append(f"{row['diverged_runs']} diverged")
    n = str(int(row["n_seeds"]))
    return f"{n} ({', '.join(notes)})" if notes else n


def _pm(mean: float | None, std: float | None, digits: int = 2, n: int = 2) -> str:
    if mean is None:
        return "–"
    if abs(mean) >= 1e5:  # a perplexity of a barely trained or diverging model
        return f"{mean:.3g}" if n < 2 else f"{mean:.3g} ± {(std or 0.0):.2g}"
    if n < 2:  # one seed: no spread to report
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {(std or 0.0):.{digits}f}"


def _num(v: float | None) -> str:
    if v is None:
        return "–"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"


def _count(v: float | None) -> str:
    return "–" if v is None else f"{v:g}"


def _bytes(v: float | None) -> str:
    if v is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(v) >= size:
            return f"{v / size:.2f} {unit}"
    return f"{v:.0f} B"


def _dp_cell(row: dict[str, Any]) -> str:
    """``ε (δ) / σ / C / clipped``: the privacy spent at the run's end (mean over seeds), the
    noise multiplier, the clip norm and the clipped uploads per run (of all the uploads the
    run's clients made); "–" for a run without DP. Runs with ``dp.reproducible_noise`` (noise
    from the run seed) are marked "no privacy"."""
    sigma = row.get("dp_noise_multiplier_mean")
    if sigma is None:
        return "–"
    eps = row.get("dp_epsilon_mean")
    eps_s = "∞" if eps is None else f"{eps:.3g}"
    delta = row.get("dp_delta")
    delta_s = f" ({delta:g})" if delta is not None else ""
    clip = row.get("dp_clip_norm_mean")
    clip_s = "–" if clip is None else f"{clip:g}"
    cell = f"{eps_s}{delta_s} / {sigma:.3g} / {clip_s} / {_count(row.get('dp_clipped_total_mean'))}"
    if row.get("no_privacy_runs"):  # dp.reproducible_noise: the noise can be regenerated
        cell = f"no privacy ({int(row['no_privacy_runs'])} runs with seeded noise): " + cell
    return cell


def to_markdown(table: list[dict[str, Any]]) -> str:
    """Render :func:`summary_table` rows as a Markdown table (accuracies in %, mean ± std).

    When any row has a perplexity (language models), the accuracy columns give way to the final
    validation loss (nats per token), the final perplexity and the next-token accuracy. Classifier
    runs that recorded an ECE add the final NLL and ECE; runs with ``eval.local`` the P-local
    accuracy, beside the G-local accuracy of runs with ``eval.clients``, so a personalized
    method's global and personal scores stand side by side; runs with client timing the
    local-training seconds per client and round; DP runs the privacy spent (ε at δ), the noise
    multiplier σ and the clipped uploads.
    """
    lm = any(row.get("language_model") for row in table)
    if not lm and any(row.get("regression") for row in table):
        return _regression_markdown(table)
    calib = not lm and any(row.get("final_ece_mean") is not None for row in table)
    local = any(row.get("local_accuracy_pct_mean") is not None for row in table)
    glocal = any(row.get("client_accuracy_pct_mean") is not None for row in table)
    timed = any(row.get("client_train_s_per_round_mean") is not None for row in table)
    peak = any(row.get("peak_memory_bytes_mean") is not None for row in table)
    private = any(row.get("dp_noise_multiplier_mean") is not None for row in table)
    quality = (
        ["val loss", "val PPL", "next-token acc. (%)"]
        if lm
        else ["final acc. (%)", "best acc. (%)"]
    )
    quality += ["NLL", "ECE"] if calib else []
    quality += ["G-local acc. (%)"] if glocal else []
    quality += ["P-local acc. (%)"] if local else []
    header = [
        "method",
        "seeds",
        *quality,
        "MB up",
        "MB down",
        "optimizer state",
        *(["peak device memory"] if peak else []),
        "s / round",
        *(["client train s / round"] if timed else []),
        "rejected / skipped",
        *(["DP ε (δ) / σ / C / clipped uploads"] if private else []),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table:
        n = int(row["n_seeds"])
        rej, skip = row.get("rejected_total_mean"), row.get("skipped_steps_total_mean")
        acc = _pm(row["final_accuracy_pct_mean"], row["final_accuracy_pct_std"], n=n)
        if lm:
            ppl = _pm(row.get("final_perplexity_mean"), row.get("final_perplexity_std"), n=n)
            if row.get("diverged_runs"):
                ppl += " (diverged)"
            first = [
                _pm(row.get("final_loss_mean"), row.get("final_loss_std"), digits=3, n=n),
                ppl,
                acc,
            ]
        else:
            first = [acc, _pm(row["best_accuracy_pct_mean"], row["best_accuracy_pct_std"], n=n)]
        if calib:
            first += [
                _pm(row.get("final_loss_mean"), row.get("final_loss_std"), digits=3, n=n),
                _pm(row.get("final_ece_mean"), row.get("final_ece_std"), digits=3, n=n),
            ]
        if glocal:
            first.append(
                _pm(row.get("client_accuracy_pct_mean"), row.get("client_accuracy_pct_std"), n=n)
            )
        if local:
            first.append(
                _pm(row.get("local_accuracy_pct_mean"), row.get("local_accuracy_pct_std"), n=n)
            )
        cells = [
            str(row["method"]),
            seeds_cell(row),
            *first,
            _num(row["mb_up_mean"]),
            _num(row["mb_down_mean"]),
            _bytes(row["optimizer_state_bytes_mean"]),
            *([_bytes(row.get("peak_memory_bytes_mean"))] if peak else []),
            _pm(row["wall_s_per_round_mean"], row["wall_s_per_round_std"], digits=3, n=n),
            *([_num(row.get("client_train_s_per_round_mean"))] if timed else []),
            f"{_count(rej)} / {_count(skip)}",
            *([_dp_cell(row)] if private else []),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _regression_markdown(table: list[dict[str, Any]]) -> str:
    """:func:`to_markdown` for regression runs: final RMSE and NLL of the global model, and the
    G-local / P-local RMSE where recorded, in place of the accuracy columns."""
    glocal = any(row.get("client_rmse_mean") is not None for row in table)
    local = any(row.get("local_rmse_mean") is not None for row in table)
    header = [
        "method",
        "seeds",
        "final RMSE",
        "NLL",
        *(["G-local RMSE"] if glocal else []),
        *(["P-local RMSE"] if local else []),
        "MB up",
        "MB down",
        "optimizer state",
        "s / round",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table:
        n = int(row["n_seeds"])
        cells = [
            str(row["method"]),
            seeds_cell(row),
            _pm(row.get("final_rmse_mean"), row.get("final_rmse_std"), digits=3, n=n),
            _pm(row.get("final_loss_mean"), row.get("final_loss_std"), digits=3, n=n),
            *([_num(row.get("client_rmse_mean"))] if glocal else []),
            *([_num(row.get("local_rmse_mean"))] if local else []),
            _num(row["mb_up_mean"]),
            _num(row["mb_down_mean"]),
            _bytes(row["optimizer_state_bytes_mean"]),
            _pm(row["wall_s_per_round_mean"], row["wall_s_per_round_std"], digits=3, n=n),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(table: list[dict[str, Any]], path: Path) -> None:
    """Write :func:`summary_table` rows to ``path`` with the :data:`COLUMNS` header; missing
    statistics are empty cells, numbers are written at full precision."""
    with replacing(path, "w", newline="") as f:  # a failed write leaves the old file
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: "" if r.get(k) is None else r[k] for k in COLUMNS} for r in table)


DIAGNOSTIC_KEYS = (
    "diag.retained_energy",
    "diag.rho2",
    "diag.d_r",
    "diag.b_norm2",
    "diag.inner",
    "diag.certificate2",
)
"""Diagnostics summarized and plotted by default when runs have them (see
:mod:`fedlore.diagnostics`)."""


def diagnostics_table(runs: dict[str, list[RunRecord]]) -> list[dict[str, Any]]:
    """Per method: each :data:`DIAGNOSTIC_KEYS` metric averaged over a run's measured rounds,
    then mean ± std over seeds; plus the measured rounds per run and the diagnostics' seconds
    and candidate-gradient MB per run. Methods without diagnostics are left out."""
    table = []
    for method, records in runs.items():
        row: dict[str, Any] = {"method": method, "n_seeds": len(records)}
        found = False
        for key in DIAGNOSTIC_KEYS:
            per_run = []
            for r in records:
                vals = [v for v in (value(x, key) for x in r.rows) if v is not None]
                if vals:
                    per_run.append(sum(vals) / len(vals))
            row[key] = _stat(per_run)
            found = found or bool(per_run)
        if not found:
            continue
        row["measured_rounds"] = _stat(
            [float(sum(1 for x in r.rows if "diag_s" in x)) for r in records]
        )[0]
        row["diag_s"] = _stat([sum(value(x, "diag_s") or 0.0 for x in r.rows) for r in records])[0]
        row["diag_mb_up"] = _stat(
            [sum(value(x, "diag_bytes_up") or 0.0 for x in r.rows) / BYTES_PER_MB for r in records]
        )[0]
        table.append(row)
    return table


def diagnostics_markdown(table: list[dict[str, Any]]) -> str:
    """Render :func:`diagnostics_table` rows as Markdown (empty string for no rows)."""
    if not table:
        return ""
    keys = [k for k in DIAGNOSTIC_KEYS if any(row[k][0] is not None for row in table)]
    header = ["method", *[k.removeprefix("diag.") for k in keys], "rounds", "s", "MB up"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table:
        n = int(row["n_seeds"])
        cells = [str(row["method"])]
        for k in keys:
            mean, std = row[k]
            cells.append(
                "–"
                if mean is None
                else _pm(mean, std, digits=3, n=n)
                if abs(mean) < 100
                else _num(mean)
            )
        cells += [_count(row["measured_rounds"]), _num(row["diag_s"]), _num(row["diag_mb_up"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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


def _report_experiment(exp_dir: Path, keys: Sequence[str] | None) -> str:
    runs = split_by_config(load_runs(exp_dir))  # runs of different configs are never pooled
    table = summary_table(runs)
    diag = diagnostics_table(runs)
    if keys is None:
        keys = [
            k
            for k in DIAGNOSTIC_KEYS
            if any(value(x, k) is not None for rs in runs.values() for r in rs for x in r.rows)
        ]
    pngs = plot(runs, exp_dir, keys=keys, title=setting_title(exp_dir.name, runs))
    to_csv(table, exp_dir / "report.csv")
    images = "\n\n".join(f"![{p.stem.replace('_', ' ')}]({p.name})" for p in pngs)
    held = {s for rs in runs.values() for r in rs if (s := r.summary.get("data_test_split"))}
    text = (
        f"# {exp_dir.name}\n\n{to_markdown(table)}\n"
        + "".join(f"Test set: {s}.\n\n" for s in sorted(held))  # no test split of its own
        + "Mean ± sample std (ddof=1) over seeds (no ± with one seed); MB = 10^6 bytes, totals "
        "per run; optimizer state per client (moment tensors); peak device memory (CUDA runs) the "
        "largest peak of one client's update; s / round without evaluation; "
        "rejected client replies and skipped local steps (non-finite loss or gradient) per run. "
        "Seeds: unfinished runs (no summary yet) show their last written round; diverged runs "
        "(a training loss gone non-finite, or test predictions not finite or blown up) are left "
        "out of the final values. Runs of different configs under one name get a row each, "
        "named by the settings that differ."
        "\n\n"
    )
    if diag:
        text += (
            "## Diagnostics\n\n"
            f"{diagnostics_markdown(diag)}\n"
            "Each value is averaged over a run's measured rounds, then mean ± std over seeds; "
            "rounds, seconds and candidate-gradient MB uploaded are per run "
            "(see fedlore.diagnostics).\n\n"
        )
    text += f"{images}\n"
    write_text(exp_dir / "report.md", text)
    return text


def report(path: Path, keys: Sequence[str] | None = None) -> str:
    """Write ``report.md``, ``report.csv`` and the PNG plots for one or several experiments.

    Args:
        path: an experiment directory (``runs/quickstart``) or an output directory holding
            several experiments (``runs``); each experiment gets its own files.
        keys: extra numeric metrics-row keys to plot against the round (see :func:`plot`).

    Returns:
        The Markdown text (experiments concatenated, in name order).

    Raises:
        FileNotFoundError: if ``path`` is missing or holds no runs.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"report: directory not found: {path}")
    if is_experiment_dir(path):
        experiments = [path]
    else:
        experiments = sorted(d for d in path.iterdir() if is_experiment_dir(d))
    if not experiments:
        raise FileNotFoundError(
            f"report: no runs found in {path}: expected <experiment>/<method>/seed-<s>/ "
            "or <method>/seed-<s>/ below it"
        )
    return "\n".join(_report_experiment(d, keys) for d in experiments)
