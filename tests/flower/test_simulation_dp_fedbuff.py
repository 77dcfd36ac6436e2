"""DP-FedBuff (``asynchronous.buffer`` with ``dp.clip_norm``) on Flower's Simulation Engine,
under the simulated clock: the rows (accuracy, ε, clients, staleness, bytes), the model and the
clients' contribution counts are the in-process run's under ``dp.reproducible_noise``; with OS
noise the server draws the same noise calls from the privacy randomness as in process; a killed
simulation resumed from its checkpoint gives the uninterrupted rows, counts and ε (the DP ledger
counts no step: none was recorded after the checkpoint). One Ray serves the module."""

from __future__ import annotations

import json
import warnings
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
from fedlore.experiment_privacy import PrivacyWarning
from fedlore.flower.simulation import ray_session, run_simulated
from fedlore.privacy.buffer_dp import contribution_epsilon
from fedlore.privacy.randomness import SERVER, SecureSource, SeededSource

# one worker runs the whole module, so the module's one Ray starts once (spread over two
# pytest-xdist workers, each started its own)
pytestmark = [pytest.mark.flower, pytest.mark.xdist_group("ray-dp_fedbuff")]

DP_FEDBUFF = [
    "asynchronous.buffer=2",
    "clients.speed=lognormal",
    "clients.speed_spread=1.0",
    "eval.every=1",
    "weighting=uniform",
    "dp.clip_norm=0.5",
    "dp.noise_multiplier=1.0",
]
REPRODUCIBLE = "dp.reproducible_noise=true"
WALL_CLOCK = {"wall_s", "eval_s", "client_train_s"}


@pytest.fixture(scope="module", autouse=True)
def one_ray() -> Iterator[None]:
    with ray_session():
        yield


def _pair(tmp: Path, data: list[str], *extra: str, rounds: int = 4) -> tuple[Config, Config]:
    local, sim = (
        sim_cfg(tmp, engine, rounds, "fedavg", [*data, *DP_FEDBUFF, *extra])
        for engine in ("local", "sim")
    )
    return local, sim.model_copy(update={"engine": "flower-sim"})


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in WALL_CLOCK}


def _state(cfg: Config) -> Any:
    _, state, _ = Checkpointer.load(run_dir(cfg, "fedavg", 42) / "checkpoint.pt")
    return state


def test_dp_fedbuff_on_flower_sim_gives_the_in_process_rows_and_counts(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    local, sim = _pair(tmp_path, digits_npz, REPRODUCIBLE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)  # the no-privacy mode says so
        run_one(local, "fedavg", 42)
        summary = run_simulated(sim, "fedavg", 42)
    want, got = rows(local, "fedavg"), rows(sim, "fedavg")
    assert [_plain(r) for r in got] == [_plain(r) for r in want]  # accuracy, ε, bytes, clock
    assert all("dp_epsilon" in r and len(set(r["accepted_clients"])) == 2 for r in got)
    assert summary["dp_accounting"].startswith("per-client steps")
    a, b = _state(local), _state(sim)
    assert a.values["privacy.contributions"] == b.values["privacy.contributions"]
    keys = [k for k in a.arrays if k.startswith("model.")]
    assert keys and all(torch.equal(a.arrays[k], b.arrays[k]) for k in keys)


def test_the_simulations_noise_is_the_privacy_randomness_not_the_run_seed(
    tmp_path: Path, digits_npz: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """OS noise (the default): the server of the simulation draws one Gaussian per step from
    the privacy randomness (:class:`SecureSource`), the calls of the in-process run, and never
    from the seeded source; the schedule and ε are the in-process run's."""
    local, sim = _pair(tmp_path, digits_npz)
    calls: list[tuple[Any, ...]] = []
    honest = SecureSource.gaussian

    def noted(self: Any, n: int, std: float, rnd: int, client: int) -> Any:
        calls.append((n, std, rnd, client))
        return honest(self, n, std, rnd, client)

    def seeded(*args: Any) -> Any:
        raise AssertionError("DP-FedBuff noise drawn from the run seed")

    monkeypatch.setattr(SecureSource, "gaussian", noted)
    monkeypatch.setattr(SeededSource, "gaussian", seeded)
    run_one(local, "fedavg", 42)
    in_process, calls[:] = list(calls), []
    run_simulated(sim, "fedavg", 42)
    assert calls == in_process and len(calls) == 4
    assert [c[2:] for c in calls] == [(v, SERVER) for v in range(4)]
    keys = ("accepted_clients", "staleness", "dp_epsilon", "dp_contributions_max", "bytes_up")
    want, got = rows(local, "fedavg"), rows(sim, "fedavg")
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in want]
    assert got[-1]["accuracy"] != want[-1]["accuracy"] or _differs(local, sim)


def _differs(a: Config, b: Config) -> bool:
    x, y = _state(a), _state(b)
    return any(not torch.equal(x.arrays[k], y.arrays[k]) for k in x.arrays if k[:6] == "model.")


def test_a_killed_dp_fedbuff_simulation_resumed_gives_the_uninterrupted_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_npz: list[str]
) -> None:
    """SIGINT during step 2: two rows are kept; ``--resume`` continues the simulation from its
    checkpoint (the clients keep their states in the run folder), so its rows, ε included,
    model and contribution counts are the uninterrupted in-process run's: the step the kill
    discarded was never recorded, and the ledger counts no repeat."""
    local, sim = _pair(tmp_path, digits_npz, REPRODUCIBLE)
    step = buffered.BufferedLoop.run_round

    def signal_in_step_2(self: Any, state: Any, rnd: int, last: int) -> Any:
        out = step(self, state, rnd, last)
        if rnd == 2:
            monkeypatch.setattr(interrupt, "_received", 2)  # as the SIGINT handler does
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        monkeypatch.setattr(buffered.BufferedLoop, "run_round", signal_in_step_2)
        with pytest.raises(Interrupted):
            run_simulated(sim, "fedavg", 42)
        monkeypatch.setattr(interrupt, "_received", None)
        monkeypatch.setattr(buffered.BufferedLoop, "run_round", step)
        assert [r["round"] for r in rows(sim, "fedavg")] == [0, 1]
        summary = run_simulated(sim, "fedavg", 42, resume=True)
        run_one(local, "fedavg", 42)
    assert summary.get("dp_repeated_exchanges", 0) == 0
    want, got = rows(local, "fedavg"), rows(sim, "fedavg")
    assert [_plain(r) for r in got] == [_plain(r) for r in want]  # ε included
    for r in got:  # the most-counted client's steps, and no repeated one
        most = r["dp_contributions_max"]
        assert r["dp_epsilon"] == pytest.approx(contribution_epsilon(1.0, 1e-5, most))
    a, b = _state(local), _state(sim)
    assert a.values["privacy.contributions"] == b.values["privacy.contributions"]
    keys = [k for k in a.arrays if k.startswith("model.")]
    assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in keys)


