"""Early stopping and best-round model selection (``early_stopping``,
:class:`fedlore.config.EarlyStoppingConfig`), as a round callback.

The rule is Keras' ``EarlyStopping`` (and Lightning's, pfl-research's
``EarlyStoppingCallback``): the first evaluation of the watched metric sets the best; a later
one *improves* when it is better than the best by more than ``min_delta``
(``value > best + min_delta`` under ``max``, ``value < best - min_delta`` under ``min``; a
non-finite value never improves), which makes it the new best and resets the count; every other
evaluation adds one to ``wait``, and the run stops at the evaluation where ``wait`` reaches
``patience``. Rounds that do not record the metric (``eval.every`` above 1, setup exchanges)
count for nothing. The rule itself is :class:`fedlore.stopping_rule.StoppingRule`, which
``fedlore report`` replays over ``metrics.jsonl`` for a run without a readable summary.

With ``restore_best`` the server state of the best round is kept (cloned: a method may reuse
its tensors) and the run's result is that round's: ``final_*`` of ``summary.json`` are its
evaluation's, and :func:`fedlore.trained.load_trained` loads its model. Everything the rule
holds (best value and round, ``wait``, the stop, the best state as CPU tensors) travels in
``checkpoint.pt`` under ``early_stopping``, so a killed and resumed run stops, selects and
reports exactly as an uninterrupted one.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from fedlore.config import Config
from fedlore.progress import tell
from fedlore.results.summary import read_metrics, stopping_outcome
from fedlore.stopping_rule import StoppingRule
from fedlore.tensors import to_cpu
from fedlore.types import State

ENTRY = "early_stopping"
"""The checkpoint's key of the rule's state."""


class EarlyStopping(StoppingRule):
    """The rule over one run's rows (:class:`fedlore.stopping_rule.StoppingRule`, which the
    report replays over ``metrics.jsonl``); a :class:`~fedlore.engine.loop.Callback`.

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
        super().__init__(metric, mode, patience, min_delta)
        self.restore_best = restore_best
        self.best_state: State | None = None

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        if self.observe(rnd, row):
            if self.restore_best:
                self.best_state = _clone(state)
        elif self.stopped_round == rnd:
            tell(
                "early stopping: %s did not improve for %d evaluation(s); stopped after round %d "
                "(best round %s: %s)",
                self.metric, self.wait, rnd, self.best_round, self.best_value,
            )  # fmt: skip

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

    def finish(
        self, summary: dict[str, Any], rows: Path | list[dict[str, Any]], extra: tuple[str, ...]
    ) -> None:
        """Add the rule's outcome to a finished run's ``summary`` (in place), from its
        ``metrics.jsonl`` ``rows`` (the file, or its rows as read; ``extra``: ``eval.metrics``):
        :func:`fedlore.results.summary.stopping_outcome` (``stopped_round``, ``best_round``,
        ``best_<metric>``; with ``restore_best`` the best round's ``final_*``)."""
        read = read_metrics(rows) if isinstance(rows, Path) else rows
        stopping_outcome(summary, self, self.restore_best, read, extra)


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
