"""The report's Markdown: :mod:`fedlore.results.tables` rows rendered as tables (mean ± std
cells, MB and byte units, the seeds and privacy cells); classifier, language-model and regression
layouts, and the diagnostics table.
"""

from __future__ import annotations

import math
from typing import Any

from fedlore.results.tables import DIAGNOSTIC_KEYS, FAIRNESS


def seeds_cell(row: dict[str, Any]) -> str:
    """The seeds column: how many runs, and how many of them are unfinished (no summary.json:
    their values are those of the last round written), have a summary.json that cannot be read
    (their values are the last round's too) or diverged (a training loss gone
    non-finite, or a model that blew up, :mod:`fedlore.results.divergence`: their final values
    are left out of the statistics); and the runs of the row that failed under ``fedlore run
    --keep-going``, not among them (``+1 failed``: left out, named under the table)."""
    notes = []
    if row.get("unfinished_runs"):
        notes.append(f"{row['unfinished_runs']} unfinished")
    if row.get("unreadable_runs"):  # values of its last round, as an unfinished run's
        notes.append(f"{row['unreadable_runs']} with an unreadable summary")
    if row.get("diverged_runs"):
        notes.append(f"{row['diverged_runs']} diverged")
    if row.get("failed_runs"):  # not among the n: left out, named under the table
        notes.append(f"+{row['failed_runs']} failed")
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


def _score(row: dict[str, Any], column: str, digits: int = 2) -> str:
    """A score's ``mean ± std`` cell over the seeds that gave it; when fewer than the row's
    seeds that did not diverge (a summary without the value), how many of them:
    ``91.67 (1 of 2 seeds)``, not a spread of 0 that one seed cannot have."""
    n = int(row["n_seeds"])
    count = row.get("counts", {}).get(column, n)
    mean = row.get(f"{column}_mean")
    cell = _pm(mean, row.get(f"{column}_std"), digits=digits, n=count)
    if mean is None or count >= n - int(row.get("diverged_runs") or 0):
        return cell
    return f"{cell} ({count} of {n} seeds)"


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


def _epsilon(v: float) -> str:
    return "∞" if math.isinf(v) else f"{v:.3g}"


def _audit(mean: float, top: float | None, n_runs: int) -> str:
    """An audit estimate: the mean over seeds, and with several seeds the largest, "2.6 (max
    3.1)" (one seed over the claim is what a mean hides)."""
    if n_runs < 2 or top is None or top == mean:
        return _epsilon(mean)
    return f"{_epsilon(mean)} (max {_epsilon(top)})"


def _above(row: dict[str, Any], n_runs: int) -> str:
    """ " · AUDIT ABOVE ε in r of n runs (…)" when some run's interval lies wholly above its
    accountant's ε (its lower end beyond the claim): a sound mechanism does so rarely, so the
    mechanism or its accounting is suspect."""
    parts = []
    for key, what in (
        ("dp_audit_above_runs", "final model"),
        ("dp_audit_all_iterates_above_runs", "all iterates"),
    ):
        r = int(row.get(key) or 0)
        if r:
            parts.append(f"{what} in {r} of {n_runs} run{'s' * (n_runs != 1)}")
    if not parts:
        return ""
    return " · **AUDIT ABOVE ε** (interval's lower end over the claim): " + ", ".join(parts)


def _dp_cell(row: dict[str, Any]) -> str:
    """``ε (δ) / σ / C / clipped``: the privacy spent at the run's end (mean over seeds), the
    noise multiplier, the clip norm and the clipped uploads per run (of all the uploads the
    run's clients made); "–" for a run without DP. Runs of ``dp.mode: local`` are marked
    "local DP" (ε is then the worst-off client's, against the server too), runs with
    ``dp.reproducible_noise`` (noise from the run seed) "no privacy". Runs with the canary
    audit (``dp.audit``) add its estimate after the cell, "· audit ε̂ 2.6 (max 3.1)" (final
    model, mean and largest over the seeds; ", all iterates 1.1 (max 1.4)" with unseen
    canaries): an empirical estimate to read beside ε, not a bound; and when a run's interval
    lies wholly above its ε, "· **AUDIT ABOVE ε** (interval's lower end over the claim): final
    model in 1 of 2 runs"."""
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
    local, n_runs = int(row.get("dp_local_runs") or 0), int(row.get("n_seeds") or 0)
    if local:  # dp.mode: local, each client's ε against everyone, the server included
        cell = (
            "local DP: " if local == n_runs else f"local DP in {local} of {n_runs} runs: "
        ) + cell
    audit = row.get("dp_audit_epsilon_mean")
    if audit is not None:  # the canary audit's estimate (Andrew et al. 2024), beside ε
        cell += f" · audit ε̂ {_audit(audit, row.get('dp_audit_epsilon_max'), n_runs)}"
        every = row.get("dp_audit_epsilon_all_iterates_mean")
        if every is not None:
            top = row.get("dp_audit_epsilon_all_iterates_max")
            cell += f", all iterates {_audit(every, top, n_runs)}"
        cell += _above(row, n_runs)
    if row.get("no_privacy_runs"):  # dp.reproducible_noise: the noise can be regenerated
        n = int(row["no_privacy_runs"])
        cell = f"no privacy ({n} run{'s' * (n != 1)} with seeded noise): " + cell
    return cell


