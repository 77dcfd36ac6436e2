"""ProjectedAdam and the local training loop around it (skipped steps, FedLore candidates, conv)."""

from __future__ import annotations

import copy
from typing import Literal

import pytest
import torch
from torch import nn

from fedlore.algorithms.fedlore import FedLore
from fedlore.algorithms.lowrank import train_projected
from fedlore.data.client_data import ClientData, TensorSplit, minibatches
from fedlore.models import build_model
from fedlore.optim.projected_adam import ProjectedAdam
from fedlore.optim.subspace import MatrixSpec, projection_plan, random_basis, top_left_singular
from fedlore.settings import LocalTraining
from fedlore.tensors import model_arrays, select
from fedlore.train.local import local_train


def linear(out_f: int, in_f: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f)


def grads_for(step: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) * (1 + step % 3) for s in shapes]


# ------------------------------------------------------------------------ identity basis = AdamW
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_identity_basis_matches_adamw(side: Literal["left", "right"], weight_decay: float) -> None:
    out_f, in_f = 5, 7
    ref = linear(out_f, in_f)
    mine = copy.deepcopy(ref)
    m, n = (out_f, in_f) if side == "left" else (in_f, out_f)
    spec = MatrixSpec("weight", (out_f, in_f), side, m, n, m)  # r = m: the full space
    opt = ProjectedAdam(
        [mine.bias],
        [(mine.weight, spec, torch.eye(m))],
        lr=1e-2,
        betas=(0.9, 0.99),
        eps=1e-8,
        weight_decay=weight_decay,
    )
    ref_opt = torch.optim.AdamW(
        ref.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay
    )
    lrs = [1e-2, 5e-3, 2e-2, 1e-2, 1e-3, 1e-2, 3e-2, 1e-2]
    for step, lr in enumerate(lrs):
        for o in (opt, ref_opt):
            for group in o.param_groups:
                group["lr"] = lr
        gw, gb = grads_for(step, [(out_f, in_f), (out_f,)])
        mine.weight.grad, mine.bias.grad = gw.clone(), gb.clone()
        ref.weight.grad, ref.bias.grad = gw.clone(), gb.clone()
        opt.step()
        ref_opt.step()
        assert torch.allclose(mine.weight, ref.weight, rtol=1e-5, atol=1e-6), step
        assert torch.allclose(mine.bias, ref.bias, rtol=1e-5, atol=1e-6), step
    assert not torch.allclose(mine.weight, linear(out_f, in_f).weight, atol=1e-3)  # it moved
    st = opt.state[mine.weight]
    assert st["step"] == len(lrs)
    assert st["exp_avg"].shape == (m, n)


# ------------------------------------------------------------------------ moments and coordinates
@pytest.mark.parametrize("side", ["left", "right"])
def test_moments_live_in_coordinates(side: Literal["left", "right"]) -> None:
    lin = linear(9, 6)
    plan = projection_plan(nn.ModuleDict({"lin": lin}), 2, side=side)
    spec = plan["lin.weight"]
    assert (spec.m, spec.n) == ((9, 6) if side == "left" else (6, 9))
    basis = random_basis(3, spec.m, spec.rank)
    opt = ProjectedAdam([], [(lin.weight, spec, basis)], lr=1e-2)
    assert opt.state_bytes() == 0
    lin.weight.grad = torch.randn(9, 6)
    opt.step()
    st = opt.state[lin.weight]
    assert st["exp_avg"].shape == (spec.rank, spec.n)
    assert st["exp_avg_sq"].shape == (spec.rank, spec.n)
    assert opt.state_bytes() == 2 * spec.rank * spec.n * 4
    assert opt.basis_bytes() == spec.m * spec.rank * 4
    # the first moment is (1 - b1) Pᵀ G in view coordinates
    expected = 0.1 * basis.t() @ spec.view(lin.weight.grad)
    assert torch.allclose(st["exp_avg"], expected, atol=1e-6)


