"""FedGaLore (:mod:`fedlore.algorithms.fedgalore`) and AJIVE's spectral steps
(:mod:`fedlore.optim.joint`) on cases small enough to compute by hand: the shared direction of
two clients' second moments, the synchronized ``V̄`` (G6), the Adam state a client continues from
(G2) and the second moment it trains with in the next round."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedlore.algorithms.fedgalore import FedGaLore, synchronized_second_moment
from fedlore.algorithms.lowrank import OptState
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.loop import validate_reply
from fedlore.optim.joint import joint_basis, joint_part, signal_basis
from fedlore.optim.projected_adam import ProjectedAdam
from fedlore.optim.subspace import MatrixSpec
from fedlore.types import Broadcast, Reply, State

# two clients' projected second moments (r = 2 rows, n = 3 shared columns): V_1's rows span
# {e1, e2}, V_2's {e1, e3}; the only direction they share is e1
V1 = torch.tensor([[1.0, 2.0, 0.0], [3.0, 1.0, 0.0]])
V2 = torch.tensor([[4.0, 0.0, 5.0], [1.0, 0.0, 1.0]])


def _line(deg: float) -> torch.Tensor:
    """The unit vector at ``deg`` degrees in the plane, as a 2 x 1 basis."""
    a = math.radians(deg)
    return torch.tensor([[math.cos(a)], [math.sin(a)]], dtype=torch.float64)


# ------------------------------------------------------------------ AJIVE, step by step


def test_signal_basis_spans_the_row_space_and_drops_zero_directions() -> None:
    u = signal_basis(V1, 2)
    assert u.shape == (3, 2) and u.dtype == torch.float64
    torch.testing.assert_close(u @ u.t(), torch.diag(torch.tensor([1.0, 1.0, 0.0])).double())
    top = signal_basis(V1, 1)  # the leading right singular vector only
    _, _, vh = torch.linalg.svd(V1.double())
    torch.testing.assert_close(top @ top.t(), vh[:1].t() @ vh[:1])
    # a rank-1 block keeps one direction whatever the rank asked; a zero block none
    assert signal_basis(torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), 2).shape == (3, 1)
    assert signal_basis(torch.zeros(2, 3), 2).shape == (3, 0)
    with pytest.raises(ValueError, match="NaN"):
        signal_basis(torch.tensor([[float("nan"), 0.0]]), 1)


def test_two_clients_share_exactly_e1() -> None:
    """Signal spaces {e1, e2} and {e1, e3}, equal weights: the stack's squared singular values
    are 1 (e1, in both), 1/2 and 1/2 (e2, e3, one client each); at θ_max = 30° (cos² = 3/4)
    only e1 is joint, at 46° (cos² < 1/2) all three are."""
    bases = [signal_basis(V1, 2), signal_basis(V2, 2)]
    joint, s2 = joint_basis(bases, [1.0, 1.0], 30.0)
    torch.testing.assert_close(s2, torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64))
    torch.testing.assert_close(joint, torch.tensor([[1.0], [0.0], [0.0]], dtype=torch.float64))
    assert joint_basis(bases, [1.0, 1.0], 46.0)[0].shape == (3, 3)


@pytest.mark.parametrize(("phi", "shared"), [(50.0, True), (70.0, False)])
def test_two_lines_are_joint_within_twice_the_angle(phi: float, shared: bool) -> None:
    """Two lines at angle φ: s² = (1 + cos φ) / 2 = cos²(φ / 2), along their bisector. At
    θ_max = 30° the bisector is joint for φ = 50° (s² = 0.82 >= 0.75), not for φ = 70°
    (0.67)."""
    joint, s2 = joint_basis([_line(0.0), _line(phi)], [1.0, 1.0], 30.0)
    assert float(s2[0]) == pytest.approx(math.cos(math.radians(phi / 2)) ** 2)
    assert float(s2[1]) == pytest.approx(math.sin(math.radians(phi / 2)) ** 2)
    if shared:
        torch.testing.assert_close(joint, _line(phi / 2))
    else:
        assert joint.shape == (2, 0)


def test_the_weights_count() -> None:
    """e1 for a client of weight 3, e2 for one of weight 1: s² = 3/4 and 1/4, so at 31°
    (cos² = 0.73) e1 is joint; with equal weights (1/2 each) neither is."""
    e1, e2 = _line(0.0), _line(90.0)
    joint, s2 = joint_basis([e1, e2], [3.0, 1.0], 31.0)
    torch.testing.assert_close(s2, torch.tensor([0.75, 0.25], dtype=torch.float64))
    torch.testing.assert_close(joint, e1)
    assert joint_basis([e1, e2], [1.0, 1.0], 31.0)[0].shape == (2, 0)


def test_joint_basis_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        joint_basis([], [], 30.0)
    with pytest.raises(ValueError, match="rows"):
        joint_basis([_line(0.0), torch.eye(3)[:, :1]], [1.0, 1.0], 30.0)
    with pytest.raises(ValueError, match="positive"):
        joint_basis([_line(0.0)], [0.0], 30.0)
    with pytest.raises(ValueError, match="90"):
        joint_basis([_line(0.0)], [1.0], 90.0)


def test_synchronized_second_moment_by_hand() -> None:
    """Equal weights: J = e1, so each V_i keeps its first column, V̄ = (V_1 + V_2) e1 e1ᵀ / 2.
    Weights 4 and 1: e2 (client 1's alone) reaches s² = 4/5 >= 3/4 and joins, e3 (1/5) does
    not: J = [e1, e2] and V̄ = (4 V_1 [e1 e2 part] + V_2 [e1 part]) / 5."""
    vbar, rank = synchronized_second_moment([V1, V2], [1.0, 1.0], 2, 30.0)
    assert rank == 1
    want = torch.tensor([[2.5, 0.0, 0.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(vbar, want)
    vbar, rank = synchronized_second_moment([V1, V2], [4.0, 1.0], 2, 30.0)
    assert rank == 2
    want = torch.tensor([[1.6, 1.6, 0.0], [2.6, 0.8, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(vbar, want)
    torch.testing.assert_close(joint_part(V1, torch.eye(3)), V1.double())


def test_synchronized_second_moment_is_never_negative() -> None:
    """A joint part can have negative entries; V̄ is clipped at 0 (sqrt(V) follows)."""
    block = torch.tensor([[1.0, -1.0]])
    vbar, rank = synchronized_second_moment([block, block], [1.0, 1.0], 1, 30.0)
    assert rank == 1
    torch.testing.assert_close(vbar, torch.tensor([[1.0, 0.0]], dtype=torch.float64))


def test_nothing_shared_gives_a_zero_second_moment() -> None:
    e1, e2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]])
    vbar, rank = synchronized_second_moment([e1, e2], [1.0, 1.0], 1, 30.0)
    assert rank == 0 and not bool(vbar.any())


# ------------------------------------------------------------------ Adam continued by hand


def test_projected_adam_continues_a_kept_state() -> None:
    """One step from M_0 = (1, 1), V_0 = (4, 1) after 3 steps, β = (0.5, 0.75), ε = 0: M, V
    move from the kept values and the bias corrections use step 4 (G2, G3)."""
    w = nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    spec = MatrixSpec("w", (2, 2), "left", 2, 2, 1)
    p = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    opt = ProjectedAdam([], [(w, spec, p)], lr=0.1, betas=(0.5, 0.75), eps=0.0)
    m0 = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    v0 = torch.tensor([[4.0, 1.0]], dtype=torch.float64)
    opt.state[w] = {"step": 3, "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    w.grad = torch.tensor([[2.0, 0.0], [9.0, 9.0]], dtype=torch.float64)  # R = (2, 0)
    opt.step()
    m1 = [0.5 * 1 + 0.5 * 2, 0.5 * 1 + 0.5 * 0]
    v1 = [0.75 * 4 + 0.25 * 4, 0.75 * 1 + 0.25 * 0]
    step = [
        -0.1 * (m / (1 - 0.5**4)) / math.sqrt(v / (1 - 0.75**4))
        for m, v in zip(m1, v1, strict=True)
    ]
    torch.testing.assert_close(w.detach()[0], torch.tensor(step, dtype=torch.float64))
    assert not bool(w.detach()[1].any())
    torch.testing.assert_close(opt.state[w]["exp_avg_sq"], torch.tensor([v1], dtype=torch.float64))
    assert opt.state[w]["step"] == 4


# ------------------------------------------------------------------ the method

NOUT, NIN = 4, 3


def _model() -> nn.Module:
    model = nn.Linear(NIN, NOUT, bias=False)  # left view 4 x 3, rank 2 < 3
    with torch.no_grad():
        model.weight.zero_()
    return model


def test_server_synchronizes_the_uploaded_second_moments() -> None:
    """Two fabricated replies carrying V_1 and V_2: the server's V̄ is the hand result above,
    its step count the weighted mean of the clients' (4 and 10: 7), both broadcast."""
    algo = FedGaLore.of(rank=2, weighting="uniform")
    state = algo.init_server(_model(), torch.Generator().manual_seed(0))
    spec = algo.expected_reply(state, 0, 0)
    assert spec["moment.v.weight"] == ((2, NIN), torch.float32)
    replies: list[tuple[int, Reply | None]] = []
    for cid, (v, steps) in enumerate([(V1, 4), (V2, 10)]):
        arrays = {"update.weight": torch.zeros(NOUT, NIN), "moment.v.weight": v}
        reply = Reply(arrays, {"num_examples": 5 + cid, "moment_steps": steps})
        assert validate_reply(reply, spec) is None
        replies.append((cid, reply))
    replies.append((2, None))  # a lost client changes nothing
    new, metrics = algo.aggregate(state, replies, 0)
    want = torch.tensor([[2.5, 0.0, 0.0], [2.0, 0.0, 0.0]])
    torch.testing.assert_close(new.arrays["sync.v.weight"], want)
    assert new.values["sync.step"] == 7 and metrics["joint_rank"] == 1
    msg = algo.broadcast(new, 1, 0)
    torch.testing.assert_close(msg.arrays["sync.v.weight"], want)
    assert msg.config["sync_step"] == 7
    assert "sync.v.weight" not in algo.broadcast(state, 0, 0).arrays  # none before a round
    # a round with no accepted reply keeps the last V̄
    kept, _ = algo.aggregate(new, [(0, None)], 1)
    torch.testing.assert_close(kept.arrays["sync.v.weight"], want)


def _moments(opt: OptState) -> tuple[torch.Tensor, torch.Tensor, int]:
    """An Adam state's ``exp_avg``, ``exp_avg_sq`` and ``step``, checked to be what they are."""
    m, v, step = opt["exp_avg"], opt["exp_avg_sq"], opt["step"]
    assert isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor) and isinstance(step, int)
    return m, v, step


