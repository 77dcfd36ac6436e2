"""FedDyn (fedlore.algorithms.feddyn): its client and server states on hand-checkable cases, and
the drift correction they exist for.

* Two full-batch local steps follow the regularized objective's gradient
  ``∇L_k(θ) - h_k + α (θ - θ^{t-1})`` step by step, and the client keeps
  ``h_k - α (θ_k - θ^{t-1})``; at first contact (``h_k = 0``) the round is FedProx's with
  ``mu = α``.
* The server moves ``h`` by ``-(α / N) Σ Δ_k`` over the round's clients (partial participation:
  ``1 / N``, not ``1 / |P|``) and sets ``θ = mean θ_k - h / α``, against numbers worked out by
  hand, under both weightings and with a straggler; ``h`` stays the mean of all clients' ``h_k``.
* On two clients whose least-squares problems disagree, with many full-batch local steps,
  FedAvg stalls at a biased point and FedDyn reaches the global optimum.
* Frozen tensors have no ``h`` or ``h_k`` and are sent once; a client's minibatches come from
  its own generator.
* Settings it cannot honour are refused, naming them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from least_squares import (
    assert_draws_from_its_generator,
    checkpointed_states,
    frozen_bias_rounds,
    linear_model,
    make_algo,
    optimum,
    regression,
    train,
)

from fedlore.algorithms.fedavg import FedAvg, FedProx
from fedlore.algorithms.feddyn import DYN, FedDyn
from fedlore.config import ConfigError, load_config
from fedlore.experiment_parts import make_algorithm
from fedlore.tensors import load_model_arrays, select, with_prefix
from fedlore.train.local import task_loss
from fedlore.types import Reply, State


def _grad(weight: torch.Tensor, cid: int) -> torch.Tensor:
    """∇L_k at ``weight``: client ``cid``'s full-batch task-loss gradient."""
    model = linear_model()
    load_model_arrays(model, {"weight": weight})
    data = regression(cid)
    task_loss(model(data.train.x), data.train.y).backward()
    assert model.weight.grad is not None
    return model.weight.grad.detach()


def test_two_steps_follow_the_regularized_gradient_and_h_k_moves_by_alpha_delta() -> None:
    """θ1 = θ - η (g(θ) - h_k), θ2 = θ1 - η (g(θ1) - h_k + α (θ1 - θ)): the upload is θ2 - θ and
    the client keeps h_k - α (θ2 - θ) (a wrong sign of either term, or of the state's step,
    moves these by O(η))."""
    alpha, lr = 0.3, 0.05
    algo = make_algo(FedDyn, local_steps=2, alpha=alpha, num_clients=4)
    state = algo.init_server(linear_model(), torch.Generator())
    h_k = torch.tensor([[0.7, -1.5, 2.0]], dtype=torch.float64)
    msg = algo.broadcast(state, 0, 1)
    reply, kept = algo.client_update(
        msg,
        State(arrays=with_prefix({"weight": h_k}, DYN)),
        linear_model(),
        regression(1),
        torch.Generator(),
    )
    theta = select(msg.arrays, "model.")["weight"]
    theta1 = theta - lr * (_grad(theta, 1) - h_k)
    theta2 = theta1 - lr * (_grad(theta1, 1) - h_k + alpha * (theta1 - theta))
    torch.testing.assert_close(reply.arrays["update.weight"], theta2 - theta)
    torch.testing.assert_close(kept.arrays[DYN + "weight"], h_k - alpha * (theta2 - theta))
    assert set(reply.arrays) == {"update.weight"}  # h_k never leaves the client


def test_first_contact_is_fedprox_with_mu_alpha() -> None:
    """No state yet: h_k = 0, the local objective L_k + (α / 2) ||θ - θ^{t-1}||² (FedProx's)."""
    dyn = make_algo(FedDyn, alpha=0.2, num_clients=2)
    prox = make_algo(FedProx, mu=0.2)
    state = dyn.init_server(linear_model(), torch.Generator())
    msg = dyn.broadcast(state, 0, 0)
    got, kept = dyn.client_update(msg, None, linear_model(), regression(0), torch.Generator())
    want, _ = prox.client_update(msg, None, linear_model(), regression(0), torch.Generator())
    torch.testing.assert_close(got.arrays["update.weight"], want.arrays["update.weight"])
    torch.testing.assert_close(kept.arrays[DYN + "weight"], -0.2 * want.arrays["update.weight"])


