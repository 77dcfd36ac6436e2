"""``fedlore tune``: a hyperparameter search of one method on the selection split, planned and
checked here (:func:`plan_search`), run by :func:`fedlore.tune_study.run_search` on Optuna.

The protocol is :doc:`/how-to/lr-sweep`'s, for any settings: every trial trains the config's
one method (``tune.method``) for one seed (``tune.run_seed``, default the config's first) at
the settings Optuna's sampler proposes from the search space (``tune.space``, ``--space``);
the objective is the trial's final score on the selection split (``tune.metric``, default
``selection_accuracy``: :func:`fedlore.checks.check_tune_metric` refuses a test set's). The
best trial's settings are then run for every seed with the ``fedlore run`` command
:func:`run_command` writes.

Everything that can refuse a search is checked here, before any folder is made: the space's
keys (:func:`fedlore.config_tune.key_problem`) and each dimension's bounds or choices against
the config's own validation and the method's (:func:`dimension_problem`), the metric, one
method, the sampler against the space. Nothing here imports Optuna.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedlore import registry
from fedlore.checks import check_overrides, check_tune_metric
from fedlore.config import Config, ConfigError, apply_overrides, effective_overrides, validate
from fedlore.config_tune import Dim
from fedlore.config_unset import FOLDERS_RECORD, resolved_folders, same_folder
from fedlore.data.federation import build_federation
from fedlore.engine.run_record import result_settings
from fedlore.experiment_parts import check_config, make_algorithm
from fedlore.experiment_privacy import PrivacyWarning
from fedlore.progress import warn_once
from fedlore.settings import STEP_PAIR, LocalTraining, config_paths
from fedlore.tune_privacy import planned

TUNE_DIR = "tune"
"""The search's folder under ``output_dir/name``."""

GOLDEN = 0.381966011250105
"""Where inside a float range :func:`dimension_problem` also tries a value (a point no bound
of a config's field sits at, and no integer in practice: a float range over an integer
setting is refused)."""


@dataclass(frozen=True)
class Search:
    """A checked search (:func:`plan_search`).

    Attributes:
        cfg: the config as given (its ``tune`` section is the search's settings).
        base: the raw config every trial starts from: no ``tune`` section, the one method,
            the one seed.
        config: the config file as the command line named it (None: the defaults).
        overrides: the command line's ``key=value`` overrides.
        method: the method searched.
        run_seed: the seed every trial trains with.
        dims: the search space.
        folder: ``output_dir/name/tune``.
    """

    cfg: Config
    base: dict[str, Any]
    config: str | None
    overrides: tuple[str, ...]
    method: str
    run_seed: int
    dims: tuple[Dim, ...]
    folder: Path

    @property
    def metric(self) -> str:
        """The objective's metric (``tune.metric``)."""
        return self.cfg.tune.metric

    @property
    def direction(self) -> str:
        """``max`` or ``min``."""
        return self.cfg.tune.direction()

    @property
    def trials(self) -> int:
        """How many trials the search runs in all: ``tune.trials``, at most the grid's size
        under the grid sampler."""
        n = self.cfg.tune.trials
        grid = self.grid()
        return n if grid is None else min(n, math.prod(len(v) for v in grid.values()))

    def grid(self) -> dict[str, list[Any]] | None:
        """The grid sampler's space (None under another sampler)."""
        if self.cfg.tune.sampler != "grid":
            return None
        return {d.key: d.grid() or [] for d in self.dims}


