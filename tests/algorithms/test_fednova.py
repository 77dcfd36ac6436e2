"""FedNova (fedlore.algorithms.fednova): its normalizer ``η ‖a_i‖₁`` on hand-checkable cases, its
server step, and the objective inconsistency it exists for.

* ``a_norm`` is the paper's ``η ‖a_i‖₁``: ``Σ η_k`` for SGD, ``η Σ (1 - ρ^k) / (1 - ρ)`` for
  momentum (checked against the coefficients of the gradients in an unrolled momentum run on a
  quadratic), ``η Σ (1 - ημ)^k`` for the proximal term; a client reports it for the steps it took.
* With equal local work FedNova is FedAvg; the server's step is
  ``(Σ p_j A_j / Σ p_j) Σ p_i (Δ_i / A_i) / Σ p_i`` (buffers averaged as FedAvg's).
* A reply without a usable ``A_i`` is left out (with a warning naming it, unless its ``A_i`` is
  0); a 16-bit upload is normalized in the model's precision; frozen tensors are not normalized
  and are sent once; a client's minibatches come from its own generator.
* Two least-squares clients taking 1 and 10 full-batch steps a round: FedAvg converges near the
  optimum of the surrogate ``Σ p_i τ_i F_i``, FedNova near that of ``Σ p_i F_i``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
from least_squares import (
    assert_draws_from_its_generator,
    frozen_bias_rounds,
    linear_model,
    make_algo,
    regression,
)
from torch import nn

from fedlore.algorithms.fedavg import FedAvg
from fedlore.algorithms.fednova import A_NORM, NORMALIZED, FedNova, a_norm
from fedlore.config import ConfigError, load_config
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.experiment_parts import make_algorithm
from fedlore.settings import STEP_BUDGET
from fedlore.train.local import TrainStats
from fedlore.types import Reply, Scalar

_regression = regression
_model = linear_model


def _algo(cls: type[FedAvg], **extra: object) -> FedAvg:
    return make_algo(cls, **{"local_steps": 10, "batch_size": 64, **extra})


# ----------------------------------------------------------------------------- the normalizer


def test_a_norm_is_the_papers_l1_norm_in_its_three_cases() -> None:
    """SGD: Σ η_k (τ η at a constant rate); momentum ρ: η Σ_{k=1}^τ (1 - ρ^k) / (1 - ρ);
    proximal μ: η Σ_{k=0}^{τ-1} (1 - ημ)^k = (1 - (1 - ημ)^τ) / μ (Wang et al. 2020, Sec. 4)."""
    assert a_norm([0.1] * 7) == pytest.approx(0.7, rel=1e-14)
    assert a_norm([0.3, 0.2, 0.1]) == pytest.approx(0.6, rel=1e-14)
    rho, tau, eta = 0.9, 12, 0.05
    want = eta * sum((1 - rho**k) / (1 - rho) for k in range(1, tau + 1))
    assert a_norm([eta] * tau, momentum=rho) == pytest.approx(want, rel=1e-12)
    assert want > 4 * eta * tau  # momentum's steps count for far more than τ
    mu = 2.0
    assert a_norm([eta] * tau, mu=mu) == pytest.approx((1 - (1 - eta * mu) ** tau) / mu, 1e-12)
    assert a_norm([]) == 0.0


def test_momentum_a_norm_matches_the_unrolled_coefficients_on_a_quadratic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unroll momentum SGD on a quadratic (a full-batch least-squares client): the trained
    model's Δ equals -η Σ_j a_j g_j over the gradients g_j met at each step, with the paper's
    a_j = (1 - ρ^{τ-j+1}) / (1 - ρ), and the reply's a_norm is η Σ_j a_j."""
    rho, tau, eta = 0.8, 6, 0.05
    algo = _algo(FedNova, local_steps=tau, lr=eta, momentum=rho)
    model = _model()
    state = algo.init_server(model, torch.Generator())
    data = _regression(1)
    grads: list[torch.Tensor] = []
    import fedlore.algorithms.fedavg as fedavg_mod

    inner = fedavg_mod.local_train

    def record(m: nn.Module, k: int) -> None:
        assert isinstance(m, nn.Linear) and m.weight.grad is not None
        grads.append(m.weight.grad.clone())

    def spy(model: nn.Module, *args: Any, **kwargs: Any) -> TrainStats:
        kwargs["on_grad"] = [*kwargs["on_grad"], record]
        return inner(model, *args, **kwargs)

    monkeypatch.setattr(fedavg_mod, "local_train", spy)
    reply, _ = algo.client_update(algo.broadcast(state, 0, 1), None, model, data, torch.Generator())
    assert len(grads) == tau and not torch.allclose(grads[0], grads[-1])  # a real quadratic
    coef = [(1 - rho ** (tau - j)) / (1 - rho) for j in range(tau)]  # j = 0 .. τ-1
    want = -eta * sum(c * g for c, g in zip(coef, grads, strict=True))
    torch.testing.assert_close(reply.arrays["update.weight"], want, rtol=1e-12, atol=1e-14)
    assert reply.metrics[A_NORM] == pytest.approx(eta * sum(coef), rel=1e-12)


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, 3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


