"""The client-cache sync protocol (``fedlore.algorithms.sync``): the increment log's rules
(cheaper of replay and dense model, trim, forget, coverage), the client's replay, and the codec,
which must write exactly the flat checkpoint keys, values, dtypes and key order that FedLore and
the LoRA methods wrote before the protocol was one module (the reference writers below are those
methods' former inline code, kept here verbatim in their effect)."""

from __future__ import annotations

import random

import pytest
import torch

from fedlore.algorithms.sync import (
    FEDLORE_LOG,
    LORA_LOG,
    ClientCache,
    Frames,
    Offer,
    SyncState,
    cheaper,
    join_names,
    replay_steps,
    split_names,
    upcast,
)
from fedlore.tensors import with_prefix
from fedlore.types import Arrays, Broadcast, Scalars, State


# ---------------------------------------------------------------- the former inline writers
def old_fedlore_round(
    arrays: Arrays,
    values: Scalars,
    lost: list[int],
    ok: list[int],
    rnd: int,
    logged: Arrays,
    decay: float,
    cur: int,
    log_rounds: int,
) -> None:
    """FedLore.aggregate's sync writes before the refactor (round >= 0), in their order."""
    for c in lost:
        values.pop(f"version.{c}", None)
        values.pop(f"held.{c}", None)
    for k, v in logged.items():
        arrays[f"log.{rnd}.{k}"] = v
    values[f"log.{rnd}.decay"] = decay
    values[f"log.{rnd}.basis_id"] = cur
    for c in ok:
        values[f"version.{c}"] = rnd
        values[f"held.{c}"] = cur
    oldest = rnd + 1 - log_rounds
    for key in [k for k in values if k.startswith("log.")]:
        if int(key.split(".")[1]) < oldest:
            del values[key]
    for key in [k for k in arrays if k.startswith("log.")]:
        if int(key.split(".")[1]) < oldest:
            del arrays[key]


def old_fedlore_setup(values: Scalars, lost: list[int], ok: list[int]) -> None:
    for c in lost:
        values.pop(f"version.{c}", None)
        values.pop(f"held.{c}", None)
    for c in ok:
        values[f"version.{c}"] = 0
        values[f"held.{c}"] = -1


def old_lora_round(
    arrays: Arrays,
    values: Scalars,
    lost: list[int],
    ok: list[int],
    rnd: int,
    log: Arrays,
    log_rounds: int,
) -> None:
    """LoraMethod.aggregate's sync writes before the refactor, in their order."""
    for c in lost:
        values.pop(f"version.{c}", None)
    if not ok:
        return
    if log:
        arrays.update(with_prefix(log, f"log.{rnd}."))
        values[f"merged.{rnd}"] = 1
    for c in ok:
        values[f"version.{c}"] = rnd
    oldest = rnd + 1 - log_rounds
    for key in [k for k in arrays if k.startswith("log.") and int(k.split(".")[1]) < oldest]:
        del arrays[key]
    for key in [k for k in values if k.startswith("merged.") and int(k[7:]) < oldest]:
        del values[key]
    values["log_from"] = max(0, oldest)


def same_flat(a: State, b: State) -> None:
    """Identical flat dicts: keys in the same order, the same values and value types, the same
    tensor objects."""
    assert list(a.values) == list(b.values)
    for k, v in a.values.items():
        assert type(v) is type(b.values[k]) and v == b.values[k], k
    assert list(a.arrays) == list(b.arrays)
    for k, t in a.arrays.items():
        assert t is b.arrays[k], k


def split_round(rng: random.Random, clients: int) -> tuple[list[int], list[int]]:
    """A round's (lost, accepted) clients, in client order, the rest absent."""
    fate = [rng.choice(["ok", "ok", "lost", "absent"]) for _ in range(clients)]
    return [c for c, f in enumerate(fate) if f == "lost"], [
        c for c, f in enumerate(fate) if f == "ok"
    ]


