"""The ε of a whole DP experiment: every method x seed it trains reads the same clients' data.

Each run's ``dp_epsilon`` is the ε of that run's models and rows alone. An experiment with
several methods or seeds trains several runs on one data set (a seed's partition may give a
person's records to another client, but they are the same records), and whoever sees all of
their results holds every run's releases: they compose. :func:`warn_many_releases` says so at
start with the composed ε (:func:`~fedlore.privacy.composition.composed_epsilon`, as
``fedlore tune`` composes its trials), so that a table of several DP runs is not read as if its
per-run ε covered it.
"""

from __future__ import annotations

from collections.abc import Mapping

from fedlore.algorithm import Algorithm
from fedlore.checks import setup_rounds
from fedlore.config import Config
from fedlore.experiment_privacy import _privacy_warning, dp_noise_multiplier
from fedlore.privacy.composition import Exchanges, composed_epsilon


def experiment_epsilon(cfg: Config, algos: Mapping[str, Algorithm]) -> tuple[float, float]:
    """``(largest ε of one run, ε of every run composed)`` at ``dp.delta`` for the methods
    ``algos`` (name -> algorithm) over ``cfg.seeds``, each run counted at all its exchanges.
    Against a party that knows the sample under local DP or FedBuff (no amplification), as the
    runs themselves report."""
    per_round = cfg.clients_per_round()
    if cfg.dp.mode == "local" or cfg.asynchronous.enabled:
        per_round = cfg.num_clients
    parts = []
    for algo in algos.values():
        setup = setup_rounds(algo)
        sigma = dp_noise_multiplier(cfg, setup)
        parts.append(Exchanges(sigma, cfg.num_clients, per_round, cfg.rounds + setup))
    acc, delta = cfg.dp.accountant, cfg.dp.delta
    one = max(composed_epsilon([p], delta, accountant=acc) for p in parts)
    return one, composed_epsilon(parts * len(cfg.seeds), delta, accountant=acc)


def warn_many_releases(cfg: Config, algos: Mapping[str, Algorithm]) -> None:
    """A :class:`~fedlore.experiment_privacy.PrivacyWarning` when a DP experiment trains more
    than one run (methods x seeds), naming the ε of all of them together."""
    runs = len(algos) * len(cfg.seeds)
    if not cfg.dp.enabled or runs < 2:
        return
    one, total = experiment_epsilon(cfg, algos)
    _privacy_warning(
        f"DP: this experiment trains {runs} runs ({len(algos)} method(s) x {len(cfg.seeds)} "
        f"seed(s)) on the same clients' data; each run's ε (up to {one:.4g}) covers its own "
        f"models and rows only, and publishing all of them spends ε = {total:.4g} at "
        f"δ = {cfg.dp.delta:g} (the runs composed). Publish one run per data set, or quote "
        "the composed ε"
    )