@pytest.mark.parametrize(
    ("momentum", "mu", "schedule", "skip"),
    [
        (0.0, 0.0, "cosine", None),
        (0.9, 0.0, "cosine", None),
        (0.5, 0.7, "constant", None),
        (0.0, 1.5, "cosine", None),
        (0.9, 0.3, "cosine", 2),
    ],
)
def test_a_norm_is_the_step_of_a_constant_unit_gradient(
    monkeypatch: pytest.MonkeyPatch, momentum: float, mu: float, schedule: str, skip: int | None
) -> None:
    """A linear loss <c, w> has the gradient c at every step, so the local run's Δ is exactly
    -A c: the reply's a_norm is the step a unit gradient takes under the round's schedule (its
    distinct step sizes), momentum and proximal term together, over the steps taken (a step
    whose loss is not finite, here the third, is skipped: it moves nothing and counts nothing)."""
    import fedlore.algorithms.fedavg as fedavg_mod

    algo = _algo(FedNova, local_steps=5, rounds=3, schedule=schedule, momentum=momentum, mu=mu)
    c = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64)
    x = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64)
    data = ClientData(0, TensorSplit(x, torch.zeros(1)), TensorSplit(x[:0], torch.zeros(0)))
    model = _Linear()
    state = algo.init_server(model, torch.Generator())
    inner = fedavg_mod.local_train
    calls: list[int] = []

    def linear_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        loss = (model.weight * c).sum()
        return loss * float("nan") if len(calls) - 1 == skip else loss

    def train(model: nn.Module, *args: Any, **kwargs: Any) -> TrainStats:
        kwargs["loss_fn"] = linear_loss
        return inner(model, *args, **kwargs)

    monkeypatch.setattr(fedavg_mod, "local_train", train)
    reply, _ = algo.client_update(algo.broadcast(state, 1, 0), None, model, data, torch.Generator())
    a = float(reply.metrics[A_NORM])
    torch.testing.assert_close(reply.arrays["update.weight"], -a * c, rtol=1e-12, atol=1e-14)
    lrs = algo.round_lrs(1, 1)
    assert reply.metrics["skipped_steps"] == (skip is not None)
    if schedule == "cosine":
        assert len(set(lrs)) == 5
    if skip is not None:
        taken = [lr for k, lr in enumerate(lrs) if k != skip]
        assert a == pytest.approx(a_norm(taken, momentum, mu), rel=1e-14)
        assert a < a_norm(lrs, momentum, mu)
    if momentum == 0 and mu == 0:
        assert a == pytest.approx(sum(lrs), rel=1e-14)


def test_a_straggler_reports_the_steps_it_took() -> None:
    """A cut round (STEP_BUDGET, clients.partial_work) of 3 of 10 steps reports 3 η; under
    local_epochs a client of n examples reports E ⌈n / B⌉ η."""
    algo = _algo(FedNova)
    model = _model()
    state = algo.init_server(model, torch.Generator())
    token = STEP_BUDGET.set(3)
    try:
        reply, _ = algo.client_update(
            algo.broadcast(state, 0, 0), None, model, _regression(0), torch.Generator()
        )
    finally:
        STEP_BUDGET.reset(token)
    assert reply.metrics[A_NORM] == pytest.approx(3 * 0.05, rel=1e-14)
    epochs = FedNova.of(lr=0.05, local_epochs=2, batch_size=8)
    reply, _ = epochs.client_update(
        epochs.broadcast(state, 0, 0), None, _model(), _regression(0, n=20), torch.Generator()
    )
    assert reply.metrics[A_NORM] == pytest.approx(2 * 3 * 0.05, rel=1e-14)


