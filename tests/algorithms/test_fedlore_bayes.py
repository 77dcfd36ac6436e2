"""Bayesian FedLore (:mod:`fedlore.algorithms.fedlore_bayes`): the upload is ``r (m + n)`` numbers
per projected mean and scale matrix, every client's cached posterior stays bit-identical to the
server's through the real round loop, the scales move only inside their shared basis, the ELBO's
KL term acts, the learning-rate search runs once per local epoch and training uses the rate it
chose, and a trial never touches the round it is searched for.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_fedlore_sync import assert_bitwise, run_rounds, sync_with_next_broadcast
from tiny_federation import H1, H2, IN, NCLS, RANK, SEED, SIZES, build, client_data

from fedlore.algorithms import bayes_search
from fedlore.algorithms.bayes import BayFL
from fedlore.algorithms.fedlore_bayes import FedLoreBayes, FedLoreBayFL
from fedlore.bayes import bayesianize, is_bayesian
from fedlore.bayes.posterior import GaussianPrior
from fedlore.optim.projected_adam import ProjectedAdam
from fedlore.optim.subspace import projection_plan
from fedlore.seeding import CLIENT, SERVER_INIT, generator
from fedlore.tensors import nbytes, select
from fedlore.types import Reply

MATRICES = {"fc1": (H1, IN), "fc2": (H2, H1)}  # the projected layers (m x n, left side)


def bayes(cls: type[FedLoreBayes] = FedLoreBayes, **kw: Any) -> FedLoreBayes:
    base: dict[str, Any] = {
        "rank": RANK,
        "local_steps": 4,
        "batch_size": 8,
        "lr": 1e-2,
    }
    if cls.lr_search != "none":  # FedLoreBayFL refuses search settings it would not read
        base.update(temp_steps=2, candidate_lrs=(1e-2, 1e-3))
    base.update(kw)
    return cls.of(**base)


def first_reply(algo: FedLoreBayes, cid: int = 0) -> tuple[Reply, dict[str, torch.Tensor]]:
    """Client ``cid``'s round-0 reply after the setup exchange, and the server's model."""
    state = algo.init_server(build(), generator(SEED, SERVER_INIT))
    setup, kept = [], {}
    for c in range(len(SIZES)):
        msg = algo.broadcast(state, -1, c)
        rng = generator(SEED, CLIENT, -1, c)
        reply, kept[c] = algo.client_update(msg, None, build(), client_data(c), rng)
        setup.append((c, reply))
    state, _ = algo.aggregate(state, list(setup), -1)
    msg = algo.broadcast(state, 0, cid)
    rng = generator(SEED, CLIENT, 0, cid)
    reply, _ = algo.client_update(msg, kept[cid], build(), client_data(cid), rng)
    return reply, algo.global_arrays(state)


# ------------------------------------------------------------------------------ bytes
def test_the_upload_is_r_m_plus_n_per_projected_matrix_and_under_half_of_bayfl() -> None:
    algo = bayes()
    reply, model = first_reply(algo)
    plan = algo.plan(bayesianize(build(), GaussianPrior(), -5.0))
    assert set(plan) == {f"{k}.weight_{p}" for k in MATRICES for p in ("mu", "rho")}
    projected = 0
    for key, spec in plan.items():
        m, n = MATRICES[key.split(".")[0]]
        assert (spec.m, spec.n) == (m, n)
        assert tuple(reply.arrays[f"update.{key}"].shape) == (RANK, n)
        assert tuple(reply.arrays[f"cand.{key}"].shape) == (m, RANK)
        projected += RANK * (m + n)
    dense = {k[len("dense.") :] for k in reply.arrays if k.startswith("dense.")}
    assert dense == set(model) - set(plan)  # biases, the head: (mu, rho) each, densely
    numbers = sum(v.numel() for v in reply.arrays.values())
    assert numbers == projected + sum(model[k].numel() for k in dense)
    # BayFL's reply: every (mu, rho) densely
    bayfl = BayFL.of(local_steps=4, batch_size=8, lr=1e-2)
    state = bayfl.init_server(build(), generator(SEED, SERVER_INIT))
    dense_reply, _ = bayfl.client_update(
        bayfl.broadcast(state, 0, 0), None, build(), client_data(0), generator(SEED, 0, 0)
    )
    assert sum(v.numel() for v in dense_reply.arrays.values()) == sum(
        v.numel() for v in model.values()
    )
    assert nbytes(reply.arrays) <= 0.5 * nbytes(dense_reply.arrays)


def test_dense_scales_send_the_rho_matrices_whole() -> None:
    reply, _ = first_reply(bayes(scales="dense"))
    assert {k[len("update.") :] for k in reply.arrays if k.startswith("update.")} == {
        "fc1.weight_mu",
        "fc2.weight_mu",
    }
    for layer, (m, n) in MATRICES.items():
        assert tuple(reply.arrays[f"dense.{layer}.weight_rho"].shape) == (m, n)
    assert "dense.head.weight_mu" in reply.arrays


def test_the_plan_of_an_unconverted_model_names_its_bayesian_twin() -> None:
    det = build()
    assert set(bayes().plan(det)) == {f"{k}.weight_{p}" for k in MATRICES for p in ("mu", "rho")}
    assert not is_bayesian(det)  # read from a copy, the model is left as it is
    assert set(projection_plan(det, RANK)) == {"fc1.weight", "fc2.weight"}


def test_a_client_round_is_reproducible() -> None:
    algo = bayes(local_epochs=2, local_steps=None)
    a, _ = first_reply(algo, 1)
    b, _ = first_reply(algo, 1)
    assert_bitwise(a.arrays, b.arrays, "two runs of one client round")
    assert a.metrics["lr_picks"] == b.metrics["lr_picks"]


# ------------------------------------------------------------------------------ sync
@pytest.mark.parametrize("scales", ["project", "dense"])
def test_caches_match_the_server_under_partial_participation(scales: str) -> None:
    rounds = 4
    run = run_rounds(bayes(scales=scales, log_rounds=50, rounds=rounds + 1), rounds, per_round=2)
    for rnd in range(rounds):
        for cid, cache in run.transport.caches[rnd].items():
            assert_bitwise(cache, run.globals_at[rnd], f"round {rnd} client {cid}")
    final = run.algo.global_arrays(run.state)
    for key in ("fc1.weight_mu", "fc1.weight_rho", "head.weight_rho"):
        assert not torch.equal(final[key], run.globals_at[0][key]), key
    for cid in range(len(SIZES)):
        _, cache = sync_with_next_broadcast(run, rounds, cid)
        assert_bitwise(cache, final, f"client {cid}")


def test_the_scales_move_only_inside_their_shared_basis() -> None:
    run = run_rounds(bayes(rounds=2), 1)
    before, after = run.globals_at[0], run.globals_at[1]
    state = run.state
    for layer in MATRICES:
        key = f"{layer}.weight_rho"
        # the basis round 0 trained in: the setup exchange's bank 0
        basis = state.arrays.get(f"bank.0.{key}")
        if basis is None:  # refreshed and dropped: rebuild it from the first broadcast
            basis = select(run.transport.messages[0][0].arrays, "bank.0.")[key]
        step = (after[key] - before[key]).double()
        p = basis.double()
        outside = step - p @ (p.T @ step)
        assert float(step.norm()) > 1e-4, "the scales did not train"
        # float32 rounding of rho near -5 only (a dense step leaves most of itself outside)
        assert float(outside.norm()) < 1e-3 * float(step.norm())


def test_the_kl_term_pulls_the_scales_towards_the_prior() -> None:
    """rho starts at -5 (sigma 0.0067) under an N(0, 1) prior: the KL's gradient raises it.
    Without the KL term (beta_kl = 0) it barely moves: a client that dropped the KL fails."""
    moved = {}
    for beta in (0.0, 1.0):
        algo = bayes(FedLoreBayFL, beta_kl=beta, lr=5e-2, local_steps=8)
        reply, model = first_reply(algo)
        kl = reply.metrics["kl"]
        assert isinstance(kl, float) and kl > 0
        moved[beta] = float(
            reply.arrays["dense.head.weight_rho"].mean() - model["head.weight_rho"].mean()
        )
    assert moved[1.0] > 0.1 and moved[1.0] > 5 * abs(moved[0.0]), moved


# ------------------------------------------------------------------------------ the search
def test_one_search_per_local_epoch_and_training_uses_the_chosen_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[list[float]] = []
    real = bayes_search.local_train

    def spy(model: Any, batches: Any, opt: Any, lrs: Any, **kw: Any) -> Any:
        seen.append(list(lrs))
        return real(model, batches, opt, lrs, **kw)

    picks = iter([1e-3, 1e-2, 1e-3])
    monkeypatch.setattr(FedLoreBayes, "select_lr", lambda self, *a, **k: (next(picks), []))
    monkeypatch.setattr(bayes_search, "local_train", spy)
    algo = bayes(local_epochs=3, local_steps=None)  # client 0: 30 examples, B = 8: 4 steps each
    reply, _ = first_reply(algo)
    assert reply.metrics["lr_searches"] == 3
    assert reply.metrics["lr_picks"] == "0.001,0.01,0.001"
    assert reply.metrics["lr_chosen"] == 1e-3
    assert seen == [[1e-3] * 4, [1e-2] * 4, [1e-3] * 4]  # constant schedule: the chosen rate


def test_without_a_search_training_runs_at_the_fixed_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[float]] = []
    real = bayes_search.local_train

    def spy(model: Any, batches: Any, opt: Any, lrs: Any, **kw: Any) -> Any:
        seen.append(list(lrs))
        return real(model, batches, opt, lrs, **kw)

    monkeypatch.setattr(bayes_search, "local_train", spy)
    reply, _ = first_reply(bayes(FedLoreBayFL, lr=3e-3))
    assert seen == [[3e-3] * 4]
    assert "lr_searches" not in reply.metrics


def test_a_trial_copy_continues_the_projected_optimizer_and_leaves_it_alone() -> None:
    torch.manual_seed(0)
    model = bayesianize(build(), GaussianPrior(), -5.0)
    plan = bayes().plan(model)
    params = dict(model.named_parameters())
    bases = {k: torch.linalg.qr(torch.randn(s.m, s.rank))[0] for k, s in plan.items()}
    opt = ProjectedAdam(
        [p for k, p in params.items() if k not in plan],
        [(params[k], plan[k], bases[k]) for k in plan],
        lr=1e-2,
    )
    x, y = torch.randn(8, IN), torch.randint(0, NCLS, (8,))

    def step(net: torch.nn.Module, o: torch.optim.Optimizer, seed: int) -> None:
        torch.manual_seed(seed)  # the same weight sample for the model and its copy
        o.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        o.step()

    step(model, opt, 1)  # moments and coordinates that the copy must carry
    trial, trial_opt = FedLoreBayes.of(rank=RANK).trial_copy(model, opt)
    assert isinstance(trial_opt, ProjectedAdam) and trial_opt.scale == opt.scale
    snapshot = copy.deepcopy(model.state_dict())
    coords = {k: opt.coords[params[k]].clone() for k in plan}
    step(trial, trial_opt, 2)
    step(trial, trial_opt, 3)
    assert_bitwise(dict(model.state_dict()), dict(snapshot), "the model a trial ran from")
    trial_params = dict(trial.named_parameters())
    for k in plan:
        assert torch.equal(opt.coords[params[k]], coords[k])
        assert not torch.equal(trial_opt.coords[trial_params[k]], coords[k])
    # the copy continues exactly as the original would
    twin, twin_opt = FedLoreBayes.of(rank=RANK).trial_copy(model, opt)
    assert isinstance(twin_opt, ProjectedAdam)
    step(model, opt, 4)
    step(twin, twin_opt, 4)
    assert_bitwise(dict(model.state_dict()), dict(twin.state_dict()), "original vs its copy")
    twin_params = dict(twin.named_parameters())
    for k in plan:
        assert torch.equal(opt.coords[params[k]], twin_opt.coords[twin_params[k]])
        assert torch.equal(
            opt.state[params[k]]["exp_avg_sq"], twin_opt.state[twin_params[k]]["exp_avg_sq"]
        )


def test_invalid_scales_are_refused() -> None:
    with pytest.raises(ValueError, match="scales"):
        FedLoreBayes.of(scales="shared")
