"""The client store past its memory limit: LRU spilling to immutable, versioned files, exact
round trips, checkpoints that name spilled states, garbage collection after each commit, and a
spilling run killed (between rounds and mid-round) that resumes to an uninterrupted run's
metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.config import Config, validate
from fedlore.engine.callbacks import Checkpointer, atomic_save
from fedlore.engine.rundir import run_dir
from fedlore.engine.store import ClientStore, StoreError
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_one
from fedlore.types import Broadcast, Reply, State

STATE_BYTES = 2 * 3 * 4 + 5 * 8  # the tensors of _state(): float32 2x3, float64 5


def _state(v: float) -> State:
    return State(
        arrays={
            "cache.w": torch.full((2, 3), v),
            "basis.p": torch.arange(5.0, dtype=torch.float64),
        },
        values={"version": int(v), "held": -1, "lr": v / 3, "tag": f"c{v}", "ok": True},
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same(got: State | None, want: State) -> None:
    assert got is not None
    assert got.values == want.values
    assert {k: type(v) for k, v in got.values.items()} == {
        k: type(v) for k, v in want.values.items()
    }
    assert got.arrays.keys() == want.arrays.keys()
    for k, t in want.arrays.items():
        g = got.arrays[k]
        assert g.dtype == t.dtype and g.shape == t.shape, k
        assert torch.equal(_bits(g), _bits(t)), k  # bit-identical (NaN, -0.0 included)


def _spill_files(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def _where(store: ClientStore) -> dict[int, str]:
    """client -> "mem" or the spill file, read from the public to_dict()."""
    return {int(c): e.get("spilled", "mem") for c, e in store.to_dict().items()}


# ------------------------------------------------------------------------------ spilling


def test_spills_past_the_limit_and_memory_stays_bounded(tmp_path: Path) -> None:
    limit = 3 * STATE_BYTES
    store = ClientStore(limit, tmp_path / "spill")
    for c in range(10):
        store.put(c, _state(float(c)))
        assert store.nbytes() <= limit
    assert len(store) == 10 and store.num_in_memory() == 3 and store.num_spilled() == 7
    assert store.nbytes() == 3 * STATE_BYTES and store.disk_bytes() == 7 * STATE_BYTES
    assert store.stats() == {
        "clients": 10,
        "in_memory": 3,
        "spilled": 7,
        "memory_bytes": 3 * STATE_BYTES,
        "disk_bytes": 7 * STATE_BYTES,
    }
    files = _spill_files(tmp_path / "spill")
    assert len(files) == 7 and all(f.endswith(".pt") for f in files)
    assert {int(f.split(".")[0]) for f in files} == set(range(7))  # the oldest spilled
    assert store.client_ids() == list(range(10)) and 4 in store and 11 not in store


def test_one_state_over_the_limit_stays_in_memory_alone(tmp_path: Path) -> None:
    store = ClientStore(STATE_BYTES // 2, tmp_path)
    store.put(0, _state(0.0))
    assert store.num_in_memory() == 1 and store.num_spilled() == 0  # the limit + one state
    store.put(1, _state(1.0))
    assert store.num_in_memory() == 1 and store.nbytes() == STATE_BYTES
    store.put(2, State(values={"only": 1}))  # states without tensors cost nothing, never spill
    store.put(3, _state(3.0))
    assert _where(store)[2] == "mem" and _where(store)[3] == "mem"
    assert store.num_spilled() == 2


def test_get_round_trips_bit_identical(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])
    want = {
        c: State(
            arrays={
                "cache.w": torch.randn(7, 5, generator=g),
                "cache.b": torch.randn(3, generator=g, dtype=torch.float64),
                "half": torch.randn(4, generator=g).to(torch.bfloat16),
                "idx": torch.randint(0, 100, (6,), generator=g),
                "special": special * c,
                "empty": torch.zeros(0, 2),
            },
            values={"version": c, "lr": 0.1 * c, "name": "x" * c, "flag": c % 2 == 0},
        )
        for c in range(6)
    }
    store = ClientStore(0, tmp_path)  # everything but the latest spills
    for c, s in want.items():
        store.put(c, s)
    assert store.num_spilled() == 5
    for c in [3, 0, 5, 1, 4, 2, 3]:
        _assert_same(store.get(c), want[c])
    assert store.get(99) is None


def test_lru_order_counts_gets_and_puts(tmp_path: Path) -> None:
    store = ClientStore(2 * STATE_BYTES, tmp_path)
    store.put(0, _state(0.0))
    store.put(1, _state(1.0))
    store.get(0)  # 0 is now more recent than 1
    store.put(2, _state(2.0))
    where = _where(store)
    assert where[0] == "mem" and where[2] == "mem" and where[1] != "mem"
    # reading a spilled state brings it back and spills the least recently used one (0)
    _assert_same(store.get(1), _state(1.0))
    where = _where(store)
    assert where[1] == "mem" and where[2] == "mem" and where[0] != "mem"
    # the file 1 was read from was never in a checkpoint: it is gone already
    assert _spill_files(tmp_path) == {where[0]}
    store.put(2, _state(20.0))  # replacing keeps it most recent
    store.put(3, _state(3.0))
    assert _where(store)[1] != "mem" and _where(store)[2] == "mem"


def test_forgetting_a_spilled_client_deletes_its_uncommitted_file(tmp_path: Path) -> None:
    store = ClientStore(STATE_BYTES, tmp_path)
    store.put(0, _state(0.0))
    store.put(1, _state(1.0))
    assert len(_spill_files(tmp_path)) == 1
    store.put(0, State())  # a stateless reply forgets the client
    assert store.get(0) is None and len(store) == 1 and _spill_files(tmp_path) == set()


def test_states_are_stored_compactly(tmp_path: Path) -> None:
    big = torch.randn(1000, 100)
    view = big[10:12, :3]  # not contiguous, pins 400 kB
    store = ClientStore(0, tmp_path)
    store.put(0, State(arrays={"a": view, "b": big.t()[:5, :5]}))
    stored = store.get(0)
    assert stored is not None
    for k, want in (("a", view), ("b", big.t()[:5, :5])):
        t = stored.arrays[k]
        assert t.is_contiguous() and torch.equal(t, want)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    store.put(1, _state(1.0))  # spills client 0: its file holds 2x3 + 5x5 floats, not 100k
    (name,) = _spill_files(tmp_path)
    assert (tmp_path / name).stat().st_size < 10_000
    own = _state(2.0)
    store.put(2, own)
    assert store.get(2) is own  # already compact: kept as is, no copy


def test_shared_tensors_count_once(tmp_path: Path) -> None:
    """Clients that cached the same broadcast model share its tensors: memory counts them once,
    and spilling one sharer frees nothing until the last one goes."""
    model = torch.zeros(100)  # 400 bytes
    shared = [State(arrays={"cache.w": model, "basis.p": torch.ones(5)}) for _ in range(3)]
    store = ClientStore(10**6, tmp_path)
    for c, s in enumerate(shared):
        store.put(c, s)
    assert store.nbytes() == 400 + 3 * 20
    store = ClientStore(400 + 2 * 20, tmp_path / "small")
    for c, s in enumerate(shared):
        store.put(c, s)
    # 460 > 440: client 0 spilled, but the model is still held by 1 and 2
    assert store.num_spilled() == 1 and store.nbytes() == 400 + 2 * 20
    store.put(3, _state(3.0))  # 440 + 64 > 440: 1 and 2 spill too, the model is freed
    assert store.num_spilled() == 3 and store.nbytes() == STATE_BYTES
    assert store.disk_bytes() == 3 * 420
    for c in range(3):
        _assert_same(store.get(c), shared[c])


def test_no_limit_never_spills(tmp_path: Path) -> None:
    store = ClientStore(None, tmp_path / "spill")
    for c in range(50):
        store.put(c, _state(float(c)))
    assert store.num_spilled() == 0 and store.nbytes() == 50 * STATE_BYTES
    assert not (tmp_path / "spill").exists()
    assert store.collect_garbage() == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="spill_dir"):
        ClientStore(100)
    with pytest.raises(ValueError, match="max_memory_bytes"):
        ClientStore(-1, Path("x"))


# -------------------------------------------------------------------- dict, checkpoints


def test_to_dict_names_spilled_states_and_from_dict_restores(tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    store = ClientStore(2 * STATE_BYTES, spill)
    want = {c: _state(float(c)) for c in range(5)}
    for c, s in want.items():
        store.put(c, s)
    raw = store.to_dict()
    assert set(raw) == {str(c) for c in range(5)}
    spilled = {c for c, e in raw.items() if "spilled" in e}
    assert spilled == {"0", "1", "2"}
    assert all(raw[c]["nbytes"] == STATE_BYTES for c in spilled)
    assert {raw[c]["spilled"] for c in spilled} == _spill_files(spill)
    torch.save(raw, tmp_path / "store.pt")
    loaded = torch.load(tmp_path / "store.pt", weights_only=True)
    for limit in (None, 0, 2 * STATE_BYTES, 10**9):
        back = ClientStore.from_dict(loaded, limit, spill)
        assert len(back) == 5
        assert back.num_spilled() == 3 or limit == 0  # spilled entries are not read
        for c in range(5):
            _assert_same(back.get(c), want[c])
    with pytest.raises(ValueError, match="spill_dir"):
        ClientStore.from_dict(loaded)  # spilled entries need the directory


def test_missing_spill_file_names_the_file(tmp_path: Path) -> None:
    store = ClientStore(STATE_BYTES, tmp_path)
    store.put(0, _state(0.0))
    store.put(1, _state(1.0))
    (name,) = _spill_files(tmp_path)
    (tmp_path / name).unlink()
    with pytest.raises(StoreError, match=name.replace(".", r"\.")):
        store.get(0)
    (tmp_path / "0.99.pt").write_bytes(b"not a torch file")
    broken = ClientStore.from_dict({"0": {"spilled": "0.99.pt", "nbytes": 1}}, None, tmp_path)
    with pytest.raises(StoreError, match=r"0\.99\.pt"):
        broken.get(0)


def test_garbage_collection_keeps_what_the_last_checkpoint_names(tmp_path: Path) -> None:
    spill, ckpt = tmp_path / "spill", tmp_path / "checkpoint.pt"
    store = ClientStore(2 * STATE_BYTES, spill)
    checkpointer = Checkpointer(ckpt, store)
    server = State(arrays={"model.w": torch.ones(2)}, values={"basis_id": 0})
    for c in range(5):
        store.put(c, _state(float(c)))
    (spill / "77.1000.pt").write_bytes(b"left by a killed run")
    (spill / "notes.txt").write_text("not ours")
    checkpointer.on_round_end(0, {}, server)
    committed = {c: _state(float(c)) for c in range(5)}
    raw = torch.load(ckpt, weights_only=True)["clients"]
    named = {e["spilled"] for e in raw.values() if "spilled" in e}
    assert len(named) == 3
    assert _spill_files(spill) == named | {"notes.txt"}  # the stray spill file is gone

    # the next round replaces every client; files the checkpoint names must outlive it ...
    for c in [0, 1, 2, 3, 4, 0]:
        store.get(c)
        store.put(c, _state(10.0 + c))
    assert named <= _spill_files(spill)
    # ... so a kill now resumes from the checkpoint with every state intact
    last, srv, back = Checkpointer.load(ckpt, 2 * STATE_BYTES, spill)
    assert last == 0 and srv.values == server.values
    for c, s in committed.items():
        _assert_same(back.get(c), s)
    # the next commit deletes them
    checkpointer.on_round_end(1, {}, server)
    now = {e["spilled"] for e in store.to_dict().values() if "spilled" in e}
    assert _spill_files(spill) == now | {"notes.txt"} and not (named & now)
    _, _, back = Checkpointer.load(ckpt, None, spill)
    for c in range(5):
        _assert_same(back.get(c), _state(10.0 + c))


def test_new_store_never_reuses_an_existing_file_name(tmp_path: Path) -> None:
    old = ClientStore(STATE_BYTES, tmp_path)
    for c in range(4):
        old.put(c, _state(float(c)))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    fresh = ClientStore(STATE_BYTES, tmp_path)  # e.g. a run started over in the same place
    for c in range(4):
        fresh.put(c, _state(100.0 + c))
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data
    assert len(_spill_files(tmp_path)) == 6


def test_checkpoint_without_spilling_is_unchanged(tmp_path: Path) -> None:
    store = ClientStore()
    store.put(1, _state(1.0))
    atomic_save({"clients": store.to_dict()}, tmp_path / "c.pt")
    raw = torch.load(tmp_path / "c.pt", weights_only=True)["clients"]
    assert set(raw["1"]) == {"arrays", "values"}
    Checkpointer(tmp_path / "ck.pt", store).on_round_end(0, {}, State())
    assert Checkpointer.load(tmp_path / "ck.pt")[2].to_dict().keys() == {"1"}


# ------------------------------------------------------------------ a spilling run resumes

SEED = 5
ROUNDS = 6


def _cfg(out: Path, max_memory_mb: float | None) -> Config:
    return validate(
        {
            "name": "spill",
            "num_clients": 20,
            "participation": 0.25,
            "rounds": ROUNDS,
            "local_steps": 2,
            "batch_size": 16,
            "lr": 3e-3,
            "rank": 4,
            "model": {"name": "mlp", "kwargs": {"hidden": [32]}},
            "partition": {"min_size": 10},
            "progress": False,
            "output_dir": str(out),
            "store": {"max_memory_mb": max_memory_mb},
        }
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _no_timing(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not (k.endswith("_s") or "_s_" in k)}


class _Killed(BaseException):
    """A kill: not an ``Exception``, so the transport does not treat it as a client failure."""


def _killing_transport(kill_round: int) -> Any:
    def make(*args: Any) -> LocalTransport:
        transport = LocalTransport(*args)
        send = transport.send

        def send_or_die(
            rnd: int, messages: dict[int, Broadcast]
        ) -> dict[int, Reply | BaseException]:
            out = send(rnd, messages)  # every client trained, spilled and replaced its state
            if rnd == kill_round:
                raise _Killed(rnd)
            return out

        transport.send = send_or_die  # type: ignore[method-assign]
        return transport

    return make


def test_spilling_run_killed_and_resumed_matches_uninterrupted_run(tmp_path: Path) -> None:
    want_cfg = _cfg(tmp_path / "want", None)  # never spills
    assert run_one(want_cfg, "fedlore", SEED) is not None
    want = run_dir(want_cfg, "fedlore", SEED)
    assert not (want / "client_states").exists()

    cfg = _cfg(tmp_path / "got", 0.02)  # 20 kB: about two of the ~10 kB client states
    got = run_dir(cfg, "fedlore", SEED)
    spill = got / "client_states"
    assert run_one(cfg, "fedlore", SEED, stop_after=1) is None  # killed between rounds
    _, _, store = Checkpointer.load(got / "checkpoint.pt", None, spill)
    assert store.num_spilled() > store.num_in_memory() > 0
    # resumed, then killed in the middle of round 3 (after its clients wrote new spill files)
    with pytest.raises(_Killed):
        run_one(cfg, "fedlore", SEED, resume=True, make_transport=_killing_transport(3))
    assert [r["round"] for r in _rows(got / "metrics.jsonl")] == [-1, 0, 1, 2]
    snapshot = tmp_path / "snapshot"

    class Snapshot:  # runs after the checkpointer: keeps the files the checkpoint names
        def on_round_end(self, rnd: int, row: dict, state: State) -> None:
            shutil.rmtree(snapshot, ignore_errors=True)
            shutil.copytree(spill, snapshot)

    summary = run_one(cfg, "fedlore", SEED, resume=True, extra_callbacks=(Snapshot(),))
    assert summary is not None and summary["rounds"] == ROUNDS
    assert not spill.exists()  # a finished run's spill files are removed

    a, b = _rows(got / "metrics.jsonl"), _rows(want / "metrics.jsonl")
    assert [r["round"] for r in a] == [r["round"] for r in b] == list(range(-1, ROUNDS))
    for ra, rb in zip(a, b, strict=True):
        assert _no_timing(ra) == _no_timing(rb), ra["round"]
        for key in ("accuracy", "loss", "bytes_up", "bytes_down"):
            assert key not in rb or ra[key] == rb[key]
    # the final client states are the same tensors; the spill directory held exactly the
    # files the final checkpoint names
    _, _, sa = Checkpointer.load(got / "checkpoint.pt", None, snapshot)
    _, _, sb = Checkpointer.load(want / "checkpoint.pt")
    assert sa.num_spilled() > 0 and sb.num_spilled() == 0
    assert sa.client_ids() == sb.client_ids()
    named = {e["spilled"] for e in sa.to_dict().values() if "spilled" in e}
    assert _spill_files(snapshot) == named
    for c in sb.client_ids():
        want_state = sb.get(c)
        assert want_state is not None
        _assert_same(sa.get(c), want_state)
