"""Shared pieces of the projected-gradient methods (FedLore, its variants, Local GaLore).

Kept here so that every method uses one projection rule, one projected-Adam training routine
and one increment formula on both server and client, ``W <- a W + P Δ`` (seed
the FedLore paper, Proposition 8; identical operations in identical
order give bit-identical caches, which the synchronization tests rely on), and the sketch
primitives of FedLore-Sketch (Ω, ``Y = G Ω``, the range of the mean sketch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from fedlore.algorithms.base import Hyper
from fedlore.optim.candidate_route import candidate_route
from fedlore.optim.projected_adam import ProjectedAdam, ProjectedSGD
from fedlore.optim.subspace import (
    MatrixSpec,
    SideRule,
    SvdMethod,
    gaussian_sketch,
    plan_of,
    random_basis,
    sketch_basis,
    top_left_singular,
    weight_matrices,
)
from fedlore.seeding import derive_seed
from fedlore.tensors import all_finite, weighted_mean
from fedlore.train.local import TrainStats, local_train
from fedlore.types import Arrays, State

SVD_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp64": torch.float64,
    "fp32": torch.float32,
}
"""``LowRankHyper.svd_dtype`` -> the ``compute_dtype`` of
:func:`~fedlore.optim.subspace.top_left_singular` (None: each route's default)."""

OptState = dict[str, torch.Tensor | int]
"""One parameter's optimizer state: tensors (moments, buffers) and the int step count."""


@dataclass(frozen=True)
class LowRankHyper(Hyper):
    """Hyperparameters of the projected methods.

    Attributes:
        rank: r per projected matrix.
        scale: alpha, multiplier of the projected update (seed: alpha = 1).
        side: projection side rule, ``"left"`` (the seed), ``"right"``, ``"auto"`` (GaLore std).
        exclude: parameter-name prefixes never projected (the classifier head); they train
            densely. Tensors matching :attr:`~fedlore.settings.LocalTraining.freeze` are
            neither projected nor trained.
        candidate_svd: how client-side bases are computed: ``"auto"`` (default: per matrix,
            ``"subspace"`` where ``r + p`` is small against the matrix and a current basis
            exists, else ``"exact"``; the rule and its measurements:
            :func:`fedlore.optim.candidate_route.candidate_route`), ``"exact"`` (the seed's
            TopLeftSVD, Algorithm 1 line 21, on every matrix), ``"randomized"`` (seeded range
            finder) or ``"subspace"`` (block power iteration warm-started from the client's
            current basis ``P^t``, see :func:`fedlore.optim.subspace.subspace_iteration`;
            cold-started from a sketch where there is no current basis: FedLore's setup
            exchange, Local GaLore). ``auto`` approximates the seed's bases on wide matrices
            (within 0.1 % of the exact captured energy where measured); ``exact`` restores them.
        svd_oversample: extra columns of the randomized range finder (Halko et al. 2011) and
            of the subspace route's block.
        svd_niter: power iterations of the randomized range finder and of the subspace route.
        svd_dtype: arithmetic of client-side bases: ``"auto"`` (float64 for the exact and
            randomized routes, as the seed's TopLeftSVD; the gradient's own dtype for the
            subspace route), or ``"fp64"`` / ``"fp32"`` for every route (fp32 exact:
            about 2.5x faster on the CPU, bases equal to ~1e-5).
        optimizer: the inner optimizer, ``"adam"`` (:class:`ProjectedAdam`, the seed's
            Algorithm 1) or ``"sgd"`` (:class:`ProjectedSGD`, the seed's theory); config
            ``optim.name``.
    """

    rank: int = field(default=8, metadata={"config": "rank"})
    scale: float = field(default=1.0, metadata={"config": "optim.scale"})
    side: SideRule = "left"
    exclude: tuple[str, ...] = field(default=("head.",), metadata={"config": "params.exclude"})
    candidate_svd: Literal["auto", "exact", "randomized", "subspace"] = "auto"
    svd_oversample: int = 10
    svd_niter: int = 2
    svd_dtype: Literal["auto", "fp64", "fp32"] = "auto"
    optimizer: Literal["adam", "sgd"] = field(default="adam", metadata={"config": "optim.name"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"{type(self).__name__}: invalid optimizer={self.optimizer!r}")
        if self.rank < 1:
            raise ValueError(f"{type(self).__name__}: invalid rank={self.rank!r}")
        if self.scale <= 0:
            raise ValueError(f"{type(self).__name__}: invalid scale={self.scale!r}")
        if self.side not in ("left", "right", "auto"):
            raise ValueError(f"{type(self).__name__}: invalid side={self.side!r}")
        if self.svd_oversample < 0 or self.svd_niter < 0:
            raise ValueError(
                f"{type(self).__name__}: svd_oversample and svd_niter must be >= 0, got "
                f"{self.svd_oversample}, {self.svd_niter}"
            )
        if self.candidate_svd not in ("auto", "exact", "randomized", "subspace"):
            raise ValueError(f"{type(self).__name__}: invalid candidate_svd={self.candidate_svd!r}")
        if self.svd_dtype not in ("auto", "fp64", "fp32"):
            raise ValueError(f"{type(self).__name__}: invalid svd_dtype={self.svd_dtype!r}")

    def top_r(
        self,
        mat: torch.Tensor,
        rank: int,
        rng: torch.Generator,
        dtype: torch.dtype = torch.float32,
        warm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Client-side top-r left singular vectors of ``mat`` (``m x k``) with this method's SVD
        settings, ``m x r`` in ``dtype`` (the model's: bases follow the model's precision);
        ``warm`` (``m x r``, the current basis) starts the ``"subspace"`` route and is ignored
        by the others; ``"auto"`` picks the route for this matrix with
        :func:`~fedlore.optim.candidate_route.candidate_route`. Raises ValueError as
        :func:`~fedlore.optim.subspace.top_left_singular` does."""
        method: SvdMethod = (
            candidate_route(
                int(mat.shape[0]),
                int(mat.shape[1]),
                rank,
                self.svd_oversample,
                self.svd_niter,
                warm=warm is not None,
            )
            if self.candidate_svd == "auto"
            else self.candidate_svd
        )
        return top_left_singular(
            mat,
            rank,
            method,
            rng,
            self.svd_oversample,
            self.svd_niter,
            dtype=dtype,
            warm=warm,
            compute_dtype=SVD_DTYPES[self.svd_dtype],
        )

    def projected_optimizer(
        self,
        dense: list[nn.Parameter],
        projected: list[tuple[nn.Parameter, MatrixSpec, torch.Tensor]],
    ) -> ProjectedAdam:
        """A fresh local optimizer of :func:`train_projected`: :class:`ProjectedAdam`
        (``optimizer="adam"``) or :class:`ProjectedSGD` (``"sgd"``) with the run's lr, betas,
        eps, weight decay and this method's scale; a method with its own optimizer (FedSLoP)
        overrides this."""
        kind = ProjectedSGD if self.optimizer == "sgd" else ProjectedAdam
        return kind(
            dense,
            projected,
            lr=self.train.lr,
            betas=self.train.betas,
            eps=self.train.eps,
            weight_decay=self.train.weight_decay,
            scale=self.scale,
        )

    def projectable(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """The weight matrices this method may project, name -> shape: the weights of the
        Linear and Conv layers (:func:`~fedlore.optim.subspace.weight_matrices`); Bayesian
        FedLore's are its layers' mean (and scale) matrices."""
        return weight_matrices(model)

    def plan(self, model: nn.Module) -> dict[str, MatrixSpec]:
        """The projection plan of ``model`` (the rule of
        :func:`fedlore.optim.subspace.projection_plan` on :meth:`projectable`), without frozen
        matrices."""
        plan = plan_of(self.projectable(model), self.rank, self.side, self.exclude)
        return {k: s for k, s in plan.items() if not self.is_frozen(k)}

    def checked_plan(self, model: nn.Module) -> dict[str, MatrixSpec]:
        """:meth:`plan`, refusing a model with nothing to project (the method would silently be
        dense training of what is left).

        Raises:
            ValueError: naming the rank and the exclude / freeze settings.
        """
        plan = self.plan(model)
        if not plan:
            raise ValueError(
                f"{type(self).__name__}: no Linear/Conv weight to project at rank {self.rank} "
                f"(min(m, n) must exceed the rank; exclude={list(self.exclude)}, "
                f"freeze={list(self.train.freeze)})"
            )
        return plan

    def dense_keys(self, names: Iterable[str], projected: Container[str]) -> list[str]:
        """The ``names`` that train (and travel) densely: neither ``projected`` (plan keys) nor
        frozen."""
        return [k for k in names if k not in projected and not self.is_frozen(k)]


def plan_values(plan: dict[str, MatrixSpec]) -> dict[str, str]:
    """The plan as state values ``plan.<name> = side`` (shapes come from the model arrays)."""
    return {f"plan.{k}": s.side for k, s in plan.items()}


def plan_from_state(state: State, rank: int) -> dict[str, MatrixSpec]:
    """Rebuild the projection plan from ``plan.*`` values and ``model.*`` shapes of a state."""
    out = {}
    for key, side in state.values.items():
        if not key.startswith("plan."):
            continue
        name = key[5:]
        shape = tuple(state.arrays["model." + name].shape)
        out_dim, in_dim = shape[0], int(torch.Size(shape[1:]).numel())
        m, n = (out_dim, in_dim) if side == "left" else (in_dim, out_dim)
        out[name] = MatrixSpec(name, shape, "left" if side == "left" else "right", m, n, rank)
    return out


def apply_increment(
    weight: torch.Tensor, spec: MatrixSpec, basis: torch.Tensor, delta: torch.Tensor, decay: float
) -> torch.Tensor:
    """``a W + P Δ`` in the parameter's shape: the server update and the client's cache sync.

    Args:
        weight: the parameter (its own shape).
        spec: its projection spec.
        basis: ``m x r``.
        delta: aggregated coordinates ``r x n``.
        decay: a, the round's common decay factor (1.0 without weight decay).
    """
    view = spec.view(weight)
    return spec.unview(decay * view + basis.to(view.dtype) @ delta.to(view.dtype)).contiguous()


def add_increment(value: torch.Tensor, inc: torch.Tensor) -> torch.Tensor:
    """``D + ΔD`` in ``value``'s dtype (``inc`` upcast exactly): an unprojected tensor's update
    under a 16-bit transport, the same operation on the server and in every client cache."""
    return (value + inc.to(value.dtype)).contiguous()


def model_dtype(arrays: Arrays) -> torch.dtype:
    """The floating-point dtype of a model's tensors (the first floating one; float32 when
    none), which bases and coordinates follow."""
    return next((v.dtype for v in arrays.values() if v.is_floating_point()), torch.float32)


def model_device(arrays: Arrays) -> torch.device:
    """The device of a model's tensors (the CPU when there are none), where bases live."""
    return next((v.device for v in arrays.values()), torch.device("cpu"))


def seeded_bases(
    seed: int,
    plan: dict[str, MatrixSpec],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Arrays:
    """FedLore-Random's SharedBasis(seed): one random orthonormal basis per projected matrix,
    seeded by (round seed, position of the matrix in the plan), in ``dtype`` on ``device`` (the
    model's; the same basis on every device)."""
    return {
        k: random_basis(int(seed) * 1_000_003 + j, s.m, s.rank, dtype, device)
        for j, (k, s) in enumerate(plan.items())
    }


def sketch_omegas(
    seed: int,
    plan: dict[str, MatrixSpec],
    width: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Arrays:
    """FedLore-Sketch's test matrices of one round: per projected matrix (view ``m x n``) a
    Gaussian Ω (``n x width``, ``width = r + p``) seeded by ``derive_seed(seed, j)`` with ``j``
    the matrix's position in the plan and ``seed`` the round's sketch seed, in ``dtype`` on
    ``device`` (the model's; drawn on the CPU, so the same Ω on the server, every client and
    every device). See :func:`~fedlore.optim.subspace.gaussian_sketch`."""
    return {
        k: gaussian_sketch(derive_seed(int(seed), j), s.n, width, dtype, device)
        for j, (k, s) in enumerate(plan.items())
    }


def sketch_gradients(
    seed: int, plan: dict[str, MatrixSpec], grads: Arrays, like: Arrays, width: int
) -> Arrays:
    """A client's sketches ``Y = G Ω`` (``m x q``, ``q = width``) of its gradient views
    ``grads[k]`` (``m x n``; zeros for a missing or non-finite gradient), with Ω from ``seed``
    (:func:`~fedlore.algorithms.lowrank.sketch_omegas`), in the dtype and on the device of the
    model tensors ``like``: one ``m n q`` product per matrix, no client-side SVD."""
    dtype, device = model_dtype(like), model_device(like)
    omegas = sketch_omegas(seed, plan, width, dtype, device)
    out: Arrays = {}
    for k, s in plan.items():
        g = grads.get(k)
        if g is None or not all_finite([g]):
            ref = like[k]
            out[k] = torch.zeros(s.m, width, dtype=ref.dtype, device=ref.device)
        else:
            out[k] = (g.to(omegas[k].dtype) @ omegas[k]).contiguous()
    return out


def mean_sketch_basis(
    sketches: list[Arrays], weights: list[float], previous: Arrays, rank: int
) -> Arrays:
    """The sketch rule's server step: per matrix ``k``, P^{t+1} = top-r left singular vectors of
    the weighted mean sketch ``S = Σ p_i Y_i / Σ p_i`` (``sketches[i][k]``: ``m x q``; exact SVD
    in float64, :func:`~fedlore.optim.subspace.sketch_basis`); ``previous[k]`` (``m x r``, P^t)
    fills the directions a rank-deficient S lacks (all of them for an all-zero S).

    Returns: name -> ``m x r`` orthonormal basis in ``previous``'s dtype.

    Raises:
        ValueError: as :func:`~fedlore.tensors.weighted_mean` and
            :func:`~fedlore.optim.subspace.sketch_basis` do.
    """
    mean = weighted_mean(sketches, weights)
    return {k: sketch_basis(mean[k], rank, p) for k, p in previous.items()}


Runner = Callable[
    [
        nn.Module,
        Iterable[tuple[torch.Tensor, torch.Tensor]],
        ProjectedAdam,
        list[float],
        list[Callable[[nn.Module, int], None]],
    ],
    TrainStats,
]
"""How :func:`train_projected` runs its steps: ``(model, batches, optimizer, lrs, gradient
hooks) -> stats``."""


@dataclass(frozen=True)
class ProjectedResult:
    """Outcome of :func:`train_projected`.

    Attributes:
        stats: loss and skipped steps.
        coords: name -> Z (``r x n``), with ``W_K = a W_0 + P Z``.
        last_grads: name -> view (``m x n``) of the last finite gradient (absent if none).
        state_bytes: bytes of the optimizer's moment tensors.
        basis_bytes: bytes of the bases held by the optimizer.
        train_s: seconds of the K steps (the reply's ``train_s``, ``client_train_s`` in rows).
        opt_state: the optimizer's state at the end, by parameter name (``{"exp_avg": M,
            "exp_avg_sq": V, "step": k}`` for Adam, ``{"momentum_buffer": B}`` for momentum;
            only the parameters that stepped; empty unless asked for with ``keep_state``), for a
            method that keeps it across rounds.
        extra: further reply metrics of the round (Bayesian FedLore: ``kl`` and the searches'
            ``lr_chosen``, ``lr_searches``, ``lr_picks``).
    """

    stats: TrainStats
    coords: Arrays
    last_grads: Arrays
    state_bytes: int
    basis_bytes: int
    train_s: float = 0.0
    opt_state: dict[str, OptState] = field(default_factory=dict)
    extra: dict[str, float | int | str] = field(default_factory=dict)


def optimizer_arrays(opt_state: dict[str, OptState], prefix: str = "opt.") -> State:
    """Optimizer states by parameter name as a client :class:`~fedlore.types.State`: tensor
    ``<prefix><stat>.<name>`` (``opt.exp_avg_sq.fc1.weight``), int ``<prefix><stat>.<name>``
    in ``values`` (the step count)."""
    arrays: Arrays = {}
    values: dict[str, int] = {}
    for name, st in opt_state.items():
        for stat, v in st.items():
            if isinstance(v, torch.Tensor):
                arrays[f"{prefix}{stat}.{name}"] = v.detach().clone().contiguous()
            else:
                values[f"{prefix}{stat}.{name}"] = int(v)
    return State(arrays, dict(values))


def optimizer_from(state: State | None, prefix: str = "opt.") -> dict[str, OptState]:
    """Inverse of :func:`optimizer_arrays` (copies of the tensors: the state passed in is never
    changed); empty for None."""
    out: dict[str, OptState] = {}
    if state is None:
        return out
    flat: dict[str, torch.Tensor | int] = {
        **{k: v for k, v in state.values.items() if k.startswith(prefix) and isinstance(v, int)},
        **{k: v.clone() for k, v in state.arrays.items() if k.startswith(prefix)},
    }
    for key, v in flat.items():
        stat, _, name = key[len(prefix) :].partition(".")
        out.setdefault(name, {})[stat] = v
    return out


def train_projected(
    hyper: LowRankHyper,
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    plan: dict[str, MatrixSpec],
    bases: Arrays,
    lrs: list[float],
    keep_last_grad: bool = False,
    start: dict[str, OptState] | None = None,
    keep_state: bool = False,
    runner: Runner | None = None,
) -> ProjectedResult:
    """K steps of ``hyper.projected_optimizer`` (:class:`ProjectedAdam`, or
    :class:`ProjectedSGD` under ``optimizer="sgd"``) on ``batches`` (K = ``len(lrs)``):
    projected matrices in ``bases``, the rest dense AdamW (SGD).

    ``start`` (parameter name -> optimizer state, :class:`ProjectedResult`'s ``opt_state``
    form) is put into the fresh optimizer before the first step, so the moments continue from
    it (None or a missing name: from zero). Its tensors are used in place: pass copies. With
    ``keep_state`` the result's ``opt_state`` holds the optimizer's final state (the tensors
    themselves, not copies: the optimizer is gone); without, it is empty and the moments are
    freed when this returns.

    ``runner`` runs the K steps in place of :func:`~fedlore.train.local.local_train` (called as
    ``runner(model, batches, opt, lrs, hooks)``; the hooks keep the last gradient and must run
    after every real step): Bayesian FedLore's ELBO steps with a learning-rate search.
    """
    params = dict(model.named_parameters())
    projected = [(params[k], plan[k], bases[k]) for k in plan]
    dense = [p for k, p in params.items() if k not in plan and p.requires_grad]
    opt = hyper.projected_optimizer(dense, projected)
    for name, st in (start or {}).items():
        if name in params and params[name].requires_grad:
            opt.state[params[name]] = dict(st)
    last: Arrays = {}
    hooks: list[Callable[[nn.Module, int], None]] = []
    if keep_last_grad:

        def remember(_: nn.Module, __: int) -> None:
            for k, s in plan.items():
                g = params[k].grad
                if g is not None:
                    # a reference, not a copy: the next step's backward writes new gradient
                    # tensors (zero_grad(set_to_none=True)) and no step changes g in place
                    last[k] = s.view(g).detach()

        hooks.append(remember)
    t0 = time.perf_counter()
    if runner is None:
        stats = local_train(
            model, batches, opt, lrs, on_grad=hooks, grad_clip=hyper.train.grad_clip
        )
    else:
        stats = runner(model, batches, opt, lrs, hooks)
    train_s = time.perf_counter() - t0
    coords = {k: opt.coords[params[k]].detach().clone() for k in plan}
    final: dict[str, OptState] = {}
    if keep_state:
        final = {
            k: {
                stat: v.detach() if isinstance(v, torch.Tensor) else int(v)
                for stat, v in opt.state[p].items()
            }
            for k, p in params.items()
            if p in opt.state
        }
    return ProjectedResult(
        stats, coords, last, opt.state_bytes(), opt.basis_bytes(), train_s, opt_state=final
    )
