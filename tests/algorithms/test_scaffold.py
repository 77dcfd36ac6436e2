"""SCAFFOLD (fedlore.algorithms.scaffold): its control variates on hand-checkable cases, and the
drift correction they exist for.

* One local step makes ``c_i+`` the client's gradient at ``x`` whatever ``c`` and ``c_i`` were
  (option II), and the reply's ``Δc_i`` is ``c_i+ - c_i``.
* The server's ``c`` moves by ``(1 / N) Σ Δc_i`` over the round's clients (partial
  participation included; under example weights by their weighted mean times ``|S| / N``), and
  its model as FedAvg's.
* A round without a step keeps ``c_i``; frozen tensors have no control variate and are sent
  once; a client's minibatches come from its own generator; the checkpoint holds ``c`` and the
  ``c_i``.
* On two clients whose least-squares problems disagree, with many full-batch local steps, FedAvg
  stalls at a biased point and SCAFFOLD reaches the global optimum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from least_squares import assert_draws_from_its_generator, checkpointed_states, frozen_bias_rounds
from least_squares import linear_model as _model
from least_squares import make_algo as _algo
from least_squares import optimum as _optimum
from least_squares import regression as _regression
from least_squares import train as _train
from torch import nn

from fedlore.algorithms.fedavg import FedAvg
from fedlore.algorithms.scaffold import CONTROL, DCONTROL, Scaffold
from fedlore.config import ConfigError, load_config
from fedlore.experiment_parts import make_algorithm
from fedlore.tensors import load_model_arrays, select, with_prefix
from fedlore.train.local import TrainStats, parameter_term, task_loss
from fedlore.types import Reply, State


def test_one_step_makes_the_control_variate_the_clients_gradient() -> None:
    """K = 1: y = x - η (g - c_i + c), so c_i+ = c_i - c + (x - y) / η = g at x, for any c and
    c_i; Δc_i = c_i+ - c_i is what the reply carries and c_i+ what the client keeps."""
    algo = _algo(Scaffold, local_steps=1, num_clients=4)
    model = _model()
    state = algo.init_server(model, torch.Generator())
    data = _regression(1)
    c = {"weight": torch.tensor([[0.3, -0.1, 2.0]], dtype=torch.float64)}
    c_i = {"weight": torch.tensor([[-1.0, 0.5, 0.25]], dtype=torch.float64)}
    state = State(arrays={**state.arrays, **with_prefix(c, CONTROL)})
    msg = algo.broadcast(state, 0, 1)
    reply, kept = algo.client_update(
        msg, State(arrays=with_prefix(c_i, CONTROL)), model, data, torch.Generator()
    )
    at_x = _model()
    load_model_arrays(at_x, select(msg.arrays, "model."))
    task_loss(at_x(data.train.x), data.train.y).backward()  # the full batch: one step's batch
    grad = at_x.weight.grad
    assert grad is not None
    torch.testing.assert_close(kept.arrays[CONTROL + "weight"], grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(reply.arrays[DCONTROL + "weight"], grad - c_i["weight"])
    step = reply.arrays["update.weight"]
    torch.testing.assert_close(step, -0.05 * (grad - c_i["weight"] + c["weight"]))


@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_the_server_moves_c_by_the_mean_over_all_n_clients(weighting: str) -> None:
    """Two of N = 4 clients reply (a third was dropped), of 10 and 30 examples: under uniform
    weights c <- c + (Δc_a + Δc_b) / 4 and the model steps by the plain mean of the Δy; under
    example weights c <- c + (2 / 4)(10 Δc_a + 30 Δc_b) / 40 and the model steps by FedAvg's
    weighted mean (either rule applied under the other weighting moves both elsewhere)."""
    algo = _algo(Scaffold, num_clients=4, weighting=weighting)
    model = _model()
    state = algo.init_server(model, torch.Generator())
    c0 = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    state = State(arrays={**state.arrays, CONTROL + "weight": c0})
    dc = [torch.tensor([[4.0, 0.0, -4.0]]), torch.tensor([[0.0, 8.0, 4.0]])]
    dy = [torch.full((1, 3), 0.5), torch.full((1, 3), -0.1)]
    replies: list[tuple[int, Reply | None]] = [
        (
            c,
            Reply(
                arrays={"update.weight": y.double(), DCONTROL + "weight": d.double()},
                metrics={"num_examples": n},
            ),
        )
        for c, y, d, n in zip((0, 2), dy, dc, (10, 30), strict=True)
    ]
    new, _ = algo.aggregate(state, [*replies, (3, None)], 0)
    if weighting == "uniform":
        want_c, step = c0 + (dc[0] + dc[1]).double() / 4, 0.2
    else:
        want_c, step = c0 + 0.5 * (10 * dc[0] + 30 * dc[1]).double() / 40, (5.0 - 3.0) / 40
    torch.testing.assert_close(new.arrays[CONTROL + "weight"], want_c)
    before = state.arrays["model.weight"]
    torch.testing.assert_close(new.arrays["model.weight"], before + step)


@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_scaffold_removes_the_client_drift_fedavg_keeps(weighting: str) -> None:
    """The global objective Σ_i p_i · ½ mean_i (x·w - y)² has its optimum w*; with 20
    full-batch local steps per round FedAvg's fixed point is off w* (each client drifts to its
    own optimum), SCAFFOLD's is w* itself, under uniform weights (the paper's) and under
    example weights with clients of 16 and 160 examples (its c then the weighted mean of the
    c_i; the uniform mean led to the uniform optimum, 1.9 away)."""
    sizes = (32, 32) if weighting == "uniform" else (16, 160)
    optimum = _optimum(sizes, weighting == "uniform")
    other = _optimum(sizes, weighting != "uniform")
    fedavg = _train(_algo(FedAvg, weighting=weighting, batch_size=160), 150, sizes) - optimum
    scaffold = _train(
        _algo(Scaffold, num_clients=2, weighting=weighting, batch_size=160), 150, sizes
    )
    assert fedavg.norm() > 0.05  # the drift: FedAvg settles elsewhere
    assert (scaffold - optimum).norm() < 1e-6 < fedavg.norm() / 1e4
    if weighting != "uniform":
        assert (other - optimum).norm() > 1.0  # the two optima are far apart


def test_the_control_variate_divides_by_the_step_sizes_taken() -> None:
    """Under a decaying schedule the K steps' sizes differ: c_i+ = c_i - c + (x - y) / Σ η_k
    over the sizes the round used (K η_0 would be wrong)."""
    algo = _algo(Scaffold, local_steps=3, num_clients=1, rounds=4, schedule="cosine")
    model = _model()
    state = algo.init_server(model, torch.Generator())
    data = _regression(0)
    msg = algo.broadcast(state, 2, 0)
    reply, kept = algo.client_update(msg, None, model, data, torch.Generator())
    taken = sum(algo.round_lrs(2, data.num_examples))
    assert len(set(algo.round_lrs(2, data.num_examples))) == 3  # three different step sizes
    want = -reply.arrays["update.weight"] / taken  # c = c_i = 0: (x - y) / Σ η
    torch.testing.assert_close(kept.arrays[CONTROL + "weight"], want)


def test_a_skipped_step_is_not_in_the_divisor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose loss is not finite is skipped: it moves nothing, so its step size is not in
    Σ η_k. With a linear loss <g, w> (the gradient g at every step) and c = c_i = 0, the local
    run moves by -Σ_taken η_k g, so c_i+ = (x - y) / Σ_taken η_k is g exactly; dividing by the
    schedule's whole sum would shrink it."""
    import fedlore.algorithms.fedavg as fedavg_mod

    algo = _algo(Scaffold, local_steps=4, num_clients=1, rounds=3, schedule="cosine")
    model = _model()
    state = algo.init_server(model, torch.Generator())
    data = _regression(0)
    g = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64)
    inner = fedavg_mod.local_train
    calls: list[int] = []

    def linear_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        loss = (model.weight * g).sum() + 0.0 * out.sum()
        return loss * float("nan") if len(calls) == 2 else loss  # the second step is skipped

    def train(net: torch.nn.Module, *args: Any, **kwargs: Any) -> TrainStats:
        kwargs["loss_fn"] = linear_loss
        return inner(net, *args, **kwargs)

    monkeypatch.setattr(fedavg_mod, "local_train", train)
    reply, kept = algo.client_update(
        algo.broadcast(state, 1, 0), None, model, data, torch.Generator()
    )
    assert reply.metrics["skipped_steps"] == 1
    torch.testing.assert_close(kept.arrays[CONTROL + "weight"], g, rtol=1e-12, atol=1e-14)


