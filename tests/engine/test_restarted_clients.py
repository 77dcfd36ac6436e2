"""A deployment resumed by a new ``flwr run`` meets nodes without the clients' states: the server
drops its record of what each client holds (:meth:`fedlore.algorithms.base.Hyper.clients_restarted`)
so the first round after the resume sends the dense model, instead of a log replay every client
must reject. Played in process by a transport whose clients start empty and that says so
(``keeps_client_states = False``, as :class:`fedlore.flower.transport.FlowerTransport`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.algorithms.sync import FEDLORE_LOG, SyncState, clients_restarted
from fedlore.config import Config, load_config
from fedlore.engine.rundir import run_dir
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_one
from fedlore.types import State

SEED = 5


class _Forgetful(LocalTransport):
    """The in-process transport over clients that start without their states (a new Flower
    run), saying so as the Flower transport does (or not, to show the round it costs)."""

    keeps_client_states = False

    def __init__(self, algorithm: Any, data: Any, factory: Any, seed: int, _: Any) -> None:
        super().__init__(algorithm, data, factory, seed, ClientStore())


class _Silent(_Forgetful):
    keeps_client_states = True  # the clients lost their states, the server is not told


def _cfg(out: Path, method: str, *extra: str) -> Config:
    return load_config(None, [
        "num_clients=3", "rounds=4", "local_steps=2", "batch_size=16", "lr=3e-3", "rank=4",
        "model.kwargs={hidden: [32]}", "partition.min_size=10", "progress=false",
        f"algorithms=[{method}]", f"seeds=[{SEED}]", f"output_dir={out}", *extra,
    ])  # fmt: skip


def _rows(cfg: Config, method: str) -> list[dict[str, Any]]:
    path = run_dir(cfg, method, SEED) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("method", "extra"), [("fedlore", ()), ("flora", ()), ("fedavg", ("params.freeze=[body.0.*]",))]
)
def test_a_resume_over_clients_without_their_states_loses_no_round(
    tmp_path: Path, method: str, extra: tuple[str, ...]
) -> None:
    for told, transport in ((True, _Forgetful), (False, _Silent)):
        cfg = _cfg(tmp_path / str(told), method, *extra)
        # both attempts on the same transport: a change of engine restarts the clients in any
        # case (fedlore.engine.client_holder, tests/flower/test_resume_across_engines.py)
        assert run_one(cfg, method, SEED, stop_after=1, make_transport=transport) is None
        assert run_one(cfg, method, SEED, resume=True, make_transport=transport) is not None
        (after,) = [r for r in _rows(cfg, method) if r["round"] == 2]  # the first one resumed
        if told:  # every client got the dense model and trained
            assert after["rejected"] == 0 and after["accepted"] == 3, after
            assert all(r["rejected"] == 0 for r in _rows(cfg, method))
        else:  # the round that the record of their states costs without it
            assert after["rejected"] == 3, after


def test_clients_restarted_drops_every_clients_record_and_keeps_the_log() -> None:
    sync = SyncState(FEDLORE_LOG)
    sync.record(3, {"x": torch.ones(2)}, scale=0.5)
    for cid in (0, 4):
        sync.acknowledge(cid, 3, held=1)
    arrays: dict[str, torch.Tensor] = {"model.w": torch.zeros(2)}
    values: dict[str, Any] = {"seen.0": 1, "seen.7": 1, "basis_id": 1}
    sync.encode(arrays, values)
    out = clients_restarted(State(arrays, values), FEDLORE_LOG)
    again = SyncState.decode(out, FEDLORE_LOG)
    assert again.clients == {} and list(again.log) == [3]
    assert not any(k.startswith(("seen.", "version.", "held.")) for k in out.values)
    assert out.values["basis_id"] == 1 and torch.equal(out.arrays["model.w"], torch.zeros(2))
    assert torch.equal(out.arrays["log.3.x"], torch.ones(2))
    plain = clients_restarted(State(dict(arrays), dict(values)))  # no log format: seen only
    assert "version.0" in plain.values and "seen.0" not in plain.values


def test_the_flower_transport_says_its_clients_start_without_their_states() -> None:
    pytest.importorskip("flwr")
    from fedlore.flower.transport import FlowerTransport

    assert FlowerTransport.keeps_client_states is False