THETA0 = [[1.0, 2.0, 3.0]]
H0 = [[0.2, -0.4, 0.1]]
DELTA_A = [[0.5, 0.5, 0.5]]
DELTA_B = [[-0.1, 0.3, 0.1]]
# α = 0.5, N = 4; clients a and b reply, a third is lost. By hand:
# uniform:      h = H0 - (0.5 / 4)(Δa + Δb) = H0 - 0.125 [0.4, 0.8, 0.6] = [0.15, -0.5, 0.025]
#               θ = θ0 + (Δa + Δb) / 2 - h / 0.5 = [1.2, 2.4, 3.3] - [0.3, -1, 0.05]
# examples 10, 30: mean Δ = (10 Δa + 30 Δb) / 40 = [0.05, 0.35, 0.2];
#               h = H0 - 0.5 (2 / 4) mean Δ = [0.1875, -0.4875, 0.05]
#               θ = [1.05, 2.35, 3.2] - [0.375, -0.975, 0.1]
# uniform, b a straggler at half its steps: the model's mean (Δa + Δb / 2) / 1.5 =
#               [0.3, 0.65 / 1.5, 0.55 / 1.5], h as under uniform (b moved its h_b by all of Δb)
# (1 / |P| for 1 / N would give h = [0.1, -0.6, -0.05] and θ = [1.0, 3.6, 3.4] under uniform)
HAND = {
    "uniform": ([0.15, -0.5, 0.025], [0.9, 3.4, 3.25], {}),
    "num_examples": ([0.1875, -0.4875, 0.05], [0.675, 3.325, 3.1], {}),
    "straggler": ([0.15, -0.5, 0.025], [1.0, 3 + 0.65 / 1.5, 2.95 + 0.55 / 1.5], {"b": 0.5}),
}


@pytest.mark.parametrize("case", list(HAND))
def test_the_server_updates_h_over_all_n_and_theta_as_worked_by_hand(case: str) -> None:
    """Two of N = 4 clients reply and one reply is lost: h and θ as worked out above."""
    weighting = "num_examples" if case == "num_examples" else "uniform"
    algo = make_algo(FedDyn, alpha=0.5, num_clients=4, weighting=weighting)
    state = algo.init_server(linear_model(), torch.Generator())
    f64 = torch.float64
    arrays = {
        "model.weight": torch.tensor(THETA0, dtype=f64),
        DYN + "weight": torch.tensor(H0, dtype=f64),
    }
    state = State(arrays={**state.arrays, **arrays})
    want_h, want_theta, shares = HAND[case]
    replies: list[tuple[int, Reply | None]] = [
        (
            cid,
            Reply(
                arrays={"update.weight": torch.tensor(d, dtype=f64)},
                metrics={"num_examples": n, "work_share": shares.get(name, 1.0)},
            ),
        )
        for cid, name, d, n in ((0, "a", DELTA_A, 10), (2, "b", DELTA_B, 30))
    ]
    new, _ = algo.aggregate(state, [*replies, (3, None)], 0)
    torch.testing.assert_close(new.arrays[DYN + "weight"], torch.tensor([want_h], dtype=f64))
    torch.testing.assert_close(new.arrays["model.weight"], torch.tensor([want_theta], dtype=f64))
    empty, _ = algo.aggregate(new, [(1, None)], 1)  # nobody replied: nothing moves
    assert all(torch.equal(empty.arrays[k], v) for k, v in new.arrays.items())


def test_h_stays_the_mean_of_every_clients_h_k_under_partial_participation() -> None:
    """Three clients, one or two a round (the others' h_k held at their last value, or 0): the
    server's h is (1 / 3) Σ_k h_k after every round, the paper's invariant."""
    algo = make_algo(FedDyn, alpha=0.1, num_clients=3, local_steps=5)
    state = algo.init_server(linear_model(), torch.Generator())
    kept: dict[int, State | None] = {0: None, 1: None, 2: None}
    for rnd, active in enumerate([(0,), (1, 2), (0, 2), (1,)]):
        replies: list[tuple[int, Reply | None]] = []
        for cid in active:
            data = regression(cid % 2, 24 + cid)
            msg = algo.broadcast(state, rnd, cid)
            reply, kept[cid] = algo.client_update(
                msg, kept[cid], linear_model(), data, torch.Generator().manual_seed(rnd)
            )
            replies.append((cid, reply))
        state, _ = algo.aggregate(state, replies, rnd)
        held = [s.arrays[DYN + "weight"] for s in kept.values() if s is not None]
        torch.testing.assert_close(state.arrays[DYN + "weight"], sum(held) / 3)


