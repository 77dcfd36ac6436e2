"""``candidate_svd: auto``: the per-matrix route rule, its bases, and its use in FedLore's rounds.

The rule (:func:`fedlore.optim.candidate_route.candidate_route`) takes the warm-started
subspace route where ``r + p`` is small against the matrix and exact elsewhere; FedLore's
default. Reproducibility: the subspace route's sketch columns come from the client's seeded
generator, never from torch's global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fedlore.algorithms.lowrank as lowrank_mod
from fedlore.algorithms.fedlore import FedLore
from fedlore.config import load_config
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.loop import RoundLoop
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment_parts import make_algorithm
from fedlore.optim.candidate_route import candidate_route, exact_macs, subspace_macs
from fedlore.optim.subspace import MatrixSpec, captured_energy, projector_distance
from fedlore.seeding import generator

P, Q = 10, 2  # the defaults svd_oversample, svd_niter


# --------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    ("m", "n", "rank"),
    [(512, 3136, 8), (3136, 512, 8), (256, 1024, 8), (256, 256, 8), (1024, 1024, 32)],
)
def test_rule_takes_subspace_where_r_plus_p_is_small(m: int, n: int, rank: int) -> None:
    """The CNN's fc layer (512 x 3136, r = 8) and other matrices whose short side is at least
    ``10 r + 120`` (the defaults), in either orientation."""
    assert candidate_route(m, n, rank, P, Q) == "subspace"


@pytest.mark.parametrize(
    ("m", "n", "rank"),
    [
        (64, 800, 8),  # the CNN's conv2: subspace measured slower than exact
        (32, 25, 8),  # conv1
        (64, 64, 8),
        (128, 128, 8),
        (128, 128, 32),  # the LLaMA's attention, r = d/4: subspace measured inaccurate
        (352, 128, 32),
        (128, 352, 32),
        (20, 30, 4),
    ],
)
def test_rule_keeps_exact_for_small_or_square_matrices(m: int, n: int, rank: int) -> None:
    assert candidate_route(m, n, rank, P, Q) == "exact"


def test_rule_boundary_is_the_documented_inequality() -> None:
    """``2 ((2 q + 1)(r + p) + p) <= min(m, n)``: ``10 r + 120`` at the defaults."""
    for rank in (1, 8, 32):
        edge = 10 * rank + 120
        assert candidate_route(edge, 5000, rank, P, Q) == "subspace"
        assert candidate_route(edge - 1, 5000, rank, P, Q) == "exact"
        assert candidate_route(5000, edge - 1, rank, P, Q) == "exact"
    # the same inequality through the cost model
    for m, n, r, p, q in [(200, 900, 8, 10, 2), (199, 900, 8, 10, 2), (300, 300, 4, 5, 3)]:
        want = 2 * subspace_macs(m, n, r, p, q) <= exact_macs(m, n)
        assert (candidate_route(m, n, r, p, q) == "subspace") == want
    assert subspace_macs(10, 20, 2, 3, 1) == (3 * 5 + 3) * 200
    assert exact_macs(10, 20) == exact_macs(20, 10) == 10 * 200


def test_rule_needs_a_warm_start_sketch_columns_and_iterations() -> None:
    """Measured inaccurate without sketch columns or iterations, and not measured cold: exact."""
    assert candidate_route(512, 3136, 8, P, Q, warm=False) == "exact"
    assert candidate_route(512, 3136, 8, 0, Q) == "exact"
    assert candidate_route(512, 3136, 8, P, 0) == "exact"
    # more iterations cost more: the route flips back to exact
    assert candidate_route(512, 3136, 8, P, 5) == "subspace"
    assert candidate_route(512, 3136, 8, P, 10) == "exact"
    assert candidate_route(4, 4, 8, P, Q) == "exact"  # a block wider than the matrix


# ------------------------------------------------------------------ auto in a FedLore client
def gapped(m: int, n: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 ``m x n`` gradient with a clear gap after ``rank`` (sigma 10..7, then <= 0.5)
    and its exact top-``rank`` left singular vectors (float64)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=g))[0]
    v = torch.linalg.qr(torch.randn(n, m, dtype=torch.float64, generator=g))[0]
    sv = torch.cat([torch.linspace(10, 7, rank), 0.5 * torch.rand(m - rank, generator=g)])
    mat = (u * sv.double()) @ v.t()
    return mat.float(), u[:, :rank]


def near(basis: torch.Tensor, angle: float, seed: int) -> torch.Tensor:
    """An orthonormal basis ``angle`` radians off ``basis`` (a client's current P^t)."""
    g = torch.Generator().manual_seed(seed)
    perp = torch.randn(basis.shape, dtype=torch.float64, generator=g)
    perp = torch.linalg.qr(perp - basis @ (basis.t() @ perp))[0]
    return (math.cos(angle) * basis + math.sin(angle) * perp).float()


class RouteSpy:
    """Records ``(shape, method)`` of every client-side basis (``LowRankHyper.top_r``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[tuple[int, ...], str]] = []
        inner: Callable[..., torch.Tensor] = lowrank_mod.top_left_singular

        def spy(mat: torch.Tensor, rank: int, method: str = "exact", *a: Any, **k: Any) -> Any:
            self.calls.append((tuple(mat.shape), method))
            return inner(mat, rank, method, *a, **k)

        monkeypatch.setattr(lowrank_mod, "top_left_singular", spy)


def test_auto_is_the_default_and_exact_is_one_setting_away() -> None:
    assert FedLore().candidate_svd == "auto"
    algo = make_algorithm("fedlore", load_config(None, ["method.fedlore.candidate_svd=exact"]))
    assert isinstance(algo, FedLore) and algo.candidate_svd == "exact"


def test_auto_spans_the_exact_subspace_on_a_clear_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a wide matrix with a clear spectral gap, ``auto`` takes the subspace route from the
    current basis and spans the exact route's subspace; ``exact`` gives the seed's bits."""
    m, n, r = 220, 600, 4
    grad, top = gapped(m, n, r, 1)
    spec = MatrixSpec("w", (m, n), "left", m, n, r)
    current = near(top, 0.4, 2)
    spy = RouteSpy(monkeypatch)
    auto = FedLore(rank=r)._candidate(spec, grad, current, generator(3))
    exact = FedLore(rank=r, candidate_svd="exact")._candidate(spec, grad, current, generator(3))
    assert spy.calls == [((m, n), "subspace"), ((m, n), "exact")]
    assert not torch.equal(auto, exact)  # really another route
    assert projector_distance(auto, top) < 1e-4
    assert projector_distance(auto, exact) < 1e-4
    assert captured_energy(auto, grad) == pytest.approx(captured_energy(exact, grad), abs=1e-6)
    torch.testing.assert_close(auto, exact, rtol=0, atol=1e-4)  # same signs too
    reference = lowrank_mod.top_left_singular(grad, r)  # the seed's TopLeftSVD, float64
    assert torch.equal(exact, reference)


def test_auto_subspace_route_is_seeded_by_the_client_generator() -> None:
    """Same generator seed, same bits; torch's global RNG is neither read nor advanced."""
    m, n, r = 220, 600, 4
    grad, top = gapped(m, n, r, 4)
    spec = MatrixSpec("w", (m, n), "left", m, n, r)
    current = near(top, 0.4, 5)
    algo = FedLore(rank=r)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = algo._candidate(spec, grad, current, generator(7))
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(123)  # another global state: no effect
    b = algo._candidate(spec, grad, current, generator(7))
    assert torch.equal(a, b)
    c = algo._candidate(spec, grad, current, generator(8))  # another sketch, same subspace
    assert not torch.equal(a, c)
    assert projector_distance(a, c) < 1e-4


# ------------------------------------------------------- per matrix, in FedLore's real rounds
BIG_IN, BIG_OUT, SMALL_OUT, NCLS, NCLIENTS = 160, 150, 12, 3, 3


class TwoLayers(nn.Module):
    """``big`` (150 x 160: short side 150 >= 10 r + 120 at r = 2) and ``small`` (12 x 150)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(BIG_IN, BIG_OUT)
        self.small = nn.Linear(BIG_OUT, SMALL_OUT)
        self.head = nn.Linear(SMALL_OUT, NCLS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.small(torch.relu(self.big(x)))))


def _build() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TwoLayers()


def _data(cid: int) -> ClientData:
    g = torch.Generator().manual_seed(100 + cid)
    x = torch.randn(40, BIG_IN, generator=g) + 0.1 * cid
    y = torch.randint(0, NCLS, (40,), generator=g)
    return ClientData(cid, TensorSplit(x, y), TensorSplit(x[:5], y[:5]))


def _run(rounds: int = 3, **kw: Any) -> dict[str, torch.Tensor]:
    algo = FedLore.of(local_steps=2, batch_size=8, lr=1e-2, rank=2, **kw)
    transport = LocalTransport(algo, _data, _build, 11, ClientStore())
    loop = RoundLoop(algo, transport, lambda _: list(range(NCLIENTS)))
    state = loop.run(algo.init_server(_build(), generator(11, 2)), -1, rounds)
    return state.arrays


def test_auto_chooses_per_matrix_in_fedlore_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """One model, two projected matrices: every round's candidates take the subspace route for
    the big one and the exact route for the small one; the setup exchange (no current basis)
    takes exact for both. Two runs with the same seed agree bit for bit."""
    spy = RouteSpy(monkeypatch)
    first = _run()
    big, small = (BIG_OUT, BIG_IN), (SMALL_OUT, BIG_OUT)
    setup, rounds = spy.calls[: 2 * NCLIENTS], spy.calls[2 * NCLIENTS :]
    assert sorted(set(setup)) == sorted({(big, "exact"), (small, "exact")})
    assert len(rounds) == 3 * 2 * NCLIENTS
    assert sorted(set(rounds)) == sorted({(big, "subspace"), (small, "exact")})
    again = _run()
    assert first.keys() == again.keys()
    for k in first:
        assert torch.equal(first[k], again[k]), k
    spy.calls.clear()
    exact = _run(candidate_svd="exact")
    assert {c[1] for c in spy.calls} == {"exact"}
    assert not torch.equal(exact["model.big.weight"], first["model.big.weight"])
