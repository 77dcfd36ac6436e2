"""The personalized methods (pFedMe, Ditto, FedFomo, pFedBayes): personal state survives rounds
and differs between clients, P-local reads only the personal model, training never reads the
test split, and each method's own math on hand-checkable cases."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from fedlore.algorithm import Algorithm
from fedlore.algorithms.ditto import Ditto
from fedlore.algorithms.fedfomo import FedFomo, fomo_weights, pick_requests
from fedlore.algorithms.personal import Personalized, personal_arrays, prox_term
from fedlore.algorithms.pfedbayes import PFedBayes
from fedlore.algorithms.pfedme import PFedMe
from fedlore.bayes import bayesianize, gaussian_kl_between, posterior_kl
from fedlore.bayes.posterior import GaussianPrior, log_softplus
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.loop import RoundLoop
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.seeding import generator
from fedlore.settings import LocalTraining
from fedlore.tensors import load_model_arrays, select
from fedlore.types import Broadcast, State

NUM_CLIENTS = 3
COMMON = {"local_steps": 4, "batch_size": 16, "rounds": 4}
DITTO = Ditto.of(lr=0.1, **COMMON)
FEDFOMO = FedFomo.of(lr=0.1, num_candidates=2, **COMMON)
METHODS: dict[str, Algorithm] = {
    "ditto": DITTO,
    "pfedme": PFedMe.of(lr=0.05, **COMMON),
    "pfedbayes": PFedBayes.of(lr=1e-2, **COMMON),
    "fedfomo": FEDFOMO,
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))


def _client(cid: int, n: int = 48, test_x: torch.Tensor | None = None) -> ClientData:
    """Client ``cid``: 3 classes separated along a client-specific direction (non-IID)."""
    g = torch.Generator().manual_seed(100 + cid)
    x = torch.randn(n + 24, 6, generator=g)
    y = ((x[:, cid % 6] > 0).long() + (x[:, (cid + 1) % 6] > 0.5).long()).clamp(max=2)
    train, test = TensorSplit(x[:n], y[:n]), TensorSplit(x[n:], y[n:])
    if test_x is not None:
        test = TensorSplit(test_x, test.y)
    return ClientData(cid, train, test)


def _run(algo: Algorithm, schedule: list[list[int]]) -> tuple[ClientStore, list[State]]:
    """Run ``algo`` over rounds whose sampled clients are ``schedule``; returns the store and
    every client's state after each round (``states[r][c]`` as a State or None)."""
    store = ClientStore()
    transport = LocalTransport(algo, _client, _model, 7, store)
    state = algo.init_server(_model(), generator(7, 2))
    snaps: list[State] = []
    loop = RoundLoop(algo, transport, lambda rnd: schedule[rnd])
    for rnd in range(len(schedule)):
        state, row = loop.run_round(state, rnd, len(schedule) - 1)
        assert row["accepted"] == len(schedule[rnd]), row
        arrays = {}
        for c in store.client_ids():
            kept = store.get(c)
            assert kept is not None  # a stored id has a state
            arrays.update({f"{c}:{k}": v for k, v in kept.arrays.items()})
        snaps.append(State(arrays=arrays))
    return store, snaps


@pytest.mark.parametrize("name", sorted(METHODS))
def test_personal_state_survives_a_round_off_and_differs_between_clients(name: str) -> None:
    algo = METHODS[name]
    # client 2 takes part in rounds 0 and 2, not 1
    store, snaps = _run(algo, [[0, 1, 2], [0, 1], [0, 1, 2]])
    after0 = {k: v for k, v in snaps[0].arrays.items() if k.startswith("2:personal.")}
    after1 = {k: v for k, v in snaps[1].arrays.items() if k.startswith("2:personal.")}
    assert after0 and after0.keys() == after1.keys()
    assert all(torch.equal(after0[k], after1[k]) for k in after0)  # untouched while away
    p = [personal_arrays(store.get(c)) for c in range(NUM_CLIENTS)]
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert any(not torch.equal(p[a][k], p[b][k]) for k in p[a]), (a, b)
    # the round-2 personal model continued from the stored one: dropping it changes the result
    if name in ("ditto", "pfedbayes", "fedfomo"):
        fresh, _ = _run(algo, [[0, 1], [0, 1], [0, 1, 2]])
        q = personal_arrays(fresh.get(2))
        assert any(not torch.equal(q[k], p[2][k]) for k in q)


