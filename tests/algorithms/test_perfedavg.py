"""Per-FedAvg (fedlore.algorithms.perfedavg): its FO and HF steps worked out by hand on a
quadratic (a linear model under the Gaussian NLL, whose Hessian is the inputs' second moment), the
evaluation-time adaptation's step count, the Hessian-vector product against torch's,
``local_epochs`` and the refusals."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
from least_squares import frozen_bias_rounds
from torch import nn

from fedlore.algorithms.perfedavg import PerFedAvg
from fedlore.algorithms.weight_grads import hessian_vector
from fedlore.config import ConfigError, load_config
from fedlore.data.client_data import ClientData, TensorSplit, stream_batches
from fedlore.experiment_parts import make_algorithm
from fedlore.seeding import generator
from fedlore.tensors import select
from fedlore.types import Reply, State

N, D_IN = 5, 2


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(D_IN, 1).double()


def _data(n: int = N) -> ClientData:
    """Real targets (a regression: the task loss is ½ (ŷ - y)² + const per example)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n + 4, D_IN, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.5, -2.0], dtype=torch.float64) + 0.5
    y = y + 0.3 * torch.randn(n + 4, generator=g, dtype=torch.float64)
    return ClientData(0, TensorSplit(x[:n], y[:n]), TensorSplit(x[n:], y[n:]))


