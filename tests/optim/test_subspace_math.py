"""The subspace routines against their definitions, on matrices with a known spectrum: block
power iteration from a warm start (Golub & Van Loan, orthogonal iteration; Halko et al. 2011),
FedLore-Sketch's seeded test matrix and its server basis, the subspace distance and the
captured energy; and ProjectedAdam's skipped step (Proposition 8's decay only)."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from fedlore.algorithms.lowrank import LowRankHyper
from fedlore.optim.projected_adam import ProjectedAdam, ProjectedSGD
from fedlore.optim.subspace import (
    MatrixSpec,
    average_projectors,
    captured_energy,
    gaussian_sketch,
    projection_plan,
    projector_distance,
    random_basis,
    sketch_basis,
    subspace_iteration,
    top_left_singular,
)


def _orth(m: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(m, r, dtype=torch.float64, generator=g))[0]


def _spectrum(m: int, k: int, sv: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = U diag(sv) Vᵀ`` (m x k, float64) and its left singular vectors U."""
    u, v = _orth(m, len(sv), seed), _orth(k, len(sv), seed + 1)
    return u @ torch.diag(torch.tensor(sv, dtype=torch.float64)) @ v.t(), u


def _orthonormal(p: torch.Tensor, atol: float = 1e-10) -> bool:
    eye = torch.eye(p.shape[1], dtype=torch.float64)
    return bool(torch.allclose(p.double().t() @ p.double(), eye, atol=atol))


# ------------------------------------------------------------------------ subspace_iteration
def test_subspace_iteration_from_the_exact_subspace_returns_it_by_singular_value() -> None:
    """Started in span(u_1..u_r) (any basis of it, not orthonormal), every iteration stays
    there; the Rayleigh–Ritz step orders the columns by singular value: column i is ±u_i and
    ``||Aᵀ q_i|| = σ_i``. The result keeps ``a``'s dtype."""
    sv = [9.0, 5.0, 3.0, 1.0, 0.5]
    a, u = _spectrum(12, 10, sv, 0)
    mix = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 3.0], [2.0, 0.0, 1.0]], dtype=torch.float64)
    warm = 3.0 * u[:, [2, 0, 1]] @ mix  # the top-3 span, scrambled and scaled
    for niter in (0, 2):
        q = subspace_iteration(a, 3, warm, niter=niter)
        assert q.shape == (12, 3) and q.dtype == torch.float64 and _orthonormal(q)
        for i in range(3):
            assert abs(float(q[:, i] @ u[:, i])) == pytest.approx(1.0, abs=1e-10), (niter, i)
        assert (a.t() @ q).norm(dim=0).tolist() == pytest.approx(sv[:3], rel=1e-10)
    q32 = subspace_iteration(a.float(), 3, warm.float(), niter=1)
    assert q32.dtype == torch.float32


def test_subspace_iteration_without_iterations_stays_in_the_warm_span() -> None:
    """``niter = 0`` and no sketch columns: the Rayleigh–Ritz step on the warm block only, so
    the result spans exactly the warm basis (here 0.6 rad off the top pair); each iteration
    then shrinks the angle by about (σ_3 / σ_2)² = 1/16."""
    sv = [8.0, 4.0, 1.0, 0.5]
    a, u = _spectrum(20, 15, sv, 3)
    off = _orth(20, 2, 9)
    off = off - u[:, :2] @ (u[:, :2].t() @ off)
    off = torch.linalg.qr(off)[0]
    warm = math.cos(0.6) * u[:, :2] + math.sin(0.6) * off
    q0 = subspace_iteration(a, 2, warm, niter=0)
    assert projector_distance(q0, warm) < 1e-10
    dists = [
        projector_distance(subspace_iteration(a, 2, warm, niter=n), u[:, :2]) for n in range(4)
    ]
    assert dists[0] == pytest.approx(math.sin(0.6), rel=1e-6)
    for before, after in itertools.pairwise(dists):
        assert after < before / 8


