"""The simulated ClientApp keeping its state in the run folder, called in this process (no Ray):
a run stopped after round 1 and resumed with new ``Context``s (a new simulation's nodes hold
nothing) gives the uninterrupted run's rows and model bit for bit, its clients reading their
states from ``clients/``; a state of a round after the checkpoint is deleted first. The same
over Ray, killed mid-round: ``test_simulation_resume.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
import torch
from app_helpers import node_contexts, train_message

from fedlore.config import Config, load_config
from fedlore.engine import node_states
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.engine.runstart import StartOverWarning
from fedlore.experiment import run_one
from fedlore.flower.app import make_apps
from fedlore.flower.codec import record_to_reply
from fedlore.flower.simulation import restore_clients
from fedlore.flower.transport import TRAIN_ROUND
from fedlore.types import Broadcast, Reply, State

pytestmark = pytest.mark.flower

TINY = [
    "num_clients=3",
    "participation=0.67",
    "rounds=4",
    "local_steps=2",
    "batch_size=16",
    "lr=0.01",
    "model.kwargs={hidden: [16]}",
    "progress=false",
    "eval.local=true",  # the last round scores Ditto's personal models
]


class Nodes:
    """A transport calling a ClientApp here, one new ``Context`` per client (a simulation's
    virtual SuperNodes), with the attribute the server reads on a resume."""

    keeps_client_states = True

    def __init__(self, client: Any, num_clients: int) -> None:
        self.client = client
        self.keys: list[int] = []  # the rounds (FedBuff: start keys) sent
        self.ctx = node_contexts(num_clients)

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out: dict[int, Reply | BaseException] = {}
        self.keys.append(rnd)
        for cid, b in messages.items():
            if b.config["round"] != rnd:  # FedBuff's repeated start, as FlowerTransport sends it
                b = Broadcast(b.arrays, {**b.config, TRAIN_ROUND: rnd})
            out[cid] = record_to_reply(
                self.client(train_message(rnd, cid, b), self.ctx[cid]).content
            )
        return out


def _run(cfg: Config, method: str, keep: bool = True, **kwargs: Any) -> Path:
    folder = run_dir(cfg, method, 42)
    states = folder / node_states.FOLDER
    _, client = make_apps(cfg, method, 42, state_dir=states if keep else None)
    run_one(cfg, method, 42, make_transport=lambda *_: Nodes(client, cfg.num_clients), **kwargs)
    return states


def _result(cfg: Config, method: str) -> tuple[list[dict[str, Any]], State]:
    folder = run_dir(cfg, method, 42)
    rows = [
        {k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
        for line in (folder / "metrics.jsonl").read_text().splitlines()
    ]
    return rows, Checkpointer.load(folder / "checkpoint.pt")[1]


def _same(a: Config, b: Config, method: str) -> bool:
    (rows_a, sa), (rows_b, sb) = _result(a, method), _result(b, method)
    return rows_a == rows_b and all(torch.equal(sa.arrays[k], sb.arrays[k]) for k in sa.arrays)


@pytest.mark.parametrize("method", ["fedlore", "scaffold", "ditto", "meta_bayfl", "pfedbayes"])
def test_a_resumed_client_app_reads_its_state_as_of_the_checkpoint(
    tmp_path: Path, method: str
) -> None:
    """FedLore (a model cache, the server's log), SCAFFOLD (control variates), Ditto and
    pFedBayes (personal models), Meta-BayFL (Bayesian clients): stopped after round 1, a state
    planted for round 2 (a discarded round's), resumed over new contexts: the uninterrupted
    run's rows and model. Without the files the resumed run differs, or FedLore's fails (the
    state matters); a fresh run over the stopped one's folder is the uninterrupted run too."""
    cfgs = {n: load_config(None, [*TINY, f"output_dir={tmp_path / n}"]) for n in "abcd"}
    _run(cfgs["a"], method)
    assert not (run_dir(cfgs["a"], method, 42) / node_states.FOLDER).exists()  # finished
    states = _run(cfgs["b"], method, stop_after=1)
    assert states.is_dir()
    c = min(int(p.name) for p in states.iterdir())
    node_states.save(states, c, 2, State({}, {"stale": True}), method, 42)  # a discarded round's
    restore_clients(run_dir(cfgs["b"], method, 42), states, method, 42)
    assert node_states.newest_round(states, c) in (-1, 0, 1)  # the stale one is gone
    _run(cfgs["b"], method, resume=True)
    assert _same(cfgs["a"], cfgs["b"], method)
    _run(cfgs["c"], method, stop_after=1)
    if method == "fedlore":  # the server replays its log to a client that lost its cache
        with pytest.raises(RuntimeError, match="client has no cached model"):
            _run(cfgs["c"], method, keep=False, resume=True)
    elif method != "meta_bayfl":  # the clients start without their states (Meta-BayFL's do
        # not change these four rounds' rows and model)
        _run(cfgs["c"], method, keep=False, resume=True)
        assert not _same(cfgs["a"], cfgs["c"], method)
    _run(cfgs["d"], method, stop_after=1)  # its clients' states...
    with pytest.warns(StartOverWarning):  # ...are gone when a fresh run starts over there
        _run(cfgs["d"], method)
    assert _same(cfgs["a"], cfgs["d"], method)


def test_a_fedbuff_clients_state_is_named_by_the_version_it_started_from(tmp_path: Path) -> None:
    """A client that starts twice from one version trains with the generator of a repeat key
    (2**31 + n), but its state is that version's round: the rounds after a checkpoint, and only
    those, are what a resume deletes."""
    from fedlore.engine.buffered import REPEAT

    fedbuff = ["asynchronous.buffer=2", "clients.speed=lognormal", "clients.speed_spread=1.0"]
    cfg = load_config(
        None, [*TINY, *fedbuff, "participation=1.0", "eval.local=false", f"output_dir={tmp_path}"]
    )
    folder = run_dir(cfg, "fedavg", 42)
    states = folder / node_states.FOLDER
    _, client = make_apps(cfg, "fedavg", 42, state_dir=states)
    nodes = Nodes(client, cfg.num_clients)
    run_one(cfg, "fedavg", 42, make_transport=lambda *_: nodes, stop_after=2)
    assert any(k >= REPEAT for k in nodes.keys)  # a repeated start happened
    tags = [int(p.name.split(".")[1]) for p in states.rglob("state.*.pt")]
    assert tags and max(tags) <= 2


def test_a_resume_leaves_the_client_states_of_a_run_another_process_holds(
    tmp_path: Path,
) -> None:
    """``--resume`` of a simulated run that another process is running is refused before a
    client state is deleted (its clients may be writing the states of its round)."""
    import subprocess
    import sys

    from fedlore.engine.lock import RunLocked
    from fedlore.flower.simulation import run_simulated

    cfg = load_config(None, [*TINY, "engine=flower-sim", f"output_dir={tmp_path}"])
    states = _run(cfg, "ditto", stop_after=1)
    folder = run_dir(cfg, "ditto", 42)
    node_states.save(states, 0, 2, State({}, {}), "ditto", 42)  # the other process's round
    hold = (
        "import sys, time\nfrom fedlore.engine.lock import RunLock\n"
        f"with RunLock({str(folder)!r}):\n    print('held', flush=True)\n    time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked):
            run_simulated(cfg, "ditto", 42, resume=True)
        assert (states / "0" / "state.2.pt").exists()
    finally:
        holder.kill()
        holder.wait()
