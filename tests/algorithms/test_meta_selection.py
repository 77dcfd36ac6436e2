"""Meta-BayFL's learning-rate search as local training sees it (issue 28 item 5): the rate every
local step actually takes (read from the optimizer and measured from the parameters' step), and
how many searches a round makes, and when, for a client with a given n, batch size and
``local_steps`` (one before every pass over its training split, seed Algorithm 1 line 7)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import pytest
import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from fedlore.algorithms.bayes import MetaBayFL, elbo_kl_term
from fedlore.algorithms.meta_lr import batchable, meta_split, pick_lowest
from fedlore.bayes import sampling
from fedlore.data.client_data import ClientData, TensorSplit, minibatches
from fedlore.settings import LocalTraining
from fedlore.train.local import local_train


def _client(n: int) -> ClientData:
    """A client with ``n`` training examples of a linearly separable 2-class problem."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return ClientData(5, TensorSplit(x, y), TensorSplit(x[:4], y[:4]))


def _spying(events: list[tuple[Any, ...]]) -> type[MetaBayFL]:
    """MetaBayFL whose searches append ``("search", chosen rate, scores)`` to ``events``."""

    class Spy(MetaBayFL):
        def select_lr(self, *args: Any, **kwargs: Any) -> tuple[float, list[float]]:
            lr, scores = super().select_lr(*args, **kwargs)
            events.append(("search", lr, scores))
            return lr, scores

    return Spy


