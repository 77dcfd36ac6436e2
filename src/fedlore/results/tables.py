"""The report's statistics: one row per method (or config) of mean ± std over its seeds, for the
summary (:func:`summary_table`, keys :data:`COLUMNS`) and for the subspace diagnostics
(:func:`diagnostics_table`). Numbers only: :mod:`fedlore.results.markdown` renders the rows,
:func:`fedlore.results.report.to_csv` writes them.

Statistics are over seeds: the mean and the sample standard deviation (ddof=1) when there are
at least two seeds, else a std of 0. Accuracies are in percent, traffic in MB (10^6 bytes),
optimizer state, client state and peak memory in bytes, round time in seconds.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from fedlore.results.plots import BYTES_PER_MB, mean_std
from fedlore.results.stopping import RUN_COLUMNS, run_cells
from fedlore.results.store import RunRecord, value

COLUMNS = [
    "method",
    "n_seeds",
    "unfinished_runs",
    "unreadable_runs",
    "diverged_runs",
    "failed_runs",
    "final_accuracy_pct_mean",
    "final_accuracy_pct_std",
    "best_accuracy_pct_mean",
    "best_accuracy_pct_std",
    "mb_up_mean",
    "mb_down_mean",
    "optimizer_state_bytes_mean",
    "peak_memory_bytes_mean",
    "client_state_bytes_mean",
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
    "client_worst_pct_mean",
    "client_worst_pct_std",
    "client_p10_pct_mean",
    "client_p10_pct_std",
    "client_spread_pct_mean",
    "client_spread_pct_std",
    "local_accuracy_pct_mean",
    "local_accuracy_pct_std",
    "client_train_s_per_round_mean",
    "client_train_s_per_round_std",
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
    "dp_local_runs",
    "dp_audit_epsilon_mean",
    "dp_audit_epsilon_all_iterates_mean",
    "dp_audit_epsilon_max",
    "dp_audit_epsilon_all_iterates_max",
    "dp_audit_above_runs",
    "dp_audit_all_iterates_above_runs",
    *RUN_COLUMNS,
]
"""Keys of every :func:`summary_table` row, in CSV column order (the perplexity columns are
empty for classifiers; ECE, G-local and P-local accuracy, the clients' fairness figures and client
training time are empty for runs that did not record them)."""


FAIRNESS = (
    ("client_worst_pct", "final_client_accuracy_min"),
    ("client_p10_pct", "final_client_accuracy_p10"),
    ("client_spread_pct", "final_client_accuracy_std"),
)
"""The fairness figures of ``eval.clients`` (the global model's accuracy on each client's own
test split, each client counted once, :func:`fedlore.experiment_parts.global_local_metrics`):
report column -> summary key, in percent: the worst client's accuracy, the 10th percentile over
the clients, and their spread (the sample std over the clients, in points). Every method
records them under ``eval.clients`` (q-FFL's case for existing, FedAvg's as its baseline); a
run of an older fedlore has only the pooled G-local accuracy."""


COSTS = frozenset(
    {
        "bytes_up_total",
        "bytes_down_total",
        "optimizer_state_bytes",
        "peak_memory_bytes",
        "client_state_bytes",
        "wall_s_per_round",
        "rejected_total",
        "skipped_steps_total",
        "client_train_s_per_round",
        "dp_epsilon",
        "dp_noise_multiplier",
        "dp_clipped_total",
        "dp_clip_norm",
        "dp_audit_epsilon",
        "dp_audit_epsilon_all_iterates",
    }
)
"""Summary keys that measure what a run cost or spent, not how good its model is: a diverged
run keeps them in the statistics; its scores (accuracy, NLL, ECE, perplexity, RMSE, the
eval.metrics) are left out, as the seeds column says."""


def _summary_values(records: list[RunRecord], key: str, scale: float = 1.0) -> list[float]:
    out = []
    for r in records:
        if key not in COSTS and r.summary.get("diverged"):
            continue  # a blown-up model's finite accuracy is no score
        v = r.summary.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v) * scale)
    return out


def _audit_mean(records: list[RunRecord], key: str) -> float | None:
    """The mean of a canary-audit estimate over the runs that made one; ``inf`` when one run's
    canaries were told apart with certainty (an infinite estimate is no outlier to drop)."""
    values = [r.summary.get(key) for r in records]
    found = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if any(math.isinf(v) for v in found):
        return math.inf
    return _stat([v for v in found if math.isfinite(v)])[0]


def _audit_max(records: list[RunRecord], key: str) -> float | None:
    """The largest canary-audit estimate over the runs that made one (one seed over the claim
    is what the mean can hide)."""
    values = [r.summary.get(key) for r in records]
    found = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    found = [v for v in found if not math.isnan(v)]
    return max(found) if found else None


def _audit_above(records: list[RunRecord], key: str) -> int:
    """The runs whose estimate's interval lies wholly above their accountant's ε: the lower end
    ``<key>_low`` above ``dp_epsilon`` (a sound mechanism's does so with probability at most
    about (1 − level)/2, 2–4 % in simulations; :mod:`fedlore.privacy.empirical_error`)."""
    count = 0
    for r in records:
        low, eps = r.summary.get(f"{key}_low"), r.summary.get("dp_epsilon")
        if isinstance(low, bool) or isinstance(eps, bool):
            continue
        if isinstance(low, int | float) and isinstance(eps, int | float) and low > eps:
            count += 1
    return count


def _scored(
    records: list[RunRecord], counts: dict[str, int], column: str, key: str, scale: float = 1.0
) -> tuple[float | None, float | None]:
    """:func:`_stat` of a score, its number of values noted in ``counts[column]``."""
    values = _summary_values(records, key, scale)
    counts[column] = len(values)
    return _stat(values)


def _stat(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return mean_std(values)


def summary_table(runs: dict[str, list[RunRecord]]) -> list[dict[str, Any]]:
    """One row per method with mean ± std over its seeds.

    Args:
        runs: method -> runs over seeds (from :func:`~fedlore.results.store.load_runs`).

    Returns:
        Rows with the keys in :data:`COLUMNS` (``n_seeds``; final and best accuracy in percent
        (mean, std); final loss and perplexity (mean, std) and best perplexity (language
        models); final ECE, G-local accuracy (the global model on the clients' test splits,
        ``eval.clients``) with its fairness figures over the clients (:data:`FAIRNESS`: worst
        client, 10th percentile, spread) and P-local accuracy (each client's own, personal or
        last local, model on its test split, ``eval.local``) in percent, and client training
        seconds per round where the runs recorded them; mean total MB up and down per run; mean
        per-client optimizer-state bytes; seconds per round (mean, std)). A statistic is None
        when no seed reports it. ``counts`` (not a CSV column) holds, per score column
        (``final_accuracy_pct``, ``final_loss``, ...), how many seeds its statistics are over:
        fewer than ``n_seeds`` when a run diverged or its summary lacks the value.
    """
    table = []
    for method, records in runs.items():
        counts: dict[str, int] = {}
        scored = functools.partial(_scored, records, counts)
        final_m, final_s = scored("final_accuracy_pct", "final_accuracy", 100.0)
        best_m, best_s = scored("best_accuracy_pct", "best_accuracy", 100.0)
        wall_m, wall_s = _stat(_summary_values(records, "wall_s_per_round"))
        # counted like a score: a seed without the timing (an older run) is no spread of 0
        train_m, train_s = scored("client_train_s_per_round", "client_train_s_per_round")
        loss_m, loss_s = scored("final_loss", "final_loss")
        ppl_m, ppl_s = scored("final_perplexity", "final_perplexity")
        ece_m, ece_s = scored("final_ece", "final_ece")
        local_m, local_s = scored("local_accuracy_pct", "local_accuracy", 100.0)
        glocal_m, glocal_s = scored("client_accuracy_pct", "final_client_accuracy", 100.0)
        fair = {}
        for column, key in FAIRNESS:
            fair[f"{column}_mean"], fair[f"{column}_std"] = scored(column, key, 100.0)
        rmse_m, rmse_s = scored("final_rmse", "final_rmse")
        table.append(
            {
                "method": method,
                "n_seeds": len(records),
                "counts": counts,
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
                "client_state_bytes_mean": _stat(_summary_values(records, "client_state_bytes"))[0],
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
                **fair,
                "local_accuracy_pct_mean": local_m,
                "local_accuracy_pct_std": local_s,
                "client_train_s_per_round_mean": train_m,
                "client_train_s_per_round_std": train_s,
                "diverged_runs": sum(
                    1
                    for r in records
                    if r.summary.get("diverged")
                    or ("final_perplexity" in r.summary and r.summary["final_perplexity"] is None)
                ),
                "unfinished_runs": sum(
                    1
                    for r in records
                    if r.summary.get("derived") and not r.summary.get("unreadable_summary")
                ),
                "unreadable_runs": sum(1 for r in records if r.summary.get("unreadable_summary")),
                "failed_runs": 0,  # not among the records: counted by the report
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
                "dp_local_runs": sum(1 for r in records if r.summary.get("dp_mode") == "local"),
                # the canary audit's estimates (dp.audit), over the runs that made them
                "dp_audit_epsilon_mean": _audit_mean(records, "dp_audit_epsilon"),
                "dp_audit_epsilon_all_iterates_mean": _audit_mean(
                    records, "dp_audit_epsilon_all_iterates"
                ),
                "dp_audit_epsilon_max": _audit_max(records, "dp_audit_epsilon"),
                "dp_audit_epsilon_all_iterates_max": _audit_max(
                    records, "dp_audit_epsilon_all_iterates"
                ),
                "dp_audit_above_runs": _audit_above(records, "dp_audit_epsilon"),
                "dp_audit_all_iterates_above_runs": _audit_above(
                    records, "dp_audit_epsilon_all_iterates"
                ),
                # each run's early stopping and audit intervals, as they are (not a statistic)
                **run_cells(records),
            }
        )
    return table


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


def eval_metrics_table(runs: dict[str, list[RunRecord]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The ``eval.metrics`` of the runs (:mod:`fedlore.train.metrics`): the summary keys
    (``final_<name>``, then ``final_selection_<name>``, ``final_client_<name>`` and
    ``final_local_<name>``, in the order the runs named them), and per method ``{"method",
    "n_seeds", key: (mean, std, count)}`` over the ``count`` seeds that recorded a finite
    value. Both empty when no run named any."""
    names: list[str] = []
    for records in runs.values():
        for r in records:
            names += [n for n in r.summary.get("eval_metrics") or [] if n not in names]
    keys = [
        key
        for where in ("", "selection_", "client_", "local_")  # the central test set's first
        for key in (f"final_{where}{n}" for n in names)
        if any(key in r.summary for records in runs.values() for r in records)
    ]
    if not keys:
        return [], []
    table = []
    for method, records in runs.items():
        row: dict[str, Any] = {"method": method, "n_seeds": len(records)}
        for key in keys:
            values = _summary_values(records, key)
            row[key] = (*_stat(values), len(values))
        table.append(row)
    return keys, table
