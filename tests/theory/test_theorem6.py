"""Theorem 6 of the seed (line ~1305): exact local SVD subspaces can stall, a shared subspace of
the global gradient cannot.

Four 2x2 quadratic clients ``f_i(W) = ½‖W‖² + <C_i, W>`` (gradient ``W + C_i``), exact
gradients, rank 1, projected SGD ``W <- W - γ Π ∇f_i(W)`` with the projector fixed within a
round, full participation, ``W^0 = 0``. Projections come from fedlore's own
``top_left_singular`` (and ``average_projectors`` for the projector average). This file checks
the theorem's algebra step by step; ``test_theory_in_the_loop.py`` runs the same examples (and
Proposition 4) through the library's algorithm objects and round loop.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Iterable

import pytest
import torch

from fedlore.optim.subspace import (
    average_projectors,
    captured_energy,
    projector_distance,
    top_left_singular,
)


def tsum(xs: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum(xs)`` in the same order, typed: a sum of tensors is a tensor."""
    return functools.reduce(operator.add, xs)


C = [
    torch.diag(torch.tensor([2.0, 1.0], dtype=torch.float64)),
    torch.diag(torch.tensor([-2.0, 1.0], dtype=torch.float64)),
    torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64)),
    torch.diag(torch.tensor([1.0, -2.0], dtype=torch.float64)),
]
C_BAR = tsum(C) / 4
W_STAR = -C_BAR  # -½ I
I2 = torch.eye(2, dtype=torch.float64)


def f_global(w: torch.Tensor) -> float:
    return float(0.5 * (w * w).sum() + (C_BAR * w).sum())


F_STAR = f_global(W_STAR)


def grad_i(w: torch.Tensor, i: int) -> torch.Tensor:
    return w + C[i]


def grad_global(w: torch.Tensor) -> torch.Tensor:
    return w + C_BAR


def projector(basis: torch.Tensor) -> torch.Tensor:
    p = basis.to(torch.float64)
    return p @ p.t()


def local_projected_sgd(
    w: torch.Tensor, i: int, proj: torch.Tensor, gamma: float, k: int
) -> torch.Tensor:
    """K steps of ``W <- W - γ Π ∇f_i(W)`` from ``w`` with a fixed projector."""
    for _ in range(k):
        w = w - gamma * proj @ grad_i(w, i)
    return w


def test_problem_constants() -> None:
    assert torch.equal(C_BAR, 0.5 * I2)
    assert abs(F_STAR + 0.25) < 1e-15
    # heterogeneity ζ² = 9/2, independent of W
    for w in (torch.zeros(2, 2, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)):
        het = sum(float(((grad_i(w, i) - grad_global(w)) ** 2).sum()) for i in range(4)) / 4
        assert het == pytest.approx(4.5)


# ---------------------------------------------------------------- (a) client-specific projections
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("gamma", [1.0, 0.5, 0.1])
def test_local_svd_projections_stall_at_zero(k: int, gamma: float) -> None:
    w = torch.zeros(2, 2, dtype=torch.float64)
    e1, e2 = [1.0, 0.0], [0.0, 1.0]
    expected_proj = [torch.diag(torch.tensor(v, dtype=torch.float64)) for v in (e1, e1, e2, e2)]
    for _ in range(5):
        endpoints = []
        for i in range(4):
            g = grad_i(w, i)
            basis = top_left_singular(g, 1, "exact")
            assert basis.shape == (2, 1)
            proj = projector(basis)
            assert torch.allclose(proj, expected_proj[i], atol=1e-7)
            # each local projection keeps 4/5 of its own round-start gradient energy
            assert captured_energy(basis, g) == pytest.approx(0.8, abs=1e-7)
            endpoints.append(local_projected_sgd(w, i, proj, gamma, k))
        w = tsum(endpoints) / 4
        assert torch.equal(w, torch.zeros(2, 2, dtype=torch.float64)), w
        g = grad_global(w)
        assert float((g * g).sum()) == pytest.approx(0.5)
        assert f_global(w) - F_STAR == pytest.approx(0.25)


def test_local_svd_bias_cancels_covered_direction() -> None:
    """At W = 0: A = ½I, A - A² = ¼I, AG = ¼I, b = -¼I, so the aggregate direction is zero
    although <G, AG> = ½‖G‖² (coverage μ = 1/2)."""
    w = torch.zeros(2, 2, dtype=torch.float64)
    bases = [top_left_singular(grad_i(w, i), 1) for i in range(4)]
    projs = [projector(b) for b in bases]
    a = tsum(projs) / 4
    g = grad_global(w)
    assert torch.allclose(a, 0.5 * I2, atol=1e-7)
    assert torch.allclose(a - a @ a, 0.25 * I2, atol=1e-7)
    b = tsum((projs[i] - a) @ (grad_i(w, i) - g) for i in range(4)) / 4
    assert torch.allclose(a @ g, 0.25 * I2, atol=1e-7)
    assert torch.allclose(b, -0.25 * I2, atol=1e-7)
    agg = tsum(projs[i] @ grad_i(w, i) for i in range(4)) / 4
    assert torch.allclose(agg, a @ g + b, atol=1e-12)
    assert torch.allclose(agg, torch.zeros(2, 2, dtype=torch.float64), atol=1e-7)
    assert float((g * (a @ g)).sum()) == pytest.approx(0.5 * float((g * g).sum()), abs=1e-7)
    # the projector average of these candidates is a tie (A = ½I): whatever direction
    # average_projectors returns keeps exactly half of the global gradient's energy
    for method in ("svd", "gram"):
        shared = average_projectors(bases, [1.0] * 4, 1, method)
        assert torch.allclose(
            shared.t().double() @ shared.double(), torch.eye(1, dtype=torch.float64), atol=1e-6
        )
        assert captured_energy(shared, g) == pytest.approx(0.5, abs=1e-6)


