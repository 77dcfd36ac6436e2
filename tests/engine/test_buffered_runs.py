"""FedBuff runs end to end (``asynchronous.*``, :mod:`fedlore.engine.buffered`): equal to
synchronous FedAvg where it must be, the server step it takes, kill-and-resume, determinism, and
what the config refuses."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.checks import check_in_process
from fedlore.config import Config, ConfigError, load_config
from fedlore.engine.buffered import AsyncState, buffered_loop, staleness_weight
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.loop import RoundLoop
from fedlore.engine.rundir import run_dir
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import build, run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.tensors import select
from fedlore.types import Broadcast, Reply, State

SMALL = ["num_clients=6", "local_steps=3", "batch_size=16", "progress=false", "lr=0.05",
         "model.kwargs={hidden: [16]}", "algorithms=[fedavg]", "rounds=4"]  # fmt: skip
SEED = 42


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(None, [*SMALL, f"output_dir={out}", *extra])


def _rows(cfg: Config, method: str = "fedavg") -> list[dict[str, Any]]:
    path = run_dir(cfg, method, SEED) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _server(cfg: Config, method: str = "fedavg") -> dict[str, torch.Tensor]:
    _, state, _ = Checkpointer.load(run_dir(cfg, method, SEED) / "checkpoint.pt")
    return state.arrays


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """A row without its wall-clock measurements (sim_time_s is simulated: kept)."""
    return {k: v for k, v in row.items() if k not in ("wall_s", "eval_s", "client_train_s")}


@pytest.mark.parametrize("server", [[], ["server.optimizer=adam", "server.lr=0.01"]])
def test_all_clients_as_buffer_equal_speeds_and_constant_weights_is_synchronous_fedavg(
    tmp_path: Path, server: list[str]
) -> None:
    sync = _cfg(tmp_path / "sync", *server)
    buff = _cfg(
        tmp_path / "buff", *server, "asynchronous.buffer=6", "asynchronous.concurrency=6",
        "asynchronous.staleness=constant",
    )  # fmt: skip
    run_one(sync, "fedavg", SEED)
    run_one(buff, "fedavg", SEED)
    a, b = _server(sync), _server(buff)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = ("accuracy", "loss", "train_loss", "accepted_clients", "bytes_up", "bytes_down")
    for ra, rb in zip(_rows(sync), _rows(buff), strict=True):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
        assert rb["staleness"] == [0] * 6


def _parts(cfg: Config, method: str = "fedavg") -> tuple[Any, LocalTransport, State]:
    exp = build(cfg, method, SEED)
    store = ClientStore(None, None, exp.device)
    clients = LocalTransport(exp.algorithm, exp.fed.client, exp.model_factory, SEED, store)
    return exp, clients, exp.state


def test_buffer_equal_to_concurrency_equal_to_the_sampled_clients_is_fedavg_on_them(
    tmp_path: Path,
) -> None:
    # C = K = 3 of 6, equal speeds, constant weights: FedAvg over the clients FedBuff drew
    cfg = _cfg(
        tmp_path, "participation=0.5", "asynchronous.buffer=3", "asynchronous.staleness=constant"
    )
    exp, clients, state = _parts(cfg)
    loop = buffered_loop(cfg, exp.algorithm, clients, exp.fed.client, SEED, AsyncState())
    rows = []
    for r in range(4):
        state, row = loop.run_round(state, r, 3)
        rows.append(row)
    assert len({tuple(r["accepted_clients"]) for r in rows}) > 1  # not the same three each time
    exp2, clients2, state2 = _parts(cfg)
    sync = RoundLoop(exp2.algorithm, clients2, lambda r: sorted(rows[r]["accepted_clients"]))
    state2 = sync.run(state2, 0, 4)
    assert all(torch.equal(state.arrays[k], state2.arrays[k]) for k in state.arrays)


class Recording(LocalTransport):
    """The in-process transport, keeping every reply with the version its client started from."""

    log: list[tuple[int, int, Reply]]

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out = super().send(rnd, messages)
        for cid, msg in messages.items():
            res = out[cid]
            assert isinstance(res, Reply)
            self.log.append((cid, int(msg.config["round"]), res))
        return out


def test_the_global_model_moves_by_eta_times_the_buffers_staleness_weighted_mean(
    tmp_path: Path,
) -> None:
    # lognormal speeds, K = 2 of C = 4 in flight, uniform weighting: θ' = θ + η (1/K) Σ w(s)Δ
    eta = 0.7
    cfg = _cfg(
        tmp_path, "clients.speed=lognormal", "clients.speed_spread=1.0", "weighting=uniform",
        f"server.lr={eta}", "asynchronous.buffer=2", "asynchronous.concurrency=4",
    )  # fmt: skip
    exp = build(cfg, "fedavg", SEED)
    clients = Recording(
        exp.algorithm, exp.fed.client, exp.model_factory, SEED, ClientStore(None, None, "cpu")
    )
    clients.log = []
    loop = buffered_loop(cfg, exp.algorithm, clients, exp.fed.client, SEED, AsyncState())
    state = exp.state
    used: set[int] = set()
    stale = 0
    for r in range(6):
        before = select(state.arrays, "model.")
        state, row = loop.run_round(state, r, 5)
        after = select(state.arrays, "model.")
        want = {k: v.double().clone() for k, v in before.items()}
        for cid, s in zip(row["accepted_clients"], row["staleness"], strict=True):
            stale += s
            i = next(
                i for i, (c, v, _) in enumerate(clients.log)
                if i not in used and c == cid and v == r - s
            )  # fmt: skip
            used.add(i)
            delta = select(clients.log[i][2].arrays, "update.")
            for k in delta:
                want[k] += eta * staleness_weight(s, "sqrt") * delta[k].double() / 2
        for k in want:
            if k in select(clients.log[0][2].arrays, "update."):
                torch.testing.assert_close(after[k].double(), want[k], rtol=0, atol=1e-6)
    assert stale > 0  # stale updates were weighted


def test_a_killed_run_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    extra = ["clients.speed=lognormal", "asynchronous.buffer=2", "asynchronous.concurrency=4",
             "rounds=6"]  # fmt: skip
    whole = _cfg(tmp_path / "whole", *extra)
    run_one(whole, "fedavg", SEED)
    cut = _cfg(tmp_path / "cut", *extra)
    assert run_one(cut, "fedavg", SEED, stop_after=2) is None
    raw = torch.load(run_dir(cut, "fedavg", SEED) / "checkpoint.pt", weights_only=True)
    # in flight with their replies: the 4 less the clients of the group that filled the
    # buffer, whose replacements start when the next step begins (here 1)
    assert len(raw["asynchronous"]["flights"]) == 3
    assert any(f["version"] < 3 for f in raw["asynchronous"]["flights"])
    run_one(cut, "fedavg", SEED, resume=True)
    assert [_plain(r) for r in _rows(cut)] == [_plain(r) for r in _rows(whole)]
    a, b = _server(whole), _server(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert max(r["staleness_max"] for r in _rows(whole)) > 0


def test_the_same_seed_gives_the_same_run_and_another_seed_another(tmp_path: Path) -> None:
    extra = ["clients.speed=lognormal", "asynchronous.buffer=2", "asynchronous.concurrency=3"]
    one, two = _cfg(tmp_path / "1", *extra), _cfg(tmp_path / "2", *extra)
    run_one(one, "fedavg", SEED)
    run_one(two, "fedavg", SEED)
    assert [_plain(r) for r in _rows(one)] == [_plain(r) for r in _rows(two)]
    other = _cfg(tmp_path / "3", *extra, "seeds=[7]")
    run_one(other, "fedavg", 7)
    got = [json.loads(x) for x in (run_dir(other, "fedavg", 7) / "metrics.jsonl").open()]
    assert [r["accepted_clients"] for r in got] != [r["accepted_clients"] for r in _rows(one)]


@pytest.mark.parametrize("method", ["fedprox", "fedfull"])
def test_fedprox_and_fedfull_run_buffered(tmp_path: Path, method: str) -> None:
    cfg = _cfg(tmp_path, f"algorithms=[{method}]", "rounds=2", "asynchronous.buffer=2")
    summary = run_one(cfg, method, SEED)
    assert summary is not None and math.isfinite(summary["final_loss"])
    assert all(len(r["accepted_clients"]) == 2 for r in _rows(cfg, method))


def test_concurrency_defaults_to_the_clients_per_round(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "participation=0.5", "asynchronous.buffer=2")
    assert cfg.async_concurrency() == 3
    assert _cfg(tmp_path, "asynchronous.buffer=2", "asynchronous.concurrency=4")\
        .async_concurrency() == 4  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["asynchronous.buffer=4", "asynchronous.concurrency=3"], "K <= C <= N"),
        (["asynchronous.buffer=2", "asynchronous.concurrency=7"], "K <= C <= N"),
        (["asynchronous.buffer=4", "participation=0.5"], "K <= C <= N"),
        (["asynchronous.buffer=0"], "greater than or equal to 1"),
        (["asynchronous.concurrency=3"], "asynchronous.buffer is not"),
        (["asynchronous.buffer=2", "asynchronous.clock=sundial"], "clock"),
        (["asynchronous.buffer=2", "asynchronous.flight_timeout_s=5"], "clock is simulated"),
        (
            ["asynchronous.buffer=2", "asynchronous.clock=wall", "asynchronous.flight_timeout_s=0"],
            "greater than 0",
        ),
        (["asynchronous.clock=wall"], "asynchronous.buffer is not"),
        (["asynchronous.buffer=2", "asynchronous.staleness=linear"], "staleness"),
        (["asynchronous.buffer=2", "asynchronous.max_staleness=-1"], "max_staleness"),
        (["asynchronous.buffer=2", "asynchronous.wait=1"], "wait"),
    ],
)
def test_the_section_validates(tmp_path: Path, extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, *extra)


@pytest.mark.parametrize("extra", [[], ["asynchronous.buffer=2"]], ids=["off", "on"])
def test_a_config_recorded_with_its_defaults_validates_again(
    tmp_path: Path, extra: list[str]
) -> None:
    """A Flower engine passes the config on, and config.json records it, with every default
    written out: the section's defaults are not settings "set without a buffer"."""
    from fedlore.config import validate

    cfg = _cfg(tmp_path, *extra)
    assert validate(json.loads(cfg.model_dump_json())) == cfg


