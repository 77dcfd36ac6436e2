"""FedLore-Sketch (issue 20 item 1): the basis from the clients' summed gradient sketches.

* the seed's Proposition 4 example, driven with the library's own projected SGD, server update,
  projector averaging (FedLore) and sketch rule (FedLore-Sketch);
* through the real round loop on a tiny MLP: P^{t+1} is the top-r left singular subspace of the
  exact mean sketch, the sketch is ``G Ω`` with the server's Ω bit for bit, runs repeat
  bitwise, the bytes are ``r n + m (r+p)`` up per matrix;
* ``upload_increments`` (the secure-aggregation / DP upload form) gives the same model for the
  sum-aggregable FedLore variants, and FedLore / FedLore-fixed with a gradient P^0 refuse it;
* the shared-basis diagnostics run for FedLore-Sketch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from fedlore.algorithm import Algorithm
from fedlore.algorithms.base import construction_gradients
from fedlore.algorithms.basis_rules import SketchRule
from fedlore.algorithms.fedlore import FedLore, FedLoreFixed, FedLoreRandom, FedLoreSketch
from fedlore.algorithms.lowrank import (
    apply_increment,
    mean_sketch_basis,
    sketch_gradients,
    sketch_omegas,
)
from fedlore.checks import is_sum_aggregable, setup_rounds
from fedlore.config import Config
from fedlore.engine.loop import RoundLoop
from fedlore.engine.rundir import run_dir
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_one
from fedlore.optim.projected_adam import ProjectedSGD
from fedlore.optim.subspace import (
    MatrixSpec,
    average_projectors,
    projection_plan,
    projector_distance,
    sketch_basis,
    top_left_singular,
)
from fedlore.seeding import CLIENT, generator
from fedlore.tensors import select
from fedlore.types import Broadcast, Reply, State

# ------------------------------------------------------------------ Proposition 4 (seed 000)
C1 = torch.diag(torch.tensor([2.0, 1.0], dtype=torch.float64))
C2 = torch.diag(torch.tensor([-2.0, 1.0], dtype=torch.float64))
SPEC = MatrixSpec("w", (2, 2), "left", 2, 2, 1)
E1 = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
E2 = torch.tensor([[0.0], [1.0]], dtype=torch.float64)


def client_step(w: torch.Tensor, c: torch.Tensor, basis: torch.Tensor) -> tuple[Any, Any]:
    """K = 1 step of the library's projected SGD at γ = 1 on ``f_i(W) = ½‖W‖² + ⟨C_i, W⟩``
    (exact gradient ``W + C_i``): the coordinates ΔZ_i (r x n) and the gradient it used."""
    param = nn.Parameter(w.clone())
    opt = ProjectedSGD([], [(param, SPEC, basis)], lr=1.0)
    loss = 0.5 * param.pow(2).sum() + (c * param).sum()
    loss.backward()
    assert param.grad is not None
    grad = param.grad.detach().clone()
    opt.step()
    return opt.coords[param].detach().clone(), grad


def prop4_round(w: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, list, list]:
    """One round with p_1 = p_2 = ½: ``W <- W + P^t mean(ΔZ_i)`` (the server's
    ``apply_increment``); returns W^{t+1}, the coordinates and the gradients."""
    steps = [client_step(w, c, basis) for c in (C1, C2)]
    coords = [z for z, _ in steps]
    delta = 0.5 * (coords[0] + coords[1])
    return apply_increment(w, SPEC, basis, delta, 1.0), coords, [g for _, g in steps]


def test_proposition4_projector_averaging_stalls_sketch_reaches_the_minimizer() -> None:
    fedlore = FedLore(rank=1)
    sketch = FedLoreSketch(rank=1)  # p = 5: Ω is 2 x 6
    plan = {"w": SPEC}
    weights = [1.0, 1.0]
    w0 = torch.zeros(2, 2, dtype=torch.float64)
    minimizer = -torch.diag(torch.tensor([0.0, 1.0], dtype=torch.float64))

    # projector averaging (FedLore): both candidates are e_1 (σ = 2 > 1), so P stays e_1 and
    # the e_1-updates cancel in every round: W = 0 forever, far from the mean's minimizer
    w, basis = w0, E1
    for rnd in range(5):
        w, coords, grads = prop4_round(w, basis)
        assert torch.equal(w, w0), rnd
        cands = [fedlore._candidate(SPEC, g, basis, generator(0, rnd), w) for g in grads]
        for c in cands:
            assert projector_distance(c, E1) < 1e-15
        basis = average_projectors(cands, weights, 1, dtype=torch.float64)
        assert projector_distance(basis, E1) < 1e-15, rnd

    # the sketch rule (its functions in lowrank: the client's sketch, the server's step)
    w, basis = w0, E1
    w, coords, grads = prop4_round(w, basis)
    # round 0 makes no progress: the e_1-coordinates are -2 and +2 (ΔZ = -γ Pᵀ G_i) and cancel
    assert torch.equal(coords[0], torch.tensor([[-2.0, 0.0]], dtype=torch.float64))
    assert torch.equal(coords[1], torch.tensor([[2.0, 0.0]], dtype=torch.float64))
    assert torch.equal(w, w0)
    # the mean gradient at W^0 = 0 is diag(0, 1): its sketch diag(0, 1) Ω has range e_2
    assert torch.equal(0.5 * (grads[0] + grads[1]), -minimizer)
    seed = 12345
    ys = [sketch_gradients(seed, plan, {"w": g}, {"w": w}, sketch.sketch_width) for g in grads]
    omega = sketch_omegas(seed, plan, sketch.sketch_width, torch.float64)["w"]
    assert omega.shape == (2, 6)
    for y, g in zip(ys, grads, strict=True):
        assert torch.equal(y["w"], g @ omega)
    # the mean sketch is the sketch of the mean gradient: its e_1 row is exactly zero
    mean = 0.5 * (ys[0]["w"] + ys[1]["w"])
    assert torch.equal(mean, (-minimizer) @ omega) and not bool(mean[0].any())
    basis = mean_sketch_basis(ys, weights, {"w": basis}, sketch.rank)["w"]
    assert projector_distance(basis, E2) < 1e-15
    assert torch.equal(basis.abs(), E2)  # ±e_2 exactly
    # round 1 in P^1 = e_2: both clients move along e_2 and reach the minimizer, exactly
    w, coords, _ = prop4_round(w, basis)
    assert torch.equal(w, minimizer)


def test_sketch_basis_rank_deficient_keeps_the_previous_basis() -> None:
    g = torch.Generator().manual_seed(0)
    prev = torch.linalg.qr(torch.randn(6, 2, dtype=torch.float64, generator=g))[0]
    # all zero (no finite gradient anywhere): P^t is kept entirely
    zero = torch.zeros(6, 4, dtype=torch.float64)
    assert torch.equal(sketch_basis(zero, 2, prev), prev)
    # rank 1 for r = 2: the sketch's direction first, then P^t's part orthogonal to it
    u = torch.randn(6, 1, dtype=torch.float64, generator=g)
    y = u @ torch.randn(1, 4, dtype=torch.float64, generator=g)
    got = sketch_basis(y, 2, prev)
    assert torch.allclose(got.t() @ got, torch.eye(2, dtype=torch.float64), atol=1e-12)
    assert projector_distance(got[:, :1], u / u.norm()) < 1e-12
    rest = prev - (u / u.norm()) @ ((u / u.norm()).t() @ prev)
    fill = top_left_singular(rest, 1, dtype=torch.float64)
    assert projector_distance(got[:, 1:], fill) < 1e-12
    # full rank: the exact top-r left singular vectors, in float32 when asked
    full = torch.randn(6, 4, dtype=torch.float64, generator=g)
    ref = torch.linalg.svd(full)[0][:, :2]
    got32 = sketch_basis(full.float(), 2, prev, dtype=torch.float32)
    assert got32.dtype == torch.float32
    assert projector_distance(got32, ref) < 1e-5
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="NaN or Inf"):
            sketch_basis(torch.full((6, 4), bad), 2, prev)
    with pytest.raises(ValueError, match="previous basis"):
        sketch_basis(full, 2, prev[:, :1])


# ------------------------------------------------------------------ through the round loop
from tiny_federation import RANK, SEED, SIZES, build, client_data  # noqa: E402

from fedlore.settings import LocalTraining  # noqa: E402

N = len(SIZES)


@dataclass
class Run:
    algo: Algorithm
    state: State
    store: ClientStore
    replies: dict[int, dict[int, Reply]] = field(default_factory=dict)
    messages: dict[int, dict[int, Broadcast]] = field(default_factory=dict)
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    states: dict[int, State] = field(default_factory=dict)  # the state after round t


def run_rounds(algo: Algorithm, rounds: int, per_round: int = N) -> Run:
    store = ClientStore()
    inner = LocalTransport(algo, client_data, build, SEED, store)
    state = algo.init_server(build(), generator(SEED, 2))
    run = Run(algo, state, store)
    run.states[-2] = state

    class Recording:
        def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict:
            out = inner.send(rnd, messages)
            run.messages[rnd] = dict(messages)
            run.replies[rnd] = {c: r for c, r in out.items() if isinstance(r, Reply)}
            return out

    class Recorder:
        def on_round_end(self, rnd: int, row: dict[str, Any], st: State) -> None:
            run.rows[rnd] = row
            run.states[rnd] = st

    loop = RoundLoop(
        algo,
        Recording(),
        lambda rnd: sample_clients(N, per_round, SEED, rnd),
        callbacks=[Recorder()],
    )
    start = -setup_rounds(algo)
    run.state = loop.run(state, start, rounds)
    for rnd, row in run.rows.items():
        assert row["rejected"] == 0, (rnd, row.get("rejected_reasons"))
    return run


def sketch_algo(**kw: Any) -> FedLoreSketch:
    base: dict[str, Any] = {"rank": RANK, "local_steps": 2, "batch_size": 8, "lr": 1e-2}
    base.update(kw)
    return FedLoreSketch.of(**base)


def test_full_participation_basis_is_the_range_finder_of_the_mean_sketch() -> None:
    algo = sketch_algo(sketch_oversample=3)
    q = RANK + 3
    rounds = 3
    run = run_rounds(algo, rounds)
    plan = projection_plan(build(), RANK)
    assert setup_rounds(algo) == 1 and sorted(run.rows) == [-1, 0, 1, 2]
    for rnd in range(-1, rounds):
        replies = run.replies[rnd]
        assert sorted(replies) == list(range(N))
        bank = select(run.states[rnd].arrays, f"bank.{rnd + 1}.")
        assert run.states[rnd].values["basis_id"] == rnd + 1
        for k, s in plan.items():
            ys = [replies[c].arrays[f"sketch.{k}"] for c in range(N)]
            assert all(y.shape == (s.m, q) and y.dtype == torch.float32 for y in ys)
            total = float(sum(SIZES))
            mean = sum(float(n) / total * y.double() for n, y in zip(SIZES, ys, strict=True))
            assert isinstance(mean, torch.Tensor)
            expected = torch.linalg.svd(mean)[0][:, :RANK]
            p = bank[k]
            assert p.shape == (s.m, RANK) and p.dtype == torch.float32
            assert projector_distance(p, expected) < 1e-5, (rnd, k)
            # heterogeneous clients: a client's own sketch spans another subspace
            own = torch.linalg.svd(ys[0].double())[0][:, :RANK]
            assert projector_distance(own, expected) > 1e-2, (rnd, k)
        if rnd >= 0:
            assert 0.0 <= run.rows[rnd]["basis_overlap"] <= 1.0 + 1e-6
    # bytes: the setup exchange uploads the sketches only; a round r n + m q per matrix (+ the
    # dense tensors), the downlink as FedLore's (Δ^{t-1}, P^t and the dense tensors)
    model = build()
    full = sum(t.numel() * 4 for t in model.state_dict().values())
    dense = full - sum(s.m * s.n * 4 for s in plan.values())
    mq = sum(s.m * q * 4 for s in plan.values())
    rn = sum(s.rank * s.n * 4 for s in plan.values())
    mr = sum(s.m * s.rank * 4 for s in plan.values())
    assert run.rows[-1]["bytes_up"] == N * mq
    assert run.rows[-1]["bytes_down"] == N * full
    assert run.rows[0]["bytes_down"] == N * (dense + mr)
    for rnd in range(rounds):
        assert run.rows[rnd]["bytes_up"] == N * (rn + mq + dense), rnd
    for rnd in range(1, rounds):
        assert run.rows[rnd]["bytes_down"] == N * (rn + mr + dense), rnd


def test_omega_is_the_same_on_server_and_client_and_runs_repeat_bitwise() -> None:
    algo = sketch_algo()
    state = algo.init_server(build(), generator(SEED, 2))
    plan = algo.plan(build())
    server = SketchRule(algo).omegas(state, -1)
    # the client's setup sketch is its construction gradient times the server's Ω, bit for bit
    for cid in (0, 2):
        msg = algo.broadcast(state, -1, cid)
        client = sketch_omegas(
            int(msg.config["sketch_seed"]), plan, algo.sketch_width, torch.float32, "cpu"
        )
        assert server.keys() == client.keys() == plan.keys()
        for k, s in plan.items():
            assert server[k].shape == (s.n, RANK + 5)
            assert torch.equal(server[k], client[k])
        reply, _ = algo.client_update(
            msg, None, build(), client_data(cid), generator(SEED, CLIENT, -1, cid)
        )
        model = build()
        grads = construction_gradients(
            model,
            client_data(cid).train,
            algo.train.batch_size,
            generator(SEED, CLIENT, -1, cid),
            list(plan),
        )
        for k, s in plan.items():
            assert torch.equal(reply.arrays[f"sketch.{k}"], s.view(grads[k]) @ server[k])
    # a fresh Ω per round and per matrix
    other = SketchRule(algo).omegas(state, 0)
    assert all(not torch.equal(server[k], other[k]) for k in plan)
    first, second = (server[k] for k in plan)
    assert not torch.equal(first[: second.shape[0]], second[: first.shape[0]])
    # two runs with the same seed: identical models, bases and replies
    a, b = run_rounds(sketch_algo(), 2), run_rounds(sketch_algo(), 2)
    for key, t in a.state.arrays.items():
        assert torch.equal(t, b.state.arrays[key]), key
    assert a.state.values == b.state.values
    for rnd, replies in a.replies.items():
        for cid, r in replies.items():
            for key, t in r.arrays.items():
                assert torch.equal(t, b.replies[rnd][cid].arrays[key]), (rnd, cid, key)


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: sketch_algo(**kw),
        lambda **kw: FedLoreRandom.of(local_steps=2, batch_size=8, lr=1e-2, rank=RANK, **kw),
        lambda **kw: FedLoreFixed.of(
            local_steps=2, batch_size=8, lr=1e-2, rank=RANK, init_basis="random", **kw
        ),
    ],
    ids=["fedlore_sketch", "fedlore_random", "fedlore_fixed"],
)
def test_upload_increments_give_the_same_model(make: Any) -> None:
    """Dense tensors uploaded (and logged, and applied) as increments ``D_K - D^t``: the global
    model after 3 rounds equals the one from uploaded values to float32 rounding, and the
    clients' caches stay bit-identical to the server model (partial participation: the log
    carries the increments to returning clients)."""
    rounds = 3
    plain = make()
    inc = make(upload_increments=True)
    assert is_sum_aggregable(type(inc)) and inc.dense_increments and not plain.dense_increments
    ref = run_rounds(plain, rounds, per_round=3)
    got = run_rounds(inc, rounds, per_round=3)
    final_ref, final = ref.algo.global_arrays(ref.state), got.algo.global_arrays(got.state)
    for k in final_ref:
        assert torch.allclose(final[k], final_ref[k], rtol=0, atol=1e-6), k
    init = got.algo.global_arrays(got.states[-2])
    assert not torch.equal(final["head.bias"], init["head.bias"])  # dense tensors moved
    for rnd in range(rounds):
        for cid, reply in got.replies[rnd].items():
            kept = got.store.get(cid) if rnd == rounds - 1 else None
            assert kept is not None or rnd < rounds - 1, cid
            start = select(kept.arrays, "cache.") if kept is not None else None
            d = reply.arrays["dense.head.bias"]
            v = ref.replies[rnd][cid].arrays["dense.head.bias"]
            if start is not None:  # the increment is the trained value minus the start
                assert torch.allclose(d + start["head.bias"], v, atol=1e-6)
            assert float(d.abs().max()) < float(v.abs().max())
        for cid, msg in got.messages[rnd].items():
            if msg.config["mode"] == "log":
                assert not any(k.startswith("dense.") for k in msg.arrays), (rnd, cid)
    # every client syncs to the final server model bit for bit
    for cid in range(N):
        msg = got.algo.broadcast(got.state, rounds, cid)
        _, st = got.algo.client_update(
            msg, got.store.get(cid), build(), client_data(cid), generator(SEED, CLIENT, rounds, cid)
        )
        cache = select(st.arrays, "cache.")
        for k in final:
            assert torch.equal(cache[k], final[k]), (cid, k)


def test_sum_aggregable_flags_and_refusals() -> None:
    assert is_sum_aggregable(FedLoreSketch)
    assert is_sum_aggregable(FedLoreRandom) and is_sum_aggregable(FedLoreFixed)
    assert not is_sum_aggregable(FedLore)
    with pytest.raises(ValueError, match=r"sqrt\(p_1\) P_1.*fedlore_sketch"):
        FedLore(train=LocalTraining(upload_increments=True))
    with pytest.raises(ValueError, match="init_basis: random"):
        FedLoreFixed(train=LocalTraining(upload_increments=True))
    assert FedLoreFixed(
        train=LocalTraining(upload_increments=True), init_basis="random"
    ).dense_increments
    assert (
        setup_rounds(FedLoreSketch(train=LocalTraining(upload_increments=True))) == 1
    )  # sketches sum, too
    with pytest.raises(ValueError, match="sketch_oversample"):
        FedLoreSketch(sketch_oversample=-1)
    assert FedLoreSketch(rank=3, sketch_oversample=0).sketch_width == 3


def test_diagnostics_measure_the_sketch_basis(tmp_path) -> None:
    cfg = Config(
        name="sketch_diag",
        rounds=2,
        num_clients=3,
        local_steps=2,
        batch_size=16,
        rank=RANK,
        algorithms=["fedlore_sketch"],
        output_dir=str(tmp_path),
        progress=False,
        checkpoint=False,
        model={"name": "mlp", "kwargs": {"hidden": [16, 16]}},
        diagnostics={"every": 1, "batch_size": 16},
    )
    summary = run_one(cfg, "fedlore_sketch", 0)
    assert summary is not None and summary["rejected_total"] == 0
    rows = [
        json.loads(x)
        for x in (run_dir(cfg, "fedlore_sketch", 0) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in rows] == [-1, 0, 1]
    for r in rows[1:]:
        assert 0.0 < r["diag.retained_energy"] <= 1.0 + 1e-9, r
        assert r["diag.rho2"] >= 0.0 and r["diag.grad_norm2"] > 0.0
        assert "diag.certificate2" not in r  # no per-client candidates, no Proposition 2 terms
        assert not r.get("diag_bytes_up")
    # the setup exchange: 3 clients upload one 16 x 64 and one 16 x 16 sketch of width r + p
    assert rows[0]["bytes_up"] == 3 * (16 + 16) * (RANK + 5) * 4
