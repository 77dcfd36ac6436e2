"""Meta-BayFL as seed 001 runs it (issue 33): clients train local *epochs* and search a rate
before each (Algorithm 1 line 7), draw a fresh meta split d_n^k ⊂ D_n^k every round k (the text
after Eq. 22), and run each trial at the rate training would use (the candidate times the
schedule's factor at the steps the trial stands for). Each test fails when its rule is broken."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_meta_selection import _client, _recorded_steps, _spying
from torch import nn

from fedlore.algorithms import meta_lr
from fedlore.algorithms.bayes import MetaBayFL
from fedlore.algorithms.fedavg import FedAvg
from fedlore.algorithms.meta_lr import meta_split
from fedlore.config import ConfigError, load_config
from fedlore.experiment_parts import make_algorithm
from fedlore.seeding import CLIENT, generator
from fedlore.settings import STEP_BUDGET, LocalTraining, steps_for_epochs


def _algo(events: list[tuple[Any, ...]], **kw: Any) -> MetaBayFL:
    settings: dict[str, Any] = {
        "posterior": "none",
        "local_optimizer": "sgd",
        "lr": 1e-3,
        "candidate_lrs": (0.2, 2.0, 20.0),
        "temp_steps": 3,
        "batch_size": 10,
        "mc_samples": 0,
    }
    return _spying(events).of(**{**settings, **kw})


def _round(algo: MetaBayFL, n: int, rnd: int = 0) -> tuple[list[tuple[Any, ...]], Any]:
    events: list[tuple[Any, ...]] = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    with _recorded_steps(model, events):
        reply, _ = algo.client_update(
            algo.broadcast(state, rnd, 0), None, model, _client(n), generator(42, CLIENT, rnd, 5)
        )
    return events, reply


# ------------------------------------------------------------- 1. local epochs, a search each


@pytest.mark.parametrize(("n", "epochs"), [(40, 3), (25, 2), (7, 4), (300, 2)])
def test_a_round_of_e_local_epochs_holds_e_searches_and_e_passes(n: int, epochs: int) -> None:
    """E local epochs: E searches, each followed by one pass of ceil(n / B) steps, whatever n
    (the shipped configs' 20 steps of 32 searched once a round on any client above 640
    examples)."""
    searches: list[tuple[Any, ...]] = []
    algo = _algo(searches, local_epochs=epochs, rounds=3)
    events, reply = _round(algo, n)
    per_pass = math.ceil(n / min(10, n))
    picks = [e for e in searches if e[0] == "search"]
    kinds = [e[0] for e in events if e[0] != "trial"]
    assert len(picks) == epochs == reply.metrics["lr_searches"]
    assert reply.metrics["lr_picks"] == ",".join(f"{e[1]:g}" for e in picks)  # each, in order
    assert kinds == ["local"] * (epochs * per_pass)
    assert algo.local_steps(n) == epochs * per_pass == steps_for_epochs(epochs, n, 10)
    # the searches sit before the passes: trials, then the pass's local steps
    order = [e[0] for e in events]
    firsts = [i for i, kind in enumerate(order) if kind == "local"][::per_pass]
    assert all(order[i - 1] == "trial" for i in firsts)


def test_each_epoch_trains_at_its_chosen_rate_times_the_schedule() -> None:
    """Under local epochs and a cosine schedule every local step's rate is the rate its epoch's
    search chose times the schedule's factor at that step (read from the optimizer, and
    measured from the SGD step itself)."""
    searches: list[tuple[Any, ...]] = []
    algo = _algo(searches, local_epochs=3, rounds=2, schedule="cosine")
    events, _ = _round(algo, 40, rnd=1)
    picks = [e[1] for e in searches if e[0] == "search"]
    local = [e for e in events if e[0] == "local"]
    base = algo.round_lrs(1, 40)
    assert len(local) == len(base) == 12 and len(picks) == 3
    for k, (_, group_lr, measured, _) in enumerate(local):
        want = picks[k // 4] * base[k] / algo.train.lr
        assert group_lr == pytest.approx(want, rel=1e-12), k
        assert measured == pytest.approx(want, rel=2e-2), k


# ------------------------------------------------------------- 2. a new d every round


def test_d_is_drawn_per_round_from_seed_round_and_client_and_is_a_subset_of_d() -> None:
    algo = MetaBayFL.of(posterior="none")
    x = torch.arange(50, dtype=torch.float32).unsqueeze(1)
    data = _client(50)
    data = type(data)(5, type(data.train)(x, torch.zeros(50, dtype=torch.long)), data.test)

    def d(seed: int, rnd: int, client: int = 5) -> list[float]:
        got = meta_split(data, 0.2, "subset", algo.meta_seed(generator(seed, CLIENT, rnd, client)))
        fit, meta = got
        assert fit is data.train  # the client trains on all of D
        return sorted(meta.x[:, 0].tolist())

    rounds = [d(42, r) for r in range(6)]
    whole = set(x[:, 0].tolist())
    assert all(len(one) == 10 and set(one) <= whole and len(set(one)) == 10 for one in rounds)
    assert len({tuple(one) for one in rounds}) == 6  # a new d every round
    assert d(42, 3) == rounds[3]  # a function of (seed, round, client): reruns agree
    assert d(43, 3) != rounds[3] and d(42, 3, client=6) != rounds[3]
    # the earlier reading stays an option: one d per client for the run and every seed
    fixed = MetaBayFL.of(posterior="none", meta_resample="fixed")
    once = {
        tuple(
            meta_split(data, 0.2, "subset", fixed.meta_seed(generator(s, CLIENT, r, 5)))[1]
            .x[:, 0]
            .tolist()
        )
        for s in (42, 43)
        for r in range(3)
    }
    assert len(once) == 1


def test_the_client_round_ranks_rates_on_that_rounds_d(monkeypatch: pytest.MonkeyPatch) -> None:
    """The d a client's search scores on is the one drawn for (seed, round, client): spy on the
    scoring and compare with :func:`meta_split` of the round's seed."""
    seen: list[torch.Tensor] = []
    real = meta_lr.candidate_score

    def spy(hyper: Any, model: nn.Module, meta: Any, terms: Any) -> float:
        seen.append(meta.x.clone())
        return real(hyper, model, meta, terms)

    monkeypatch.setattr(meta_lr, "candidate_score", spy)
    algo = MetaBayFL.of(posterior="none", local_steps=2, batch_size=10, temp_steps=1, mc_samples=0)
    data = _client(40)
    for rnd in (0, 1):
        seen.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 2))
        state = algo.init_server(model, torch.Generator().manual_seed(0))
        rng = generator(42, CLIENT, rnd, 5)
        algo.client_update(algo.broadcast(state, rnd, 0), None, model, data, rng)
        want = meta_split(data, 0.2, "subset", algo.meta_seed(generator(42, CLIENT, rnd, 5)))[1]
        assert seen and all(torch.equal(s, want.x) for s in seen), rnd
        if rnd == 0:
            first = want.x
    assert not torch.equal(first, want.x)