@pytest.mark.parametrize(
    ("method", "extra", "message"),
    [
        ("fedlore", [], "shared basis P"),
        ("scaffold", [], "control variates assume synchronous rounds"),
        ("fedit", [], "weighted mean of plain model deltas"),
        ("moon", [], "fedfull, fedavg and fedprox only"),
        ("fedavg", ["secure_aggregation=true"], "secure_aggregation: "),
        (
            "fedavg",
            ["dp.clip_norm=1", "dp.noise_multiplier=1", "weighting=uniform", "dp.mode=local"],
            "dp.mode=local: ",
        ),  # central DP runs: DP-FedBuff
        ("fedavg", ["compression.kind=topk"], "compression=topk"),
        ("fedavg", ["robust.aggregate=median"], "robust_aggregate=median"),
        ("fedavg", ["clients.dropout=0.1"], "clients.dropout or clients.round_deadline_s"),
        ("fedavg", ["clients.round_deadline_s=1.0"], "clients.dropout or clients.round_deadline"),
        ("fedavg", ["attack.kind=scale", "attack.fraction=0.2"], "attack: "),
        ("fedavg", ["diagnostics.every=1"], "diagnostics.every"),
        ("fedavg", ["eval.local=true"], "eval.local"),
        ("fedavg", ["data.sampling=stream"], "data.sampling=stream"),
    ],
)
def test_what_fedbuff_refuses(tmp_path: Path, method: str, extra: list[str], message: str) -> None:
    cfg = _cfg(tmp_path, f"algorithms=[{method}]", *extra, "asynchronous.buffer=2")
    with pytest.raises(ConfigError, match=message) as e:
        make_algorithm(method, cfg)
    assert str(e.value).startswith("asynchronous.buffer (FedBuff) with ")
    assert "\n" not in str(e.value)
    off = _cfg(tmp_path, f"algorithms=[{method}]", *extra)
    if method in ("fedavg",) and not any("dp." in x or "secure" in x for x in extra):
        make_algorithm(method, off)  # the same settings run synchronously


