"""HeteroFL (Diao, Ding, Tarokh, "HeteroFL: Computation and Communication Efficient Federated
Learning for Heterogeneous Clients", ICLR 2021), with FedRolex's rolling extraction (Alam, Liu,
Yan, Zhang, "FedRolex: Model-Heterogeneous Federated Learning with Rolling Sub-Model
Extraction", NeurIPS 2022) as an option.

Each client k has a capacity rate ``r_k`` (the paper's levels a-e: 1, 1/2, 1/4, 1/8, 1/16) and
trains a sub-model that keeps ``ceil(r_k · n)`` of the ``n`` units of every hidden layer (the
model's input and output dimensions whole), so its download, upload, optimizer state and
activations shrink by about ``r_k²`` for the hidden-to-hidden weights and ``r_k`` for the
first and last layers (:mod:`fedlore.algorithms.heterofl_plan`).

Round t:

* the server cuts client k's sub-model out of the global model ``W^t`` and sends it
  (``model.*`` of the sub-model's shapes) with ``r_k`` (``config["rate"]``);
* the client loads it into a sub-model (a copy of the model with smaller tensors), trains it
  with FedAvg's local steps (:meth:`~fedlore.algorithms.fedavg.FedFull.train_locally`: the
  run's optimizer, schedule, minibatches, clipping), HeteroFL's *scaler* dividing each hidden
  layer's output by ``r_k`` while training, and uploads ``update.* = W_k - W^t`` of the
  sub-model's shapes;
* the server averages every entry over the clients whose sub-model holds it,
  ``W^{t+1}[e] = W^t[e] + Σ_{k ∋ e} p_k Δ_k[e] / Σ_{k ∋ e} p_k`` (equal to the average of the
  held values ``W_k[e]``), with fedlore's weights ``p_k`` (``n_k``, or 1 under
  ``weighting: uniform``, the authors' code's plain count); an entry no client of the round
  holds keeps its value. With every rate 1 this is FedAvg, bit for bit (with BatchNorm: FedAvg's
  trained tensors bit for bit, the running statistics the pooled ones of the query).

Which units a sub-model holds (``extraction``): ``static``, the first ``ceil(r · n)`` of every
layer (HeteroFL: the small sub-models are nested in the large ones); ``rolling``, a window of
the same size starting at ``t mod n`` (FedRolex, ``roll_by: unit``) or ``t · m mod n``
(``roll_by: window``: the window moves by its own width, so a client of rate ``1/2^j`` has
trained every unit after ``2^j`` rounds), wrapping around, so every unit is trained by every
capacity level over the rounds.

Rates, ``assignment: fixed`` (the paper's ``fix`` mode, each client's level fixed over the rounds,
the levels in exact proportions): the clients come in blocks of ``S = Σ shares`` consecutive ids,
each block holding every rate ``shares`` times (``shares`` empty: once) in an order drawn from the
run's seed (a salt drawn in ``init_server`` from the server generator, kept in the server state)
and the block.
So a client's level depends only on the seed and its id (the same in every method and resume of
a seed, whatever the number of clients), and every full block has the levels in the proportions
of ``shares``: 10 clients at rates 1, 1/2, 1/4 are 3 + 3 + 3 and one drawn. ``assignment:
dynamic`` (the paper's ``dynamic`` mode): every round each client's level is drawn afresh, with
probabilities proportional to ``shares``, from the generator seeded with (salt, round, client), so
a run and its resumption draw the same levels; a client's level in a round is the one it trains,
uploads and is queried with (static batch norm) in that round. The rate reaches the client in the
broadcast's ``config["rate"]`` and the round's row as the per-client metric ``width_rate``.
``mask_labels``: the paper's masked cross-entropy for label-skewed data
(:mod:`fedlore.algorithms.heterofl_labels`; each client uploads its label set).

Supported models: ``mlp`` (with or without BatchNorm), ``cnn`` and the CIFAR ResNets
(``resnet20``/32/44/56 with BatchNorm: every conv and BatchNorm sliced along its stage's or block's
channels, the option-A shortcuts routed as in the global model). BatchNorm is the paper's *static
batch norm* (:mod:`fedlore.algorithms.heterofl_bn`): no running statistics in training; after
aggregation, on the rounds that evaluate, the server queries the round's clients for per-channel
sums of their data and sets the pooled mean and variance, each client queried only with the
sub-models its rate can run, so the full-width model's statistics come from the clients of rate 1
alone (:mod:`fedlore.algorithms.heterofl_levels`, counted in the round's bytes). ``eval_levels``
also evaluates every level's sub-model with statistics of its own. Refused with a one-line reason:
``resnet`` with ``norm: group``, ``vit``, ``text_encoder`` and ``llama`` (no width plan for
attention heads, embeddings, residual streams).
Not offered: ``params.freeze``, secure aggregation and DP (the uploads have per-client shapes),
16-bit transport, robust aggregation, the server optimizers, upload compression and FedBuff.

Bytes per round, client of rate r, for the 64-32-10 MLP on digits (2 410 parameters, fp32):
9 640 bytes each way at r = 1, 4 840 at 1/2, 2 440 at 1/4 (``tests/algorithms/test_heterofl.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from torch import nn

from fedlore.algorithms import heterofl_labels as labels
from fedlore.algorithms import heterofl_levels as levels
from fedlore.algorithms.base import ReplySpec
from fedlore.algorithms.fedavg import UNCOMPRESSED, FedAvg
from fedlore.algorithms.heterofl_bn import QUERY, route_shortcuts, static_bn
from fedlore.algorithms.heterofl_plan import (
    WidthPlan,
    add_scaler,
    extract,
    flat_index,
    sub_model,
    unit_index,
    width_plan,
)
from fedlore.data.client_data import ClientData
from fedlore.registry import register_algorithm
from fedlore.seeding import generator
from fedlore.tensors import load_model_arrays, model_arrays, select, with_prefix
from fedlore.types import Broadcast, Reply, Scalars, State

PLAN = "heterofl.plan"
"""Server state value: the model's :class:`~fedlore.algorithms.heterofl_plan.WidthPlan` (JSON)."""
SALT = "heterofl.salt"
"""Server state value: the seed salt of the clients' rate draws."""
DYNAMIC = 0x64796E
"""Seed part of the dynamic assignment's draws (apart from the fixed blocks' streams)."""
RATE = "width_rate"
"""Reply metric (recorded per client): the client's capacity rate r_k."""


