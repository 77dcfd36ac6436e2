"""The early-stopping rule as a pure function of a run's rows, without torch or pydantic: which
direction each of fedlore's scores improves in, whether a metric is scored on a test set the run
reports, and :class:`StoppingRule`, the rule itself.

Three places apply it and must agree: the running rule, a round callback that also keeps the
best round's state (:class:`fedlore.engine.early_stopping.EarlyStopping` subclasses
:class:`StoppingRule`); the config's check of an explicit ``mode`` against a score's known
direction (:class:`fedlore.config.EarlyStoppingConfig`); and ``fedlore report``, which replays
the rule over ``metrics.jsonl`` (:func:`replay`) for a run whose ``summary.json`` is missing or
damaged, to find the round the rule kept.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any, Literal

MAXIMIZED = frozenset(
    {
        "accuracy",
        "balanced_accuracy",
        "f1_macro",
        "top5_accuracy",
        "auroc_macro",
        "accuracy_mean",
        "accuracy_min",
        "accuracy_p10",
    }
)
"""Scores (without their ``selection_`` / ``client_`` prefix) for which higher is better."""
MINIMIZED = frozenset({"loss", "ece", "perplexity", "rmse", "brier", "accuracy_std", "train_loss"})
"""Scores (without their prefix) for which lower is better."""
PREFIXES = ("selection_", "client_")


def base_name(metric: str) -> str:
    """``metric`` without its split prefix (``selection_loss`` -> ``loss``)."""
    for prefix in PREFIXES:
        if metric.startswith(prefix):
            return metric.removeprefix(prefix)
    return metric


def known_direction(metric: str) -> Literal["max", "min"] | None:
    """Whether fedlore knows ``metric`` to be better large (``max``: accuracies, F1, AUROC) or
    small (``min``: losses, ECE, perplexity, RMSE, Brier); None for a metric it does not know
    (a plugin's)."""
    base = base_name(metric)
    if base in MAXIMIZED:
        return "max"
    if base in MINIMIZED:
        return "min"
    return None


def mode_contradiction(section: str, metric: str, mode: str) -> str | None:
    """What is wrong when ``mode`` (``max``/``min``, or ``auto``) goes against the known direction
    of ``metric`` (``section`` names the keys: ``early_stopping``, ``tune``): a rule that keeps
    the worst value; None when they agree, the mode is ``auto`` or the metric's direction is
    unknown (a plugin's, whose mode is given)."""
    way = known_direction(metric.removeprefix("local_"))
    if mode == "auto" or way is None or mode == way:
        return None
    how = "maximized (larger is better)" if way == "max" else "minimized (smaller is better)"
    return (
        f"{section}.mode={mode} contradicts {section}.metric={metric}, which is {how}: set "
        f"{section}.mode=auto (or {way})"
    )


OPTIONAL = frozenset({"balanced_accuracy", "f1_macro", "top5_accuracy", "auroc_macro", "brier"})
"""fedlore's scores that a run records only when ``eval.metrics`` lists them."""
CLIENT_SPREAD = {"accuracy_mean", "accuracy_std", "accuracy_min", "accuracy_p10"}
SPLITS = {
    "selection_": ("the selection split", {"accuracy", "loss", "perplexity", "rmse"}),
    "client_": ("the clients' test splits", {"accuracy", "loss", "ece", "rmse", *CLIENT_SPREAD}),
    "local_": ("the clients' own models (P-local)", {"accuracy", "loss", "ece", "rmse"}),
    "": ("the central test set", {"accuracy", "loss", "ece", "perplexity", "rmse", "train_loss"}),
}
"""Split prefix -> (the split in words, fedlore's scores of it but the :data:`OPTIONAL` ones)."""


def unknown_score(section: str, metric: str, mode_key: str) -> str | None:
    """What is wrong when ``mode: auto`` meets a ``metric`` whose direction fedlore does not
    know (``section`` names the keys: ``early_stopping``, ``tune``; ``mode_key`` how to set the
    mode): most often a typo, so the message names the metric, says it is not a known score of
    its split, suggests the nearest known name or lists them, and only then mentions the other
    possibility, a plugin's metric (:func:`fedlore.registry.register_metric`), whose direction
    ``mode_key`` must give. None when the direction is known. The one wording of
    :class:`fedlore.config.EarlyStoppingConfig` and :class:`fedlore.config_tune.TuneConfig`."""
    if known_direction(metric.removeprefix("local_")) is not None:
        return None
    lower = metric.lower()  # the split and the suggestion, whatever the case: still refused
    prefix = next((p for p in SPLITS if p and lower.startswith(p)), "")
    split, scores = SPLITS[prefix]
    known = sorted(prefix + m for m in scores | OPTIONAL)
    near = nearest_score(lower, known)
    said = f" (did you mean {near}?)" if near else f"; fedlore's are {', '.join(known)}"
    return (
        f"{section}.metric={metric} is not a known score of {split}{said}; if it is a "
        f"plugin's metric, set {mode_key} to max or min (mode=auto cannot tell whether it is "
        "better large or small)"
    )


def nearest_score(lower: str, known: list[str]) -> str | None:
    """The name of ``known`` that the lowercased ``lower`` most likely means: the shortest
    that it begins (itself when only the case differs; a truncated name, ``selection_acc``),
    else the closest by :func:`difflib.get_close_matches`; None when none is near."""
    if len(base_name(lower)) >= 3:
        begun = [k for k in known if k.startswith(lower)]
        if begun:
            return min(begun, key=len)
    near = difflib.get_close_matches(lower, known, n=1, cutoff=0.85)
    return near[0] if near else None


def watches_test(metric: str) -> bool:
    """Whether ``metric`` is scored on a test set the run reports: the central test set (an
    unprefixed score) or the clients' test splits (``client_*``); not the selection split
    (``selection_*``) nor the training loss."""
    return metric.startswith("client_") or (
        metric != "train_loss" and not metric.startswith(("selection_", "local_"))
    )


class StoppingRule:
    """Keras' ``EarlyStopping`` over one run's rows, fed in round order (:meth:`observe`).

    Args:
        metric: the row key watched.
        mode: ``max`` or ``min``.
        patience: evaluations in a row without an improvement before the stop (at least 1).
        min_delta: the margin an improvement must exceed (>= 0).

    Attributes:
        best_value: the best value so far (None before the first evaluation).
        best_round: its round.
        wait: evaluations since the best without an improvement.
        stopped_round: the round the run stopped after (None while it goes on).
    """

    def __init__(self, metric: str, mode: str, patience: int, min_delta: float) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"early stopping: mode must be max or min, got {mode!r}")
        if patience < 1 or not min_delta >= 0:
            raise ValueError(
                f"early stopping: patience must be >= 1 and min_delta >= 0 (got {patience}, "
                f"{min_delta})"
            )
        self.metric, self.mode, self.patience = metric, mode, patience
        self.min_delta = float(min_delta)
        self.best_value: float | None = None
        self.best_round: int | None = None
        self.wait = 0
        self.stopped_round: int | None = None

    def improves(self, value: float) -> bool:
        """Whether ``value`` is a new best (always, for the first finite value)."""
        if not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        if self.mode == "max":
            return value > self.best_value + self.min_delta
        return value < self.best_value - self.min_delta

    def observe(self, rnd: int, row: dict[str, Any]) -> bool:
        """Take round ``rnd``'s row; True when it is the new best. A setup round (``rnd`` < 0),
        a row without the metric (not evaluated) and any row after the stop count for nothing;
        a value that is not a finite number (null in ``metrics.jsonl``) never improves."""
        if rnd < 0 or self.metric not in row or self.stopped_round is not None:
            return False  # not evaluated this round
        raw = row[self.metric]
        ok = isinstance(raw, int | float) and not isinstance(raw, bool)
        value = float(raw) if ok else math.nan  # None: no value
        if self.improves(value):
            self.best_value, self.best_round, self.wait = value, rnd, 0
            return True
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_round = rnd
        return False

    def stopped(self) -> bool:
        """Whether the run has stopped (the round loop asks before every round)."""
        return self.stopped_round is not None


def replay(rows: Iterable[dict[str, Any]], rule: StoppingRule) -> StoppingRule:
    """``rule`` after every row of ``rows`` (``metrics.jsonl``'s, in round order; rows without
    an int ``round`` are skipped), as the run fed it; returned for chaining."""
    for row in rows:
        rnd = row.get("round")
        if isinstance(rnd, int) and not isinstance(rnd, bool):
            rule.observe(rnd, row)
    return rule
