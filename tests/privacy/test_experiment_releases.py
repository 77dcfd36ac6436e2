"""A DP experiment of several methods x seeds: every run reads the same clients' data, so the
runs' releases compose. `fedlore run` warns at start with the composed ε, which must be what
dp-accounting gives for every run's exchanges (each run's own ε covers that run only)."""

from __future__ import annotations

import warnings
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting.rdp import RdpAccountant

from fedlore.checks import setup_rounds
from fedlore.config import Config, load_config
from fedlore.experiment_parts import make_algorithm
from fedlore.experiment_privacy import PrivacyWarning, dp_noise_multiplier
from fedlore.experiment_releases import experiment_epsilon, warn_many_releases
from fedlore.progress import command

QUICKSTART = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"
DP = ["dp.clip_norm=0.5", "dp.epsilon=4.0", "dp.delta=1e-5", "weighting=uniform", "rounds=5"]


def _cfg(*extra: str) -> Config:
    return load_config(QUICKSTART, [*DP, *extra])


def _algos(cfg: Config) -> dict:
    return {m: make_algorithm(m, cfg) for m in cfg.algorithms}


def _direct(cfg: Config, algos: dict, sampled: bool) -> float:
    """dp-accounting called directly: every run's exchanges as GaussianDpEvent(σ/2) under
    replace-one (a client moves the sum by 2C), composed over methods and seeds."""
    acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    for _ in cfg.seeds:
        for algo in algos.values():
            setup = setup_rounds(algo)
            event = dp_accounting.GaussianDpEvent(dp_noise_multiplier(cfg, setup) / 2)
            if sampled:
                per = cfg.clients_per_round()
                event = dp_accounting.SampledWithoutReplacementDpEvent(cfg.num_clients, per, event)
            acc.compose(event, cfg.rounds + setup)
    return float(acc.get_epsilon(cfg.dp.delta))


def test_two_methods_and_two_seeds_compose_as_dp_accounting_says() -> None:
    cfg = _cfg("algorithms=[fedfull,fedlore_sketch]", "seeds=[42,43]")
    algos = _algos(cfg)
    assert [setup_rounds(a) for a in algos.values()] == [0, 1]  # the runs differ in exchanges
    one, total = experiment_epsilon(cfg, algos)
    assert one == pytest.approx(4.0, rel=1e-3)  # each run at its target (solved from below)
    assert total == pytest.approx(_direct(cfg, algos, sampled=False), rel=1e-9)
    assert total > 2 * one  # four runs: far above any one run's ε


def test_local_dp_counts_every_exchange_without_amplification() -> None:
    """Local DP (and FedBuff) report ε without amplification by sampling: so does the sum."""
    cfg = _cfg("algorithms=[fedfull]", "seeds=[42,43]", "participation=0.5", "dp.mode=local")
    algos = _algos(cfg)
    assert experiment_epsilon(cfg, algos)[1] == pytest.approx(
        _direct(cfg, algos, sampled=False), rel=1e-9
    )
    central = _cfg("algorithms=[fedfull]", "seeds=[42,43]", "participation=0.5")
    assert experiment_epsilon(central, algos)[1] < _direct(central, algos, sampled=False)


def test_the_warning_names_the_composed_epsilon_and_only_for_several_dp_runs() -> None:
    cfg = _cfg("algorithms=[fedfull]", "seeds=[42,43,44]")
    algos = _algos(cfg)
    total = experiment_epsilon(cfg, algos)[1]
    with command(), pytest.warns(PrivacyWarning) as caught:
        warn_many_releases(cfg, algos)
    (w,) = caught
    assert str(w.message).startswith(
        "DP: this experiment trains 3 runs (1 method(s) x 3 seed(s)) on the same clients' data; "
        "each run's ε (up to 4) covers its own models and rows only, and publishing all of them "
        f"spends ε = {total:.4g} at δ = 1e-05 (the runs composed)"
    )
    for quiet in (_cfg("algorithms=[fedfull]"), load_config(QUICKSTART, ["seeds=[42,43]"])):
        with command(), warnings.catch_warnings():
            warnings.simplefilter("error")
            warn_many_releases(quiet, _algos(quiet))  # one DP run, or no DP: nothing to say


def test_the_largest_single_run_epsilon_is_named() -> None:
    """At a fixed σ the run with a setup exchange spends more: the warning names the larger."""
    cfg = load_config(
        QUICKSTART,
        [*DP, "dp.epsilon=null", "dp.noise_multiplier=3", "algorithms=[fedfull,fedlore_sketch]"],
    )
    one, _ = experiment_epsilon(cfg, _algos(cfg))
    direct = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    direct.compose(dp_accounting.GaussianDpEvent(1.5), cfg.rounds + 1)  # fedlore_sketch's
    assert one == pytest.approx(direct.get_epsilon(cfg.dp.delta), rel=1e-9)


def test_fedlore_run_warns_before_training(tmp_path: Path) -> None:
    """`run_experiment` (what `fedlore run` calls) says it for a two-seed DP experiment."""
    from fedlore.experiment import run_experiment

    cfg = _cfg(
        "algorithms=[fedfull]", "seeds=[42,43]", "rounds=1", "local_steps=1", "progress=false",
        "num_clients=3", "model.kwargs.hidden=[8]", f"output_dir={tmp_path}",
    )  # fmt: skip
    with pytest.warns(PrivacyWarning, match=r"DP: this experiment trains 2 runs"):
        run_experiment(cfg)