@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_feddyn_removes_the_client_drift_fedavg_keeps(weighting: str) -> None:
    """The global objective Σ_k p_k · ½ mean_k (x·w - y)² has its optimum w*; with 20
    full-batch local steps per round FedAvg's fixed point is off w*, FedDyn's is w* itself
    (h = 0 and h_k = ∇L_k(w*)), under uniform weights (the paper's) and under example weights
    with clients of 16 and 160 examples (its h then the weighted mean of the h_k: the uniform
    optimum is over 1 away). α = 0.5: at the default 0.01 the correction is slow here (0.12 off
    after 150 rounds; α trades the speed of the correction against the pull to θ^{t-1})."""
    sizes = (32, 32) if weighting == "uniform" else (16, 160)
    best = optimum(sizes, weighting == "uniform")
    other = optimum(sizes, weighting != "uniform")
    fedavg = train(make_algo(FedAvg, weighting=weighting, batch_size=160), 150, sizes) - best
    feddyn = train(
        make_algo(FedDyn, alpha=0.5, num_clients=2, weighting=weighting, batch_size=160),
        150,
        sizes,
    )
    assert fedavg.norm() > 0.05  # the drift: FedAvg settles elsewhere
    assert (feddyn - best).norm() < 1e-6 < fedavg.norm() / 1e4
    if weighting != "uniform":
        assert (other - best).norm() > 1.0


def test_frozen_tensors_have_no_gradient_state_and_are_sent_once() -> None:
    """``freeze`` leaves the bias out of training: h and h_k cover the weight only, the
    replies pass the engine's check, the server remembers the client (its ``seen`` flag
    survives FedDyn's aggregate) and sends the bias once, the client takes it from its cache
    after that, and the bias stays where it was (no ``- h / α`` for it)."""
    algo = make_algo(FedDyn, alpha=0.5, num_clients=1, freeze=("bias",))
    state, sent, kept = frozen_bias_rounds(algo, rounds=3)
    assert set(select(state.arrays, DYN)) == {"weight"}
    assert set(select(kept.arrays, DYN)) == {"weight"}
    assert "model.bias" in sent[0].arrays
    assert all("model.bias" not in msg.arrays for msg in sent[1:])
    torch.testing.assert_close(state.arrays["model.bias"], sent[0].arrays["model.bias"])


def test_the_local_run_draws_from_the_clients_generator() -> None:
    assert_draws_from_its_generator(make_algo(FedDyn, alpha=0.1, batch_size=8, local_steps=4))


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ("method.feddyn.alpha=0", "alpha must be > 0"),
        ("method.feddyn.alpha=-0.1", "alpha must be > 0"),
        ("method.feddyn.num_clients=5", "method.feddyn.num_clients: set num_clients instead"),
        ("secure_aggregation=true", "feddyn"),
        ("weighting=uniform dp.clip_norm=1 dp.noise_multiplier=1", "feddyn"),
        ("robust.aggregate=median", "robust.aggregate=median: method 'feddyn'"),
        ("server.optimizer=adam", "server.optimizer=adam.*'feddyn'"),
        ("transport_dtype=bf16", "transport_dtype=bf16: method 'feddyn'"),
    ],
)
def test_what_feddyn_cannot_honour_is_refused_by_name(setting: str, match: str) -> None:
    cfg = load_config(None, ["algorithms=[feddyn]", *setting.split()])
    with pytest.raises((ValueError, ConfigError), match=match):
        make_algorithm("feddyn", cfg)


def test_alpha_and_n_come_from_the_config() -> None:
    with pytest.raises(ValueError, match="alpha must be > 0"):
        FedDyn.of(alpha=0.0)
    algo = make_algorithm("feddyn", load_config(None, ["algorithms=[feddyn]", "num_clients=7"]))
    assert isinstance(algo, FedDyn) and algo.num_clients == 7 and algo.alpha == 0.01
    over = ["algorithms=[feddyn]", "method.feddyn.alpha=0.1"]
    assert make_algorithm("feddyn", load_config(None, over)).alpha == 0.1  # type: ignore[attr-defined]


def test_the_checkpoint_holds_every_clients_h_k(tmp_path: Path) -> None:
    """After round 0 the checkpointed client store holds each client's ``dyn.*`` (non-zero) and
    the server state its h (the kill-and-resume run of tests/engine/test_resume.py then
    continues from them)."""
    h, clients = checkpointed_states("feddyn", DYN, tmp_path)
    assert h and sum(float(v.abs().sum()) for v in h.values()) > 0
    assert len(clients) == 3
    for h_k in clients:
        assert h_k and sum(float(v.abs().sum()) for v in h_k.values()) > 0
