"""Every registered algorithm on Flower's Simulation Engine (Ray backend) equals its in-process run.

Each method runs one simulated round (plus its setup exchange; FedLore, FedFull and Meta-BayFL
two): the global model and the byte counts must equal those of the in-process transport (same
seeds, same data, same ``client_update``). One Ray serves the whole module
(:func:`fedlore.flower.simulation.ray_session`, as ``fedlore run`` holds one around all its
runs; a simulation's actors are killed at its end, so each method starts in fresh worker
processes): a Ray start per method cost ~10 s of CI each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
from sim_helpers import assert_matches, sim_cfg

from fedlore import registry
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.flower.simulation import ray_session, run_simulated

pytestmark = pytest.mark.flower


@pytest.fixture(scope="module", autouse=True)
def one_ray() -> Iterator[None]:
    with ray_session():
        yield


# Variants that only switch hyperparameters of a class tested here run no transport-specific
# code of their own (each Ray start costs ~15 s of CI): FedProx is FedAvg with a loss term, and
# the Meta-BayFL family is one class (``meta_bayfl`` covers the BNN, the search, per-client
# learning rates in the reply metrics and the in-place model conversion on a fresh ClientApp).
SAME_CLASS_AS_TESTED = {"fedprox", "bayfl", "meta_bayfl_mcd", "fedavg_mcd", "meta_fl"}
# FedFull and FedAvg are compared with their in-process runs by the two-method experiment test
# (one Ray start for both: test_an_experiment_starts_ray_once_and_its_runs_equal_runs_alone)
IN_EXPERIMENT_TEST = {"fedfull", "fedavg"}


@pytest.mark.parametrize(
    ("method", "rounds"),
    [
        (m, 2 if m in ("fedlore", "fedfull", "meta_bayfl") else 1)
        for m in registry.names("algorithm")
        if m not in SAME_CLASS_AS_TESTED | IN_EXPERIMENT_TEST
    ],
)
def test_simulation_matches_in_process(
    tmp_path: Path, method: str, rounds: int, capfd: pytest.CaptureFixture[str]
) -> None:
    local = sim_cfg(tmp_path, "local", rounds, method)
    sim = sim_cfg(tmp_path, "sim", rounds, method)
    run_one(local, method, 42)
    summary = run_simulated(sim, method, 42)
    # Flower's DEBUG lines and deprecation notices go to the run's flower.log, not the console
    console = capfd.readouterr().err
    assert "DEBUG flwr" not in console and "DEPRECATED" not in console
    assert "flwr" in (run_dir(sim, method, 42) / "flower.log").read_text()
    assert_matches(local, sim, method, summary)
