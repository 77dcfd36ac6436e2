"""q-FFL / q-FedAvg (fedlore.algorithms.qffl): the server step worked out by hand, its reduction
to FedAvg at q = 0, one full-batch local step as q-FedSGD, the client's F_k, the limits at
F_k = 0, and the fairness it exists for.

* Two clients, L = 10: Δ_k = F_k^q L (w^t - w̄_k), h_k = q F_k^{q-1} ‖ΔW_k‖² + L F_k^q and
  w^{t+1} = w^t - Σ p_k Δ_k / Σ p_k h_k, the numbers done by hand at q = 1 and 2, uniform and
  n_k weights, q = 0.5 with a client of loss 0, an explicit L.
* q = 0 is the plain mean of the client models under uniform weights, FedAvg's weighted mean
  under n_k, whatever L; with one full-batch local step the step is q-FedSGD's (Algorithm 1) on
  the exact gradients.
* Three least-squares clients of different optima: a larger q lowers the worst client's loss
  and the spread of the losses.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from least_squares import (
    assert_draws_from_its_generator,
    frozen_bias_rounds,
    linear_model,
    regression,
)
from torch import nn

from fedlore import checks
from fedlore.algorithms.fedavg import FedAvg
from fedlore.algorithms.qffl import LOSS, QFFL, TRAINED, qffl_scales, split_loss
from fedlore.config import ConfigError, load_config
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.device import training_precision
from fedlore.experiment_parts import make_algorithm
from fedlore.train.local import task_loss
from fedlore.types import Reply, Scalar, State


def _algo(**extra: object) -> QFFL:
    common = {"lr": 0.1, "local_steps": 5, "batch_size": 32, "weighting": "uniform"}
    return QFFL.of(**{**common, **extra})


def _two_weights() -> tuple[nn.Module, torch.Tensor]:
    """A bias-free linear model 2 -> 1 in float64 with w^t = (1, 2)."""
    model = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]], dtype=torch.float64))
    return model, model.weight.detach().clone()


def _reply(delta: list[float], n: int, loss: float, **metrics: Scalar) -> Reply:
    update = torch.tensor([delta], dtype=torch.float64)
    return Reply(
        arrays={"update.weight": update}, metrics={"num_examples": n, LOSS: loss, **metrics}
    )


# Client A: w̄ - w^t = (-0.1, 0), F = 2, n = 1; client B: (0, 0.2), F = 0.5, n = 3. With L = 10:
# ΔW_A = (1, 0), ‖ΔW_A‖² = 1; ΔW_B = (0, -2), ‖ΔW_B‖² = 4.
A = ([-0.1, 0.0], 1, 2.0)
B = ([0.0, 0.2], 3, 0.5)


@pytest.mark.parametrize(
    ("q", "weighting", "want", "share"),
    [
        # Δ_A = 2 (1, 0), h_A = 1 + 20 = 21; Δ_B = 0.5 (0, -2), h_B = 4 + 5 = 9
        (1.0, "uniform", [1 - 2 / 30, 2 + 1 / 30], 25 / 30),
        # Δ_A = 4 (1, 0), h_A = 2·2·1 + 10·4 = 44; Δ_B = (0, -0.5), h_B = 2·0.5·4 + 2.5 = 6.5
        (2.0, "uniform", [1 - 4 / 50.5, 2 + 0.5 / 50.5], 42.5 / 50.5),
        # p = (1, 3): Σ p Δ = (2, -3), Σ p h = 21 + 27 = 48
        (1.0, "num_examples", [1 - 2 / 48, 2 + 3 / 48], 35 / 48),
        # q = 0: Δ_k = ΔW_k, h_k = L: the mean of the client models, (0.95, 2.1)
        (0.0, "uniform", [1 - 0.05, 2 + 0.1], 1.0),
        # q = 0.5: Δ_A = √2 (1, 0), h_A = 0.5/√2 + 10√2; Δ_B = √0.5 (0, -2), h_B = 2/√0.5 + 10√0.5
        (
            0.5,
            "uniform",
            [
                1
                - math.sqrt(2)
                / (
                    0.5 / math.sqrt(2)
                    + 10 * math.sqrt(2)
                    + 2 / math.sqrt(0.5)
                    + 10 * math.sqrt(0.5)
                ),
                2
                + 2
                * math.sqrt(0.5)
                / (
                    0.5 / math.sqrt(2)
                    + 10 * math.sqrt(2)
                    + 2 / math.sqrt(0.5)
                    + 10 * math.sqrt(0.5)
                ),
            ],
            (10 * math.sqrt(2) + 10 * math.sqrt(0.5))
            / (0.5 / math.sqrt(2) + 10 * math.sqrt(2) + 2 / math.sqrt(0.5) + 10 * math.sqrt(0.5)),
        ),
    ],
)
def test_the_server_step_by_hand(q: float, weighting: str, want: list[float], share: float) -> None:
    """The two clients above (a lost reply listed first): the new weights, the round's largest
    loss and ``qffl_step_share`` = Σ p L F^q / Σ p h."""
    algo = _algo(q=q, weighting=weighting)
    assert algo.lipschitz_estimate == 10.0  # 1 / lr
    model, _ = _two_weights()
    state = algo.init_server(model, torch.Generator())
    replies: list[tuple[int, Reply | None]] = [(2, None), (0, _reply(*A)), (1, _reply(*B))]
    new, metrics = algo.aggregate(state, replies, 0)
    got = new.arrays["model.weight"].flatten().tolist()
    assert got == pytest.approx(want, rel=1e-13, abs=1e-15)
    assert metrics["aggregated"] == 2
    assert metrics["qffl_loss_max"] == 2.0
    assert metrics["qffl_step_share"] == pytest.approx(share, rel=1e-13)


def test_an_explicit_lipschitz_constant_replaces_one_over_lr() -> None:
    """L = 2, q = 1, uniform: ΔW_A = 2 (0.1, 0) = (0.2, 0), Δ_A = (0.4, 0), h_A = 0.04 + 4;
    ΔW_B = (0, -0.4), Δ_B = (0, -0.2), h_B = 0.16 + 1."""
    algo = _algo(q=1.0, lipschitz=2.0)
    assert algo.lipschitz_estimate == 2.0
    model, _ = _two_weights()
    new, _ = algo.aggregate(
        algo.init_server(model, torch.Generator()), [(0, _reply(*A)), (1, _reply(*B))], 0
    )
    h = 0.04 + 4 + 0.16 + 1
    assert new.arrays["model.weight"].flatten().tolist() == pytest.approx(
        [1 - 0.4 / h, 2 + 0.2 / h], rel=1e-13
    )


def test_a_client_of_loss_zero() -> None:
    """F_C = 0. At q = 0.5 (q F^{q-1} infinite) C contributes Δ_C = 0 and h_C = 0 (the limit):
    the step is that of A and B alone. At q = 1 the formula is finite and kept: h_C = ‖ΔW_C‖²
    (here 18) joins the denominator. At q = 0, FedAvg: C's model counts as any other. Every
    loss 0 at q > 0: no step."""
    c = ([0.3, -0.3], 2, 0.0)
    model, w = _two_weights()
    for q in (0.5, 1.0, 0.0, 3.0):
        algo = _algo(q=q)
        state = algo.init_server(model, torch.Generator())
        with_c, _ = algo.aggregate(state, [(0, _reply(*A)), (1, _reply(*B)), (2, _reply(*c))], 0)
        without, _ = algo.aggregate(state, [(0, _reply(*A)), (1, _reply(*B))], 0)
        got = with_c.arrays["model.weight"].flatten()
        assert torch.isfinite(got).all()
        if q == 0.5 or q == 3.0:  # h_C = 0 (the limit; and 0^2 = 0 at q = 3)
            torch.testing.assert_close(
                got, without.arrays["model.weight"].flatten(), rtol=1e-13, atol=0
            )
        elif q == 1.0:
            h = 21 + 9 + 18
            torch.testing.assert_close(
                got, torch.tensor([1 - 2 / h, 2 + 1 / h], dtype=torch.float64), rtol=1e-13, atol=0
            )
        else:
            mean = (
                w.flatten()
                + torch.tensor([-0.1 + 0.0 + 0.3, 0.0 + 0.2 - 0.3], dtype=torch.float64) / 3
            )
            torch.testing.assert_close(got, mean, rtol=1e-13, atol=0)
    zero = ([0.3, -0.3], 2, 0.0)
    algo = _algo(q=1.0)
    state = algo.init_server(model, torch.Generator())
    new, metrics = algo.aggregate(state, [(0, _reply(*zero)), (1, _reply(*zero))], 0)
    assert torch.equal(new.arrays["model.weight"], w)
    assert metrics["qffl_step_share"] == 0.0


def test_the_scales_do_not_overflow_at_a_large_q() -> None:
    """F^q at q = 2000 overflows a float for F = 3; the scales are computed with F / max F, so
    they stay finite and put the step on the client of the largest loss (q -> ∞: minimax)."""
    with pytest.raises(OverflowError):
        _ = 3.0**2000
    s = qffl_scales([3.0, 2.9, 0.5], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], 2000.0, 10.0)
    assert all(math.isfinite(x) for x in s)
    assert s[1] < 1e-20 * s[0] and s[2] == 0.0
    # the one client left: s = L / (h / 3), h = q ‖ΔW‖² / F + L (in units of F^q)
    assert s[0] == pytest.approx(10.0 / ((2000 * 1.0 / 3.0 + 10.0) / 3), rel=1e-12)
    assert qffl_scales([0.0, 0.0], [5.0, 1.0], [1.0, 2.0], 0.0, 10.0) == [1.0, 1.0]


def test_the_scales_refuse_lists_of_other_lengths() -> None:
    """One loss, one ‖ΔW‖² and one weight per client: a list of another length is refused, not
    cut to the shortest (which would drop a client's weight from Σ p h)."""
    for sq, weights in (([1.0], [1.0, 1.0]), ([1.0, 1.0], [1.0]), ([1.0, 1.0], [1.0, 1.0, 1.0])):
        with pytest.raises(ValueError, match=r"zip\(\) argument 2 is (shorter|longer)"):
            qffl_scales([2.0, 1.0], sq, weights, 1.0, 10.0)


# ----------------------------------------------------------------------------- q = 0 and q-FedSGD


def _clients(sizes: tuple[int, ...] = (32, 32, 32)) -> list[ClientData]:
    return [regression(c, n) for c, n in enumerate(sizes)]


def _round(
    algo: FedAvg, state: State, clients: list[ClientData], rnd: int = 0
) -> list[tuple[int, Reply | None]]:
    out: list[tuple[int, Reply | None]] = []
    for data in clients:
        reply, _ = algo.client_update(
            algo.broadcast(state, rnd, data.client_id),
            None,
            linear_model(),
            data,
            torch.Generator().manual_seed(rnd),
        )
        out.append((data.client_id, reply))
    return out


def test_q0_is_the_unweighted_mean_of_the_client_models() -> None:
    """weighting: uniform, q = 0, any L: w^{t+1} = (1/m) Σ w̄_k, the client models' plain mean
    (clients of 32, 8 and 20 examples: a weighted mean would differ)."""
    clients = _clients((32, 8, 20))
    for lip in (None, 123.0):
        algo = _algo(q=0.0, lipschitz=lip)
        state = algo.init_server(linear_model(), torch.Generator())
        w = state.arrays["model.weight"]
        replies = _round(algo, state, clients)
        models = [w + r.arrays["update.weight"] for _, r in replies if r is not None]
        new, _ = algo.aggregate(state, replies, 0)
        torch.testing.assert_close(
            new.arrays["model.weight"], sum(models) / 3, rtol=1e-13, atol=1e-15
        )
        weighted = (
            sum((n * m for n, m in zip((32, 8, 20), models, strict=True)), torch.zeros_like(w)) / 60
        )
        assert not torch.allclose(new.arrays["model.weight"], weighted, rtol=1e-6)


def test_q0_under_example_weights_is_fedavg() -> None:
    """weighting: num_examples, q = 0: FedAvg's n-weighted mean, round after round (the same
    clients' replies: qffl's are FedAvg's plus its loss)."""
    clients = _clients((32, 8, 20))
    q0 = _algo(q=0.0, weighting="num_examples")
    fedavg = FedAvg.of(lr=0.1, local_steps=5, batch_size=32, weighting="num_examples")
    a = q0.init_server(linear_model(), torch.Generator())
    b = fedavg.init_server(linear_model(), torch.Generator())
    for rnd in range(4):
        ra, rb = _round(q0, a, clients, rnd), _round(fedavg, b, clients, rnd)
        for (_, x), (_, y) in zip(ra, rb, strict=True):
            assert x is not None and y is not None
            assert torch.equal(x.arrays["update.weight"], y.arrays["update.weight"])
        a, _ = q0.aggregate(a, ra, rnd)
        b, _ = fedavg.aggregate(b, rb, rnd)
        torch.testing.assert_close(
            a.arrays["model.weight"], b.arrays["model.weight"], rtol=1e-12, atol=1e-14
        )


@pytest.mark.parametrize("q", [0.5, 1.0, 3.0])
def test_one_full_batch_step_is_q_fedsgd(q: float) -> None:
    """One local step on the whole split: w̄_k = w^t - η ∇F_k(w^t), so ΔW_k = ∇F_k(w^t) with
    L = 1/η, and the round is q-FedSGD (the paper's Algorithm 1):
    w^{t+1} = w^t - Σ F_k^q ∇F_k / Σ (q F_k^{q-1} ‖∇F_k‖² + L F_k^q), with F_k the clients'
    losses at w^t (uniform weights; here the Gaussian NLL of a linear regression)."""
    algo = _algo(q=q, local_steps=1, batch_size=64, lr=0.05)
    clients = _clients((32, 24, 40))
    state = algo.init_server(linear_model(), torch.Generator())
    w = state.arrays["model.weight"]
    new, _ = algo.aggregate(state, _round(algo, state, clients), 0)
    num, den = torch.zeros_like(w), 0.0
    for data in clients:
        wk = w.clone().requires_grad_(True)
        f = task_loss(data.train.x @ wk.T, data.train.y)
        (g,) = torch.autograd.grad(f, wk)
        fk = float(f.detach())
        num += fk**q * g
        den += q * fk ** (q - 1) * float(g.pow(2).sum()) + 20.0 * fk**q
    torch.testing.assert_close(new.arrays["model.weight"], w - num / den, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- the client


def test_the_client_reports_its_loss_at_the_start_and_fedavgs_delta() -> None:
    """``qffl_loss`` is F_k(w^t), the received model's mean task loss on the client's whole
    training split (not the local steps' mean); the upload is FedAvg's delta, bit for bit. Under
    ``loss_at="local"`` it is the local steps' mean loss, the reply's ``train_loss``."""
    data = regression(1, n=40)
    algo = _algo(batch_size=8)
    state = algo.init_server(linear_model(), torch.Generator())
    w = state.arrays["model.weight"]
    reply, kept = algo.client_update(
        algo.broadcast(state, 0, 1), None, linear_model(), data, torch.Generator().manual_seed(5)
    )
    want = float(task_loss(data.train.x @ w.T, data.train.y))
    assert reply.metrics[LOSS] == pytest.approx(want, rel=1e-12)
    assert reply.metrics[LOSS] != pytest.approx(reply.metrics["train_loss"], rel=1e-3)
    fedavg = FedAvg.of(lr=0.1, local_steps=5, batch_size=8, weighting="uniform")
    plain, _ = fedavg.client_update(
        fedavg.broadcast(state, 0, 1), None, linear_model(), data, torch.Generator().manual_seed(5)
    )
    assert reply.arrays.keys() == plain.arrays.keys() == {"update.weight"}
    assert torch.equal(reply.arrays["update.weight"], plain.arrays["update.weight"])
    assert kept.arrays == {} and kept.values == {}
    local = _algo(batch_size=8, loss_at="local")
    reply, _ = local.client_update(
        local.broadcast(state, 0, 1), None, linear_model(), data, torch.Generator().manual_seed(5)
    )
    assert reply.metrics[LOSS] == reply.metrics["train_loss"] == plain.metrics["train_loss"]


def test_split_loss_is_the_mean_over_examples_or_counted_tokens() -> None:
    """Over minibatches of unequal size (3, 3, 2) the loss is the mean over all examples, not
    the mean of the batches' means; for token targets, over the tokens that count."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double().requires_grad_(False)
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 2, 2])
    got = split_loss(model, TensorSplit(x, y), batch_size=3)
    assert got == pytest.approx(float(nn.functional.cross_entropy(model(x), y)), rel=1e-13)
    tokens = torch.tensor([[0, 1, -100], [2, -100, -100], [1, 1, 1]])
    seqs = torch.randn(3, 3, 4, dtype=torch.float64)
    got = split_loss(model, TensorSplit(seqs, tokens), batch_size=2)
    keep = tokens.flatten() != -100
    want = nn.functional.cross_entropy(model(seqs).flatten(0, 1)[keep], tokens.flatten()[keep])
    assert got == pytest.approx(float(want), rel=1e-13)
    assert math.isnan(split_loss(model, TensorSplit(seqs[:1], torch.full((1, 3), -100))))
    # a batch where nothing counts is skipped, not a NaN in the sum
    gap = torch.cat([tokens[:1], torch.full((1, 3), -100), tokens[1:]])
    got = split_loss(model, TensorSplit(torch.cat([seqs[:1], seqs]), gap), batch_size=1)
    assert got == pytest.approx(float(want), rel=1e-13)


def test_real_targets_count_per_example_whatever_their_value() -> None:
    """Regression targets ([B] or [B, 2]) of value -100.0 (the ignore index of token targets)
    are examples like any other: F_k is the mean Gaussian NLL over all examples, over batches
    of unequal size."""
    torch.manual_seed(0)
    for d in (1, 2):
        model = nn.Linear(4, d).double().requires_grad_(False)
        x = torch.randn(5, 4, dtype=torch.float64)
        y = torch.randn(5, d, dtype=torch.float64)
        y[0, 0] = -100.0
        y = y.squeeze(1) if d == 1 else y
        got = split_loss(model, TensorSplit(x, y), batch_size=2)
        out = model(x).squeeze(1) if d == 1 else model(x)
        assert got == pytest.approx(float(task_loss(out, y)), rel=1e-13)


def test_the_loss_is_taken_in_the_training_forwards_precision() -> None:
    """Under ``precision: bf16`` the forward pass that measures F_k runs in bf16 autocast, as
    local training's does (a float32 model: its loss differs from the full-precision one)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).requires_grad_(False)
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 2, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = float(task_loss(model(x), y))
    assert want != pytest.approx(float(task_loss(model(x), y)), rel=1e-6)
    with training_precision("bf16"):
        assert split_loss(model, TensorSplit(x, y)) == pytest.approx(want, rel=1e-6)


def test_the_pass_that_measures_the_loss_counts_in_the_clients_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fedlore.algorithms.qffl as qffl_mod

    def slow(model: nn.Module, split: TensorSplit) -> float:
        time.sleep(0.2)
        return 1.0

    monkeypatch.setattr(qffl_mod, "split_loss", slow)
    algo = _algo(local_steps=1)
    state = algo.init_server(linear_model(), torch.Generator())
    t0 = time.perf_counter()
    reply, _ = algo.client_update(
        algo.broadcast(state, 0, 0), None, linear_model(), regression(0), torch.Generator()
    )
    wall = time.perf_counter() - t0
    assert isinstance(reply.metrics["train_s"], float)
    assert reply.metrics[LOSS] == 1.0 and 0.2 <= reply.metrics["train_s"] <= wall


def test_the_local_run_draws_from_the_clients_generator() -> None:
    assert_draws_from_its_generator(_algo(batch_size=8))


def test_the_loss_is_measured_in_eval_mode_on_the_received_model() -> None:
    """A dropout model: F_k is the deterministic eval-mode loss of w^t (measured twice with other
    global seeds, the same), whatever the scratch model held before."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1)).double()
    algo = _algo(batch_size=8)
    state = algo.init_server(net, torch.Generator())
    data = regression(0)
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        scratch = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1)).double()
        reply, _ = algo.client_update(
            algo.broadcast(state, 0, 0), None, scratch, data, torch.Generator()
        )
        losses.append(reply.metrics[LOSS])
    net.eval()
    with torch.no_grad():
        want = float(task_loss(net(data.train.x), data.train.y))
    assert losses == [pytest.approx(want, rel=1e-12)] * 2


# ----------------------------------------------------------------------------- the server's checks


@pytest.mark.parametrize("loss", [None, float("nan"), float("inf"), -0.5, True, "1.0"])
def test_a_reply_without_a_usable_loss_is_rejected(loss: object) -> None:
    algo = _algo()
    model, _ = _two_weights()
    state = algo.init_server(model, torch.Generator())
    metrics: dict[str, object] = {"num_examples": 3}
    if loss is not None:
        metrics[LOSS] = loss
    reply = Reply(arrays={"update.weight": torch.zeros(1, 2, dtype=torch.float64)}, metrics=metrics)  # type: ignore[arg-type]
    why = algo.reply_problem(state, 0, 4, reply)
    assert why == f"qffl_loss must be a finite number >= 0 (the client's loss F_k), got {loss!r}"
    assert algo.reply_problem(state, 0, 4, _reply([0.0, 0.0], 3, 0.0)) is None


def test_lost_replies_reach_fedavgs_bookkeeping() -> None:
    """A lost client's frozen tensors are sent again (FedAvg's ``seen.<id>`` dropped), in a
    round with other replies and in a round where every reply was lost."""
    algo = _algo(freeze=("bias",))
    state = algo.init_server(nn.Linear(2, 1).double(), torch.Generator())
    seen = State(arrays=dict(state.arrays), values={**state.values, "seen.2": 1, "seen.0": 1})
    new, _ = algo.aggregate(seen, [(2, None), (0, _reply([0.1, 0.0], 1, 1.0))], 0)
    assert "seen.2" not in new.values and new.values["seen.0"] == 1
    new, metrics = algo.aggregate(seen, [(2, None)], 0)
    assert "seen.2" not in new.values and metrics == {"aggregated": 0}
    assert torch.equal(new.arrays["model.weight"], state.arrays["model.weight"])


def test_buffers_get_fedavgs_mean_and_stay_out_of_the_norms() -> None:
    """A BatchNorm model: the q-weighted step moves the parameters; the running statistics and
    the counter get FedAvg's (uniform) mean delta; ‖ΔW‖² is over the parameters only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).double()
    algo = _algo(q=2.0)
    state = algo.init_server(model, torch.Generator())
    assert json.loads(str(state.values[TRAINED])) == ["0.weight", "0.bias", "1.weight", "1.bias"]

    def reply(s: float, loss: float) -> Reply:
        arrays = {
            "update." + k[6:]: torch.full_like(v, s)
            for k, v in state.arrays.items()
            if k.startswith("model.")
        }
        return Reply(arrays=arrays, metrics={"num_examples": 5, LOSS: loss})

    new, _ = algo.aggregate(state, [(0, reply(0.01, 1.0)), (1, reply(-0.02, 2.0))], 0)
    params = 6 + 2 + 2 + 2  # the parameters' entries
    sq = [100 * params * 0.01**2, 100 * params * 0.02**2]
    h = [2 * 1.0 * sq[0] + 10 * 1.0, 2 * 2.0 * sq[1] + 10 * 4.0]
    step = (10 * 1.0 * 0.01 + 10 * 4.0 * -0.02) / sum(h)
    for k in ("0.weight", "0.bias", "1.weight", "1.bias"):
        v = state.arrays["model." + k]
        torch.testing.assert_close(
            new.arrays["model." + k], v + step, rtol=1e-12, atol=1e-15, msg=k
        )
    for k in ("running_mean", "running_var"):
        v = state.arrays["model.1." + k]
        torch.testing.assert_close(new.arrays["model.1." + k], v + (0.01 - 0.02) / 2, msg=k)


def test_frozen_tensors_are_sent_once_and_not_trained() -> None:
    algo = _algo(freeze=("bias",))
    state, sent, kept = frozen_bias_rounds(algo)
    assert json.loads(str(state.values[TRAINED])) == ["weight"]
    assert "model.bias" in sent[0].arrays and "model.bias" not in sent[1].arrays
    assert "cache.bias" in kept.arrays


def test_a_16_bit_upload_is_weighed_in_the_models_precision() -> None:
    """bf16 deltas are upcast before ‖ΔW‖² and the scaling: the step equals that of the same
    values sent in float64."""
    model, _ = _two_weights()
    wire = _algo(q=2.0, transport_dtype="bf16")
    state = wire.init_server(model, torch.Generator())
    assert wire.expected_reply(state, 0)["update.weight"] == ((1, 2), torch.bfloat16)
    deltas = [torch.tensor([[-0.1, 0.03]]), torch.tensor([[0.07, 0.2]])]
    low = [
        (i, Reply({"update.weight": d.bfloat16()}, {"num_examples": 2, LOSS: 1.0 + i}))
        for i, d in enumerate(deltas)
    ]
    high = [
        (i, Reply({"update.weight": d.bfloat16().double()}, {"num_examples": 2, LOSS: 1.0 + i}))
        for i, d in enumerate(deltas)
    ]
    a, _ = wire.aggregate(state, low, 0)  # type: ignore[arg-type]
    b, _ = _algo(q=2.0).aggregate(state, high, 0)  # type: ignore[arg-type]
    assert torch.equal(a.arrays["model.weight"], b.arrays["model.weight"])


# ----------------------------------------------------------------------------- fairness


def _majority_and_one() -> list[ClientData]:
    """Two clients that fit the same w (client 0's problem, 32 and 24 examples) and one far from
    it (client 2's): FedAvg's uniform mean sits near the majority, and the third client pays."""
    same, far = regression(0, 24), regression(2, 32)
    return [
        regression(0, 32),
        ClientData(1, same.train, same.test),
        ClientData(2, far.train, far.test),
    ]


def _losses_after(q: float, rounds: int = 150) -> list[float]:
    """The three clients above (uniform weights, full participation, 5 full-batch steps a round
    at lr 0.02, L = 50): each client's loss at the final global model (150 rounds: the losses
    have settled to 3 digits)."""
    algo = _algo(q=q, lr=0.02, local_steps=5, batch_size=32)
    clients = _majority_and_one()
    state = algo.init_server(linear_model(), torch.Generator())
    for rnd in range(rounds):
        state, _ = algo.aggregate(state, _round(algo, state, clients, rnd), rnd)
    w = state.arrays["model.weight"]
    return [float(task_loss(d.train.x @ w.T, d.train.y)) for d in clients]


def test_a_larger_q_serves_the_worst_client_better() -> None:
    """The fairness property (the paper's Section 3): as q grows, the largest client loss and
    the spread of the losses fall, and the mean loss rises (the price of fairness). Here the
    worst loss goes from about 17.1 (q = 0) to 12.6 (q = 1) and 10.8 (q = 5)."""
    by_q = {q: _losses_after(q) for q in (0.0, 1.0, 5.0)}
    worst = [max(v) for v in by_q.values()]
    spread = [max(v) - min(v) for v in by_q.values()]
    mean = [sum(v) / 3 for v in by_q.values()]
    assert all(v.index(max(v)) == 2 for v in by_q.values())  # the far client stays the worst
    assert worst[0] > 1.3 * worst[1] and worst[1] > 1.1 * worst[2]
    assert spread[0] > 2 * spread[1] and spread[1] > 2 * spread[2]
    assert mean[0] < mean[1] < mean[2]


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ("method.qffl.q=-1", "q must be a finite number >= 0"),
        ("method.qffl.q=.nan", "q"),
        ("method.qffl.lipschitz=0", "lipschitz must be a finite number > 0"),
        ("method.qffl.lipschitz=-2", "lipschitz must be a finite number > 0"),
        ("method.qffl.local_optimizer=adamw", "local_optimizer must be 'sgd'"),
        ("method.qffl.loss_at=end", "loss_at"),
    ],
)
def test_bad_settings_are_refused_with_their_name(setting: str, match: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=match):
        make_algorithm("qffl", load_config(None, ["algorithms=[qffl]", setting]))


