"""Flower Simulation Engine (Ray backend) vs the in-process transport.

Every registered algorithm runs through one simulated Flower round (plus its setup exchange),
and FedLore and FedFull run two rounds; the global model and the byte counts must equal those of
the in-process transport (same seeds, same data, same ``client_update``).
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
from fedlore.flower.simulation import run_simulated

pytestmark = pytest.mark.flower


def test_pretraining_simulation_matches_in_process(tmp_path: Path) -> None:
    """LLaMA on the C4 fixture (source groups, per-client streams, perplexity) over Flower."""
    c4 = Path(__file__).parents[1] / "fixtures" / "c4"
    pre = [
        "data.name=c4",
        f"data.root={c4}",
        "data.max_length=16",
        "data.vocab_size=300",
        "partition.name=source_dirichlet",
        "model.name=llama",
        "model.kwargs={size: micro, hidden: 32, intermediate: 64, heads: 2}",
        "rank=4",
        "batch_size=4",
    ]
    runs = {}
    for engine in ("local", "sim"):
        cfg = load_config(
            None,
            [
                *SMALL[:-2],
                *pre,
                "flower.num_cpus=2",
                "rounds=2",
                "algorithms=[fedlore]",
                f"output_dir={tmp_path / engine}",
            ],
        )
        summary = (
            run_one(cfg, "fedlore", 42) if engine == "local" else run_simulated(cfg, "fedlore", 42)
        )
        assert summary is not None
        runs[engine] = summary
    assert runs["sim"]["final_perplexity"] == pytest.approx(runs["local"]["final_perplexity"])
    assert runs["sim"]["bytes_up_total"] == runs["local"]["bytes_up_total"]


def test_simulation_carries_diagnostics(tmp_path: Path) -> None:
    """FedLore's candidate gradients cross Flower's wire; the diagnostics equal in-process ones."""
    extra = ["diagnostics.every=1", "diagnostics.batch_size=16"]
    local = load_config(None, [*SMALL, "rounds=2", f"output_dir={tmp_path / 'l'}", *extra])
    sim = load_config(None, [*SMALL, "rounds=2", f"output_dir={tmp_path / 's'}", *extra])
    run_one(local, "fedlore", 42)
    run_simulated(sim, "fedlore", 42)
    a, b = rows(local, "fedlore"), rows(sim, "fedlore")
    assert a[1]["diag_bytes_up"] == b[1]["diag_bytes_up"] > 0  # round 0 uploads H_i
    for key in ("diag.retained_energy", "diag.rho2", "diag.d_r", "diag.certificate2"):
        assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-4), key


def test_an_experiment_starts_ray_once_and_its_runs_equal_runs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
    tiny = [*SMALL, "rounds=2", "algorithms=[fedfull, fedavg]"]
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


# Ctrl-C and SIGTERM during a simulation (exit status, no spoiled round, no Ray process left):
# tests/reliability/test_interrupts.py