def test_round_moments_adopt_the_broadcast_second_moment() -> None:
    """(G2): a returning client keeps its first moment and step count and trains from V̄; a new
    client starts from M = 0, V = V̄ and the broadcast step count; no V̄: its own state."""
    algo = FedGaLore.of(rank=2)
    plan = algo.plan(_model())
    like = {"weight": torch.zeros(NOUT, NIN)}
    vbar = torch.tensor([[2.5, 0.0, 0.0], [2.0, 0.0, 0.0]])
    msg = Broadcast({"sync.v.weight": vbar}, {"round": 1, "sync_step": 7})
    own_m, own_v = torch.ones(2, NIN), torch.full((2, NIN), 9.0)
    state = State(
        {"opt.exp_avg.weight": own_m, "opt.exp_avg_sq.weight": own_v}, {"opt.step.weight": 3}
    )
    m, v, step = _moments(algo.round_moments(msg, state, plan, like)["weight"])
    assert torch.equal(m, own_m) and torch.equal(v, vbar)
    assert step == 3
    assert m is not own_m and v is not vbar  # copies
    m, v, step = _moments(algo.round_moments(msg, None, plan, like)["weight"])
    assert not bool(m.any()) and torch.equal(v, vbar)
    assert step == 7
    _, v, _ = _moments(algo.round_moments(Broadcast({}, {"round": 1}), state, plan, like)["weight"])
    assert torch.equal(v, own_v)
    assert algo.round_moments(Broadcast({}, {"round": 0}), None, plan, like) == {}