@contextmanager
def _recorded_steps(model: nn.Module, events: list[tuple[Any, ...]]) -> Iterator[None]:
    """Append every optimizer step taken meanwhile to ``events``: ``("trial",)`` for an optimizer
    over other parameters (a search's temporary copies), ``("local", group lr, measured rate,
    gradient norm)`` for the optimizer over ``model``'s own, the measured rate being
    ``-<Δw, g> / <g, g>`` of the step's parameter change Δw and gradient g (the rate itself for
    plain SGD: Δw = -lr g; g as the optimizer sees it, after any clipping)."""
    own = {id(p) for p in model.parameters()}
    before: dict[str, list[torch.Tensor]] = {}

    def params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in opt.param_groups for p in group["params"]]

    def pre(opt: torch.optim.Optimizer, *_: Any) -> None:
        ps = params(opt)
        if id(ps[0]) not in own:
            events.append(("trial",))
            return
        before["w"] = [p.detach().clone() for p in ps]
        before["g"] = [p.grad.detach().clone() for p in ps if p.grad is not None]

    def post(opt: torch.optim.Optimizer, *_: Any) -> None:
        ps = params(opt)
        if id(ps[0]) not in own:
            return
        delta = torch.cat(
            [(p.detach() - w).flatten() for p, w in zip(ps, before["w"], strict=True)]
        )
        grad = torch.cat([g.flatten() for g in before["g"]])
        rate = float(-(delta.double() @ grad.double()) / (grad.double() @ grad.double()))
        events.append(("local", opt.param_groups[0]["lr"], rate, float(grad.norm())))

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_each_epoch_trains_at_the_rate_its_search_chose(schedule: str) -> None:
    """Every local step of a pass over the training split moves the parameters by the rate
    that pass's search chose (times the schedule's factor ``lr_k / lr``), never by the base
    ``lr``: measured from the SGD step itself (Δw = -rate · g) and read from the optimizer.
    40 examples in batches of 10: 4 steps a pass, 20 steps, 5 searches; the candidates are set
    so that the searches do not all agree (the first pass picks a different rate)."""
    events: list[tuple[Any, ...]] = []
    algo = _spying(events).of(
        posterior="none",
        local_optimizer="sgd",
        lr=1e-3,
        # the trials run at the schedule's factors too (0.5 -> ~0 under cosine in this
        # round); with these candidates and this model the searches disagree either way
        candidate_lrs=(0.2, 2.0, 20.0),
        local_steps=20,
        batch_size=10,
        temp_steps=3,
        schedule=schedule,
        rounds=2,
        mc_samples=0,
    )
    torch.manual_seed(0)  # the model's initial weights, whatever ran before
    model = nn.Sequential(nn.Linear(4, 2))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    rnd = 1  # the second of two rounds: the cosine factor falls from 0.5 to ~0
    msg = algo.broadcast(state, rnd, 0)
    with _recorded_steps(model, events):
        reply, _ = algo.client_update(msg, None, model, _client(40), torch.Generator())
    picks = [e[1] for e in events if e[0] == "search"]
    local = [e for e in events if e[0] == "local"]
    assert len(picks) == 5 and len(local) == 20 and reply.metrics["skipped_steps"] == 0
    assert len(set(picks)) > 1 and algo.train.lr not in picks  # the test can tell the rates apart
    base = algo.round_lrs(rnd)
    for k, (_, group_lr, measured, _) in enumerate(local):
        want = picks[k // 4] * base[k] / algo.train.lr
        assert group_lr == pytest.approx(want, rel=1e-12), k
        # float32 rounding of a small step on grown weights: far below the 10x between rates
        assert measured == pytest.approx(want, rel=1e-2), k
    # the reply's lr_chosen is the most frequent choice (the first on a tie)
    assert reply.metrics["lr_chosen"] == statistics.mode(picks)


@pytest.mark.parametrize(
    ("n", "batch_size", "local_steps", "meta_split", "passes"),
    [
        (40, 10, 12, "subset", [4, 4, 4]),  # a pass is 4 steps: searches before steps 0, 4, 8
        (25, 10, 7, "subset", [3, 3, 1]),  # ceil(25 / 10) = 3 steps a pass (the last one short)
        (40, 8, 10, "heldout", [4, 4, 2]),  # d (8) held out: 32 to fit, 4 steps a pass
        (10, 16, 3, "subset", [1, 1, 1]),  # B > n: one step covers the split, a search each
        (40, 10, 3, "subset", [3]),  # the round ends inside the first pass: one search
    ],
)
def test_a_round_searches_before_every_pass_over_the_training_split(
    n: int, batch_size: int, local_steps: int, meta_split: str, passes: list[int]
) -> None:
    """``lr_search="per_epoch"`` runs one search (J candidates x ``temp_steps`` trial steps)
    before every ``ceil(n_fit / B)`` local steps, as many as the round starts passes, and
    reports that count; the exact order of trial and local optimizer steps is checked."""
    events: list[tuple[Any, ...]] = []
    algo = _spying(events).of(
        posterior="none",
        local_optimizer="sgd",
        candidate_lrs=(0.01, 0.1, 1.0),
        temp_steps=2,
        local_steps=local_steps,
        batch_size=batch_size,
        meta_split=meta_split,
        mc_samples=0,
    )
    model = nn.Sequential(nn.Linear(4, 2))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    with _recorded_steps(model, events):
        reply, _ = algo.client_update(
            algo.broadcast(state, 0, 0), None, model, _client(n), torch.Generator()
        )
    kinds = [e[0] for e in events]
    expect: list[str] = []
    for steps in passes:
        expect += ["trial"] * (3 * 2) + ["search"] + ["local"] * steps
    assert kinds == expect
    assert reply.metrics["lr_searches"] == len(passes)


@pytest.mark.parametrize(("lr_search", "searches"), [("per_round", 1), ("none", 0)])
def test_per_round_searches_once_and_none_never(lr_search: str, searches: int) -> None:
    """The comparators: ``per_round`` searches once, before the first of 12 steps (3 passes),
    ``none`` never searches and trains every step at the base rate (and refuses the search's
    settings, which it would not read)."""
    events: list[tuple[Any, ...]] = []
    search = {"candidate_lrs": (0.01, 0.1, 1.0), "temp_steps": 2} if searches else {}
    algo = _spying(events).of(
        posterior="none",
        local_optimizer="sgd",
        lr=0.05,
        local_steps=12,
        batch_size=10,
        lr_search=lr_search,
        mc_samples=0,
        **search,
    )
    model = nn.Sequential(nn.Linear(4, 2))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    with _recorded_steps(model, events):
        reply, _ = algo.client_update(
            algo.broadcast(state, 0, 0), None, model, _client(40), torch.Generator()
        )
    kinds = [e[0] for e in events]
    assert kinds == (["trial"] * 6 + ["search"]) * searches + ["local"] * 12
    rate = events[6][1] if searches else algo.train.lr
    assert all(e[1] == pytest.approx(rate) for e in events if e[0] == "local")
    assert reply.metrics.get("lr_searches", 0) == searches


def test_batched_trials_search_as_often_and_train_at_the_chosen_rate() -> None:
    """With ``trials="batched"`` (no trial optimizers: one vmap computation) the round still
    searches before every pass (40 examples, batches of 10, 10 steps: 3 searches) and each
    pass's SGD steps move the parameters by the rate its search chose."""
    events: list[tuple[Any, ...]] = []
    algo = _spying(events).of(
        posterior="none",
        local_optimizer="sgd",
        lr=1e-3,
        candidate_lrs=(0.1, 1.0, 10.0),
        temp_steps=3,
        local_steps=10,
        batch_size=10,
        trials="batched",
        mc_samples=0,
    )
    model = nn.Sequential(nn.Linear(4, 2))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    with _recorded_steps(model, events):
        algo.client_update(algo.broadcast(state, 0, 0), None, model, _client(40), torch.Generator())
    assert [e[0] for e in events] == (["search"] + ["local"] * 4) * 2 + ["search"] + ["local"] * 2
    rate = None
    for e in events:
        if e[0] == "search":
            rate = e[1]
        else:
            assert e[1] == rate and e[2] == pytest.approx(rate, rel=1e-2)


# ------------------------------------------------------------------------ batched trials
def _search_both_ways(
    fit: TensorSplit, meta: TensorSplit, hidden: int = 8, **hyper: Any
) -> dict[str, tuple[float, list[float]]]:
    """``select_lr`` with sequential and with batched trials from the same seeded MLP (after
    two local steps, so the trials continue the optimizer's state)."""
    out = {}
    n_out = meta.y.shape[1] if meta.y.is_floating_point() else 3
    for trials in ("sequential", "batched"):
        torch.manual_seed(1)
        model = nn.Sequential(
            nn.Linear(fit.x.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, n_out)
        )
        algo = MetaBayFL.of(batch_size=16, trials=trials, temp_steps=3, **hyper)
        algo.prepare_model(model)
        opt = algo.make_optimizer(model)
        terms = [elbo_kl_term(algo.beta_kl, len(fit))] if algo.posterior == "bnn" else []
        with sampling(model, True):
            pre = minibatches(fit, 16, 2, torch.Generator().manual_seed(3))
            local_train(model, pre, opt, [1e-3, 1e-3], loss_terms=terms)
            out[trials] = algo.select_lr(model, opt, fit, meta, terms, seed=7)
    return out


def _assert_same_search(out: dict[str, tuple[float, list[float]]]) -> None:
    """Both ways choose the same rate with the same scores (1e-4), and the candidates' scores
    differ (so the comparison means something)."""
    assert out["sequential"][0] == out["batched"][0]
    torch.testing.assert_close(
        torch.tensor(out["sequential"][1]), torch.tensor(out["batched"][1]), rtol=1e-4, atol=1e-6
    )
    assert len(set(out["sequential"][1])) == len(out["sequential"][1])  # the scores differ


def _splits(n_fit: int, n_meta: int, regression: bool) -> tuple[TensorSplit, TensorSplit]:
    """(fit, meta) of a seeded 5-feature problem: 3 classes, or a real 2-d linear target."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_fit + n_meta, 5, generator=g)
    y = x[:, :2] - 0.5 * x[:, 1:3] if regression else (x[:, 0] > 0).long() + (x[:, 1] > 1)
    return TensorSplit(x[:n_fit], y[:n_fit]), TensorSplit(x[n_fit:], y[n_fit:])


@pytest.mark.parametrize("posterior", ["bnn", "mcdropout", "none"])
@pytest.mark.parametrize("score", ["nll", "elbo"])
def test_batched_trials_equal_sequential_ones_on_a_regression_task(
    posterior: str, score: str
) -> None:
    """Real targets: the score is the NLL of the predictive mixture of N(f_s(x), I) (or the
    ELBO with the Gaussian likelihood); the batched trials give the sequential scores."""
    fit, meta = _splits(64, 24, regression=True)
    out = _search_both_ways(
        fit,
        meta,
        posterior=posterior,
        meta_score=score,
        mc_samples=3,
        candidate_lrs=(0.3, 0.03, 0.003),
    )
    _assert_same_search(out)


@pytest.mark.parametrize("mc_samples", [0, 1])
@pytest.mark.parametrize("regression", [False, True])
def test_batched_trials_follow_mc_samples_zero_and_one(mc_samples: int, regression: bool) -> None:
    """S = 0: one pass with sampling off (the posterior means); S = 1: one sampled pass. A BNN
    with wide posteriors (rho 0: sigma 0.69) tells the two apart; batched = sequential."""
    fit, meta = _splits(64, 24, regression)
    out = _search_both_ways(
        fit, meta, mc_samples=mc_samples, rho_init=0.0, candidate_lrs=(0.3, 0.03, 0.003)
    )
    _assert_same_search(out)
    other = _search_both_ways(
        fit, meta, mc_samples=1 - mc_samples, rho_init=0.0, candidate_lrs=(0.3, 0.03, 0.003)
    )
    assert out["batched"][1] != pytest.approx(other["batched"][1], rel=1e-3)


@pytest.mark.parametrize("score", ["nll", "elbo"])
def test_batched_trials_use_the_prior_and_draw_per_512_examples_as_sequential_ones(
    score: str,
) -> None:
    """A prior other than N(0, 1) (N(0.1, 0.5²): the KL of training and of the ELBO score),
    wide posteriors (sigma 0.69) and a meta split of 600 (two weight draws per pass: the
    first 512 examples, then the rest): batched = sequential."""
    fit, meta = _splits(64, 600, regression=False)
    out = _search_both_ways(
        fit,
        meta,
        meta_score=score,
        mc_samples=2,
        rho_init=0.0,
        prior_mu=0.1,
        prior_sigma=0.5,
        candidate_lrs=(0.3, 0.03, 0.003),
    )
    _assert_same_search(out)


def test_batchable_only_without_buffers_clip_or_momentum() -> None:
    """The batched trials need a model without buffers, no gradient clip and AdamW or SGD
    without momentum (in every group); otherwise select_lr runs them sequentially, with the
    sequential scores."""
    lin = nn.Linear(3, 2)
    plain = nn.Sequential(lin)
    adamw = torch.optim.AdamW(plain.parameters())
    assert batchable(plain, adamw, None)
    assert batchable(plain, torch.optim.SGD(plain.parameters(), lr=0.1), None)
    assert not batchable(plain, adamw, 1.0)
    assert not batchable(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), None)
    assert not batchable(plain, torch.optim.Adam(plain.parameters()), None)
    groups: list[dict[str, Any]] = [
        {"params": [lin.weight]},
        {"params": [lin.bias], "momentum": 0.5},
    ]
    two = torch.optim.SGD(groups, lr=0.1)
    assert not batchable(plain, two, None)
    normed = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    assert not batchable(normed, torch.optim.AdamW(normed.parameters()), None)


def test_batched_trials_with_decoupled_decay_a_large_eps_and_a_single_tensor() -> None:
    """AdamW's decoupled decay (λ = 0.1) and a large eps (0.01, so it shows in the step) enter
    the batched update as in torch's AdamW; a model with one trainable tensor (no bias) works
    too."""
    fit, meta = _splits(64, 24, regression=False)
    _assert_same_search(
        _search_both_ways(
            fit,
            meta,
            posterior="none",
            weight_decay=0.1,
            eps=1e-2,
            mc_samples=0,
            candidate_lrs=(0.3, 0.03, 0.003),
        )
    )
    out = {}
    for trials in ("sequential", "batched"):
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(5, 3, bias=False))
        algo = MetaBayFL(
            train=LocalTraining(mc_samples=0), posterior="none", trials=trials, temp_steps=3
        )
        out[trials] = algo.select_lr(model, algo.make_optimizer(model), fit, meta, [], seed=1)
    _assert_same_search(out)


@pytest.mark.parametrize("regression", [False, True])
def test_a_diverging_batched_trial_scores_nan_and_leaves_the_others_alone(
    regression: bool,
) -> None:
    """A candidate whose step turns non-finite (lr 1e36) stops and scores NaN; the other
    candidates keep their own (the sequential scores) and the search picks among them. The
    sequential trial of that rate, whose predictions are no longer finite, scores NaN too."""
    fit, meta = _splits(64, 24, regression)
    out = _search_both_ways(
        fit, meta, posterior="none", local_optimizer="sgd", mc_samples=0, candidate_lrs=(0.1, 1e36)
    )
    seq, bat = out["sequential"][1], out["batched"][1]
    assert math.isnan(bat[1]) and math.isnan(seq[1]) and bat[0] == pytest.approx(seq[0], rel=1e-5)
    assert out["batched"][0] == out["sequential"][0] == 0.1


def test_a_batched_trial_stops_at_its_first_non_finite_step() -> None:
    """One fit example is Inf and falls in the trials' first minibatch: every batched trial
    stops there and scores NaN, even though its later steps would be finite (the documented
    difference: a sequential trial skips the step and goes on); the search then returns the
    smallest candidate."""
    fit, meta = _splits(48, 24, regression=False)
    first = next(minibatches(fit, 16, 1, torch.Generator().manual_seed(7)))[0]
    row = int((fit.x == first[0]).all(1).nonzero()[0])
    fit.x[row, 0] = math.inf
    out = _search_both_ways(
        fit, meta, posterior="none", mc_samples=0, candidate_lrs=(0.3, 0.03, 0.003)
    )
    assert all(math.isnan(s) for s in out["batched"][1]) and out["batched"][0] == 0.003
    assert all(math.isfinite(s) for s in out["sequential"][1])


# ------------------------------------------------------------------------ the client's round
def _bnn_client(beta_kl: float, rng_seed: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    """One BNN client round (fixed rate, rho -1: sigma 0.31) -> (reply, its upload)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    algo = MetaBayFL(
        train=LocalTraining(local_steps=5, lr=0.05),
        lr_search="none",
        beta_kl=beta_kl,
        rho_init=-1.0,
    )
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    reply, _ = algo.client_update(
        algo.broadcast(state, 0, 0),
        None,
        model,
        _client(20),
        torch.Generator().manual_seed(rng_seed),
    )
    return reply, reply.arrays


def test_the_kl_term_is_part_of_a_bnn_clients_objective() -> None:
    """The local loss is NLL + beta_kl · KL / N: with beta_kl = 10 the posterior moves towards
    the prior (a smaller KL after the round) and the upload differs from beta_kl = 0."""
    with_kl, up_kl = _bnn_client(10.0)
    without, up = _bnn_client(0.0)
    assert with_kl.metrics["kl"] < without.metrics["kl"]
    assert any(not torch.equal(up_kl[k], up[k]) for k in up)


@pytest.mark.parametrize(("posterior", "stream"), [("none", False), ("bnn", True)])
def test_a_client_round_is_a_function_of_its_generator(posterior: str, stream: bool) -> None:
    """The searches (their trials' minibatches), the round's minibatches and a BNN's weight
    samples come from the client's generator (and the round, for a client that reads one
    stream), not the global RNG: two rounds with the same generator seed give the same search
    scores and the same upload, whatever the global RNG did meanwhile."""
    replies, searches = [], []
    for i in range(2):
        events: list[tuple[Any, ...]] = []
        algo = _spying(events).of(
            posterior=posterior, local_steps=8, batch_size=10, temp_steps=2, mc_samples=2
        )
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 2))
        torch.rand(1 + 5 * i)  # the global RNG moves on, by a different amount each time
        state = algo.init_server(model, torch.Generator().manual_seed(0))
        data = _client(40)
        data = dataclasses.replace(data, stream_seed=11) if stream else data
        reply, _ = algo.client_update(
            algo.broadcast(state, 1, 0), None, model, data, torch.Generator().manual_seed(5)
        )
        replies.append(reply)
        searches.append([e[2] for e in events])
    assert len(searches[0]) == 2 and searches[0] == searches[1]
    assert all(torch.equal(v, replies[1].arrays[k]) for k, v in replies[0].arrays.items())


