"""Subspace helpers: TopLeftSVD, projector averaging, seeded bases and the projection plan."""

from __future__ import annotations

import itertools
import math
from typing import Literal

import pytest
import torch
from torch import nn

from fedlore.algorithms.fedlore import FedLore
from fedlore.config import load_config
from fedlore.experiment_parts import make_algorithm
from fedlore.optim.subspace import (
    MatrixSpec,
    SvdMethod,
    average_projectors,
    captured_energy,
    projection_plan,
    projector_distance,
    random_basis,
    top_left_singular,
)


def orthonormal(p: torch.Tensor, atol: float = 1e-6) -> bool:
    eye = torch.eye(p.shape[1], dtype=torch.float64)
    return bool(torch.allclose(p.double().t() @ p.double(), eye, atol=atol))


def rand_orth(m: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(m, r, dtype=torch.float64, generator=g))
    return q


# ------------------------------------------------------------------------ top_left_singular
@pytest.mark.parametrize(("m", "k", "rank"), [(8, 5, 1), (8, 5, 3), (20, 30, 4), (6, 6, 6)])
@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_top_left_singular_orthonormal(m: int, k: int, rank: int, method: SvdMethod) -> None:
    mat = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k + rank))
    p = top_left_singular(mat, rank, method, generator=torch.Generator().manual_seed(0))
    assert p.shape == (m, rank) and p.dtype == torch.float32 and p.is_contiguous()
    assert orthonormal(p)


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_top_left_singular_recovers_planted_subspace(method: SvdMethod) -> None:
    m, k, r = 40, 60, 3
    u = rand_orth(m, r, 1)
    v = rand_orth(k, r, 2)
    mat = u @ torch.diag(torch.tensor([5.0, 3.0, 2.0], dtype=torch.float64)) @ v.t()
    noise = 1e-6 * torch.randn(
        m, k, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    p = top_left_singular((mat + noise).float(), r, method, torch.Generator().manual_seed(4))
    assert projector_distance(p, u) < 1e-4
    assert captured_energy(p, mat) == pytest.approx(1.0, abs=1e-6)
    # a wrong subspace is far away (the distance really measures something)
    assert projector_distance(p, rand_orth(m, r, 9)) > 0.5


@pytest.mark.parametrize(("m", "k"), [(80, 60), (60, 80)])
def test_randomized_matches_exact_on_decaying_spectrum(m: int, k: int) -> None:
    r, q = 4, min(m, k)
    u = rand_orth(m, q, 5)
    v = rand_orth(k, q, 6)
    s = torch.tensor([0.5**j for j in range(q)], dtype=torch.float64)
    mat = (u * s) @ v.t()
    exact = top_left_singular(mat, r, "exact")
    rand = top_left_singular(mat, r, "randomized", generator=torch.Generator().manual_seed(7))
    assert projector_distance(exact, u[:, :r]) < 1e-5
    assert projector_distance(rand, exact) < 1e-4
    # with the deterministic sign convention the bases agree column by column
    assert torch.allclose(rand, exact, atol=1e-4)


@pytest.mark.parametrize(("m", "k"), [(12, 30), (30, 12), (16, 16)])
def test_exact_matches_reference_svd(m: int, k: int) -> None:
    """Wide, tall and square inputs (the exact path may use eigh of A Aᵀ for wide ones)."""
    mat = torch.randn(m, k, dtype=torch.float64, generator=torch.Generator().manual_seed(m + k))
    u, s, _ = torch.linalg.svd(mat, full_matrices=False)
    assert float(s[2] - s[3]) > 1e-3  # a spectral gap after r = 3
    p = top_left_singular(mat, 3)
    assert projector_distance(p, u[:, :3]) < 1e-5
    # column by column, up to the sign convention
    for j in range(3):
        assert abs(float(p[:, j].double() @ u[:, j])) == pytest.approx(1.0, abs=1e-6)


def test_top_left_singular_deterministic_sign() -> None:
    mat = torch.randn(10, 7, generator=torch.Generator().manual_seed(8))
    p = top_left_singular(mat, 3)
    q = top_left_singular(-mat, 3)
    assert torch.allclose(p, q, atol=1e-6)
    idx = p.abs().argmax(dim=0)
    assert bool((p[idx, torch.arange(3)] > 0).all())


def test_top_left_singular_zero_matrix_gives_identity_columns() -> None:
    p = top_left_singular(torch.zeros(6, 4), 3)
    assert torch.equal(p, torch.eye(6, 3))
    assert bool(torch.isfinite(p).all())
    p = top_left_singular(torch.zeros(6, 4), 2, "randomized", torch.Generator().manual_seed(0))
    assert torch.equal(p, torch.eye(6, 2))


def test_top_left_singular_fewer_columns_than_rank_is_padded() -> None:
    mat = torch.randn(9, 2, generator=torch.Generator().manual_seed(1))
    p = top_left_singular(mat, 5)
    assert p.shape == (9, 5) and orthonormal(p)
    # the column space of mat is inside span(P)
    assert captured_energy(p, mat) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_top_left_singular_rejects_non_finite(bad: float) -> None:
    mat = torch.randn(5, 4)
    mat[2, 1] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        top_left_singular(mat, 2)


def test_top_left_singular_argument_errors() -> None:
    with pytest.raises(ValueError):
        top_left_singular(torch.randn(5), 1)
    with pytest.raises(ValueError):
        top_left_singular(torch.randn(5, 4), 0)
    with pytest.raises(ValueError):
        top_left_singular(torch.randn(5, 4), 6)


# ------------------------------------------------------------------------ average_projectors
def candidates(m: int, r: int, n: int, seed: int) -> list[torch.Tensor]:
    return [rand_orth(m, r, seed + i).float() for i in range(n)]


@pytest.mark.parametrize(("m", "r", "n"), [(12, 2, 3), (30, 4, 5), (10, 3, 2)])
def test_average_projectors_svd_and_gram_agree(m: int, r: int, n: int) -> None:
    bases = candidates(m, r, n, 10 * m)
    weights = [1.0 + i for i in range(n)]
    a = average_projectors(bases, weights, r, "svd")
    b = average_projectors(bases, weights, r, "gram")
    assert orthonormal(a) and orthonormal(b)
    assert projector_distance(a, b) < 1e-6
    # both maximize tr(Pᵀ A P) over orthonormal P: the sum of the top-r eigenvalues of A
    total = sum(weights)
    avg = sum(
        w / total * (p.double() @ p.double().t()) for p, w in zip(bases, weights, strict=True)
    )
    top = float(torch.linalg.eigvalsh(avg).flip(0)[:r].sum())
    assert float(torch.trace(a.double().t() @ avg @ a.double())) == pytest.approx(top, abs=1e-6)


@pytest.mark.parametrize("method", ["svd", "gram"])
def test_average_projectors_invariant_to_rotating_a_candidate(
    method: Literal["svd", "randomized", "gram"],
) -> None:
    m, r = 15, 3
    bases = candidates(m, r, 4, 40)
    rotated = list(bases)
    q = rand_orth(r, r, 99).float()
    rotated[1] = bases[1] @ q
    rotated[3] = -bases[3]
    a = average_projectors(bases, [1, 2, 3, 4], r, method)
    b = average_projectors(rotated, [1, 2, 3, 4], r, method)
    assert projector_distance(a, b) < 1e-6
    assert torch.allclose(a, b, atol=1e-5)  # deterministic representative too


@pytest.mark.parametrize("method", ["svd", "gram"])
def test_average_projectors_identical_candidates(
    method: Literal["svd", "randomized", "gram"],
) -> None:
    p = rand_orth(20, 3, 1).float()
    out = average_projectors([p, p @ rand_orth(3, 3, 2).float(), p], [1, 1, 1], 3, method)
    assert projector_distance(out, p) < 1e-6


def test_average_projectors_zero_weight_is_ignored() -> None:
    p, q = rand_orth(20, 3, 1).float(), rand_orth(20, 3, 2).float()
    out = average_projectors([p, q], [1.0, 0.0], 3)
    assert projector_distance(out, p) < 1e-6
    assert projector_distance(average_projectors([p, q], [0.0, 5.0], 3), q) < 1e-6


def test_average_projectors_errors() -> None:
    p = rand_orth(6, 2, 0).float()
    with pytest.raises(ValueError):
        average_projectors([], [], 2)
    with pytest.raises(ValueError):
        average_projectors([p, rand_orth(7, 2, 1).float()], [1, 1], 2)
    with pytest.raises(ValueError):
        average_projectors([p], [0.0], 2)


# ------------------------------------------------------------------------ random_basis
def test_random_basis_deterministic_and_orthonormal() -> None:
    a = random_basis(123, 17, 4)
    b = random_basis(123, 17, 4)
    c = random_basis(124, 17, 4)
    assert a.shape == (17, 4) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert orthonormal(a) and orthonormal(c)
    # huge seeds (FedLore-Random derives 62-bit ids) are fine too
    big = random_basis(2**62 + 12345, 9, 2)
    assert torch.equal(big, random_basis(2**62 + 12345, 9, 2)) and orthonormal(big)
    with pytest.raises(ValueError):
        random_basis(0, 4, 5)


# ------------------------------------------------------------------------ projection_plan
class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3)  # 8 x 27
        self.wide = nn.Linear(10, 6)  # out 6 < in 10
        self.tall = nn.Linear(6, 12)  # out 12 >= in 6
        self.square = nn.Linear(12, 12)
        self.tiny = nn.Linear(12, 2)  # min(m, n) = 2
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 5)


