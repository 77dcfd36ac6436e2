"""The ``early_stopping`` section of :class:`fedlore.config_model.Config`: stop a run once a
per-round metric has stopped improving, and optionally keep the model of its best round
(import it from :mod:`fedlore.config`; the rule is :mod:`fedlore.engine.early_stopping` over
:mod:`fedlore.stopping_rule`, whose table of the scores' directions this section checks an
explicit ``mode`` against; the refusals that span other sections :mod:`fedlore.checks.stopping`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedlore.settings import StrictModel as _Strict
from fedlore.stopping_rule import (  # the rule's own table of directions, without pydantic
    MAXIMIZED,
    MINIMIZED,
    PREFIXES,
    base_name,
    known_direction,
    mode_contradiction,
    unknown_score,
    watches_test,
)

__all__ = [
    "MAXIMIZED",
    "MINIMIZED",
    "PREFIXES",
    "EarlyStoppingConfig",
    "base_name",
    "known_direction",
    "mode_contradiction",
    "unknown_score",
    "watches_test",
]


class EarlyStoppingConfig(_Strict):
    """Early stopping and best-round model selection (:mod:`fedlore.engine.early_stopping`),
    the rule of Keras' and Lightning's ``EarlyStopping``: an evaluation *improves* when its
    ``metric`` is better than the best so far by more than ``min_delta``; the run stops after
    ``patience`` evaluations in a row without an improvement. Off unless ``metric`` is set.
    Choose on the *selection split* (``selection_<score>``, with ``data.selection_fraction``
    above 0): a metric of the test sets the run reports is refused unless ``allow_test`` is
    set. ``summary.json`` records ``stopped_round``, ``best_round`` and ``best_<metric>``."""

    metric: str | None = None
    """The per-round metric to watch: a key of ``metrics.jsonl`` the run records at every
    evaluation, e.g. ``selection_accuracy``, ``selection_loss`` (``selection_perplexity``,
    ``selection_rmse``, ``selection_<name>`` of ``eval.metrics``), or ``train_loss`` (the
    sampled clients' mean training loss, every round; needs ``eval.every: 1``, and clients
    release no loss under secure aggregation or DP). None: no early stopping (the default)."""
    mode: Literal["auto", "max", "min"] = "auto"
    """Whether larger (``max``) or smaller (``min``) values are better; ``auto`` knows
    fedlore's scores (accuracies, F1 and AUROC ``max``; losses, ECE, perplexity, RMSE and Brier
    ``min``) and refuses a metric registered by a plugin. An explicit mode against a score's
    known direction (``selection_loss`` with ``max``) is refused; a plugin's metric takes the
    mode given."""
    patience: int = Field(3, ge=1)
    """Evaluations in a row without an improvement after which the run stops (rounds with
    ``eval.every: 1``; a metric is recorded at every ``eval.every``-th round)."""
    min_delta: float = Field(0.0, ge=0.0)
    """An evaluation improves only when it beats the best so far by more than this (in the
    metric's own units; 0: any strict improvement)."""
    restore_best: bool = False
    """The run's result is its best round's model: ``final_*`` in ``summary.json`` are that
    round's evaluation (not the last round's), and its model is what
    :func:`fedlore.trained.load_trained` returns (kept, on the CPU, in ``checkpoint.pt``:
    one more copy of the server state). The run still trains until it stops or reaches
    ``rounds``."""
    allow_test: bool = False
    """Allow a metric of a test set the run reports (the central test set's ``accuracy``,
    ``loss``, ...; the clients' test splits' ``client_*``): selecting rounds on them inflates
    the reported scores. The run warns, and its summary says so (``early_stopping_on_test``).
    Never under DP for ``client_*``."""

    @model_validator(mode="after")
    def _consistent(self) -> EarlyStoppingConfig:
        if self.metric is None:
            given = [  # a setting of a rule that is off (its default is no setting)
                k
                for k in ("mode", "patience", "min_delta", "restore_best", "allow_test")
                if getattr(self, k) != type(self).model_fields[k].default
            ]
            if given:
                raise ValueError(
                    f"early_stopping.{given[0]} is set but early_stopping.metric is not: name "
                    "the metric to watch (e.g. early_stopping.metric=selection_accuracy)"
                )
            return self
        local = self.metric.startswith("local_")  # refused by the run's check: last round only
        if wrong := mode_contradiction("early_stopping", self.metric, self.mode):
            raise ValueError(wrong)
        if (  # a typo, or a plugin's metric: tune's wording (stopping_rule.unknown_score)
            self.mode == "auto"
            and not local
            and (wrong := unknown_score("early_stopping", self.metric, "early_stopping.mode"))
        ):
            raise ValueError(wrong)
        return self

    @property
    def enabled(self) -> bool:
        """Whether the run stops early (a ``metric`` is set)."""
        return self.metric is not None

    def direction(self) -> Literal["max", "min"]:
        """``mode`` resolved: ``max`` or ``min``."""
        if self.mode != "auto":
            return self.mode
        assert self.metric is not None
        return known_direction(self.metric) or "min"  # auto: a known score (the validator)
