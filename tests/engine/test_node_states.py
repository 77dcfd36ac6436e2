"""The client states a simulated client keeps in the run folder (:mod:`fedlore.engine.node_states`):
bit-exact round trips, what a write keeps, what a resume deletes, and one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedlore.config import load_config
from fedlore.engine import node_states
from fedlore.engine.node_states import NodeStateError, kept_by_clients, load, restore_point, save
from fedlore.types import State


def _state(x: float) -> State:
    return State(
        {
            "personal.w": torch.full((2, 3), x),
            "cache.b": torch.tensor([x, -x], dtype=torch.bfloat16),
            "n": torch.tensor(7, dtype=torch.int64),
        },
        {"version": 3, "lr": 0.1 + x, "chosen": "a", "on": True},
    )


def _files(root: Path, cid: int) -> list[str]:
    return sorted(p.name for p in (root / str(cid)).iterdir())


def test_a_saved_state_loads_bit_for_bit_and_a_client_without_one_has_none(
    tmp_path: Path,
) -> None:
    assert load(tmp_path, 0, "ditto", 42) is None
    want = _state(1.0 / 3.0)
    save(tmp_path, 0, 2, want, "ditto", 42)
    got = load(tmp_path, 0, "ditto", 42)
    assert got is not None and got.values == want.values
    assert got.arrays.keys() == want.arrays.keys()
    for k, t in want.arrays.items():
        assert got.arrays[k].dtype == t.dtype and torch.equal(got.arrays[k], t)
    save(tmp_path, 0, 3, _state(2.0), "ditto", 42)  # the newest is the one read
    again = load(tmp_path, 0, "ditto", 42)
    assert again is not None and again.values["lr"] == 2.1
    assert load(tmp_path, 1, "ditto", 42) is None  # another client's folder


def test_a_write_keeps_the_newest_state_before_its_round_and_deletes_older_ones(
    tmp_path: Path,
) -> None:
    for rnd in (-1, 0, 2):
        save(tmp_path, 4, rnd, _state(rnd), "fedlore", 1)
    assert _files(tmp_path, 4) == ["state.0.pt", "state.2.pt"]
    save(tmp_path, 4, 2, _state(9), "fedlore", 1)  # FedBuff's second start in one round
    assert _files(tmp_path, 4) == ["state.0.pt", "state.2.pt"]
    save(tmp_path, 4, 5, _state(5), "fedlore", 1)
    assert _files(tmp_path, 4) == ["state.2.pt", "state.5.pt"]
    assert node_states.newest_round(tmp_path, 4) == 5
    assert node_states.newest_round(tmp_path, 3) is None


def test_a_resume_deletes_the_states_after_its_checkpoint_and_keeps_the_one_as_of_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "clients"
    for rnd in (1, 3):
        save(root, 0, rnd, _state(rnd), "ditto", 42)  # 3: the discarded round's
    save(root, 1, 0, _state(0), "ditto", 42)
    save(root, 1, 1, _state(1), "ditto", 42)  # both kept by the write
    (root / "1" / "state.2.pt.tmp").write_bytes(b"torn")  # a killed write
    (root / "2").mkdir()  # a client whose first write was cut
    (root / "2" / "state.3.pt.tmp").write_bytes(b"")
    gone = restore_point(root, 2, "ditto", 42)
    assert gone == ["0/state.3.pt", "1/state.2.pt.tmp", "2/state.3.pt.tmp"]
    assert _files(root, 0) == ["state.1.pt"]
    assert _files(root, 1) == ["state.1.pt"]  # the older one is no longer needed
    assert _files(root, 2) == []
    got = load(root, 0, "ditto", 42)
    assert got is not None and got.values["lr"] == 1.1  # round 1's, not round 3's
    assert restore_point(root, 2, "ditto", 42) == []  # nothing more to delete
    assert restore_point(root, None, "ditto", 42) == ["0/state.1.pt", "1/state.1.pt"]
    assert not root.exists()  # no checkpoint: the run starts from its first round
    assert restore_point(root, 0, "ditto", 42) == []  # nothing there


def test_a_damaged_or_foreign_state_is_refused_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "clients"
    save(root, 0, 1, _state(1), "ditto", 42)
    path = root / "0" / "state.1.pt"
    good = path.read_bytes()
    path.write_bytes(good[:100])
    for read in (lambda: load(root, 0, "ditto", 42), lambda: restore_point(root, 1, "ditto", 42)):
        with pytest.raises(NodeStateError) as e:
            read()
        assert str(e.value).startswith(f"--resume: the client state {path} is damaged")
        assert "\n" not in str(e.value) and "without --resume" in str(e.value)
    path.write_bytes(good)
    for cid, method, seed in ((1, "ditto", 42), (0, "fedavg", 42), (0, "ditto", 43)):
        (root / str(cid)).mkdir(exist_ok=True)
        moved = root / str(cid) / "state.1.pt"
        if moved != path:
            moved.write_bytes(good)
        with pytest.raises(NodeStateError, match=f"the client state {moved} is not this run's"):
            restore_point(root, 1, method, seed)
        if moved != path:
            moved.unlink()
    (root / "0" / "state.1.pt").rename(root / "0" / "state.0.pt")  # named another round
    with pytest.raises(NodeStateError, match="client 0, round 1, ditto seed 42"):
        load(root, 0, "ditto", 42)


def test_which_simulated_runs_keep_their_clients_states() -> None:
    assert kept_by_clients(load_config(None, []))
    assert not kept_by_clients(load_config(None, ["checkpoint=false"]))
    fedbuff = ["asynchronous.buffer=2", "engine=flower-sim"]
    assert kept_by_clients(load_config(None, fedbuff))
    assert not kept_by_clients(load_config(None, [*fedbuff, "asynchronous.clock=wall"]))