def _quadratic(split: TensorSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """``A``, ``c`` of the loss ``½ θᵀAθ - cᵀθ + const`` in ``θ = (W, b)``: its gradient is
    ``Aθ - c`` and its Hessian ``A = mean z zᵀ`` with ``z = (x, 1)``, known exactly."""
    z = torch.cat([split.x, torch.ones(len(split), 1, dtype=torch.float64)], dim=1)
    return z.T @ z / len(split), z.T @ split.y / len(split)


def _theta0() -> torch.Tensor:
    m = _model()
    return torch.cat([m.weight.detach().flatten(), m.bias.detach()])


def _round(algo: PerFedAvg, data: ClientData) -> tuple[Reply, State]:
    msg = algo.broadcast(algo.init_server(_model(), generator(0, 2)), 0, 0)
    return algo.client_update(msg, None, _model(), data, generator(0, 3))


def _theta1(reply: Reply) -> torch.Tensor:
    up = select(reply.arrays, "update.")
    return _theta0() + torch.cat([up["weight"].flatten(), up["bias"]])


def _by_hand(theta: torch.Tensor, a: torch.Tensor, c: torch.Tensor, alpha: float, beta: float,
             hf: bool) -> torch.Tensor:  # fmt: skip
    g_in = a @ theta - c  # ∇f(w; D)
    tilde = theta - alpha * g_in  # w̃
    g_out = a @ tilde - c  # ∇f(w̃; D')
    if hf:
        g_out = g_out - alpha * (a @ g_out)  # (I - α ∇²f(w; D'')) ∇f(w̃; D')
    return theta - beta * g_out


@pytest.mark.parametrize("variant", ["fo", "hf"])
@pytest.mark.parametrize(("beta", "steps"), [(None, 1), (0.3, 1), (0.3, 3)])
def test_outer_steps_by_hand_on_a_quadratic(variant: str, beta: float | None, steps: int) -> None:
    """Full-batch minibatches (B = n), so D, D' and D'' hold the whole split and the Hessian is
    ``A``: FO is ``w - β ∇f(w̃)``, HF ``w - β (I - α A) ∇f(w̃)``, each step from the last."""
    lr, alpha = 0.2, 0.15
    algo = PerFedAvg.of(lr=lr, local_steps=steps, batch_size=N, rounds=2, alpha=alpha, beta=beta,
                        variant=variant)  # fmt: skip
    data = _data()
    reply, _ = _round(algo, data)
    a, c = _quadratic(data.train)
    want = _theta0()
    for _ in range(steps):
        want = _by_hand(want, a, c, alpha, lr if beta is None else beta, variant == "hf")
    torch.testing.assert_close(_theta1(reply), want, rtol=0, atol=1e-12)
    # the Hessian term is not negligible here: the other variant lands elsewhere
    other = _theta0()
    for _ in range(steps):
        other = _by_hand(other, a, c, alpha, lr if beta is None else beta, variant != "hf")
    assert float((other - want).abs().max()) > 1e-3


def test_hf_uses_the_minibatch_hessian_vector_product_of_torch() -> None:
    """Beyond a quadratic: the exact product on a small softmax MLP equals torch's
    ``autograd.functional.hvp`` (the finite difference of the paper would not, to 1e-10)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    u = {n: torch.randn_like(p) for n, p in params.items()}
    got = hessian_vector(model, params, {}, (x, y), u)

    def loss(*flat: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, dict(zip(names, flat, strict=True)), (x,))
        return nn.functional.cross_entropy(out, y)

    _, want = torch.autograd.functional.hvp(
        loss, tuple(params[n].detach() for n in names), tuple(u[n] for n in names)
    )
    for n, w in zip(names, want, strict=True):
        torch.testing.assert_close(got[n], w, rtol=1e-10, atol=1e-12)
    assert any(float(w.abs().max()) > 1e-3 for w in want)


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_p_local_adapts_the_received_model_by_adapt_steps_steps_of_alpha(steps: int) -> None:
    """In the last round P-local scores the global model received that round after
    ``adapt_steps`` SGD steps of size α on the client's training data (full batches here):
    ``θ_s = θ_{s-1} - α (A θ_{s-1} - c)``; one step more or fewer scores otherwise."""
    alpha = 0.3
    common = {"lr": 0.2, "local_steps": 2, "batch_size": N, "rounds": 1, "local_eval": True}
    algo = PerFedAvg.of(alpha=alpha, adapt_steps=steps, **common)
    data = _data()
    reply, _ = _round(algo, data)
    a, c = _quadratic(data.train)
    zt = torch.cat([data.test.x, torch.ones(len(data.test), 1, dtype=torch.float64)], dim=1)

    def mse(s: int) -> float:
        theta = _theta0()
        for _ in range(s):
            theta = theta - alpha * (a @ theta - c)
        return float(((zt @ theta - data.test.y) ** 2).mean())

    # (the evaluation's predictive is float32: agreement to its precision)
    assert reply.metrics["local_mse"] == pytest.approx(mse(steps), rel=1e-6)
    for s in (steps - 1, steps + 1):
        assert reply.metrics["local_mse"] != pytest.approx(mse(s), rel=1e-3)
    # scoring changes nothing of what the client trains and sends
    quiet = PerFedAvg.of(alpha=alpha, adapt_steps=steps, **{**common, "local_eval": False})
    r2, _ = _round(quiet, data)
    assert "local_mse" not in r2.metrics
    assert all(torch.equal(reply.arrays[k], r2.arrays[k]) for k in reply.arrays)


def test_alpha_defaults_to_the_runs_lr_and_keeps_no_state() -> None:
    data = _data()
    by_default = PerFedAvg.of(lr=0.2, local_steps=2, batch_size=N, rounds=2)
    explicit = PerFedAvg.of(lr=0.2, local_steps=2, batch_size=N, rounds=2, alpha=0.2, beta=0.2)
    (r1, s1), (r2, _) = _round(by_default, data), _round(explicit, data)
    assert all(torch.equal(r1.arrays[k], r2.arrays[k]) for k in r1.arrays)
    assert s1.arrays == {}  # Per-FedAvg keeps nothing between rounds


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_local_epochs_equal_the_same_number_of_local_steps(variant: str) -> None:
    data = _data(n=7)
    by_epochs = PerFedAvg.of(lr=0.1, local_epochs=2, batch_size=3, rounds=2, variant=variant)
    by_steps = PerFedAvg.of(lr=0.1, local_steps=6, batch_size=3, rounds=2, variant=variant)
    assert by_epochs.local_steps(7) == 6
    r1, _ = _round(by_epochs, data)
    r2, _ = _round(by_steps, data)
    assert all(torch.equal(r1.arrays[k], r2.arrays[k]) for k in r1.arrays)
    r3, _ = _round(PerFedAvg.of(lr=0.1, local_steps=5, batch_size=3, rounds=2, variant=variant),
                   data)  # fmt: skip
    assert not torch.equal(r1.arrays["update.bias"], r3.arrays["update.bias"])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"alpha": 0.0}, "perfedavg: alpha must be > 0"),
        ({"beta": -1.0}, "perfedavg: beta must be > 0"),
        ({"adapt_steps": 0}, "perfedavg: adapt_steps must be >= 1"),
        ({"variant": "so"}, "perfedavg: variant must be 'fo' or 'hf'"),
        ({"upload_increments": True}, "Per-FedAvg is not yet offered under secure aggregation"),
    ],
)
def test_bad_settings_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PerFedAvg.of(**kw)


def test_config_refusals_name_the_setting() -> None:
    with pytest.raises(ValueError, match=r"method\.perfedavg\.variant"):
        make_algorithm("perfedavg", load_config(None, ["method.perfedavg.variant=so"]))
    with pytest.raises(ValueError, match=r"method\.perfedavg: adapt_steps must be >= 1"):
        make_algorithm("perfedavg", load_config(None, ["method.perfedavg.adapt_steps=0"]))
    with pytest.raises(ValueError, match="method 'perfedavg' does not offer upload compression"):
        make_algorithm("perfedavg", load_config(None, ["method.perfedavg.compression=topk"]))
    cfg = load_config(None, ["algorithms=[perfedavg]", "dp.clip_norm=1",
                             "dp.noise_multiplier=1", "weighting=uniform"])  # fmt: skip
    with pytest.raises(ConfigError, match="dp: method 'perfedavg' cannot run under it"):
        make_algorithm("perfedavg", cfg)


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_each_step_draws_independent_minibatches(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D (the inner step's), D' (the outer gradient's) and, for HF, D'' (the Hessian's) are
    separate draws: with B < n they differ at some step, D is the run's own minibatch stream
    (``ClientData.batches``), and every step gets its own."""
    seen: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]] = []
    real = PerFedAvg.meta_gradient

    def spy(self: PerFedAvg, model: nn.Module, params: object, batches: object) -> object:
        seen.append(batches)  # type: ignore[arg-type]
        return real(self, model, params, batches)  # type: ignore[arg-type]

    drawn: list[torch.Tensor] = []
    real_batches = ClientData.batches

    def spy_batches(self: ClientData, *args: object) -> object:
        for x, y in real_batches(self, *args):  # type: ignore[arg-type]
            drawn.append(x)
            yield x, y

    monkeypatch.setattr(PerFedAvg, "meta_gradient", spy)
    monkeypatch.setattr(ClientData, "batches", spy_batches)
    algo = PerFedAvg.of(lr=0.1, local_steps=4, batch_size=2, rounds=2, variant=variant)
    _round(algo, _data(n=8))
    assert len(seen) == 4 and all(len(b) == (3 if variant == "hf" else 2) for b in seen)
    assert all(len(x) == 2 for b in seen for x, _ in b)  # D, D' and D'' all of B examples
    assert len(drawn) == 4 and all(
        torch.equal(b[0][0], d) for b, d in zip(seen, drawn, strict=True)
    )
    for i, j in [(0, 1), *([(0, 2), (1, 2)] if variant == "hf" else [])]:
        assert any(not torch.equal(b[i][0], b[j][0]) for b in seen), (i, j)
    assert any(not torch.equal(seen[0][1][0], b[1][0]) for b in seen[1:])


