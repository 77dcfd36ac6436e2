"""FedBuff (``asynchronous.buffer``) on Flower's Simulation Engine.

Under the simulated clock (the default) Flower only carries each client's training: the buffer
fills in the order of the clients' configured speeds, so the simulated run's rows are the
in-process run's (accuracy, bytes, staleness, clock), its global model too, and a killed run
resumed with ``--resume`` gives the rows of an uninterrupted one. Under ``clock: wall`` the
buffer fills in the real arrival order of Flower's replies (:mod:`fedlore.flower.wallclock`).
One Ray serves the module (:func:`fedlore.flower.simulation.ray_session`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
import torch
from sim_helpers import rows, sim_cfg

from fedlore.config import Config
from fedlore.engine import buffered, interrupt
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.interrupt import Interrupted
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.flower.simulation import ray_session, run_simulated

# one worker runs the whole module, so the module's one Ray starts once (spread over two
# pytest-xdist workers, each started its own)
pytestmark = [pytest.mark.flower, pytest.mark.xdist_group("ray-fedbuff")]

# three clients in flight, a step every two arrivals, lognormal speeds: stale updates, and a
# fast client that starts twice from one version (its second start's generator is REPEAT + n)
FEDBUFF = [
    "asynchronous.buffer=2",
    "clients.speed=lognormal",
    "clients.speed_spread=1.0",
    "eval.every=1",
]
WALL_CLOCK = {"wall_s", "eval_s", "client_train_s"}


@pytest.fixture(scope="module", autouse=True)
def one_ray() -> Iterator[None]:
    with ray_session():
        yield


def _pair(tmp: Path, method: str, data: list[str], rounds: int = 4) -> tuple[Config, Config]:
    local, sim = (
        sim_cfg(tmp, engine, rounds, method, [*data, *FEDBUFF]) for engine in ("local", "sim")
    )
    return local, sim.model_copy(update={"engine": "flower-sim"})


def _same_model(local: Config, sim: Config, method: str) -> None:
    _, a, _ = Checkpointer.load(run_dir(local, method, 42) / "checkpoint.pt")
    _, b, _ = Checkpointer.load(run_dir(sim, method, 42) / "checkpoint.pt")
    keys = [k for k in a.arrays if k.startswith("model.")]
    assert keys
    for k in keys:
        torch.testing.assert_close(b.arrays[k], a.arrays[k], rtol=0, atol=0)


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in WALL_CLOCK}


@pytest.mark.parametrize("method", ["fedavg", "fedfull"])
def test_fedbuff_on_flower_sim_gives_the_in_process_rows(
    tmp_path: Path, method: str, digits_npz: list[str]
) -> None:
    local, sim = _pair(tmp_path, method, digits_npz)
    run_one(local, method, 42)
    summary = run_simulated(sim, method, 42)
    _same_model(local, sim, method)
    want, got = rows(local, method), rows(sim, method)
    assert [_plain(r) for r in got] == [_plain(r) for r in want]  # accuracy and clock included
    # on the wire: the recorded uploads, and those of the clients still in flight at the end
    # (trained when they started; no step used them)
    assert summary["wire_bytes_up_total"] > sum(r["bytes_up"] for r in got)
    assert any(r["staleness_max"] for r in want)  # stale updates were weighted
    repeated = [r for r in want if len(set(r["accepted_clients"])) < len(r["accepted_clients"])]
    assert repeated  # a client arrived twice in one step: it started twice from one version


def test_a_killed_fedbuff_simulation_resumed_gives_the_uninterrupted_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_npz: list[str]
) -> None:
    """SIGINT during server step 2 (the flag a signal sets): the simulation stops with two rows
    (the interrupted step is discarded);
    ``--resume`` continues it from its checkpoint, and its rows are those of the uninterrupted
    in-process run."""
    local, sim = _pair(tmp_path, "fedavg", digits_npz)
    step = buffered.BufferedLoop.run_round

    def signal_in_step_2(self: Any, state: Any, rnd: int, last: int) -> Any:
        out = step(self, state, rnd, last)
        if rnd == 2:
            monkeypatch.setattr(interrupt, "_received", 2)  # as the SIGINT handler does
        return out

    monkeypatch.setattr(buffered.BufferedLoop, "run_round", signal_in_step_2)
    with pytest.raises(Interrupted):
        run_simulated(sim, "fedavg", 42)
    monkeypatch.setattr(interrupt, "_received", None)
    monkeypatch.setattr(buffered.BufferedLoop, "run_round", step)
    assert [r["round"] for r in rows(sim, "fedavg")] == [0, 1]
    run_simulated(sim, "fedavg", 42, resume=True)
    run_one(local, "fedavg", 42)
    want, got = rows(local, "fedavg"), rows(sim, "fedavg")
    assert [_plain(r) for r in got] == [_plain(r) for r in want]


def test_fedbuff_on_the_wall_clock_fills_the_buffer_as_replies_arrive(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    """``clock: wall`` over Ray's actors: every step buffers K real arrivals, the clock in the
    rows is the real elapsed time, staleness is counted from each client's start version."""
    _, sim = _pair(tmp_path, "fedavg", digits_npz)
    wall = sim.model_copy(
        update={
            "asynchronous": sim.asynchronous.model_copy(update={"clock": "wall"}),
            "clients": sim.clients.model_copy(update={"speed": "equal"}),  # real speeds
        }
    )
    run_simulated(wall, "fedavg", 42)
    got = rows(wall, "fedavg")
    assert [r["round"] for r in got] == [0, 1, 2, 3]
    assert all(r["accepted"] == 2 and r["rejected"] == 0 for r in got)
    assert all("sim_time_s" not in r for r in got)
    clock = [r["elapsed_s"] for r in got]
    assert clock == sorted(clock) and clock[0] > 0
    assert all(len(r["staleness"]) == 2 and min(r["staleness"]) >= 0 for r in got)
    assert all(r["in_flight"] == 3 for r in got)
    assert got[-1]["accuracy"] > 0
