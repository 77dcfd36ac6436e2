"""Seeded client sampling and the in-process client-state store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedlore.config import load_config
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.experiment import run_one
from fedlore.types import State

# ------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("per_round", [10, 11, 100])
def test_full_participation_returns_every_client(per_round: int) -> None:
    for rnd in (-1, 0, 5):
        assert sample_clients(10, per_round, seed=3, rnd=rnd) == list(range(10))


@pytest.mark.parametrize(("num_clients", "per_round"), [(10, 3), (20, 7), (5, 4), (100, 1)])
def test_partial_participation_distinct_sorted_in_range(num_clients: int, per_round: int) -> None:
    for seed in (0, 1):
        for rnd in range(6):
            ids = sample_clients(num_clients, per_round, seed, rnd)
            assert len(ids) == per_round
            assert len(set(ids)) == per_round
            assert ids == sorted(ids)
            assert all(isinstance(i, int) and 0 <= i < num_clients for i in ids)


def test_sampling_is_deterministic_per_seed_and_round() -> None:
    first = [sample_clients(20, 5, 7, r) for r in range(10)]
    # drawn in another order: the draw of a round depends only on (seed, round)
    again = {r: sample_clients(20, 5, 7, r) for r in reversed(range(10))}
    assert first == [again[r] for r in range(10)]


def test_sampling_differs_across_rounds_and_seeds() -> None:
    by_round = {tuple(sample_clients(20, 5, 7, r)) for r in range(10)}
    assert len(by_round) >= 8  # C(20, 5) = 15504: repeats among 10 draws would be a bug
    other_seed = [sample_clients(20, 5, 8, r) for r in range(10)]
    assert other_seed != [sample_clients(20, 5, 7, r) for r in range(10)]


def test_sampling_covers_all_clients_over_many_rounds() -> None:
    seen = {c for r in range(60) for c in sample_clients(12, 3, 0, r)}
    assert seen == set(range(12))


@pytest.mark.parametrize(("num_clients", "per_round"), [(0, 1), (5, 0), (-1, 3)])
def test_sampling_rejects_bad_sizes(num_clients: int, per_round: int) -> None:
    with pytest.raises(ValueError):
        sample_clients(num_clients, per_round, 0, 0)


@pytest.mark.parametrize(
    ("num_clients", "participation", "expected"),
    [(10, 1.0, 10), (10, 0.3, 3), (10, 0.5, 5), (10, 0.01, 1), (7, 0.6, 4), (1, 0.1, 1)],
)
def test_clients_per_round(num_clients: int, participation: float, expected: int) -> None:
    cfg = load_config(None, [f"num_clients={num_clients}", f"participation={participation}"])
    assert cfg.clients_per_round() == expected


def test_run_samples_clients_per_round(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "num_clients=4",
            "participation=0.5",
            "rounds=2",
            "local_steps=1",
            "model.kwargs={hidden: [8]}",
            "progress=false",
            f"output_dir={tmp_path}",
            "partition.min_size=10",
        ],
    )
    run_one(cfg, "fedfull", 0)
    path = tmp_path / cfg.name / "fedfull" / "seed-0" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    assert all(r["clients"] == 2 and r["accepted"] == 2 for r in rows)
    # bytes_down counts one dense model per sampled client
    assert rows[0]["bytes_down"] == rows[1]["bytes_down"] > 0


# ---------------------------------------------------------------------------------- store


def _state(v: float) -> State:
    return State(arrays={"cache.w": torch.full((2, 3), v)}, values={"version": int(v)})


def test_store_put_get_and_forget() -> None:
    store = ClientStore()
    assert store.get(0) is None and len(store) == 0
    a, b = _state(1.0), _state(2.0)
    store.put(0, a)
    store.put(3, b)
    assert store.get(0) is a and store.get(3) is b and store.get(1) is None
    assert len(store) == 2
    assert store.nbytes() == 2 * 6 * 4
    store.put(0, _state(5.0))  # replace
    assert float(store.get(0).arrays["cache.w"][0, 0]) == 5.0  # type: ignore[union-attr]
    store.put(0, State())  # an empty state forgets the client
    assert store.get(0) is None and len(store) == 1
    store.put(3, None)
    assert store.get(3) is None and len(store) == 0
    store.put(4, State())  # stateless methods keep nothing
    assert len(store) == 0


def test_store_keeps_values_only_state() -> None:
    store = ClientStore()
    store.put(2, State(values={"lr": 0.1}))
    assert store.get(2) is not None and len(store) == 1 and store.nbytes() == 0


def test_store_roundtrip_through_dict_and_disk(tmp_path: Path) -> None:
    store = ClientStore()
    store.put(0, _state(1.0))
    store.put(7, State(arrays={"basis.x": torch.arange(6.0).reshape(3, 2)}, values={"held": -1}))
    store.put(9, State(values={"name": "x", "flag": True, "lr": 0.25}))
    raw = store.to_dict()
    assert set(raw) == {"0", "7", "9"}
    torch.save(raw, tmp_path / "store.pt")
    loaded = torch.load(tmp_path / "store.pt", weights_only=True)
    for back in (ClientStore.from_dict(raw), ClientStore.from_dict(loaded)):
        assert len(back) == len(store)
        for cid in (0, 7, 9):
            got, want = back.get(cid), store.get(cid)
            assert got is not None and want is not None
            assert got.values == want.values
            assert got.arrays.keys() == want.arrays.keys()
            for k in want.arrays:
                assert torch.equal(got.arrays[k], want.arrays[k])
        assert back.get(1) is None
        assert back.nbytes() == store.nbytes()


def test_empty_store_roundtrip() -> None:
    assert ClientStore().to_dict() == {}
    assert len(ClientStore.from_dict({})) == 0