def test_projection_plan_left() -> None:
    plan = projection_plan(Mixed(), 2)
    assert list(plan) == ["conv.weight", "wide.weight", "tall.weight", "square.weight"]
    conv = plan["conv.weight"]
    assert (conv.shape, conv.side, conv.m, conv.n, conv.rank) == ((8, 3, 3, 3), "left", 8, 27, 2)
    w = torch.randn(8, 3, 3, 3)
    assert torch.equal(conv.view(w), w.reshape(8, 27))
    assert torch.equal(conv.unview(conv.view(w)), w)
    assert (plan["wide.weight"].m, plan["wide.weight"].n) == (6, 10)
    # 1-D parameters, the head and min(m, n) <= rank are not projected
    assert not any(k.endswith("bias") or k.startswith(("norm", "head", "tiny")) for k in plan)


def test_projection_plan_rank_at_least_min_dim_not_projected() -> None:
    plan = projection_plan(Mixed(), 6)
    assert "wide.weight" not in plan and "tall.weight" not in plan  # min(m, n) = 6 <= 6
    assert set(plan) == {"conv.weight", "square.weight"}
    assert set(projection_plan(Mixed(), 5)) == {
        "conv.weight",
        "wide.weight",
        "tall.weight",
        "square.weight",
    }


def test_projection_plan_auto_side() -> None:
    plan = projection_plan(Mixed(), 2, side="auto")
    assert plan["tall.weight"].side == "right"  # out >= in
    assert (plan["tall.weight"].m, plan["tall.weight"].n) == (6, 12)
    assert plan["square.weight"].side == "right"  # out == in counts as out >= in
    assert plan["wide.weight"].side == "left"
    assert plan["conv.weight"].side == "left"  # 8 < 27
    t = plan["tall.weight"]
    w = torch.randn(12, 6)
    assert torch.equal(t.view(w), w.t())
    assert torch.equal(t.unview(t.view(w)), w)
    right = projection_plan(Mixed(), 2, side="right")
    assert all(s.side == "right" for s in right.values())
    assert (right["conv.weight"].m, right["conv.weight"].n) == (27, 8)