def test_subspace_iteration_sketch_columns_widen_the_block() -> None:
    """With p sketch columns ``A Ω`` the block is r + p wide: starting from a warm basis
    orthogonal to the answer (no progress possible with p = 0), p = 1 column of a rank-1
    matrix finds its only direction at once; with no warm basis the r + p columns come from
    the seeded sketch alone (the same generator seed, the same basis)."""
    u1 = _orth(10, 1, 4)
    a = u1 @ _orth(8, 1, 5).t() * 3.0
    warm = torch.linalg.qr(torch.eye(10, 1, dtype=torch.float64) - u1 @ u1[:1].t())[0]
    stuck = subspace_iteration(a, 1, warm, niter=0)
    found = subspace_iteration(a, 1, warm, 0, 1, torch.Generator().manual_seed(0))
    assert projector_distance(found, u1) < 1e-10 < projector_distance(stuck, u1)
    full, u = _spectrum(10, 8, [5.0, 4.0, 3.0, 2.0, 1.0], 6)
    cold = [subspace_iteration(full, 2, None, 3, 2, torch.Generator().manual_seed(1)) for _ in "ab"]
    assert torch.equal(cold[0], cold[1]) and cold[0].shape == (10, 2)
    assert projector_distance(cold[0], u[:, :2]) < 1e-2


def test_subspace_iteration_refuses_a_block_wider_than_the_matrix() -> None:
    """``r + p`` may equal ``min(m, k)`` but not exceed it; ``niter`` must be >= 0."""
    a, _ = _spectrum(6, 4, [3.0, 2.0, 1.0, 0.5], 7)
    g = torch.Generator().manual_seed(0)
    assert subspace_iteration(a, 2, None, 1, 2, g).shape == (6, 2)  # r + p = 4 = min(6, 4)
    with pytest.raises(ValueError, match=r"r \+ p <= min\(m, k\) = 4 and niter >= 0"):
        subspace_iteration(a, 2, None, 1, 3, g)
    with pytest.raises(ValueError, match="r=2, p=0, niter=-1"):
        subspace_iteration(a, 2, _orth(6, 2, 1), -1)


# ------------------------------------------------------------------------ FedLore-Sketch
def test_gaussian_sketch_is_a_seeded_float64_standard_normal_draw() -> None:
    """The same seed gives the same Ω bit for bit (seeds taken modulo 2^63), another seed
    another Ω; lower precisions are the float64 draw rounded; the entries are standard
    normal (10^4 draws: mean and standard deviation within 0.03 of 0 and 1)."""
    omega = gaussian_sketch(7, 100, 100, dtype=torch.float64)
    assert omega.shape == (100, 100) and omega.is_contiguous()
    assert torch.equal(omega, gaussian_sketch(7 + 2**63, 100, 100, dtype=torch.float64))
    assert not torch.equal(omega[:2], gaussian_sketch(8, 2, 100, dtype=torch.float64))
    assert torch.equal(gaussian_sketch(7, 100, 100), omega.float())
    assert abs(float(omega.mean())) < 0.03 and abs(float(omega.std()) - 1) < 0.03
    assert gaussian_sketch(7, 1, 1).shape == (1, 1)
    for n, width in ((0, 3), (3, 0)):
        with pytest.raises(ValueError, match=f"n={n}, width={width}"):
            gaussian_sketch(7, n, width)


@pytest.mark.parametrize(("m", "q"), [(6, 9), (12, 5)])
def test_sketch_basis_is_the_top_left_singular_subspace_with_fixed_signs(m: int, q: int) -> None:
    """Both routes (m <= q: eigenvectors of Y Yᵀ; m > q: the SVD of Y) give Y's top-r left
    singular vectors in order, each column's largest entry positive, in the previous basis's
    dtype unless another is asked for."""
    sv = [6.0, 3.0, 1.0, 0.2, 0.1][: min(m, q)]
    y, u = _spectrum(m, q, sv, 8)
    prev = _orth(m, 3, 9).float()
    got = sketch_basis(y, 3, prev)
    assert got.dtype == torch.float32 and got.shape == (m, 3) and got.is_contiguous()
    for i in range(3):
        col = got[:, i].double()
        assert abs(float(col @ u[:, i])) == pytest.approx(1.0, abs=1e-6)
        assert float(col[col.abs().argmax()]) > 0
    assert sketch_basis(y, 3, prev, dtype=torch.float64).dtype == torch.float64