def test_hf_takes_the_hessian_at_w_not_at_the_inner_step() -> None:
    """On a non-quadratic loss (a softmax classifier) the Hessian depends on where it is taken:
    HF's step is ``w - β (I - α ∇²f(w)) ∇f(w̃)`` with the Hessian at ``w`` (torch's own gradient
    and Hessian-vector product of the full-batch loss, B = n)."""
    torch.manual_seed(2)
    x = torch.randn(6, D_IN, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    data = ClientData(0, TensorSplit(x, y), TensorSplit(x[:3], y[:3]))

    def net() -> nn.Linear:
        torch.manual_seed(0)
        return nn.Linear(D_IN, 3).double()

    alpha, beta = 0.8, 0.5
    algo = PerFedAvg.of(lr=beta, local_steps=1, batch_size=6, rounds=2, alpha=alpha, variant="hf")
    msg = algo.broadcast(algo.init_server(net(), generator(0, 2)), 0, 0)
    reply, _ = algo.client_update(msg, None, net(), data, generator(0, 3))

    def f(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(x @ w.T + b, y)

    m = net()
    w0 = (m.weight.detach(), m.bias.detach())
    g_in = torch.autograd.functional.jacobian(f, w0)
    tilde = tuple(p - alpha * g for p, g in zip(w0, g_in, strict=True))
    g_out = torch.autograd.functional.jacobian(f, tilde)
    _, h_w = torch.autograd.functional.hvp(f, w0, g_out)
    _, h_tilde = torch.autograd.functional.hvp(f, tilde, g_out)
    want = [p - beta * (g - alpha * h) for p, g, h in zip(w0, g_out, h_w, strict=True)]
    got = [w0[0] + reply.arrays["update.weight"], w0[1] + reply.arrays["update.bias"]]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(h_w, h_tilde, strict=True))


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_minibatch_steps_by_hand_with_a_cosine_schedule(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B = 2 < n: each step's D, D' (and D'') are different minibatches, each with its own
    quadratic ``A_D θ - c_D``; the inner gradient is D's, the outer D''s, the Hessian D'''s,
    and β follows the cosine schedule: ``β_k = β (1 + cos(π k / K)) / 2`` over the run's K
    steps (one round)."""
    import math

    seen: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]] = []
    real = PerFedAvg.meta_gradient

    def spy(self: PerFedAvg, model: nn.Module, params: object, batches: object) -> object:
        seen.append(batches)  # type: ignore[arg-type]
        return real(self, model, params, batches)  # type: ignore[arg-type]

    monkeypatch.setattr(PerFedAvg, "meta_gradient", spy)
    alpha, beta, k = 0.2, 0.3, 3
    algo = PerFedAvg.of(lr=0.1, beta=beta, alpha=alpha, local_steps=k, batch_size=2, rounds=1,
                        schedule="cosine", variant=variant)  # fmt: skip
    reply, _ = _round(algo, _data())
    want = _theta0()
    for step, batches in enumerate(seen):
        a_in, c_in = _quadratic(TensorSplit(*batches[0]))
        a_out, c_out = _quadratic(TensorSplit(*batches[1]))
        tilde = want - alpha * (a_in @ want - c_in)
        g = a_out @ tilde - c_out
        if variant == "hf":
            a_h, _ = _quadratic(TensorSplit(*batches[2]))
            g = g - alpha * (a_h @ g)
        want = want - beta * 0.5 * (1 + math.cos(math.pi * step / k)) * g
    assert len(seen) == k
    torch.testing.assert_close(_theta1(reply), want, rtol=0, atol=1e-12)


def test_the_adaptation_draws_its_minibatches_from_the_clients_generator() -> None:
    """P-local's adaptation steps on minibatches (B < n) drawn from the client's round
    generator: the same generator gives the same score whatever torch's global one."""
    common = {"lr": 0.2, "local_steps": 1, "batch_size": 2, "rounds": 1, "local_eval": True}
    algo = PerFedAvg.of(alpha=0.3, adapt_steps=2, **common)
    first, second = _under_two_global_seeds(algo, _data(n=8))
    assert first.metrics["local_mse"] == second.metrics["local_mse"]


def _under_two_global_seeds(algo: PerFedAvg, data: ClientData) -> list[Reply]:
    """One client round from the same server state and client generator, with torch's global
    generator seeded 1, then 2."""
    replies = []
    for global_seed in (1, 2):
        msg = algo.broadcast(algo.init_server(_model(), generator(0, 2)), 0, 0)
        torch.manual_seed(global_seed)
        reply, _ = algo.client_update(msg, None, _model(), data, generator(0, 3))
        replies.append(reply)
    return replies


def test_frozen_tensors_are_sent_once_and_never_move() -> None:
    """``freeze``: the frozen bias is broadcast in the first round only and filled in from the
    client's cache afterwards; it never moves."""
    algo = PerFedAvg.of(lr=0.1, local_steps=2, batch_size=8, rounds=3, freeze=("bias",))
    state, sent, kept = frozen_bias_rounds(algo, rounds=3)
    assert "model.bias" in sent[0].arrays
    assert all("model.bias" not in msg.arrays for msg in sent[1:])
    assert torch.equal(state.arrays["model.bias"], sent[0].arrays["model.bias"])
    assert torch.equal(kept.arrays["cache.bias"], sent[0].arrays["model.bias"])


def test_a_streamed_client_reads_its_rounds_part_of_the_stream() -> None:
    """A client that reads one stream over the run (``stream_seed``): its inner minibatches D of
    round t are batches t·K .. t·K + K - 1 of the stream, so the same generator in rounds 0 and
    1 gives other uploads (D' is drawn from the generator alike in both)."""
    seen: list[torch.Tensor] = []
    real = PerFedAvg.meta_gradient

    def spy(self: PerFedAvg, model: nn.Module, params: object, batches: object) -> object:
        seen.append(batches[0][0])  # type: ignore[index]
        return real(self, model, params, batches)  # type: ignore[arg-type]

    algo = PerFedAvg.of(lr=0.1, local_steps=2, batch_size=2, rounds=4)
    data = dataclasses.replace(_data(n=8), stream_seed=5)
    ups = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PerFedAvg, "meta_gradient", spy)
        for rnd in (0, 1):
            msg = algo.broadcast(algo.init_server(_model(), generator(0, 2)), rnd, 0)
            reply, _ = algo.client_update(msg, None, _model(), data, generator(0, 3))
            ups.append(reply.arrays["update.weight"])
    assert not torch.equal(ups[0], ups[1])
    want = [x for x, _ in stream_batches(data.train, 2, 4, 5, start=0)]  # rounds 0 and 1
    assert len(seen) == 4 and all(torch.equal(a, b) for a, b in zip(seen, want, strict=True))


def test_the_reported_losses_are_the_means_over_the_steps() -> None:
    """Two full-batch FO steps on the quadratic: ``inner_loss`` is the mean of f(w_k; D) and
    ``train_loss`` the mean of f(w̃_k; D'), by hand; every step skipped (NaN inputs): NaN."""
    from fedlore.train.local import task_loss

    lr, alpha = 0.2, 0.15
    algo = PerFedAvg.of(lr=lr, local_steps=2, batch_size=N, rounds=2, alpha=alpha)
    data = _data()
    reply, _ = _round(algo, data)
    a, c = _quadratic(data.train)
    z = torch.cat([data.train.x, torch.ones(N, 1, dtype=torch.float64)], dim=1)
    theta, inner, outer = _theta0(), [], []
    for _ in range(2):
        tilde = theta - alpha * (a @ theta - c)
        inner.append(float(task_loss(z @ theta, data.train.y)))
        outer.append(float(task_loss(z @ tilde, data.train.y)))
        theta = _by_hand(theta, a, c, alpha, lr, False)
    assert inner[0] != pytest.approx(inner[1], rel=1e-3)
    assert reply.metrics["inner_loss"] == pytest.approx(sum(inner) / 2, rel=1e-10)
    assert reply.metrics["train_loss"] == pytest.approx(sum(outer) / 2, rel=1e-10)
    bad = ClientData(0, TensorSplit(data.train.x * float("nan"), data.train.y), data.test)
    reply, _ = _round(algo, bad)
    assert reply.metrics["skipped_steps"] == 2
    assert reply.metrics["train_loss"] != reply.metrics["train_loss"]  # NaN
    assert all(bool((u == 0).all()) for u in reply.arrays.values())  # no step taken


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_the_outer_direction_is_clipped_and_the_inner_step_is_not(variant: str) -> None:
    """``optim.grad_clip`` scales the outer direction (``∇f(w̃)``, or HF's ``(I - α A) ∇f(w̃)``)
    to the clip norm before β's step, with ``clip_grad_norm_``'s coefficient
    ``c / (‖g‖ + 1e-6)``; the inner step that defines ``w̃`` is taken unclipped. Two
    full-batch steps on the quadratic, by hand."""
    lr, alpha, clip = 0.2, 0.15, 1e-2
    algo = PerFedAvg.of(lr=lr, local_steps=2, batch_size=N, rounds=2, alpha=alpha,
                        grad_clip=clip, variant=variant)  # fmt: skip
    data = _data()
    reply, _ = _round(algo, data)
    a, c = _quadratic(data.train)
    theta = _theta0()
    for _ in range(2):
        g_in = a @ theta - c
        assert float(g_in.norm()) > 10 * clip  # the premise: clipping the inner step would act
        g = a @ (theta - alpha * g_in) - c
        if variant == "hf":
            g = g - alpha * (a @ g)
        norm = float(g.norm())
        assert norm > 10 * clip  # the premise: the clip acts on the outer direction
        theta = theta - lr * (clip / (norm + 1e-6)) * g
    torch.testing.assert_close(_theta1(reply), theta, rtol=0, atol=1e-12)


def test_momentum_carries_over_the_outer_steps_and_its_buffer_is_counted() -> None:
    """SGD momentum μ on the outer step: ``b_k = μ b_{k-1} + g_k``, ``w <- w - β b_k`` over
    three full-batch FO steps (one optimizer for the round), by hand; ``optimizer_state_bytes``
    is the buffer (one float64 per parameter) and ``train_s`` lies within the call's time."""
    lr, alpha, mu = 0.2, 0.15, 0.9
    algo = PerFedAvg.of(lr=lr, local_steps=3, batch_size=N, rounds=2, alpha=alpha,
                        local_optimizer="sgd", momentum=mu)  # fmt: skip
    data = _data()
    t0 = time.perf_counter()
    reply, _ = _round(algo, data)
    wall = time.perf_counter() - t0
    a, c = _quadratic(data.train)
    theta, buf = _theta0(), torch.zeros(D_IN + 1, dtype=torch.float64)
    for _ in range(3):
        g = a @ (theta - alpha * (a @ theta - c)) - c
        buf = mu * buf + g
        theta = theta - lr * buf
    torch.testing.assert_close(_theta1(reply), theta, rtol=0, atol=1e-12)
    assert reply.metrics["optimizer_state_bytes"] == (D_IN + 1) * 8
    train_s = reply.metrics["train_s"]
    assert isinstance(train_s, float) and 0 < train_s <= wall


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_every_minibatch_stream_is_drawn_from_the_clients_generator(variant: str) -> None:
    """D, D' and D'' (B < n) all come from the client's round generator: the same generator
    gives the same upload whatever torch's global one (a stream drawn from the global one
    would differ)."""
    algo = PerFedAvg.of(lr=0.1, local_steps=3, batch_size=2, rounds=2, variant=variant)
    first, second = _under_two_global_seeds(algo, _data(n=8))
    assert torch.equal(first.arrays["update.weight"], second.arrays["update.weight"])


class _Masked(nn.Module):
    """A linear classifier whose class-0 logit is -inf (a buffer): the loss of a class-0
    example is inf while every gradient stays finite (softmax gives class 0 exactly 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D_IN, 2)
        self.register_buffer("mask", torch.tensor([-math.inf, 0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.mask


class _Pow(nn.Module):
    """A linear regression plus ``|c|^1.5`` at ``c = 0``: finite loss and gradient (0 in c),
    but its second derivative in c is not finite (HF's Hessian-vector product is NaN)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D_IN, 1)
        self.c = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.c.abs().pow(1.5)


@pytest.mark.parametrize("case", ["infinite_loss", "infinite_hessian"])
def test_a_step_whose_loss_or_direction_is_not_finite_is_skipped(case: str) -> None:
    """Two full-batch steps, each either skipped whole (counted, the model unmoved) or taken:
    an inf loss with finite gradients (``_Masked``: skipped by FO), or finite losses with a
    non-finite HF direction (``_Pow``: skipped by HF, while FO, whose direction is finite,
    steps)."""
    net: type[nn.Module]
    if case == "infinite_loss":
        g = torch.Generator().manual_seed(4)
        x = torch.randn(6, D_IN, generator=g, dtype=torch.float64)
        y = torch.tensor([0, 1, 0, 1, 0, 1])
        data = ClientData(0, TensorSplit(x[:4], y[:4]), TensorSplit(x[4:], y[4:]))
        variants, net = {"fo": True, "hf": True}, _Masked
    else:
        data, variants, net = _data(), {"fo": False, "hf": True}, _Pow
    for variant, skips in variants.items():
        algo = PerFedAvg.of(lr=0.2, local_steps=2, batch_size=len(data.train), rounds=2,
                            variant=variant)  # fmt: skip
        msg = algo.broadcast(algo.init_server(net().double(), generator(0, 2)), 0, 0)
        reply, _ = algo.client_update(msg, None, net().double(), data, generator(0, 3))
        assert reply.metrics["skipped_steps"] == (2 if skips else 0), variant
        moved = reply.arrays["update.lin.weight"]
        assert torch.isfinite(moved).all()
        assert bool((moved == 0).all()) == skips, variant


def test_a_model_handed_over_in_eval_mode_trains_in_train_mode() -> None:
    """The client puts the model in training mode: with BatchNorm, a model handed over in eval
    mode (as after an evaluation) trains and uploads exactly as one in training mode (batch
    statistics, running averages updated)."""

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(D_IN, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)).double()

    algo = PerFedAvg.of(lr=0.1, local_steps=2, batch_size=N, rounds=2)
    data = _data()
    ups = []
    for model in (net(), net().eval()):
        msg = algo.broadcast(algo.init_server(net(), generator(0, 2)), 0, 0)
        reply, _ = algo.client_update(msg, None, model, data, generator(0, 3))
        ups.append(reply.arrays)
    assert float(ups[0]["update.1.running_mean"].abs().max()) > 0  # the premise: stats moved
    assert all(torch.equal(ups[0][k], ups[1][k]) for k in ups[0])


def test_a_step_whose_outer_loss_alone_is_not_finite_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_Masked`` on one example of each class, B = 1: a step is skipped exactly when D or D'
    holds the class-0 example (an inf loss at w or at w̃; every gradient stays finite), also
    when D' alone does."""
    seen: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]] = []
    real = PerFedAvg.meta_gradient

    def spy(self: PerFedAvg, model: nn.Module, params: object, batches: object) -> object:
        seen.append(batches)  # type: ignore[arg-type]
        return real(self, model, params, batches)  # type: ignore[arg-type]

    monkeypatch.setattr(PerFedAvg, "meta_gradient", spy)
    x = torch.tensor([[0.5, -1.0], [1.5, 0.25], [0.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([1, 0, 1])
    data = ClientData(0, TensorSplit(x[:2], y[:2]), TensorSplit(x[2:], y[2:]))
    algo = PerFedAvg.of(lr=0.2, local_steps=8, batch_size=1, rounds=2)
    msg = algo.broadcast(algo.init_server(_Masked().double(), generator(0, 2)), 0, 0)
    reply, _ = algo.client_update(msg, None, _Masked().double(), data, generator(0, 3))
    inner_zero = [bool((b[0][1] == 0).any()) for b in seen]
    outer_zero = [bool((b[1][1] == 0).any()) for b in seen]
    assert any(o and not i for i, o in zip(inner_zero, outer_zero, strict=True))  # the premise
    want = sum(i or o for i, o in zip(inner_zero, outer_zero, strict=True))
    assert 0 < want < 8 and reply.metrics["skipped_steps"] == want