def test_a_held_out_meta_split_needs_two_examples_and_keeps_one_to_fit() -> None:
    """Held out: 2 examples are enough (1 fits, 1 forms d) and the client searches; the cap
    keeps one example to fit whatever the fraction (n = 2 or 3 at fraction 0.9: d has 1 or
    2); the subset split has at least one example (n = 4 at 0.2: round(0.8) = 1)."""
    for n, n_meta in ((2, 1), (3, 2)):
        fit, d = meta_split(_client(n), 0.9, "heldout")
        assert (len(fit), len(d)) == (n - n_meta, n_meta)
    assert len(meta_split(_client(4), 0.2)[1]) == 1
    algo = MetaBayFL(
        train=LocalTraining(local_steps=2, mc_samples=0), posterior="none", meta_split="heldout"
    )
    model = nn.Sequential(nn.Linear(4, 2))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    reply, _ = algo.client_update(
        algo.broadcast(state, 0, 0), None, model, _client(2), torch.Generator()
    )
    assert reply.metrics["lr_searches"] == 2  # one pass of 1 example per step


def test_meta_split_refusals_say_what_is_missing() -> None:
    """No example: the search needs at least 1; held out with 1: it needs 2."""
    none = TensorSplit(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    empty = ClientData(3, none, _client(1).test)
    with pytest.raises(
        ValueError, match=r"has 0 training example\(s\); the learning-rate search needs at least 1$"
    ):
        meta_split(empty, 0.2)
    with pytest.raises(
        ValueError, match=r"held-out meta split needs at least 2 \(one to fit, one for d\)$"
    ):
        meta_split(_client(1), 0.2, "heldout")


def test_a_clients_meta_split_is_the_same_as_in_earlier_versions() -> None:
    """The permutation that forms d is seeded from the client id alone (salt · 1000003 + id),
    so a rerun of an old configuration ranks the rates on the same examples: client 3's d of
    10 examples at 0.3 is examples 1, 9 and 6."""
    x = torch.arange(10, dtype=torch.float32).unsqueeze(1)
    data = ClientData(3, TensorSplit(x, torch.zeros(10, dtype=torch.long)), _client(1).test)
    assert meta_split(data, 0.3)[1].x[:, 0].tolist() == [1.0, 9.0, 6.0]
    assert sorted(meta_split(data, 0.3, "heldout")[0].x[:, 0].tolist()) == [0, 2, 3, 4, 5, 7, 8]


def _scripted(rates: list[float]) -> type[MetaBayFL]:
    """MetaBayFL whose searches return ``rates`` in turn (no trials)."""
    left = list(rates)

    class Scripted(MetaBayFL):
        def select_lr(self, *args: Any, **kwargs: Any) -> tuple[float, list[float]]:
            return left.pop(0), []

    return Scripted


def test_lr_chosen_is_the_most_frequent_choice_the_earliest_on_a_tie() -> None:
    """Choices 0.01, 0.1, 1, 1, 0.1 over five passes: 0.1 and 1 tie at two, 0.1 came first;
    each pass trains at its own choice."""
    rates = [0.01, 0.1, 1.0, 1.0, 0.1]
    algo = _scripted(rates).of(
        posterior="none", local_optimizer="sgd", local_steps=20, batch_size=10, mc_samples=0
    )
    model = nn.Sequential(nn.Linear(4, 2))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    events: list[tuple[Any, ...]] = []
    with _recorded_steps(model, events):
        reply, _ = algo.client_update(
            algo.broadcast(state, 0, 0), None, model, _client(40), torch.Generator()
        )
    assert reply.metrics["lr_chosen"] == 0.1 and reply.metrics["lr_searches"] == 5
    assert [e[1] for e in events] == [r for r in rates for _ in range(4)]


def test_a_frozen_tensor_left_out_by_the_server_comes_from_the_clients_cache() -> None:
    """With ``freeze``, the client keeps the frozen tensors of the first round it sees and
    fills them in when a later broadcast leaves them out."""
    algo = MetaBayFL(
        train=LocalTraining(freeze=("0.bias",), local_steps=2), posterior="none", lr_search="none"
    )
    lin = nn.Linear(4, 2)
    model = nn.Sequential(lin)
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    msg = algo.broadcast(state, 0, 0)
    _, keep = algo.client_update(msg, None, model, _client(20), torch.Generator())
    assert torch.equal(keep.arrays["cache.0.bias"], msg.arrays["model.0.bias"])
    later = dataclasses.replace(
        msg, arrays={k: v for k, v in msg.arrays.items() if k != "model.0.bias"}
    )
    lin.bias.data.fill_(7.0)  # whatever the client's model holds is overwritten
    reply, _ = algo.client_update(later, keep, model, _client(20), torch.Generator())
    assert torch.equal(lin.bias, msg.arrays["model.0.bias"])
    assert "update.0.bias" not in reply.arrays and "update.0.weight" in reply.arrays


def test_grad_clip_bounds_the_local_steps_and_the_trials() -> None:
    """``grad_clip`` clips every local step's gradient (SGD at lr 1: the norm the optimizer
    sees is at most 1e-3, 10x below the unclipped ones) and every trial step: a batched search
    falls back to the sequential, clipped trials, whose scores differ from unclipped ones."""
    norms = {}
    for clip in (None, 1e-3):
        algo = MetaBayFL(
            train=LocalTraining(lr=1.0, local_steps=6, batch_size=10, grad_clip=clip),
            posterior="none",
            local_optimizer="sgd",
            lr_search="none",
        )
        model = nn.Sequential(nn.Linear(4, 2))
        state = algo.init_server(model, torch.Generator().manual_seed(0))
        events: list[tuple[Any, ...]] = []
        with _recorded_steps(model, events):
            algo.client_update(
                algo.broadcast(state, 0, 0), None, model, _client(40), torch.Generator()
            )
        norms[clip] = [e[3] for e in events]
    assert max(norms[1e-3]) <= 1e-3 * (1 + 1e-5) and min(norms[None]) > 1e-2
    fit, meta = _splits(64, 24, regression=False)
    scores = {}
    cases: tuple[tuple[Literal["sequential", "batched"], float | None], ...] = (
        ("sequential", 1e-3),
        ("batched", 1e-3),
        ("sequential", None),
    )
    for trials, clip in cases:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(5, 3))
        algo = MetaBayFL(
            train=LocalTraining(grad_clip=clip, mc_samples=0),
            posterior="none",
            trials=trials,
            candidate_lrs=(0.3, 0.03),
            temp_steps=3,
        )
        scores[trials, clip] = algo.select_lr(model, algo.make_optimizer(model), fit, meta, [], 2)[
            1
        ]
    assert scores["batched", 1e-3] == scores["sequential", 1e-3]
    assert scores["sequential", None] != pytest.approx(scores["sequential", 1e-3], rel=1e-3)