def test_sketch_basis_fills_missing_directions_from_the_previous_basis() -> None:
    """Singular values 1 and 1e-3 with ``rtol = 1e-2``: the sketch has numerical rank 1, so
    the basis is its top direction followed by the leading direction of the previous basis's
    part orthogonal to it; with the default ``rtol`` (max(m, q) · eps) both of Y's directions
    are kept. A sketch that is all zero returns a copy of the previous basis."""
    y, u = _spectrum(8, 5, [1.0, 1e-3], 10)
    prev = _orth(8, 2, 11)
    kept = sketch_basis(y, 2, prev)
    assert projector_distance(kept, u[:, :2]) < 1e-8
    filled = sketch_basis(y, 2, prev, rtol=1e-2)
    assert _orthonormal(filled)
    assert abs(float(filled[:, 0] @ u[:, 0])) == pytest.approx(1.0, abs=1e-12)
    rest = prev - u[:, :1] @ (u[:, :1].t() @ prev)  # P^t's part orthogonal to u_1 ...
    lead = torch.linalg.svd(rest)[0][:, :1]  # ... its leading direction fills the gap
    assert projector_distance(filled[:, 1:], lead) < 1e-8
    assert projector_distance(filled, u[:, :2]) > 0.1  # not Y's second direction
    zero = sketch_basis(torch.zeros(8, 5), 2, prev)
    assert torch.equal(zero, prev) and zero is not prev and zero.dtype == prev.dtype


def test_sketch_basis_refuses_bad_shapes() -> None:
    """The sketch is a matrix, ``1 <= r <= min(m, q)``, the previous basis is ``m x r``."""
    prev = _orth(6, 2, 0)
    with pytest.raises(ValueError, match="expected a sketch matrix"):
        sketch_basis(torch.zeros(6), 2, prev)
    assert sketch_basis(torch.randn(6, 2, dtype=torch.float64), 2, prev).shape == (6, 2)
    for rank in (0, 3):
        with pytest.raises(ValueError, match=r"rank must be in \[1, min\(m, q\) = 2\]"):
            sketch_basis(torch.randn(6, 2), rank, prev)
    with pytest.raises(ValueError, match=r"previous basis has shape \(6, 2\), expected \(6, 1\)"):
        sketch_basis(torch.randn(6, 4), 1, prev)


# ------------------------------------------------------------------------ distances, energy
def test_projector_distance_is_the_sine_of_the_largest_principal_angle() -> None:
    """``||P Pᵀ - Q Qᵀ||_2 = sin θ_max``: 0 for two bases of one subspace, sin(0.3) for a
    plane tilted by 0.3 rad in one direction, 1 for orthogonal lines."""
    e = torch.eye(4, dtype=torch.float64)
    p = e[:, :2]
    assert projector_distance(p, p @ _orth(2, 2, 1)) == pytest.approx(0.0, abs=1e-12)
    tilted = torch.stack([e[:, 0], math.cos(0.3) * e[:, 1] + math.sin(0.3) * e[:, 2]], dim=1)
    assert projector_distance(p, tilted.float()) == pytest.approx(math.sin(0.3), rel=1e-6)
    assert projector_distance(e[:, :1], e[:, 1:2]) == pytest.approx(1.0, rel=1e-12)


