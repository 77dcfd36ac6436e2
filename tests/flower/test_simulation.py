"""``fedlore run`` on Flower's Simulation Engine (Ray backend): one Ray for an experiment's runs,
each run equal to its in-process run, no Ray process left at the end.

Every registered algorithm, a pre-training run and FedLore's diagnostics against their
in-process runs: ``test_simulation_methods.py`` (one Ray for the whole module; this test needs
its own: it checks that the experiment starts and stops Ray itself).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")

from sim_helpers import SMALL, assert_matches, rows

from fedlore.config import load_config
from fedlore.experiment import run_one

pytestmark = pytest.mark.flower


def test_an_experiment_starts_ray_once_and_its_runs_equal_runs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_npz: list[str]
) -> None:
    """``fedlore run`` on flower-sim: one Ray for both methods (Flower's backend would shut it
    down after each), each method's run equal to its in-process run (nothing of the first run's
    actors reaches the second), and no Ray process left once the experiment ends."""
    import ray

    from fedlore.cli import ENGINES
    from fedlore.engine.interrupt import Process, alive
    from fedlore.experiment import run_experiment
    from fedlore.flower import simulation

    inits: list[int] = []
    listed: list[Process] = []
    init, stop = ray.init, simulation.stop_ray

    def spy_init(*args: Any, **kwargs: Any) -> Any:
        inits.append(1)
        return init(*args, **kwargs)

    def spy_stop(seen: list[Process]) -> None:
        listed.extend(seen)  # Ray's processes, listed while it still ran
        stop(seen)

    monkeypatch.setattr(ray, "init", spy_init)
    monkeypatch.setattr(simulation, "stop_ray", spy_stop)
    # two actors (one CPU each): clients of one round run in two processes at once
    tiny = [*SMALL, *digits_npz, "rounds=2", "algorithms=[fedfull, fedavg]", "flower.client_cpus=1"]
    tiny += ["eval.local=true", "eval.metrics=[brier]"]  # P-local metrics cross Flower's wire
    sim = load_config(None, [*tiny, "engine=flower-sim", f"output_dir={tmp_path / 'sim'}"])
    got = run_experiment(sim, engine=ENGINES["flower-sim"]())
    assert len(inits) == 1 and not ray.is_initialized()
    assert listed and not simulation.ray_processes()
    deadline = time.monotonic() + 3  # killed: gone a moment later
    while [p for p in listed if alive(p)]:
        assert time.monotonic() < deadline, [p for p in listed if alive(p)]
        time.sleep(0.1)
    local = load_config(None, [*tiny, f"output_dir={tmp_path / 'local'}"])
    for method in ("fedfull", "fedavg"):
        run_one(local, method, 42)
        assert_matches(local, sim, method, got[method][0])
        want, have = rows(local, method)[-1], rows(sim, method)[-1]
        assert have["local_clients"] == want["local_clients"] == 3
        assert have["local_brier"] == pytest.approx(want["local_brier"], rel=1e-5)


# Ctrl-C and SIGTERM during a simulation (exit status, no spoiled round, no Ray process left):
# tests/reliability/test_interrupts.py