@register_algorithm("heterofl")
@dataclass(frozen=True)
class HeteroFL(FedAvg):
    """HeteroFL (module docstring): width-heterogeneous sub-models of one global model.
    Hyperparameters beyond FedAvg's:

    Attributes:
        rates: the capacity levels r in (0, 1], distinct (default the paper's 1, 1/2, 1/4, 1/8,
            1/16); a sub-model of rate r keeps ``ceil(r · n)`` of the n units of every hidden
            layer.
        shares: how many clients of every ``Σ shares`` consecutive ids take each level (one
            integer >= 1 per rate; empty: one each), e.g. ``[3, 1]`` with rates ``[1, 0.25]``:
            three of every four clients at full width. Which ids of a block get which level is
            drawn from (the run's seed, the block).
        extraction: ``"static"`` (HeteroFL: the first units of every layer) or ``"rolling"``
            (FedRolex: a window that moves with the round, wrapping around).
        roll_by: how far the rolling window moves per round: ``"unit"`` (one unit, FedRolex)
            or ``"window"`` (its own width: a client of rate 1/2^j covers a layer in 2^j
            rounds); read only under ``extraction: rolling``.
        scaler: divide each hidden layer's output by r while training (the paper's scaler;
            off: the ablation without it).
        eval_levels: on the rounds that evaluate (and the last), also evaluate every level's
            sub-model (the slice its clients train, with its own static batch norm statistics)
            on the test set: the row's ``levels`` (:mod:`~fedlore.algorithms.heterofl_levels`).
        assignment: ``"fixed"`` (each client keeps the level of its block's draw) or
            ``"dynamic"`` (every round each client's level is drawn afresh, with probabilities
            proportional to ``shares``, from (the run's seed, the round, the client)).
        mask_labels: the masked cross-entropy of label-skewed data: each client's logits of the
            classes absent from its training data are masked out of its loss, and each row of
            the output layer is averaged over the clients whose data holds that class
            (:mod:`~fedlore.algorithms.heterofl_labels`; the client uploads its label set).
        mask_fill: what the absent classes' logits become under ``mask_labels``: ``"exclude"``
            (``-inf``: they leave the softmax, the loss is the cross-entropy over the client's
            classes) or ``"zero"`` (0, as the authors' code: they stay in the normaliser with
            weight ``exp(0)`` and get no gradient); read only with ``mask_labels``.
        local_optimizer: FedAvg's (``"sgd"``; ``"adamw"``), on the sub-model.
    """

    name: ClassVar[str] = "heterofl"
    capabilities = replace(
        FedAvg.capabilities,
        sum_aggregable=False,
        transport_16bit=False,
        robust_aggregate=False,
        server_optimizer=False,
        compress_uploads=False,
        individual_uploads=(
            "its uploads have per-client shapes (each client's sub-model), and its server "
            "divides each entry by the weight of the clients that hold it"
        ),
        synchronous_only=(
            "its server averages each entry over the clients of one round whose sub-models hold "
            "it, not a staleness-weighted mean of whole-model deltas"
        ),
    )
    not_applicable: ClassVar[dict[str, str]] = UNCOMPRESSED
    per_client_metrics: ClassVar[tuple[str, ...]] = (RATE,)
    read_only_with: ClassVar[dict[str, tuple[str, tuple[object, ...]]]] = {
        "roll_by": ("extraction", ("rolling",)),
        "mask_fill": ("mask_labels", (True,)),
    }
    rates: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 0.0625)
    shares: tuple[int, ...] = ()
    extraction: Literal["static", "rolling"] = "static"
    roll_by: Literal["unit", "window"] = "unit"
    scaler: bool = True
    eval_levels: bool = False
    assignment: Literal["fixed", "dynamic"] = "fixed"
    mask_labels: bool = False
    mask_fill: Literal["exclude", "zero"] = "exclude"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.rates or not all(0.0 < r <= 1.0 for r in self.rates):
            raise ValueError(
                f"heterofl: rates must be a non-empty list in (0, 1], got {self.rates!r}"
            )
        if len(set(self.rates)) != len(self.rates):
            raise ValueError(f"heterofl: rates must be distinct, got {self.rates!r}")
        if self.shares and (
            len(self.shares) != len(self.rates) or not all(s >= 1 for s in self.shares)
        ):
            raise ValueError(
                f"heterofl: shares must be empty or one integer >= 1 per rate "
                f"({len(self.rates)}), got {self.shares!r}"
            )
        if self.extraction not in ("static", "rolling"):
            raise ValueError(f"heterofl: invalid extraction={self.extraction!r}")
        if self.roll_by not in ("unit", "window"):
            raise ValueError(f"heterofl: invalid roll_by={self.roll_by!r}")
        if self.assignment not in ("fixed", "dynamic"):
            raise ValueError(f"heterofl: invalid assignment={self.assignment!r}")
        if self.mask_fill not in ("exclude", "zero"):
            raise ValueError(f"heterofl: invalid mask_fill={self.mask_fill!r}")
        if self.train.freeze:
            raise ValueError(
                f"heterofl: params.freeze={list(self.train.freeze)} is not implemented (every "
                "tensor of a sub-model trains); leave it empty"
            )

    # ------------------------------------------------------------------ rates and indices

    def rate_of(self, salt: int, client_id: int, rnd: int = 0) -> float:
        """Client ``client_id``'s capacity rate in round ``rnd``. Fixed: the clients come in
        blocks of ``S = Σ shares`` consecutive ids (``client_id // S``); a block holds each rate
        ``shares`` times, in an order drawn by the generator seeded with (``salt``, block), and
        the client takes its place's rate (``client_id mod S``); ``rnd`` is not read. Dynamic:
        one draw with probabilities ``shares / S`` from the generator seeded with (``salt``,
        ``rnd``, ``client_id``)."""
        counts = self.shares or (1,) * len(self.rates)
        if self.assignment == "dynamic":
            g = generator(salt, DYNAMIC, rnd, client_id)
            weights = torch.tensor(counts, dtype=torch.float64)
            return self.rates[int(torch.multinomial(weights, 1, generator=g))]
        block = [r for r, n in zip(self.rates, counts, strict=True) for _ in range(n)]
        order = torch.randperm(len(block), generator=generator(salt, client_id // len(block)))
        return block[int(order[client_id % len(block)])]

    def client_rate(self, state: State, client_id: int, rnd: int) -> float:
        """Client ``client_id``'s rate in round ``rnd`` (:meth:`rate_of` with the run's salt)."""
        return self.rate_of(int(state.values[SALT]), client_id, rnd)

    def units(self, plan: WidthPlan, rnd: int, rate: float) -> list[torch.Tensor]:
        """Per group of ``plan``, the global units a sub-model of ``rate`` holds in ``rnd``."""
        return [unit_index(n, rate, rnd, self.extraction, self.roll_by) for n in plan.widths]

    def positions(self, state: State, rnd: int, rate: float) -> dict[str, torch.Tensor | None]:
        """Per global tensor a client trains (every one but BatchNorm's running statistics),
        the flat positions of the sub-model's entries (None: all, in order) for a client of
        ``rate`` in round ``rnd``."""
        plan = WidthPlan.from_json(str(state.values[PLAN]))
        units = self.units(plan, rnd, rate)
        skip = plan.buffers()
        model = select(state.arrays, "model.")
        return {
            k: flat_index(v.shape, plan.dims[k], units) for k, v in model.items() if k not in skip
        }

    # ------------------------------------------------------------------ the protocol

    def init_server(self, model: nn.Module, rng: torch.Generator) -> State:
        """``W^0``, the model's width plan (refusing a model without one) and the rate salt."""
        plan = width_plan(model)
        salt = int(torch.randint(0, 2**31 - 1, (), generator=rng))
        arrays = with_prefix(model_arrays(model), "model.") | levels.init_levels(self, model, plan)
        return State(arrays=arrays, values={PLAN: plan.to_json(), SALT: salt})

    def broadcast(self, state: State, rnd: int, client_id: int) -> Broadcast:
        rate = self.client_rate(state, client_id, rnd)
        model = select(state.arrays, "model.")
        where = self.positions(state, rnd, rate)
        arrays = {"model." + k: extract(model[k], pos) for k, pos in where.items()}
        return Broadcast(arrays=arrays, config={"round": rnd, "rate": rate})

    def query(self, state: State, rnd: int, client_id: int) -> Broadcast | None:
        """The static batch norm's statistics query (:mod:`~fedlore.algorithms.heterofl_bn`),
        sent by the round loop after aggregation to the round's clients when the global model
        is evaluated: the sub-model of every queried level the client's rate can run
        (:func:`~fedlore.algorithms.heterofl_levels.query`); None for a model without
        BatchNorm or a client below every queried level (no query)."""
        return levels.query(self, state, rnd, client_id)

    def absorb_query(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, dict[str, object]]:
        """Each queried level's running statistics pooled from the replies of the clients
        that could run it (:func:`~fedlore.algorithms.heterofl_levels.absorb`)."""
        return levels.absorb(self, state, replies, rnd)

    def level_models(
        self, state: State, model: nn.Module, num_clients: int
    ) -> list[tuple[float, nn.Module, dict[str, float]]]:
        """With ``eval_levels``, every level's sub-model to evaluate, with its share, clients
        and parameters (:func:`~fedlore.algorithms.heterofl_levels.level_models`)."""
        return levels.level_models(self, state, model, num_clients)

    def client_update(
        self,
        msg: Broadcast,
        state: State | None,
        model: nn.Module,
        data: ClientData,
        rng: torch.Generator,
    ) -> tuple[Reply, State]:
        """Train the received sub-model (the scaler on below rate 1; BatchNorm static); upload
        its delta (and with ``mask_labels`` its label set, the absent classes' logits masked in
        training). A query message (:meth:`query`): the statistics of the client's data."""
        if msg.config.get(QUERY):
            return levels.answer(self, msg, model, data), State()
        start = select(msg.arrays, "model.")
        plan = width_plan(model)
        rate = float(msg.config["rate"])
        if rate != 1.0 or plan.norms:  # a copy: the full model is never trained twice
            model = self.client_model(model, plan, start, rate, int(msg.config["round"]))
        load_model_arrays(model, start)
        extra: dict[str, torch.Tensor] = {}
        hook = None
        if self.mask_labels:
            extra[labels.LABELS] = labels.label_set(data, start[labels.HEAD + ".bias"].numel())
            hook = labels.mask_logits(model, extra[labels.LABELS], self.mask_fill)
        try:
            reply, _ = self.train_locally(msg, start, model, data, rng, self.loss_terms(start))
        finally:
            if hook is not None:
                hook.remove()  # the full model may be the caller's own
        return Reply({**reply.arrays, **extra}, {**reply.metrics, RATE: rate}), State()

    def client_model(
        self,
        model: nn.Module,
        plan: WidthPlan,
        start: dict[str, torch.Tensor],
        rate: float,
        rnd: int,
    ) -> nn.Module:
        """The sub-model a client of ``rate`` trains in round ``rnd`` (not loaded yet): a copy
        of ``model`` of ``start``'s shapes, its BatchNorms static, its shortcuts routed as the
        global model's (:mod:`~fedlore.algorithms.heterofl_bn`) and, below rate 1, the scaler."""
        sub = sub_model(model, {k: v.shape for k, v in start.items()})
        static_bn(sub)
        route_shortcuts(sub, plan, self.units(plan, rnd, rate))
        if self.scaler and rate != 1.0:
            add_scaler(sub, plan, rate)
        return sub

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, Scalars]:
        """Each entry: ``W + Σ_{k ∋ e} p_k Δ_k / Σ_{k ∋ e} p_k`` over the accepted clients
        holding it (in float64, as FedAvg's mean); entries nobody holds keep their value. With
        ``mask_labels`` a client holds only the output layer's rows of its label set.
        Metrics: ``aggregated`` and ``covered`` (the share of the model's entries updated)."""
        ok = [(c, r) for c, r in replies if r is not None]
        values = dict(state.values)
        if self.eval_levels:  # the rolling windows the levels are evaluated in
            values[levels.ROUND] = rnd
        if not ok:
            return State(arrays=dict(state.arrays), values=values), {"aggregated": 0}
        weights = self.weights([r for _, r in ok])
        skip = WidthPlan.from_json(str(values[PLAN])).buffers()  # the running statistics stay
        model = {k: v for k, v in select(state.arrays, "model.").items() if k not in skip}
        wide = torch.float64
        num = {k: torch.zeros(v.numel(), dtype=wide, device=v.device) for k, v in model.items()}
        den = {k: torch.zeros(v.numel(), dtype=wide, device=v.device) for k, v in model.items()}
        for (c, r), w in zip(ok, weights, strict=True):
            where = self.positions(state, rnd, self.client_rate(state, c, rnd))
            delta = select(r.arrays, "update.")
            present = r.arrays[labels.LABELS] if self.mask_labels else None
            for k, v in model.items():
                pos = where[k]
                flat = (
                    torch.arange(v.numel(), device=v.device)
                    if pos is None
                    else pos.reshape(-1).to(v.device)
                )
                flat, d = labels.kept_rows(k, flat, delta[k], present)
                num[k].index_add_(0, flat, float(w) * d.to(wide))
                den[k].index_add_(0, flat, torch.full(flat.shape, float(w), dtype=wide))
        new, held, total = {}, 0, 0
        for k, v in model.items():
            has = den[k] > 0
            step = (num[k] / den[k]).reshape(v.shape).to(v.dtype)  # 0 / 0 where nobody holds
            new[k] = torch.where(has.reshape(v.shape), v + step, v)
            held += int(has.sum())
            total += v.numel()
        arrays = {**dict(state.arrays), **with_prefix(new, "model.")}
        return State(arrays=arrays, values=values), {"aggregated": len(ok), "covered": held / total}

    def expected_reply(self, state: State, rnd: int, client_id: int | None = None) -> ReplySpec:
        """``update.*`` of client ``client_id``'s sub-model shapes in round ``rnd``.

        Raises:
            ValueError: without ``client_id`` when the rates differ (the shapes depend on it).
        """
        if client_id is None:
            if len(self.rates) > 1:
                raise ValueError(
                    f"heterofl: clients of rates {list(self.rates)} reply with different shapes; "
                    "call expected_reply(state, rnd, client_id)"
                )
            rate = self.rates[0]
        else:
            rate = self.client_rate(state, client_id, rnd)
        where = self.positions(state, rnd, rate)
        model = select(state.arrays, "model.")
        spec: ReplySpec = {}
        for k, pos in where.items():
            v = model[k]
            spec["update." + k] = (tuple(v.shape if pos is None else pos.shape), v.dtype)
        if self.mask_labels:
            spec[labels.LABELS] = ((model[labels.HEAD + ".bias"].numel(),), torch.bool)
        return spec
