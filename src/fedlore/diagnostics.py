"""Subspace diagnostics of projected federated training (seed Appendix D, "Diagnostics").

Per projected matrix (view ``m x n``), at the round-start global model ``W^t``, with normalized
weights ``p_i`` over the diagnostic clients:

* ``G = Σ p_i G_i``, the global gradient (seed eq. 13 with ``p_i = 1/N``);
* ``A = Σ p_i Π_i``, ``Π_i = P_i P_iᵀ`` (one shared ``Π`` for FedLore and its variants);
* retained energy ``⟨G, A G⟩ / ‖G‖²``, which is ``‖Π G‖² / ‖G‖²`` for a shared projector, and the
  residual ``ρ² = ‖G‖² − ⟨G, A G⟩`` (``‖(I − Π) G‖²``; Theorem 5, eq. 42);
* the coupling bias ``b = Σ p_i Π_i G_i − A G = Σ p_i (Π_i − A)(G_i − G)`` (Theorem 3), its bound
  constants ``v = ‖A − A²‖₂`` and ``tr(A − A²)``, and ``⟨G, A G + b⟩``, the first-order descent
  of the aggregated projected gradient (Theorem 3: ``‖b‖² ≤ v Σ p_i ‖G_i − G‖²``);
* the disagreement ``d_r = r − Σ_{j≤r} λ_j(A)`` (Proposition 2, eq. 53).

FedLore's candidate certificate (Proposition 2, eqs. 53–57): with candidate gradients ``H_i``
(each client's last local gradient of the previous round) and their candidate projectors
``Q_i``, ``ε_loc² = Σ p_i ‖(I − Q_i) H_i‖²``, ``M = max_i ‖H_i‖₂``, ``d_r`` of
``A^cand = Σ p_i Q_i``, ``ε_eig = Σ_{j≤r} λ_j(A^cand) − tr(Π̂ A^cand)`` for the server basis
``Π̂`` and ``δ = ‖H̄ − G‖`` give ``‖(I − Π̂) G‖ ≤ ε_loc + M √(d_r + ε_eig) + δ``.

Everything is computed in float64. :class:`Diagnoser` streams over the clients (one gradient
in memory at a time, plus each client's ``m x r`` basis for client-specific projections) and
sums the per-matrix quantities over the projected matrices (a block-diagonal projector:
energies add, ``v`` is the maximum over blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
from torch import nn

from fedlore.checks import projects
from fedlore.data.client_data import ClientData
from fedlore.optim.subspace import MatrixSpec, projection_plan
from fedlore.optim.svd import spectral_norm
from fedlore.seeding import DIAG, derive_seed, generator
from fedlore.tensors import load_model_arrays
from fedlore.train.local import task_loss
from fedlore.types import Arrays, State

CERTIFICATE_TERMS = ("eps_loc2", "M", "d_r", "eps_eig")
"""The G-independent terms of Proposition 2 that :func:`candidate_certificate` returns."""


def normalized(weights: Sequence[float]) -> list[float]:
    """``p_i = w_i / Σ w_j``.

    Raises:
        ValueError: if the weights are empty, negative or sum to zero.
    """
    total = float(sum(weights))
    if not weights or any(w < 0 for w in weights) or not total > 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights!r}")
    return [float(w) / total for w in weights]


def mixture_eigenvalues(bases: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Eigenvalues of ``A = Σ p_i P_i P_iᵀ``, descending, float64.

    Computed from the ``m x R`` stack ``S = [√p_1 P_1, ..., √p_N P_N]`` (``R = Σ r_i``): ``A = S
    Sᵀ``, whose nonzero eigenvalues are those of the ``R x R`` Gram ``Sᵀ S``; the smaller of the
    two is decomposed. Returns ``min(m, R)`` values in ``[0, 1]`` (up to rounding); the other
    eigenvalues of ``A`` are zero.

    Args:
        bases: N matrices ``m x r_i`` with orthonormal columns.
        weights: N non-negative weights (normalized here).
    """
    p = normalized(weights)
    stack = torch.cat([b.double() * math.sqrt(w) for b, w in zip(bases, p, strict=True)], dim=1)
    gram = stack @ stack.t() if stack.shape[0] <= stack.shape[1] else stack.t() @ stack
    return torch.linalg.eigvalsh(gram).flip(0).clamp(0.0, 1.0)


