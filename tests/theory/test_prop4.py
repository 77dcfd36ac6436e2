"""Proposition 4 of the seed: agreement alone does not imply coverage.

Two quadratic clients f_i(W) = ½‖W‖² + ⟨C_i, W⟩ with C_1 = diag(2, 1), C_2 = diag(−2, 1). At
W = 0 both leading left singular subspaces are e_1 (they agree uniquely), the averaged projector
is diag(1, 0), yet the global gradient is diag(0, 1): the shared projection has zero coverage,
the two projected local steps cancel, and the server stays at W = 0 in every round while the
last-step candidate rule keeps selecting the same projector. This file checks the algebra;
``test_theory_in_the_loop.py`` runs the example through FedLore and the round loop.
"""

from __future__ import annotations

import torch

from fedlore.optim.subspace import average_projectors, captured_energy, top_left_singular

C = [torch.diag(torch.tensor([2.0, 1.0])), torch.diag(torch.tensor([-2.0, 1.0]))]


def grad(i: int, w: torch.Tensor) -> torch.Tensor:
    return w + C[i]


def test_agreeing_candidates_give_a_zero_coverage_projector() -> None:
    w = torch.zeros(2, 2)
    cands = [top_left_singular(grad(i, w), 1) for i in range(2)]
    e1 = torch.tensor([[1.0], [0.0]])
    assert all(torch.allclose(c.abs(), e1) for c in cands)  # unique and identical
    shared = average_projectors(cands, [1.0, 1.0], 1)
    global_grad = (grad(0, w) + grad(1, w)) / 2
    assert torch.allclose(global_grad, torch.diag(torch.tensor([0.0, 1.0])))
    assert captured_energy(shared, global_grad) == 0.0  # zero coverage
    assert float(global_grad.norm() ** 2) == 1.0  # although the point is not stationary
    # heterogeneity N^-1 Σ‖C_i − G‖² = 4
    assert sum(float((grad(i, w) - global_grad).norm() ** 2) for i in range(2)) / 2 == 4.0


def test_shared_projected_sgd_stays_at_zero_every_round() -> None:
    w = torch.zeros(2, 2)
    basis = average_projectors([top_left_singular(grad(i, w), 1) for i in range(2)], [1, 1], 1)
    for _ in range(10):  # K = 1, full participation, exact gradients, gamma = 1
        ends = []
        cands = []
        for i in range(2):
            g = grad(i, w)
            ends.append(w - basis @ (basis.t() @ g))
            cands.append(top_left_singular(g, 1))  # last-step candidate
        w = (ends[0] + ends[1]) / 2
        assert torch.equal(w, torch.zeros(2, 2))  # the local updates cancel exactly
        new_basis = average_projectors(cands, [1, 1], 1)
        assert torch.allclose(new_basis.abs(), basis.abs())  # the same projector is reselected
        basis = new_basis