def scalar(value: Any) -> str:
    """``value`` as the text of a ``key=value`` override that reads back as exactly ``value``
    (YAML 1.1, as overrides are read: ``1e-05`` is written ``1.0e-05``, a word that YAML would
    read as something else is quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)  # the shortest text that reads back as the same float
        mantissa, e, exponent = text.partition("e")
        if e and "." not in mantissa:
            text = f"{mantissa}.0e{exponent}"
        return text
    text = str(value)
    return text if yaml.safe_load(text) == text and "," not in text else json.dumps(text)


def override(key: str, value: Any) -> str:
    """The ``key=value`` override that sets ``key`` to ``value``."""
    return f"{key}={scalar(value)}"


def _only_problem(e: Exception, key: str) -> str:
    """The line of a refusal that names ``key`` (or its first line), without the ``invalid
    config:`` heading."""
    text = str(e.args[0] if e.args else e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].endswith(":") and len(lines) > 1:
        lines = lines[1:]
    named = [line for line in lines if line.startswith(key)]
    return (named or lines or [type(e).__name__])[0]


def overriding_key(
    cls: type, name: str, section: dict[str, Any], path: str
) -> tuple[str, str] | None:
    """(the key of ``section``, method class ``cls``'s ``method.<name>`` settings, that
    :func:`~fedlore.settings.build_hyper` lays over the setting it reads from config ``path``,
    that setting): the method never sees ``path``'s value (``local_epochs`` also replaces
    ``local_steps`` and the reverse); None when no key does."""
    holds_train = any(f.name == "train" for f in dataclasses.fields(cls))
    paths = (config_paths(LocalTraining) if holds_train else {}) | config_paths(cls)
    for setting, where in paths.items():
        if where != path:
            continue
        if setting in section:
            return setting, setting
        pair = STEP_PAIR.get(setting) if holds_train else None
        if pair is not None and pair in section:
            return pair, setting
    return None


def dimension_problem(base: dict[str, Any], method: str, dim: Dim) -> str | None:
    """Why the config ``base`` (raw, one method) cannot take every value of ``dim``: a
    ``method.<name>.*`` key of another method, a key the method's own ``method.<name>``
    section overrides (:func:`overriding_key`: every trial would train the same), or a
    bound, a choice or (for a float range) a value inside the range that the config's
    validation or the method's refuses; None when it can. Only these values are tried:
    settings whose valid values are not one range may still fail in a trial (recorded as
    failed)."""
    parts = dim.key.split(".")
    if parts[0] == "method" and parts[1] != method:
        return f"the search tunes {method}: write method.{method}.{parts[2]}"
    sections = base.get("method")
    section = sections.get(method) if isinstance(sections, dict) else None
    if parts[0] != "method" and isinstance(section, dict):
        found = overriding_key(registry.get("algorithm", method), method, section, dim.key)
        if found is not None:
            by, setting = found
            return (
                f"method.{method}.{by}={scalar(section[by])} in the config overrides "
                f"{dim.key} for {method}, so every trial would train with it: search "
                f"method.{method}.{setting} instead, or drop method.{method}.{by} from the config"
            )
    values = list(dim.extremes())
    if dim.kind in ("log", "float"):
        assert isinstance(dim.low, float) and isinstance(dim.high, float)
        if dim.kind == "log":
            values.append(dim.low * (dim.high / dim.low) ** GOLDEN)
        else:
            values.append(dim.low + (dim.high - dim.low) * GOLDEN)
    for value in values:
        try:
            cfg = validate(apply_overrides(base, [override(dim.key, value)]))
            make_algorithm(method, cfg)
        except (ValueError, KeyError) as e:  # ConfigError is a ValueError
            why = _only_problem(e, dim.key)
            if dim.kind in ("log", "float") and "integer" in why:
                why += "; an integer setting takes int:LOW:HIGH"
            return f"{dim.key}={scalar(value)} is refused: {why}"
    return None


def _method(cfg: Config) -> str:
    """The method the search tunes: ``tune.method``, or the config's one method.

    Raises:
        ConfigError: the config runs several and ``tune.method`` is not set.
    """
    if cfg.tune.method is not None:
        return cfg.tune.method
    if len(cfg.algorithms) > 1:
        raise ConfigError(
            f"fedlore tune tunes one method, and the config runs {len(cfg.algorithms)} "
            f"({', '.join(cfg.algorithms)}): name one with --method (tune.method)"
        )
    return cfg.algorithms[0]


SEARCH_PRIVACY = (
    "dp is on: the search's trials train on the same clients' data, so its ε is the "
    "composition of every DP exchange of every trial it runs (finished, pruned, failed, "
    "resumed), larger than any one trial's dp_epsilon. {trials} trial(s) of {exchanges} "
    "exchange(s) each at this config's settings spend ε = {epsilon:.4g} at δ = {delta:g}{known}; "
    "best.json records the search's measured ε (dp_epsilon_of_search). Tune on data whose "
    "privacy is not at stake, or, having accounted for it, set "
    "tune.search_privacy_accounted=true to silence this warning"
)
"""The :class:`~fedlore.experiment_privacy.PrivacyWarning` of a search under DP: the ε that
:func:`fedlore.tune_privacy.planned` composes for ``tune.trials`` trials of the config's
exchanges."""


def search_privacy_warning(one: Config, method: str, trials: int) -> str:
    """:data:`SEARCH_PRIVACY` for ``trials`` trials of the config ``one`` (its one method).

    Raises:
        ConfigError: ``dp.epsilon`` cannot be reached (every trial would fail).
    """
    try:
        plan = planned(one, method, trials)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    known = ""
    if plan.sample_known is not None:
        known = f" ({plan.sample_known:.4g} against a party that knows each round's sample)"
    if plan.local:
        known = " for a client in every exchange (local DP)"
    return SEARCH_PRIVACY.format(
        trials=trials,
        exchanges=plan.exchanges // max(trials, 1),
        epsilon=plan.epsilon,
        delta=plan.delta,
        known=known,
    )


def plan_search(
    cfg: Config, raw: dict[str, Any], config: str | None = None, overrides: tuple[str, ...] = ()
) -> Search:
    """Check the search that ``cfg`` (validated from ``raw``) describes and return it; nothing
    is written. Warns (:class:`~fedlore.experiment_privacy.PrivacyWarning`) under DP unless
    ``tune.search_privacy_accounted``.

    Args:
        config: the config file as named on the command line (for :func:`run_command`).
        overrides: the command line's ``key=value`` overrides (likewise).

    Raises:
        ConfigError: no search space; no selection split; several methods and no
            ``tune.method``; a dimension the config or the method refuses (one line each);
            a continuous dimension under the grid sampler; pruning or several workers off the
            in-process engine;
            the config's own problems (:func:`~fedlore.experiment_parts.check_config`); a
            metric that is not a selection-split score the run records.
    """
    tune = cfg.tune
    dims = tune.dims()
    if not dims:
        raise ConfigError(
            "no search space: give --space KEY=SPEC (e.g. --space lr=log:1e-4:1e-1) or "
            "tune.space in the config"
        )
    method = _method(cfg)
    run_seed = tune.run_seed if tune.run_seed is not None else cfg.seeds[0]
    base = {k: v for k, v in copy.deepcopy(raw).items() if k != "tune"}
    base.update(algorithms=[method], seeds=[run_seed])
    one = validate(base)
    check_overrides(one, list(overrides))  # method.<other>.* on the command line
    check_config(one)  # names, method settings: every problem at once, before the space's
    problems = [
        f"search space {d.key}={d.spec}: {why}"
        for d in dims
        if (why := dimension_problem(base, method, d)) is not None
    ]
    if problems:
        raise ConfigError(
            problems[0]
            if len(problems) == 1
            else "invalid search space:\n  " + "\n  ".join(problems)
        )
    if tune.sampler == "grid":
        continuous = [f"{d.key}={d.spec}" for d in dims if d.grid() is None]
        if continuous:
            raise ConfigError(
                f"the grid sampler needs finite dimensions (int: or cat:), not "
                f"{', '.join(continuous)}: e.g. lr=cat:1e-3,3e-3,1e-2, or --sampler tpe"
            )
    if tune.workers > 1 and cfg.engine != "local":
        raise ConfigError(
            f"--workers {tune.workers} (tune.workers) needs engine: local: each trial trains in "
            f"a process of its own; engine {cfg.engine} runs its clients on Flower's engines "
            "already"
        )
    check_tune_metric(one, build_federation(one, run_seed), tune.metric)
    folder = Path(cfg.output_dir) / cfg.name / TUNE_DIR
    search = Search(cfg, base, config, tuple(overrides), method, run_seed, dims, folder)
    if cfg.dp.enabled and not tune.search_privacy_accounted:
        warn_once(search_privacy_warning(one, method, search.trials), PrivacyWarning)
    return search


def trial_config(search: Search, number: int, params: dict[str, Any]) -> Config:
    """The config of trial ``number`` at ``params`` (config key -> value): the search's base
    with each value set as its override, in ``output_dir/name/tune`` as experiment
    ``trial-<number>``.

    Raises:
        ConfigError: when the config refuses the combination.
    """
    raw = apply_overrides(search.base, [override(k, v) for k, v in params.items()])
    raw.update(output_dir=str(search.folder), name=f"trial-{number}")
    return validate(raw)


def run_command(search: Search, params: dict[str, Any]) -> str:
    """The ``fedlore run`` command that runs every seed of the config at ``params`` (the
    command line's overrides but the search's own, then the method, then ``params``), each key
    once (:func:`~fedlore.config.effective_overrides`)."""
    args = ["fedlore", "run"]
    if search.config is not None:
        args.append(search.config)
    args += [o for o in search.overrides if o.partition("=")[0].split(".")[0] != "tune"]
    if list(search.cfg.algorithms) != [search.method]:
        args.append(f"algorithms={search.method}")
    args += [override(k, v) for k, v in params.items()]
    return shlex.join(effective_overrides(args))  # each key once, with the value it takes


def seeds_note(search: Search) -> str:
    """How the search's seed (``tune.run_seed``, ``--run-seed``) stands to the seeds of the
    config, which :func:`run_command` runs, in words for ``best.json`` and the command's last
    lines. A seed the config does not list is accepted: the trials' folders are the search's
    own (``tune/trial-<n>/``, one experiment each), never runs of the experiment, so no report
    of it pools a trial with its runs; its runs are then of seeds the choice never saw."""
    seeds = ", ".join(str(s) for s in search.cfg.seeds)
    if search.run_seed in search.cfg.seeds:
        return (
            f"the trials trained seed {search.run_seed}, one of the config's seeds ({seeds}): "
            "its run is of the seed the settings were chosen on"
        )
    return (
        f"the trials trained seed {search.run_seed}, which the config's seeds ({seeds}) leave "
        "out: the command's runs are of seeds the choice never saw, and the trials stay in "
        f"{search.folder}/, out of the experiment's report"
    )


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _folders_resolved(record: dict[str, Any]) -> dict[str, Any]:
    """A search record with its settings' data folders in the place of their paths."""
    out = {k: v for k, v in record.items() if k != FOLDERS_RECORD}
    if isinstance(settings := out.get("settings"), dict):
        out["settings"] = settings = dict(settings)
        same_folder(settings, record.get(FOLDERS_RECORD))
    return out