def test_direct_construction_checks_too() -> None:
    for bad, match in (
        ({"q": -0.1}, "q must be"),
        ({"q": math.inf}, "q must be"),
        ({"lipschitz": math.nan}, "lipschitz must be"),
        ({"loss_at": "middle"}, "loss_at must be"),
    ):
        with pytest.raises(ValueError, match=match):
            _algo(**bad)
    assert _algo(q=0.0).q == 0.0 and _algo().q == 1.0 and _algo().lipschitz is None


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ("robust.aggregate=median", "robust.aggregate=median"),
        ("server.optimizer=adam", "server.optimizer=adam"),
        ("server.lr=0.5", "server.lr=0.5"),
        ("transport_dtype=bf16", None),
    ],
)
def test_what_qffl_refuses(setting: str, match: str | None) -> None:
    """Robust aggregates and server optimizers are refused, each naming the setting; a 16-bit
    transport is accepted (the upload is FedAvg's delta)."""
    cfg = load_config(None, ["algorithms=[qffl]", setting])
    if match is None:
        checks.check_method_settings("qffl", QFFL, cfg, {})
        return
    with pytest.raises(ConfigError, match=match):
        checks.check_method_settings("qffl", QFFL, cfg, {})


def test_secure_aggregation_dp_and_compression_are_refused() -> None:
    """The server reads each client's loss: refused under secure aggregation and DP with its own
    reason; compression is untested with the q-weighting and refused."""
    reason = "its server weighs each client's delta by that client's own loss"
    for setting in (["secure_aggregation=true"], ["dp.clip_norm=1", "dp.noise_multiplier=1.0"]):
        cfg = load_config(None, ["algorithms=[qffl]", "weighting=uniform", *setting])
        with pytest.raises(ConfigError, match=reason):
            checks.check_privacy("qffl", QFFL, cfg)
    with pytest.raises(ValueError, match="method 'qffl' does not offer upload compression"):
        make_algorithm("qffl", load_config(None, ["method.qffl.compression=topk"]))