class _Context:
    def __init__(self) -> None:
        self.run_config: dict[str, str] = {}


def test_a_deployment_refuses_dp_fedbuff_before_it_trains(
    tmp_path: Path, digits_npz: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deployed ServerApp logs the one-line refusal and trains nothing; FedBuff without DP
    and DP without FedBuff go on to train."""
    from fedlore.flower import app

    logged: list[str] = []
    trained: list[Config] = []
    monkeypatch.setattr(app, "server_main", lambda grid, cfg, *a, **k: trained.append(cfg))
    monkeypatch.setattr(app.logging.getLogger("flwr"), "error", lambda f, e: logged.append(str(e)))
    _, sim = _pair(tmp_path, digits_npz)
    deployed = sim.model_copy(update={"engine": "local"})  # as a flwr run config reads it
    for cfg in (deployed, _pair(tmp_path, digits_npz, "dp.clip_norm=null",
                                "dp.noise_multiplier=null")[1]):  # fmt: skip
        monkeypatch.setattr(app, "_from_run_config", lambda ctx, c=cfg: (c, "fedavg", 42))
        app._deployed_main(None, _Context())  # type: ignore[arg-type]
    assert len(logged) == 1 and logged[0].startswith(
        "asynchronous.buffer (FedBuff) with dp on a flwr run deployment: DP-FedBuff is tested"
    )
    assert len(trained) == 1 and not trained[0].dp.enabled


def test_a_killed_simulation_resumed_with_a_raised_cap_records_it_from_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_npz: list[str]
) -> None:
    """Cap 3, SIGINT during step 1, ``--resume`` with cap 4: the simulation continues after
    step 0 under the new cap, so its rows are those of the in-process run stopped after step 0
    at cap 3 and resumed at cap 4, and ``config.json`` records the change from round 1."""
    local3, sim3 = _pair(tmp_path, digits_npz, REPRODUCIBLE, "dp.max_contributions=3")
    sim4 = sim3.model_copy(update={"dp": sim3.dp.model_copy(update={"max_contributions": 4})})
    local4 = local3.model_copy(update={"dp": sim4.dp})
    step = buffered.BufferedLoop.run_round

    def signal_in_step_1(self: Any, state: Any, rnd: int, last: int) -> Any:
        out = step(self, state, rnd, last)
        if rnd == 1:
            monkeypatch.setattr(interrupt, "_received", 2)
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        monkeypatch.setattr(buffered.BufferedLoop, "run_round", signal_in_step_1)
        with pytest.raises(Interrupted):
            run_simulated(sim3, "fedavg", 42)
        monkeypatch.setattr(interrupt, "_received", None)
        monkeypatch.setattr(buffered.BufferedLoop, "run_round", step)
        summary = run_simulated(sim4, "fedavg", 42, resume=True)
        assert run_one(local3, "fedavg", 42, stop_after=0) is None
        run_one(local4, "fedavg", 42, resume=True)
    assert summary.get("dp_repeated_exchanges", 0) == 0 and summary["dp_max_contributions"] == 4
    record = json.loads((run_dir(sim4, "fedavg", 42) / "config.json").read_text())
    assert record["resume_changes"] == [{"round": 1, "dp.max_contributions": [3, 4]}]
    assert [_plain(r) for r in rows(sim4, "fedavg")] == [_plain(r) for r in rows(local4, "fedavg")]