def test_a_round_without_a_step_keeps_the_control_variate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every step's loss is not finite: no step is taken (Σ η_k = 0), the model does not move,
    and the client learnt nothing about its drift: it keeps c_i (not 0 / 0) and uploads
    Δc_i = 0."""
    import fedlore.algorithms.fedavg as fedavg_mod

    algo = _algo(Scaffold, local_steps=3, num_clients=2)
    state = algo.init_server(_model(), torch.Generator())
    c = {"weight": torch.tensor([[0.3, -0.1, 2.0]], dtype=torch.float64)}
    c_i = {"weight": torch.tensor([[-1.0, 0.5, 0.25]], dtype=torch.float64)}
    state = State(arrays={**state.arrays, **with_prefix(c, CONTROL)})
    inner = fedavg_mod.local_train

    def nan_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return out.sum() * float("nan")

    def train(net: torch.nn.Module, *args: Any, **kwargs: Any) -> TrainStats:
        kwargs["loss_fn"] = nan_loss
        return inner(net, *args, **kwargs)

    monkeypatch.setattr(fedavg_mod, "local_train", train)
    reply, kept = algo.client_update(
        algo.broadcast(state, 0, 1),
        State(arrays=with_prefix(c_i, CONTROL)),
        _model(),
        _regression(1),
        torch.Generator(),
    )
    assert reply.metrics["skipped_steps"] == 3
    assert torch.equal(reply.arrays["update.weight"], torch.zeros(1, 3, dtype=torch.float64))
    assert torch.equal(kept.arrays[CONTROL + "weight"], c_i["weight"])
    assert torch.equal(reply.arrays[DCONTROL + "weight"], torch.zeros(1, 3, dtype=torch.float64))


def test_frozen_tensors_have_no_control_variate_and_are_sent_once() -> None:
    """``freeze`` leaves a tensor out of training: c and c_i cover the weight only, the replies
    (Δy and Δc_i of the weight) pass the engine's check against ``expected_reply``, the server
    remembers the client (its ``seen`` flag survives SCAFFOLD's aggregate) and sends the bias
    once, and the client takes it from its cache after that."""
    algo = _algo(Scaffold, num_clients=1, freeze=("bias",))
    state, sent, kept = frozen_bias_rounds(algo, rounds=3)
    assert set(select(state.arrays, CONTROL)) == {"weight"}
    assert set(select(kept.arrays, CONTROL)) == {"weight"}
    assert algo.expected_reply(state, 3, 0) == {
        "update.weight": ((1, 3), torch.float64),
        DCONTROL + "weight": ((1, 3), torch.float64),
    }
    assert "model.bias" in sent[0].arrays
    assert all(
        "model.bias" not in msg.arrays and CONTROL + "weight" in msg.arrays for msg in sent[1:]
    )
    torch.testing.assert_close(state.arrays["model.bias"], sent[0].arrays["model.bias"])


def test_the_local_run_draws_from_the_clients_generator() -> None:
    assert_draws_from_its_generator(_algo(Scaffold, batch_size=8, local_steps=4))


def test_the_checkpoint_holds_c_and_every_clients_c_i(tmp_path: Path) -> None:
    """A real run (the engine checks each reply against ``expected_reply``; the client store
    keeps each c_i): after round 0 the checkpoint holds the server's c and each client's c_i,
    non-zero."""
    c, clients = checkpointed_states("scaffold", CONTROL, tmp_path)
    assert c and sum(float(v.abs().sum()) for v in c.values()) > 0
    assert len(clients) == 3
    for c_i in clients:
        assert c_i.keys() == c.keys() and sum(float(v.abs().sum()) for v in c_i.values()) > 0


class _Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor([3.0, 4.0, 5.0], dtype=torch.float64))
        self.c = nn.Parameter(torch.tensor([0.5], dtype=torch.float64))


def test_parameter_term_sums_the_named_parameters_in_model_order() -> None:
    """``parameter_term`` (SCAFFOLD's correction and FedDyn's dynamic term): ``Σ part(name, p)``
    over the named parameters only (a name the model lacks adds nothing), called in the model's
    parameter order whatever the order of ``names``, exact in float64, with each part's
    gradient. With no name it is a 0-d zero on the model's device (``meta`` here)."""
    model = _Three()
    weight = {
        "a": torch.tensor([0.25, 2.0], dtype=torch.float64),
        "c": torch.tensor([8.0], dtype=torch.float64),
    }
    calls: list[str] = []

    def part(name: str, p: nn.Parameter) -> torch.Tensor:
        calls.append(name)
        return (weight[name] * p).sum()

    term = parameter_term(iter(["c", "zzz", "a"]), part)
    value = term(model)
    assert value.dtype == torch.float64 and value.shape == ()
    assert value.item() == 0.25 * 1.0 + 2.0 * -2.0 + 8.0 * 0.5
    assert calls == ["a", "c"]
    assert term(model).item() == 0.25 and calls == ["a", "c", "a", "c"]  # the names are kept
    value.backward()
    assert model.a.grad is not None and torch.equal(model.a.grad, weight["a"])
    assert model.c.grad is not None and torch.equal(model.c.grad, weight["c"])
    assert model.b.grad is None
    assert parameter_term(["b"], lambda n, p: p.sum())(_Three()).item() == 12.0
    assert parameter_term([], part)(model).item() == 0.0
    with torch.device("meta"):
        meta = _Three()
    zero = parameter_term([], part)(meta)
    assert zero.shape == () and zero.device.type == "meta"


def test_scaffold_takes_sgd_steps_and_secure_aggregation_but_not_dp(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="local_optimizer must be 'sgd'"):
        _algo(Scaffold, local_optimizer="adamw")
    cfg = load_config(None, ["algorithms=[scaffold]", "num_clients=7"])
    algo = make_algorithm("scaffold", cfg)
    assert isinstance(algo, Scaffold) and algo.num_clients == 7  # N from the config
    private = load_config(None, ["algorithms=[scaffold]", "secure_aggregation=true"])
    assert make_algorithm("scaffold", private).train.upload_increments  # type: ignore[attr-defined]
    for mode in (["dp.mode=central"], ["dp.mode=local"], ["secure_aggregation=true"]):
        dp = ["weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1", *mode]
        with pytest.raises(ConfigError, match="dp: method 'scaffold' cannot run under it: its "
                           "control variate c adds every round's mean Δc_i for good"):  # fmt: skip
            make_algorithm("scaffold", load_config(None, ["algorithms=[scaffold]", *dp]))


def test_n_is_the_federations_not_a_method_setting() -> None:
    """c moves by (|S| / N) ...: an N other than the federation's would break c = mean c_i."""
    cfg = load_config(None, ["algorithms=[scaffold]", "num_clients=3"])
    over = load_config(
        None, ["algorithms=[scaffold]", "num_clients=3", "method.scaffold.num_clients=5"]
    )
    with pytest.raises((ValueError, ConfigError), match="set num_clients instead"):
        make_algorithm("scaffold", over)
    assert make_algorithm("scaffold", cfg).num_clients == 3  # type: ignore[attr-defined]