# ---------------------------------------------------------------- codec
@pytest.mark.parametrize("seed", range(4))
def test_fedlore_codec_writes_what_the_old_fedlore_wrote(seed: int) -> None:
    rng = random.Random(seed)
    log_rounds, clients = rng.choice([1, 2, 3]), 6
    init_values: Scalars = {"plan.w": "left", "plan.v": "right", "basis_id": 0, "base_seed": 7}
    init_arrays: Arrays = {"model.w": torch.zeros(3), "bank.0.w": torch.ones(3)}
    old, new = (
        State(dict(init_arrays), dict(init_values)),
        State(dict(init_arrays), dict(init_values)),
    )
    lost, ok = split_round(rng, clients)  # the setup exchange
    old_fedlore_setup(old.values, lost, ok)
    sync = SyncState.decode(new, FEDLORE_LOG)
    for c in lost:
        sync.forget(c)
    for c in ok:
        sync.acknowledge(c, 0, held=-1)
    sync.encode(new.arrays, new.values)
    same_flat(old, new)
    for rnd in range(8):
        lost, ok = split_round(rng, clients)
        logged = {"w": torch.randn(2), "v": torch.randn(2)}
        decay, cur = rng.choice([1.0, 0.99]), rng.choice([0, rnd, rnd + 1])
        old_fedlore_round(old.arrays, old.values, lost, ok, rnd, logged, decay, cur, log_rounds)
        sync = SyncState.decode(new, FEDLORE_LOG)  # from the state before the round
        for c in lost:
            sync.forget(c)
        sync.record(rnd, logged, decay=decay, basis_id=cur)
        for c in ok:
            sync.acknowledge(c, rnd, held=cur)
        sync.trim(rnd + 1 - log_rounds)
        sync.encode(new.arrays, new.values)
        same_flat(old, new)
        # next round's broadcasts: the log covers exactly the clients the old rule replayed
        vals, now = old.values, SyncState.decode(new, FEDLORE_LOG)
        for c in range(clients):
            v = vals.get(f"version.{c}")
            assert v is None or isinstance(v, int), (c, v)  # the round the client holds
            replayed = v is not None and all(f"log.{s}.decay" in vals for s in range(v, rnd + 1))
            assert replayed == (v is not None and now.covers(int(v), rnd + 1)), (rnd, c)
        # decoding and encoding again changes nothing (the checkpoint a resume reads)
        again = State(dict(new.arrays), dict(new.values))
        SyncState.decode(again, FEDLORE_LOG).encode(again.arrays, again.values)
        same_flat(again, new)


@pytest.mark.parametrize("seed", range(4))
def test_lora_codec_writes_what_the_old_lora_methods_wrote(seed: int) -> None:
    rng = random.Random(seed)
    log_rounds, clients = rng.choice([1, 2, 4]), 5
    values: Scalars = {"lora_modules": "fc1,fc2", "dense_keys": "head.weight"}
    SyncState(LORA_LOG, floor=0).encode({}, values)
    assert values == {"lora_modules": "fc1,fc2", "dense_keys": "head.weight", "log_from": 0}
    values["changed.lora.fc1.A"] = -1
    init_arrays: Arrays = {"model.fc1.weight": torch.zeros(2), "lora.fc1.A": torch.ones(2)}
    old, new = State(dict(init_arrays), dict(values)), State(dict(init_arrays), dict(values))
    for rnd in range(9):
        lost, ok = split_round(rng, clients)
        merged = rng.random() < 0.6
        log = {"fc1.A": torch.randn(2), "fc1.B": torch.randn(2)} if merged else {}
        old_lora_round(old.arrays, old.values, lost, ok, rnd, log, log_rounds)
        sync = SyncState.decode(new, LORA_LOG)
        for c in lost:
            sync.forget(c)
        if ok:
            if log:
                sync.record(rnd, log)
            for c in ok:
                sync.acknowledge(c, rnd)
            sync.trim(rnd + 1 - log_rounds)
        sync.encode(new.arrays, new.values)
        same_flat(old, new)
        vals, now = old.values, SyncState.decode(new, LORA_LOG)
        for c in range(clients):
            v = vals.get(f"version.{c}")
            if v is None:
                continue
            logs = [s for s in range(int(v), rnd + 1) if vals.get(f"merged.{s}")]
            assert now.rounds(int(v), rnd + 1) == logs, (rnd, c)
            assert now.covers(int(v), rnd + 1) == (int(v) >= int(vals["log_from"])), (rnd, c)


