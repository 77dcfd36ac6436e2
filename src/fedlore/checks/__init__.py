"""Every refusal that spans several settings, and the one reader of what a method declares.

A config is checked before any run folder is looked at, so that the first error names the real
problem (a misspelt source or setting), not a folder in the way:

* names and method sections: every name the config gives is registered
  (:func:`name_problems`), a ``method.<name>`` section of a method not in ``algorithms`` names
  a registered method and only hyperparameters it has (:func:`unused_method_problems`), and a
  command-line ``method.<name>.*`` setting for a method the run leaves out is refused
  (:func:`check_overrides`);
* a method against the config: its overrides, ``robust.aggregate``, ``transport_dtype``,
  ``compression`` and clients per round (:func:`check_method_settings`,
  :func:`check_min_clients`), secure
  aggregation and DP (:func:`check_privacy`, :func:`check_secure_round`), the server's
  unlabeled set and regression data (:func:`server_data`);
* early stopping against the data and privacy: :func:`check_early_stopping`
  (:mod:`fedlore.checks.stopping`);
* the model against the data: :func:`check_model_fits_data`,
  :func:`check_tokenizer_matches_model`, :func:`check_eval`, :func:`check_params`,
  :func:`check_model_output`, and :func:`check_site_data`;
* :func:`preflight`: all of them for every method of an experiment on the real model, every
  problem at once, before any run folder is touched.

Three modules hold them: :mod:`fedlore.checks.methods` (names, overrides, each method against
the config, privacy), :mod:`fedlore.checks.compression` (upload compression, which
``check_method_settings`` asks) and :mod:`fedlore.checks.model_data` (the model against the
data, the preflight); everything is importable from here. The first two are the only readers
of a method's :class:`~fedlore.algorithm.Capabilities` (its
``capabilities`` record, and ``caps()`` where a value depends on hyperparameters): the refusals
above, the construction-time refusals of :func:`check_wire_settings` and
:func:`check_compression`, and the questions other modules ask (:func:`setup_rounds`,
:func:`is_sum_aggregable`, :func:`projects`, :func:`adapts`, :func:`keeps_layers_local`).
Whether a method has an ``optimizer`` setting is read here too (:func:`warn_own_optimizer`).
"""

from fedlore.checks.asynchronous import (
    asynchronous_problems,
    check_asynchronous,
    check_in_process,
)
from fedlore.checks.compression import Declares, check_compression
from fedlore.checks.methods import (
    NAMED,
    adapts,
    check_method_settings,
    check_min_clients,
    check_overrides,
    check_privacy,
    check_secure_round,
    check_wire_settings,
    is_sum_aggregable,
    keeps_layers_local,
    name_problems,
    override_problems,
    privacy_modes,
    projects,
    server_data,
    setup_rounds,
    unused_method_problems,
)
from fedlore.checks.model_data import (
    check_eval,
    check_model_fits_data,
    check_model_output,
    check_params,
    check_site_data,
    check_tokenizer_matches_model,
    preflight,
    warn_own_optimizer,
)
from fedlore.checks.stopping import (
    TestSelectionWarning,
    check_early_stopping,
    check_tune_metric,
    recorded_metrics,
    warn_test_selection,
)

__all__ = [
    "NAMED",
    "Declares",
    "TestSelectionWarning",
    "adapts",
    "asynchronous_problems",
    "check_asynchronous",
    "check_compression",
    "check_early_stopping",
    "check_eval",
    "check_in_process",
    "check_method_settings",
    "check_min_clients",
    "check_model_fits_data",
    "check_model_output",
    "check_overrides",
    "check_params",
    "check_privacy",
    "check_secure_round",
    "check_site_data",
    "check_tokenizer_matches_model",
    "check_tune_metric",
    "check_wire_settings",
    "is_sum_aggregable",
    "keeps_layers_local",
    "name_problems",
    "override_problems",
    "preflight",
    "privacy_modes",
    "projects",
    "recorded_metrics",
    "server_data",
    "setup_rounds",
    "unused_method_problems",
    "warn_own_optimizer",
    "warn_test_selection",
]