def _state_after_one_round(algo: Algorithm, cid: int = 0, test_x: torch.Tensor | None = None):
    state = algo.init_server(_model(), generator(7, 2))
    msg = algo.broadcast(state, 0, cid)
    return algo.client_update(msg, None, _model(), _client(cid, test_x=test_x), generator(1, 2))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_personalized_score_reads_the_personal_model_only(name: str) -> None:
    algo = METHODS[name]
    assert isinstance(algo, Personalized)
    _, state = _state_after_one_round(algo)
    data = _client(0)
    scratch_a, scratch_b = _model(), _model()
    with torch.no_grad():  # the "global" model in the workspace differs wildly
        for p in scratch_b.parameters():
            p.add_(torch.randn_like(p) * 5)
    a = algo.evaluate_personal(state, scratch_a, data)
    b = algo.evaluate_personal(state, scratch_b, data)
    assert a == b and a["local_n"] == 24
    # a different personal model scores differently
    other = State(
        arrays={
            k: (
                v + torch.randn_like(v) * 3
                if k.startswith("personal.") and v.is_floating_point()
                else v
            )
            for k, v in state.arrays.items()
        },
        values=state.values,
    )
    c = algo.evaluate_personal(other, _model(), data)
    assert c["local_loss"] != a["local_loss"]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_training_never_reads_the_test_split(name: str) -> None:
    algo = METHODS[name]
    nan_test = torch.full((24, 6), float("nan"))
    r1, s1 = _state_after_one_round(algo)
    r2, s2 = _state_after_one_round(algo, test_x=nan_test)
    assert r1.arrays.keys() == r2.arrays.keys()
    assert all(torch.equal(r1.arrays[k], r2.arrays[k]) for k in r1.arrays)
    assert all(torch.equal(s1.arrays[k], s2.arrays[k]) for k in s1.arrays)
    assert all(torch.isfinite(v).all() for v in personal_arrays(s2).values())


def test_last_round_reports_the_personal_score() -> None:
    algo = dataclasses.replace(
        DITTO, train=DITTO.train.model_copy(update={"local_eval": True, "rounds": 1})
    )
    reply, state = _state_after_one_round(algo)
    assert (
        reply.metrics["local_accuracy"]
        == algo.evaluate_personal(state, _model(), _client(0))["local_accuracy"]
    )
    assert "personal_loss" in reply.metrics


def test_fedfomo_scores_its_federated_model_before_local_training() -> None:
    """NVlabs scores the weighted combination before local training (``plocal="combined"``);
    ``plocal="trained"`` scores the personal model after it. At a first contact the federated
    model is the received initial one."""
    from fedlore.algorithms.base import local_scores

    combined = dataclasses.replace(
        FEDFOMO, train=FEDFOMO.train.model_copy(update={"local_eval": True, "rounds": 1})
    )
    assert isinstance(combined, FedFomo) and combined.plocal == "combined"
    reply, _ = _state_after_one_round(combined)
    before = local_scores(_model(), _client(0), 0)  # the initial model, untrained
    assert reply.metrics["local_accuracy"] == before["local_accuracy"]
    assert reply.metrics["local_loss"] == before["local_loss"]
    trained = dataclasses.replace(combined, plocal="trained")
    reply2, state2 = _state_after_one_round(trained)
    after = trained.evaluate_personal(state2, _model(), _client(0))
    assert reply2.metrics["local_loss"] == after["local_loss"] != before["local_loss"]
    # which model is scored does not change what the client trains
    assert all(torch.equal(reply.arrays[k], reply2.arrays[k]) for k in reply.arrays)
    with pytest.raises(ValueError, match="plocal"):
        FedFomo(plocal="both")  # type: ignore[arg-type]


def test_prox_term_value_and_gradient() -> None:
    model = nn.Linear(2, 1)
    anchor = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    term = prox_term(anchor, 3.0)
    val = term(model)
    sq = sum(float(p.detach().pow(2).sum()) for p in model.parameters())
    assert math.isclose(float(val.detach()), 1.5 * sq, rel_tol=1e-6)
    val.backward()
    assert model.weight.grad is not None
    assert torch.allclose(model.weight.grad, 3.0 * model.weight.detach())