def test_state_bytes_adds_dense_moments() -> None:
    lin = linear(9, 6)
    spec = projection_plan(nn.ModuleDict({"lin": lin}), 3)["lin.weight"]
    opt = ProjectedAdam([lin.bias], [(lin.weight, spec, random_basis(0, 9, 3))])
    lin.weight.grad, lin.bias.grad = torch.randn(9, 6), torch.randn(9)
    opt.step()
    assert opt.state_bytes() == 2 * 3 * 6 * 4 + 2 * 9 * 4


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(("weight_decay", "scale"), [(0.0, 1.0), (0.2, 1.0), (0.1, 0.25)])
def test_coords_accumulate_to_endpoint(
    side: Literal["left", "right"], weight_decay: float, scale: float
) -> None:
    lin = linear(10, 8)
    spec = projection_plan(nn.ModuleDict({"lin": lin}), 3, side=side)["lin.weight"]
    basis = random_basis(5, spec.m, spec.rank)
    w0 = lin.weight.detach().clone()
    opt = ProjectedAdam(
        [], [(lin.weight, spec, basis)], lr=1e-2, weight_decay=weight_decay, scale=scale
    )
    lrs = [3e-2, 2e-2, 1e-2, 5e-3, 1e-3]
    a = 1.0
    for step, lr in enumerate(lrs):
        opt.set_lr(lr)
        (lin.weight.grad,) = grads_for(step, [(10, 8)])
        opt.step()
        a *= 1 - lr * weight_decay
    z = opt.coords[lin.weight]
    assert z.shape == (spec.rank, spec.n)
    recon = spec.unview(a * spec.view(w0).double() + basis.double() @ z.double())
    assert torch.allclose(recon.float(), lin.weight.detach(), atol=1e-6)
    assert float((lin.weight.detach() - w0).abs().max()) > 1e-3
    # the change is a·W0 plus something in span(P): its component outside span(P) is (a-1)W0
    resid = spec.view(lin.weight.detach() - a * w0).double()
    proj = basis.double() @ (basis.double().t() @ resid)
    assert torch.allclose(resid, proj, atol=1e-6)


def test_scale_multiplies_projected_step_only() -> None:
    outs = []
    for scale in (1.0, 3.0):
        lin = linear(8, 6)
        spec = projection_plan(nn.ModuleDict({"lin": lin}), 2)["lin.weight"]
        w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
        opt = ProjectedAdam(
            [lin.bias], [(lin.weight, spec, random_basis(1, 8, 2))], lr=1e-2, scale=scale
        )
        lin.weight.grad, lin.bias.grad = grads_for(0, [(8, 6), (8,)])
        opt.step()
        outs.append((lin.weight.detach() - w0, lin.bias.detach() - b0))
    assert torch.allclose(outs[1][0], 3.0 * outs[0][0], atol=1e-7)
    assert torch.allclose(outs[1][1], outs[0][1])


def test_wrong_basis_shape_is_rejected() -> None:
    lin = linear(8, 6)
    spec = projection_plan(nn.ModuleDict({"lin": lin}), 2)["lin.weight"]
    with pytest.raises(ValueError, match="basis"):
        ProjectedAdam([], [(lin.weight, spec, torch.eye(6, 2))])


# ------------------------------------------------------------------------ skipped steps
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(x)))


def tiny_opt(model: Tiny) -> tuple[ProjectedAdam, dict[str, MatrixSpec], dict]:
    plan = projection_plan(model, 2)
    bases = {k: random_basis(7, s.m, s.rank) for k, s in plan.items()}
    params = dict(model.named_parameters())
    opt = ProjectedAdam(
        [p for k, p in params.items() if k not in plan],
        [(params[k], plan[k], bases[k]) for k in plan],
        lr=1e-2,
    )
    return opt, plan, bases


def data(n: int = 12, nan_rows: tuple[int, ...] = (), seed: int = 0) -> TensorSplit:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    for r in nan_rows:
        x[r, 0] = float("nan")
    return TensorSplit(x, torch.randint(0, 3, (n,), generator=g))


def nan_batches(split: TensorSplit, bs: int, k: int, seed: int) -> list[bool]:
    gen = torch.Generator().manual_seed(seed)
    return [bool(torch.isnan(x).any()) for x, _ in minibatches(split, bs, k, gen)]


def test_nan_loss_batches_are_skipped() -> None:
    split = data(nan_rows=(4,))
    k, bs, seed = 10, 3, 11
    flags = nan_batches(split, bs, k, seed)
    assert 0 < sum(flags) < k
    model = Tiny()
    opt, _, _ = tiny_opt(model)
    gen = torch.Generator().manual_seed(seed)
    stats = local_train(model, minibatches(split, bs, k, gen), opt, [1e-2] * k)
    assert stats.skipped_steps == sum(flags)
    assert stats.steps == k
    for p in model.parameters():
        assert bool(torch.isfinite(p).all())
        assert opt.state[p]["step"] == k - sum(flags)  # no moment update on a skipped step


