"""FedLore's basis rules: how the shared basis P^t starts, travels and is refreshed, one small
strategy per variant, chosen by name (:data:`RULES`, a FedLore class's ``basis_rule``).

Seed (the FedLore paper):

* ``"candidates"`` (FedLore, Algorithm 1): client i uploads its candidate ``P_i =
  TopLeftSVD_r(G_i^{t,K-1})`` of its last local gradient (line 21, :func:`candidate`); the server
  refreshes ``P^{t+1} = TopLeftSVD_r(B^t)``, ``B^t = [sqrt(p_1) P_1, ..., sqrt(p_N) P_N]``
  (line 27, its uniform ``1/sqrt(N)`` generalized to the aggregation weights p_i: the leading
  eigenspace of ``Σ p_i P_i P_i^T``, :func:`~fedlore.optim.subspace.average_projectors`). The
  same candidates give the Proposition 2 certificate of the diagnostics
  (:meth:`CandidatesRule.certify`, :func:`kept_certificate`).
* ``"random"`` (FedLore-Random, Algorithm 4): ``P^t = SharedBasis(seed_t)``,
  :func:`~fedlore.algorithms.lowrank.seeded_bases`; only the seed travels (as the basis id).
* ``"fixed"`` (Table 4, "w/o dynamic subspace"): ``P^t = P^0`` for every round.
* ``"sketch"`` (FedLore-Sketch, issue 20): client i uploads the sketch ``Y_i = G_i Ω^t``
  (``m x q``, ``q = r + p``) of its last finite local gradient view
  (:func:`~fedlore.algorithms.lowrank.sketch_gradients`, Ω^t from a broadcast seed); the server
  takes the top-r left singular vectors of the mean sketch ``S = Σ p_i Y_i / Σ p_i``
  (:func:`~fedlore.algorithms.lowrank.mean_sketch_basis`): the randomized range finder of the
  clients' mean gradient (Halko, Martinsson & Tropp, SIAM Review 2011, Algorithm 4.1), since
  ``Σ p_i G_i Ω = (Σ p_i G_i) Ω``.

P^0 (every rule but ``"random"``): with ``init_basis="gradient"`` one setup exchange (round -1) in
which the clients upload the rule's basis upload (candidates; sketches for ``"sketch"``) of one
construction-minibatch gradient at W^0, combined by the rule's server step; with ``"random"``
the seeded random basis. The server keeps bases by id (arrays ``bank.<id>.<name>``, as sent);
FedLore-Random keeps none (its id is the seed).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal, Protocol

import torch

from fedlore.algorithms.base import ReplySpec
from fedlore.algorithms.lowrank import (
    mean_sketch_basis,
    model_device,
    model_dtype,
    plan_from_state,
    seeded_bases,
    sketch_gradients,
    sketch_omegas,
)
from fedlore.diagnostics import CERTIFICATE_TERMS, candidate_certificate
from fedlore.optim.subspace import MatrixSpec, average_projectors
from fedlore.seeding import BASIS, SKETCH, derive_seed, generator
from fedlore.tensors import all_finite, from_wire, select, to_wire, with_prefix
from fedlore.types import Arrays, Broadcast, Reply, Scalars, State

log = logging.getLogger(__name__)

RuleName = Literal["candidates", "random", "fixed", "sketch"]
"""How P^{t+1} is built: from the clients' candidate bases (FedLore), a seed (FedLore-Random),
never (fixed), or from the clients' mean gradient sketch (FedLore-Sketch)."""


