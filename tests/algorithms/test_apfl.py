"""APFL (fedlore.algorithms.apfl): one local step of w, v and α worked out by hand on a linear
softmax classifier, α clipped to [0, 1] and fixed without ``adaptive_alpha``, α = 0 making the
personalized model the global copy (APFL = FedAvg), the state a client keeps, P-local of the
mixed model, ``local_epochs`` and the refusals."""

from __future__ import annotations

import dataclasses
import math
from typing import TypedDict

import pytest
import torch
from least_squares import frozen_bias_rounds
from torch import nn

from fedlore.algorithms.apfl import ALPHA, APFL
from fedlore.algorithms.base import local_scores
from fedlore.algorithms.fedavg import FedAvg
from fedlore.algorithms.personal import personal_arrays
from fedlore.config import ConfigError, load_config
from fedlore.data.client_data import ClientData, TensorSplit, minibatches, stream_batches
from fedlore.experiment_parts import make_algorithm
from fedlore.seeding import generator
from fedlore.tensors import select, state_bytes
from fedlore.types import Reply, State

D_IN, CLASSES = 3, 2


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(D_IN, CLASSES).double()


def _data(n: int = 4, seed: int = 5) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n + 3, D_IN, generator=g, dtype=torch.float64)
    y = torch.tensor(([0, 1] * n)[: n + 3])
    return ClientData(0, TensorSplit(x[:n], y[:n]), TensorSplit(x[n:], y[n:]))


