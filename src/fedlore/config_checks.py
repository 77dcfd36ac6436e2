"""Checks of a whole config that run before any run folder is looked at, so that the first
error is the real problem (a misspelt source or setting), not a run folder in the way.

* :func:`name_problems`: every name the config gives (``data.name``, ``partition.name``,
  ``model.name``) is registered;
* :func:`unused_method_problems`: a ``method.<name>`` section of a method that is not in
  ``algorithms`` (a config file may keep settings for methods a command line leaves out) names
  a registered method and only hyperparameters it has;
* :func:`override_problems`: a ``method.<name>.*`` setting given on the command line for a
  method that is not in ``algorithms`` is refused: it would change nothing (a typo, or a
  method left out by mistake).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fedlore import registry
from fedlore.config import Config, ConfigError

NAMED = (("data.name", "source"), ("partition.name", "partition"), ("model.name", "model"))
"""Config keys that name a registered entry, with the registry kind."""


def _names(cfg: Config) -> str:
    """``algorithms`` as the command line spells it: ``[fedfull, fedlore]``."""
    return f"[{', '.join(cfg.algorithms)}]"


def name_problems(cfg: Config) -> list[str]:
    """``key: unknown <kind> ...; registered: [...]`` for every name of :data:`NAMED` that is
    not registered."""
    problems = []
    for key, kind in NAMED:
        section, field = key.split(".")
        try:
            registry.get(kind, getattr(getattr(cfg, section), field))
        except KeyError as e:
            problems.append(f"{key}: {e.args[0] if e.args else e}")
    return problems


def unused_method_problems(cfg: Config) -> list[str]:
    """Problems of the ``method`` sections of methods not in ``algorithms``: an unknown method,
    or keys that are not hyperparameters of the method (the sections of the run's methods are
    checked in full when the methods are built)."""
    problems = []
    for name, settings in cfg.method.items():
        if name in cfg.algorithms:
            continue
        try:
            cls = registry.get("algorithm", name)
        except KeyError as e:
            problems.append(f"method.{name}: {e.args[0] if e.args else e}")
            continue
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - fields)
        if unknown:
            problems.append(
                f"method.{name}: {cls.__name__} has no hyperparameter(s) {unknown}; known: "
                f"{sorted(fields)} ({name} is not in algorithms {_names(cfg)} either)"
            )
    return problems


def override_problems(cfg: Config, overrides: Sequence[str]) -> list[str]:
    """One line for every ``key=value`` override of ``method.<name>`` (or of the whole
    ``method`` section) that sets a method not in ``cfg.algorithms``."""
    problems = []
    for item in overrides:
        key = item.partition("=")[0].strip()
        parts = key.split(".")
        if parts[0] != "method":
            continue
        names = [parts[1]] if len(parts) > 1 else list(cfg.method)
        for name in names:
            if name not in cfg.algorithms:
                problems.append(
                    f"{item}: method {name!r} is not in algorithms {_names(cfg)}, so the "
                    f"setting would change nothing; add {name} to algorithms or drop the setting"
                )
    return problems


def check_overrides(cfg: Config, overrides: Sequence[str]) -> None:
    """Refuse command-line settings of methods the run does not include.

    Raises:
        ConfigError: listing every such override (:func:`override_problems`).
    """
    problems = override_problems(cfg, overrides)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("invalid overrides:\n  " + "\n  ".join(problems))
