"""The diagnostics' formulas against their definitions (seed Theorem 3, Proposition 2).

* ``mixture_eigenvalues`` equals the spectrum of the dense ``A = Σ p_i P_i P_iᵀ`` in both the
  ``m <= R`` and ``m > R`` branches;
* ``d_r`` is the minimum over rank-r projectors Π of ``Σ p_i ‖(I − Π) Q_i‖²`` (eq. 53), attained
  by the top eigenvectors of A;
* the Proposition 2 certificate ``ε_loc + M √(d_r + ε_eig) + δ`` bounds ``‖(I − Π̂) G‖`` for the
  server basis built by every ``average_projectors`` method, exact candidates or random ones,
  with any target G; ``ε_eig`` is ~0 for the exact eigenspace.
"""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch

from fedlore.diagnostics import (
    candidate_certificate,
    certificate_bound,
    disagreement,
    mixture_eigenvalues,
    normalized,
)
from fedlore.optim.subspace import average_projectors, random_basis, top_left_singular


def _dense_a(bases: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    p = normalized(weights)
    return sum(w * (b.double() @ b.double().t()) for b, w in zip(bases, p, strict=True))  # type: ignore[return-value]


@pytest.mark.parametrize(("m", "n_clients", "rank"), [(6, 5, 2), (40, 3, 4), (12, 4, 3)])
def test_mixture_eigenvalues_are_the_spectrum_of_a(m: int, n_clients: int, rank: int) -> None:
    bases = [random_basis(10 * m + i, m, rank) for i in range(n_clients)]
    weights = [1.0 + i for i in range(n_clients)]
    lam = mixture_eigenvalues(bases, weights)
    dense = torch.linalg.eigvalsh(_dense_a(bases, weights)).flip(0)
    k = min(m, n_clients * rank)
    assert lam.shape == (k,)
    # P_i have float32 orthonormality, so eigenvalues agree to float32 precision
    assert torch.allclose(lam, dense[:k].clamp(0, 1), atol=1e-6)
    if k < m:
        assert float(dense[k:].abs().max()) < 1e-6
    assert abs(float(lam.sum()) - rank) < 1e-5  # tr A = r


def test_disagreement_is_the_minimum_over_projectors() -> None:
    m, rank = 9, 3
    bases = [random_basis(i, m, rank) for i in range(4)]
    weights = [1.0, 2.0, 3.0, 4.0]
    p = normalized(weights)
    d_r = disagreement(mixture_eigenvalues(bases, weights), rank)

    def cost(pi: torch.Tensor) -> float:
        proj = pi.double() @ pi.double().t()
        eye = torch.eye(m, dtype=torch.float64)
        return sum(
            w * float(((eye - proj) @ b.double()).pow(2).sum())
            for b, w in zip(bases, p, strict=True)
        )

    top = torch.linalg.eigh(_dense_a(bases, weights))[1][:, -rank:]
    assert cost(top) == pytest.approx(d_r, abs=1e-6)
    for s in range(20):
        assert cost(random_basis(100 + s, m, rank)) >= d_r - 1e-9
    assert 0 < d_r < rank
    same = disagreement(mixture_eigenvalues([bases[0]] * 3, [1.0, 1.0, 1.0]), rank)
    assert same == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("method", ["svd", "randomized", "gram"])
@pytest.mark.parametrize("candidates", ["exact", "random"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_proposition2_certificate_bounds_the_residual(
    method: Literal["svd", "randomized", "gram"], candidates: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    m, n, rank, n_clients = 16, 12, 3, 5
    shared = torch.randn(m, n, generator=gen)
    grads = [shared + 0.8 * torch.randn(m, n, generator=gen) for _ in range(n_clients)]
    if candidates == "exact":
        bases = [top_left_singular(h, rank) for h in grads]
    else:
        bases = [random_basis(seed * 10 + i, m, rank) for i in range(n_clients)]
    weights = [float(i + 1) for i in range(n_clients)]
    server = average_projectors(
        bases, weights, rank, method, generator=torch.Generator().manual_seed(7), niter=0
    )
    stats, hbar = candidate_certificate(grads, bases, weights, server)
    assert stats["eps_loc2"] >= 0 and stats["M"] > 0 and 0 <= stats["d_r"] <= rank
    if method != "randomized":
        assert stats["eps_eig"] < 1e-5
    zero = torch.zeros(m, n, dtype=torch.float64)
    assert torch.allclose(
        hbar, sum((w * g.double() for g, w in zip(grads, normalized(weights), strict=False)), zero)
    )
    proj = server.double() @ server.double().t()
    for target in (hbar, hbar + 0.5 * torch.randn(m, n, generator=gen, dtype=torch.float64)):
        residual = float((target - proj @ target).norm())
        delta = float((hbar - target).norm())
        assert residual <= certificate_bound(stats, delta) + 1e-9
    if candidates == "exact":
        # eps_loc is the discarded singular-value energy of each candidate
        want = sum(
            w * float(torch.linalg.svdvals(g.double())[rank:].pow(2).sum())
            for g, w in zip(grads, normalized(weights), strict=True)
        )
        assert stats["eps_loc2"] == pytest.approx(want, rel=1e-5)


def test_eps_eig_is_the_top_r_mass_of_a_the_server_basis_misses() -> None:
    """ε_eig = Σ_{j≤r} λ_j(A^cand) − tr(Π̂ A^cand) (the ``diag.eps_eig`` of outputs.md): a
    server basis that is not A's top-r eigenspace (a random one) leaves a positive gap, equal
    to the one computed from the dense A; A's own top-r eigenvectors leave none."""
    gen = torch.Generator().manual_seed(3)
    m, n, rank = 14, 9, 3
    grads = [torch.randn(m, n, generator=gen) for _ in range(4)]
    bases = [top_left_singular(h, rank) for h in grads]
    weights = [1.0, 2.0, 3.0, 4.0]
    dense = _dense_a(bases, weights).double()
    eigval, eigvec = torch.linalg.eigh(dense)
    top = eigvec[:, -rank:]
    server = random_basis(11, m, rank).double()
    want = float(eigval[-rank:].sum() - torch.trace(server.t() @ dense @ server))
    stats, _ = candidate_certificate(grads, bases, weights, server)
    assert want > 0.1 and stats["eps_eig"] == pytest.approx(want, rel=1e-6)
    stats, _ = candidate_certificate(grads, bases, weights, top)
    assert stats["eps_eig"] == pytest.approx(0.0, abs=1e-9)


def test_certificate_bound_formula() -> None:
    stats = {"eps_loc2": 4.0, "M": 3.0, "d_r": 0.5, "eps_eig": 0.25}
    assert certificate_bound(stats, 1.0) == pytest.approx(2.0 + 3.0 * math.sqrt(0.75) + 1.0)


def test_normalized_rejects_bad_weights() -> None:
    for bad in ([], [0.0, 0.0], [1.0, -1.0]):
        with pytest.raises(ValueError, match="weights"):
            normalized(bad)