def disagreement(eigenvalues: torch.Tensor, rank: int) -> float:
    """``d_r = r − Σ_{j≤r} λ_j(A)`` (seed eq. 53): 0 iff all projectors agree (same rank r),
    at most r; ``min_Π Σ p_i ‖(I − Π) Q_i‖_F²`` over rank-r projectors Π."""
    return max(float(rank) - float(eigenvalues[:rank].sum()), 0.0)


def candidate_certificate(
    cand_grads: Sequence[torch.Tensor],
    cand_bases: Sequence[torch.Tensor],
    weights: Sequence[float],
    server_basis: torch.Tensor,
) -> tuple[dict[str, float], torch.Tensor]:
    """The G-independent terms of Proposition 2 for one matrix, and the candidate mean ``H̄``.

    Args:
        cand_grads: N candidate gradients ``H_i`` (``m x n``).
        cand_bases: N candidate bases ``m x r`` (``Q_i = P_i P_iᵀ``).
        weights: N aggregation weights (normalized here).
        server_basis: the basis ``m x r`` the server built from the candidates (``Π̂``).

    Returns:
        ``({"eps_loc2", "M", "d_r", "eps_eig"}, H̄ as float64 m x n)``.
    """
    p = normalized(weights)
    rank = server_basis.shape[1]
    eps_loc2 = 0.0
    spectral = 0.0
    hbar = torch.zeros(cand_grads[0].shape, dtype=torch.float64, device=cand_grads[0].device)
    tr_pi_a = 0.0
    pi = server_basis.double()
    for h, q, w in zip(cand_grads, cand_bases, p, strict=True):
        h64, q64 = h.double(), q.double()
        kept = float((q64.t() @ h64).pow(2).sum())
        eps_loc2 += w * max(float(h64.pow(2).sum()) - kept, 0.0)
        spectral = max(spectral, float(spectral_norm(h64)))
        hbar += w * h64
        tr_pi_a += w * float((pi.t() @ q64).pow(2).sum())
    lam = mixture_eigenvalues(cand_bases, p)
    top = float(lam[:rank].sum())
    stats = {
        "eps_loc2": eps_loc2,
        "M": spectral,
        "d_r": disagreement(lam, rank),
        "eps_eig": max(top - tr_pi_a, 0.0),
    }
    return stats, hbar


def certificate_bound(stats: dict[str, float], delta: float) -> float:
    """``R = ε_loc + M √(d_r + ε_eig) + δ`` (seed eq. 57), an upper bound on ``‖(I − Π̂) G‖``."""
    return (
        math.sqrt(stats["eps_loc2"])
        + stats["M"] * math.sqrt(stats["d_r"] + stats["eps_eig"])
        + delta
    )


class Diagnosable(Protocol):
    """What an algorithm offers the diagnostics (all optional; dense methods offer none).

    Which bases it has is its capabilities' ``projects`` (:func:`fedlore.checks.projects`):
    ``"shared"`` (one projector per matrix for all clients) or ``"client"`` (each client builds
    its own).

    * ``plan(model)``: the projected matrices.
    * ``diagnostic_bases(state, rnd, grads, rng)``: ``"shared"``: the bases round ``rnd`` uses
      (``grads`` is None); ``"client"``: the bases the client would build from its gradient
      views ``grads``.
    * ``diagnostic_candidates(state, rnd)``: per matrix, the candidate statistics of
      :func:`candidate_certificate` plus ``"hbar"`` (tensor), or None.
    """

    def plan(self, model: nn.Module) -> dict[str, MatrixSpec]: ...

    def diagnostic_bases(
        self, state: State, rnd: int, grads: Arrays | None, rng: torch.Generator
    ) -> Arrays: ...


