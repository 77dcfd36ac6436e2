"""Deprecated: the old experiment driver's names, from the modules that hold them now (issue 31:
:mod:`fedlore.experiment`, ``experiment_parts``, ``experiment_privacy``, ``checks``,
``engine.rundir``, ``results.summary``; engines: :data:`fedlore.cli.ENGINES`). Import from those:
patching a name here changes nothing there."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from fedlore.config import Config

_MOVED = {
    "fedlore.checks": "check_eval check_model_fits_data check_params check_privacy "
    "check_secure_round check_tokenizer_matches_model privacy_modes",
    "fedlore.engine.rundir": "DEFAULTS_CHANGED check_output_dir check_same_data make_output_dir "
    "recorded_threads resolved_hyper run_dir spill_dir",
    "fedlore.experiment": "run_one",
    "fedlore.experiment_parts": "describe_parameters global_local_metrics make_algorithm "
    "model_factory start_server",
    "fedlore.experiment_privacy": "NO_PRIVACY client_sampler make_privacy",
    "fedlore.results.summary": "SUMMARY_LAST final_value summarize",
}
_HOME = {name: module for module, names in _MOVED.items() for name in names.split()}


def __getattr__(name: str) -> Any:
    """An old name, from the module that holds it now."""
    if name in ("config_diff", "check_same_config"):  # now given the method builder
        from fedlore.engine import rundir
        from fedlore.experiment_parts import make_algorithm

        return functools.partial(getattr(rundir, name), make_algorithm=make_algorithm)
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def preflight(cfg: Config, fed: Any) -> None:
    """:func:`fedlore.checks.preflight` with the driver's builders, as the old driver ran it."""
    from fedlore import checks, experiment, experiment_parts

    build = experiment_parts.model_factory(cfg, fed, cfg.seeds[0])
    start = functools.partial(experiment.try_method, cfg, fed, build)
    for name, algo in checks.preflight(cfg, fed, build, start):
        experiment_parts.describe_parameters(name, algo, build())
        checks.warn_own_optimizer(cfg, name, algo)


def run_experiment(
    cfg: Config, resume: bool = False, overwrite: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """:func:`fedlore.experiment.run_experiment` on the config's engine."""
    from fedlore.cli import ENGINES
    from fedlore.experiment import run_experiment as run

    return run(cfg, resume, overwrite, engine=ENGINES[cfg.engine]())
