"""FedLore (seed Algorithm 1), FedLore-Random (Algorithm 4), FedLore with a fixed basis and
FedLore-Sketch (issue 20: the basis from the clients' summed gradient sketches, see
:class:`FedLoreSketch`).

Per projected matrix W (view m x n, rank r), round t:

* server -> client: the increments the client's cache lacks, ``(Δ^s, P^s)`` for rounds
  ``s`` since the client last synced (under full participation just ``Δ^{t-1}``, r x n), or the
  dense model if that is cheaper (first contact, long absence, log exhausted); plus ``P^t``
  (m x r) when the client does not hold it. Unprojected tensors travel densely.
* client: ``cache <- a_s cache + P^s Δ^s`` for each missed round (Proposition 8), then K steps of
  :class:`~fedlore.optim.projected_adam.ProjectedAdam` in ``P^t`` (moments reset), uploading
  ``ΔZ_i`` (r x n, lr-weighted, so a schedule inside the round stays exact) and, for FedLore,
  the candidate ``P_i`` = top-r left singular vectors of its last finite local gradient (m x r;
  the current basis when no step had a finite gradient); for FedLore-Sketch instead the sketch
  ``Y_i = G_i Ω^t`` of that gradient (m x (r+p), Ω^t from a broadcast seed).
* server: ``Δ^t = Σ p_i ΔZ_i``; ``W^{t+1} = a_t W^t + P^t Δ^t``; ``P^{t+1}`` = top-r left
  singular vectors of ``[sqrt(p_1) P_1, ..., sqrt(p_N) P_N]`` (FedLore), ``SharedBasis(seed)``
  (FedLore-Random, only a seed travels), ``P^t`` again (fixed basis, the "w/o dynamic
  subspace" ablation of seed Table 4), or the top-r left singular vectors of the mean sketch
  ``Σ p_i Y_i / Σ p_i`` (FedLore-Sketch).

Partial participation: the sums above run over the round's accepted replies, so ``P^{t+1}``
comes from the active clients' candidates only (seed Appendix D notes that its certificate
assumes full participation; the diagnostics measure the residual either way).

P^0: ``init_basis="gradient"`` (default) spends one setup exchange (round -1, counted in the
byte totals) in which the sampled clients upload the top-r left singular vectors of one
construction-minibatch gradient at W^0 and the server averages their projectors as above;
``init_basis="random"`` takes a seeded random orthonormal basis. The server tracks each
client's cache round only from accepted replies; a client whose reply was lost or rejected gets
the dense model at its next contact.

16-bit transport (``transport_dtype: fp16 | bf16``): everything that crosses the wire in a round
is an increment, a basis or a sketch, cast to the 16-bit dtype: ΔZ_i, the candidates P_i
(sketches Y_i) and the deltas ``D_K - D^t`` of the unprojected tensors up; Δ^s, P^{t+1} and the
unprojected tensors' increments ``Σ p_i (D_i - D^t)`` (logged as ``log.<s>.<name>`` like Δ^s,
instead of their values ``dense.<name>``) down. The server quantizes Δ^t, the unprojected
increments and P^{t+1} *before* it applies them, ``W^{t+1} = a W^t + P^t Δ^t`` with exactly the
values it sends (:func:`~fedlore.algorithms.lowrank.apply_increment` on both sides, received
tensors upcast exactly to the model's dtype), so every client cache stays bit-identical to the
server model while the server keeps W at the model's precision (no weight is ever rounded to 16
bits, so an update smaller than half a 16-bit ulp of a weight still accumulates). The full model
(first contact, a client too long away) stays at the model's dtype: it is a value, and the
client's cache must equal the server model bit for bit. Diagnostic uploads (``diag.H.*``) stay
at the model's dtype (measurements, not the method). A quantized basis is orthonormal only up to
the 16-bit rounding (about 1e-3 in bf16); both sides train and apply in that same basis.

``upload_increments`` (secure aggregation and DP; FedLore-Sketch, FedLore-Random and
FedLore-fixed with a random P^0 only, FedLore refuses it): the unprojected tensors travel as
increments exactly as under a 16-bit wire (:attr:`FedLore.dense_increments`), at the model's
dtype when the wire is fp32, so every upload is an increment (ΔZ_i, ``D_K - D^t``) or a linear
sketch and the server needs only the weighted sums.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms.base import (
    ReplySpec,
    construction_gradients,
    local_eval_metrics,
    reply_metrics,
)
from fedlore.algorithms.lowrank import (
    LowRankHyper,
    apply_increment,
    model_device,
    model_dtype,
    plan_from_state,
    plan_values,
    seeded_bases,
    sketch_omegas,
    train_projected,
)
from fedlore.data.client_data import ClientData
from fedlore.diagnostics import CERTIFICATE_TERMS, candidate_certificate
from fedlore.optim.subspace import MatrixSpec, average_projectors, sketch_basis
from fedlore.registry import register_algorithm
from fedlore.seeding import BASIS, SKETCH, derive_seed, generator
from fedlore.tensors import (
    all_finite,
    from_wire,
    load_model_arrays,
    model_arrays,
    nbytes,
    select,
    to_wire,
    weighted_mean,
    with_prefix,
)
from fedlore.types import Arrays, Broadcast, Reply, Scalars, State

log = logging.getLogger(__name__)

BasisRule = Literal["candidates", "random", "fixed", "sketch"]
"""How P^{t+1} is built: from the clients' candidate bases (FedLore), a seed (FedLore-Random),
never (fixed), or from the clients' mean gradient sketch (FedLore-Sketch)."""