def test_captured_energy_is_the_share_of_the_squared_frobenius_norm() -> None:
    """``||P Pᵀ G||² / ||G||²``: the top-r energy share σ₁² + ... + σ_r² over Σσ², 1 for a
    zero G (nothing is lost)."""
    sv = [3.0, 2.0, 1.0]
    g, u = _spectrum(7, 5, sv, 12)
    assert captured_energy(u[:, :2], g) == pytest.approx(13 / 14, rel=1e-12)
    assert captured_energy(u[:, 2:3].float(), g.float()) == pytest.approx(1 / 14, rel=1e-5)
    assert captured_energy(u[:, :1], torch.zeros(7, 5)) == 1.0


def test_average_projectors_weights_only_matter_relative_to_each_other() -> None:
    """Scaling every weight by 1000 leaves the averaged basis unchanged (the weights are
    normalized); weights 3:1 between two lines at 90° pick the heavier line."""
    bases = [_orth(9, 2, s).float() for s in range(3)]
    for method in ("svd", "gram"):
        a = average_projectors(bases, [1.0, 2.0, 3.0], 2, method)
        b = average_projectors(bases, [1e3, 2e3, 3e3], 2, method)
        assert torch.allclose(a, b, atol=1e-6)
        e = torch.eye(9)
        heavy = average_projectors([e[:, :1], e[:, 1:2]], [1.0, 3.0], 1, method)
        assert projector_distance(heavy, e[:, 1:2]) < 1e-6


# ------------------------------------------------------------------------ the skipped step
@pytest.mark.parametrize("cls", [ProjectedAdam, ProjectedSGD])
def test_skip_step_applies_only_the_decay_to_weights_and_coordinates(cls: type) -> None:
    """A skipped step multiplies every weight and the coordinates Z by ``a = 1 - lr · λ``
    (Proposition 8 keeps ``W_K = (Π a_k) W_0 + P Z``) and touches nothing else: no moment,
    no step count; with λ = 0 it changes nothing at all."""
    w = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    b = torch.nn.Parameter(torch.ones(4))
    spec = MatrixSpec("w", (4, 3), "left", 4, 3, 2)
    basis = _orth(4, 2, 1).float()
    opt = cls([b], [(w, spec, basis)], lr=0.1, weight_decay=0.5)
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()
    w0, b0, z0 = w.detach().clone(), b.detach().clone(), opt.coords[w].clone()
    state0 = {id(p): {k: copy.deepcopy(v) for k, v in st.items()} for p, st in opt.state.items()}
    opt.skip_step()
    assert torch.allclose(w, 0.95 * w0) and torch.allclose(b, 0.95 * b0)
    assert torch.allclose(opt.coords[w], 0.95 * z0)
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state0[id(p)][k])), k
    for group in opt.param_groups:
        group["weight_decay"] = 0.0
    w1, z1 = w.detach().clone(), opt.coords[w].clone()
    opt.skip_step()
    assert torch.equal(w, w1) and torch.equal(opt.coords[w], z1)


@pytest.mark.parametrize("cls", [ProjectedAdam, ProjectedSGD])
def test_skip_step_decays_each_group_by_its_own_rate(cls: type) -> None:
    """Groups may carry their own decay: a dense group without decay does not stop the
    projected group's (λ = 0.5, lr 0.1: a = 0.95) on a skipped step."""
    w = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    b = torch.nn.Parameter(torch.ones(4))
    spec = MatrixSpec("w", (4, 3), "left", 4, 3, 2)
    opt = cls([b], [(w, spec, _orth(4, 2, 1).float())], lr=0.1, weight_decay=0.5)
    assert [g["projected"] for g in opt.param_groups] == [False, True]
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.coords[w] += 1.0
    w0 = w.detach().clone()
    opt.skip_step()
    assert torch.equal(b, torch.ones(4))
    assert torch.allclose(w, 0.95 * w0) and torch.allclose(opt.coords[w], torch.full((2, 3), 0.95))


