"""FedLore (seed Algorithm 1) and its variants FedLore-Random (Algorithm 4), FedLore with a fixed
basis (Table 4) and FedLore-Sketch (issue 20): the method's settings and its server round. How a
variant builds its basis is its rule (:mod:`fedlore.algorithms.basis_rules`), the client round is
:mod:`fedlore.algorithms.fedlore_client`, and client caches stay synchronized through
:mod:`fedlore.algorithms.sync`.

Seed (the FedLore paper). Per projected matrix W (view m x n, rank r),
round t:

* server -> client: the increments the client's cache lacks, ``(Δ^s, P^s)`` for rounds ``s``
  since the client last synced (under full participation just ``Δ^{t-1}``, r x n), or the dense
  model if that is cheaper (first contact, long absence, log exhausted); plus ``P^t`` (m x r)
  when the client does not hold it. Unprojected tensors travel densely.
* client: synchronize, K steps of projected Adam in ``P^t``, upload ``ΔZ_i`` and the rule's
  basis upload (the candidate ``P_i`` for FedLore).
* server (:meth:`FedLore.aggregate`): ``Δ^t = Σ p_i ΔZ_i`` (Algorithm 1 line 25 with the
  aggregation weights p_i); ``W^{t+1} = a_t W^t + P^t Δ^t`` (Proposition 8, ``a_t`` the round's
  common decay); ``P^{t+1}`` by the rule (line 27 for FedLore).

Partial participation: the sums run over the round's accepted replies, so ``P^{t+1}`` comes from
the active clients' uploads only (seed Appendix D notes that its certificate assumes full
participation; the diagnostics measure the residual either way). P^0: ``init_basis="gradient"``
(default) spends one setup exchange (round -1, counted in the byte totals); ``"random"`` takes a
seeded random orthonormal basis.

16-bit transport (``transport_dtype: fp16 | bf16``): everything that crosses the wire in a round
is an increment, a basis or a sketch, cast to the 16-bit dtype: ΔZ_i, the candidates (sketches)
and the deltas ``D_K - D^t`` of the unprojected tensors up; Δ^s, P^{t+1} and the unprojected
tensors' increments ``Σ p_i (D_i - D^t)`` (logged as ``log.<s>.<name>`` like Δ^s, instead of
their values ``dense.<name>``) down. The server quantizes them *before* it applies them (the
sync module's exactness rule), while W stays at the model's precision (an update smaller than
half a 16-bit ulp of a weight still accumulates); the full model, a value, and the diagnostic
uploads ``diag.H.*`` stay at the model's dtype. A quantized basis is orthonormal only up to the
16-bit rounding (about 1e-3 in bf16); both sides train and apply in that same basis.

``upload_increments`` (secure aggregation and DP; FedLore-Sketch, FedLore-Random and
FedLore-fixed with a random P^0 only, FedLore refuses it): the unprojected tensors travel as
increments exactly as under a 16-bit wire (:attr:`FedLore.dense_increments`), at the model's
dtype when the wire is fp32, so every upload is an increment or a linear sketch and the server
needs only the weighted sums.

A BatchNorm running variance (unprojected) that DP's noise or a server optimizer's step would
take below 0, where BatchNorm would score with NaN, is clamped at 0 as FedAvg's server clamps
it: in the value the server keeps and sends or, when the unprojected tensors travel as
increments, in the increment it logs and applies (:func:`~fedlore.tensors.nonnegative_increments`),
so a client that replays the log clamps too and its cache stays the server's model bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithm import Capabilities
from fedlore.algorithms.base import ReplySpec
from fedlore.algorithms.basis_rules import (
    RULES,
    BasisRule,
    CandidatesRule,
    RuleName,
    basis_overlap,
    candidate,
    keep_banks,
    kept_certificate,
)
from fedlore.algorithms.fedlore_client import FedLoreClient
from fedlore.algorithms.lowrank import (
    add_increment,
    apply_increment,
    model_dtype,
    plan_from_state,
    plan_values,
)
from fedlore.algorithms.sync import (
    FEDLORE_LOG,
    Frames,
    LogFormat,
    Offer,
    SyncState,
    cheaper,
    upcast,
)
from fedlore.optim.server import STEPS, ServerOpt, rotate_first_moments
from fedlore.optim.subspace import MatrixSpec
from fedlore.registry import register_algorithm
from fedlore.tensors import (
    from_wire,
    model_arrays,
    nbytes,
    nonnegative_increments,
    nonnegative_variances,
    select,
    to_wire,
    weighted_mean,
    with_prefix,
)
from fedlore.types import Arrays, Broadcast, Reply, Scalars, State


@register_algorithm("fedlore")
@dataclass(frozen=True)
class FedLore(FedLoreClient):
    """FedLore: a shared, refreshed low-rank basis per weight matrix (seed Algorithm 1).

    Attributes:
        init_basis: how P^0 is built, ``"gradient"`` (setup exchange) or ``"random"``.
        server_basis: ``"svd"`` of the m x Nr stack (exact), ``"randomized"`` (seeded range
            finder with the ``svd_*`` settings), or ``"gram"`` (eigh of the Nr x Nr Gram).
        log_rounds: rounds of increments the server keeps for catching up returning clients.
        diagnostics_every: the run's diagnostics period D (0: off). In the round before each
            measured round, FedLore's clients also upload their candidate gradient ``H_i``
            (``diag.H.*``, counted as ``diag_bytes_up``), from which the server keeps the terms
            of the Proposition 2 certificate (see :mod:`fedlore.diagnostics`).
    """

    name: ClassVar[str] = "fedlore"
    sync_log: ClassVar[LogFormat | None] = FEDLORE_LOG
    capabilities = replace(
        FedLoreClient.capabilities,
        synchronous_only=(
            "its clients train in the round's shared basis P^t, which a client that "
            "started from an older version no longer shares with the server"
        ),
        transport_16bit=True,
        individual_uploads=(
            "its P^{t+1} is the SVD of the stack [sqrt(p_1) P_1, ..., sqrt(p_N) P_N] of the "
            "clients' candidate bases, which needs each P_i on its own; use fedlore_sketch (its "
            "basis comes from the sum of the clients' gradient sketches)"
        ),
        projects="shared",
        server_optimizer=True,  # in the shared coordinates: FedLore.server_steps
    )
    basis_rule: ClassVar[RuleName] = "candidates"
    init_basis: Literal["gradient", "random"] = "gradient"
    server_basis: Literal["svd", "randomized", "gram"] = "svd"
    log_rounds: int = 8
    diagnostics_every: int = field(default=0, metadata={"config": "diagnostics.every"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init_basis not in ("gradient", "random"):
            raise ValueError(f"FedLore: invalid init_basis={self.init_basis!r}")
        if self.server_basis not in ("svd", "randomized", "gram"):
            raise ValueError(f"FedLore: invalid server_basis={self.server_basis!r}")
        if self.log_rounds < 1:
            raise ValueError(f"FedLore: invalid log_rounds={self.log_rounds!r}")
        self.round_decay(0)  # refuses local_epochs with weight decay (no common decay, Prop. 8)
        if self.diagnostics_every < 0:
            raise ValueError(f"FedLore: invalid diagnostics_every={self.diagnostics_every!r}")

    @property
    def rule(self) -> BasisRule:
        """This variant's basis rule (:data:`~fedlore.algorithms.basis_rules.RULES`)."""
        return RULES[self.basis_rule](self)

    def _uploads_candidates(self, rnd: int) -> bool:
        """Whether round ``rnd``'s clients upload candidate gradients for the next diagnostics."""
        d = self.diagnostics_every
        due = d > 0 and rnd >= 0 and (rnd + 1) % d == 0 and rnd + 1 < self.train.rounds
        return self.rule.certifies and due

    @property
    def dense_increments(self) -> bool:
        """Whether the unprojected tensors travel as increments (clients upload ``D_K - D^t``,
        the server applies ``Σ p_i (D_i - D^t) / Σ p_i`` and logs it as ``log.<t>.<name>``)
        rather than as values: under a 16-bit transport and under ``upload_increments``."""
        return self.wire_dtype is not None or self.train.upload_increments

    def caps(self) -> Capabilities:
        """``setup_rounds`` is 1 when P^0 comes from client gradients (a basis-only exchange
        before round 0), 0 otherwise (the basis rule says)."""
        return replace(super().caps(), setup_rounds=self.rule.setup_rounds())

    # ----------------------------------------------------------------- server
    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        self.check_freeze(model)
        plan = self.checked_plan(model)
        values: Scalars = {**plan_values(plan), "basis_id": -1}
        arrays = with_prefix(model_arrays(model), "model.")
        values["base_seed"] = int(torch.randint(0, 2**62, (1,), generator=rng))
        self.rule.init(arrays, values, plan)
        return State(arrays, values)

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        rule = self.rule
        model = select(state.arrays, "model.", strip=False)
        if rnd < 0:
            setup: Scalars = {"round": rnd, "mode": "dense", **rule.round_config(state, rnd)}
            return Broadcast(arrays=model, config=setup)
        cur = int(state.values["basis_id"])
        sync = SyncState.decode(state, FEDLORE_LOG)
        client = sync.client(client_id)
        held = -1 if client.held is None else client.held
        config: Scalars = {"round": rnd, "mode": "dense", "basis_id": cur}
        config.update(rule.round_config(state, rnd))
        if self._uploads_candidates(rnd):
            config["diag_upload"] = True
        replay = None
        if client.version is not None and sync.covers(client.version, rnd):
            server_model = select(state.arrays, "model.")
            plan_keys = {k[5:] for k in state.values if k.startswith("plan.")}
            dense_keys = [] if self.dense_increments else self.dense_keys(server_model, plan_keys)
            arrays = {"dense." + k: server_model[k] for k in dense_keys}  # else in the log
            frames = Frames("basis_id", held, cur, lambda bid: rule.bank_message(state, bid))
            logged, per_round = sync.replay(client.version, rnd, frames)
            arrays.update(logged)
            log_cfg: Scalars = {"mode": "log", "from_round": client.version, **per_round}
            replay = Offer(arrays, log_cfg, nbytes(arrays))
        dense = dict(model)
        if client.version is not None:  # the client holds a cache: frozen tensors stay there
            dense = {k: v for k, v in model.items() if not self.is_frozen(k[6:])}
        if held != cur:
            dense.update(rule.bank_message(state, cur))
        offer = cheaper(replay, Offer(dense, {"mode": "dense"}, nbytes(dense)), slack=1)
        config.update(offer.config)
        return Broadcast(arrays=offer.arrays, config=config)

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        wire, rule = self.wire_dtype, self.rule
        received = select(state.arrays, "model.")  # 16-bit uploads: upcast to the model's dtype
        ok = [
            (c, Reply(upcast(r.arrays, received), r.metrics)) for c, r in replies if r is not None
        ]
        replied = [r for _, r in ok]
        weights = self.weights(replied)
        plan = plan_from_state(state, self.rank)
        arrays = dict(state.arrays)
        values = dict(state.values)
        metrics: Scalars = {"aggregated": len(ok)}
        for flat in (arrays, values):
            for key in [k for k in flat if k.startswith("diag.")]:
                del flat[key]
        sync = SyncState.decode(state, FEDLORE_LOG)
        for c, r in replies:
            if r is None:
                sync.forget(c)
        if rnd < 0:  # setup exchange: P^0 from the clients' gradient candidates (or sketches)
            p0 = rule.setup_basis(replied, weights, plan, values, rnd, select(arrays, "model."))
            arrays.update(with_prefix(to_wire(p0, wire), "bank.0."))
            values["basis_id"] = 0
            for c, _ in ok:
                sync.acknowledge(c, 0, held=-1)
            sync.encode(arrays, values)
            return State(arrays, values), metrics
        cur = int(values["basis_id"])
        basis = rule.bank(state, cur, plan)
        decay = self.round_decay(rnd) if ok else 1.0
        model = select(arrays, "model.")
        if ok:
            deltas = weighted_mean([select(r.arrays, "update.") for _, r in ok], weights)
            dense = weighted_mean([select(r.arrays, "dense.") for _, r in ok], weights)
        else:
            deltas = {
                k: torch.zeros(s.rank, s.n, dtype=model[k].dtype, device=model[k].device)
                for k, s in plan.items()
            }
            dense = {}
        opt = self.server_opt()
        if ok and not opt.is_identity:  # the step in P^t's coordinates (fedlore.optim.server)
            deltas, dense = self.server_steps(arrays, values, model, deltas, dense, opt)
        deltas = to_wire(deltas, wire)  # Δ^t as the clients will receive it, then applied
        logged: Arrays = {}
        for k, s in plan.items():
            arrays["model." + k] = apply_increment(model[k], s, basis[k], deltas[k], decay)
            logged[k] = deltas[k]
        # a running variance the noise or a server step would take below 0 is clamped at 0:
        # in the value sent, or in the increment logged, so the replaying clients clamp too
        if not self.dense_increments:  # unprojected tensors: the mean of the uploaded values
            arrays.update(with_prefix(nonnegative_variances(dense), "model."))
        else:  # the mean of the uploaded increments (16-bit: quantized), logged and applied
            for k, inc in nonnegative_increments(model, to_wire(dense, wire)).items():
                arrays["model." + k] = add_increment(model[k], inc)
                logged[k] = inc
        sync.record(rnd, logged, decay=decay, basis_id=cur)
        for c, _ in ok:
            sync.acknowledge(c, rnd, held=cur)
        sync.trim(rnd + 1 - self.log_rounds)
        sync.encode(arrays, values)
        nxt, sent = rule.refresh(replied, weights, plan, values, rnd, (cur, basis))
        if sent is not None:
            arrays.update(with_prefix(sent, f"bank.{nxt}."))
            new = from_wire(sent, model_dtype(model))  # P^{t+1} as the clients will hold it
            arrays.update(rotate_first_moments(select(arrays, "sopt.", strip=False), basis, new))
            metrics["basis_overlap"] = basis_overlap(new, basis, plan)
            if self._uploads_candidates(rnd):
                CandidatesRule.certify(arrays, values, replied, weights, new, rnd)
        values["basis_id"] = nxt
        # keep the bases the log (or round t+1) uses
        keep_banks(arrays, {nxt} | {int(e.meta["basis_id"]) for e in sync.log.values()})
        return State(arrays, values), metrics

    def server_steps(
        self,
        arrays: Arrays,
        values: dict[str, Any],
        model: Arrays,
        deltas: Arrays,
        dense: Arrays,
        opt: ServerOpt,
    ) -> tuple[Arrays, Arrays]:
        """The server optimizer's steps (:mod:`fedlore.optim.server`) for the round's averaged
        coordinates Δ^t (``r x n`` each, moments in the same shared coordinates, so every client
        still applies exactly ``P^t Δ'^t`` and its cache stays the server's model) and for the
        unprojected tensors (their averaged increment, or the averaged uploaded value minus the
        model). Updates ``arrays`` (the moments ``sopt.*``) and ``values`` (``sopt.t``) in place.

        Returns:
            ``(Δ'^t, dense)``: the coordinates to apply and log, and the unprojected tensors in
            the form the round uses (increments, or values).
        """
        t = int(values.get(STEPS, 0)) + 1
        values[STEPS] = t
        prev = select(arrays, "sopt.", strip=False)
        flat = {**deltas}
        for k, v in dense.items():
            flat[k] = v if self.dense_increments else v - model[k]
        step, moments = opt.step(flat, prev, t)
        arrays.update(moments)
        coords = {k: step[k] for k in deltas}
        rest = {
            k: step[k] if self.dense_increments else (model[k] + step[k]).to(model[k].dtype)
            for k in dense
        }
        return coords, rest

    def diagnostic_candidates(self, state: State, rnd: int) -> dict[str, dict[str, Any]] | None:
        """Per matrix: the candidate terms of Proposition 2 for round ``rnd`` and ``hbar``, the
        weighted mean of the candidate gradients (None when the last round kept none)."""
        return kept_certificate(state, rnd)

    def diagnostic_bases(
        self, state: State, rnd: int, grads: Arrays | None, rng: torch.Generator
    ) -> Arrays:
        """The shared bases round ``rnd`` trains in (the same for every client)."""
        plan = plan_from_state(state, self.rank)
        return self.rule.bank(state, int(state.values["basis_id"]), plan)

    def global_arrays(self, state: State) -> dict[str, torch.Tensor]:
        return select(state.arrays, "model.")

    def expected_reply(self, state: State, rnd: int, client_id: int | None = None) -> ReplySpec:
        plan = plan_from_state(state, self.rank)
        model = select(state.arrays, "model.")
        spec: ReplySpec = {}
        w = self.wire_spec
        spec.update(self.rule.reply_spec(plan, model, rnd))
        if rnd < 0:
            return spec
        spec.update({f"update.{k}": ((s.rank, s.n), w(model[k].dtype)) for k, s in plan.items()})
        spec.update(
            {
                f"dense.{k}": (tuple(model[k].shape), w(model[k].dtype))
                for k in self.dense_keys(model, plan)
            }
        )
        if self._uploads_candidates(rnd):
            spec.update({f"diag.H.{k}": ((s.m, s.n), model[k].dtype) for k, s in plan.items()})
        return spec

    def _candidate(
        self,
        spec: MatrixSpec,
        grad: torch.Tensor | None,
        fallback: torch.Tensor | None,
        rng: torch.Generator,
        like: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A client's candidate (seed Algorithm 1 line 21),
        :func:`~fedlore.algorithms.basis_rules.candidate`."""
        return candidate(self, spec, grad, fallback, rng, like)


@register_algorithm("fedlore_random")
@dataclass(frozen=True)
class FedLoreRandom(FedLore):
    """FedLore-Random (seed Algorithm 4): the basis is rebuilt from a broadcast seed; no
    candidate upload. Bytes per matrix: rn up, rn down (+ a seed)."""

    name: ClassVar[str] = "fedlore_random"
    # ΔZ_i and the dense increments: weighted sums only
    capabilities = replace(FedLore.capabilities, sum_aggregable=True)
    basis_rule: ClassVar[RuleName] = "random"


@register_algorithm("fedlore_fixed")
@dataclass(frozen=True)
class FedLoreFixed(FedLore):
    """FedLore with P^t = P^0 for all rounds (seed Table 4, "w/o dynamic subspace"); the basis
    travels once per client.

    Sum-aggregable in its rounds (ΔZ_i and the dense increments). Its gradient P^0 averages
    the clients' candidate projectors (the setup exchange needs each P_i), so
    ``upload_increments`` (secure aggregation, DP) needs ``init_basis="random"``.
    """

    name: ClassVar[str] = "fedlore_fixed"
    capabilities = replace(FedLore.capabilities, sum_aggregable=True)
    basis_rule: ClassVar[RuleName] = "fixed"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.train.upload_increments and self.init_basis == "gradient":
            raise ValueError(
                "FedLoreFixed: invalid upload_increments=True with init_basis='gradient': its "
                "P^0 averages the clients' candidate projectors (the setup exchange needs each "
                "P_i on its own); set method.fedlore_fixed.init_basis: random"
            )


@register_algorithm("fedlore_sketch")
@dataclass(frozen=True)
class FedLoreSketch(FedLore):
    """FedLore-Sketch: the shared basis from the clients' summed gradient sketches (issue 20;
    the rule and its math: :class:`~fedlore.algorithms.basis_rules.SketchRule`).

    Client i uploads the sketch ``Y_i = G_i Ω^t`` (``m x q``, ``q = r + p``) of its last finite
    local gradient view, Ω^t from the broadcast ``sketch_seed``; the server takes ``P^{t+1}`` =
    the top-r left singular vectors of ``S = Σ p_i Y_i / Σ p_i``, the randomized range finder of
    the clients' *mean* gradient, where FedLore's projector averaging keeps what the clients' own
    top-r subspaces share, which can miss the mean gradient altogether (seed Proposition 4;
    ``tests/algorithms/test_fedlore_sketch.py`` runs that example). Every upload is aggregated
    linearly, so the method is :attr:`sum_aggregable` (secure aggregation, DP). Everything else
    (synchronization, partial participation, diagnostics without the Proposition 2 candidate
    certificate, 16-bit transport) is FedLore's. Bytes per matrix and round: ``r n + m q`` up
    (FedLore: ``r n + m r``), ``r n + m r`` down (as FedLore), plus a seed.

    Attributes:
        sketch_oversample: p >= 0, extra sketch columns beyond r (Halko et al.: 5..10).
    """

    name: ClassVar[str] = "fedlore_sketch"
    capabilities = replace(FedLore.capabilities, sum_aggregable=True)
    basis_rule: ClassVar[RuleName] = "sketch"
    sketch_oversample: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sketch_oversample < 0:
            raise ValueError(
                f"FedLoreSketch: invalid sketch_oversample={self.sketch_oversample!r} (p >= 0)"
            )

    @property
    def sketch_width(self) -> int:
        """q = r + p, the columns of Ω and of each sketch."""
        return self.rank + self.sketch_oversample