def test_projection_plan_exclude_and_errors() -> None:
    plan = projection_plan(Mixed(), 2, exclude=("head.", "conv"))
    assert "conv.weight" not in plan and "square.weight" in plan
    assert "head.weight" in projection_plan(Mixed(), 2, exclude=())
    with pytest.raises(ValueError):
        projection_plan(Mixed(), 0)
    with pytest.raises(ValueError):
        projection_plan(Mixed(), 2, side="up")  # type: ignore[arg-type]


def test_matrix_spec_right_view_of_conv() -> None:
    spec = MatrixSpec("w", (4, 2, 3, 3), "right", 18, 4, 2)
    w = torch.randn(4, 2, 3, 3)
    assert spec.view(w).shape == (18, 4)
    assert torch.equal(spec.unview(spec.view(w)), w)


# ------------------------------------------------------------------------ subspace route
def known_spectrum(m: int, k: int, sv: list[float], seed: int) -> tuple[torch.Tensor, ...]:
    """``A = U diag(sv) Vᵀ`` with known singular values and vectors (float64)."""
    q = len(sv)
    u, v = rand_orth(m, q, seed), rand_orth(k, q, seed + 1)
    return (u * torch.tensor(sv, dtype=torch.float64)) @ v.t(), u


def rotated(basis: torch.Tensor, angle: float, seed: int) -> torch.Tensor:
    """``basis`` turned by ``angle`` (radians) towards a random orthogonal complement."""
    perp = torch.randn(
        basis.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )
    perp = torch.linalg.qr(perp - basis @ (basis.t() @ perp))[0]
    return math.cos(angle) * basis + math.sin(angle) * perp


def test_subspace_route_converges_from_a_warm_start_on_a_known_spectrum() -> None:
    sv = [10.0, 8.0, 6.0, 5.0, 1.0, 0.8, 0.5, 0.3, 0.2, 0.1]
    r = 4
    mat, u = known_spectrum(50, 70, sv, 3)
    exact_energy = sum(s * s for s in sv[:r]) / sum(s * s for s in sv)
    exact = top_left_singular(mat, r)
    assert captured_energy(exact, mat) == pytest.approx(exact_energy, abs=1e-6)
    warm = rotated(u[:, :r], 0.3, 4)
    dists, energies = [], []
    for niter in range(4):
        p = top_left_singular(mat, r, "subspace", oversample=0, niter=niter, warm=warm.float())
        assert p.shape == (50, r) and p.dtype == torch.float32 and orthonormal(p, 1e-5)
        dists.append(projector_distance(p, u[:, :r]))
        energies.append(captured_energy(p, mat))
    # every iteration shrinks the angle by about (sigma_5 / sigma_4)^2 = 1/25
    assert dists[0] > 0.2 and all(b < a / 10 for a, b in itertools.pairwise(dists))
    assert dists[3] < 1e-4
    assert energies[0] < exact_energy - 0.05  # the start is off: 0.3 rad
    assert all(b >= a - 1e-7 for a, b in itertools.pairwise(energies))  # float32 rounding
    assert energies[3] >= exact_energy - 1e-6
    # with the sign convention the columns agree with the exact route's
    torch.testing.assert_close(p, exact.float(), rtol=0, atol=1e-4)


