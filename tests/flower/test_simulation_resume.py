"""A killed ``engine: flower-sim`` run resumed with ``--resume`` continues from its checkpoint to
the uninterrupted simulated run's result, bit for bit: every row (timings aside), the final
global model and the summary. The clients keep their states in the run folder
(:mod:`fedlore.engine.node_states`); a state newer than the checkpoint (written in the round the
kill discarded) is deleted before the resumed simulation starts, and a damaged one is refused in
one line. One Ray serves the module.

The stop is the flag a SIGINT sets (:mod:`fedlore.engine.interrupt`), set after round 2's
clients answered: the round loop discards round 2 (its clients have written their round-2
states) and stops; rows and checkpoint end at round 1.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
import torch
from sim_helpers import sim_cfg

from fedlore.config import Config
from fedlore.engine import interrupt, node_states
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.interrupt import Interrupted
from fedlore.engine.loop import RoundLoop
from fedlore.engine.node_states import NodeStateError
from fedlore.engine.rundir import run_dir
from fedlore.flower.simulation import ray_session, run_simulated

# one worker runs the whole module, so the module's one Ray starts once (spread over two
# pytest-xdist workers, each started its own)
pytestmark = [pytest.mark.flower, pytest.mark.xdist_group("ray-resume")]

ROUNDS = 4
KILLED_IN = 2
# two of three clients a round: a client's newest state is often from an earlier round; the
# last round scores Ditto's personal models
PARTIAL = ["participation=0.67", "eval.local=true"]


@pytest.fixture(scope="module", autouse=True)
def one_ray() -> Iterator[None]:
    with ray_session():
        yield


def _cfg(tmp: Path, name: str, method: str, data: list[str], *extra: str) -> Config:
    cfg = sim_cfg(tmp / name, "sim", ROUNDS, method, [*data, *PARTIAL, *extra])
    return cfg.model_copy(update={"engine": "flower-sim"})


def _kill_in_round(monkeypatch: pytest.MonkeyPatch, cfg: Config, method: str) -> None:
    """Run ``cfg`` until the SIGINT flag stops it in round :data:`KILLED_IN`, its clients done."""
    own = RoundLoop.run_round

    def signal_after(self: Any, state: Any, rnd: int, last: int) -> Any:
        out = own(self, state, rnd, last)
        if rnd == KILLED_IN:
            monkeypatch.setattr(interrupt, "_received", 2)  # as the SIGINT handler does
        return out

    monkeypatch.setattr(RoundLoop, "run_round", signal_after)
    try:
        with pytest.raises(Interrupted) as stop:
            run_simulated(cfg, method, 42)
    finally:
        monkeypatch.setattr(interrupt, "_received", None)
        monkeypatch.setattr(RoundLoop, "run_round", own)
    assert not stop.value.starts_over
    assert "continues from there" in stop.value.describe("`fedlore run ... --resume`")


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.endswith("_s")}  # no timings


def _rows(cfg: Config, method: str) -> list[dict[str, Any]]:
    path = run_dir(cfg, method, 42) / "metrics.jsonl"
    return [_plain(json.loads(line)) for line in path.read_text().splitlines()]


def _summary(cfg: Config, method: str) -> dict[str, Any]:
    raw = json.loads((run_dir(cfg, method, 42) / "summary.json").read_text())
    return {k: v for k, v in raw.items() if not k.endswith("_s") and "_s_" not in k}


def _assert_same_run(a: Config, b: Config, method: str) -> None:
    assert _rows(a, method) == _rows(b, method)
    assert _summary(a, method) == _summary(b, method)
    _, sa, _ = Checkpointer.load(run_dir(a, method, 42) / "checkpoint.pt")
    _, sb, _ = Checkpointer.load(run_dir(b, method, 42) / "checkpoint.pt")
    assert sa.arrays.keys() == sb.arrays.keys() and sa.values == sb.values
    for k in sa.arrays:
        assert torch.equal(sa.arrays[k], sb.arrays[k]), k


@pytest.mark.parametrize("method", ["fedavg", "fedlore", "ditto"])
def test_a_killed_simulation_resumes_from_its_checkpoint_to_the_uninterrupted_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_npz: list[str], method: str
) -> None:
    """FedAvg (no client state), FedLore (a model cache and the server's increment log, a setup
    round) and Ditto (a personal model): killed in round 2 and resumed, each gives the
    uninterrupted simulation's rows, summary and final server state; rounds 0 and 1 are not
    trained again."""
    killed, straight = (_cfg(tmp_path, n, method, digits_npz) for n in ("killed", "straight"))
    _kill_in_round(monkeypatch, killed, method)
    first = -1 if method == "fedlore" else 0
    assert [r["round"] for r in _rows(killed, method)] == list(range(first, KILLED_IN))
    states = run_dir(killed, method, 42) / node_states.FOLDER
    newest = {c: node_states.newest_round(states, c) for c in range(3)}
    assert KILLED_IN in newest.values()  # the discarded round's clients wrote their states
    trained: list[int] = []
    own = RoundLoop.run_round

    def spy(self: Any, state: Any, rnd: int, last: int) -> Any:
        trained.append(rnd)
        return own(self, state, rnd, last)

    monkeypatch.setattr(RoundLoop, "run_round", spy)
    run_simulated(killed, method, 42, resume=True)
    monkeypatch.setattr(RoundLoop, "run_round", own)
    assert trained == list(range(KILLED_IN, ROUNDS))  # after the checkpoint only
    assert not states.exists()  # a finished run keeps no client states
    run_simulated(straight, method, 42)
    _assert_same_run(killed, straight, method)


def test_a_client_state_newer_than_the_checkpoint_is_deleted_before_the_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_npz: list[str]
) -> None:
    """The round-2 states the discarded round wrote are gone before the resumed simulation's
    first message (so no client trains from one), a planted round-9 state too, and the states
    as of the checkpoint are kept; a ``.tmp`` of a killed write is deleted."""
    from fedlore.flower import simulation

    cfg = _cfg(tmp_path, "killed", "ditto", digits_npz)
    _kill_in_round(monkeypatch, cfg, "ditto")
    folder = run_dir(cfg, "ditto", 42)
    states = folder / node_states.FOLDER

    def names() -> dict[int, list[str]]:
        return {
            c: sorted(p.name for p in (states / str(c)).iterdir())
            for c in range(3)
            if (states / str(c)).is_dir()
        }

    before = names()
    assert any(f"state.{KILLED_IN}.pt" in kept for kept in before.values())
    c = next(iter(before))
    shutil.copy(states / str(c) / before[c][0], states / str(c) / "state.9.pt")  # round 9's
    (states / str(c) / "state.1.pt.tmp").write_bytes(b"torn")
    seen: dict[int, list[str]] = {}
    restore = simulation.restore_clients

    def after_restore(*args: Any) -> None:
        restore(*args)
        seen.update(names())

    monkeypatch.setattr(simulation, "restore_clients", after_restore)
    run_simulated(cfg, "ditto", 42, resume=True)
    assert seen.keys() == before.keys()
    for c, had in before.items():
        kept = [n for n in had if int(n.split(".")[1]) < KILLED_IN]
        assert seen[c] == kept[-1:], (c, had, seen[c])  # the newest as of round 1


def test_a_damaged_or_foreign_client_state_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_npz: list[str]
) -> None:
    """A client's newest state cut short, or one that is another client's, stops the resume
    before anything runs, naming the file; the run folder is left as it was."""
    cfg = _cfg(tmp_path, "killed", "ditto", digits_npz)
    _kill_in_round(monkeypatch, cfg, "ditto")
    folder = run_dir(cfg, "ditto", 42)
    states = folder / node_states.FOLDER
    rows = (folder / "metrics.jsonl").read_text()
    c = next(c for c in range(3) if (states / str(c)).is_dir())
    newest = [p for p in (states / str(c)).iterdir() if p.name.endswith(".pt")]
    path = max(newest, key=lambda p: int(p.name.split(".")[1]))
    if int(path.name.split(".")[1]) >= KILLED_IN:  # the discarded round's: deleted anyway
        path.unlink()
        newest.remove(path)
        path = max(newest, key=lambda p: int(p.name.split(".")[1]))
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(NodeStateError) as e:
        run_simulated(cfg, "ditto", 42, resume=True)
    assert str(e.value).startswith(f"--resume: the client state {path} is damaged")
    assert "\n" not in str(e.value)
    other = str(next(d for d in range(3) if d != c))
    (states / other).mkdir(exist_ok=True)
    moved = states / other / path.name
    for p in (states / other).iterdir():
        p.unlink()
    path.write_bytes(good)
    shutil.move(path, moved)  # client c's state where client `other`'s belongs
    with pytest.raises(NodeStateError, match=f"client state {moved} is not this run's"):
        run_simulated(cfg, "ditto", 42, resume=True)
    assert (folder / "metrics.jsonl").read_text() == rows
