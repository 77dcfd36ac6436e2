"""HeteroFL's complexity levels on the server: the static batch norm query that respects each
client's capacity, and the evaluation of every level's sub-model
(:mod:`fedlore.algorithms.heterofl`, :mod:`fedlore.algorithms.heterofl_bn`).

**Which sub-models a client is queried with** (its rate: the one of the round it is queried
after, also under dynamic assignment). The query's *levels* are the full-width model
(rate 1: the global model that is always evaluated) and, with ``eval_levels``, every rate of
``rates``. A client of rate ``r_k`` is sent the sub-model of every queried level of rate
``<= r_k`` (its own width or narrower), each cut as a client of that level trains it in the
round (:meth:`~fedlore.algorithms.heterofl.HeteroFL.positions`), under ``sbn.<j>.<name>`` (j: the
level's index in ``rates``); a client below every queried level gets no query. It answers, per
sub-model, the per-channel counts, sums and sums of squares of its BatchNorms' inputs
(``stats.<j>.<norm>.count|sum|sumsq``, float64). So the statistics of level ``r`` pool the
data of the round's clients of rate ``>= r`` only: the full model's come from the largest
clients alone.

**A level nobody can run.** A model with BatchNorm needs rate 1 among the ``rates`` (refused at the
first query otherwise: the global model could not be evaluated). A round whose clients include none
of a queried level's rate or above keeps that level's earlier statistics (logged; ``sbn_clients`` /
``level_sbn_clients`` 0); when the level never had statistics (its first query), the run is refused
with a :class:`~fedlore.config.ConfigError` naming the level, since its evaluation would use
statistics of no data.

**Per-level evaluation** (:func:`level_models`): the sub-model a client of each level holds
after the round (its window of the last aggregated round under rolling extraction), with that
level's own running statistics, unscaled, as the evaluator scores it on the test set.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from fedlore.algorithms.heterofl_bn import (
    PARTS,
    QUERY,
    STATS,
    pooled,
    query_stats,
    route_shortcuts,
    static_bn,
    stats_problem,
)
from fedlore.algorithms.heterofl_plan import WidthPlan, extract, sub_model, width_plan
from fedlore.config import ConfigError
from fedlore.data.client_data import ClientData
from fedlore.settings import LocalTraining
from fedlore.tensors import load_model_arrays, select
from fedlore.types import Broadcast, Reply, State


class HasLevels(Protocol):
    """What this module reads of :class:`fedlore.algorithms.heterofl.HeteroFL` (a protocol:
    the method imports this module, so this module does not import it)."""

    @property
    def rates(self) -> tuple[float, ...]: ...
    @property
    def shares(self) -> tuple[int, ...]: ...
    @property
    def eval_levels(self) -> bool: ...
    @property
    def train(self) -> LocalTraining: ...
    def client_rate(self, state: State, client_id: int, rnd: int) -> float: ...
    def units(self, plan: WidthPlan, rnd: int, rate: float) -> list[torch.Tensor]: ...
    def positions(self, state: State, rnd: int, rate: float) -> dict[str, torch.Tensor | None]: ...


log = logging.getLogger(__name__)

SUB = "sbn."
"""Prefix of the query's arrays: ``sbn.<level>.<tensor>``, one sub-model per level sent."""
LEVEL_STATS = "levels."
"""Server state arrays of the levels below rate 1: ``levels.<j>.<norm>.running_mean|var``."""
ROUND = "heterofl.round"
"""Server state value (with ``eval_levels``): the last aggregated round (rolling windows)."""
SET = "heterofl.sbn."
"""Server state values ``heterofl.sbn.<j>``: the round of level j's latest statistics."""


def plan_of(state: State) -> WidthPlan:
    return WidthPlan.from_json(str(state.values["heterofl.plan"]))


def queried(algo: HasLevels, plan: WidthPlan) -> list[int]:
    """The levels (indices into ``rates``) whose statistics the query sets: none without
    BatchNorm; the full model's (rate 1); with ``eval_levels`` every level's."""
    if not plan.norms:
        return []
    return [j for j, r in enumerate(algo.rates) if algo.eval_levels or r == 1.0]


