"""FedLore's client caches, message sizes and initial basis, through the real round loop.

Runs FedLore (and its variants / FedFull for the byte counts) with ``RoundLoop`` +
``LocalTransport`` + ``ClientStore`` on a tiny MLP with random client data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import torch
from tiny_federation import (
    H1,
    H2,
    IN,
    RANK,
    SEED,
    SIZES,
    build,
    client_data,
)

from fedlore.algorithm import Algorithm
from fedlore.algorithms.fedavg import FedFull
from fedlore.algorithms.fedlore import FedLore, FedLoreFixed, FedLoreRandom, FedLoreSketch
from fedlore.algorithms.local_galore import LocalGaLore
from fedlore.checks import setup_rounds
from fedlore.config import Config
from fedlore.engine.loop import RoundLoop
from fedlore.engine.rundir import run_dir
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_one
from fedlore.optim.subspace import average_projectors, projection_plan, projector_distance
from fedlore.seeding import CLIENT, generator
from fedlore.settings import LocalTraining
from fedlore.tensors import select
from fedlore.types import Broadcast, Reply, State


class RecordingTransport:
    """LocalTransport that also records each message's config and the synced cache the client
    stored right after it (cache.* = the model the client started the round from)."""

    def __init__(self, inner: LocalTransport) -> None:
        self.inner = inner
        self.configs: dict[int, dict[int, dict[str, Any]]] = {}
        self.caches: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self.messages: dict[int, dict[int, Broadcast]] = {}

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out = self.inner.send(rnd, messages)
        self.messages[rnd] = dict(messages)
        self.configs[rnd] = {c: dict(m.config) for c, m in messages.items()}
        self.caches[rnd] = {}
        for c in messages:
            st = self.inner.store.get(c)
            if st is not None:
                self.caches[rnd][c] = select(st.arrays, "cache.")
        return out


@dataclass
class Run:
    algo: Algorithm
    state: State
    store: ClientStore
    transport: RecordingTransport
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    globals_at: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


def run_rounds(algo: Algorithm, rounds: int, per_round: int = len(SIZES)) -> Run:
    store = ClientStore()
    inner = LocalTransport(algo, client_data, build, SEED, store)
    transport = RecordingTransport(inner)
    state = algo.init_server(build(), generator(SEED, 2))
    run = Run(algo, state, store, transport)
    start = -setup_rounds(algo)
    run.globals_at[start] = algo.global_arrays(state)

    class Recorder:
        def on_round_end(self, rnd: int, row: dict[str, Any], st: State) -> None:
            run.rows[rnd] = row
            run.globals_at[rnd + 1] = algo.global_arrays(st)

    loop = RoundLoop(
        algo,
        transport,
        lambda rnd: sample_clients(len(SIZES), per_round, SEED, rnd),
        callbacks=[Recorder()],
    )
    run.state = loop.run(state, start, rounds)
    for rnd, row in run.rows.items():
        assert row["rejected"] == 0, (rnd, row.get("rejected_reasons"))
    return run


def fedlore(**kw: Any) -> FedLore:
    base: dict[str, Any] = {"rank": RANK, "local_steps": 2, "batch_size": 8, "lr": 1e-2}
    base.update(kw)
    return FedLore.of(**base)


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert set(a) == set(b), what
    for k in a:
        assert torch.equal(a[k], b[k]), (
            f"{what}: {k} differs by {float((a[k].double() - b[k].double()).abs().max())}"
        )


def sync_with_next_broadcast(run: Run, rnd: int, cid: int) -> tuple[Broadcast, dict]:
    """Client ``cid`` receives round ``rnd``'s broadcast; returns it and the client's cache after
    synchronizing (``client_update`` stores the synced cache as ``cache.*``)."""
    msg = run.algo.broadcast(run.state, rnd, cid)
    _, new_state = run.algo.client_update(
        msg, run.store.get(cid), build(), client_data(cid), generator(SEED, CLIENT, rnd, cid)
    )
    return msg, select(new_state.arrays, "cache.")


# ------------------------------------------------------------------------------ cache sync
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_full_participation_caches_match_server(weight_decay: float) -> None:
    rounds = 4
    run = run_rounds(fedlore(weight_decay=weight_decay, schedule="cosine", rounds=6), rounds)
    # during the run: every client started every round from exactly the server model
    for rnd in range(rounds):
        for cid, cache in run.transport.caches[rnd].items():
            assert_bitwise(cache, run.globals_at[rnd], f"round {rnd} client {cid}")
            if rnd >= 1:
                assert run.transport.configs[rnd][cid]["mode"] == "log"
    # after the run: syncing with the next broadcast reproduces the final server model
    final = run.algo.global_arrays(run.state)
    assert not torch.equal(final["fc1.weight"], run.globals_at[0]["fc1.weight"])
    for cid in range(len(SIZES)):
        kept = run.store.get(cid)
        assert kept is not None, cid
        stored = select(kept.arrays, "cache.")
        assert_bitwise(stored, run.globals_at[rounds - 1], f"stored cache of {cid}")
        msg, cache = sync_with_next_broadcast(run, rounds, cid)
        assert msg.config["mode"] == "log"
        assert_bitwise(cache, final, f"client {cid}")


def test_partial_participation_long_log_caches_match_server() -> None:
    rounds = 7
    run = run_rounds(fedlore(log_rounds=50, rounds=rounds + 1), rounds, per_round=2)
    caught_up = 0  # log messages carrying more than one missed round
    for rnd in range(rounds):
        for cid, cache in run.transport.caches[rnd].items():
            assert_bitwise(cache, run.globals_at[rnd], f"round {rnd} client {cid}")
            cfg = run.transport.configs[rnd][cid]
            if cfg["mode"] == "log" and rnd - int(cfg["from_round"]) >= 2:
                caught_up += 1
    assert caught_up >= 1, "no returning client was caught up with several increments"
    final = run.algo.global_arrays(run.state)
    seen = {c for r in range(-1, rounds) for c in run.transport.configs.get(r, {})}
    for cid in range(len(SIZES)):
        msg, cache = sync_with_next_broadcast(run, rounds, cid)
        if cid not in seen:
            assert msg.config["mode"] == "dense"
        assert_bitwise(cache, final, f"client {cid}")


def test_log_rounds_one_returning_clients_get_dense_model() -> None:
    rounds = 6
    run = run_rounds(fedlore(log_rounds=1, rounds=rounds + 1), rounds, per_round=2)
    kept = [k for k in run.state.values if k.startswith("log.") and k.endswith(".decay")]
    assert kept == [f"log.{rounds - 1}.decay"]
    modes = {"log": 0, "dense": 0}
    version: dict[int, int] = {}  # round of the model each client caches (setup: W^0)
    for rnd in range(-1, rounds):
        for cid, cfg in run.transport.configs.get(rnd, {}).items():
            if rnd >= 0:
                # only a client whose cache is W^{rnd-1} (or W^rnd) can be served from a
                # one-round log; everyone else must get the dense model
                fresh = version.get(cid, -10) >= rnd - 1
                assert cfg["mode"] == ("log" if fresh else "dense"), (rnd, cid, cfg)
                modes[cfg["mode"]] += 1
                msg = run.transport.messages[rnd][cid]
                if cfg["mode"] == "dense":
                    assert set(select(msg.arrays, "model.")) == set(run.globals_at[rnd])
                cache = run.transport.caches[rnd][cid]
                assert_bitwise(cache, run.globals_at[rnd], f"round {rnd} client {cid}")
            version[cid] = max(rnd, 0)
    assert modes["dense"] >= 1 and modes["log"] >= 1, modes
    final = run.algo.global_arrays(run.state)
    for cid in range(len(SIZES)):
        msg, cache = sync_with_next_broadcast(run, rounds, cid)
        expected = "log" if version.get(cid, -10) >= rounds - 1 else "dense"
        assert msg.config["mode"] == expected
        assert_bitwise(cache, final, f"client {cid}")


# ------------------------------------------------------------------------------ bytes
def plan_and_dense_bytes() -> tuple[dict, int, int]:
    model = build()
    plan = projection_plan(model, RANK)
    assert {k: (s.m, s.n) for k, s in plan.items()} == {
        "fc1.weight": (H1, IN),
        "fc2.weight": (H2, H1),
    }
    full = sum(t.numel() * 4 for t in model.state_dict().values())
    dense = full - sum(s.m * s.n * 4 for s in plan.values())
    return plan, dense, full


N = len(SIZES)


def test_fedlore_bytes_per_round() -> None:
    plan, dense, full = plan_and_dense_bytes()
    run = run_rounds(fedlore(), 3)
    mr = sum(s.m * s.rank * 4 for s in plan.values())
    rn = sum(s.rank * s.n * 4 for s in plan.values())
    assert mr + rn == sum(s.rank * (s.m + s.n) * 4 for s in plan.values())
    # setup round: dense model down, candidate bases up
    assert run.rows[-1]["bytes_down"] == N * full
    assert run.rows[-1]["bytes_up"] == N * mr
    # round 0: the cache is W^0 already, only P^0 (and unprojected tensors) travel down
    assert run.rows[0]["bytes_down"] == N * (dense + mr)
    for rnd in (0, 1, 2):
        assert run.rows[rnd]["bytes_up"] == N * (rn + mr + dense), rnd
    for rnd in (1, 2):
        assert run.rows[rnd]["bytes_down"] == N * (rn + mr + dense), rnd
        for cid, msg in run.transport.messages[rnd].items():
            proj = {k: v for k, v in msg.arrays.items() if not k.startswith("dense.")}
            assert {k: tuple(v.shape) for k, v in proj.items()} == {
                **{f"log.{rnd - 1}.{k}": (s.rank, s.n) for k, s in plan.items()},
                **{f"bank.{rnd}.{k}": (s.m, s.rank) for k, s in plan.items()},
            }, (rnd, cid)
            assert sum(v.numel() * 4 for v in proj.values()) == sum(
                s.rank * (s.m + s.n) * 4 for s in plan.values()
            )


def test_dense_baselines_bytes() -> None:
    _, _, full = plan_and_dense_bytes()
    for algo in (
        FedFull(train=LocalTraining(local_steps=2, batch_size=8)),
        LocalGaLore(train=LocalTraining(local_steps=2, batch_size=8), rank=RANK),
    ):
        run = run_rounds(algo, 2)
        for rnd in (0, 1):
            assert run.rows[rnd]["bytes_down"] == N * full, algo.name
            assert run.rows[rnd]["bytes_up"] == N * full, algo.name


def test_fedlore_random_bytes() -> None:
    plan, dense, full = plan_and_dense_bytes()
    run = run_rounds(FedLoreRandom(train=LocalTraining(local_steps=2, batch_size=8), rank=RANK), 3)
    rn = sum(s.rank * s.n * 4 for s in plan.values())
    assert -1 not in run.rows
    assert run.rows[0]["bytes_down"] == N * full  # first contact: dense model, seed only
    for rnd in (0, 1, 2):
        assert run.rows[rnd]["bytes_up"] == N * (rn + dense)
    for rnd in (1, 2):
        assert run.rows[rnd]["bytes_down"] == N * (rn + dense)


@pytest.mark.parametrize("init_basis", ["random", "gradient"])
def test_fedlore_fixed_bytes(init_basis: Literal["gradient", "random"]) -> None:
    plan, dense, full = plan_and_dense_bytes()
    algo = FedLoreFixed(
        train=LocalTraining(local_steps=2, batch_size=8), rank=RANK, init_basis=init_basis
    )
    run = run_rounds(algo, 3)
    rn = sum(s.rank * s.n * 4 for s in plan.values())
    mr = sum(s.m * s.rank * 4 for s in plan.values())
    if init_basis == "gradient":
        # setup exchange: dense model down, gradient candidates up (accepted, see run_rounds)
        assert setup_rounds(algo) == 1
        assert run.rows[-1]["bytes_down"] == N * full
        assert run.rows[-1]["bytes_up"] == N * mr
        assert run.rows[0]["bytes_down"] == N * (dense + mr)  # cache is W^0: only P^0
    else:
        assert -1 not in run.rows
        assert run.rows[0]["bytes_down"] == N * (full + mr)  # first contact: model and P^0
    for rnd in (0, 1, 2):
        assert run.rows[rnd]["bytes_up"] == N * (rn + dense)
    for rnd in (1, 2):
        assert run.rows[rnd]["bytes_down"] == N * (rn + dense)
    bank = [k for k in run.state.arrays if k.startswith("bank.")]
    assert bank and all(k.startswith("bank.0.") for k in bank)
    for k, s in plan.items():
        p = run.state.arrays[f"bank.0.{k}"]
        assert p.shape == (s.m, s.rank)
        assert torch.allclose(p.t() @ p, torch.eye(s.rank), atol=1e-6)


# ------------------------------------------------------------------------------ P^0
def test_gradient_p0_is_orthonormal_projector_average() -> None:
    algo = fedlore()
    assert setup_rounds(algo) == 1
    run = run_rounds(algo, 0)  # only the setup exchange (round -1)
    plan = projection_plan(build(), RANK)
    assert run.state.values["basis_id"] == 0
    p0 = select(run.state.arrays, "bank.0.")
    assert set(p0) == set(plan)
    # recompute the candidates the clients uploaded and average their projectors
    init = algo.init_server(build(), generator(SEED, 2))
    replies = []
    for cid in range(N):
        msg = algo.broadcast(init, -1, cid)
        assert msg.config["mode"] == "dense"
        reply, _ = algo.client_update(
            msg, None, build(), client_data(cid), generator(SEED, CLIENT, -1, cid)
        )
        replies.append(reply)
    for k, s in plan.items():
        p = p0[k]
        assert p.shape == (s.m, s.rank) and p.dtype == torch.float32
        assert torch.allclose(p.t() @ p, torch.eye(s.rank), atol=1e-6)
        cands = [r.arrays["cand." + k] for r in replies]
        for c in cands:
            assert torch.allclose(c.t() @ c, torch.eye(s.rank), atol=1e-6)
        expected = average_projectors(cands, [float(n) for n in SIZES], s.rank)
        assert projector_distance(p, expected) < 1e-5
        # heterogeneous clients: their candidate subspaces are not all the same
        assert max(projector_distance(c, cands[0]) for c in cands) > 1e-2


def test_random_init_skips_setup_round() -> None:
    algo = fedlore(init_basis="random")
    assert setup_rounds(algo) == 0
    state = algo.init_server(build(), generator(SEED, 2))
    assert state.values["basis_id"] == 0
    for k, s in projection_plan(build(), RANK).items():
        p = state.arrays[f"bank.0.{k}"]
        assert p.shape == (s.m, s.rank)
        assert torch.allclose(p.t() @ p, torch.eye(s.rank), atol=1e-6)
    run = run_rounds(algo, 1)
    assert sorted(run.rows) == [0]
    assert sorted(run.transport.configs) == [0]


@pytest.mark.parametrize(("init_basis", "first_round"), [("gradient", -1), ("random", 0)])
def test_run_one_setup_round_rows(tmp_path, init_basis: str, first_round: int) -> None:
    cfg = Config(
        name="sync",
        rounds=1,
        num_clients=3,
        local_steps=2,
        batch_size=16,
        rank=RANK,
        algorithms=["fedlore"],
        output_dir=str(tmp_path),
        progress=False,
        checkpoint=False,
        model={"name": "mlp", "kwargs": {"hidden": [16, 16]}},
        method={"fedlore": {"init_basis": init_basis}},
    )
    summary = run_one(cfg, "fedlore", 0)
    assert summary is not None and summary["rejected_total"] == 0
    rows = [
        json.loads(x)
        for x in (run_dir(cfg, "fedlore", 0) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in rows] == list(range(first_round, 1))
    if init_basis == "gradient":
        # digits MLP 64 -> 16 -> 16 -> head: two projected 16 x 64 and 16 x 16 matrices
        assert rows[0]["bytes_up"] == 3 * (16 * RANK + 16 * RANK) * 4


# ------------------------------------------------------------------------------ 16-bit transport
WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize(
    ("cls", "transport"),
    [
        (FedLore, "fp16"),
        (FedLore, "bf16"),
        (FedLoreRandom, "bf16"),
        (FedLoreFixed, "fp16"),
        (FedLoreSketch, "bf16"),
    ],
)
def test_16bit_transport_partial_participation_caches_match_server(
    cls: type[FedLore], transport: str
) -> None:
    """Under a 16-bit wire the server applies exactly the quantized Δ^t, P^t and unprojected
    increments it sends: every client cache, also after catching up several missed rounds, is
    bit-identical to the fp32 server model, and everything a log message carries is 16-bit."""
    rounds = 6
    kw: dict[str, Any] = {"rank": RANK, "local_steps": 2, "batch_size": 8, "lr": 1e-2}
    algo = cls.of(
        transport_dtype=transport, log_rounds=50, rounds=rounds + 1, weight_decay=0.05, **kw
    )
    run = run_rounds(algo, rounds, per_round=2)
    caught_up = 0
    for rnd in range(rounds):
        for cid, cache in run.transport.caches[rnd].items():
            assert_bitwise(cache, run.globals_at[rnd], f"round {rnd} client {cid}")
            cfg = run.transport.configs[rnd][cid]
            msg = run.transport.messages[rnd][cid]
            if cfg["mode"] == "log":
                assert not any(k.startswith("dense.") for k in msg.arrays)  # increments only
                assert {v.dtype for v in msg.arrays.values()} <= {WIRE[transport]}, rnd
                caught_up += rnd - int(cfg["from_round"]) >= 2
        for cid in run.transport.caches[rnd]:  # clients hold bases and caches in fp32
            st = run.store.get(cid)
            assert st is not None and {v.dtype for v in st.arrays.values()} == {torch.float32}
    assert caught_up >= 1, "no returning client was caught up with several increments"
    final = run.algo.global_arrays(run.state)
    assert {v.dtype for v in final.values()} == {torch.float32}
    for k in ("fc1.weight", "head.bias"):  # projected and unprojected tensors both moved
        assert not torch.equal(final[k], run.globals_at[0][k]), k
    for cid in range(len(SIZES)):
        _, cache = sync_with_next_broadcast(run, rounds, cid)
        assert_bitwise(cache, final, f"client {cid}")


@pytest.mark.parametrize("transport", ["fp16", "bf16"])
def test_16bit_transport_halves_fedlore_and_fedfull_uploads(transport: str) -> None:
    """Bytes counted from the real messages: FedLore's rounds halve both ways (its round-0
    downlink is P^0 alone, the unprojected tensors travel as increments in the log), the
    setup exchange's dense model stays fp32; FedFull's uploads halve, its broadcast (the full
    model) does not."""
    plan, _, full = plan_and_dense_bytes()
    mr = sum(s.m * s.rank * 4 for s in plan.values())
    ref = run_rounds(fedlore(), 3)
    half = run_rounds(fedlore(transport_dtype=transport), 3)
    assert half.rows[-1]["bytes_down"] == ref.rows[-1]["bytes_down"] == N * full
    assert 2 * half.rows[-1]["bytes_up"] == ref.rows[-1]["bytes_up"]
    assert 2 * half.rows[0]["bytes_down"] == N * mr  # P^0 only
    for rnd in (0, 1, 2):
        assert 2 * half.rows[rnd]["bytes_up"] == ref.rows[rnd]["bytes_up"], rnd
    for rnd in (1, 2):
        assert 2 * half.rows[rnd]["bytes_down"] == ref.rows[rnd]["bytes_down"], rnd
    dense_ref = run_rounds(FedFull(train=LocalTraining(local_steps=2, batch_size=8)), 2)
    dense_half = run_rounds(
        FedFull(train=LocalTraining(local_steps=2, batch_size=8, transport_dtype=transport)), 2
    )
    for rnd in (0, 1):
        assert 2 * dense_half.rows[rnd]["bytes_up"] == dense_ref.rows[rnd]["bytes_up"] == N * full
        assert dense_half.rows[rnd]["bytes_down"] == dense_ref.rows[rnd]["bytes_down"]


@pytest.mark.parametrize("transport", ["fp32", "fp16", "bf16"])
def test_fp16_overflow_makes_the_upload_non_finite_and_rejected(transport: str) -> None:
    """A delta beyond float16's 65504 becomes ±inf on an fp16 wire (no clamping): the server's
    reply validation rejects it like any non-finite upload and the model stays as it was;
    bfloat16 (float32's range) and fp32 carry the same huge deltas."""
    from fedlore.algorithms.fedavg import FedAvg

    algo = FedAvg(
        train=LocalTraining(local_steps=1, batch_size=8, lr=1e7, transport_dtype=transport)
    )
    store = ClientStore()
    state = algo.init_server(build(), generator(SEED, 2))
    loop = RoundLoop(
        algo, LocalTransport(algo, client_data, build, SEED, store), lambda _: list(range(N))
    )
    new, row = loop.run_round(state, 0, 0)
    msgs = {c: algo.broadcast(state, 0, c) for c in range(N)}
    rng = generator(SEED, CLIENT, 0, 0)
    reply, _ = algo.client_update(msgs[0], None, build(), client_data(0), rng)
    assert float(max(v.float().abs().max() for v in reply.arrays.values())) > 65504
    if transport == "fp16":
        assert row["accepted"] == 0 and row["rejected"] == N
        assert all("NaN or Inf" in r for r in row["rejected_reasons"])
        assert_bitwise(algo.global_arrays(new), algo.global_arrays(state), "after the round")
    else:
        assert row["accepted"] == N, row.get("rejected_reasons")
        assert {v.dtype for v in reply.arrays.values()} == {WIRE.get(transport, torch.float32)}