class Diagnoser:
    """Measures the ``diag.*`` metrics at the start of selected rounds.

    Each client's diagnostic batch is fixed for the run: ``batch_size`` training examples drawn
    without replacement with ``generator(seed, DIAG, client)``. Gradients are of the mean
    cross-entropy in train mode (as local training sees them), with dropout's randomness drawn
    from a forked, seeded RNG so the run's other randomness is untouched.

    Args:
        algorithm: the method (see :class:`Diagnosable`; methods without projections get only
            ``diag.grad_norm2`` over the matrices of the default projection plan).
        model: a scratch model of the run's architecture (its weights are overwritten).
        client_data: client id -> :class:`ClientData`.
        num_clients: N.
        every: measure at rounds ``t >= 0`` with ``t % every == 0``; 0 never.
        batch_size: examples per diagnostic batch.
        clients: ``"all"`` (G over every client) or ``"sampled"`` (the round's sampled clients).
        seed: run seed.
        rank: r of the default plan for methods without one.
        uniform: weight clients equally instead of by their number of training examples.
    """

    def __init__(
        self,
        algorithm: Any,
        model: nn.Module,
        client_data: Callable[[int], ClientData],
        num_clients: int,
        every: int,
        batch_size: int,
        clients: Literal["all", "sampled"],
        seed: int,
        rank: int,
        uniform: bool = False,
    ) -> None:
        self.algorithm = algorithm
        self.model = model
        self.client_data = client_data
        self.num_clients = num_clients
        self.every = every
        self.batch_size = batch_size
        self.clients = clients
        self.seed = seed
        self.uniform = uniform
        planner = getattr(algorithm, "plan", None)
        self.plan = planner(model) if planner is not None else projection_plan(model, rank)
        self.kind: str | None = projects(algorithm)

    def due(self, rnd: int) -> bool:
        """Whether round ``rnd`` is measured."""
        return self.every > 0 and rnd >= 0 and rnd % self.every == 0

    def _gradient(self, cid: int) -> tuple[Arrays, float]:
        data = self.client_data(cid)
        x, y = data.train.x, data.train.y
        n = int(y.shape[0])
        take = min(self.batch_size, n)
        idx = torch.randperm(n, generator=generator(self.seed, DIAG, cid))[:take].to(x.device)
        model = self.model
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, DIAG, cid))
            loss = task_loss(model(x[idx]), y[idx])
        loss.backward()
        params = dict(model.named_parameters())
        views = {}
        for k, s in self.plan.items():
            g = params[k].grad
            views[k] = (
                s.view(g).detach().double()
                if g is not None
                else torch.zeros(s.m, s.n, dtype=torch.float64, device=params[k].device)
            )
        model.zero_grad(set_to_none=True)
        return views, 1.0 if self.uniform else float(n)

    def __call__(self, state: State, rnd: int, sampled: Sequence[int]) -> dict[str, float]:
        """The ``diag.*`` metrics of round ``rnd`` (empty when the round is not measured)."""
        if not self.due(rnd):
            return {}
        load_model_arrays(self.model, self.algorithm.global_arrays(state))
        ids = list(range(self.num_clients)) if self.clients == "all" else sorted(sampled)
        plan = self.plan
        device = next(self.model.parameters()).device
        sum_g = {
            k: torch.zeros(s.m, s.n, dtype=torch.float64, device=device) for k, s in plan.items()
        }
        sum_pg = {
            k: torch.zeros(s.m, s.n, dtype=torch.float64, device=device) for k, s in plan.items()
        }
        sq = 0.0
        weights: list[float] = []
        client_bases: list[Arrays] = []
        for cid in ids:
            g, w = self._gradient(cid)
            weights.append(w)
            sq += w * sum(float(v.pow(2).sum()) for v in g.values())
            for k in plan:
                sum_g[k] += w * g[k]
            if self.kind == "client":
                rng = generator(self.seed, DIAG, rnd, cid)
                bases = self.algorithm.diagnostic_bases(
                    state, rnd, {k: v.float() for k, v in g.items()}, rng
                )
                client_bases.append(bases)
                for k in plan:
                    p = bases[k].double()
                    sum_pg[k] += w * (p @ (p.t() @ g[k]))
        total_w = sum(weights)
        grad = {k: v / total_w for k, v in sum_g.items()}
        gnorm2 = sum(float(v.pow(2).sum()) for v in grad.values())
        out: dict[str, float] = {
            "diag.grad_norm2": gnorm2,
            "diag.heterogeneity": max(sq / total_w - gnorm2, 0.0),
            "diag.clients": float(len(ids)),
        }
        if self.kind == "shared":
            out.update(self._shared(state, rnd, grad, gnorm2))
        elif self.kind == "client":
            out.update(self._client(grad, gnorm2, sum_pg, total_w, client_bases, weights))
        return out

    def _shared(self, state: State, rnd: int, grad: Arrays, gnorm2: float) -> dict[str, float]:
        bases = self.algorithm.diagnostic_bases(state, rnd, None, generator(self.seed, DIAG, rnd))
        kept = {k: float((bases[k].double().t() @ grad[k]).pow(2).sum()) for k in self.plan}
        retained = sum(kept.values())
        out = {
            "diag.retained_energy": retained / gnorm2 if gnorm2 > 0 else 1.0,
            "diag.rho2": max(gnorm2 - retained, 0.0),
            "diag.inner": retained,
        }
        cands = getattr(self.algorithm, "diagnostic_candidates", None)
        cand = cands(state, rnd) if cands is not None else None
        if cand:
            eps_loc2 = delta2 = d_r = eps_eig = bound2 = 0.0
            spectral = 0.0
            for k, st in cand.items():
                delta = float((st["hbar"] - grad[k]).norm())
                stats = {s: float(st[s]) for s in CERTIFICATE_TERMS}
                eps_loc2 += stats["eps_loc2"]
                delta2 += delta**2
                d_r += stats["d_r"]
                eps_eig += stats["eps_eig"]
                spectral = max(spectral, stats["M"])
                bound2 += certificate_bound(stats, delta) ** 2
            out.update(
                {
                    "diag.eps_loc2": eps_loc2,
                    "diag.d_r": d_r,
                    "diag.eps_eig": eps_eig,
                    "diag.M": spectral,
                    "diag.delta2": delta2,
                    "diag.certificate2": bound2,
                }
            )
        return out

    def _client(
        self,
        grad: Arrays,
        gnorm2: float,
        sum_pg: Arrays,
        total_w: float,
        client_bases: list[Arrays],
        weights: list[float],
    ) -> dict[str, float]:
        p = normalized(weights)
        retained = inner = b2 = tr = d_r = 0.0
        v = 0.0
        for k, s in self.plan.items():
            ag = torch.zeros_like(grad[k])
            for bases, w in zip(client_bases, p, strict=True):
                q = bases[k].double()
                ag += w * (q @ (q.t() @ grad[k]))
            pg = sum_pg[k] / total_w
            b = pg - ag
            retained += float((grad[k] * ag).sum())
            inner += float((grad[k] * pg).sum())
            b2 += float(b.pow(2).sum())
            lam = mixture_eigenvalues([bs[k] for bs in client_bases], p)
            gap = lam - lam.pow(2)
            v = max(v, float(gap.max()))
            tr += float(gap.sum())
            d_r += disagreement(lam, s.rank)
        return {
            "diag.retained_energy": retained / gnorm2 if gnorm2 > 0 else 1.0,
            "diag.rho2": max(gnorm2 - retained, 0.0),
            "diag.inner": inner,
            "diag.b_norm2": b2,
            "diag.v": v,
            "diag.trace": tr,
            "diag.d_r": d_r,
        }