def check_full(algo: HasLevels, plan: WidthPlan) -> None:
    """Refuse a model with BatchNorm when no level can run the full-width model.

    Raises:
        ConfigError: one line naming the rates and what to do.
    """
    if plan.norms and 1.0 not in algo.rates:
        raise ConfigError(
            f"heterofl: the model has BatchNorm, whose full-width running statistics (static "
            f"batch norm) only clients of rate 1 can compute, and rates {list(algo.rates)} has "
            "none; add 1.0 to method.heterofl.rates"
        )


def init_levels(algo: HasLevels, model: nn.Module, plan: WidthPlan) -> dict[str, torch.Tensor]:
    """With ``eval_levels`` on a model with BatchNorm, every level below rate 1 starts with
    torch's initial running statistics (mean 0, variance 1) of its sub-model's widths."""
    out: dict[str, torch.Tensor] = {}
    for j in queried(algo, plan):
        if algo.rates[j] == 1.0:
            continue
        units = algo.units(plan, 0, algo.rates[j])
        for n in plan.norms:
            m = len(units[plan.dims[f"{n}.weight"][0][0]])
            ref = model.get_submodule(n).get_buffer("running_mean")
            out[f"{LEVEL_STATS}{j}.{n}.running_mean"] = torch.zeros(m, dtype=ref.dtype)
            out[f"{LEVEL_STATS}{j}.{n}.running_var"] = torch.ones(m, dtype=ref.dtype)
    return out


def level_arrays(algo: HasLevels, state: State, rnd: int, j: int) -> dict[str, torch.Tensor]:
    """Level j's sub-model of round ``rnd`` (the trained tensors a client of its rate holds)."""
    model = select(state.arrays, "model.")
    where = algo.positions(state, rnd, algo.rates[j])
    return {k: extract(model[k], pos) for k, pos in where.items()}


def query(algo: HasLevels, state: State, rnd: int, client_id: int) -> Broadcast | None:
    """The query to ``client_id``: the sub-model of every queried level its rate can run."""
    plan = plan_of(state)
    check_full(algo, plan)
    rate = algo.client_rate(state, client_id, rnd)
    levels = [j for j in queried(algo, plan) if algo.rates[j] <= rate]
    if not levels:
        return None
    arrays = {
        f"{SUB}{j}.{k}": v for j in levels for k, v in level_arrays(algo, state, rnd, j).items()
    }
    return Broadcast(arrays=arrays, config={"round": rnd, QUERY: True})


def answer(algo: HasLevels, msg: Broadcast, model: nn.Module, data: ClientData) -> Reply:
    """Client side: per level sent, the statistics of the client's training data through that
    sub-model (static BatchNorm, shortcuts routed as the global model's, no scaler)."""
    plan = width_plan(model)
    rnd = int(msg.config["round"])
    out: dict[str, torch.Tensor] = {}
    levels = sorted({int(k[len(SUB) :].split(".", 1)[0]) for k in msg.arrays})
    for j in levels:
        start = {k.split(".", 2)[2]: v for k, v in msg.arrays.items() if k.startswith(f"{SUB}{j}.")}
        sub = sub_model(model, {k: v.shape for k, v in start.items()})
        static_bn(sub)
        route_shortcuts(sub, plan, algo.units(plan, rnd, algo.rates[j]))
        load_model_arrays(sub, start)
        stats = query_stats(sub, plan.norms, data.train.x, algo.train.batch_size)
        out |= {f"{STATS}{j}.{k[len(STATS) :]}": v for k, v in stats.items()}
    return Reply(out, {"num_examples": data.num_examples})


def _split(reply: Reply, j: int) -> Reply:
    """Level j's part of a query reply, its keys as one level's (``stats.<norm>.<part>``)."""
    head = f"{STATS}{j}."
    return Reply({STATS + k[len(head) :]: v for k, v in reply.arrays.items() if k.startswith(head)})