# ------------------------------------------------------------- 3. trials on the schedule


@pytest.mark.parametrize("trials", ["sequential", "batched"])
def test_trials_run_at_the_candidate_times_the_schedule_at_the_steps_they_stand_for(
    trials: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before epoch e (first local step a) trial step s runs at eta_j * factor(a + s); under a
    cosine schedule those factors are below 1 and fall, so a constant eta_j (the old trials)
    fails this. Batched trials get the same factors (checked on their scores against
    sequential trials given the same factors)."""
    calls: list[tuple[list[float] | None, int]] = []
    real = meta_lr.select_lr

    def spy(hyper: Any, model: Any, opt: Any, fit: Any, meta: Any, terms: Any, seed: int,
            factors: Any = None) -> Any:  # fmt: skip
        calls.append((list(factors) if factors is not None else None, seed))
        return real(hyper, model, opt, fit, meta, terms, seed, factors)

    monkeypatch.setattr(meta_lr, "select_lr", spy)
    algo = MetaBayFL.of(
        posterior="none", local_optimizer="sgd", lr=1e-3, candidate_lrs=(0.2, 2.0, 20.0),
        temp_steps=3, batch_size=10, mc_samples=0, local_epochs=3, rounds=2,
        schedule="cosine", trials=trials,
    )  # fmt: skip
    _round(algo, 40, rnd=1)
    schedule = algo.lr_schedule(40)
    first = 1 * algo.local_steps(40)
    assert len(calls) == 3
    for e, (factors, _) in enumerate(calls):
        a = e * 4
        want = [schedule.at(first + a + s) / algo.train.lr for s in range(3)]
        assert factors == pytest.approx(want, rel=1e-12)
        assert all(f < 1 for f in want) and want[0] > want[-1]

    # the trial optimizers of sequential trials take exactly those rates
    rates: list[list[float]] = []
    real_train = meta_lr.local_train

    def train_spy(model: Any, batches: Any, opt: Any, lrs: Any, **kw: Any) -> Any:
        rates.append(list(lrs))
        return real_train(model, batches, opt, lrs, **kw)

    monkeypatch.setattr(meta_lr, "local_train", train_spy)
    seq = MetaBayFL.of(
        posterior="none", local_optimizer="sgd", lr=1e-3, candidate_lrs=(0.2, 2.0),
        temp_steps=3, batch_size=10, mc_samples=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    opt = seq.make_optimizer(model)
    data = _client(40)
    fit, meta = meta_split(data, 0.2)
    factors = [0.9, 0.5, 0.25]
    _, seq_scores = real(seq, model, opt, fit, meta, [], 7, factors)
    assert rates == [[c * f for f in factors] for c in (0.2, 2.0)]
    batched = MetaBayFL.of(
        posterior="none", local_optimizer="sgd", lr=1e-3, candidate_lrs=(0.2, 2.0),
        temp_steps=3, batch_size=10, mc_samples=0, trials="batched",
    )  # fmt: skip
    _, bat_scores = real(batched, model, opt, fit, meta, [], 7, factors)
    _, flat_scores = real(batched, model, opt, fit, meta, [], 7, None)
    assert bat_scores == pytest.approx(seq_scores, rel=1e-5)
    assert bat_scores != pytest.approx(flat_scores, rel=1e-5)  # the factors changed them


def _factors_searched(monkeypatch: pytest.MonkeyPatch) -> list[list[float]]:
    """The schedule factors of every search (``meta_lr.select_lr``), as the searches run."""
    calls: list[list[float]] = []
    real = meta_lr.select_lr

    def spy(hyper: Any, model: Any, opt: Any, fit: Any, meta: Any, terms: Any, seed: int,
            factors: Any = None) -> Any:  # fmt: skip
        calls.append(list(factors))
        return real(hyper, model, opt, fit, meta, terms, seed, factors)

    monkeypatch.setattr(meta_lr, "select_lr", spy)
    return calls


@pytest.mark.parametrize(("kw", "n"), [({"local_steps": 2}, 40), ({"local_epochs": 1}, 15)])
def test_trials_past_the_runs_last_step_run_at_its_rate_not_zero(
    kw: dict[str, Any], n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the last round a trial of 3 steps may stand for steps after the run's last (2 local
    steps; or 2 steps an epoch); under cosine with min_lr_ratio 0 the schedule is 0 there, and
    the search refused its factors, so every client of the round was rejected. Those trial
    steps run at the last step's rate."""
    calls = _factors_searched(monkeypatch)
    algo = _algo([], rounds=2, schedule="cosine", **kw)
    _, reply = _round(algo, n, rnd=1)
    schedule = algo.lr_schedule(n)
    end = schedule.at(schedule.total_steps - 1) / algo.train.lr
    assert calls and reply.metrics["lr_searches"] == len(calls)
    assert calls[-1][-1] == pytest.approx(end, rel=1e-12) and end > 0


def test_a_stragglers_trials_stand_for_the_steps_of_its_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A straggler that finishes 1 of its 4 steps (clients.partial_work) still searches at the
    schedule of its round's steps (round 1 starts at the run's step 4, not at step 1)."""
    calls = _factors_searched(monkeypatch)
    algo = _algo([], rounds=3, schedule="cosine", local_steps=4)
    token = STEP_BUDGET.set(1)
    try:
        _round(algo, 40, rnd=1)
    finally:
        STEP_BUDGET.reset(token)
    schedule = algo.lr_schedule(40)
    want = [schedule.at(4 + s) / algo.train.lr for s in range(3)]
    assert len(calls) == 1 and calls[0] == pytest.approx(want, rel=1e-12)


def test_trial_factors_must_fit_the_trial() -> None:
    assert meta_lr.trial_factors(2, None) == [1.0, 1.0]
    for bad in ([1.0], [1.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="schedule factors"):
            meta_lr.trial_factors(2, bad)


# ------------------------------------------------------------- the setting itself


def test_local_epochs_or_local_steps_exactly_one() -> None:
    assert load_config(None, []).local_steps == 10  # neither: 10 steps
    cfg = load_config(None, ["local_epochs=3"])
    assert (cfg.local_steps, cfg.local_epochs) == (None, 3)
    with pytest.raises(ConfigError, match="set one"):
        load_config(None, ["local_steps=5", "local_epochs=3"])
    with pytest.raises(ValueError, match="both set"):
        LocalTraining(local_steps=5, local_epochs=2)
    with pytest.raises(ValueError, match="which the caller did not give"):
        LocalTraining(local_epochs=2).steps()


def test_an_override_of_one_replaces_the_other_given_in_the_file(tmp_path: Any) -> None:
    path = tmp_path / "e.yaml"
    path.write_text("local_steps: 20\nbatch_size: 8\n")
    cfg = load_config(path, ["local_epochs=2"])
    assert (cfg.local_steps, cfg.local_epochs) == (None, 2)
    base = tmp_path / "child.yaml"
    base.write_text("base: e.yaml\nlocal_epochs: 4\n")
    assert load_config(base, []).local_epochs == 4
    path.write_text("local_steps: 20\nlocal_epochs: 2\n")  # both in one file: refused
    with pytest.raises(ConfigError, match="both set"):
        load_config(path, [])
    # per method: method.<name>.local_epochs replaces the run's local_steps for that method
    cfg = load_config(None, ["local_steps=20", "method.meta_bayfl.local_epochs=2"])
    algo, fedavg = make_algorithm("meta_bayfl", cfg), make_algorithm("fedavg", cfg)
    assert isinstance(algo, MetaBayFL) and isinstance(fedavg, FedAvg)
    assert (algo.train.local_steps, algo.train.local_epochs) == (None, 2)
    assert fedavg.train.local_steps == 20


def test_every_method_sizes_its_round_by_epochs() -> None:
    """FedAvg under local_epochs takes E * ceil(n / B) minibatches; FedLore refuses it with
    weight decay (its server applies one common decay per round, Prop. 8)."""
    cfg = load_config(None, ["local_epochs=2", "batch_size=16"])
    fedavg = make_algorithm("fedavg", cfg)
    assert isinstance(fedavg, FedAvg)
    assert fedavg.local_steps(100) == 14 and len(fedavg.round_lrs(0, 100)) == 14
    make_algorithm("fedlore", cfg)  # weight_decay 0: accepted
    with pytest.raises((ValueError, ConfigError), match="local_epochs"):
        make_algorithm("fedlore", load_config(None, ["local_epochs=2", "optim.weight_decay=0.1"]))
