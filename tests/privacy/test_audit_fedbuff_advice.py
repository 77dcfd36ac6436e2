"""The few-canaries advice (:func:`fedlore.experiment_privacy.warn_few_canaries`) under
DP-FedBuff: the claim it reads a sound canary's estimate against is the least ``dp_epsilon``
the run can report (no amplification; the most-counted client is in at least ⌈T·K / N⌉ steps),
not the synchronous sampled accountant's; the canary's own rate is
⌊k·K / N⌋ / k, drawn per step apart from the speeds."""

from __future__ import annotations

import math
import warnings

import pytest

from fedlore import progress
from fedlore.config import Config, ConfigError, load_config
from fedlore.experiment_privacy import AuditWarning, fedbuff_claim, warn_few_canaries
from fedlore.privacy.buffer_dp import contribution_epsilon
from fedlore.privacy.canaries import canaries_per_round
from fedlore.privacy.dp import epsilon_spent
from fedlore.privacy.empirical_error import canaries_for, sound_canary

# 10 clients, K = 5 a step, 9 steps at σ = 6: a client is in at least ⌈45 / 10⌉ = 5 steps
BASE = ["num_clients=10", "rounds=9", "weighting=uniform", "dp.clip_norm=1",
        "dp.noise_multiplier=6", "asynchronous.buffer=5", "asynchronous.concurrency=10",
        "dp.audit.unseen=0"]  # fmt: skip
SIGMA, DELTA = 6.0, 1e-5


def _cfg(*extra: str) -> Config:
    return load_config(None, [*BASE, *extra])


def _advice(cfg: Config) -> list[str]:
    progress._SAID.clear()  # warned once per process: show each here
    rate = canaries_per_round(cfg.dp.audit.canaries, 10, 5) / cfg.dp.audit.canaries
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", AuditWarning)
        warn_few_canaries(cfg, rate, SIGMA, 0)
    return [str(w.message) for w in got if w.category is AuditWarning]


def test_the_claim_is_the_least_epsilon_the_run_can_report() -> None:
    cfg = _cfg("dp.audit.canaries=100")
    assert fedbuff_claim(cfg, SIGMA, 0) == contribution_epsilon(SIGMA, DELTA, 5)
    assert fedbuff_claim(cfg, SIGMA, 2) == contribution_epsilon(SIGMA, DELTA, 7)  # setup
    capped = _cfg("dp.audit.canaries=100", "dp.max_contributions=9", "rounds=17")  # ⌈8.5⌉
    assert fedbuff_claim(capped, SIGMA, 0) == contribution_epsilon(SIGMA, DELTA, 9)
    # the synchronous advice read it against 9 rounds of all 10 clients: a larger ε
    assert epsilon_spent(SIGMA, DELTA, 9, 10, 10) > fedbuff_claim(cfg, SIGMA, 0)


def test_the_advice_names_the_canaries_the_fedbuff_claim_needs() -> None:
    """The count the synchronous claim found enough is too few against the FedBuff claim: the
    run warns, naming the count for its own claim and the canary's rate, and that many pass."""
    shift, spread = sound_canary(9, 0.5, SIGMA)
    sync = canaries_for(shift, spread, epsilon_spent(SIGMA, DELTA, 9, 10, 10), DELTA)
    enough = canaries_for(shift, spread, contribution_epsilon(SIGMA, DELTA, 5), DELTA)
    assert sync < enough
    even = 2 * math.ceil(sync / 2)  # an even k: ⌊k·5/10⌋ / k = 0.5 exactly
    (message,) = _advice(_cfg(f"dp.audit.canaries={even}"))
    assert "above the least dp_epsilon this DP-FedBuff run can report = " in message
    named = int(message.split("use at least ")[1].split(" ")[0].replace(",", ""))
    assert named == canaries_for(shift, spread, contribution_epsilon(SIGMA, DELTA, 5), DELTA)
    assert _advice(_cfg(f"dp.audit.canaries={2 * math.ceil(named / 2)}")) == []


def test_too_few_canaries_for_a_step_of_k_clients_are_refused() -> None:
    """k·K < N would insert no canary a step: refused naming K, not the synchronous round."""
    why = r"with 2 of 10 clients a step \(asynchronous.buffer\) would insert ⌊4 · 2 / 10⌋ = 0"
    with pytest.raises(ConfigError, match=why + r" canaries per round.*use at least 5"):
        _cfg("dp.audit.canaries=4", "asynchronous.buffer=2")
    _cfg("dp.audit.canaries=5", "asynchronous.buffer=2")