def absorb(
    algo: HasLevels, state: State, replies: list[tuple[int, Reply | None]], rnd: int
) -> tuple[State, dict[str, object]]:
    """Server side: each queried level's running statistics pooled over the usable replies of
    the clients that could run it (a reply must hold exactly the levels its client was sent;
    one that does not, or whose statistics are unusable, is logged and left out). Metrics:
    ``sbn_clients`` (pooled into the full model); with ``eval_levels``, ``level_sbn_clients``
    (per level's rate)."""
    plan = plan_of(state)
    arrays, values = dict(state.arrays), dict(state.values)
    levels = queried(algo, plan)
    if not levels:
        return state, {}
    bad = {}  # a reply must hold the levels its client was sent, no more
    for cid, reply in replies:
        sent = {str(j) for j in levels if algo.rates[j] <= algo.client_rate(state, cid, rnd)}
        got = {k[len(STATS) :].split(".", 1)[0] for k in (reply.arrays if reply else ())}
        if reply is not None and got != sent:
            bad[cid] = f"levels {sorted(got)} in the reply, {sorted(sent)} sent"
    counts: dict[str, int] = {}
    for j in levels:
        rate = algo.rates[j]
        where = "model." if rate == 1.0 else f"{LEVEL_STATS}{j}."
        widths = {n: int(arrays[f"{where}{n}.running_mean"].numel()) for n in plan.norms}
        ok = []
        for cid, reply in replies:
            if algo.client_rate(state, cid, rnd) < rate:
                continue  # never sent this level
            part = None if reply is None else _split(reply, j)
            why = "no reply" if part is None else bad.get(cid) or stats_problem(part, plan, widths)
            if why is None and part is not None:
                ok.append(part)
            else:
                log.warning("round %d: sBN statistics of client %d left out: %s", rnd, cid, why)
        counts[str(rate)] = len(ok)
        if not ok and f"{SET}{j}" not in values:
            raise ConfigError(
                f"heterofl: round {rnd}: no client of the round could run (or answered for) "
                f"level rate {rate}, whose static batch norm statistics were never set, so it "
                "cannot be evaluated; sample every round's clients (participation: 1.0) or "
                "give that level (or a larger one) more clients (method.heterofl.shares)"
            )
        if not ok:
            log.warning("round %d: no client could run rate %s: its statistics stay", rnd, rate)
            continue
        values[f"{SET}{j}"] = rnd
        for n in plan.norms:
            mean, var = pooled(*[sum(r.arrays[f"{STATS}{n}.{p}"] for r in ok) for p in PARTS])  # type: ignore[arg-type]
            old = arrays[f"{where}{n}.running_mean"]
            arrays[f"{where}{n}.running_mean"] = mean.to(old.dtype).to(old.device)
            arrays[f"{where}{n}.running_var"] = var.to(old.dtype).to(old.device)
    full = [counts[str(algo.rates[j])] for j in levels if algo.rates[j] == 1.0]
    metrics: dict[str, object] = {"sbn_clients": full[0] if full else 0}
    if algo.eval_levels:
        metrics["level_sbn_clients"] = counts
    return State(arrays=arrays, values=values), metrics


def level_models(
    algo: HasLevels, state: State, model: nn.Module, num_clients: int
) -> list[tuple[float, nn.Module, dict[str, float]]]:
    """With ``eval_levels``: per level (largest rate first), (rate, its sub-model ready to
    evaluate, ``{"share", "clients", "params"}``): the level's configured share of the clients,
    how many of the ``num_clients`` have it (in the last aggregated round, under dynamic
    assignment), and its trained parameters. The sub-model is the
    one a client of the level holds after the last aggregated round, its BatchNorms with the
    level's running statistics; empty without ``eval_levels``."""
    if not algo.eval_levels:
        return []
    plan = plan_of(state)
    rnd = int(state.values.get(ROUND, 0))
    counts = algo.shares or (1,) * len(algo.rates)
    rates = [algo.client_rate(state, c, rnd) for c in range(num_clients)]
    out = []
    for j in sorted(range(len(algo.rates)), key=lambda i: -algo.rates[i]):
        rate = algo.rates[j]
        start = level_arrays(algo, state, rnd, j)
        sub = sub_model(model, {k: v.shape for k, v in start.items()})
        route_shortcuts(sub, plan, algo.units(plan, rnd, rate))
        where = "model." if rate == 1.0 else f"{LEVEL_STATS}{j}."
        for n in plan.norms:
            norm = sub.get_submodule(n)
            assert isinstance(norm, nn.modules.batchnorm._BatchNorm)
            norm.track_running_stats = True
            norm.running_mean = state.arrays[f"{where}{n}.running_mean"].clone()
            norm.running_var = state.arrays[f"{where}{n}.running_var"].clone()
            norm.num_batches_tracked = torch.zeros((), dtype=torch.long)
        load_model_arrays(sub, start, strict=False)
        sub.eval()
        info = {
            "share": counts[j] / sum(counts),
            "clients": float(sum(r == rate for r in rates)),
            "params": float(sum(v.numel() for v in start.values())),
        }
        out.append((rate, sub, info))
    return out
