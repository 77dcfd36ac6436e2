"""Flower Simulation Engine (Ray backend) vs the in-process transport.

Every registered algorithm runs through one simulated Flower round (plus its setup exchange),
and FedLore and FedFull run two rounds; the global model and the byte counts must equal those of
the in-process transport (same seeds, same data, same ``client_update``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
import torch

from fedlore import registry
from fedlore.config import Config, load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.flower.simulation import run_simulated

pytestmark = pytest.mark.flower

SMALL = [
    "num_clients=3",
    "local_steps=2",
    "batch_size=16",
    "progress=false",
    "lr=0.01",
    "model.kwargs={hidden: [16]}",
    "flower.num_cpus=2",
]


def _cfg(tmp: Path, engine: str, rounds: int, method: str) -> Config:
    # a method that distils on the server (FedBE) needs the server's unlabeled set U
    needs_u = registry.get("algorithm", method).capabilities.server_data
    return load_config(
        None,
        [
            *SMALL,
            *(["data.server_fraction=0.2"] if needs_u else []),
            f"rounds={rounds}",
            f"algorithms=[{method}]",
            f"output_dir={tmp / engine}",
        ],
    )


def _rows(cfg: Config, method: str) -> list[dict]:
    path = run_dir(cfg, method, 42) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    local = _cfg(tmp_path, "local", rounds, method)
    sim = _cfg(tmp_path, "sim", rounds, method)
    run_one(local, method, 42)
    summary = run_simulated(sim, method, 42)
    # Flower's DEBUG lines and deprecation notices go to the run's flower.log, not the console
    console = capfd.readouterr().err
    assert "DEBUG flwr" not in console and "DEPRECATED" not in console
    assert "flwr" in (run_dir(sim, method, 42) / "flower.log").read_text()
    assert_matches(local, sim, method, summary)


def assert_matches(local: Config, sim: Config, method: str, summary: dict[str, Any]) -> None:
    """The simulated run of ``method`` ended with the in-process run's global model and bytes."""
    _, s_local, _ = Checkpointer.load(run_dir(local, method, 42) / "checkpoint.pt")
    _, s_sim, _ = Checkpointer.load(run_dir(sim, method, 42) / "checkpoint.pt")
    model_keys = [k for k in s_local.arrays if k.startswith("model.")]
    assert model_keys and set(model_keys) <= set(s_sim.arrays)
    for k in model_keys:
        torch.testing.assert_close(s_sim.arrays[k], s_local.arrays[k], rtol=1e-5, atol=1e-6)
    rows_local, rows_sim = _rows(local, method), _rows(sim, method)
    assert [r["round"] for r in rows_sim] == [r["round"] for r in rows_local]
    for a, b in zip(rows_local, rows_sim, strict=True):
        assert (a["bytes_up"], a["bytes_down"]) == (b["bytes_up"], b["bytes_down"])
        assert b["rejected"] == 0
    # bytes measured on the wire (numpy payload + header) sit next to our accounting
    ours_up = sum(r["bytes_up"] for r in rows_sim)
    assert ours_up <= summary["wire_bytes_up_total"] <= ours_up * 1.05 + 10_000


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
    a, b = _rows(local, "fedlore"), _rows(sim, "fedlore")
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