def test_the_simulated_clock_runs_on_flower_engines_and_the_wall_clock_only_there(
    tmp_path: Path,
) -> None:
    _cfg(tmp_path, "asynchronous.buffer=2", "engine=flower-sim")  # validates
    _cfg(tmp_path, "asynchronous.buffer=2", "asynchronous.clock=wall", "engine=flower-sim")
    simulated = _cfg(tmp_path, "asynchronous.buffer=2")
    check_in_process(simulated, deployed=True)
    check_in_process(simulated, deployed=False)
    wall = _cfg(tmp_path, "asynchronous.buffer=2", "asynchronous.clock=wall")
    check_in_process(wall, deployed=True)
    with pytest.raises(ConfigError, match=r"asynchronous\.clock=wall in process") as e:
        check_in_process(wall, deployed=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("speed", ["clients.speed=lognormal", "clients.speed_trace=t.json"])
def test_the_wall_clock_refuses_simulated_speeds(tmp_path: Path, speed: str) -> None:
    cfg = _cfg(tmp_path, "asynchronous.buffer=2", "asynchronous.clock=wall", speed)
    with pytest.raises(ConfigError, match=r"clock=wall and clients\.speed or clients\.speed_trace"):
        make_algorithm("fedavg", cfg)
    simulated = _cfg(tmp_path, "asynchronous.buffer=2", "clients.speed=lognormal")
    make_algorithm("fedavg", simulated)


def test_run_one_refuses_the_wall_clock_in_process(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "asynchronous.buffer=2", "asynchronous.clock=wall")
    with pytest.raises(ConfigError, match="no real clock"):
        run_one(cfg, "fedavg", SEED)
    assert not run_dir(cfg, "fedavg", SEED).exists()  # refused before the run folder
    with pytest.raises(ConfigError, match="LocalTransport has no real clock"):
        run_one(cfg, "fedavg", SEED, make_transport=LocalTransport)  # a transport without one


def test_early_stopping_keeps_its_meaning_and_resumes_with_the_clients_in_flight(
    tmp_path: Path,
) -> None:
    extra = [
        "clients.speed=lognormal", "asynchronous.buffer=2", "asynchronous.concurrency=4",
        "rounds=12", "data.selection_fraction=0.2", "early_stopping.patience=2", "lr=0.1",
        "early_stopping.metric=selection_accuracy", "early_stopping.restore_best=true",
    ]  # fmt: skip
    whole = _cfg(tmp_path / "whole", *extra)
    want = run_one(whole, "fedavg", SEED)
    assert want is not None and 2 < want["stopped_round"] < 11  # two server steps without a gain
    cut = _cfg(tmp_path / "cut", *extra)
    assert run_one(cut, "fedavg", SEED, stop_after=want["stopped_round"] - 2) is None
    got = run_one(cut, "fedavg", SEED, resume=True)
    assert got is not None and got["stopped_round"] == want["stopped_round"]
    assert [_plain(r) for r in _rows(cut)] == [_plain(r) for r in _rows(whole)]