def test_projected_adam_defaults_and_state_follow_the_parameters() -> None:
    """Adam's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, no decay, scale 1); the basis
    is cast to the parameter's dtype (a float64 basis steps a float32 weight) and Z lives on
    the parameter's device and dtype (the meta device: any non-CPU one would do)."""
    w = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    spec = MatrixSpec("w", (4, 3), "left", 4, 3, 2)
    opt = ProjectedAdam([], [(w, spec, _orth(4, 2, 1))])
    assert opt.defaults == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert opt.scale == 1.0 and opt.bases[w].dtype == torch.float32
    w.grad = torch.ones_like(w)
    opt.step()  # the float64 basis would not multiply a float32 gradient
    assert opt.coords[w].dtype == torch.float32 and bool(opt.coords[w].abs().sum() > 0)
    meta = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    on_meta = ProjectedAdam([], [(meta, spec, torch.empty(4, 2, device="meta"))])
    assert on_meta.coords[meta].device.type == "meta"


# ------------------------------------------------------------------------ top_left_singular
def test_routine_defaults_are_the_methods_svd_settings() -> None:
    """Called without settings, the SVD routines use the methods' defaults (``svd_oversample``
    10, ``svd_niter`` 2): the same bits as with those settings given; the subspace iteration
    alone defaults to 2 iterations and no sketch columns."""
    over, niter = LowRankHyper.svd_oversample, LowRankHyper.svd_niter
    assert (over, niter) == (10, 2)
    a, _ = _spectrum(40, 30, [1.0 - 0.03 * i for i in range(30)], 20)
    g = torch.Generator
    for method in ("randomized", "subspace"):
        plain = top_left_singular(a, 3, method, g().manual_seed(0), dtype=torch.float64)
        given = top_left_singular(
            a,
            3,
            method,
            g().manual_seed(0),
            over,
            niter,
            dtype=torch.float64,
        )
        assert torch.equal(plain, given), method
    bases = [_orth(40, 3, s) for s in range(8)]  # 24 columns: more than r + p = 13
    weights = [float(i + 1) for i in range(8)]
    plain = average_projectors(bases, weights, 3, "randomized", g().manual_seed(0))
    given = average_projectors(bases, weights, 3, "randomized", g().manual_seed(0), over, niter)
    assert torch.equal(plain, given)
    warm = _orth(40, 3, 9)
    assert torch.equal(subspace_iteration(a, 3, warm), subspace_iteration(a, 3, warm, 2, 0))
    assert not torch.equal(subspace_iteration(a, 3, warm), subspace_iteration(a, 3, warm, 3, 0))