class RuleSettings(Protocol):
    """What a rule reads of its method's settings (a FedLore class; a protocol, so that this
    module does not import the method)."""

    @property
    def rank(self) -> int: ...
    @property
    def init_basis(self) -> Literal["gradient", "random"]: ...
    @property
    def server_basis(self) -> Literal["svd", "randomized", "gram"]: ...
    @property
    def svd_oversample(self) -> int: ...
    @property
    def svd_niter(self) -> int: ...
    @property
    def wire_dtype(self) -> torch.dtype | None: ...
    def wire_spec(self, dtype: torch.dtype) -> torch.dtype: ...
    def top_r(
        self,
        mat: torch.Tensor,
        rank: int,
        rng: torch.Generator,
        dtype: torch.dtype = torch.float32,
        warm: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class SketchSettings(RuleSettings, Protocol):
    """The sketch rule's settings: also ``q = r + p``."""

    @property
    def sketch_width(self) -> int: ...


class BasisRule:
    """The ``"fixed"`` rule, and every rule's defaults: P^0 from a setup exchange of candidates
    (or seeded), kept in the bank as sent, never refreshed.

    Attributes:
        hyper: the method's settings (rank, wire dtype, SVD settings, ``init_basis``).
    """

    name: ClassVar[RuleName] = "fixed"
    seeded: ClassVar[bool] = False
    """Whether bases are rebuilt from a seed (the basis id) instead of travelling."""
    refreshes: ClassVar[bool] = False
    """Whether P^{t+1} is built from the clients' uploads (they keep their last gradient)."""
    certifies: ClassVar[bool] = False
    """Whether the uploads are candidates that feed the Proposition 2 certificate."""

    def __init__(self, hyper: RuleSettings) -> None:
        self.hyper = hyper

    # ------------------------------------------------------------------ P^0 and the bank
    def setup_rounds(self) -> int:
        """1 when P^0 comes from client gradients (a basis-only exchange before round 0)."""
        return int(self.hyper.init_basis == "gradient")

    def init(self, arrays: Arrays, values: Scalars, plan: dict[str, MatrixSpec]) -> None:
        """P^0 without a setup exchange (``init_basis="random"``): the seeded random basis into
        bank 0, as sent (server arrays and values, in place)."""
        if self.hyper.init_basis != "random":
            return
        model = select(arrays, "model.")
        seed = derive_seed(int(values["base_seed"]), BASIS, 0)
        p0 = seeded_bases(seed, plan, model_dtype(model), model_device(model))
        arrays.update(with_prefix(to_wire(p0, self.hyper.wire_dtype), "bank.0."))
        values["basis_id"] = 0

    def setup_basis(
        self,
        replies: list[Reply],
        weights: list[float],
        plan: dict[str, MatrixSpec],
        values: Scalars,
        rnd: int,
        model: Arrays,
    ) -> Arrays:
        """P^0 from the setup exchange's accepted replies (:meth:`next_basis`, the seeded random
        basis standing for P^t), or the seeded random basis itself when none came back (logged).
        ``model``: the server's model tensors, whose dtype and device the bases follow."""
        seed = derive_seed(int(values["base_seed"]), BASIS, 0)
        random0 = seeded_bases(seed, plan, model_dtype(model), model_device(model))
        if not replies:
            log.warning("FedLore setup exchange got no valid reply; P^0 is random")
            return random0
        return self.next_basis(replies, weights, plan, values, rnd, random0)

    def bank(self, state: State, bid: int, plan: dict[str, MatrixSpec]) -> Arrays:
        """The server's bases of basis ``bid`` in the model's dtype (banks hold them as sent)."""
        return from_wire(select(state.arrays, f"bank.{bid}."), model_dtype(_model(state)))

    def bank_message(self, state: State, bid: int) -> Arrays:
        """What a client that lacks basis ``bid`` is sent (``bank.<bid>.*``)."""
        return select(state.arrays, f"bank.{bid}.", strip=False)

    def client_bases(
        self, msg: Broadcast, bid: int, plan: dict[str, MatrixSpec], like: Arrays
    ) -> Arrays:
        """A client's bases of basis ``bid`` from the broadcast, upcast exactly to the dtype of
        the model tensors ``like``.

        Raises:
            KeyError: when the broadcast lacks them.
        """
        got = select(msg.arrays, f"bank.{bid}.")
        if set(got) != set(plan):
            raise KeyError(f"broadcast lacks basis {bid} for {sorted(set(plan) - set(got))[:3]}")
        return from_wire(got, model_dtype(like))

    # ------------------------------------------------------------------ a round
    def round_config(self, state: State, rnd: int) -> Scalars:
        """Extra broadcast config of round ``rnd`` (the sketch rule: the seed of Ω^rnd)."""
        return {}

    def reply_spec(self, plan: dict[str, MatrixSpec], model: Arrays, rnd: int) -> ReplySpec:
        """The reply arrays the next basis is built from: candidates ``cand.*`` (``m x r``) in
        the setup exchange, nothing in the rounds."""
        return _candidate_spec(self.hyper, plan, model) if rnd < 0 else {}

    def upload(
        self,
        msg: Broadcast,
        plan: dict[str, MatrixSpec],
        grads: Arrays,
        bases: Arrays | None,
        rng: torch.Generator,
        like: Arrays,
    ) -> Arrays:
        """What a client uploads for the next basis, as sent (:meth:`reply_spec`'s arrays), from
        its gradient views ``grads`` (``m x n``), its current bases (None in the setup exchange)
        and ``like``, the model tensors whose dtype and device the uploads follow."""
        if int(msg.config["round"]) >= 0:
            return {}
        return _candidates(self.hyper, plan, grads, bases, rng, like)

    def next_basis(
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
        the sketch rule keeps it for the directions a rank-deficient sketch lacks."""
        hyper = self.hyper
        rng = generator(int(values["base_seed"]), BASIS, rnd, 1)  # randomized server SVD only
        return {
            k: average_projectors(
                [r.arrays["cand." + k] for r in replies],
                weights,
                s.rank,
                hyper.server_basis,
                generator=rng,
                oversample=hyper.svd_oversample,
                niter=hyper.svd_niter,
                dtype=replies[0].arrays["cand." + k].dtype,  # the model's (expected_reply)
            )
            for k, s in plan.items()
        }

    def refresh(
        self,
        replies: list[Reply],
        weights: list[float],
        plan: dict[str, MatrixSpec],
        values: Scalars,
        rnd: int,
        current: tuple[int, Arrays],
    ) -> tuple[int, Arrays | None]:
        """The id of P^{rnd+1} and, when it is a new basis to bank, its tensors as sent: a
        refreshing rule builds it from the accepted replies (:meth:`next_basis`; no reply keeps
        P^t), the others keep ``current`` (the id and bases of P^rnd)."""
        cur, basis = current
        if not self.refreshes or not replies:
            return cur, None
        new = self.next_basis(replies, weights, plan, values, rnd, basis)
        return rnd + 1, to_wire(new, self.hyper.wire_dtype)


class SeededRule(BasisRule):
    """FedLore-Random (seed Algorithm 4): ``P^t = SharedBasis(seed_t)`` with ``seed_t =
    derive_seed(base_seed, BASIS, t)``; the seed is the basis id and the only thing that
    travels; no setup exchange."""

    name: ClassVar[RuleName] = "random"
    seeded: ClassVar[bool] = True

    def setup_rounds(self) -> int:
        return 0

    def init(self, arrays: Arrays, values: Scalars, plan: dict[str, MatrixSpec]) -> None:
        values["basis_id"] = derive_seed(int(values["base_seed"]), BASIS, 0)

    def bank(self, state: State, bid: int, plan: dict[str, MatrixSpec]) -> Arrays:
        held = _model(state)
        return seeded_bases(bid, plan, model_dtype(held), model_device(held))

    def bank_message(self, state: State, bid: int) -> Arrays:
        return {}  # only the seed (the id, in config) travels

    def client_bases(
        self, msg: Broadcast, bid: int, plan: dict[str, MatrixSpec], like: Arrays
    ) -> Arrays:
        return seeded_bases(bid, plan, model_dtype(like), model_device(like))

    def refresh(
        self,
        replies: list[Reply],
        weights: list[float],
        plan: dict[str, MatrixSpec],
        values: Scalars,
        rnd: int,
        current: tuple[int, Arrays],
    ) -> tuple[int, Arrays | None]:
        return derive_seed(int(values["base_seed"]), BASIS, rnd + 1), None


class CandidatesRule(BasisRule):
    """FedLore (seed Algorithm 1): every client uploads its candidate each round, the server
    averages their projectors (:meth:`BasisRule.next_basis`)."""

    name: ClassVar[RuleName] = "candidates"
    refreshes: ClassVar[bool] = True
    certifies: ClassVar[bool] = True

    def reply_spec(self, plan: dict[str, MatrixSpec], model: Arrays, rnd: int) -> ReplySpec:
        return _candidate_spec(self.hyper, plan, model)

    def upload(
        self,
        msg: Broadcast,
        plan: dict[str, MatrixSpec],
        grads: Arrays,
        bases: Arrays | None,
        rng: torch.Generator,
        like: Arrays,
    ) -> Arrays:
        """The candidates ``cand.*`` and, when the broadcast asks (``diag_upload``), the
        candidate gradients ``diag.H.*`` (``m x n``, zero when no step had a finite gradient) at
        the model's dtype for the diagnostics."""
        out = _candidates(self.hyper, plan, grads, bases, rng, like)
        if msg.config.get("diag_upload"):
            for k, s in plan.items():
                h = grads.get(k)
                if h is None or not bool(torch.isfinite(h).all()):
                    h = torch.zeros(s.m, s.n, dtype=like[k].dtype, device=like[k].device)
                out[f"diag.H.{k}"] = h.contiguous()
        return out

    @staticmethod
    def certify(
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


class SketchRule(BasisRule):
    """FedLore-Sketch: the clients upload gradient sketches, the server takes the range of
    their weighted mean (module docstring; :class:`~fedlore.algorithms.fedlore.FedLoreSketch`).
    """

    name: ClassVar[RuleName] = "sketch"
    refreshes: ClassVar[bool] = True
    hyper: SketchSettings

    def round_config(self, state: State, rnd: int) -> Scalars:
        return {"sketch_seed": derive_seed(int(state.values["base_seed"]), SKETCH, rnd)}

    def omegas(self, state: State, rnd: int) -> Arrays:
        """The server's Ω^rnd per projected matrix (``n x q``, the model's dtype and device),
        the same tensors every client builds from the broadcast ``sketch_seed``."""
        plan = plan_from_state(state, self.hyper.rank)
        model = _model(state)
        seed = int(self.round_config(state, rnd)["sketch_seed"])
        width = self.hyper.sketch_width
        return sketch_omegas(seed, plan, width, model_dtype(model), model_device(model))

    def reply_spec(self, plan: dict[str, MatrixSpec], model: Arrays, rnd: int) -> ReplySpec:
        w, q = self.hyper.wire_spec, self.hyper.sketch_width
        return {f"sketch.{k}": ((s.m, q), w(model[k].dtype)) for k, s in plan.items()}

    def upload(
        self,
        msg: Broadcast,
        plan: dict[str, MatrixSpec],
        grads: Arrays,
        bases: Arrays | None,
        rng: torch.Generator,
        like: Arrays,
    ) -> Arrays:
        seed = int(msg.config["sketch_seed"])
        sketches = sketch_gradients(seed, plan, grads, like, self.hyper.sketch_width)
        return with_prefix(to_wire(sketches, self.hyper.wire_dtype), "sketch.")

    def next_basis(
        self,
        replies: list[Reply],
        weights: list[float],
        plan: dict[str, MatrixSpec],
        values: Scalars,
        rnd: int,
        previous: Arrays,
    ) -> Arrays:
        sketches = [select(r.arrays, "sketch.") for r in replies]
        return mean_sketch_basis(sketches, weights, {k: previous[k] for k in plan}, self.hyper.rank)


RULES: dict[str, type[BasisRule]] = {
    r.name: r for r in (CandidatesRule, SeededRule, BasisRule, SketchRule)
}
"""Rule name (a FedLore class's ``basis_rule``) -> its strategy."""


# ---------------------------------------------------------------------- the math
def candidate(
    hyper: RuleSettings,
    spec: MatrixSpec,
    grad: torch.Tensor | None,
    fallback: torch.Tensor | None,
    rng: torch.Generator,
    like: torch.Tensor | None = None,
) -> torch.Tensor:
    """A client's candidate (seed Algorithm 1 line 21): the top-r left singular vectors of a
    gradient view with ``hyper``'s SVD settings, in the dtype and on the device of the model
    tensor ``like`` (else of ``grad``; bases follow the model); the fallback (current basis) if
    the gradient is missing or not finite; an all-zero gradient gives the standard basis."""
    ref = like if like is not None else grad if grad is not None else fallback
    dtype = ref.dtype if ref is not None else torch.float32
    device = ref.device if ref is not None else torch.device("cpu")
    if grad is None or not all_finite([grad]):  # a sum, not an m x n isfinite pass
        if fallback is None:
            return torch.eye(spec.m, spec.rank, dtype=dtype, device=device)
        return fallback.to(dtype).clone()
    return hyper.top_r(grad, spec.rank, rng, dtype, warm=fallback)


def kept_certificate(state: State, rnd: int) -> dict[str, dict[str, Any]] | None:
    """Per matrix: the candidate terms of Proposition 2 for round ``rnd`` kept by
    :meth:`CandidatesRule.certify`, and ``hbar``, the weighted mean of the candidate gradients
    (None when the last round kept none)."""
    vals = state.values
    if vals.get("diag.for_round") != rnd:
        return None
    out: dict[str, dict[str, Any]] = {}
    for k, t in select(state.arrays, "diag.hbar.").items():
        out[k] = {term: vals[f"diag.{term}.{k}"] for term in CERTIFICATE_TERMS}
        out[k]["hbar"] = t
    return out


def basis_overlap(new: Arrays, old: Arrays, plan: dict[str, MatrixSpec]) -> float:
    """The mean over matrices of ``||P_new^T P_old||_F^2 / r`` (1: the same subspace, 0:
    orthogonal ones), the server's ``basis_overlap`` metric of a refresh."""
    return sum(
        float((new[k].double().t() @ old[k].double()).pow(2).sum()) / s.rank
        for k, s in plan.items()
    ) / max(len(plan), 1)


def keep_banks(arrays: Arrays, live: set[int]) -> None:
    """Drop the banked bases (``bank.<id>.*``) whose id is not in ``live`` (in place)."""
    for key in [k for k in arrays if k.startswith("bank.")]:
        if int(key.split(".")[1]) not in live:
            del arrays[key]


def _candidates(
    hyper: RuleSettings,
    plan: dict[str, MatrixSpec],
    grads: Arrays,
    bases: Arrays | None,
    rng: torch.Generator,
    like: Arrays,
) -> Arrays:
    """Every matrix's candidate (:func:`candidate`, warm-started from the current basis) as
    sent, ``cand.<k>``."""
    prev = bases or {}
    cands = {
        k: candidate(hyper, s, grads.get(k), prev.get(k), rng, like[k]) for k, s in plan.items()
    }
    return with_prefix(to_wire(cands, hyper.wire_dtype), "cand.")


def _candidate_spec(hyper: RuleSettings, plan: dict[str, MatrixSpec], model: Arrays) -> ReplySpec:
    w = hyper.wire_spec
    return {f"cand.{k}": ((s.m, s.rank), w(model[k].dtype)) for k, s in plan.items()}


def _model(state: State) -> Arrays:
    return select(state.arrays, "model.")