# ----------------------------------------------------------------------------- the server


def test_the_server_step_normalizes_each_delta_by_its_a_norm() -> None:
    """p = (10, 30), A = (0.1, 0.5): x + (Σ p A / Σ p) Σ p (Δ / A) / Σ p over the accepted
    replies (a lost one, listed first, and one with a_norm 0 left out; a straggler's
    work_share discounts nothing); tau_eff_lr is Σ p A / Σ p. Buffers (BatchNorm's) get
    FedAvg's mean delta."""
    algo = _algo(FedNova, weighting="num_examples")
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).double()
    state = algo.init_server(model, torch.Generator())
    assert json.loads(str(state.values[NORMALIZED])) == ["0.weight", "0.bias", "1.weight", "1.bias"]

    def reply(s: float, n: int, a: float, share: float = 1.0) -> Reply:
        arrays = {
            "update." + k[6:]: torch.full_like(v, s)
            for k, v in state.arrays.items()
            if k.startswith("model.")
        }
        return Reply(arrays=arrays, metrics={"num_examples": n, A_NORM: a, "work_share": share})

    replies: list[tuple[int, Reply | None]] = [
        (2, None),  # first: the replies after a lost one count
        (0, reply(1.0, 10, 0.1, share=0.3)),
        (3, reply(7.0, 50, 0.0)),
        (1, reply(-2.0, 30, 0.5)),
    ]
    new, metrics = algo.aggregate(state, replies, 0)
    tau = (10 * 0.1 + 30 * 0.5) / 40
    assert metrics["tau_eff_lr"] == pytest.approx(tau) and metrics["aggregated"] == 2
    step = tau * (10 * 1.0 / 0.1 + 30 * -2.0 / 0.5) / 40
    for k in ("0.weight", "0.bias", "1.weight", "1.bias"):
        v = state.arrays["model." + k]
        torch.testing.assert_close(new.arrays["model." + k], v + step, msg=k)
    fedavg = _algo(FedAvg, weighting="num_examples")
    plain = [(c, reply(s, n, a)) for c, s, n, a in ((0, 1.0, 10, 0.1), (1, -2.0, 30, 0.5))]
    buffers, _ = fedavg.aggregate(state, list(plain), 0)
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(new.arrays["model.1." + k], buffers.arrays["model.1." + k]), k


def _train(
    algo: FedAvg, rounds: int, budgets: tuple[int, int], sizes: tuple[int, int]
) -> torch.Tensor:
    """Full participation of the two regression clients, full-batch steps, client i cut to
    ``budgets[i]`` steps a round (STEP_BUDGET: heterogeneous local work), in process."""
    model = _model()
    state = algo.init_server(model, torch.Generator())
    clients = [_regression(c, n) for c, n in zip((0, 1), sizes, strict=True)]
    for rnd in range(rounds):
        replies: list[tuple[int, Reply | None]] = []
        for cid in (0, 1):
            token = STEP_BUDGET.set(budgets[cid])
            try:
                reply, _ = algo.client_update(
                    algo.broadcast(state, rnd, cid),
                    None,
                    _model(),
                    clients[cid],
                    torch.Generator().manual_seed(rnd),
                )
            finally:
                STEP_BUDGET.reset(token)
            replies.append((cid, reply))
        state, _ = algo.aggregate(state, replies, rnd)
    return state.arrays["model.weight"].flatten()


def _optimum(weights: tuple[float, float], sizes: tuple[int, int]) -> torch.Tensor:
    """argmin Σ_i w_i · ½ mean_i (x·w - y)²."""
    clients = [_regression(c, n) for c, n in zip((0, 1), sizes, strict=True)]
    hessian = sum(
        w * d.train.x.T @ d.train.x / len(d.train) for w, d in zip(weights, clients, strict=True)
    )
    rhs = sum(
        w * d.train.x.T @ d.train.y / len(d.train) for w, d in zip(weights, clients, strict=True)
    )
    return torch.linalg.solve(hessian, rhs).flatten()


