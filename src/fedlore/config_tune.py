"""The ``tune`` section of :class:`fedlore.config_model.Config`: the hyperparameter search of
``fedlore tune`` (:mod:`fedlore.tune`), and the grammar of its search space (import the section
from :mod:`fedlore.config`). ``fedlore run`` reads none of it, and a run's results do not depend
on it (it is not part of a run's recorded config).

A dimension of the space is ``KEY=SPEC`` on the command line (``--space``) or ``KEY: SPEC`` under
``tune.space``; ``KEY`` is a config key as ``key=value`` overrides write it (``lr``,
``data.noise``, ``method.fedlore.rank``) and ``SPEC`` one of:

* ``log:LOW:HIGH``: a float, log-uniform on [LOW, HIGH] (0 < LOW < HIGH);
* ``float:LOW:HIGH``: a float, uniform on [LOW, HIGH] (LOW < HIGH);
* ``int:LOW:HIGH``: an integer of LOW..HIGH, both included (LOW < HIGH);
* ``cat:A,B,...``: one of at least two distinct choices (numbers, ``true``/``false``,
  ``null`` or words).
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, Field, model_validator

from fedlore.config_stopping import MAXIMIZED, base_name, mode_contradiction, unknown_score
from fedlore.registry import did_you_mean
from fedlore.settings import StrictModel as _Strict

KINDS = ("log", "float", "int", "cat")
"""The kinds of a dimension, as ``SPEC`` begins."""

NOT_SEARCHED = {
    "name": "the search names each trial's folder",
    "output_dir": "the search puts each trial under output_dir/name/tune",
    "seeds": "the search runs one seed (tune.run_seed)",
    "algorithms": "the search tunes one method (tune.method)",
    "method": "name one setting, method.<name>.<setting>",
    "tune": "the search's own settings",
    "imports": "code to import, not a hyperparameter",
    "progress": "it does not change a result",
    "device": "it does not change a result",
    "threads": "it does not change a result",
    "checkpoint": "a trial must be resumable",
    "engine": "it does not change a result",
    "data.selection_fraction": "the objective is scored on that split",
    "dp.noise_multiplier": "a search scored by accuracy picks the least privacy; fix the privacy "
    "level in the config",
    "dp.epsilon": "a search scored by accuracy picks the least privacy; fix the privacy level "
    "in the config",
    "dp.delta": "a search scored by accuracy picks the least privacy; fix the privacy level in "
    "the config",
    "dp.mode": "a search scored by accuracy picks the weaker guarantee; fix it in the config",
    "dp.audit": "the audit measures a run, it does not train one",
}
"""Config keys a search may not vary, and why."""

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


@dataclass(frozen=True)
class Dim:
    """One dimension of a search space.

    Attributes:
        key: the config key it sets (``lr``, ``method.fedlore.rank``).
        kind: ``log``, ``float``, ``int`` or ``cat``.
        low, high: the range (``log``, ``float``, ``int``; None for ``cat``).
        choices: the choices of ``cat`` (empty otherwise).
        spec: the ``SPEC`` as given.
    """

    key: str
    kind: str
    low: float | int | None
    high: float | int | None
    choices: tuple[Any, ...]
    spec: str

    def extremes(self) -> tuple[Any, ...]:
        """The values the config must accept for the dimension to be searched: its bounds, or
        every choice."""
        return self.choices if self.kind == "cat" else (self.low, self.high)

    def grid(self) -> list[Any] | None:
        """Every value of a finite dimension (``int``, ``cat``); None for a continuous one."""
        if self.kind == "cat":
            return list(self.choices)
        if self.kind == "int":
            assert isinstance(self.low, int) and isinstance(self.high, int)
            return list(range(self.low, self.high + 1))
        return None


def _number(text: str, kind: str) -> float | int:
    """A bound of ``SPEC`` (an integer for ``int``, a finite float otherwise).

    Raises:
        ValueError: naming the text.
    """
    text = text.strip()
    if kind == "int":
        if not _INT.fullmatch(text):
            raise ValueError(f"int bounds are integers, got {text!r}")
        return int(text)
    if not _FLOAT.fullmatch(text):
        raise ValueError(f"{kind} bounds are numbers, got {text!r}")
    return float(text)


def _choice(text: str) -> Any:
    """One choice of ``cat:``: an integer, a float (``1e-3`` too, which YAML 1.1 reads as text),
    ``true``/``false``/``null``, or a word."""
    text = text.strip()
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    value = yaml.safe_load(text) if text else None
    if text and (value is None or isinstance(value, bool | str | int | float)):
        return value
    raise ValueError(
        f"a choice is a number, true, false, null or a word, got {text!r} (choices are "
        "separated by commas)"
    )


def parse_dim(key: str, spec: str) -> Dim:
    """The dimension ``KEY=SPEC``.

    Raises:
        ValueError: a malformed spec, LOW >= HIGH, LOW <= 0 for ``log``, fewer than two
            distinct choices; the message says what a spec looks like.
    """
    kind, sep, rest = str(spec).partition(":")
    if not sep or kind not in KINDS:
        raise ValueError(
            "not a search range: write log:LOW:HIGH, float:LOW:HIGH, int:LOW:HIGH or "
            "cat:A,B,... (e.g. lr=log:1e-4:1e-1)"
        )
    if kind == "cat":
        choices = tuple(_choice(c) for c in rest.split(","))
        distinct = {(type(c), c) for c in choices}
        if len(distinct) < len(choices):
            raise ValueError("a choice is given twice")
        if len(choices) < 2:
            raise ValueError("give at least two choices (one is no search)")
        return Dim(key, kind, None, None, choices, str(spec))
    parts = rest.split(":")
    if len(parts) != 2:
        raise ValueError(f"write {kind}:LOW:HIGH (two bounds)")
    low, high = (_number(p, kind) for p in parts)
    if not low < high:
        raise ValueError("LOW must be below HIGH")
    if kind == "log" and low <= 0:
        raise ValueError("a log range needs LOW above 0")
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError("the bounds must be finite")
    return Dim(key, kind, low, high, (), str(spec))


def _valid_spec(spec: str) -> str:
    parse_dim("KEY", spec)
    return spec


Spec = Annotated[str, AfterValidator(_valid_spec)]


def key_problem(model: type[BaseModel], key: str) -> str | None:
    """Why the config ``model`` (:class:`~fedlore.config_model.Config`) cannot search ``key``:
    an unknown key (with the nearest known one), a section, a key no search may vary
    (:data:`NOT_SEARCHED`); None when it can. ``method.<name>.<setting>`` is checked when the
    method is built (:mod:`fedlore.tune`), and the keys below a free mapping (``model.kwargs``)
    when the trial's model is."""
    parts = key.split(".")
    if key in NOT_SEARCHED or parts[0] in ("tune", "imports"):
        return f"not searched: {NOT_SEARCHED.get(key) or NOT_SEARCHED[parts[0]]}"
    if parts[:2] == ["dp", "audit"]:
        return f"not searched: {NOT_SEARCHED['dp.audit']}"
    if parts[0] == "method":
        if len(parts) != 3 or not all(parts):
            return "a method's setting is written method.<name>.<setting>"
        return None
    current: Any = model
    for i, part in enumerate(parts):
        fields = current.model_fields
        if part not in fields:
            where = ".".join(parts[:i])
            known = f" of {where}" if where else ""
            return f"unknown key{known}{did_you_mean(part, fields)}"
        annotation = fields[part].annotation
        sections = [
            a
            for a in (annotation, *typing.get_args(annotation))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        rest = parts[i + 1 :]
        if sections and not rest:
            first = next(iter(sections[0].model_fields))
            return f"{key} is a section: name one of its keys (e.g. {key}.{first})"
        if not sections:
            mapping = typing.get_origin(annotation) is dict or annotation is dict
            if rest and not mapping:
                return f"{'.'.join(parts[: i + 1])} is not a section"
            return None
        current = sections[0]
    return None  # pragma: no cover - the loop returns


class TuneConfig(_Strict):
    """The hyperparameter search of ``fedlore tune`` (:doc:`/how-to/tune`): Optuna's sampler
    proposes settings from ``space``, each trial trains ``method`` for ``run_seed`` under
    ``output_dir/name/tune/trial-<n>/``, and the trial's final ``metric`` on the selection
    split is the objective. The command line's options (``--space``, ``--trials``, ...) set
    these keys; ``fedlore run`` ignores the section, and no run's results depend on it."""

    space: dict[str, Spec] = Field(default_factory=dict)
    """The search space: config key -> range, as ``--space KEY=SPEC`` gives it: ``log:LOW:HIGH``
    (a float, log-uniform), ``float:LOW:HIGH``, ``int:LOW:HIGH`` (both bounds included) or
    ``cat:A,B,...``; e.g. ``{lr: "log:1e-4:1e-1", "method.fedlore.rank": "cat:4,8,16"}``."""
    trials: int = Field(20, ge=1)
    """How many trials the search runs in all (finished, pruned and failed ones count); a
    search continued with more runs only the new ones. The grid sampler runs at most its grid."""
    metric: str = "selection_accuracy"
    """The objective: a score of the selection split (``selection_accuracy``,
    ``selection_loss``, ``selection_perplexity``, ``selection_rmse``, ``selection_<name>`` of
    ``eval.metrics``), its final value in the trial's ``summary.json`` (the best round's with
    ``early_stopping.restore_best``). A score of a test set the run reports is refused."""
    mode: Literal["auto", "max", "min"] = "auto"
    """Whether the metric is maximized or minimized; ``auto`` knows fedlore's scores (as
    ``early_stopping.mode``)."""
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    """Optuna's sampler: ``tpe`` (the tree-structured Parzen estimator; random for its first 10
    trials), ``random``, or ``grid`` (every combination of ``int`` and ``cat`` dimensions, in
    an order shuffled by ``seed``)."""
    seed: int = 0
    """The search seed: the sampler's proposals are a function of it, the trial's number and the
    trials before (never of a run's seed, and never any privacy randomness)."""
    method: str | None = None
    """The method to tune; None: the config's one method (a config of several names one)."""
    run_seed: int | None = None
    """The seed every trial trains with; None: the config's first seed."""
    prune: Literal["none", "median"] = "none"
    """``median``: stop a trial after an evaluation whose ``metric`` is worse than the median of
    the earlier trials' at the same round (Optuna's ``MedianPruner``); the trial is recorded as
    pruned, its folder keeping its rows and checkpoint. On ``engine: local`` and ``flower-sim``
    (whose ServerApp reports each round from this process)."""
    prune_startup_trials: int = Field(5, ge=0)
    """Trials that finish before any is pruned (Optuna's ``n_startup_trials``)."""
    prune_warmup_rounds: int = Field(0, ge=0)
    """Rounds of a trial before it may be pruned (Optuna's ``n_warmup_steps``)."""
    workers: int = Field(1, ge=1)
    """Trials trained at once, each in a process of its own (in process only, ``engine:
    local``). The sampler proposes them together, before any of them trains, from the trials
    finished before them (TPE counts the ones proposed beside them as running); a trial is
    pruned by comparison with those earlier trials alone. So a search gives the same trials
    for the same ``workers`` however fast each trial runs, and one (the default) is the
    sequential search. Each process takes an equal share of the CPUs under ``threads: auto``."""
    search_privacy_accounted: bool = False
    """Under DP, each trial's ``dp_epsilon`` covers that trial only: the search spends the
    composition of every trial's exchanges, which ``fedlore tune`` computes and records in
    ``best.json`` (``dp_epsilon_of_search``) and warns of before it starts (a
    ``PrivacyWarning``, with the ε of ``trials`` trials of the config's exchanges) unless this
    is true: set it when you have accounted for the search's privacy yourself (or tune on data
    whose privacy is not at stake). The ε is computed and recorded either way."""

    @model_validator(mode="after")
    def _consistent(self) -> TuneConfig:
        if self.prune == "none":
            given = [
                k
                for k in ("prune_startup_trials", "prune_warmup_rounds")
                if getattr(self, k) != type(self).model_fields[k].default
            ]
            if given:
                raise ValueError(
                    f"tune.{given[0]} is set but tune.prune is none: set tune.prune=median "
                    "(--prune median)"
                )
        if wrong := mode_contradiction("tune", self.metric, self.mode):
            raise ValueError(f"{wrong} (the search would keep the worst trial)")
        if self.mode == "auto" and (
            wrong := unknown_score("tune", self.metric, "tune.mode (--mode)")
        ):
            raise ValueError(wrong)  # a typo, or a plugin's metric: early stopping's wording
        return self

    def dims(self) -> tuple[Dim, ...]:
        """The space's dimensions, in the order given."""
        return tuple(parse_dim(k, v) for k, v in self.space.items())

    def direction(self) -> Literal["max", "min"]:
        """``mode`` resolved: ``max`` or ``min``."""
        if self.mode != "auto":
            return self.mode
        return "max" if _score(self.metric) in MAXIMIZED else "min"


def _score(metric: str) -> str:
    """The score a metric names, without its split (``selection_``, ``client_``, ``local_``)."""
    return base_name(metric.removeprefix("local_"))
