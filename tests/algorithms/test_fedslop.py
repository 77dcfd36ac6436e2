"""FedSLoP (:mod:`fedlore.algorithms.fedslop`) on cases small enough to compute by hand: the
projected heavy-ball step (S2)–(S4), the exact low-rank upload (S5) and the momentum carried
across the change of subspace (S6)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedlore.algorithms.fedslop import FedSLoP, carried_momentum
from fedlore.algorithms.lowrank import seeded_bases
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.loop import validate_reply
from fedlore.optim.projected_adam import ProjectedMomentum
from fedlore.optim.subspace import MatrixSpec
from fedlore.tensors import select
from fedlore.types import Reply, State

E1 = torch.tensor([[1.0], [0.0]])


def test_projected_momentum_two_steps_by_hand() -> None:
    """P = e1 on a 2 x 3 weight (left side), η = 0.1, μ = 0.5; two gradients. Only W's first row
    moves: W_1[0] = -η R_1, W_2[0] = W_1[0] - η (μ R_1 + R_2); Z is that total; the bias takes
    the same heavy ball at full shape."""
    w = nn.Parameter(torch.zeros(2, 3))
    b = nn.Parameter(torch.zeros(2))
    spec = MatrixSpec("w", (2, 3), "left", 2, 3, 1)
    opt = ProjectedMomentum([b], [(w, spec, E1)], lr=0.1, momentum=0.5)
    grads = [
        (torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([1.0, 1.0])),
        (torch.tensor([[-1.0, 0.0, 2.0], [7.0, 7.0, 7.0]]), torch.tensor([2.0, 0.0])),
    ]
    gw, gb = grads[0]
    w.grad, b.grad = gw, gb
    opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor([[-0.1, -0.2, -0.3], [0.0, 0.0, 0.0]]))
    gw, gb = grads[1]
    w.grad, b.grad = gw, gb
    opt.step()
    # B_2 = 0.5 [1, 2, 3] + [-1, 0, 2] = [-0.5, 1, 3.5]
    want = torch.tensor([[-0.05, -0.3, -0.65], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(w.detach(), want)
    torch.testing.assert_close(opt.coords[w], want[:1])  # W_2 = W_0 + P Z
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], torch.tensor([[-0.5, 1.0, 3.5]]))
    # bias: b_1 = -0.1 [1, 1]; buffer 0.5 [1, 1] + [2, 0] = [2.5, 0.5]
    torch.testing.assert_close(b.detach(), torch.tensor([-0.35, -0.15]))
    assert opt.state_bytes() == (3 + 2) * 4  # an r x n buffer and the bias's, no m x n


def test_projected_momentum_continues_a_loaded_buffer_and_decays() -> None:
    """A buffer put into the state before the first step is continued (B = μ B_0 + R), and the
    decoupled decay a = 1 - η λ multiplies W and Z."""
    w = nn.Parameter(torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    spec = MatrixSpec("w", (2, 2), "left", 2, 2, 1)
    opt = ProjectedMomentum([], [(w, spec, E1)], lr=0.1, momentum=0.5, weight_decay=1.0)
    opt.state[w] = {"momentum_buffer": torch.tensor([[4.0, -2.0]])}
    w.grad = torch.tensor([[1.0, 3.0], [5.0, 5.0]])
    opt.step()
    # B = 0.5 [4, -2] + [1, 3] = [3, 2]; a = 0.9; W = 0.9 W - 0.1 e1 B
    torch.testing.assert_close(w.detach(), torch.tensor([[0.6, 0.7], [1.8, 1.8]]))
    torch.testing.assert_close(opt.coords[w], torch.tensor([[-0.3, -0.2]]))


def test_projected_momentum_refuses_a_bad_coefficient() -> None:
    w = nn.Parameter(torch.zeros(2, 2))
    spec = MatrixSpec("w", (2, 2), "left", 2, 2, 1)
    with pytest.raises(ValueError, match="momentum"):
        ProjectedMomentum([], [(w, spec, E1)], momentum=1.0)


def test_carried_momentum_rules() -> None:
    """(S6) with P^t = e1 and P^{t+1} = (e1 + e2) / sqrt 2 in R^2: keep the coordinates, map them
    by P^{t+1}ᵀ P^t = 1 / sqrt 2, or drop them."""
    buf = torch.tensor([[2.0, -4.0]])
    new = torch.tensor([[1.0], [1.0]]) / math.sqrt(2.0)
    assert carried_momentum(buf, E1, new, "keep") is buf
    torch.testing.assert_close(carried_momentum(buf, E1, new, "project"), buf / math.sqrt(2.0))
    ortho = torch.tensor([[0.0], [1.0]])
    torch.testing.assert_close(carried_momentum(buf, E1, ortho, "project"), torch.zeros(1, 2))
    # r = 2 in R^3, P^t = [e1, e2], P^{t+1} = [e2, e3]: P^{t+1}ᵀ P^t = [[0, 1], [0, 0]] (not
    # symmetric: the order of the product matters), so B's second row moves up, the first is lost
    eye = torch.eye(3)
    two = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    torch.testing.assert_close(
        carried_momentum(two, eye[:, :2], eye[:, 1:], "project"),
        torch.tensor([[3.0, 4.0], [0.0, 0.0]]),
    )
    assert carried_momentum(buf, E1, new, "reset") is None
    with pytest.raises(ValueError, match="carry"):
        carried_momentum(buf, E1, new, "rotate")


# ------------------------------------------------------------------ a client's rounds by hand

X = torch.tensor([[1.0, 0.0, 0.0]])
Y = torch.tensor([[1.0, 2.0, 3.0]])
LR, MU = 0.1, 0.5


def _setup(carry: str) -> tuple[FedSLoP, nn.Module, ClientData]:
    algo = FedSLoP.of(lr=LR, local_steps=1, batch_size=1, rank=1, momentum=MU, carry=carry)
    model = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    data = ClientData(0, TensorSplit(X, Y), TensorSplit(X, Y))
    return algo, model, data


def _rounds(carry: str) -> list[tuple[State, Reply, State]]:
    """Two rounds of one client: (server state of the round, its reply, its state after)."""
    algo, model, data = _setup(carry)
    state = algo.init_server(model, torch.Generator().manual_seed(3))
    client: State | None = None
    out = []
    for rnd in range(2):
        msg = algo.broadcast(state, rnd, 0)
        reply, client = algo.client_update(
            msg, client, model, data, torch.Generator().manual_seed(rnd)
        )
        assert validate_reply(reply, algo.expected_reply(state, rnd, 0)) is None
        out.append((state, reply, client))
        state, _ = algo.aggregate(state, [(0, reply)], rnd)
    return out


def _basis(algo: FedSLoP, state: State) -> torch.Tensor:
    """The round's P (``3 x 1``): the seeded basis of the broadcast's basis id."""
    plan = algo.plan(nn.Linear(3, 3, bias=False))
    return seeded_bases(int(state.values["basis_id"]), plan)["weight"]


def _gradient_view(w: torch.Tensor) -> torch.Tensor:
    """The right-side view ``Gᵀ`` (input x output) of the gradient of ½ ||W x - y||² at W."""
    g = (X @ w.t() - Y).t() @ X  # (W x - y) xᵀ, out x in
    return g.t()


@pytest.mark.parametrize("carry", ["keep", "project", "reset"])
def test_fedslop_rounds_by_hand(carry: str) -> None:
    """W^0 = 0, one example (x = e1, y = (1, 2, 3)), one step a round, r = 1, basis on the input
    side. Round 0: R_0 = p_0ᵀ Gᵀ with Gᵀ = -[[1, 2, 3], 0, 0], so the upload is
    Z_0 = -η R_0 = η p_0[0] (1, 2, 3) (1 x 3: r n scalars, not the 9 of W). Round 1 starts from
    the momentum B_0 = R_0 carried into P^1 by the rule: Z_1 = -η (μ carry(B_0) + R_1)."""
    algo, _, _ = _setup(carry)
    (s0, r0, c0), (s1, r1, c1) = _rounds(carry)
    p0, p1 = _basis(algo, s0), _basis(algo, s1)
    assert not torch.allclose(p0, p1)  # a fresh subspace every round
    z0 = r0.arrays["update.weight"]
    assert z0.shape == (1, 3)
    torch.testing.assert_close(z0, LR * p0[0, 0] * torch.tensor([[1.0, 2.0, 3.0]]))
    r_0 = p0.t() @ _gradient_view(torch.zeros(3, 3))
    if carry == "reset":
        assert not any(k.startswith("mom.") for k in c0.arrays)
    else:
        torch.testing.assert_close(c0.arrays["mom.momentum_buffer.weight"], r_0)
    # the server's model after round 0: W^1 = W^0 + unview(P^0 Z_0)
    w1 = (p0 @ z0).t()
    torch.testing.assert_close(select(s1.arrays, "model.")["weight"], w1)
    r_1 = p1.t() @ _gradient_view(w1)
    carried = {"keep": r_0, "project": p1.t() @ p0 @ r_0, "reset": torch.zeros(1, 3)}[carry]
    want = -LR * (MU * carried + r_1)
    torch.testing.assert_close(r1.arrays["update.weight"], want)
    if carry != "reset":
        torch.testing.assert_close(c1.arrays["mom.momentum_buffer.weight"], MU * carried + r_1)
    assert r1.metrics["optimizer_state_bytes"] == 3 * 4  # B: r x n floats


def test_the_carry_rules_give_different_rounds() -> None:
    """The three rules are told apart by round 1's upload (round 0's is the same)."""
    ups = {c: _rounds(c)[1][1].arrays["update.weight"] for c in ("keep", "project", "reset")}
    assert not torch.allclose(ups["keep"], ups["project"])
    assert not torch.allclose(ups["keep"], ups["reset"])
    assert not torch.allclose(ups["project"], ups["reset"])


def test_the_client_state_passed_in_is_not_changed() -> None:
    algo, model, data = _setup("project")
    state = algo.init_server(model, torch.Generator().manual_seed(3))
    reply, client = algo.client_update(
        algo.broadcast(state, 0, 0), None, model, data, torch.Generator().manual_seed(0)
    )
    state, _ = algo.aggregate(state, [(0, reply)], 0)
    before = {k: v.clone() for k, v in client.arrays.items()}
    algo.client_update(algo.broadcast(state, 1, 0), client, model, data, torch.Generator())
    for k, v in before.items():
        assert torch.equal(client.arrays[k], v), k


@pytest.mark.parametrize(
    ("field", "value"), [("momentum", 1.0), ("momentum", -0.1), ("carry", "rotate")]
)
def test_invalid_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        FedSLoP.of(**{field: value})


def test_defaults_follow_the_authors_code() -> None:
    algo = FedSLoP()
    assert (algo.side, algo.momentum, algo.carry, algo.scale) == ("right", 0.8, "keep", 1.0)
    assert algo.caps().sum_aggregable and algo.caps().projects == "shared"


def test_settings_it_never_reads_are_refused_with_the_reason() -> None:
    """FedSLoP inherits FedLore-Random's ``optimizer`` and shares Adam's ``betas``/``eps``; it
    reads none of them, so a ``method.fedslop`` override of one is refused naming why (in the
    methods of ``algorithms`` and in a section for another method alike), and they are not among
    the settings a ``method.fedslop`` section may set."""
    from fedlore.checks.methods import unused_method_problems
    from fedlore.config import load_config
    from fedlore.experiment_parts import make_algorithm
    from fedlore.settings import hyperparameter_names

    names = hyperparameter_names(FedSLoP)
    assert {"momentum", "carry", "lr"} <= set(names)
    assert not {"optimizer", "betas", "eps"} & set(names)
    cfg = load_config(None, ["algorithms=[fedslop]", "method.fedslop.optimizer=sgd"])
    with pytest.raises(ValueError, match=r"method.fedslop.optimizer: does not apply to fedslop "
                       r"\(its inner optimizer is always the heavy ball"):  # fmt: skip
        make_algorithm("fedslop", cfg)
    with pytest.raises(ValueError, match=r"method.fedslop.betas: does not apply"):
        make_algorithm("fedslop", load_config(None, ["method.fedslop.betas=[0.5, 0.9]"]))
    make_algorithm("fedlore_random", load_config(None, ["method.fedlore_random.optimizer=sgd"]))
    other = load_config(None, ["algorithms=[fedavg]", "method.fedslop.eps=1e-6"])
    assert any("method.fedslop.eps: does not apply" in p for p in unused_method_problems(other))


def test_a_run_wide_inner_optimizer_is_said_not_to_reach_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``optim.name: sgd`` sets the projected methods' inner optimizer; FedSLoP inherits the
    setting but always runs the heavy ball, so the run says so (as for a method without one)."""
    import logging

    from fedlore.checks.model_data import warn_own_optimizer
    from fedlore.config import load_config
    from fedlore.experiment_parts import make_algorithm

    cfg = load_config(None, ["algorithms=[fedslop, fedlore]", "optim.name=sgd"])
    with caplog.at_level(logging.WARNING, logger="fedlore.checks"):
        warn_own_optimizer(cfg, "fedslop", make_algorithm("fedslop", cfg))
        warn_own_optimizer(cfg, "fedlore", make_algorithm("fedlore", cfg))
    assert "fedslop keeps its own" in caplog.text and "fedlore keeps" not in caplog.text
