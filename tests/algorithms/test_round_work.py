"""The work the simulated clock charges a client (``round_work``, :mod:`fedlore.engine.simclock`)
is the optimizer steps its round really runs: every method, counted from the optimizers' own
step hooks inside ``client_update``, for a whole round and for a straggler's budget
(``clients.partial_work``); Meta-BayFL's searches (J candidates x ``temp_steps`` trial steps
before every local epoch, or once a round), a held-out meta split (the epochs of D \\ d) and
Ditto's personal steps included, and the plain SGD steps a method takes by hand, without an
optimizer (APFL's step of v_i, Per-FedAvg's inner step to w~: :data:`BY_HAND`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from torch.optim.optimizer import register_optimizer_step_post_hook

from fedlore import registry
from fedlore.algorithms import apfl, perfedavg
from fedlore.config import load_config
from fedlore.data.federation import build_federation
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.settings import STEP_BUDGET

SEED = 7
ALGORITHMS = registry.names("algorithm")
BASE = ["name=work", "num_clients=3", "rounds=1", "batch_size=16", "lr=3e-3", "rank=4",
        "model.kwargs={hidden: [16]}", "partition.min_size=10", "progress=false"]  # fmt: skip
OWN = {
    "fedbn": ["model.kwargs={hidden: [16], norm: batch}"],
    "fedbe": ["data.server_fraction=0.1"],
}
"""What a method needs of the config: FedBN a BatchNorm, FedBE the server's unlabeled set."""
BY_HAND = {"apfl": (apfl, "loss_and_grads"), "perfedavg": (perfedavg, "grads_of")}
"""Where a method takes a plain SGD step by hand (no optimizer's ``step``): the gradient that
each such step computes, counted as a step (APFL's step of v_i, Per-FedAvg's inner step)."""


@contextmanager
def _counted(algo: Any, counts: list[tuple[int, int, int]]) -> Iterator[None]:
    """Append ``(n, budget or K, optimizer steps)`` for every client round (round >= 0: a setup
    exchange trains no steps) that ``algo`` runs meanwhile."""
    steps = [0]

    def count(*_: Any) -> None:
        steps[0] += 1

    own = type(algo).client_update

    def client_update(self: Any, msg: Any, state: Any, model: Any, data: Any, rng: Any) -> Any:
        steps[0] = 0
        out = own(self, msg, state, model, data, rng)
        if int(msg.config["round"]) >= 0:
            budget = STEP_BUDGET.get()
            n = data.num_examples
            counts.append((n, budget or self.round_steps(n), steps[0]))
        return out

    hand = BY_HAND.get(algo.name)
    grad = getattr(*hand) if hand else None

    def by_hand(*args: Any) -> Any:
        count()
        return grad(*args)  # type: ignore[misc]

    handle = register_optimizer_step_post_hook(count)
    type(algo).client_update = client_update
    if hand:
        setattr(*hand, by_hand)
    try:
        yield
    finally:
        type(algo).client_update = own
        handle.remove()
        if hand:
            setattr(*hand, grad)


def _work(name: str, tmp_path: Path, *extra: str) -> tuple[Any, list[tuple[int, int, int]]]:
    cfg = load_config(None, [*BASE, *OWN.get(name, []), f"output_dir={tmp_path}", *extra])
    algo = make_algorithm(name, cfg)
    counts: list[tuple[int, int, int]] = []
    with _counted(algo, counts):
        assert run_one(cfg, name, SEED, fed=build_federation(cfg, SEED)) is not None
    assert counts, "no client round ran"
    return algo, counts


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_clocks_work_is_the_optimizer_steps_a_client_runs(name: str, tmp_path: Path) -> None:
    algo, counts = _work(name, tmp_path, "local_epochs=2", "local_steps=null")
    for n, k, ran in counts:
        assert k == algo.round_steps(n)
        assert algo.round_work(n, k) == ran, (n, k)


SEARCHES = {
    "per_round": ["method.meta_bayfl.lr_search=per_round"],
    "heldout": ["method.meta_bayfl.meta_split=heldout"],
    "steps": ["local_steps=7"],  # an epoch (28 steps) longer than the round: one search
}


@pytest.mark.parametrize("how", list(SEARCHES))
def test_meta_bayfls_work_counts_its_searches_trials(how: str, tmp_path: Path) -> None:
    """One search a round, a held-out d (the epochs of D \\ d), local steps shorter than an
    epoch: the trial steps each way of searching runs."""
    epochs = [] if how == "steps" else ["local_epochs=2", "local_steps=null"]
    algo, counts = _work("meta_bayfl", tmp_path, *epochs, *SEARCHES[how])
    for n, k, ran in counts:
        assert ran > k  # trials ran
        assert algo.round_work(n, k) == ran, (n, k)


@pytest.mark.parametrize("name", ["fedavg", "meta_bayfl", "ditto", "pfedme", "fedfomo", "apfl"])
def test_a_stragglers_work_is_the_optimizer_steps_of_its_budget(name: str, tmp_path: Path) -> None:
    """Under ``clients.partial_work`` a straggler trains a budget of its local steps: the work
    of that budget is what it runs (Meta-BayFL searches before the epochs the budget starts,
    Ditto's personal steps are not cut)."""
    unreliable = ["clients.speed=lognormal", "clients.speed_spread=1.0", "clients.step_s=0.01",
                  "clients.round_deadline_s=0.5", "clients.partial_work=true"]  # fmt: skip
    algo, counts = _work(name, tmp_path, "local_epochs=2", "local_steps=null", *unreliable)
    assert any(k < algo.round_steps(n) for n, k, _ in counts)  # a straggler
    for n, k, ran in counts:
        assert algo.round_work(n, k) == ran, (n, k)