def test_skipped_steps_and_train_loss_cover_every_pass() -> None:
    """One training example is Inf: each pass over the split (4 steps of 10) skips the step
    that holds it, so 10 steps (passes of 4, 4 and 2) skip 2 or 3, counted over all passes;
    ``train_loss`` is the mean of the other steps' losses (recorded from the model's outputs),
    whatever pass they belong to. A client whose every example is Inf skips all steps and
    reports a NaN loss."""
    data = _client(40)
    data.train.x[17, 0] = math.inf
    labels = {
        tuple(row.tolist()): int(t) for row, t in zip(data.train.x, data.train.y, strict=True)
    }
    model = nn.Sequential(nn.Linear(4, 2))
    losses: list[float] = []

    def record(mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        if mod is model and mod.training:
            y = torch.tensor([labels[tuple(row.tolist())] for row in args[0]])
            losses.append(float(torch.nn.functional.cross_entropy(out.detach(), y)))

    handle = model.register_forward_hook(record)
    algo = MetaBayFL(
        train=LocalTraining(local_steps=10, batch_size=10, mc_samples=0),
        posterior="none",
        temp_steps=2,
    )
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    reply, _ = algo.client_update(algo.broadcast(state, 0, 0), None, model, data, torch.Generator())
    finite = [v for v in losses if math.isfinite(v)]
    assert len(losses) == 10 and reply.metrics["skipped_steps"] == 10 - len(finite) >= 2
    assert reply.metrics["train_loss"] == pytest.approx(sum(finite) / len(finite), rel=1e-6)
    handle.remove()
    data.train.x[:, 0] = math.inf
    bad, _ = algo.client_update(algo.broadcast(state, 0, 0), None, model, data, torch.Generator())
    assert bad.metrics["skipped_steps"] == 10 and math.isnan(float(bad.metrics["train_loss"]))


def test_reply_reports_time_optimizer_bytes_and_the_posteriors_kl() -> None:
    """``train_s`` is within the call's wall time; ``optimizer_state_bytes`` is AdamW's two
    float32 moments of the 10 weights of a Linear(4, 2) (80 bytes); only a BNN reports the KL of
    its trained posterior to the prior, and sampled weights train sigma (rho moves even with
    beta_kl = 0: only the likelihood, through the samples, can move it)."""
    algo = MetaBayFL(train=LocalTraining(local_steps=3), posterior="none", lr_search="none")
    model = nn.Sequential(nn.Linear(4, 2))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    reply, _ = algo.client_update(
        algo.broadcast(state, 0, 0), None, model, _client(20), torch.Generator()
    )
    train_s = reply.metrics["train_s"]
    assert isinstance(train_s, float) and 0 <= train_s <= time.perf_counter() - t0
    assert reply.metrics["optimizer_state_bytes"] == 2 * 10 * 4
    assert "kl" not in reply.metrics  # a deterministic model has no posterior
    bnn, arrays = _bnn_client(0.0)
    rho = [v for k, v in arrays.items() if k.endswith("_rho")]
    assert rho and all(float(v.abs().max()) > 0 for v in rho)
    assert bnn.metrics["kl"] > 0


def test_pick_lowest_refuses_scores_that_do_not_match_the_candidates() -> None:
    """One score per candidate, at least one candidate: the error counts both."""
    with pytest.raises(ValueError, match=r"^1 candidates but 0 scores$"):
        pick_lowest((1e-2,), [])
    with pytest.raises(ValueError, match=r"^0 candidates but 0 scores$"):
        pick_lowest((), [])


@pytest.mark.parametrize("lr_search", ["per_epoch", "per_round"])
def test_optimizer_bytes_leave_out_the_search_copies(
    lr_search: Literal["per_epoch", "per_round"],
) -> None:
    """docs/reference/outputs.md: ``optimizer_state_bytes`` is the training optimizer's moments;
    the learning-rate search's temporary copies (a model and optimizer state per candidate,
    discarded after each search) are not counted, so a searching client reports what the same
    client without a search reports: AdamW's two float32 moments of the 10 weights (80 bytes)."""
    algo = MetaBayFL(
        train=LocalTraining(local_steps=6, batch_size=5),
        posterior="none",
        lr_search=lr_search,
        temp_steps=2,
    )
    model = nn.Sequential(nn.Linear(4, 2))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    reply, _ = algo.client_update(
        algo.broadcast(state, 0, 0), None, model, _client(20), torch.Generator()
    )
    assert int(reply.metrics["lr_searches"]) >= 1  # the search ran
    assert reply.metrics["optimizer_state_bytes"] == 2 * 10 * 4
