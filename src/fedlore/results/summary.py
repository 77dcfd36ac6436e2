"""The one place a run's summary is computed from its metrics rows.

A finished run's ``summary.json`` (:func:`summarize`, written when the run ends) and the summary
that :mod:`fedlore.results.store` derives for a run that has none (:func:`derive_summary`) hold
the same final and best scores, totals and last values; nothing here needs torch, so reading
results back stays light.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedlore.results.divergence import divergence
from fedlore.stopping_rule import StoppingRule, known_direction, replay, watches_test


def value(row: dict[str, Any], key: str) -> float | None:
    """``row[key]`` as a finite float, or None when it is missing, null, non-numeric or NaN/inf."""
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def lm_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``final_perplexity`` (of the last evaluated round; None when it was not finite, i.e. the
    run diverged) and ``best_perplexity`` (the lowest finite one, None if none) of a language
    model's metrics rows; empty for a classifier (no row has a ``perplexity`` key)."""
    evaluated = [r for r in rows if "perplexity" in r]
    if not evaluated:
        return {}
    finite = [float(r["perplexity"]) for r in evaluated if r["perplexity"] is not None]
    return {
        "final_perplexity": evaluated[-1]["perplexity"],
        "best_perplexity": min(finite) if finite else None,
    }


def per_round_wall(rows: list[dict[str, Any]]) -> float | None:
    """Mean seconds of a training round (``wall_s``, without evaluation) over rounds 1, 2, ...;
    round 0 counts only in a run of one round. Round 0 of the first run in a process also pays
    the process's one-time start-up (lazy imports, first kernels: 1.4 s against 0.01 s for the
    next rounds of a small FedAvg), so with it the method run first in ``fedlore run`` looked
    slower than the others. The total, start-up included, is ``wall_s_total``. None: no row
    has a time."""
    walls = [
        (int(r["round"]), w)
        for r in rows
        if isinstance(r.get("round"), int)
        and r["round"] >= 0
        and (w := value(r, "wall_s")) is not None
    ]
    later = [w for rnd, w in walls if rnd > 0] or [w for _, w in walls]
    return sum(later) / len(later) if later else None


def derive_summary(
    method: str, seed: int, rows: list[dict[str, Any]], extra: Sequence[str] = ()
) -> dict[str, Any]:
    """A ``summary.json`` equivalent computed from metrics rows.

    ``final_accuracy`` and ``final_loss`` are the last evaluation's values (None when they were
    not finite: a run that diverged at the end), ``best_accuracy`` the finite maximum (None if no
    round was evaluated); language models add
    ``final_perplexity`` and ``best_perplexity`` (the minimum); byte totals are sums;
    ``optimizer_state_bytes`` is the peak over rounds; ``wall_s_per_round`` the mean round
    time (:func:`per_round_wall`); ``rounds`` the number of rows; rejected replies and skipped
    steps are totals, and the optional last values (ECE, P-local, client seconds) and the
    divergence mark are those a finished run's summary would hold.
    """
    acc = [a for a in (value(r, "accuracy") for r in rows) if a is not None]
    evaluated = [r for r in rows if "accuracy" in r or "loss" in r]
    last_eval = evaluated[-1] if evaluated else {}
    states = [s for s in (value(r, "optimizer_state_bytes") for r in rows) if s is not None]
    losses = [v for v in (value(r, "loss") for r in rows) if v is not None]
    train = [r for r in rows if isinstance(r.get("round"), int) and r["round"] >= 0]
    lm = lm_summary(train)
    return {
        "method": method,
        "seed": seed,
        "final_accuracy": value(last_eval, "accuracy"),  # the last evaluation, not finite: None
        "best_accuracy": max(acc) if acc else None,
        "bytes_up_total": sum(value(r, "bytes_up") or 0.0 for r in rows),
        "bytes_down_total": sum(value(r, "bytes_down") or 0.0 for r in rows),
        "optimizer_state_bytes": max(states) if states else None,
        **_largest(rows, "client_state_bytes"),
        "wall_s_per_round": per_round_wall(train),
        "rounds": len(rows),
        "final_loss": value(last_eval, "loss") if losses else None,
        "rejected_total": sum(int(r.get("rejected", 0) or 0) for r in rows),
        "skipped_steps_total": sum(int(r.get("skipped_steps", 0) or 0) for r in rows),
        "derived": True,
        **lm,
        **_last_values(train),  # ECE, P-local, client seconds: as a finished run's summary
        **extra_values(train, extra),
        **divergence(train),
    }