def test_ditto_personal_step_is_pulled_to_the_received_model() -> None:
    # with lr * lam = 1 the proximal part of one step lands exactly on w^t; with no data
    # gradient difference between v and the landing point, v_1 = w^t - lr * grad F(v_0)
    algo = Ditto.of(lr=0.01, local_steps=1, batch_size=48, rounds=2, lam=100.0)
    state = algo.init_server(_model(), generator(7, 2))
    received = select(state.arrays, "model.")
    v0 = {k: v + 1.0 for k, v in received.items()}
    client_state = State(arrays={"personal." + k: v for k, v in v0.items()})
    msg = algo.broadcast(state, 1, 0)
    data = _client(0)
    _, new = algo.client_update(msg, client_state, _model(), data, generator(1, 2))
    v1 = personal_arrays(new)
    m = _model()
    load_model_arrays(m, v0)
    loss = nn.functional.cross_entropy(m(data.train.x), data.train.y)
    loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    for k in v1:
        grad = grads[k]
        assert grad is not None, k
        assert torch.allclose(v1[k], received[k] - 0.01 * grad, atol=1e-5), k


@pytest.mark.parametrize("personal_steps", [None, 6])
def test_ditto_personal_steps_follow_the_schedule_over_the_whole_run(
    personal_steps: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under cosine, round r's personal steps run at the rates of a schedule over rounds x P
    personal steps (P = personal_steps, else K): v's rate decays over the run as w's does."""
    import fedlore.algorithms.ditto as ditto_module
    from fedlore.train.local import Schedule

    seen: list[list[float]] = []
    real = ditto_module.local_train

    def record(*args: object, **kwargs: object) -> object:
        lrs = args[3]
        assert isinstance(lrs, list)
        seen.append(lrs)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ditto_module, "local_train", record)
    algo = Ditto.of(
        lr=0.1, local_steps=2, batch_size=16, rounds=4, schedule="cosine",
        personal_steps=personal_steps,
    )  # fmt: skip
    state = algo.init_server(_model(), generator(7, 2))
    p = personal_steps or 2
    want = Schedule(0.1, "cosine", 4 * p, 0.0)
    for rnd in range(4):
        seen.clear()
        algo.client_update(
            algo.broadcast(state, rnd, 0), None, _model(), _client(0), generator(1, 2)
        )
        assert seen[-1] == pytest.approx(want.round_lrs(rnd, p)), rnd
        assert min(seen[-1]) > 0.0


def test_pfedme_keeps_theta_not_w_and_mixes_with_beta() -> None:
    algo = PFedMe.of(lr=0.05, local_steps=3, batch_size=16, rounds=2, beta=2.0)
    state = algo.init_server(_model(), generator(7, 2))
    reply, new = algo.client_update(
        algo.broadcast(state, 0, 0), None, _model(), _client(0), generator(1, 2)
    )
    w_up = {k[len("update.") :]: v for k, v in reply.arrays.items()}
    start = select(state.arrays, "model.")
    theta = personal_arrays(new)
    # the kept personal model is theta, not the uploaded local copy w_i (pFedMe issue #5)
    assert any(not torch.allclose(theta[k], start[k] + w_up[k]) for k in theta)
    # theta stays near w_i (lam = 15 ties them) but is not it
    # server: w^{t+1} = (1 - beta) w^t + beta * mean w_i
    nxt, _ = algo.aggregate(state, [(0, reply)], 0)
    for k, v in select(nxt.arrays, "model.").items():
        assert torch.allclose(v, start[k] + 2.0 * w_up[k], atol=1e-6)


def test_posterior_kl_matches_torch_distributions() -> None:
    torch.manual_seed(3)
    a = bayesianize(_model(), GaussianPrior(0.0, 1.0), -2.0)
    b = bayesianize(_model(), GaussianPrior(0.0, 1.0), -1.0)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.1 * torch.randn_like(p))
    expect = 0.0
    for ma, mb in zip(a.modules(), b.modules(), strict=True):
        if not hasattr(ma, "weight_mu"):
            continue
        for s in ("weight", "bias"):
            q = torch.distributions.Normal(
                getattr(ma, s + "_mu"), torch.exp(log_softplus(getattr(ma, s + "_rho")))
            )
            prior = torch.distributions.Normal(
                getattr(mb, s + "_mu"), torch.exp(log_softplus(getattr(mb, s + "_rho")))
            )
            expect += float(torch.distributions.kl_divergence(q, prior).sum().detach())
    assert math.isclose(float(posterior_kl(a, b).detach()), expect, rel_tol=1e-5)
    assert float(posterior_kl(a, a).detach()) == pytest.approx(0.0, abs=1e-5)
    one = gaussian_kl_between(
        torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([0.0])
    )
    assert float(one.detach()) == pytest.approx(0.5)  # KL(N(0,1) || N(1,1)) = 1/2


def test_pfedbayes_moves_z_toward_q_and_uploads_z() -> None:
    algo = PFedBayes(train=LocalTraining(lr=1e-2, local_steps=5, batch_size=16, rounds=2))
    state = algo.init_server(_model(), generator(7, 2))
    v = select(state.arrays, "model.")
    msg = algo.broadcast(state, 0, 0)
    reply, new = algo.client_update(msg, None, _model(), _client(0), generator(1, 2))
    q = algo.load_personal(new, _model())
    start = algo.prepare_model(_model())
    load_model_arrays(start, v)
    z = copy.deepcopy(start)
    load_model_arrays(z, {k: v[k] + reply.arrays["update." + k] for k in v})
    # q left v (it fit the data) and z followed it: KL(q || z) < KL(q || v)
    assert float(posterior_kl(q, start).detach()) > 0
    assert float(posterior_kl(q, z).detach()) < float(posterior_kl(q, start).detach())
    assert math.isclose(
        float(reply.metrics["kl"]), float(posterior_kl(q, z).detach()), rel_tol=1e-4
    )


def test_fomo_weights_on_a_hand_checked_case() -> None:
    # L(theta_b) = 1.0; candidates with losses 0.5, 1.5, 0.8 at distances 0.5, 1.0, 0.1
    deltas, weights = fomo_weights(1.0, [0.5, 1.5, 0.8], [0.5, 1.0, 0.1])
    assert deltas == pytest.approx([1.0, -0.5, 2.0])
    assert weights == pytest.approx([1 / 3, 0.0, 2 / 3])
    deltas, weights = fomo_weights(1.0, [1.5, float("nan")], [1.0, 1.0])
    assert weights == [0.0, 0.0] and deltas[1] == 0.0  # nothing helps: keep theta_b


def test_fomo_combine_and_affinity_on_a_hand_checked_case() -> None:
    algo = FedFomo.of(lr=0.1, local_steps=1, rounds=2, num_candidates=2)
    model = nn.Linear(1, 2, bias=False)
    # validation: x = 1, label 0; a model scores logits (w0, w1)
    val = TensorSplit(torch.ones(1, 1), torch.zeros(1, dtype=torch.long))
    base = {"weight": torch.zeros(2, 1)}  # loss ln 2
    good = {"weight": torch.tensor([[1.0], [0.0]])}  # loss ln(1 + e^-1)
    bad = {"weight": torch.tensor([[0.0], [1.0]])}  # loss ln(1 + e)
    affinity: dict[int, float] = {}
    metrics = algo.combine(model, base, {4: good, 9: bad}, val, affinity)
    d_good = (math.log(2) - math.log(1 + math.exp(-1))) / 1.0  # L1 distance 1
    d_bad = (math.log(2) - math.log(1 + math.e)) / 1.0
    total = abs(d_good + d_bad)
    assert affinity[4] == pytest.approx(d_good / total) and affinity[9] == pytest.approx(
        d_bad / total
    )
    # only the helpful model enters, with weight 1: theta = theta_b + 1 * (good - theta_b)
    assert torch.allclose(model.weight, good["weight"])
    assert metrics == {"candidates": 2, "positive_weights": 1}


def test_fomo_requests_are_epsilon_greedy() -> None:
    g = torch.Generator().manual_seed(0)
    aff = {1: 0.5, 2: 2.0, 3: -1.0, 4: 1.0}
    assert pick_requests([1, 2, 3, 4], aff, 2, 0.0, g) == [2, 4]  # greedy: the top two
    picks = {tuple(sorted(pick_requests([1, 2, 3, 4], aff, 2, 1.0, g))) for _ in range(50)}
    assert len(picks) > 3  # exploring: many different pairs
    assert pick_requests([5], aff, 3, 0.0, g) == [5]  # fewer than M available


def test_fomo_client_downloads_what_it_asked_for() -> None:
    algo = METHODS["fedfomo"]
    state = algo.init_server(_model(), generator(7, 2))
    # after two rounds, the broadcast of round 2 carries the models each client named
    transport = LocalTransport(algo, _client, _model, 7, ClientStore())
    loop = RoundLoop(algo, transport, lambda rnd: [0, 1, 2])
    for rnd in range(2):
        state, _ = loop.run_round(state, rnd, 2)
    for c in range(NUM_CLIENTS):
        asked = [int(x) for x in str(state.values[f"request.{c}"]).split(",") if x]
        msg: Broadcast = algo.broadcast(state, 2, c)
        got = sorted({int(k.split(".")[1]) for k in msg.arrays if k.startswith("cand.")})
        assert got == sorted(asked) and c not in got and len(got) == 2
        assert "model.0.weight" not in msg.arrays  # the initial model only at first contact


def test_diverged_scores_are_nan_not_invented() -> None:
    from fedlore.engine.loop import client_reports
    from fedlore.experiment_parts import global_local_metrics
    from fedlore.types import Reply

    ok = Reply(metrics={"num_examples": 5, "local_n": 4, "local_accuracy": 0.5})
    bad = Reply(metrics={"num_examples": 5, "local_n": 4, "local_accuracy": float("nan")})
    assert client_reports([(0, ok), (1, ok)])["local_accuracy"] == 0.5
    row = client_reports([(0, ok), (1, bad)])
    assert math.isnan(row["local_accuracy"]) and row["local_clients"] == 2
    model = _model()
    first = model[0]
    assert isinstance(first, nn.Linear)
    with torch.no_grad():
        first.weight.fill_(float("nan"))
    pooled = TensorSplit.concat([_client(0).test, _client(1).test])
    out = global_local_metrics(model, pooled, [24, 24], 64, 0)
    assert math.isnan(out["client_accuracy"]) and math.isnan(out["client_accuracy_mean"])


def test_the_clients_accuracy_spread_is_computed_per_client_not_per_example() -> None:
    """``eval.clients``' fairness figures over the clients' own accuracies (each client once):
    mean, sample std, worst, 10th percentile; a diverged model gives NaN for all four."""
    from fedlore.experiment_parts import CLIENT_SPREAD, global_local_metrics

    class Fixed(torch.nn.Module):  # predicts class 0 for every input
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tensor([[0.0, -9.0]]).expand(len(x), 2)

    sizes = [10, 4, 1, 5]  # per client: 10, 1, 0 and 5 hits of class 0 -> 1.0, 0.25, 0.0, 1.0
    y = torch.tensor([0] * 10 + [0, 1, 1, 1] + [1] + [0] * 5)
    pooled = TensorSplit(torch.zeros(len(y), 3), y)
    out = global_local_metrics(Fixed(), pooled, sizes, 64, 0)
    per = torch.tensor([1.0, 0.25, 0.0, 1.0], dtype=torch.float64)
    assert out["client_accuracy"] == pytest.approx(16 / 20)  # pooled over examples
    assert out["client_accuracy_mean"] == pytest.approx(0.5625)
    assert out["client_accuracy_std"] == pytest.approx(float(per.std()))  # ddof = 1
    assert out["client_accuracy_min"] == 0.0
    assert out["client_accuracy_p10"] == pytest.approx(0.075)  # 0 + 0.3 * (0.25 - 0)
    model = _model()
    first = model[0]
    assert isinstance(first, nn.Linear)
    with torch.no_grad():
        first.weight.fill_(float("nan"))
    nan = global_local_metrics(model, TensorSplit.concat([_client(0).test]), [24], 64, 0)
    assert all(math.isnan(nan[k]) for k in CLIENT_SPREAD)