def test_nan_gradient_with_finite_loss_is_skipped() -> None:
    """A loss term with a finite value but NaN gradient (0 · d sqrt(u)/du at u = 0)."""
    model = Tiny()
    before = model_arrays(model)
    opt, _, _ = tiny_opt(model)

    def poison(m: nn.Module) -> torch.Tensor:
        assert isinstance(m, Tiny)
        return 0.0 * torch.sqrt((m.fc.weight * 0.0).sum())

    batches = minibatches(data(), 4, 4, torch.Generator().manual_seed(0))
    stats = local_train(model, batches, opt, [1e-2] * 4, loss_terms=[poison])
    assert stats.skipped_steps == 4
    assert stats.mean_loss != stats.mean_loss  # NaN: no finite step
    after = model_arrays(model)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert len(opt.state) == 0
    for p in model.parameters():
        assert p.grad is None


def test_last_gradient_is_last_finite_one() -> None:
    """keep_last_grad records the gradient of the last step that was actually taken."""
    k, bs = 8, 4
    split = data(n=12, nan_rows=(5,))
    seed = next(s for s in range(200) if nan_batches(split, bs, k, s)[-1])
    flags = nan_batches(split, bs, k, seed)
    last_ok = max(i for i, f in enumerate(flags) if not f)
    algo = FedLore(train=LocalTraining(local_steps=k, batch_size=bs, lr=1e-2), rank=2)
    model = Tiny()
    replay = copy.deepcopy(model)
    plan = algo.plan(model)
    bases = {key: random_basis(3, s.m, s.rank) for key, s in plan.items()}
    batches = minibatches(split, bs, k, torch.Generator().manual_seed(seed))
    res = train_projected(algo, model, batches, plan, bases, [1e-2] * k, True)
    assert res.stats.skipped_steps == sum(flags)
    # replay with a hook that records every taken step's gradient
    seen: dict[int, torch.Tensor] = {}
    params = dict(replay.named_parameters())
    opt = ProjectedAdam(
        [p for key, p in params.items() if key not in plan],
        [(params[key], plan[key], bases[key]) for key in plan],
        lr=1e-2,
    )

    def hook(_: nn.Module, step: int) -> None:
        grad = params["fc.weight"].grad
        assert grad is not None
        seen[step] = plan["fc.weight"].view(grad).detach().clone()

    batches = minibatches(split, bs, k, torch.Generator().manual_seed(seed))
    local_train(replay, batches, opt, [1e-2] * k, on_grad=[hook])
    assert max(seen) == last_ok
    assert torch.equal(res.last_grads["fc.weight"], seen[last_ok])


# ------------------------------------------------------------------------ FedLore candidates
def test_candidate_falls_back_to_current_basis() -> None:
    algo = FedLore(rank=2)
    spec = MatrixSpec("w", (8, 6), "left", 8, 6, 2)
    current = random_basis(0, 8, 2)
    bad = torch.randn(8, 6)
    bad[1, 1] = float("nan")
    assert torch.equal(algo._candidate(spec, bad, current, torch.Generator()), current)
    assert torch.equal(algo._candidate(spec, None, current, torch.Generator()), current)
    bad[1, 1] = float("inf")
    assert torch.equal(algo._candidate(spec, bad, current, torch.Generator()), current)
    good = torch.randn(8, 6)
    assert torch.equal(
        algo._candidate(spec, good, current, torch.Generator()), top_left_singular(good, 2)
    )
    assert torch.equal(algo._candidate(spec, bad, None, torch.Generator()), torch.eye(8, 2))


def test_client_without_finite_step_uploads_current_basis() -> None:
    algo = FedLore(
        train=LocalTraining(local_steps=3, batch_size=4, lr=1e-2), rank=2, init_basis="random"
    )
    model = Tiny()
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    split = data(n=8, nan_rows=tuple(range(8)))
    client = ClientData(0, split, split)
    msg = algo.broadcast(state, 0, 0)
    reply, _ = algo.client_update(msg, None, model, client, torch.Generator().manual_seed(1))
    assert reply.metrics["skipped_steps"] == 3
    bank = select(state.arrays, "bank.0.")
    for key in algo.plan(model):
        assert torch.equal(reply.arrays["cand." + key], bank[key])
        assert torch.equal(
            reply.arrays["update." + key], torch.zeros_like(reply.arrays["update." + key])
        )
    start = select(msg.arrays, "model.")
    for key, v in model_arrays(model).items():
        assert torch.equal(v, start[key]), key