def summarize(
    method: str, seed: int, metrics: Path | list[dict[str, Any]], extra: Sequence[str] = ()
) -> dict[str, Any]:
    """The ``summary.json`` of a finished run, computed from its ``metrics.jsonl`` (the file,
    or its rows as :func:`read_metrics` read them); ``extra`` names the run's ``eval.metrics``
    (:func:`extra_values`)."""
    rows = read_metrics(metrics) if isinstance(metrics, Path) else metrics
    return _summary(method, seed, rows, extra)


def restored_finals(
    rows: list[dict[str, Any]], best_round: int, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """The ``final_*`` values of a run whose result is the model of round ``best_round``
    (``early_stopping.restore_best``, :mod:`fedlore.engine.early_stopping`): those
    :func:`summarize` gives the rows (``metrics.jsonl``'s) up to that round, i.e. its
    evaluation's, and ``diverged`` when those rows tell a divergence."""
    kept = [r for r in rows if r["round"] <= best_round]
    summary = _summary("", 0, kept, extra)
    return {k: v for k, v in summary.items() if k.startswith("final_") or k == "diverged"}


def stopping_outcome(
    summary: dict[str, Any],
    rule: StoppingRule,
    restore_best: bool,
    rows: list[dict[str, Any]],
    extra: Sequence[str] = (),
    finals: Callable[[list[dict[str, Any]], int, Sequence[str]], dict[str, Any]] | None = None,
) -> None:
    """Add an early-stopping rule's outcome to a run's ``summary`` (in place): the finished
    run's (:meth:`fedlore.engine.early_stopping.EarlyStopping.finish`), or, replayed over
    ``metrics.jsonl`` (:func:`fedlore.stopping_rule.replay`), that of a run whose summary is
    missing or damaged (:mod:`fedlore.results.store`).

    ``stopped_round`` (None when the run reached ``rounds``), ``best_round``,
    ``best_<metric>``, ``early_stopping_metric`` and ``early_stopping_on_test`` (a test set's
    metric, ``allow_test``: the reported scores are optimistic); with ``restore_best`` the
    ``final_*`` values become those of the best round's evaluation (``restored_best`` True),
    from ``rows`` (``extra``: ``eval.metrics``), and a divergence in later rounds moves from
    ``diverged`` to ``diverged_after_best`` (the result did not diverge). The P-local scores
    (``local_*``) stay the last round's: the clients' own models are not the server's state
    and are not restored. ``finals`` computes the best round's values from ``rows`` (default
    :func:`restored_finals`)."""
    summary["early_stopping_metric"] = rule.metric
    summary["stopped_round"] = rule.stopped_round
    summary["best_round"] = rule.best_round
    summary[f"best_{rule.metric}"] = rule.best_value
    summary["restored_best"] = restore_best and rule.best_round is not None
    summary["early_stopping_on_test"] = watches_test(rule.metric)  # allow_test: optimistic
    if summary["restored_best"]:
        assert rule.best_round is not None
        # the result is the best round's model: whether it diverged is judged on the rows up
        # to it; a divergence after it stays on record as ``diverged_after_best``
        later = summary.pop("diverged", None)
        restored = (finals or restored_finals)(rows, rule.best_round, extra)
        summary.update(restored)
        if later is not None and "diverged" not in restored:
            summary["diverged_after_best"] = later


def replayed_stopping(
    summary: dict[str, Any],
    rows: list[dict[str, Any]],
    early: Any,
    extra: Sequence[str] = (),
) -> bool:
    """Add to ``summary``, one derived from ``rows`` (:func:`derive_summary`: the run's
    ``summary.json`` is missing or damaged), the outcome the run's early-stopping rule had or
    has so far (:func:`stopping_outcome`): ``metrics.jsonl`` does not record the rule's best
    round, so the rule of the run's ``early_stopping`` settings (``early``: its
    ``config.json`` section) is replayed over ``rows``
    (:func:`fedlore.stopping_rule.replay`). With ``restore_best`` the ``final_*`` values become
    the kept round's, as the finished run's summary holds them, not the last round's;
    ``early_stopping_derived`` marks it. Returns whether it added anything (not without a
    metric, or with settings the rule cannot take)."""
    if not isinstance(early, dict) or not isinstance(metric := early.get("metric"), str):
        return False
    mode = early.get("mode", "auto")
    mode = known_direction(metric) if mode == "auto" else mode
    try:
        rule = StoppingRule(metric, str(mode), int(early.get("patience", 3)),
                            float(early.get("min_delta", 0.0)))  # fmt: skip
    except (TypeError, ValueError):  # an edited config.json: no rule to replay
        return False
    restore = bool(early.get("restore_best"))
    stopping_outcome(summary, replay(rows, rule), restore, rows, extra, _derived_finals)
    summary["early_stopping_derived"] = True
    return True


def _derived_finals(
    rows: list[dict[str, Any]], best_round: int, extra: Sequence[str]
) -> dict[str, Any]:
    """:func:`restored_finals` as :func:`derive_summary` reads rows (which tolerates a row
    without a key a finished run's rows all hold)."""
    derived = derive_summary("", 0, [r for r in rows if r["round"] <= best_round], extra)
    return {k: v for k, v in derived.items() if k.startswith("final_") or k == "diverged"}


def read_metrics(metrics_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]


def _summary(
    method: str, seed: int, rows: list[dict[str, Any]], extra: Sequence[str]
) -> dict[str, Any]:
    train = [r for r in rows if r["round"] >= 0]
    accs = [r["accuracy"] for r in train if r.get("accuracy") is not None]
    lm = lm_summary(train)
    return {
        "method": method,
        "seed": seed,
        "rounds": len(train),
        "final_accuracy": final_value(train, "accuracy"),
        "best_accuracy": max(accs) if accs else None,
        "final_loss": final_value(train, "loss"),
        "bytes_up_total": sum(r["bytes_up"] for r in rows),
        "bytes_down_total": sum(r["bytes_down"] for r in rows),
        "optimizer_state_bytes": max((r["optimizer_state_bytes"] for r in rows), default=0),
        **_peak(rows),
        **_largest(rows, "client_state_bytes"),
        "wall_s_per_round": per_round_wall(train) or 0.0,
        "wall_s_total": sum(r["wall_s"] for r in rows),
        "rejected_total": sum(r.get("rejected", 0) for r in rows),
        "skipped_steps_total": sum(r.get("skipped_steps", 0) for r in rows),
        "diag_s_total": sum(r.get("diag_s", 0.0) for r in rows),
        "diag_bytes_up_total": sum(r.get("diag_bytes_up", 0) for r in rows),
        **(
            {"dp_clipped_total": sum(r.get("dp_clipped", 0) for r in rows)}
            if any("dp_clipped" in r for r in rows)
            else {}
        ),
        **lm,
        **_last_values(train),
        **extra_values(train, extra),
        **divergence(train),
    }


SUMMARY_LAST = {
    "final_ece": "ece",
    "final_client_accuracy": "client_accuracy",
    "final_client_loss": "client_loss",
    "final_client_ece": "client_ece",
    "final_client_accuracy_mean": "client_accuracy_mean",
    "final_client_accuracy_std": "client_accuracy_std",
    "final_client_accuracy_min": "client_accuracy_min",
    "final_client_accuracy_p10": "client_accuracy_p10",
    "local_accuracy": "local_accuracy",
    "local_loss": "local_loss",
    "local_ece": "local_ece",
    "local_clients": "local_clients",
    "final_selection_accuracy": "selection_accuracy",
    "final_selection_loss": "selection_loss",
    "final_rmse": "rmse",
    "final_selection_rmse": "selection_rmse",
    "final_client_rmse": "client_rmse",
    "local_rmse": "local_rmse",
    "dp_epsilon": "dp_epsilon",
    "dp_epsilon_sample_known": "dp_epsilon_sample_known",
}
"""Summary key -> row key whose last recorded value it holds (when any round recorded it)."""


def _peak(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``peak_memory_bytes``: the largest peak device memory of any client's update in the run
    (CUDA only; absent on the CPU, where nothing measures it)."""
    peaks = [r["peak_memory_bytes"] for r in rows if r.get("peak_memory_bytes") is not None]
    return {"peak_memory_bytes": max(peaks)} if peaks else {}


def _largest(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """``key``'s largest value over the rows (``client_state_bytes``: the most any client kept
    between rounds); absent when no row has it (runs from before it was measured, or under
    secure aggregation or DP)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return {key: max(values)} if values else {}


def final_value(rows: list[dict[str, Any]], key: str) -> Any:
    """The value of ``key`` in the last row that recorded it (the last evaluation), None when
    that value was not finite (metrics.jsonl writes NaN and inf as null) or no row recorded it.
    Never an earlier round's value: a run that diverged at the end reports None, not the score
    it had before (so it can never win a learning-rate grid)."""
    return next((r[key] for r in reversed(rows) if key in r), None)


def _last_values(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's optional metrics: each :data:`SUMMARY_LAST` key that any row recorded,
    with its value in the last row that recorded it (None when not finite, see
    :func:`final_value`), ``final_selection_perplexity`` and ``levels`` (HeteroFL's
    per-level scores) likewise, and
    ``client_train_s_per_round`` (mean seconds of local training per client per round, from
    round 1 on as :func:`per_round_wall`)."""
    out: dict[str, Any] = {}
    for key, src in SUMMARY_LAST.items():
        if any(src in r for r in rows):
            out[key] = final_value(rows, src)
    if any("selection_perplexity" in r for r in rows):
        out["final_selection_perplexity"] = final_value(rows, "selection_perplexity")
    if any("levels" in r for r in rows):  # HeteroFL's eval_levels: each level's last scores
        out["levels"] = final_value(rows, "levels")
    timed = [
        (int(r["round"]), r["client_train_s"])
        for r in rows
        if r.get("client_train_s") is not None and isinstance(r.get("round"), int)
    ]
    # from round 1 on, as the round's seconds (per_round_wall): round 0 pays the first run's
    # one-time start-up in its clients too (flower-sim: 0.317 s against 0.038 s a round)
    times = [t for rnd, t in timed if rnd > 0] or [t for _, t in timed]
    if times:
        out["client_train_s_per_round"] = sum(times) / len(times)
    return out


def extra_values(rows: list[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """The last values of the ``eval.metrics`` ``names``: ``final_<key>`` for each of
    ``<name>``, ``selection_<name>``, ``client_<name>`` and ``local_<name>`` (P-local) that a
    row recorded (None when not finite, see :func:`final_value`), and ``eval_metrics``, the
    names, when there are any."""
    out: dict[str, Any] = {"eval_metrics": list(names)} if names else {}
    for name in names:
        for final, key in (
            (f"final_{name}", name),
            (f"final_selection_{name}", f"selection_{name}"),
            (f"final_client_{name}", f"client_{name}"),
            (f"final_local_{name}", f"local_{name}"),
        ):
            if any(key in r for r in rows):
                out[final] = final_value(rows, key)
    return out
