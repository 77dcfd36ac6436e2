"""Theorem 3 of the seed (line ~835): the projection-induced aggregation bias.

For orthogonal projectors Π_i, A = (1/N)Σ Π_i and zero-mean d_i with G_i = G + d_i:
(1/N)Σ Π_i G_i = A G + b with b = (1/N)Σ (Π_i - A) d_i; (1/N)Σ (Π_i - A)² = A - A² with
0 ⪯ A - A² ⪯ ¼I; ‖b‖² ≤ ‖A - A²‖₂ (1/N)Σ‖d_i‖² (attained); b = 0 for equal projectors.
Projectors come from fedlore's ``random_basis``; everything is checked in float64.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable

import pytest
import torch

from fedlore.optim.subspace import random_basis

M, NCOL = 7, 5


def tsum(xs: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum(xs)`` in the same order, typed: a sum of tensors is a tensor."""
    return functools.reduce(operator.add, xs)


def projectors(seed: int, n: int, ranks: list[int]) -> list[torch.Tensor]:
    out = []
    for i in range(n):
        p = random_basis(seed * 100 + i, M, ranks[i % len(ranks)]).double()
        # re-orthonormalize in float64 so the projectors are idempotent to float64 precision
        q, _ = torch.linalg.qr(p)
        out.append(q @ q.t())
    return out


def zero_mean(seed: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    d = torch.randn(n, M, NCOL, dtype=torch.float64, generator=gen)
    d = d - d.mean(dim=0, keepdim=True)
    return list(d)


def bias(projs: list[torch.Tensor], ds: list[torch.Tensor]) -> torch.Tensor:
    a = tsum(projs) / len(projs)
    return tsum((p - a) @ d for p, d in zip(projs, ds, strict=True)) / len(projs)


CASES = [(0, 2, [1]), (1, 4, [2]), (2, 5, [1, 2, 3]), (3, 8, [3, 4]), (4, 3, [6])]


@pytest.mark.parametrize(("seed", "n", "ranks"), CASES)
def test_decomposition_13(seed: int, n: int, ranks: list[int]) -> None:
    projs = projectors(seed, n, ranks)
    ds = zero_mean(seed, n)
    g = torch.randn(M, NCOL, dtype=torch.float64, generator=torch.Generator().manual_seed(99))
    a = tsum(projs) / n
    lhs = tsum(p @ (g + d) for p, d in zip(projs, ds, strict=True)) / n
    b = bias(projs, ds)
    assert torch.allclose(lhs, a @ g + b, rtol=0, atol=1e-13)
    # b is not the trivial zero for distinct projectors (else the identity says little)
    assert float(b.norm()) > 1e-3
    # b equals (1/N)Σ Π_i d_i because Σ d_i = 0
    assert torch.allclose(b, tsum(p @ d for p, d in zip(projs, ds, strict=True)) / n, atol=1e-13)


@pytest.mark.parametrize(("seed", "n", "ranks"), CASES)
def test_operator_identity_and_bounds_14(seed: int, n: int, ranks: list[int]) -> None:
    projs = projectors(seed, n, ranks)
    for p in projs:
        assert torch.allclose(p @ p, p, atol=1e-13) and torch.allclose(p, p.t(), atol=0)
    a = tsum(projs) / n
    var = tsum((p - a) @ (p - a) for p in projs) / n
    assert torch.allclose(var, a - a @ a, atol=1e-13)
    evals = torch.linalg.eigvalsh((a - a @ a + (a - a @ a).t()) / 2)
    assert float(evals.min()) >= -1e-13
    assert float(evals.max()) <= 0.25 + 1e-13
    assert float(evals.max()) > 1e-3  # distinct projectors: A - A² ≠ 0
    a_evals = torch.linalg.eigvalsh(a)
    assert float(a_evals.min()) >= -1e-13 and float(a_evals.max()) <= 1 + 1e-13


@pytest.mark.parametrize(("seed", "n", "ranks"), CASES)
def test_bias_bound_15(seed: int, n: int, ranks: list[int]) -> None:
    projs = projectors(seed, n, ranks)
    a = tsum(projs) / n
    v = float(torch.linalg.matrix_norm(a - a @ a, ord=2))
    for s in range(5):
        ds = zero_mean(1000 * seed + s, n)
        b = bias(projs, ds)
        z2 = sum(float((d * d).sum()) for d in ds) / n
        assert float((b * b).sum()) <= v * z2 * (1 + 1e-12)


@pytest.mark.parametrize(("seed", "n", "ranks"), CASES)
def test_bias_bound_15_is_attained(seed: int, n: int, ranks: list[int]) -> None:
    """d_i = (Π_i - A) v eᵀ with v a top eigenvector of A - A² gives ‖b‖² = ‖A-A²‖₂ z²."""
    projs = projectors(seed, n, ranks)
    a = tsum(projs) / n
    evals, evecs = torch.linalg.eigh(a - a @ a)
    v = evecs[:, -1:]
    x = v @ torch.ones(1, NCOL, dtype=torch.float64) / NCOL**0.5
    ds = [(p - a) @ x for p in projs]
    assert torch.allclose(tsum(ds), torch.zeros(M, NCOL, dtype=torch.float64), atol=1e-13)
    b = bias(projs, ds)
    z2 = sum(float((d * d).sum()) for d in ds) / n
    lam = float(evals[-1])
    assert z2 == pytest.approx(lam, rel=1e-10)
    assert float((b * b).sum()) == pytest.approx(lam * z2, rel=1e-10)


@pytest.mark.parametrize("n", [2, 5])
@pytest.mark.parametrize("rank", [1, 3])
def test_bias_vanishes_for_equal_projectors(n: int, rank: int) -> None:
    base = random_basis(11, M, rank).double()
    q, _ = torch.linalg.qr(base)
    # the same subspace in different orthonormal bases (P Q_i): the projectors coincide
    projs = []
    for i in range(n):
        rot, _ = torch.linalg.qr(
            torch.randn(rank, rank, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        )
        pi = q @ rot
        projs.append(pi @ pi.t())
    a = tsum(projs) / n
    assert float(torch.linalg.matrix_norm(a - a @ a, ord=2)) < 1e-13
    for s in range(3):
        b = bias(projs, zero_mean(s, n))
        assert float(b.abs().max()) < 1e-13
    # identical tensors: the bias is zero to rounding of Σ d_i
    same = [projs[0]] * n
    assert float(bias(same, zero_mean(7, n)).abs().max()) < 1e-14


def test_bias_nonzero_once_one_projector_differs() -> None:
    """Converse of (16): a single disagreeing projector makes A - A² ≠ 0 and some b ≠ 0."""
    q, _ = torch.linalg.qr(random_basis(3, M, 2).double())
    other, _ = torch.linalg.qr(random_basis(4, M, 2).double())
    projs = [q @ q.t()] * 3 + [other @ other.t()]
    a = tsum(projs) / 4
    evals, evecs = torch.linalg.eigh(a - a @ a)
    assert float(evals[-1]) > 1e-3
    x = evecs[:, -1:] @ torch.ones(1, NCOL, dtype=torch.float64)
    b = bias(projs, [(p - a) @ x for p in projs])
    assert float(b.norm()) > 1e-3