def test_equal_local_work_makes_fednova_fedavg() -> None:
    """Every client takes the same steps: all A_i are equal and FedNova's step is FedAvg's,
    under example weights (clients of 16 and 48 examples), over two rounds."""
    sizes = (16, 48)
    fedavg = _train(_algo(FedAvg, weighting="num_examples"), 2, (10, 10), sizes)
    fednova = _train(_algo(FedNova, weighting="num_examples"), 2, (10, 10), sizes)
    assert (fedavg - _model().weight.detach().flatten()).norm() > 1.0  # it moved
    torch.testing.assert_close(fednova, fedavg, rtol=1e-12, atol=1e-12)


def _fixed_point(
    p: tuple[float, float], taus: tuple[int, int], eta: float, sizes: tuple[int, int], nova: bool
) -> torch.Tensor:
    """Where FedAvg (or FedNova) stops moving in closed form: client i's τ_i full-batch steps
    give Δ_i = -(I - (I - η H_i)^τ_i)(x - x_i*), so the server's step vanishes where
    Σ c_i (I - (I - η H_i)^τ_i)(x - x_i*) = 0, with c_i = p_i (FedAvg) or p_i / (η τ_i)
    (FedNova: each Δ_i over its A_i = η τ_i)."""
    clients = [_regression(c, n) for c, n in zip((0, 1), sizes, strict=True)]
    eye = torch.eye(3, dtype=torch.float64)
    system = torch.zeros(3, 3, dtype=torch.float64)
    rhs = torch.zeros(3, 1, dtype=torch.float64)
    for pi, tau, d in zip(p, taus, clients, strict=True):
        h = d.train.x.T @ d.train.x / len(d.train)
        own = torch.linalg.solve(h, (d.train.x.T @ d.train.y / len(d.train)).unsqueeze(1))
        c = pi / (eta * tau) if nova else pi
        m = c * (eye - torch.linalg.matrix_power(eye - eta * h, tau))
        system, rhs = system + m, rhs + m @ own
    return torch.linalg.solve(system, rhs).flatten()


@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_fednova_removes_the_objective_inconsistency_of_fedavg(weighting: str) -> None:
    """Client 0 takes 1 full-batch step a round, client 1 ten (Wang et al. 2020, Sec. 3):
    FedAvg optimizes the surrogate Σ p_i τ_i F_i, FedNova the true Σ p_i F_i.

    Both runs reach their closed-form fixed points (1e-7); FedAvg's is 0.02-0.03 of the gap
    between the two optima from the surrogate's optimum, FedNova's 0.08-0.09 from the true one
    (the O(η τ) drift of local steps at η = 0.02, which vanishes with η: 4e-4 at η = 1e-4, where
    FedAvg's point stays at the surrogate's)."""
    sizes, taus, eta = (16, 48), (1, 10), 0.02
    p = (1.0, 1.0) if weighting == "uniform" else (16.0, 48.0)
    true = _optimum(p, sizes)
    surrogate = _optimum((p[0] * taus[0], p[1] * taus[1]), sizes)
    gap = float((true - surrogate).norm())
    assert gap > 1.0  # the two objectives disagree
    fedavg = _train(_algo(FedAvg, lr=eta, weighting=weighting), 300, taus, sizes)
    fednova = _train(_algo(FedNova, lr=eta, weighting=weighting), 300, taus, sizes)
    torch.testing.assert_close(fedavg, _fixed_point(p, taus, eta, sizes, False), rtol=0, atol=1e-7)
    torch.testing.assert_close(fednova, _fixed_point(p, taus, eta, sizes, True), rtol=0, atol=1e-7)
    assert (fedavg - surrogate).norm() < 0.03 * gap  # FedAvg: the wrong objective
    assert (fedavg - true).norm() > 0.95 * gap
    assert (fednova - true).norm() < 0.1 * gap  # FedNova: the right one
    assert (fednova - true).norm() < 0.1 * (fedavg - true).norm()
    small = 1e-4  # the local-drift term vanishes with η, the inconsistency does not
    assert (_fixed_point(p, taus, small, sizes, True) - true).norm() < 1e-3 * gap
    assert (_fixed_point(p, taus, small, sizes, False) - surrogate).norm() < 1e-3 * gap


# ----------------------------------------------------------------------------- settings