def test_subspace_route_sketch_columns_and_cold_start() -> None:
    sv = [4.0, 3.0, 2.0, 1.9, 1.8, 0.1, 0.05]  # small gap after r = 2: slow without sketch
    mat, u = known_spectrum(40, 30, sv, 11)
    warm = rotated(u[:, :2], 0.5, 12).float()
    plain = top_left_singular(mat, 2, "subspace", oversample=0, niter=1, warm=warm)
    sketched = top_left_singular(
        mat, 2, "subspace", torch.Generator().manual_seed(0), oversample=5, niter=1, warm=warm
    )
    assert projector_distance(sketched, u[:, :2]) < projector_distance(plain, u[:, :2]) / 10
    cold = [
        top_left_singular(mat, 2, "subspace", torch.Generator().manual_seed(0), 5, 2)
        for _ in range(2)
    ]
    assert torch.equal(cold[0], cold[1])  # seeded
    assert projector_distance(cold[0], u[:, :2]) < 1e-3


def test_subspace_route_edge_cases() -> None:
    warm = torch.eye(6, 2)
    assert torch.equal(top_left_singular(torch.zeros(6, 5), 2, "subspace", warm=warm), warm)
    bad = torch.randn(6, 5)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        top_left_singular(bad, 2, "subspace", warm=warm)
    with pytest.raises(ValueError, match="warm basis"):
        top_left_singular(torch.randn(6, 5), 2, "subspace", warm=torch.eye(6, 3))
    # a block wider than min(m, k) takes the exact route
    mat = torch.randn(6, 5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(
        top_left_singular(mat, 2, "subspace", oversample=4, warm=warm), top_left_singular(mat, 2)
    )


def test_fedlore_candidate_is_warm_started_from_the_current_basis() -> None:
    """FedLore's client passes its current basis P^t: with no iteration and no sketch the
    candidate spans P^t exactly (the warm start reaches the route)."""

    spec = MatrixSpec("w", (30, 20), "left", 30, 20, 3)
    current = rand_orth(30, 3, 5).float()
    grad = torch.randn(30, 20, generator=torch.Generator().manual_seed(6))
    still = FedLore(rank=3, candidate_svd="subspace", svd_oversample=0, svd_niter=0)
    cand = still._candidate(spec, grad, current, torch.Generator())
    assert projector_distance(cand, current) < 1e-5
    moved = FedLore(rank=3, candidate_svd="subspace", svd_oversample=5, svd_niter=3)
    cand = moved._candidate(spec, grad, current, torch.Generator().manual_seed(0))
    assert captured_energy(cand, grad) >= captured_energy(top_left_singular(grad, 3), grad) - 0.01
    with pytest.raises(ValueError, match="candidate_svd"):
        FedLore(candidate_svd="power")  # type: ignore[arg-type]


def test_svd_settings_reach_the_client_candidate() -> None:
    """``method.fedlore.candidate_svd`` / ``svd_dtype`` from a config; float32 exact arithmetic
    is an option that agrees with the seed's float64 route to float32 accuracy."""
    cfg = load_config(
        None, ["method.fedlore.candidate_svd=subspace", "method.fedlore.svd_dtype=fp32"]
    )
    algo = make_algorithm("fedlore", cfg)
    assert isinstance(algo, FedLore)
    assert (algo.candidate_svd, algo.svd_dtype) == ("subspace", "fp32")
    grad = torch.randn(30, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    spec = MatrixSpec("w", (30, 40), "left", 30, 40, 3)
    f32 = FedLore(rank=3, svd_dtype="fp32")._candidate(spec, grad, None, torch.Generator())
    f64 = FedLore(rank=3)._candidate(spec, grad, None, torch.Generator())
    assert f32.dtype == f64.dtype == torch.float64  # bases follow the model
    assert not torch.equal(f32, f64)  # the arithmetic really differs
    torch.testing.assert_close(f32, f64, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="svd_dtype"):
        FedLore(svd_dtype="fp16")  # type: ignore[arg-type]