X = torch.tensor([[1.0, 0.0, 0.0]])
YS = [torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[2.0, 0.0, 0.0, 0.0]])]
LR = 0.1
B2 = 0.999


def _data(cid: int) -> ClientData:
    return ClientData(cid, TensorSplit(X, YS[cid]), TensorSplit(X, YS[cid]))


def test_two_clients_train_their_second_round_from_the_synchronized_moment() -> None:
    """W^0 = 0, one example each (x = e1, y_A = (1, 2, 3, 4), y_B = (2, 0, 0, 0)), one step a
    round, r = 2. A client's gradient is (W x - y) xᵀ, rank 1, so its basis's first column is
    ±(W x - y)/|W x - y| and R = Pᵀ G has one non-zero entry, ±|W x - y|, at (0, 0): after
    round 0, V_i = (1 - β2) |y_i|² there and 0 elsewhere, both rows along e1, so J = e1 and
    V̄ = (1 - β2) (30 + 4) / 2 at (0, 0). Round 1: client A's second moment is
    β2 V̄ + (1 - β2) |W^1 x - y_A|² (not its own 30 (1 - β2), nor a fresh one)."""
    algo = FedGaLore.of(rank=2, lr=LR, local_steps=1, batch_size=1, weighting="uniform")
    model = _model()
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    store: dict[int, State] = {}
    replies: list[tuple[int, Reply | None]] = []
    for cid in (0, 1):
        reply, store[cid] = algo.client_update(
            algo.broadcast(state, 0, cid), None, model, _data(cid), torch.Generator()
        )
        assert validate_reply(reply, algo.expected_reply(state, 0, cid)) is None
        want = torch.zeros(2, NIN)
        want[0, 0] = (1 - B2) * float(YS[cid].pow(2).sum())
        torch.testing.assert_close(reply.arrays["moment.v.weight"], want)
        assert reply.metrics["moment_steps"] == 1
        replies.append((cid, reply))
    state, _ = algo.aggregate(state, replies, 0)
    vbar = (1 - B2) * (30.0 + 4.0) / 2
    assert float(state.arrays["sync.v.weight"][0, 0]) == pytest.approx(vbar, rel=1e-6)
    # the server's W^1 x: the mean of the clients' first Adam steps, lr (y_i / |y_i|) each
    w1x = algo.global_arrays(state)["weight"][:, 0]
    steps = [LR * y[0] / y[0].norm() for y in YS]
    torch.testing.assert_close(w1x, (steps[0] + steps[1]) / 2)
    reply, after = algo.client_update(
        algo.broadcast(state, 1, 0), store[0], model, _data(0), torch.Generator()
    )
    resid = float((w1x - YS[0][0]).pow(2).sum())
    got = reply.arrays["moment.v.weight"]
    assert float(got[0, 0]) == pytest.approx(B2 * vbar + (1 - B2) * resid, rel=1e-5)
    assert float(got[1].abs().max()) < 1e-12 and float(got[0, 1:].abs().max()) < 1e-12
    assert reply.metrics["moment_steps"] == 2  # its own count continues
    assert after.values["opt.step.weight"] == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("joint_angle", 90.0), ("joint_angle", -1.0), ("signal_rank", -1), ("optimizer", "sgd")],
)
def test_invalid_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        FedGaLore.of(**{field: value})
