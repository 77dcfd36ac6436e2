"""The seed's Theorem 6 and Proposition 4 with the library's own objects: the quadratic clients
are a model plus data (a bias-free 2 x 2 Linear and a least-squares task), trained by
:class:`~fedlore.algorithms.local_galore.LocalGaLore` and
:class:`~fedlore.algorithms.fedlore.FedLore` with projected SGD (``optimizer="sgd"``, the
theory's inner optimizer) in float64, through :class:`~fedlore.engine.loop.RoundLoop` and the
in-process transport, exactly as ``fedlore run`` drives them.

Client i holds two examples ``x_k = √2 e_k`` with targets ``y_k = -√2 C_i e_k``; the model's
output is ``W x``, and the task loss of real targets (the unit-noise Gaussian NLL, ½ the squared
error plus a constant) over that full batch is ``½ ||W + C_i||²_F`` + const, i.e. the seed's
``f_i(W) = ½ ||W||² + <C_i, W>`` up to a constant, with gradient ``W + C_i``. The hand-written
derivations of the same examples are in ``test_theorem6.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedlore.algorithm import Algorithm
from fedlore.algorithms.fedlore import FedLore
from fedlore.algorithms.local_galore import LocalGaLore
from fedlore.checks import setup_rounds
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.loop import RoundLoop
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.optim.subspace import captured_energy, projector_distance, top_left_singular
from fedlore.seeding import SERVER_INIT, generator
from fedlore.settings import LocalTraining
from fedlore.tensors import select
from fedlore.types import State

F64 = torch.float64
THEOREM6 = [torch.diag(torch.tensor(v, dtype=F64)) for v in ((2, 1), (-2, 1), (1, 2), (1, -2))]
PROP4 = THEOREM6[:2]


def least_squares_client(c: torch.Tensor, cid: int) -> ClientData:
    """Client ``cid`` of ``f(W) = ½ ||W + C||²`` (+ const) as data: ``x_k = √2 e_k``,
    ``y_k = -√2 C e_k`` (rows), real targets."""
    root2 = math.sqrt(2.0)
    x = root2 * torch.eye(2, dtype=F64)
    y = -root2 * c.t()  # row k = -(√2 C e_k)ᵀ
    split = TensorSplit(x, y)
    return ClientData(cid, split, split)


def zero_linear() -> nn.Module:
    """The model W (2 x 2, no bias) at W^0 = 0, in float64."""
    model = nn.Linear(2, 2, bias=False).to(F64)
    with torch.no_grad():
        model.weight.zero_()
    return model


def run(algo: Algorithm, cs: list[torch.Tensor], rounds: int) -> list[tuple[State, torch.Tensor]]:
    """Drive ``algo`` through the round loop on the clients ``cs`` (full participation); the
    server state and global W after the setup exchange (if any) and after every round."""
    clients = [least_squares_client(c, i) for i, c in enumerate(cs)]
    transport = LocalTransport(algo, lambda i: clients[i], zero_linear, 0, ClientStore())
    loop = RoundLoop(algo, transport, lambda rnd: list(range(len(cs))))
    state = algo.init_server(zero_linear(), generator(0, SERVER_INIT))
    out = []
    start = -setup_rounds(algo)
    for rnd in range(start, rounds):
        state, row = loop.run_round(state, rnd, rounds - 1)
        assert row["accepted"] == len(cs) and row.get("skipped_steps", 0) == 0, row
        out.append((state, algo.global_arrays(state)["weight"]))
    return out


def global_gradient(w: torch.Tensor, cs: list[torch.Tensor]) -> torch.Tensor:
    return w + sum(cs) / len(cs)


def shared_basis(state: State) -> torch.Tensor:
    return select(state.arrays, f"bank.{int(state.values['basis_id'])}.")["weight"]


def test_the_least_squares_clients_have_the_theorems_gradients() -> None:
    from fedlore.train.local import task_loss

    w = torch.randn(2, 2, dtype=F64, requires_grad=True)
    for c in THEOREM6:
        data = least_squares_client(c, 0)
        loss = task_loss(data.train.x @ w.t(), data.train.y)
        (grad,) = torch.autograd.grad(loss, w)
        torch.testing.assert_close(grad, w.detach() + c, rtol=0, atol=1e-14)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("gamma", [1.0, 0.5, 0.1])
def test_theorem6_local_svd_projections_stall_at_zero(k: int, gamma: float) -> None:
    """Theorem 6 (1): Local GaLore, each client projecting on the exact leading left singular
    subspace of its own round-start gradient, stays at W = 0: squared global-gradient norm 1/2,
    objective gap 1/4, although every client keeps 4/5 of its own gradient energy."""
    algo = LocalGaLore(
        train=LocalTraining(lr=gamma, local_steps=k, batch_size=2, rounds=5, weighting="uniform"),
        rank=1,
        optimizer="sgd",
        exclude=(),
    )
    history = run(algo, THEOREM6, 5)
    for _, w in history:
        assert w.dtype == F64
        torch.testing.assert_close(w, torch.zeros(2, 2, dtype=F64), rtol=0, atol=1e-14)
        g = global_gradient(w, THEOREM6)
        assert float((g * g).sum()) == pytest.approx(0.5)
        gap = 0.5 * float(((w + 0.5 * torch.eye(2, dtype=F64)) ** 2).sum())
        assert gap == pytest.approx(0.25)
    for c in THEOREM6:  # the clients' own projections keep 4/5 of their gradients
        assert captured_energy(algo.top_r(c, 1, torch.Generator(), F64), c) == pytest.approx(0.8)


def test_theorem6_shared_projection_reaches_the_minimizer_in_two_rounds() -> None:
    """Theorem 6 (2) with FedLore's own rule at γ = 1: the setup exchange picks a leading
    direction p of G^0 = ½I (a tie), round 0 lands on W^1 = -½ppᵀ, the clients' last local
    gradients (K = 2: after one step in p) all point along q ⟂ p, which is the leading left
    singular direction of the round-start G^1 = ½qqᵀ, and round 1 lands on W* = -½I."""
    algo = FedLore(
        train=LocalTraining(lr=1.0, local_steps=2, batch_size=2, rounds=2, weighting="uniform"),
        rank=1,
        optimizer="sgd",
        exclude=(),
    )
    history = run(algo, THEOREM6, 2)
    (setup, w0), (s1, w1), (_, w2) = history
    half = 0.5 * torch.eye(2, dtype=F64)
    torch.testing.assert_close(w0, torch.zeros(2, 2, dtype=F64))
    p = shared_basis(setup)
    assert p.dtype == F64
    assert captured_energy(p, global_gradient(w0, THEOREM6)) == pytest.approx(0.5)
    torch.testing.assert_close(w1, -0.5 * p @ p.t(), rtol=0, atol=1e-14)
    q = shared_basis(s1)  # the basis round 1 trains in
    g1 = global_gradient(w1, THEOREM6)
    assert projector_distance(q, top_left_singular(g1, 1, dtype=F64)) < 1e-12
    assert projector_distance(p, q) == pytest.approx(1.0)
    torch.testing.assert_close(w2, -half, rtol=0, atol=1e-14)
    g2 = global_gradient(w2, THEOREM6)
    assert float((g2 * g2).sum()) < 1e-26


def test_proposition4_agreeing_projectors_cover_nothing_and_fedlore_stays_at_zero() -> None:
    """Proposition 4: with C_1 = diag(2, 1), C_2 = diag(-2, 1), K = 1 and γ = 1, both clients'
    leading projectors are Q = diag(1, 0) (unique, they agree), so FedLore's setup exchange
    gives Π^0 = Q; the two projected updates cancel, W stays 0, the candidates (last-step
    gradients C_i) give Q again every round, and Q keeps none of G = diag(0, 1)."""
    algo = FedLore(
        train=LocalTraining(lr=1.0, local_steps=1, batch_size=2, rounds=4, weighting="uniform"),
        rank=1,
        optimizer="sgd",
        exclude=(),
    )
    e1 = torch.tensor([[1.0], [0.0]], dtype=F64)
    for state, w in run(algo, PROP4, 4):
        torch.testing.assert_close(w, torch.zeros(2, 2, dtype=F64), rtol=0, atol=0)
        basis = shared_basis(state)
        assert projector_distance(basis, e1) < 1e-15
        g = global_gradient(w, PROP4)
        torch.testing.assert_close(g, torch.diag(torch.tensor([0.0, 1.0], dtype=F64)))
        assert captured_energy(basis, g) == 0.0


def _fedlore_sgd(local_steps: int, rounds: int) -> FedLore:
    return FedLore(
        train=LocalTraining(
            lr=1.0, local_steps=local_steps, batch_size=2, rounds=rounds, weighting="uniform"
        ),
        rank=1,
        optimizer="sgd",
        exclude=(),
    )


def _gap(w: torch.Tensor, cs: list[torch.Tensor]) -> float:
    """``f(W) - f(W*)`` of the mean objective ``½||W||² + <C̄, W>``: ``½||W + C̄||²``."""
    return 0.5 * float(((w + sum(cs) / len(cs)) ** 2).sum())


def test_theorem6_fedlore_needs_two_local_steps() -> None:
    """The docs' condition on Theorem 6 (2): with K = 1 the candidates are the round-start
    gradients, whose projector average is the tie ½I again, the basis stays p and FedLore
    stalls at W = -½ppᵀ (gap 1/8); with K = 2 it reaches W* (the test above)."""
    history = run(_fedlore_sgd(1, 4), THEOREM6, 4)
    p = shared_basis(history[0][0])
    for state, w in history[1:]:
        torch.testing.assert_close(w, -0.5 * p @ p.t(), rtol=0, atol=1e-14)
        assert _gap(w, THEOREM6) == pytest.approx(0.125)
        assert projector_distance(shared_basis(state), p) < 1e-12


@pytest.mark.parametrize("k", [2, 3])
def test_proposition4_stall_needs_one_local_step(k: int) -> None:
    """The docs' condition on Proposition 4: with K >= 2 each client's last local gradient is
    (I - e_1e_1ᵀ)C_i = e_2e_2ᵀ, so round 0's candidates turn the basis to e_2 and round 1 lands
    on W* = -diag(0, 1)."""
    history = run(_fedlore_sgd(k, 3), PROP4, 3)
    (_, w_setup), (s0, w0), (_, w1), (_, w2) = history
    e2 = torch.tensor([[0.0], [1.0]], dtype=F64)
    torch.testing.assert_close(w0, torch.zeros(2, 2, dtype=F64), rtol=0, atol=1e-14)
    assert projector_distance(shared_basis(s0), e2) < 1e-12
    for w in (w1, w2):
        torch.testing.assert_close(w, -torch.diag(torch.tensor([0.0, 1.0], dtype=F64)))
        assert _gap(w, PROP4) < 1e-26
    assert _gap(w_setup, PROP4) == pytest.approx(0.5)