def test_decode_reads_the_flat_keys_into_typed_records() -> None:
    w0, w1, v1 = torch.zeros(2), torch.ones(2), torch.full((1,), 2.0)
    state = State(
        {"model.w": w0, "log.3.w": w0, "log.4.w": w1, "log.4.v": v1, "bank.4.w": w1},
        {
            "plan.w": "left",
            "version.2": 3,
            "held.2": 3,
            "log.3.decay": 1.0,
            "log.3.basis_id": 3,
            "log.4.decay": 0.5,
            "log.4.basis_id": 4,
            "version.10": 4,
            "held.10": 4,
            "held.7": 1,  # a held basis without a version: dense at next contact
            "basis_id": 5,
        },
    )
    sync = SyncState.decode(state, FEDLORE_LOG)
    assert sync.clients == {
        2: ClientCache(3, 3),
        10: ClientCache(4, 4),
        7: ClientCache(None, 1),
    }
    assert list(sync.log) == [3, 4]
    assert sync.log[4].meta == {"decay": 0.5, "basis_id": 4}
    assert list(sync.log[4].arrays) == ["w", "v"] and sync.log[4].arrays["v"] is v1
    assert sync.floor is None
    assert sync.client(99) == ClientCache() and 99 not in sync.clients
    lora = SyncState.decode(
        State({"log.2.fc.A": w0}, {"log_from": 1, "merged.2": 1, "version.0": 2}), LORA_LOG
    )
    assert lora.floor == 1 and list(lora.log) == [2] and lora.clients == {0: ClientCache(2)}


# ---------------------------------------------------------------- server rules
def test_cheaper_picks_the_replay_up_to_the_dense_cost_plus_slack() -> None:
    dense = Offer({}, {"mode": "dense"}, 100)
    assert cheaper(None, dense) is dense  # no replay (the log does not cover the client)
    for cost, slack, replay_wins in [
        (99, 0, True),
        (100, 0, True),  # a tie goes to the replay
        (101, 0, False),
        (101, 1, True),  # FedLore's rule: one byte dearer still replays
        (102, 1, False),
    ]:
        replay = Offer({}, {"mode": "log"}, cost)
        assert (cheaper(replay, dense, slack=slack) is replay) == replay_wins, (cost, slack)


def test_trim_keeps_the_last_rounds_and_moves_the_floor() -> None:
    lora = SyncState(LORA_LOG, floor=0)
    fed = SyncState(FEDLORE_LOG)
    for s in range(6):
        lora.record(s, {"m.A": torch.zeros(1)})
        fed.record(s, {"w": torch.zeros(1)}, decay=1.0, basis_id=s)
    lora.trim(6 - 3)
    fed.trim(6 - 3)
    assert list(lora.log) == list(fed.log) == [3, 4, 5]
    assert lora.floor == 3 and fed.floor is None
    lora.trim(-2)  # early rounds: the floor never goes below round 0
    assert lora.floor == 0
    # coverage: a floored (sparse) log from its floor; FedLore's when every round is logged
    lora.trim(4)
    assert lora.covers(4, 9) and not lora.covers(3, 9)
    assert fed.covers(3, 6) and fed.covers(6, 6) and not fed.covers(2, 6)
    assert not fed.covers(3, 7)  # round 6 is not logged
    assert lora.rounds(0, 9) == [4, 5] and fed.rounds(4, 6) == [4, 5]


def test_forget_drops_the_client_and_its_keys() -> None:
    state = State({}, {"version.1": 2, "held.1": 2, "version.3": 2, "held.3": 0, "basis_id": 2})
    sync = SyncState.decode(state, FEDLORE_LOG)
    sync.forget(1)
    sync.forget(42)  # unknown: nothing to drop
    values = dict(state.values)
    sync.encode({}, values)
    assert values == {"version.3": 2, "held.3": 0, "basis_id": 2}
    assert sync.client(1).version is None