def search_record(search: Search) -> dict[str, Any]:
    """What a search is, as its study keeps it (``study.db``): the settings that decide the
    trials' results but the searched ones (with the data folders they name,
    :data:`~fedlore.config_unset.FOLDERS_RECORD`), and the search's own. A search continues
    only under the same record (:func:`record_diff`); ``tune.trials`` may change."""
    tune = search.cfg.tune
    settings = _flat(result_settings(validate(search.base), search.method))
    searched = [
        d.key.replace(f"method.{search.method}.", "method.", 1)
        if d.key.startswith("method.")
        else d.key
        for d in search.dims
    ]
    settings = {
        k: v
        for k, v in settings.items()
        if not any(k == s or k.startswith(f"{s}.") for s in searched)
    }
    record = {
        "settings": settings,
        FOLDERS_RECORD: resolved_folders(settings),
        "space": {d.key: d.spec for d in search.dims},
        "metric": tune.metric,
        "direction": search.direction,
        "method": search.method,
        "run_seed": search.run_seed,
        "sampler": tune.sampler,
        "seed": tune.seed,
        "prune": tune.prune,
        "prune_startup_trials": tune.prune_startup_trials,
        "prune_warmup_rounds": tune.prune_warmup_rounds,
    }
    return dict(json.loads(json.dumps(record)))


def record_diff(before: dict[str, Any], now: dict[str, Any]) -> str:
    """``key: before -> now`` for the first five keys whose values differ (and how many
    more); empty when none does. ``data.root`` and ``data.tokenizer`` are compared as the
    folders they name (:func:`~fedlore.config_unset.same_folder`; a study recorded before
    fedlore 2026-12-06 has its relative paths taken from the working folder now)."""
    a, b = (_flat(_folders_resolved(r)) for r in (before, now))
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    items = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:5]]
    if len(keys) > 5:
        items.append(f"{len(keys) - 5} more")
    return ", ".join(items)