def to_markdown(table: list[dict[str, Any]]) -> str:
    """Render :func:`~fedlore.results.tables.summary_table` rows as a Markdown table (accuracies
    in %, mean ± std).

    When any row has a perplexity (language models), the accuracy columns give way to the final
    validation loss (nats per token), the final perplexity and the next-token accuracy. Classifier
    runs that recorded an ECE add the final NLL and ECE; runs with ``eval.local`` the P-local
    accuracy, beside the G-local accuracy of runs with ``eval.clients``, so a personalized
    method's global and personal scores stand side by side; runs with ``eval.clients`` that
    recorded the clients' fairness figures (:data:`~fedlore.results.tables.FAIRNESS`) the worst
    client's accuracy, the 10th percentile and the spread (sample std over the clients, in
    points) after the G-local accuracy, "–" for a method whose runs did not record them; runs
    with client timing the local-training seconds per client and round; runs that measured it
    the client state (the most one client keeps between rounds: control variates, personal
    layers, optimizer moments carried to its next round); DP runs the privacy spent (ε at δ),
    the noise multiplier σ and the clipped uploads.
    """
    lm = any(row.get("language_model") for row in table)
    if not lm and any(row.get("regression") for row in table):
        return _regression_markdown(table)
    calib = not lm and any(row.get("final_ece_mean") is not None for row in table)
    local = any(row.get("local_accuracy_pct_mean") is not None for row in table)
    glocal = any(row.get("client_accuracy_pct_mean") is not None for row in table)
    fair = any(row.get(f"{c}_mean") is not None for row in table for c, _ in FAIRNESS)
    timed = any(row.get("client_train_s_per_round_mean") is not None for row in table)
    peak = any(row.get("peak_memory_bytes_mean") is not None for row in table)
    kept = any(row.get("client_state_bytes_mean") is not None for row in table)
    private = any(row.get("dp_noise_multiplier_mean") is not None for row in table)
    quality = (
        ["val loss", "val PPL", "next-token acc. (%)"]
        if lm
        else ["final acc. (%)", "best acc. (%)"]
    )
    quality += ["NLL", "ECE"] if calib else []
    quality += ["G-local acc. (%)"] if glocal else []
    quality += ["worst client (%)", "client p10 (%)", "client spread (pts)"] if fair else []
    quality += ["P-local acc. (%)"] if local else []
    header = [
        "method",
        "seeds",
        *quality,
        "MB up",
        "MB down",
        "optimizer state",
        *(["client state"] if kept else []),
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
        acc = _score(row, "final_accuracy_pct")
        if lm:
            ppl = _score(row, "final_perplexity")
            if row.get("diverged_runs"):
                ppl += " (diverged)"
            first = [
                _score(row, "final_loss", 3),
                ppl,
                acc,
            ]
        else:
            first = [acc, _score(row, "best_accuracy_pct")]
        if calib:
            first += [
                _score(row, "final_loss", 3),
                _score(row, "final_ece", 3),
            ]
        if glocal:
            first.append(_score(row, "client_accuracy_pct"))
        if fair:  # "–" for a method whose runs did not record them
            first += [_score(row, column) for column, _ in FAIRNESS]
        if local:
            first.append(_score(row, "local_accuracy_pct"))
        cells = [
            str(row["method"]),
            seeds_cell(row),
            *first,
            _num(row["mb_up_mean"]),
            _num(row["mb_down_mean"]),
            _bytes(row["optimizer_state_bytes_mean"]),
            *([_bytes(row.get("client_state_bytes_mean"))] if kept else []),
            *([_bytes(row.get("peak_memory_bytes_mean"))] if peak else []),
            _pm(row["wall_s_per_round_mean"], row["wall_s_per_round_std"], digits=3, n=n),
            *([_score(row, "client_train_s_per_round", digits=3)] if timed else []),
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
            _score(row, "final_rmse", 3),
            _score(row, "final_loss", 3),
            *([_num(row.get("client_rmse_mean"))] if glocal else []),
            *([_num(row.get("local_rmse_mean"))] if local else []),
            _num(row["mb_up_mean"]),
            _num(row["mb_down_mean"]),
            _bytes(row["optimizer_state_bytes_mean"]),
            _pm(row["wall_s_per_round_mean"], row["wall_s_per_round_std"], digits=3, n=n),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def diagnostics_markdown(table: list[dict[str, Any]]) -> str:
    """Render :func:`~fedlore.results.tables.diagnostics_table` rows as Markdown (empty string
    for no rows)."""
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


def eval_metrics_markdown(keys: list[str], table: list[dict[str, Any]]) -> str:
    """Render :func:`~fedlore.results.tables.eval_metrics_table` as Markdown: a column per
    metric (``final_`` dropped), mean ± std over the seeds with a finite value, 4 decimals, and
    how many of the method's seeds those are when not all (empty for no rows)."""
    if not table:
        return ""
    header = ["method", *[k.removeprefix("final_") for k in keys]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table:
        n = int(row["n_seeds"])
        cells = [str(row["method"])]
        for k in keys:
            mean, std, count = row[k]
            cell = _pm(mean, std, digits=4, n=count)
            cells.append(cell if count in (0, n) else f"{cell} ({count} of {n} seeds)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