def test_replay_sends_each_missing_frame_before_its_increments() -> None:
    sync = SyncState(FEDLORE_LOG)
    for s, bid in [(3, 3), (4, 3), (5, 5)]:
        sync.record(s, {"w": torch.full((1,), float(s))}, decay=0.5, basis_id=bid)

    def bank(bid: int) -> Arrays:
        return {f"bank.{bid}.w": torch.full((1,), 10.0 * bid)}

    arrays, config = sync.replay(3, 6, Frames("basis_id", held=3, current=6, message=bank))
    assert list(arrays) == ["log.3.w", "log.4.w", "bank.5.w", "log.5.w", "bank.6.w"]
    assert config == {
        "decay.3": 0.5,
        "basis_id.3": 3,
        "decay.4": 0.5,
        "basis_id.4": 3,
        "decay.5": 0.5,
        "basis_id.5": 5,
    }
    arrays, _ = sync.replay(4, 6, Frames("basis_id", held=-1, current=5, message=bank))
    assert list(arrays) == ["bank.3.w", "log.4.w", "bank.5.w", "log.5.w"]
    plain, config = SyncState(LORA_LOG, floor=0).replay(0, 3)
    assert plain == {} and config == {}


# ---------------------------------------------------------------- client
def test_replay_steps_checks_the_cache_and_lists_the_rounds() -> None:
    a, b = torch.zeros(2), torch.ones(2)
    msg = Broadcast({"log.2.w": a, "log.3.w": b, "dense.x": a}, {"from_round": 2})
    cache = State({"cache.w": a, "basis.w": b}, {"version": 2})
    got, steps = replay_steps(msg, cache, 4)
    assert list(got) == ["w"] and got["w"] is a
    assert [(s, list(inc)) for s, inc in steps] == [(2, ["w"]), (3, ["w"])]
    assert steps[1][1]["w"] is b
    _, steps = replay_steps(msg, cache, 4, listed={3})
    assert [s for s, _ in steps] == [3]
    later = State({"cache.w": a}, {"version": 3})  # the server knew an older cache: skip round 2
    assert [s for s, _ in replay_steps(msg, later, 4)[1]] == [3]
    with pytest.raises(RuntimeError, match="no cached model"):
        replay_steps(msg, None, 4)
    with pytest.raises(RuntimeError, match="round 1; the replay starts at 2"):
        replay_steps(msg, State({}, {"version": 1}), 4)


def test_upcast_is_exact_and_follows_the_receiver() -> None:
    model = {"w": torch.zeros(2, dtype=torch.float64), "n": torch.zeros(1, dtype=torch.int64)}
    half = torch.tensor([0.1, 3.0], dtype=torch.bfloat16)
    got = upcast({"update.w": half, "lora.m.A": half, "other": half}, model)
    assert got["update.w"].dtype == torch.float64 and torch.equal(got["update.w"].bfloat16(), half)
    assert got["lora.m.A"] is half and got["other"] is half  # names the model does not hold
    lora = upcast(
        {"lora.m.A": half, "log.1.m.B": half, "dense.w": half, "model.w": half},
        model,
        fp32=("lora.", "log."),
        roles=("dense.",),
    )
    assert lora["lora.m.A"].dtype == lora["log.1.m.B"].dtype == torch.float32
    assert lora["dense.w"].dtype == torch.float64 and lora["model.w"] is half
    same = torch.zeros(2, dtype=torch.float64)
    assert upcast({"update.w": same}, model)["update.w"] is same  # no copy


def test_names_round_trip_as_one_scalar() -> None:
    assert join_names(["fc1", "fc2"]) == "fc1,fc2" and join_names({"a": 1}) == "a"
    assert split_names("fc1,fc2") == ["fc1", "fc2"] and split_names("") == []
    assert [int(s) for s in split_names(join_names([3, 4]))] == [3, 4]