def _grad(
    w: torch.Tensor, b: torch.Tensor, split: TensorSplit
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy's gradient of the linear classifier ``x W^T + b``, by hand:
    ``(softmax(z) - onehot(y)) / B`` times ``x`` (W) or summed (b)."""
    z = split.x @ w.T + b
    p = torch.exp(z - z.max(dim=1, keepdim=True).values)
    p = p / p.sum(dim=1, keepdim=True)
    r = (p - torch.nn.functional.one_hot(split.y, CLASSES).double()) / len(split)
    return r.T @ split.x, r.sum(dim=0)


def _state(v_w: torch.Tensor, v_b: torch.Tensor, alpha: float) -> State:
    return State(
        arrays={
            "personal.weight": v_w,
            "personal.bias": v_b,
            ALPHA: torch.tensor(alpha, dtype=torch.float64),
        }
    )


def _one_step(algo: APFL, state: State | None, data: ClientData) -> tuple[Reply, State]:
    """One client round from the initial model (``state``: the client's, None at first contact)."""
    msg = algo.broadcast(algo.init_server(_model(), generator(0, 2)), 0, 0)
    return algo.client_update(msg, state, _model(), data, generator(0, 3))


class _Step(TypedDict):
    """One step by hand: w's and v's (weight, bias) after it, α's step before the clipping."""

    w: tuple[torch.Tensor, torch.Tensor]
    v: tuple[torch.Tensor, torch.Tensor]
    alpha_raw: float


def _by_hand(
    v_w: torch.Tensor, v_b: torch.Tensor, a: float, lr: float, a_lr: float, data: ClientData
) -> _Step:
    """Algorithm 1's three updates of one step, from the step's values (whole-split batch)."""
    m = _model()
    w, b = m.weight.detach(), m.bias.detach()
    gw, gb = _grad(w, b, data.train)  # ∇f(w)
    bar_w, bar_b = a * v_w + (1 - a) * w, a * v_b + (1 - a) * b  # v̄
    hw, hb = _grad(bar_w, bar_b, data.train)  # ∇f(v̄)
    grad_a = float(((v_w - w) * hw).sum() + ((v_b - b) * hb).sum())  # ⟨v - w, ∇f(v̄)⟩
    return {
        "w": (w - lr * gw, b - lr * gb),
        "v": (v_w - lr * a * hw, v_b - lr * a * hb),
        "alpha_raw": a - a_lr * grad_a,
    }


def _v0(shift: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    m = _model()
    g = torch.Generator().manual_seed(11)
    return (
        m.weight.detach() + shift * torch.randn(CLASSES, D_IN, generator=g, dtype=torch.float64),
        m.bias.detach() + shift * torch.randn(CLASSES, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize("alpha_lr", [None, 0.7])
def test_one_local_step_of_w_v_and_alpha_by_hand(alpha_lr: float | None) -> None:
    lr, a = 0.3, 0.4
    algo = APFL.of(lr=lr, local_steps=1, batch_size=4, rounds=2, alpha=0.9, alpha_lr=alpha_lr)
    v_w, v_b = _v0()
    data = _data()
    reply, new = _one_step(algo, _state(v_w, v_b, a), data)
    want = _by_hand(v_w, v_b, a, lr, lr if alpha_lr is None else alpha_lr, data)
    m = _model()
    (w1, b1), (v1_w, v1_b) = want["w"], want["v"]
    up = select(reply.arrays, "update.")
    torch.testing.assert_close(up["weight"], w1 - m.weight.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(up["bias"], b1 - m.bias.detach(), rtol=0, atol=1e-12)
    v = personal_arrays(new)
    torch.testing.assert_close(v["weight"], v1_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(v["bias"], v1_b, rtol=0, atol=1e-12)
    raw = want["alpha_raw"]
    assert 0 < raw < 1 and abs(raw - a) > 1e-4  # the step moved α, inside [0, 1]
    assert float(new.arrays[ALPHA]) == pytest.approx(raw, abs=1e-12)
    assert reply.metrics["alpha"] == pytest.approx(raw, abs=1e-12)
    # the state's α was used, not the configured initial one (0.9)
    assert float(new.arrays[ALPHA]) != pytest.approx(0.9, abs=1e-3)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_alpha_is_clipped_to_the_unit_interval(sign: float) -> None:
    """v = w + s·c·∇f(w): ⟨v - w, ∇f(v̄)⟩ has the sign of s, so a large η_α drives α below 0
    (s = +1) or above 1 (s = -1); the step lands on 0 or 1 exactly."""
    lr, a, a_lr = 0.1, 0.5, 1e4
    m = _model()
    data = _data()
    gw, gb = _grad(m.weight.detach(), m.bias.detach(), data.train)
    v_w, v_b = m.weight.detach() + sign * 0.5 * gw, m.bias.detach() + sign * 0.5 * gb
    raw = _by_hand(v_w, v_b, a, lr, a_lr, data)["alpha_raw"]
    assert raw < 0 if sign > 0 else raw > 1  # the premise: the unclipped step leaves [0, 1]
    algo = APFL.of(lr=lr, local_steps=1, batch_size=4, rounds=2, alpha_lr=a_lr)
    _, new = _one_step(algo, _state(v_w, v_b, a), data)
    assert float(new.arrays[ALPHA]) == (0.0 if sign > 0 else 1.0)


def test_alpha_stays_fixed_without_adaptive_alpha_and_v_steps_with_it() -> None:
    lr, a = 0.3, 0.4
    algo = APFL.of(lr=lr, local_steps=1, batch_size=4, rounds=2, adaptive_alpha=False)
    v_w, v_b = _v0()
    data = _data()
    reply, new = _one_step(algo, _state(v_w, v_b, a), data)
    assert float(new.arrays[ALPHA]) == a and reply.metrics["alpha"] == a
    want = _by_hand(v_w, v_b, a, lr, lr, data)
    torch.testing.assert_close(personal_arrays(new)["weight"], want["v"][0], rtol=0, atol=1e-12)
    # several steps, first contact: α is the configured one throughout
    algo = APFL.of(lr=lr, local_steps=5, batch_size=2, rounds=2, adaptive_alpha=False, alpha=0.25)
    _, new = _one_step(algo, None, data)
    assert float(new.arrays[ALPHA]) == 0.25


def test_first_contact_starts_v_at_the_received_model_and_alpha_at_alpha() -> None:
    algo = APFL.of(lr=0.3, local_steps=1, batch_size=4, rounds=2, alpha=0.25)
    data = _data()
    m = _model()
    got = _one_step(algo, None, data)
    want = _one_step(algo, _state(m.weight.detach(), m.bias.detach(), 0.25), data)
    for a, b in ((got[0].arrays, want[0].arrays), (got[1].arrays, want[1].arrays)):  # reply, state
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def _pair(alpha: float, adaptive: bool, **kw: float) -> tuple[APFL, FedAvg]:
    common = {"lr": 0.2, "local_steps": 3, "batch_size": 2, "rounds": 1, "local_eval": True}
    common.update(kw)
    apfl = APFL.of(alpha=alpha, adaptive_alpha=adaptive, **common)
    return apfl, FedAvg.of(**common)


def test_alpha_zero_makes_the_personalized_model_the_global_copy() -> None:
    """α = 0, fixed: v̄ = w, v never moves (its step is α ∇f), and P-local is FedAvg's (the
    client's trained w_i) to the last bit; the uploads are FedAvg's for any α."""
    data = _data(n=6)
    apfl, fedavg = _pair(0.0, adaptive=False)
    v_w, v_b = _v0()
    r_a, s_a = _one_step(apfl, _state(v_w, v_b, 0.0), data)
    msg = fedavg.broadcast(fedavg.init_server(_model(), generator(0, 2)), 0, 0)
    r_f, _ = fedavg.client_update(msg, None, _model(), data, generator(0, 3))
    assert all(torch.equal(r_a.arrays[k], r_f.arrays[k]) for k in r_f.arrays)
    for key in ("local_accuracy", "local_loss", "local_ece"):
        assert r_a.metrics[key] == r_f.metrics[key], key
    assert torch.equal(personal_arrays(s_a)["weight"], v_w)  # v_i untouched
    # any other α: the same uploads, another personalized model
    apfl_half, _ = _pair(0.5, adaptive=True)
    r_h, _ = _one_step(apfl_half, _state(v_w, v_b, 0.5), data)
    assert all(torch.equal(r_h.arrays[k], r_f.arrays[k]) for k in r_f.arrays)
    assert r_h.metrics["local_loss"] != r_f.metrics["local_loss"]


def test_p_local_scores_the_mixed_model_with_the_trained_global_copy() -> None:
    data = _data(n=6)
    apfl, _ = _pair(0.6, adaptive=True)
    v_w, v_b = _v0()
    reply, new = _one_step(apfl, _state(v_w, v_b, 0.6), data)
    a = float(new.arrays[ALPHA])
    w = {k: _model().state_dict()[k] + u for k, u in select(reply.arrays, "update.").items()}
    v = personal_arrays(new)
    mixed = _model()
    mixed.load_state_dict({k: a * v[k] + (1 - a) * w[k] for k in w})
    want = local_scores(mixed, data, 0)
    assert reply.metrics["local_loss"] == pytest.approx(want["local_loss"], abs=1e-12)
    assert reply.metrics["local_accuracy"] == want["local_accuracy"]
    # neither the local model alone nor the global copy alone
    for only in (v, w):
        alone = _model()
        alone.load_state_dict(only)
        assert local_scores(alone, data, 0)["local_loss"] != pytest.approx(want["local_loss"])


def test_the_state_is_v_and_alpha() -> None:
    algo = APFL.of(lr=0.1, local_steps=2, batch_size=2, rounds=2)
    _, new = _one_step(algo, None, _data())
    assert set(new.arrays) == {"personal.weight", "personal.bias", ALPHA}
    assert new.arrays[ALPHA].shape == () and new.arrays[ALPHA].dtype == torch.float64
    params = sum(p.numel() * p.element_size() for p in _model().parameters())
    assert state_bytes(new) == params + 8  # v_i (float64 here) and α_i


def test_local_epochs_equal_the_same_number_of_local_steps() -> None:
    """Under ``local_epochs`` E a client of n examples takes E ceil(n / B) steps of all three
    updates, on the same minibatches as ``local_steps`` = that count (constant schedule)."""
    data = _data(n=5)
    by_epochs = APFL.of(lr=0.2, local_epochs=2, batch_size=2, rounds=2)
    by_steps = APFL.of(lr=0.2, local_steps=6, batch_size=2, rounds=2)
    assert by_epochs.local_steps(5) == 6
    v_w, v_b = _v0()
    (r_e, s_e), (r_s, s_s) = (
        _one_step(by_epochs, _state(v_w, v_b, 0.5), data),
        _one_step(by_steps, _state(v_w, v_b, 0.5), data),
    )
    for a, b in ((r_e.arrays, r_s.arrays), (s_e.arrays, s_s.arrays)):  # replies, states
        assert all(torch.equal(a[k], b[k]) for k in a)
    fewer = APFL.of(lr=0.2, local_steps=5, batch_size=2, rounds=2)
    _, s5 = _one_step(fewer, _state(v_w, v_b, 0.5), data)
    _, s6 = _one_step(by_steps, _state(v_w, v_b, 0.5), data)
    assert not torch.equal(s5.arrays[ALPHA], s6.arrays[ALPHA])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"alpha": 1.5}, r"apfl: alpha must be in \[0, 1\]"),
        ({"alpha": -0.1}, r"apfl: alpha must be in \[0, 1\]"),
        ({"alpha_lr": 0.0}, "apfl: alpha_lr must be > 0"),
        ({"upload_increments": True}, "APFL is not yet offered under secure aggregation"),
    ],
)
def test_bad_settings_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        APFL.of(**kw)


def test_config_refusals_name_the_setting() -> None:
    with pytest.raises(ValueError, match=r"method\.apfl: alpha must be in \[0, 1\]"):
        make_algorithm("apfl", load_config(None, ["method.apfl.alpha=2"]))
    with pytest.raises(ValueError, match="method 'apfl' does not offer upload compression"):
        make_algorithm("apfl", load_config(None, ["method.apfl.compression=topk"]))
    cfg = load_config(None, ["algorithms=[apfl]", "secure_aggregation=true", "weighting=uniform"])
    with pytest.raises(ConfigError, match="secure_aggregation: method 'apfl' cannot run under it"):
        make_algorithm("apfl", cfg)
    assert dataclasses.replace(APFL(), alpha=0.0).alpha == 0.0  # the ends are valid


def test_the_gradient_at_the_mixed_model_is_clipped_like_ws() -> None:
    """``optim.grad_clip`` bounds the step of v and α as it bounds w's: the gradient at v̄ is
    scaled to the clip norm before both use it."""
    lr, a, clip = 0.3, 0.4, 1e-2
    algo = APFL.of(lr=lr, local_steps=1, batch_size=4, rounds=2, grad_clip=clip, alpha_lr=50.0)
    v_w, v_b = _v0()
    data = _data()
    _, new = _one_step(algo, _state(v_w, v_b, a), data)
    m = _model()
    w, b = m.weight.detach(), m.bias.detach()
    hw, hb = _grad(a * v_w + (1 - a) * w, a * v_b + (1 - a) * b, data.train)
    norm = float(torch.sqrt((hw**2).sum() + (hb**2).sum()))
    assert norm > 10 * clip  # the premise: the clip acts
    c = clip / (norm + 1e-6)
    v = personal_arrays(new)
    torch.testing.assert_close(v["weight"], v_w - lr * a * c * hw, rtol=0, atol=1e-12)
    grad_a = c * float(((v_w - w) * hw).sum() + ((v_b - b) * hb).sum())
    assert float(new.arrays[ALPHA]) == pytest.approx(a - 50.0 * grad_a, abs=1e-12)


def test_v_keeps_its_own_buffers() -> None:
    """With BatchNorm the forward passes at v̄ update v's running statistics (kept in
    ``personal.*``) and those at w update w's (uploaded): each the momentum average of its own
    model's batch statistics, by hand."""

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(D_IN, 4), nn.BatchNorm1d(4), nn.Linear(4, CLASSES)).double()

    data = _data(n=6)
    algo = APFL.of(lr=0.3, local_steps=1, batch_size=6, rounds=2)
    init = net().state_dict()
    v = {k: t.clone() for k, t in init.items()}
    v["0.weight"] = v["0.weight"] + 0.5
    v["1.running_mean"] = torch.full((4,), 2.0, dtype=torch.float64)
    state = State(
        arrays={
            **{f"personal.{k}": t for k, t in v.items()},
            ALPHA: torch.tensor(0.5, dtype=torch.float64),
        }
    )
    msg = algo.broadcast(algo.init_server(net(), generator(0, 2)), 0, 0)
    reply, new = algo.client_update(msg, state, net(), data, generator(0, 3))
    x = data.train.x
    h_w = x @ init["0.weight"].T + init["0.bias"]
    bar_w = 0.5 * v["0.weight"] + 0.5 * init["0.weight"]
    h_bar = x @ bar_w.T + 0.5 * (v["0.bias"] + init["0.bias"])
    want_w = 0.9 * init["1.running_mean"] + 0.1 * h_w.mean(0)
    want_v = 0.9 * v["1.running_mean"] + 0.1 * h_bar.mean(0)
    got_w = init["1.running_mean"] + reply.arrays["update.1.running_mean"]
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(new.arrays["personal.1.running_mean"], want_v, rtol=0, atol=1e-12)
    assert int(new.arrays["personal.1.num_batches_tracked"]) == 1


def test_frozen_tensors_are_sent_once_and_never_move() -> None:
    """``freeze``: the frozen bias is broadcast in the first round only; the client fills it in
    from its cache in the next rounds (the state it kept), and neither w's nor v's copy of it
    moves, while v's weight trains."""
    algo = APFL.of(lr=0.1, local_steps=2, batch_size=8, rounds=3, freeze=("bias",))
    state, sent, kept = frozen_bias_rounds(algo, rounds=3)
    assert "model.bias" in sent[0].arrays
    assert all("model.bias" not in msg.arrays for msg in sent[1:])
    bias = sent[0].arrays["model.bias"]
    assert torch.equal(state.arrays["model.bias"], bias)
    assert torch.equal(kept.arrays["cache.bias"], bias)
    assert torch.equal(personal_arrays(kept)["bias"], bias)
    assert not torch.equal(personal_arrays(kept)["weight"], sent[0].arrays["model.weight"])


def test_a_streamed_client_steps_w_v_and_alpha_on_its_rounds_minibatch() -> None:
    """A client that reads one stream over the run (``stream_seed``): in round 2 the one local
    step of w, v and α uses batch 2 of the stream (``t·K`` with K = 1), the same for all three,
    by hand."""
    lr, a = 0.3, 0.4
    algo = APFL.of(lr=lr, local_steps=1, batch_size=2, rounds=4)
    data = dataclasses.replace(_data(n=6), stream_seed=7)
    v_w, v_b = _v0()
    msg = algo.broadcast(algo.init_server(_model(), generator(0, 2)), 2, 0)
    reply, new = algo.client_update(msg, _state(v_w, v_b, a), _model(), data, generator(0, 3))
    ((x, y),) = list(stream_batches(data.train, 2, 1, 7, start=2))
    first = next(iter(stream_batches(data.train, 2, 1, 7, start=0)))
    assert not torch.equal(x, first[0])  # the premise: round 2's batch is not round 0's
    batch = TensorSplit(x, y)
    want = _by_hand(v_w, v_b, a, lr, lr, ClientData(0, batch, batch))
    (w1, b1), (v1_w, v1_b) = want["w"], want["v"]
    m = _model()
    up = select(reply.arrays, "update.")
    torch.testing.assert_close(up["weight"], w1 - m.weight.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(up["bias"], b1 - m.bias.detach(), rtol=0, atol=1e-12)
    v = personal_arrays(new)
    torch.testing.assert_close(v["weight"], v1_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(v["bias"], v1_b, rtol=0, atol=1e-12)
    assert float(new.arrays[ALPHA]) == pytest.approx(float(want["alpha_raw"]), abs=1e-12)


def _mixed_loss(v_w: torch.Tensor, v_b: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                a: float, split: TensorSplit) -> float:  # fmt: skip
    """The mean cross-entropy of the mixed model ``a v + (1 - a) w`` on ``split``."""
    z = split.x @ (a * v_w + (1 - a) * w).T + (a * v_b + (1 - a) * b)
    return float(torch.nn.functional.cross_entropy(z, split.y))


def test_personal_loss_is_the_mean_loss_at_the_mixed_model_over_the_steps() -> None:
    """Two whole-split steps: ``personal_loss`` is the mean of the losses at v̄ before each
    step, the second at the w, v and α the first step left, by hand."""
    lr, a = 0.3, 0.4
    algo = APFL.of(lr=lr, local_steps=2, batch_size=4, rounds=2)
    data = _data()
    v_w, v_b = _v0()
    reply, _ = _one_step(algo, _state(v_w, v_b, a), data)
    m = _model()
    w, b = m.weight.detach(), m.bias.detach()
    first = _mixed_loss(v_w, v_b, w, b, a, data.train)
    step = _by_hand(v_w, v_b, a, lr, lr, data)
    (w1, b1), (v1_w, v1_b) = step["w"], step["v"]
    second = _mixed_loss(v1_w, v1_b, w1, b1, float(step["alpha_raw"]), data.train)
    assert first != pytest.approx(second, rel=1e-3)
    assert reply.metrics["personal_loss"] == pytest.approx((first + second) / 2, rel=1e-12)


def test_a_round_whose_every_step_is_skipped_reports_no_personal_loss() -> None:
    """Non-finite inputs: every step of w is skipped (and with it those of v and α):
    ``personal_loss`` is NaN, v and α stay where they were."""
    algo = APFL.of(lr=0.3, local_steps=2, batch_size=4, rounds=2)
    data = _data()
    bad = ClientData(0, TensorSplit(data.train.x * float("nan"), data.train.y), data.test)
    v_w, v_b = _v0()
    reply, new = _one_step(algo, _state(v_w, v_b, 0.4), bad)
    assert reply.metrics["skipped_steps"] == 2
    assert reply.metrics["personal_loss"] != reply.metrics["personal_loss"]  # NaN
    assert torch.equal(personal_arrays(new)["weight"], v_w)
    assert float(new.arrays[ALPHA]) == 0.4


def test_a_local_model_whose_loss_is_not_finite_is_not_stepped_and_counts_as_skipped() -> None:
    """v_i of NaN: every gradient at v̄ is NaN, so v and α stay (NaN and the state's α) and each
    step counts in ``skipped_steps``, while w trains as FedAvg's (its steps are not skipped)."""
    algo = APFL.of(lr=0.3, local_steps=3, batch_size=2, rounds=2)
    fedavg = FedAvg.of(lr=0.3, local_steps=3, batch_size=2, rounds=2)
    data = _data()
    v_w, v_b = _v0()
    reply, new = _one_step(algo, _state(v_w * float("nan"), v_b, 0.4), data)
    msg = fedavg.broadcast(fedavg.init_server(_model(), generator(0, 2)), 0, 0)
    plain, _ = fedavg.client_update(msg, None, _model(), data, generator(0, 3))
    assert plain.metrics["skipped_steps"] == 0
    assert reply.metrics["skipped_steps"] == 3
    assert all(torch.equal(reply.arrays[k], plain.arrays[k]) for k in plain.arrays)
    assert float(new.arrays[ALPHA]) == 0.4
    assert torch.equal(personal_arrays(new)["bias"], v_b)


def test_two_steps_on_two_minibatches_by_hand() -> None:
    """Two local steps on minibatches of 2 of 4 examples: step k of w, v and α uses minibatch k
    of the round's stream (the one w trains on), from the values step k - 1 left, by hand."""
    lr, a = 0.3, 0.4
    algo = APFL.of(lr=lr, local_steps=2, batch_size=2, rounds=2)
    data = _data()
    v_w, v_b = _v0()
    reply, new = _one_step(algo, _state(v_w, v_b, a), data)
    m = _model()
    w, b = m.weight.detach(), m.bias.detach()
    batches = [TensorSplit(x, y) for x, y in minibatches(data.train, 2, 2, generator(0, 3))]
    assert not torch.equal(batches[0].x, batches[1].x)
    _matches_by_hand(reply, new, (w, b, v_w, v_b, a), [(lr, split) for split in batches])


def _matches_by_hand(
    reply: Reply,
    new: State,
    start: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
    steps: list[tuple[float, TensorSplit]],
) -> None:
    """``reply`` and ``new`` are APFL's round from ``start`` = (w, b, v_w, v_b, α) over
    ``steps`` = (η_k, minibatch k), computed here by hand: w steps on its loss, v on the mixed
    model's, α on the mixed model's derivative in α, clipped to [0, 1]."""
    w0, b0, v_w, v_b, a = start
    w, b = w0, b0
    for eta, split in steps:
        gw, gb = _grad(w, b, split)
        hw, hb = _grad(a * v_w + (1 - a) * w, a * v_b + (1 - a) * b, split)
        grad_a = float(((v_w - w) * hw).sum() + ((v_b - b) * hb).sum())
        w, b, v_w, v_b = w - eta * gw, b - eta * gb, v_w - eta * a * hw, v_b - eta * a * hb
        a = min(max(a - eta * grad_a, 0.0), 1.0)
    up = select(reply.arrays, "update.")
    torch.testing.assert_close(up["weight"], w - w0, rtol=0, atol=1e-12)
    v = personal_arrays(new)
    torch.testing.assert_close(v["weight"], v_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(v["bias"], v_b, rtol=0, atol=1e-12)
    assert float(new.arrays[ALPHA]) == pytest.approx(a, abs=1e-12)


def test_v_and_alpha_step_at_the_scheduled_rate_of_their_step() -> None:
    """A cosine schedule over one round of K = 3 whole-split steps: step k moves w, v and α at
    ``η_k = η (1 + cos(π k / K)) / 2`` (η, 3η/4, η/4), from the values step k - 1 left, by hand
    (under a constant rate a hook that read another step's rate passed)."""
    import math

    lr, a, k = 0.4, 0.4, 3
    algo = APFL.of(lr=lr, local_steps=k, batch_size=4, rounds=1, schedule="cosine")
    assert algo.round_lrs(0, 4) == pytest.approx([lr, 0.75 * lr, 0.25 * lr])
    data = _data()
    v_w, v_b = _v0()
    reply, new = _one_step(algo, _state(v_w, v_b, a), data)
    m = _model()
    w, b = m.weight.detach(), m.bias.detach()
    etas = [lr * 0.5 * (1 + math.cos(math.pi * step / k)) for step in range(k)]
    _matches_by_hand(reply, new, (w, b, v_w, v_b, a), [(eta, data.train) for eta in etas])


class _Root(nn.Module):
    """A linear classifier plus ``√c`` on its logits: finite at ``c = 0``, whose gradient in
    ``c`` is not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D_IN, CLASSES)
        self.c = nn.Parameter(torch.ones(CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.c.sqrt()


@pytest.mark.parametrize("case", ["infinite_loss", "infinite_gradient"])
def test_a_step_whose_loss_or_gradient_at_the_mixed_model_is_not_finite_leaves_v(
    case: str,
) -> None:
    """α = 1 (v̄ = v) and a v at which only one of the two is not finite: a logit of -inf on a
    target class (the loss is inf, its gradient finite: softmax gives that class 0), or
    ``c = 0`` under ``√c`` (the loss is finite, its gradient in c infinite). Either way v's two
    steps are skipped and counted, v stays, and w trains as FedAvg's."""
    algo = APFL.of(lr=0.3, local_steps=2, batch_size=4, rounds=2, alpha=1.0, adaptive_alpha=False)
    fedavg = FedAvg.of(lr=0.3, local_steps=2, batch_size=4, rounds=2)
    data = _data()

    def net() -> nn.Module:
        return (_model() if case == "infinite_loss" else _Root()).double()

    v = {k: t.detach().clone() for k, t in net().state_dict().items()}
    if case == "infinite_loss":
        v["bias"][0] = -math.inf
        assert (data.train.y == 0).any()  # the premise: the -inf logit is some example's target
    else:
        v["c"].zero_()
    state = State(
        arrays={
            **{f"personal.{k}": t for k, t in v.items()},
            ALPHA: torch.tensor(1.0, dtype=torch.float64),
        }
    )
    msg = algo.broadcast(algo.init_server(net(), generator(0, 2)), 0, 0)
    reply, new = algo.client_update(msg, state, net(), data, generator(0, 3))
    msg = fedavg.broadcast(fedavg.init_server(net(), generator(0, 2)), 0, 0)
    plain, _ = fedavg.client_update(msg, None, net(), data, generator(0, 3))
    assert plain.metrics["skipped_steps"] == 0
    assert all(torch.equal(reply.arrays[k], plain.arrays[k]) for k in plain.arrays)
    assert reply.metrics["skipped_steps"] == 2
    assert reply.metrics["personal_loss"] != reply.metrics["personal_loss"]  # NaN: no step
    kept = personal_arrays(new)
    assert all(torch.equal(kept[k], v[k]) for k in v)