# ---------------------------------------------------------------- (b) shared global projection
def shared_round(w: torch.Tensor, basis: torch.Tensor, gamma: float, k: int) -> torch.Tensor:
    proj = projector(basis)
    return tsum(local_projected_sgd(w, i, proj, gamma, k) for i in range(4)) / 4


@pytest.mark.parametrize("k", [1, 3])
def test_shared_projection_gamma_one_reaches_minimizer_in_two_rounds(k: int) -> None:
    w = torch.zeros(2, 2, dtype=torch.float64)
    g0 = grad_global(w)
    p0 = top_left_singular(g0, 1)
    # ½I has a repeated singular value: any unit vector is a leading left singular vector;
    # the chosen one must keep half of the energy (the maximum for a rank-1 projector).
    assert captured_energy(p0, g0) == pytest.approx(0.5, abs=1e-7)
    w1 = shared_round(w, p0, 1.0, k)
    assert f_global(w1) - F_STAR == pytest.approx(0.125, abs=1e-7)  # half the gap is gone
    assert not torch.allclose(w1, W_STAR, atol=1e-3)  # one round is not enough
    g1 = grad_global(w1)
    p1 = top_left_singular(g1, 1)
    assert captured_energy(p1, g1) == pytest.approx(1.0, abs=1e-7)  # G_1 has rank one
    assert projector_distance(p0, p1) == pytest.approx(1.0, abs=1e-6)  # orthogonal direction
    w2 = shared_round(w1, p1, 1.0, k)
    assert torch.allclose(w2, W_STAR, atol=1e-7)
    assert f_global(w2) - F_STAR == pytest.approx(0.0, abs=1e-12)
    # after reaching the minimizer the shared aggregate stays zero
    w3 = shared_round(w2, top_left_singular(grad_global(w2), 1), 1.0, k)
    assert torch.allclose(w3, W_STAR, atol=1e-7)


@pytest.mark.parametrize("theta", [0.0, 0.3, 1.0, math.pi / 2, 2.5])
def test_shared_projection_any_leading_direction_works(theta: float) -> None:
    """The proof resolves the tie with Π^0 = diag(1, 0); every other leading direction of ½I
    also reaches W* after two rounds (W^1 = -½ppᵀ, G_1 = ½qqᵀ, W^2 = -½I)."""
    p0 = torch.tensor([[math.cos(theta)], [math.sin(theta)]], dtype=torch.float64)
    w1 = shared_round(torch.zeros(2, 2, dtype=torch.float64), p0, 1.0, 2)
    assert torch.allclose(w1, -0.5 * p0 @ p0.t(), atol=1e-12)
    w2 = shared_round(w1, top_left_singular(grad_global(w1), 1), 1.0, 2)
    assert torch.allclose(w2, W_STAR, atol=1e-6)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("gamma", [0.05, 0.3, 0.7])
def test_shared_projection_gap_follows_bound_51(k: int, gamma: float) -> None:
    nu = 1.0 - (1.0 - gamma) ** k
    rate = 1.0 - nu * (2.0 - nu) / 2.0
    w = torch.zeros(2, 2, dtype=torch.float64)
    gap0 = f_global(w) - F_STAR
    assert gap0 == pytest.approx(0.25)
    gaps = [gap0]
    for t in range(1, 9):
        g = grad_global(w)
        basis = top_left_singular(g, 1)
        proj = projector(basis)
        w_new = shared_round(w, basis, gamma, k)
        # unrolled dynamics: W^+ = W - ν Π G, and the exact identity for ‖G^+‖²
        assert torch.allclose(w_new, w - nu * proj @ g, atol=1e-12)
        g_new = grad_global(w_new)
        lhs = float((g_new * g_new).sum())
        rhs = float((g * g).sum()) - nu * (2 - nu) * float(((proj @ g) ** 2).sum())
        assert lhs == pytest.approx(rhs, rel=1e-9, abs=1e-15)
        w = w_new
        gap = f_global(w) - F_STAR
        assert gap <= rate**t * gap0 + 1e-12, (t, gap, rate**t * gap0)
        gaps.append(gap)
    assert all(b < a for a, b in itertools.pairwise(gaps))
    # strict separation: the local-SVD run keeps the gap at 1/4 > the shared bound for t >= 1
    assert gaps[-1] < 0.25 * rate