def test_top_left_singular_refuses_bad_input_with_the_reason() -> None:
    """Not a matrix, a rank outside [1, m], an unknown method, a non-finite entry: each
    error says which."""
    cases = [
        ((torch.zeros(3), 1), r"^expected a matrix, got shape \(3,\)$"),
        ((torch.ones(3, 4), 4), r"^rank must be in \[1, 3\], got 4$"),
        ((torch.ones(3, 4), 0), r"^rank must be in \[1, 3\], got 0$"),
        ((torch.ones(3, 4), 1, "qr"), r"^unknown SVD method 'qr'$"),
        ((torch.full((3, 4), math.nan), 1), r"^cannot take the SVD of a matrix with NaN or Inf"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            top_left_singular(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(4, 6), (6, 4)])
def test_zero_matrix_and_sign_boundaries(shape: tuple[int, int]) -> None:
    """An all-zero matrix (wide or tall) gives the first r standard basis vectors in the
    asked dtype; a matrix whose entries are all <= 0, or all in [0, 1], is no zero matrix:
    its own top direction comes back."""
    zero = top_left_singular(torch.zeros(shape), 2, dtype=torch.float64)
    assert zero.dtype == torch.float64 and torch.equal(zero, torch.eye(shape[0], 2).double())
    col = torch.zeros(shape[0], 1)
    col[-1] = 1.0
    for mat in (-(col @ torch.ones(1, shape[1])), col @ torch.ones(1, shape[1]) * 0.5):
        mat[-1, 0] = 0.0  # a 0 among the entries: min 0 (or max 0), but not all zero
        top = top_left_singular(mat, 1)
        assert projector_distance(top, col) < 1e-6


def test_approximate_routes_take_the_exact_one_when_the_block_covers_the_matrix() -> None:
    """``r + oversample >= min(m, k)``: the randomized and subspace routes are the exact route,
    bit for bit (at the boundary r + p = min(m, k) too); one column less and they are not."""
    a, _ = _spectrum(8, 6, [5.0, 4.0, 3.0, 2.0, 1.0, 0.5], 13)
    f64 = torch.float64  # float32 results would hide the approximate routes' rounding
    exact = top_left_singular(a, 2, dtype=f64)
    g = torch.Generator().manual_seed(0)
    for method in ("randomized", "subspace"):
        at_boundary = top_left_singular(a, 2, method, g, oversample=4, niter=0, dtype=f64)
        assert torch.equal(at_boundary, exact), method
        inside = top_left_singular(a, 2, method, g, oversample=3, niter=0, dtype=f64)
        assert not torch.equal(inside, exact), method


def test_compute_dtypes_of_the_routes() -> None:
    """The exact and randomized routes compute in float64 whatever the input (orthonormal to
    1e-13 when a float64 result is asked of a float32 matrix); the subspace route computes in
    the matrix's own dtype (the same bits as asking for float32 arithmetic); both follow an
    explicit ``compute_dtype``."""
    a32 = _spectrum(40, 30, [float(30 - i) for i in range(30)], 14)[0].float()
    g = torch.Generator
    for method in ("exact", "randomized"):
        out = top_left_singular(a32, 3, method, g().manual_seed(1), 5, 1, dtype=torch.float64)
        assert _orthonormal(out, 1e-13), method
        as64 = top_left_singular(
            a32,
            3,
            method,
            g().manual_seed(1),
            5,
            1,
            torch.float64,
            compute_dtype=torch.float64,
        )
        assert torch.equal(out, as64), method
    warm = _orth(40, 3, 15).float()
    sub = top_left_singular(a32, 3, "subspace", g().manual_seed(1), 5, 1, torch.float64, warm)
    sub32 = top_left_singular(
        a32, 3, "subspace", g().manual_seed(1), 5, 1, torch.float64, warm, torch.float32
    )
    sub64 = top_left_singular(
        a32, 3, "subspace", g().manual_seed(1), 5, 1, torch.float64, warm, torch.float64
    )
    assert torch.equal(sub, sub32) and not torch.equal(sub, sub64)


def test_the_subspace_route_draws_its_sketch_from_the_generator_only() -> None:
    """The sketch columns come from ``generator``, not the global RNG: the same seed gives the
    same bits whatever the global RNG did meanwhile, another seed another basis."""
    a, _ = _spectrum(30, 20, [1.0 - 0.04 * i for i in range(20)], 16)  # a flat spectrum
    warm = _orth(30, 2, 17)

    def route(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return top_left_singular(a, 2, "subspace", g, oversample=3, niter=0, warm=warm)

    first = route(0)
    torch.randn(5)  # the global RNG moves on
    assert torch.equal(route(0), first) and not torch.allclose(route(1), first, atol=1e-6)


def test_padding_completes_a_basis_with_the_asked_dtype() -> None:
    """k < r columns: the k singular directions, then an orthonormal completion, r columns in
    the asked dtype."""
    mat = torch.randn(7, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float32, torch.float64):
        p = top_left_singular(mat, 4, dtype=dtype)
        assert p.shape == (7, 4) and p.dtype == dtype and _orthonormal(p, 1e-6)
        assert captured_energy(p[:, :2], mat) == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------------ average_projectors
def test_average_projectors_refuses_bad_input_with_the_reason() -> None:
    """No basis, bases of different heights, weights that do not sum to a positive number, a
    weight count that does not match (a missing weight must not drop a client silently), an
    unknown method."""
    p, q = _orth(6, 2, 0), _orth(6, 2, 1)
    cases = [
        (([], [], 2), "^average_projectors needs at least one basis$"),
        (
            ([p, _orth(7, 2, 1)], [1, 1], 2),
            "^all candidate bases must have the same number of rows$",
        ),
        (([p], [0.0], 2), "^weights must have a positive sum$"),
        (([p, q], [1.0], 2), "shorter"),
        (([p, q], [1.0, 1.0, 1.0], 2), "longer"),
        (([p], [1.0], 2, "qr"), "^unknown method 'qr'$"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            average_projectors(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["svd", "randomized", "gram"])
def test_average_projectors_returns_the_asked_dtype(method: str) -> None:
    """Every method returns the basis in ``dtype`` (float32 by default)."""
    bases = [_orth(12, 2, s) for s in range(3)]
    g = torch.Generator().manual_seed(0)
    assert average_projectors(bases, [1, 1, 1], 2, method, g).dtype == torch.float32  # type: ignore[arg-type]
    out = average_projectors(bases, [1, 1, 1], 2, method, g, dtype=torch.float64)  # type: ignore[arg-type]
    assert out.dtype == torch.float64 and _orthonormal(out)


def test_randomized_average_uses_its_power_iterations() -> None:
    """The randomized server basis follows ``niter``: candidates scattered around a common
    subspace, 2 sketch columns; 4 power iterations bring it far closer to the exact basis
    than none."""
    common = _orth(60, 4, 0)
    bases = [torch.linalg.qr(common + 0.5 * _orth(60, 4, s + 1))[0] for s in range(8)]
    weights = [float(8 - i) for i in range(8)]
    exact = average_projectors(bases, weights, 4)
    dist = [
        projector_distance(
            average_projectors(
                bases, weights, 4, "randomized", torch.Generator().manual_seed(0), 2, n
            ),
            exact,
        )
        for n in (0, 4)
    ]
    assert dist[1] < dist[0] / 1000


def test_gram_route_pads_a_rank_deficient_average() -> None:
    """Two copies of one line, rank 2 asked: the average projector has rank 1, the gram route
    keeps the line and completes it with an orthonormal direction, like the svd route."""
    line = _orth(5, 1, 3)
    for method in ("gram", "svd"):
        out = average_projectors([line, line], [1.0, 2.0], 2, method, dtype=torch.float64)
        assert out.shape == (5, 2) and _orthonormal(out)
        assert abs(float(out[:, 0] @ line[:, 0])) == pytest.approx(1.0, abs=1e-12), method


# ------------------------------------------------------------------------ random_basis, plan
def test_random_basis_is_the_haar_representative_of_a_seeded_draw() -> None:
    """The basis is Q of the QR of the seeded float64 Gaussian draw with diag(R) > 0: Qᵀ G is
    upper triangular with a positive diagonal, Q is orthonormal to float64 precision; ranks 1
    to m are allowed; seeds 5 and 131 differ; ``device`` is honoured (the meta device)."""
    for rank in (1, 3, 6):
        q = random_basis(5, 6, rank, dtype=torch.float64)
        g = torch.randn(6, rank, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        r = q.t() @ g
        assert _orthonormal(q, 1e-14)
        assert torch.allclose(torch.tril(r, -1), torch.zeros_like(r), atol=1e-12)
        assert bool((torch.diagonal(r) > 0).all())
    assert not torch.allclose(random_basis(5, 6, 2), random_basis(131, 6, 2))
    assert random_basis(5, 6, 2, device="meta").device.type == "meta"
    for rank in (0, 7):
        with pytest.raises(ValueError, match=rf"^rank must be in \[1, 6\], got {rank}$"):
            random_basis(5, 6, rank)


def test_gaussian_sketch_is_the_documented_draw_on_the_asked_device() -> None:
    """Ω is ``randn(n, width)`` in float64 from a CPU generator seeded with ``seed mod 2^63``
    (a seed of any size), cast, then moved."""
    ref = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    assert torch.equal(gaussian_sketch(11, 5, 3, dtype=torch.float64), ref)
    big = 3**63 + 11
    want = torch.Generator().manual_seed(big % 2**63)
    assert torch.equal(
        gaussian_sketch(big, 5, 3, dtype=torch.float64),
        torch.randn(5, 3, dtype=torch.float64, generator=want),
    )
    assert gaussian_sketch(11, 5, 3, device="meta").device.type == "meta"


def test_projection_plan_rank_one_bare_modules_and_single_outputs() -> None:
    """Rank 1 is a valid rank; a bare layer's weight is ``weight`` (its state_dict name), each
    spec carries its name; a layer with one output is never projected (min(m, n) = 1 <= r)."""
    bare = projection_plan(torch.nn.Linear(6, 4), 1)
    assert list(bare) == ["weight"] and bare["weight"].name == "weight"
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 1))
    plan = projection_plan(model, 1)
    assert list(plan) == ["0.weight"] and plan["0.weight"].name == "0.weight"
    with pytest.raises(ValueError, match=r"^rank must be >= 1, got 0$"):
        projection_plan(model, 0)
    with pytest.raises(ValueError, match=r"^side must be 'left', 'right' or 'auto', got 'up'$"):
        projection_plan(model, 1, "up")  # type: ignore[arg-type]


# ------------------------------------------------------------------------ sketch_basis, more
def test_sketch_basis_numerical_rank_is_relative_and_strict() -> None:
    """The numerical rank counts singular values strictly above ``rtol · σ₁``: scaling the
    sketch by 1e3 or 1e-3 changes nothing (both routes), and a value exactly at the threshold
    does not count."""
    prev = _orth(5, 2, 18)
    for m, q in ((5, 8), (5, 3)):  # the eigh route (m <= q) and the SVD route
        y = torch.zeros(m, q, dtype=torch.float64)
        y[0, 0], y[1, 1] = 1.0, 0.01
        base = sketch_basis(y, 2, prev, rtol=0.05)  # rank 1: filled from prev
        for scale in (1e3, 1e-3):
            assert torch.allclose(sketch_basis(y * scale, 2, prev, rtol=0.05), base, atol=1e-12)
        assert projector_distance(base, torch.eye(m, 2, dtype=torch.float64)) > 0.1
        at = sketch_basis(y, 2, prev, rtol=0.01)  # 0.01 is not above 0.01 · 1
        assert torch.allclose(at, base, atol=1e-12), (m, q)


def test_an_exactly_rank_one_sketch_with_unit_scale_keeps_its_direction() -> None:
    """``Y = e_1 e_1ᵀ`` (σ₁ = 1, σ₂ = 0 exactly): the basis starts with e_1 (the sketch is not
    empty), then the previous basis fills in; the same in float64 when a float32 sketch and
    a float64 result are asked (the arithmetic is float64)."""
    prev = _orth(4, 2, 19)
    for m, q in ((4, 6), (4, 3)):
        y = torch.zeros(m, q)
        y[0, 0] = 1.0
        out = sketch_basis(y, 2, prev, dtype=torch.float64)
        assert out.dtype == torch.float64 and _orthonormal(out, 1e-13)
        assert float(out[0, 0]) == pytest.approx(1.0, abs=1e-12)
    empty = sketch_basis(torch.zeros(4, 3), 2, prev.float(), dtype=torch.float64)
    assert empty.dtype == torch.float64 and torch.allclose(empty, prev, atol=1e-7)


def test_sketch_basis_error_message() -> None:
    """A non-finite sketch is refused with the reason."""
    with pytest.raises(
        ValueError, match=r"^cannot take the SVD of a sketch with NaN or Inf entries$"
    ):
        sketch_basis(torch.full((4, 3), math.inf), 2, _orth(4, 2, 0))
