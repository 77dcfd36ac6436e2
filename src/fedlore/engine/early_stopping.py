"""Early stopping and best-round model selection (``early_stopping``,
:class:`fedlore.config.EarlyStoppingConfig`), as a round callback.

The rule is Keras' ``EarlyStopping`` (and Lightning's, pfl-research's
``EarlyStoppingCallback``): the first evaluation of the watched metric sets the best; a later
one *improves* when it is better than the best by more than ``min_delta``
(``value > best + min_delta`` under ``max``, ``value < best - min_delta`` under ``min``; a
non-finite value never improves), which makes it the new best and resets the count; every other
evaluation adds one to ``wait``, and the run stops at the evaluation where ``wait`` reaches
``patience``. Rounds that do not record the metric (``eval.every`` above 1, setup exchanges)
count for nothing.

With ``restore_best`` the server state of the best round is kept (cloned: a method may reuse
its tensors) and the run's result is that round's: ``final_*`` of ``summary.json`` are its
evaluation's, and :func:`fedlore.trained.load_trained` loads its model. Everything the rule
holds (best value and round, ``wait``, the stop, the best state as CPU tensors) travels in
``checkpoint.pt`` under ``early_stopping``, so a killed and resumed run stops, selects and
reports exactly as an uninterrupted one.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

from fedlore.config import Config
from fedlore.config_stopping import watches_test
from fedlore.progress import say
from fedlore.results.summary import restored_finals
from fedlore.tensors import to_cpu
from fedlore.types import State

ENTRY = "early_stopping"
"""The checkpoint's key of the rule's state."""


class EarlyStopping:
    """The rule over one run's rows; a :class:`~fedlore.engine.loop.Callback`.

    Args:
        metric: the row key watched.
        mode: ``max`` or ``min``.
        patience: evaluations in a row without an improvement before the stop (at least 1).
        min_delta: the margin an improvement must exceed (>= 0).
        restore_best: keep the best round's server state.

    Attributes:
        best_value: the best value so far (None before the first evaluation).
        best_round: its round.
        wait: evaluations since the best without an improvement.
        stopped_round: the round the run stopped after (None while it goes on).
        best_state: the best round's server state (``restore_best`` only).
    """

    def __init__(
        self, metric: str, mode: str, patience: int, min_delta: float, restore_best: bool
    ) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"early stopping: mode must be max or min, got {mode!r}")
        if patience < 1 or not min_delta >= 0:
            raise ValueError(
                f"early stopping: patience must be >= 1 and min_delta >= 0 (got {patience}, "
                f"{min_delta})"
            )
        self.metric, self.mode, self.patience = metric, mode, patience
        self.min_delta, self.restore_best = float(min_delta), restore_best
        self.best_value: float | None = None
        self.best_round: int | None = None
        self.wait = 0
        self.stopped_round: int | None = None
        self.best_state: State | None = None

    def improves(self, value: float) -> bool:
        """Whether ``value`` is a new best (always, for the first finite value)."""
        if not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        if self.mode == "max":
            return value > self.best_value + self.min_delta
        return value < self.best_value - self.min_delta

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        if rnd < 0 or self.metric not in row or self.stopped_round is not None:
            return  # not evaluated this round
        raw = row[self.metric]
        value = float(raw) if isinstance(raw, int | float) else math.nan  # None: no value
        if self.improves(value):
            self.best_value, self.best_round, self.wait = value, rnd, 0
            if self.restore_best:
                self.best_state = _clone(state)
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_round = rnd
            say(
                "early stopping: %s did not improve for %d evaluation(s); stopped after round %d "
                "(best round %s: %s)",
                self.metric, self.wait, rnd, self.best_round, self.best_value,
            )  # fmt: skip

    def stopped(self) -> bool:
        """Whether the run has stopped (the round loop asks before every round)."""
        return self.stopped_round is not None

    def checkpoint_entry(self) -> dict[str, Any]:
        """What ``checkpoint.pt`` keeps under :data:`ENTRY` (CPU tensors, plain scalars)."""
        entry: dict[str, Any] = {
            "best_value": self.best_value,
            "best_round": self.best_round,
            "wait": self.wait,
            "stopped_round": self.stopped_round,
        }
        if self.best_state is not None:
            entry["best_state"] = {
                "arrays": to_cpu(self.best_state.arrays),
                "values": self.best_state.values,
            }
        return {ENTRY: entry}

    def restore(self, raw: dict[str, Any]) -> None:
        """Continue from a checkpoint's :data:`ENTRY` (its tensors on the run's device, as the
        checkpoint is loaded); a checkpoint without one (an earlier fedlore) starts afresh.

        Raises:
            ValueError: when the checkpoint's rule kept no best state but this run restores
                the best round (the run was started without ``restore_best``; the config
                check refuses that resume first).
        """
        entry = raw.get(ENTRY)
        if entry is None:
            return
        self.best_value = entry["best_value"]
        self.best_round = entry["best_round"]
        self.wait = int(entry["wait"])
        self.stopped_round = entry["stopped_round"]
        kept = entry.get("best_state")
        if self.restore_best and kept is None and self.best_round is not None:
            raise ValueError(
                "early_stopping.restore_best: the checkpoint holds no best state to restore"
            )
        if kept is not None:
            self.best_state = State(dict(kept["arrays"]), dict(kept["values"]))

    def finish(self, summary: dict[str, Any], rows: Path, extra: tuple[str, ...]) -> None:
        """Add the rule's outcome to a finished run's ``summary`` (in place):
        ``stopped_round`` (None when the run reached ``rounds``), ``best_round``,
        ``best_<metric>``, ``early_stopping_metric`` and ``early_stopping_on_test`` (a test
        set's metric, ``allow_test``: the reported scores are optimistic); with
        ``restore_best`` the ``final_*`` values become those of the best round's evaluation
        (``restored_best`` True), read from ``rows`` (``metrics.jsonl``; ``extra``:
        ``eval.metrics``), and a divergence in later rounds moves from ``diverged`` to
        ``diverged_after_best`` (the result did not diverge). The P-local scores
        (``local_*``) stay the last round's: the clients' own models are not the server's
        state and are not restored."""
        summary["early_stopping_metric"] = self.metric
        summary["stopped_round"] = self.stopped_round
        summary["best_round"] = self.best_round
        summary[f"best_{self.metric}"] = self.best_value
        summary["restored_best"] = self.restore_best and self.best_round is not None
        summary["early_stopping_on_test"] = watches_test(self.metric)  # allow_test: optimistic
        if summary["restored_best"]:
            assert self.best_round is not None
            # the result is the best round's model: whether it diverged is judged on the rows
            # up to it; a divergence after it stays on record as ``diverged_after_best``
            later = summary.pop("diverged", None)
            restored = restored_finals(rows, self.best_round, extra)
            summary.update(restored)
            if later is not None and "diverged" not in restored:
                summary["diverged_after_best"] = later


def early_stopper(cfg: Config) -> EarlyStopping | None:
    """The run's rule (None when ``early_stopping.metric`` is not set)."""
    es = cfg.early_stopping
    if es.metric is None:
        return None
    return EarlyStopping(es.metric, es.direction(), es.patience, es.min_delta, es.restore_best)


def _clone(state: State) -> State:
    """A copy of ``state`` that later rounds cannot change (tensors cloned on their device)."""
    arrays = {k: v.detach().clone() for k, v in state.arrays.items()}
    return State(arrays, copy.deepcopy(state.values))