def test_bad_settings_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="mu must be >= 0"):
        _algo(FedNova, mu=-0.1)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
        _algo(FedNova, momentum=1.0)
    with pytest.raises(ValueError, match="local_optimizer must be 'sgd'"):
        _algo(FedNova, local_optimizer="adamw")
    bad = load_config(None, ["algorithms=[fednova]", "method.fednova.mu=-1"])
    with pytest.raises((ValueError, ConfigError), match="mu"):
        make_algorithm("fednova", bad)
    for extra in ("secure_aggregation=true", "robust.aggregate=median"):
        cfg = load_config(None, ["algorithms=[fednova]", extra])
        with pytest.raises(ConfigError, match="fednova"):
            make_algorithm("fednova", cfg)
    ok = make_algorithm("fednova", load_config(None, ["algorithms=[fednova]"]))
    assert isinstance(ok, FedNova) and ok.mu == 0.0 and ok.momentum == 0.0


def test_a_reply_without_a_usable_a_norm_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    """An a_norm that is missing, not finite, negative or not a number (a bool) is left out
    with a warning naming the round, the client and the value; 0 (a round of zero step sizes,
    nothing learnt) is left out silently."""
    algo = _algo(FedNova)
    state = algo.init_server(_model(), torch.Generator())
    up = {"update.weight": torch.ones(1, 3, dtype=torch.float64)}
    bad: list[Scalar] = [float("nan"), -1.0, float("inf"), True]
    replies: list[tuple[int, Reply | None]] = [
        (0, Reply(arrays=up, metrics={"num_examples": 4})),
        *(
            (c, Reply(arrays=up, metrics={"num_examples": 4, A_NORM: a}))
            for c, a in enumerate(bad, 1)
        ),
        (7, Reply(arrays=up, metrics={"num_examples": 4, A_NORM: 0.0})),
    ]
    with caplog.at_level(logging.WARNING, logger="fedlore.algorithms.fednova"):
        new, metrics = algo.aggregate(state, replies, 5)
    assert metrics["aggregated"] == 0
    torch.testing.assert_close(new.arrays["model.weight"], state.arrays["model.weight"])
    assert [r.getMessage() for r in caplog.records] == [
        f"round 5: client {c} sent no usable a_norm ({a!r}): left out"
        for c, a in enumerate([None, *bad])
    ]


def test_a_16_bit_upload_is_normalized_in_the_models_precision() -> None:
    """Under ``transport_dtype: bf16`` the Δ_i arrive in bfloat16; the server upcasts them to
    the model's float64 before dividing by A_i (a quotient such as 1 · 0.2 / 0.3 rounded to
    bfloat16 would move the model by 1e-3 elsewhere)."""
    algo = _algo(FedNova, transport_dtype="bf16")
    state = algo.init_server(_model(), torch.Generator())
    up = {"update.weight": torch.ones(1, 3, dtype=torch.bfloat16)}
    replies: list[tuple[int, Reply | None]] = [
        (c, Reply(arrays=dict(up), metrics={"num_examples": 4, A_NORM: a}))
        for c, a in ((0, 0.1), (1, 0.3))
    ]
    new, metrics = algo.aggregate(state, replies, 0)
    assert metrics["tau_eff_lr"] == pytest.approx(0.2)
    step = (0.2 / 0.1 + 0.2 / 0.3) / 2
    want = state.arrays["model.weight"] + step
    torch.testing.assert_close(new.arrays["model.weight"], want, rtol=1e-12, atol=1e-12)


def test_frozen_tensors_are_not_normalized_and_are_sent_once() -> None:
    """``freeze`` leaves the bias out of training: the normalized tensors are the weight only,
    the replies pass the engine's check, the bias is sent once and then taken from the
    client's cache, and it stays where it was."""
    algo = _algo(FedNova, freeze=("bias",))
    state, sent, _ = frozen_bias_rounds(algo, rounds=3)
    assert json.loads(str(state.values[NORMALIZED])) == ["weight"]
    assert "model.bias" in sent[0].arrays
    assert all("model.bias" not in msg.arrays for msg in sent[1:])
    torch.testing.assert_close(state.arrays["model.bias"], sent[0].arrays["model.bias"])


def test_the_local_run_draws_from_the_clients_generator() -> None:
    assert_draws_from_its_generator(_algo(FedNova, batch_size=8, local_steps=4))