# ------------------------------------------------------------------------ conv model
def test_cnn_trains_a_fedlore_round_with_projected_kernels() -> None:
    torch.manual_seed(0)
    model = build_model("cnn", (1, 8, 8), 10)
    rank = 3
    algo = FedLore(train=LocalTraining(local_steps=2, batch_size=8, lr=1e-2), rank=rank)
    plan = algo.plan(model)
    assert (plan["features.0.weight"].m, plan["features.0.weight"].n) == (32, 1 * 5 * 5)
    assert (plan["features.3.weight"].m, plan["features.3.weight"].n) == (64, 32 * 5 * 5)
    assert "fc.weight" in plan and not any(k.startswith("head.") for k in plan)
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    clients = []
    for cid in range(2):
        g = torch.Generator().manual_seed(cid)
        x = torch.rand(16, 1, 8, 8, generator=g)
        clients.append(
            ClientData(
                cid,
                TensorSplit(x, torch.randint(0, 10, (16,), generator=g)),
                TensorSplit(x, x[:, 0, 0, 0].long()),
            )
        )
    cstates: dict = {}
    # setup exchange (gradient P^0), then one training round
    for rnd in (-1, 0):
        expected = algo.expected_reply(state, rnd)
        replies = []
        for c in clients:
            msg = algo.broadcast(state, rnd, c.client_id)
            reply, cstates[c.client_id] = algo.client_update(
                msg, cstates.get(c.client_id), model, c, torch.Generator().manual_seed(rnd + 5)
            )
            assert set(reply.arrays) == set(expected)
            for key, (shape, dtype) in expected.items():
                assert tuple(reply.arrays[key].shape) == shape, key
                assert reply.arrays[key].dtype == dtype, key
            replies.append((c.client_id, reply))
        w_before = algo.global_arrays(state)
        state, _ = algo.aggregate(state, list(replies), rnd)
    assert replies[0][1].arrays["update.features.0.weight"].shape == (rank, 25)
    assert replies[0][1].arrays["cand.features.3.weight"].shape == (64, rank)
    assert all(r.metrics["skipped_steps"] == 0 for _, r in replies)
    w_after = algo.global_arrays(state)
    for key, spec in plan.items():
        delta = spec.view(w_after[key] - w_before[key]).double()
        assert float(delta.abs().max()) > 0, key
        assert int(torch.linalg.matrix_rank(delta, atol=1e-4 * float(delta.abs().max()))) <= rank


# ------------------------------------------------------------------------ projected SGD
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_projected_sgd_steps_along_the_projected_gradient(
    side: Literal["left", "right"], weight_decay: float
) -> None:
    """ProjectedSGD: W <- a W - lr·scale·P Pᵀ G for the projected matrix, p <- a p - lr g for
    dense ones, no moments; W_K = (Π a_k) W_0 + P Z exactly (Proposition 8)."""
    from fedlore.optim.projected_adam import ProjectedSGD

    lin = linear(10, 8).double()
    spec = projection_plan(nn.ModuleDict({"lin": lin}), 3, side=side)["lin.weight"]
    basis = random_basis(5, spec.m, spec.rank, torch.float64)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    scale = 0.5
    opt = ProjectedSGD(
        [lin.bias], [(lin.weight, spec, basis)], lr=1e-2, weight_decay=weight_decay, scale=scale
    )
    w_ref, b_ref, a = w0.clone(), b0.clone(), 1.0
    for step, lr in enumerate([3e-2, 2e-2, 1e-2]):
        opt.set_lr(lr)
        gw, gb = (g.double() for g in grads_for(step, [(10, 8), (10,)]))
        lin.weight.grad, lin.bias.grad = gw.clone(), gb.clone()
        opt.step()
        decay = 1 - lr * weight_decay
        pg = spec.unview(basis @ (basis.t() @ spec.view(gw)))
        w_ref = decay * w_ref - lr * scale * pg
        b_ref = decay * b_ref - lr * gb
        a *= decay
    torch.testing.assert_close(lin.weight.detach(), w_ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(lin.bias.detach(), b_ref, rtol=0, atol=1e-14)
    z = opt.coords[lin.weight]
    recon = spec.unview(a * spec.view(w0) + basis @ z)
    torch.testing.assert_close(recon, lin.weight.detach(), rtol=0, atol=1e-14)
    assert opt.state_bytes() == 0  # SGD keeps no moments
    assert opt.coords[lin.weight].dtype == torch.float64


def test_optim_name_sgd_reaches_every_projected_method() -> None:
    from fedlore.algorithms.lowrank import LowRankHyper
    from fedlore.config import load_config
    from fedlore.experiment_parts import make_algorithm

    cfg = load_config(None, ["optim.name=sgd"])
    for name in ("fedlore", "fedlore_random", "fedlore_fixed", "local_galore"):
        algo = make_algorithm(name, cfg)
        assert isinstance(algo, LowRankHyper) and algo.optimizer == "sgd", name
    default = make_algorithm("fedlore", load_config(None))
    assert isinstance(default, LowRankHyper) and default.optimizer == "adam"