def add_increment(value: torch.Tensor, inc: torch.Tensor) -> torch.Tensor:
    """``D + ΔD`` in ``value``'s dtype (``inc`` upcast exactly): an unprojected tensor's update
    under a 16-bit transport, the same operation on the server and in every client cache."""
    return (value + inc.to(value.dtype)).contiguous()


def _upcast(reply: Reply, model: Arrays) -> Reply:
    """``reply`` with each ``<role>.<name>`` array upcast to the dtype of ``model[name]`` (the
    receiving side of a 16-bit transport; exact, and no copy when the dtypes already match)."""
    dtypes = {}
    for key in reply.arrays:
        name = key.split(".", 1)[-1]
        if name in model:
            dtypes[key] = model[name].dtype
    return Reply(from_wire(reply.arrays, dtypes), reply.metrics)


@register_algorithm("fedlore")
@dataclass(frozen=True)
class FedLore(LowRankHyper):
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
    honours_transport_dtype: ClassVar[bool] = True
    individual_uploads: ClassVar[str] = (
        "its P^{t+1} is the SVD of the stack [sqrt(p_1) P_1, ..., sqrt(p_N) P_N] of the "
        "clients' candidate bases, which needs each P_i on its own; use fedlore_sketch (its "
        "basis comes from the sum of the clients' gradient sketches)"
    )
    basis_rule: ClassVar[BasisRule] = "candidates"
    init_basis: Literal["gradient", "random"] = "gradient"
    server_basis: Literal["svd", "randomized", "gram"] = "svd"
    log_rounds: int = 8
    diagnostics_every: int = 0
    diagnostic_kind: ClassVar[Literal["shared", "client"]] = "shared"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init_basis not in ("gradient", "random"):
            raise ValueError(f"FedLore: invalid init_basis={self.init_basis!r}")
        if self.server_basis not in ("svd", "randomized", "gram"):
            raise ValueError(f"FedLore: invalid server_basis={self.server_basis!r}")
        if self.log_rounds < 1:
            raise ValueError(f"FedLore: invalid log_rounds={self.log_rounds!r}")
        if self.diagnostics_every < 0:
            raise ValueError(f"FedLore: invalid diagnostics_every={self.diagnostics_every!r}")

    def _uploads_candidates(self, rnd: int) -> bool:
        """Whether round ``rnd``'s clients upload candidate gradients for the next diagnostics."""
        d = self.diagnostics_every
        return (
            self.basis_rule == "candidates"
            and d > 0
            and rnd >= 0
            and (rnd + 1) % d == 0
            and rnd + 1 < self.rounds
        )

    @property
    def dense_increments(self) -> bool:
        """Whether the unprojected tensors travel as increments (clients upload ``D_K - D^t``,
        the server applies ``Σ p_i (D_i - D^t) / Σ p_i`` and logs it as ``log.<t>.<name>``)
        rather than as values: under a 16-bit transport and under ``upload_increments``."""
        return self.wire_dtype is not None or self.upload_increments

    @property
    def setup_rounds(self) -> int:
        """1 when P^0 comes from client gradients (a basis-only exchange before round 0)."""
        return int(self.basis_rule != "random" and self.init_basis == "gradient")

    # ----------------------------------------------------------------- server
    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        self.check_freeze(model)
        plan = self.checked_plan(model)
        values: Scalars = {**plan_values(plan), "basis_id": -1}
        arrays = with_prefix(model_arrays(model), "model.")
        base = int(torch.randint(0, 2**62, (1,), generator=rng))
        values["base_seed"] = base
        initial = select(arrays, "model.")
        dtype, device = model_dtype(initial), model_device(initial)
        if self.basis_rule == "random":
            values["basis_id"] = derive_seed(base, BASIS, 0)
        elif self.init_basis == "random":
            p0 = seeded_bases(derive_seed(base, BASIS, 0), plan, dtype, device)
            arrays.update(with_prefix(to_wire(p0, self.wire_dtype), "bank.0."))
            values["basis_id"] = 0
        return State(arrays, values)

    def _bank(self, state: State, bid: int, plan: dict[str, MatrixSpec]) -> Arrays:
        """The bases of basis ``bid`` in the model's dtype (banks hold them as sent)."""
        held_model = select(state.arrays, "model.")
        if self.basis_rule == "random":
            return seeded_bases(bid, plan, model_dtype(held_model), model_device(held_model))
        return from_wire(select(state.arrays, f"bank.{bid}."), model_dtype(held_model))

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        model = select(state.arrays, "model.", strip=False)
        if rnd < 0:
            setup: Scalars = {"round": rnd, "mode": "dense", **self._round_config(state, rnd)}
            return Broadcast(arrays=model, config=setup)
        vals = state.values
        cur = int(vals["basis_id"])
        plan_keys = {k[5:] for k in vals if k.startswith("plan.")}
        version = vals.get(f"version.{client_id}")
        held = int(vals.get(f"held.{client_id}", -1))
        config: Scalars = {"round": rnd, "mode": "dense", "basis_id": cur}
        config.update(self._round_config(state, rnd))
        if self._uploads_candidates(rnd):
            config["diag_upload"] = True
        dense_arrays = dict(model)
        dense_held = held
        options = []
        if version is not None and all(f"log.{s}.decay" in vals for s in range(int(version), rnd)):
            v = int(version)
            server_model = select(state.arrays, "model.")
            arrays = {  # dense increments: they travel in the log instead
                "dense." + k: server_model[k]
                for k in self.dense_keys(server_model, plan_keys)
                if not self.dense_increments
            }
            log_cfg: Scalars = {"mode": "log", "from_round": v}
            b = held
            for s in range(v, rnd):
                bid = int(vals[f"log.{s}.basis_id"])
                log_cfg[f"decay.{s}"] = vals[f"log.{s}.decay"]
                log_cfg[f"basis_id.{s}"] = bid
                if bid != b:
                    arrays.update(self._bank_message(state, bid))
                    b = bid
                arrays.update(select(state.arrays, f"log.{s}.", strip=False))
            if b != cur:
                arrays.update(self._bank_message(state, cur))
            options.append((nbytes(arrays), arrays, log_cfg))
        if version is not None:  # the client holds a cache: frozen tensors stay there
            dense_arrays = {k: v for k, v in model.items() if not self.is_frozen(k[6:])}
        if dense_held != cur:
            dense_arrays.update(self._bank_message(state, cur))
        options.append((nbytes(dense_arrays) + 1, dense_arrays, {"mode": "dense"}))
        _, arrays, extra = min(options, key=lambda o: o[0])
        config.update(extra)
        return Broadcast(arrays=arrays, config=config)

    def _round_config(self, state: State, rnd: int) -> Scalars:
        """Extra broadcast config of round ``rnd`` (FedLore-Sketch: the seed of Ω^rnd)."""
        return {}

    def _bank_message(self, state: State, bid: int) -> Arrays:
        if self.basis_rule == "random":
            return {}  # only the seed (the id, in config) travels
        return select(state.arrays, f"bank.{bid}.", strip=False)

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        wire = self.wire_dtype
        received = select(state.arrays, "model.")  # 16-bit uploads: upcast to the model's dtype
        ok = [(c, _upcast(r, received)) for c, r in replies if r is not None]
        weights = self.weights([r for _, r in ok])
        plan = plan_from_state(state, self.rank)
        arrays = dict(state.arrays)
        values = dict(state.values)
        metrics: Scalars = {"aggregated": len(ok)}
        for key in [k for k in arrays if k.startswith("diag.")]:
            del arrays[key]
        for key in [k for k in values if k.startswith("diag.")]:
            del values[key]
        for c, r in replies:
            if r is None:
                values.pop(f"version.{c}", None)
                values.pop(f"held.{c}", None)
        if rnd < 0:  # setup exchange: P^0 from the clients' gradient candidates (or sketches)
            held_model = select(arrays, "model.")
            seed = derive_seed(int(values["base_seed"]), BASIS, 0)
            random0 = seeded_bases(seed, plan, model_dtype(held_model), model_device(held_model))
            if ok:
                p0 = self._next_basis([r for _, r in ok], weights, plan, values, rnd, random0)
            else:  # nothing valid came back: fall back to a seeded random P^0 (logged)
                log.warning("FedLore setup exchange got no valid reply; P^0 is random")
                p0 = random0
            arrays.update(with_prefix(to_wire(p0, wire), "bank.0."))
            values["basis_id"] = 0
            for c, _ in ok:
                values[f"version.{c}"] = 0
                values[f"held.{c}"] = -1
            return State(arrays, values), metrics
        cur = int(values["basis_id"])
        basis = self._bank(state, cur, plan)
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
        deltas = to_wire(deltas, wire)  # Δ^t as the clients will receive it, then applied
        for k, s in plan.items():
            arrays["model." + k] = apply_increment(model[k], s, basis[k], deltas[k], decay)
            arrays[f"log.{rnd}.{k}"] = deltas[k]
        if not self.dense_increments:  # unprojected tensors: the mean of the uploaded values
            arrays.update(with_prefix(dense, "model."))
        else:  # the mean of the uploaded increments (16-bit: quantized), logged and applied
            for k, inc in to_wire(dense, wire).items():
                arrays["model." + k] = add_increment(model[k], inc)
                arrays[f"log.{rnd}.{k}"] = inc
        values[f"log.{rnd}.decay"] = decay
        values[f"log.{rnd}.basis_id"] = cur
        for c, _ in ok:
            values[f"version.{c}"] = rnd
            values[f"held.{c}"] = cur
        # next basis
        if self.basis_rule == "random":
            nxt = derive_seed(int(values["base_seed"]), BASIS, rnd + 1)
        elif self.basis_rule in ("candidates", "sketch") and ok:
            nxt = rnd + 1
            replied = [r for _, r in ok]
            sent = to_wire(self._next_basis(replied, weights, plan, values, rnd, basis), wire)
            arrays.update(with_prefix(sent, f"bank.{nxt}."))
            new = from_wire(sent, model_dtype(model))  # P^{t+1} as the clients will hold it
            metrics["basis_overlap"] = sum(
                float((new[k].double().t() @ basis[k].double()).pow(2).sum()) / s.rank
                for k, s in plan.items()
            ) / max(len(plan), 1)
            if self._uploads_candidates(rnd):
                self._keep_certificate(arrays, values, [r for _, r in ok], weights, new, rnd)
        else:
            nxt = cur
        values["basis_id"] = nxt
        self._trim(arrays, values, rnd)
        return State(arrays, values), metrics

    def _next_basis(
        self,
        replies: list[Reply],
        weights: list[float],
        plan: dict[str, MatrixSpec],
        values: Scalars,
        rnd: int,
        previous: Arrays,
    ) -> Arrays:
        """P^{t+1} from round ``rnd``'s accepted replies (``rnd = -1``: P^0): the leading
        eigenspace of the weighted mean of the candidates' projectors (seed Algorithm 1 line
        27). ``previous`` (P^t, or the seeded random P^0 of the setup exchange) is unused here;
        FedLore-Sketch keeps it for the directions a rank-deficient sketch lacks."""
        rng = generator(int(values["base_seed"]), BASIS, rnd, 1)  # randomized server SVD only
        return {
            k: average_projectors(
                [r.arrays["cand." + k] for r in replies],
                weights,
                s.rank,
                self.server_basis,
                generator=rng,
                oversample=self.svd_oversample,
                niter=self.svd_niter,
                dtype=replies[0].arrays["cand." + k].dtype,  # the model's (expected_reply)
            )
            for k, s in plan.items()
        }

    @staticmethod
    def _keep_certificate(
        arrays: Arrays,
        values: Scalars,
        replies: list[Reply],
        weights: list[float],
        new: Arrays,
        rnd: int,
    ) -> None:
        """Store the Proposition 2 terms of the candidates for the diagnostics of round
        ``rnd + 1`` (``diag.hbar.*`` arrays, ``diag.<term>.<matrix>`` values)."""
        for k in new:
            stats, hbar = candidate_certificate(
                [r.arrays["diag.H." + k] for r in replies],
                [r.arrays["cand." + k] for r in replies],
                weights,
                new[k],
            )
            arrays["diag.hbar." + k] = hbar
            for term, v in stats.items():
                values[f"diag.{term}.{k}"] = v
        values["diag.for_round"] = rnd + 1

    def diagnostic_candidates(self, state: State, rnd: int) -> dict[str, dict[str, Any]] | None:
        """Per matrix: the candidate terms of Proposition 2 for round ``rnd`` and ``hbar``, the
        weighted mean of the candidate gradients (None when the last round kept none)."""
        vals = state.values
        if vals.get("diag.for_round") != rnd:
            return None
        out: dict[str, dict[str, Any]] = {}
        for k, t in select(state.arrays, "diag.hbar.").items():
            out[k] = {term: vals[f"diag.{term}.{k}"] for term in CERTIFICATE_TERMS}
            out[k]["hbar"] = t
        return out

    def diagnostic_bases(
        self, state: State, rnd: int, grads: Arrays | None, rng: torch.Generator
    ) -> Arrays:
        """The shared bases round ``rnd`` trains in (the same for every client)."""
        plan = plan_from_state(state, self.rank)
        return self._bank(state, int(state.values["basis_id"]), plan)

    def _trim(self, arrays: Arrays, values: Scalars, rnd: int) -> None:
        """Keep ``log_rounds`` rounds of increments and the bases they (or round t+1) use."""
        oldest = rnd + 1 - self.log_rounds
        for key in [k for k in values if k.startswith("log.")]:
            if int(key.split(".")[1]) < oldest:
                del values[key]
        for key in [k for k in arrays if k.startswith("log.")]:
            if int(key.split(".")[1]) < oldest:
                del arrays[key]
        live = {int(values["basis_id"])} | {
            int(v) for k, v in values.items() if k.startswith("log.") and k.endswith(".basis_id")
        }
        for key in [k for k in arrays if k.startswith("bank.")]:
            if int(key.split(".")[1]) not in live:
                del arrays[key]

    def global_arrays(self, state: State) -> dict[str, torch.Tensor]:
        return select(state.arrays, "model.")

    def expected_reply(self, state: State, rnd: int, client_id: int | None = None) -> ReplySpec:
        plan = plan_from_state(state, self.rank)
        model = select(state.arrays, "model.")
        spec: ReplySpec = {}
        w = self.wire_spec
        spec.update(self._basis_reply_spec(plan, model, rnd))
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

    def _basis_reply_spec(self, plan: dict[str, MatrixSpec], model: Arrays, rnd: int) -> ReplySpec:
        """The reply arrays the next basis is built from: the candidates ``cand.*``
        (``m x r``) in FedLore's rounds and in every setup exchange."""
        if self.basis_rule != "candidates" and rnd >= 0:
            return {}
        w = self.wire_spec
        return {f"cand.{k}": ((s.m, s.rank), w(model[k].dtype)) for k, s in plan.items()}

    # ----------------------------------------------------------------- client
    def _client_bases(
        self, msg: Broadcast, bid: int, plan: dict[str, MatrixSpec], like: Arrays
    ) -> Arrays:
        """The bases of basis ``bid``: from the broadcast (upcast exactly to the dtype of the
        model tensors ``like``), or (FedLore-Random) rebuilt from the seed in the dtype and on
        the device of ``like``."""
        if self.basis_rule == "random":
            return seeded_bases(bid, plan, model_dtype(like), model_device(like))
        got = select(msg.arrays, f"bank.{bid}.")
        if set(got) != set(plan):
            raise KeyError(f"broadcast lacks basis {bid} for {sorted(set(plan) - set(got))[:3]}")
        return from_wire(got, model_dtype(like))

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        plan = self.plan(model)
        self.set_frozen(model)
        rnd = int(msg.config["round"])
        if rnd < 0:
            load_model_arrays(model, select(msg.arrays, "model."))
            grads = construction_gradients(model, data.train, self.batch_size, rng, list(plan))
            views = {k: plan[k].view(g) for k, g in grads.items()}
            held_model = model_arrays(model)
            new_state = State(
                arrays=with_prefix(held_model, "cache."), values={"version": 0, "held": -1}
            )
            up = self._basis_upload(msg, plan, views, None, rng, held_model)
            return Reply(up, reply_metrics(data.num_examples)), new_state
        cache, bases, held = self._synchronize(msg, state, plan, rnd, model)
        cur = int(msg.config["basis_id"])
        if cur != held:
            bases, held = self._client_bases(msg, cur, plan, cache), cur
        load_model_arrays(model, cache)
        lrs = self.round_lrs(rnd)
        res = train_projected(
            self,
            model,
            data.batches(self.batch_size, len(lrs), rng, rnd),
            plan,
            bases,
            lrs,
            keep_last_grad=self.basis_rule in ("candidates", "sketch"),
        )
        final = model_arrays(model)
        wire = self.wire_dtype
        out = with_prefix(to_wire(res.coords, wire), "update.")
        dense = {k: final[k] for k in self.dense_keys(final, plan)}
        if self.dense_increments:  # the unprojected tensors' increments D_K - D^t
            dense = {k: v - cache[k].to(v.dtype) for k, v in dense.items()}
        out.update(with_prefix(to_wire(dense, wire), "dense."))
        out.update(self._basis_upload(msg, plan, res.last_grads, bases, rng, final))
        if self.basis_rule == "candidates" and msg.config.get("diag_upload"):
            for k, s in plan.items():  # H_i for the diagnostics (zero when no finite gradient)
                h = res.last_grads.get(k)
                if h is None or not bool(torch.isfinite(h).all()):
                    h = torch.zeros(s.m, s.n, dtype=final[k].dtype, device=final[k].device)
                out[f"diag.H.{k}"] = h.contiguous()
        metrics = reply_metrics(
            data.num_examples,
            train_loss=res.stats.mean_loss,
            skipped_steps=res.stats.skipped_steps,
            optimizer_state_bytes=res.state_bytes,
            basis_bytes=res.basis_bytes,
            train_s=res.train_s,
            **local_eval_metrics(self, model, data, rnd),
        )
        new_state = State(
            arrays={**with_prefix(cache, "cache."), **with_prefix(bases, "basis.")},
            values={"version": rnd, "held": held},
        )
        return Reply(out, metrics), new_state

    def _basis_upload(
        self,
        msg: Broadcast,
        plan: dict[str, MatrixSpec],
        grads: Arrays,
        bases: Arrays | None,
        rng: torch.Generator,
        like: Arrays,
    ) -> Arrays:
        """What the client uploads for the next basis, as sent: FedLore's candidates
        ``cand.<k>`` (``m x r``, top-r left singular vectors of the gradient view ``grads[k]``;
        the current basis ``bases[k]`` when it is missing or not finite) in its rounds and in
        every setup exchange (``bases`` None), else nothing. ``like``: the model tensors whose
        dtype and device the candidates follow."""
        if self.basis_rule != "candidates" and int(msg.config["round"]) >= 0:
            return {}
        prev = bases or {}
        cands = {
            k: self._candidate(s, grads.get(k), prev.get(k), rng, like[k]) for k, s in plan.items()
        }
        return with_prefix(to_wire(cands, self.wire_dtype), "cand.")

    def _candidate(
        self,
        spec: MatrixSpec,
        grad: torch.Tensor | None,
        fallback: torch.Tensor | None,
        rng: torch.Generator,
        like: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Top-r left singular vectors of a gradient view, in the dtype and on the device of the
        model tensor ``like`` (else of ``grad``; bases follow the model); the fallback (current
        basis) if the gradient is missing or not finite; an all-zero gradient gives the standard
        basis."""
        ref = like if like is not None else grad if grad is not None else fallback
        dtype = ref.dtype if ref is not None else torch.float32
        device = ref.device if ref is not None else torch.device("cpu")
        if grad is None or not all_finite([grad]):  # a sum, not an m x n isfinite pass
            if fallback is None:
                return torch.eye(spec.m, spec.rank, dtype=dtype, device=device)
            return fallback.to(dtype).clone()
        return self.top_r(grad, spec.rank, rng, dtype, warm=fallback)

    def _synchronize(
        self,
        msg: Broadcast,
        state: State | None,
        plan: dict[str, MatrixSpec],
        rnd: int,
        model: nn.Module,
    ) -> tuple[Arrays, Arrays, int]:
        """Bring the cached global model to W^rnd; returns (cache, held bases, held basis id)."""
        held = int(state.values.get("held", -1)) if state is not None else -1
        bases = select(state.arrays, "basis.") if state is not None else {}
        if msg.config["mode"] == "dense":
            return self.fill_frozen(select(msg.arrays, "model."), state, model), bases, held
        if state is None:
            raise RuntimeError("client has no cached model but the server sent increments")
        own = int(state.values["version"])
        start = int(msg.config["from_round"])
        if own < start:
            raise RuntimeError(f"client cache is at round {own}; increments start at {start}")
        cache = select(state.arrays, "cache.")
        for s in range(own, rnd):
            bid = int(msg.config[f"basis_id.{s}"])
            if bid != held:
                bases, held = self._client_bases(msg, bid, plan, cache), bid
            decay = float(msg.config[f"decay.{s}"])
            for k, spec in plan.items():
                cache[k] = apply_increment(
                    cache[k], spec, bases[k], msg.arrays[f"log.{s}.{k}"], decay
                )
            for k, inc in select(msg.arrays, f"log.{s}.").items():
                if k not in plan:  # 16-bit transport: an unprojected tensor's increment
                    cache[k] = add_increment(cache[k], inc)
        cache.update(select(msg.arrays, "dense."))
        return cache, bases, held


@register_algorithm("fedlore_random")
@dataclass(frozen=True)
class FedLoreRandom(FedLore):
    """FedLore-Random (seed Algorithm 4): the basis is rebuilt from a broadcast seed; no
    candidate upload. Bytes per matrix: rn up, rn down (+ a seed)."""

    name: ClassVar[str] = "fedlore_random"
    honours_transport_dtype: ClassVar[bool] = True
    sum_aggregable: ClassVar[bool] = True  # ΔZ_i and the dense increments: weighted sums only
    basis_rule: ClassVar[BasisRule] = "random"


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
    honours_transport_dtype: ClassVar[bool] = True
    sum_aggregable: ClassVar[bool] = True
    basis_rule: ClassVar[BasisRule] = "fixed"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.upload_increments and self.init_basis == "gradient":
            raise ValueError(
                "FedLoreFixed: invalid upload_increments=True with init_basis='gradient': its "
                "P^0 averages the clients' candidate projectors (the setup exchange needs each "
                "P_i on its own); set method.fedlore_fixed.init_basis: random"
            )


@register_algorithm("fedlore_sketch")
@dataclass(frozen=True)
class FedLoreSketch(FedLore):
    """FedLore-Sketch: the shared basis from the clients' summed gradient sketches (issue 20).

    Per projected matrix (view ``m x n``, rank r) and round t, with oversampling p
    (``sketch_oversample``) and ``q = r + p``:

    * the server broadcasts only a seed, ``sketch_seed = derive_seed(base_seed, SKETCH, t)``
      (:mod:`fedlore.seeding`); server and clients build the same Gaussian test matrix Ω^t
      (``n x q``, :func:`~fedlore.algorithms.lowrank.sketch_omegas`, drawn by a seeded CPU
      generator, then cast to the model's dtype and moved to its device: bit-reproducible);
    * client i trains exactly as in FedLore (K projected-Adam steps in P^t, ΔZ_i up) and
      uploads the sketch ``sketch.<k>`` ``Y_i = G_i Ω^t`` (``m x q``) of its last finite local
      gradient view G_i (where FedLore takes its candidate; zeros when no step had a finite
      gradient): one ``m n q`` product per matrix, no client-side SVD;
    * the server forms ``S = Σ p_i Y_i / Σ p_i`` (:func:`~fedlore.tensors.weighted_mean`) and
      takes ``P^{t+1}`` = the top-r left singular vectors of S (exact SVD in float64 of the
      ``m x q`` matrix, cast to the model's dtype; :func:`~fedlore.optim.subspace.sketch_basis`).

    Since ``Σ p_i G_i Ω = (Σ p_i G_i) Ω``, S is the sketch of the clients' *mean* gradient, and
    P^{t+1} is the randomized range finder of the mean gradient (Halko, Martinsson & Tropp, SIAM
    Review 2011, Algorithm 4.1, with oversampling p = 5..10 as their §4.2 recommends; the exact
    SVD of the small sketch instead of its QR keeps the r leading directions). FedLore's
    projector averaging instead keeps what the clients' own top-r subspaces share, which can miss
    the mean gradient altogether (seed Proposition 4; ``tests/algorithms/
    test_fedlore_sketch.py`` runs that example). Every upload (ΔZ_i, Y_i and the dense tensors)
    is aggregated linearly, so the method is :attr:`sum_aggregable` (secure aggregation, DP).

    A rank-deficient S (e.g. all zero: no client had a finite gradient) keeps P^t for the
    directions it lacks, and an all-zero S keeps P^t entirely (see ``sketch_basis``). P^0:
    ``init_basis="gradient"`` (default) spends a sketch setup exchange (round -1: each client
    sketches one construction-minibatch gradient at W^0 with Ω^{-1}; the seeded random basis
    fills the directions a rank-deficient setup sketch lacks), ``"random"`` the seeded random
    basis. Synchronization, log catch-up, partial participation (S over the accepted replies),
    diagnostics (the shared basis; no Proposition 2 candidate certificate, which needs
    per-client candidates) and 16-bit transport (the sketches cross the wire in the 16-bit
    dtype like FedLore's candidates) are FedLore's.

    Bytes per matrix and round: ``r n + m q`` up (FedLore: ``r n + m r``), ``r n + m r`` down
    (as FedLore), plus a seed.

    Attributes:
        sketch_oversample: p >= 0, extra sketch columns beyond r.
    """

    name: ClassVar[str] = "fedlore_sketch"
    honours_transport_dtype: ClassVar[bool] = True
    sum_aggregable: ClassVar[bool] = True
    basis_rule: ClassVar[BasisRule] = "sketch"
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

    def _round_config(self, state: State, rnd: int) -> Scalars:
        return {"sketch_seed": derive_seed(int(state.values["base_seed"]), SKETCH, rnd)}

    def omegas(self, state: State, rnd: int) -> Arrays:
        """The server's Ω^rnd per projected matrix (``n x q``, the model's dtype and device),
        the same tensors every client builds from the broadcast ``sketch_seed``."""
        plan = plan_from_state(state, self.rank)
        model = select(state.arrays, "model.")
        seed = int(self._round_config(state, rnd)["sketch_seed"])
        return sketch_omegas(seed, plan, self.sketch_width, model_dtype(model), model_device(model))

    def basis_from_sketches(
        self, sketches: list[Arrays], weights: list[float], previous: Arrays
    ) -> Arrays:
        """The server rule: per matrix ``k``, P^{t+1} = top-r left singular vectors of the
        weighted mean sketch ``S = Σ p_i Y_i / Σ p_i`` (``sketches[i][k]``: ``m x q``);
        ``previous[k]`` (``m x r``, P^t) fills the directions a rank-deficient S lacks.

        Returns: name -> ``m x r`` orthonormal basis in ``previous``'s dtype.

        Raises:
            ValueError: as :func:`~fedlore.tensors.weighted_mean` and
                :func:`~fedlore.optim.subspace.sketch_basis` do.
        """
        mean = weighted_mean(sketches, weights)
        return {k: sketch_basis(mean[k], self.rank, p) for k, p in previous.items()}

    def _next_basis(
        self,
        replies: list[Reply],
        weights: list[float],
        plan: dict[str, MatrixSpec],
        values: Scalars,
        rnd: int,
        previous: Arrays,
    ) -> Arrays:
        sketches = [select(r.arrays, "sketch.") for r in replies]
        return self.basis_from_sketches(sketches, weights, {k: previous[k] for k in plan})

    def _basis_reply_spec(self, plan: dict[str, MatrixSpec], model: Arrays, rnd: int) -> ReplySpec:
        w, q = self.wire_spec, self.sketch_width
        return {f"sketch.{k}": ((s.m, q), w(model[k].dtype)) for k, s in plan.items()}

    def sketch_gradients(
        self, seed: int, plan: dict[str, MatrixSpec], grads: Arrays, like: Arrays
    ) -> Arrays:
        """A client's sketches ``Y = G Ω`` (``m x q``) of its gradient views ``grads[k]``
        (``m x n``; zeros for a missing or non-finite gradient), with Ω from ``seed``, in the
        dtype and on the device of the model tensors ``like``."""
        dtype, device = model_dtype(like), model_device(like)
        omegas = sketch_omegas(seed, plan, self.sketch_width, dtype, device)
        out: Arrays = {}
        for k, s in plan.items():
            g = grads.get(k)
            if g is None or not all_finite([g]):
                ref = like[k]
                out[k] = torch.zeros(s.m, self.sketch_width, dtype=ref.dtype, device=ref.device)
            else:
                out[k] = (g.to(omegas[k].dtype) @ omegas[k]).contiguous()
        return out

    def _basis_upload(
        self,
        msg: Broadcast,
        plan: dict[str, MatrixSpec],
        grads: Arrays,
        bases: Arrays | None,
        rng: torch.Generator,
        like: Arrays,
    ) -> Arrays:
        seed = int(msg.config["sketch_seed"])
        sketches = self.sketch_gradients(seed, plan, grads, like)
        return with_prefix(to_wire(sketches, self.wire_dtype), "sketch.")
