"""``fedlore.optim.svd``: where LAPACK's SVD fails to converge, the QR + eigh fallback gives the
same singular values and subspaces; where it converges, the SVD's own answer is returned.

The fallback works on the squared spectrum, so a singular value is exact to about
``sqrt(eps) * s_max`` (1.5e-8 of the largest): zero singular values come back as ~1e-8, and the
tests hold it to that, not to the SVD's own ``eps * s_max``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedlore.optim import svd as svd_mod
from fedlore.optim.subspace import top_left_singular
from fedlore.optim.svd import svd_left, svd_right, svd_triplets

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "svd_no_convergence.npz"


def _matrix(m: int, k: int, rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.logspace(0, -3, rank, dtype=torch.float64)
    left = torch.linalg.qr(torch.randn(m, rank, generator=g, dtype=torch.float64))[0]
    right = torch.linalg.qr(torch.randn(k, rank, generator=g, dtype=torch.float64))[0]
    return left @ torch.diag(spectrum) @ right.t()


@pytest.fixture
def failing_svd(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.linalg.svd`` fails as gesdd does on some machines."""

    def no_convergence(*_: object, **__: object) -> None:
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "svd", no_convergence)


def _same_subspace(u: torch.Tensor, v: torch.Tensor, atol: float = 1e-9) -> None:
    torch.testing.assert_close(u @ u.t(), v @ v.t(), atol=atol, rtol=0)


@pytest.mark.parametrize("shape", [(40, 12, 12), (40, 12, 7), (12, 40, 9), (30, 30, 30)])
def test_the_fallback_gives_the_svds_values_and_subspaces(
    shape: tuple[int, int, int], failing_svd: None
) -> None:
    m, k, rank = shape
    a = _matrix(m, k, rank)
    want_u, want_s, want_vh = np.linalg.svd(a.numpy(), full_matrices=False)
    u, s = svd_left(a)
    n = min(m, k)
    assert u.shape == (m, n) and s.shape == (n,)
    torch.testing.assert_close(s, torch.from_numpy(want_s), atol=1e-7, rtol=0)  # s_max = 1
    assert bool((s[:-1] >= s[1:]).all())  # descending
    torch.testing.assert_close(u.t() @ u, torch.eye(n, dtype=u.dtype), atol=1e-10, rtol=0)
    for r in (1, 3, rank):  # each leading subspace (the spectrum has distinct values)
        _same_subspace(u[:, :r], torch.from_numpy(want_u[:, :r]))
    s_r, vh = svd_right(a)
    torch.testing.assert_close(s_r, s, atol=1e-7, rtol=0)
    _same_subspace(vh[:rank].t(), torch.from_numpy(want_vh[:rank].T))
    u3, s3, vh3 = svd_triplets(a)
    torch.testing.assert_close(u3 @ torch.diag(s3) @ vh3, a, atol=1e-10, rtol=0)


def test_where_the_svd_converges_its_answer_is_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of the three returns the economy-size SVD's own factors (a 20 x 10 matrix: 10
    columns of U, 10 rows of Vh), untouched."""
    a = _matrix(20, 10, 6)
    u, s, vh = torch.linalg.svd(a, full_matrices=False)

    def unused(*_: object) -> None:
        raise AssertionError("the fallback ran although the SVD converged")

    monkeypatch.setattr(svd_mod, "_gram_left", unused)
    got_u, got_s = svd_left(a)
    assert torch.equal(got_u, u) and torch.equal(got_s, s)
    got_u, got_s, got_vh = svd_triplets(a)
    assert got_u.shape == (20, 10) and got_vh.shape == (10, 10)
    assert torch.equal(got_u, u) and torch.equal(got_s, s) and torch.equal(got_vh, vh)
    got_s, got_vh = svd_right(a.t())  # aᵀ's right singular vectors: a's left ones
    assert torch.equal(got_s, s) and torch.equal(got_vh, u.t())


def test_the_fallbacks_vh_has_a_zero_row_for_a_zero_singular_value(failing_svd: None) -> None:
    """``svd_triplets``' fallback divides ``Uᵀ A`` by the singular values where they are not 0
    and leaves a zero row where one is (exactly 0 here: ``R Rᵀ`` is diagonal), as its
    docstring says; ``U S Vh`` is ``A``."""
    a = torch.zeros(5, 3, dtype=torch.float64)
    a[0, 0], a[1, 1] = 3.0, 2.0
    u, s, vh = svd_triplets(a)
    assert s.tolist() == [3.0, 2.0, 0.0]
    assert torch.equal(vh[2], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(vh[:2].abs(), torch.eye(3, dtype=torch.float64)[:2], atol=0, rtol=0)
    torch.testing.assert_close(u @ torch.diag(s) @ vh, a, atol=1e-15, rtol=0)
    _, s0, vh0 = svd_triplets(torch.zeros(4, 6, dtype=torch.float64))  # all zero, wide
    assert not s0.any() and not vh0.any() and vh0.shape == (4, 6)


def test_a_gradient_gesdd_failed_on_gets_its_basis() -> None:
    """The 128 x 64 client gradient (rank 54) of the quickstart's FedLore run, seed 43, on
    which ``torch.linalg.svd`` failed to converge on an AVX-512 machine (its client's update
    was rejected): the basis comes back, equal to NumPy's SVD's."""
    a = torch.from_numpy(np.load(FIXTURE)["a"])
    assert a.shape == (128, 64) and a.dtype == torch.float64
    want_u, want_s, _ = np.linalg.svd(a.numpy(), full_matrices=False)
    u, s = svd_left(a)
    top = float(want_s[0])
    torch.testing.assert_close(s, torch.from_numpy(want_s), atol=1e-7 * top, rtol=0)
    basis = top_left_singular(a, 8, dtype=torch.float64)
    _same_subspace(basis, torch.from_numpy(want_u[:, :8]))
    # the directions above the fallback's floor (32 of them; the next singular value is 9e-9)
    _same_subspace(u[:, :32], torch.from_numpy(want_u[:, :32]), atol=1e-5)


def test_the_fallback_refuses_nan_as_the_svd_does(failing_svd: None) -> None:
    a = _matrix(10, 6, 4)
    a[2, 3] = float("nan")
    message = r"^svd: the matrix has NaN or Inf entries$"
    with pytest.raises(torch.linalg.LinAlgError, match=message):
        svd_left(a)
    with pytest.raises(torch.linalg.LinAlgError, match=message):
        svd_triplets(a)


def test_the_spectral_norm_falls_back_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``spectral_norm`` (the diagnostics' ``||H||_2``, ``projector_distance``) is the matrix
    norm where it converges, and the fallback's top singular value where it does not, equal to
    NumPy's to rounding, on the fixture's gradient too."""
    from fedlore.optim.svd import spectral_norm

    a = _matrix(30, 12, 7) * 3.0
    assert torch.equal(spectral_norm(a), torch.linalg.matrix_norm(a, ord=2))
    fixture = torch.from_numpy(np.load(FIXTURE)["a"])

    def no_convergence(*_: object, **__: object) -> None:
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "matrix_norm", no_convergence)
    for m in (a, a.t(), fixture):
        want = float(np.linalg.norm(m.numpy(), ord=2))
        assert float(spectral_norm(m)) == pytest.approx(want, rel=1e-12)
