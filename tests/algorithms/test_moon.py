"""MOON (fedlore.algorithms.moon): FedAvg whose local loss adds μ ℓ_con, the model-contrastive
term on the representation z (the input of the model's ``head``).

* ℓ_con's value on a hand-computed example (cosine similarities, both divided by τ, the global
  model's as the positive, the previous model's as the negative, the minibatch's mean); for a
  sequence, per position along the last dimension.
* z is the head's input, read without leaving a hook; the frozen copies are evaluation-mode
  twins without gradients; the term refuses to run without the step's training forward pass.
* A local step is the gradient step of ``ℓ_sup + μ ℓ_con`` with z_glob from the received model
  and z_prev from the client's own model after its previous round, both frozen in evaluation
  mode (BatchNorm's running statistics): computed here by hand.
* At first contact z_prev is z_glob: ℓ_con = log 2 with no gradient, the round is FedAvg's.
* The client keeps its trained model (``prev.*``), through a round off too, and the client
  store counts it: one model per client; under ``params.freeze`` the frozen tensors are sent
  once, kept in its cache and never move.
* A model without a ``head`` is refused; so are μ or τ ≤ 0 and upload compression. 16-bit
  uploads, a robust mean and a server optimizer work (FedAvg's server), and so do secure
  aggregation and DP (attacked in tests/privacy/test_personal_methods.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from four_clusters import SERVER_SETTINGS, N, Run, check_fedavg_server
from four_clusters import client as _client
from four_clusters import model as _model
from torch import nn

from fedlore.algorithms.fedavg import FedAvg
from fedlore.algorithms.moon import (
    PREV,
    Contrast,
    Moon,
    contrastive_loss,
    frozen_copy,
    representation,
)
from fedlore.config import load_config
from fedlore.data.client_data import ClientData
from fedlore.experiment_parts import make_algorithm
from fedlore.seeding import generator
from fedlore.tensors import load_model_arrays, model_arrays, nbytes, select
from fedlore.types import Broadcast, Reply, State


def _moon(**kw: object) -> Moon:
    return Moon.of(**{"lr": 0.1, "local_steps": 3, "batch_size": 16, "rounds": 3, **kw})


def test_the_contrastive_loss_on_a_hand_computed_example() -> None:
    """Three examples in R^2, τ = 0.5. With s_g = cos(z, z_glob), s_p = cos(z, z_prev), each
    example's ℓ_con = log(1 + e^{(s_p - s_g)/τ}):

    * z = (1, 0), z_glob = (1, 0), z_prev = (0, 1): s_g = 1, s_p = 0: log(1 + e^-2);
    * z = (2, 0), z_glob = (3, 4), z_prev = (0, -5): s_g = 6/10 = 0.6, s_p = 0: log(1 + e^-1.2)
      (a dot product would give s_g = 6);
    * z = (1, 1), z_glob = (2, 0), z_prev = (3, 3): s_g = 1/√2, s_p = 1: log(1 + e^{2 - √2}),
      the previous model closer than the global one.

    ℓ_con is their mean, 0.4728...; swapping the two models, dropping the normalization,
    multiplying by τ or dividing one similarity only all give other values."""
    z = torch.tensor([[1.0, 0.0], [2.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[1.0, 0.0], [3.0, 4.0], [2.0, 0.0]])
    z_prev = torch.tensor([[0.0, 1.0], [0.0, -5.0], [3.0, 3.0]])
    rows = [math.log1p(math.exp(-2.0)), math.log1p(math.exp(-1.2)),
            math.log1p(math.exp(2.0 - math.sqrt(2.0)))]  # fmt: skip
    want = sum(rows) / 3
    assert want == pytest.approx(0.472848, abs=1e-6)
    got = contrastive_loss(z, z_glob, z_prev, 0.5)
    assert got.shape == () and float(got) == pytest.approx(want, rel=1e-6)
    # one example at a time, and at τ = 1 (e^{s_p - s_g}) for the last one
    for i, value in enumerate(rows):
        one = contrastive_loss(z[i : i + 1], z_glob[i : i + 1], z_prev[i : i + 1], 0.5)
        assert float(one) == pytest.approx(value, rel=1e-6)
    last = contrastive_loss(z[2:], z_glob[2:], z_prev[2:], 1.0)
    assert float(last) == pytest.approx(math.log1p(math.exp(1.0 - 1.0 / math.sqrt(2.0))))
    # identical models: log 2, whatever z, and no gradient
    w = torch.tensor([[0.3, -2.0], [1.0, 4.0]], requires_grad=True)
    same = contrastive_loss(w, z_glob[:2], z_glob[:2], 0.5)
    assert float(same.detach()) == pytest.approx(math.log(2.0))
    same.backward()
    assert w.grad is not None and float(w.grad.abs().max()) < 1e-7


def test_the_contrastive_loss_of_a_sequence_is_per_position() -> None:
    """For z of shape [B, L, d] (a language model's tokens) the similarities are taken along the
    last dimension and ℓ_con is the mean over all B·L positions: the loss of the same rows laid
    out as [B·L, d], written out by hand too (B, L, d all different, so taking a similarity or
    stacking along another dimension gives another value). On the ``meta`` device it stays
    there (its targets made on the logits' device)."""
    g = torch.Generator().manual_seed(0)
    z, z_glob, z_prev = (torch.randn(2, 3, 5, generator=g) for _ in range(3))
    flat = contrastive_loss(z.reshape(6, 5), z_glob.reshape(6, 5), z_prev.reshape(6, 5), 0.5)
    got = contrastive_loss(z, z_glob, z_prev, 0.5)
    assert got.shape == () and float(got) == pytest.approx(float(flat), rel=1e-6)
    rows = []
    for a, b, c in zip(z.reshape(6, 5), z_glob.reshape(6, 5), z_prev.reshape(6, 5), strict=True):
        s_g = float(a @ b / (a.norm() * b.norm()))
        s_p = float(a @ c / (a.norm() * c.norm()))
        rows.append(math.log1p(math.exp((s_p - s_g) / 0.5)))
    assert float(got) == pytest.approx(sum(rows) / 6, rel=1e-5)
    meta = contrastive_loss(z.to("meta"), z_glob.to("meta"), z_prev.to("meta"), 0.5)
    assert meta.device.type == "meta" and meta.shape == ()


def test_the_frozen_copies_are_detached_evaluation_twins() -> None:
    """``frozen_copy``: a copy in evaluation mode whose parameters neither require nor hold a
    gradient, with the given arrays loaded (or the model's own); the model itself is left
    training, with its gradients."""
    model = _model("batch")
    model.train()
    F.cross_entropy(model(_client(0).train.x), _client(0).train.y).backward()
    other = model_arrays(_model("batch", 3))
    for arrays, want in ((None, model_arrays(model)), (other, other)):
        twin = frozen_copy(model, arrays)
        assert not twin.training and not any(m.training for m in twin.modules())
        assert all(not p.requires_grad and p.grad is None for p in twin.parameters())
        got = model_arrays(twin)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert model.training
    assert all(p.requires_grad and p.grad is not None for p in model.parameters())


class _Skips(nn.Module):
    """A model with a ``head`` its forward pass never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_z_is_the_input_of_the_head_read_without_a_trace() -> None:
    """``representation`` is the head's input (the MLP's body output) and leaves no hook on the
    model; a model whose forward pass skips its head is refused, by name."""
    model = _model("batch")
    model.eval()
    x = _client(0).train.x
    torch.testing.assert_close(representation(model, x), model.body(x))
    assert not model.head._forward_pre_hooks and not model._forward_pre_hooks
    with pytest.raises(RuntimeError) as info:
        representation(_Skips(), x)
    assert str(info.value) == "moon: the model's forward pass did not call its `head`"
    assert not _Skips().head._forward_pre_hooks


def test_the_term_reads_the_training_forward_just_made() -> None:
    """The term of a step needs the step's training forward pass (the model's input x and its
    z, each recorded once): without one, with the head's input alone, or read twice, it
    refuses; an evaluation forward (a P-local score) records nothing. ``close`` leaves the
    model without hooks."""
    model = _model("batch")
    glob = frozen_copy(model)
    term = Contrast(model, glob, None, 2.0, 0.5)
    message = "moon: no training forward pass recorded x and z before its term"
    x = _client(0).train.x
    model.train()
    model.head(torch.randn(3, 12))  # z only
    model.eval()
    model(x)  # an evaluation: nothing
    for _ in range(2):
        with pytest.raises(RuntimeError) as info:
            term(model)
        assert str(info.value) == message
    model.train()
    model(x)
    assert float(term(model).detach()) == pytest.approx(2.0 * math.log(2.0))  # z_prev = z_glob
    with pytest.raises(RuntimeError, match="no training forward pass"):
        term(model)
    term.close()
    assert not model._forward_pre_hooks and not model.head._forward_pre_hooks


def _reference(start: dict[str, torch.Tensor], prev: dict[str, torch.Tensor], data: ClientData,
               mu: float, tau: float, lr: float) -> dict[str, torch.Tensor]:  # fmt: skip
    """One full-batch SGD step on ``CE + mu l_con`` by hand, on the MLP with BatchNorm: z is the
    body's output (the head's input), z_glob and z_prev the bodies of the received and the
    previous models in evaluation mode; cosine similarities written out."""
    ref, glob, old = _model("batch", 5), _model("batch", 6), _model("batch", 7)
    load_model_arrays(ref, start)
    load_model_arrays(glob, start)
    load_model_arrays(old, prev)
    glob.eval()
    old.eval()
    ref.train()
    x, y = data.train.x, data.train.y
    z = ref.body(x)
    with torch.no_grad():
        z_glob, z_prev = glob.body(x), old.body(x)

    def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum(-1) / (a.norm(dim=-1).clamp_min(1e-8) * b.norm(dim=-1).clamp_min(1e-8))

    pos, neg = torch.exp(cos(z, z_glob) / tau), torch.exp(cos(z, z_prev) / tau)
    con = -torch.log(pos / (pos + neg)).mean()
    loss = F.cross_entropy(ref.head(z), y) + mu * con
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            assert p.grad is not None
            p.sub_(lr * p.grad)
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _two_rounds(algo: Moon, data: ClientData) -> tuple[Broadcast, State, State]:
    """Round 0 of client 0 (on ``data``) and client 1, the server's step, and round 1's
    broadcast to client 0: (that broadcast, client 0's state after round 0, the server state).
    The global model is the two clients' mean, not client 0's model."""
    state = algo.init_server(_model("batch"), generator(0, 2))
    replies: list[tuple[int, Reply | None]] = []
    mine = State()
    for cid, own in ((0, data), (1, _client(1, "features"))):
        reply, kept = algo.client_update(algo.broadcast(state, 0, cid), None, _model("batch"),
                                         own, generator(0, 3, cid))  # fmt: skip
        replies.append((cid, reply))
        mine = kept if cid == 0 else mine
    state, _ = algo.aggregate(state, replies, 0)
    return algo.broadcast(state, 1, 0), mine, state


def test_a_local_step_descends_the_contrastive_objective_by_hand() -> None:
    """Round 1 of client 0 (its round-0 model kept as prev.*), one full-batch SGD step at μ = 5:
    the upload is the hand-computed step of ``CE + μ ℓ_con`` with z_prev from the client's
    previous model, which differs from the step with z_prev from the global model (no
    contrastive gradient: FedAvg's step)."""
    mu, tau, lr = 5.0, 0.5, 0.2
    algo = _moon(mu=mu, temperature=tau, lr=lr, local_steps=1, batch_size=64)
    data = _client(0, "features")
    msg, mine, _ = _two_rounds(algo, data)
    prev = select(mine.arrays, PREV)
    start = select(msg.arrays, "model.")
    assert max(float((prev[k] - start[k]).abs().max()) for k in start) > 0.01  # not the global
    reply, after = algo.client_update(msg, mine, _model("batch", 9), data, generator(0, 3, 1))
    want = _reference(start, prev, data, mu, tau, lr)
    got = {k: start[k] + reply.arrays["update." + k] for k in start}
    for k in start:
        torch.testing.assert_close(got[k], want[k].to(got[k].dtype), rtol=1e-5, atol=1e-6)
    # the client keeps what it trained
    for k, v in select(after.arrays, PREV).items():
        torch.testing.assert_close(v, want[k].to(v.dtype), rtol=1e-5, atol=1e-6)
    # with the global model as the previous one the step would be FedAvg's, another step
    plain = _reference(start, start, data, mu, tau, lr)
    assert max(float((want[k] - plain[k]).abs().max()) for k in want if k.endswith("weight")) > 1e-4


def test_at_first_contact_the_global_model_is_the_previous_one_and_the_round_is_fedavgs() -> None:
    """Without a previous model z_prev = z_glob: ℓ_con = log 2 with no gradient, so the upload
    is FedAvg's (up to rounding) and the reported loss is FedAvg's plus μ log 2."""
    settings = {"lr": 0.1, "local_steps": 3, "batch_size": 16, "rounds": 3}
    moon, fedavg = Moon.of(mu=2.0, **settings), FedAvg.of(**settings)
    data = _client(1, "features")
    state = moon.init_server(_model("batch"), generator(0, 2))
    msg = moon.broadcast(state, 0, 1)
    mine, _ = moon.client_update(msg, None, _model("batch"), data, generator(0, 3, 0))
    theirs, _ = fedavg.client_update(msg, None, _model("batch"), data, generator(0, 3, 0))
    assert mine.arrays.keys() == theirs.arrays.keys()
    for k in mine.arrays:
        torch.testing.assert_close(mine.arrays[k], theirs.arrays[k], rtol=1e-5, atol=1e-6)
    want = float(theirs.metrics["train_loss"]) + 2.0 * math.log(2.0)
    assert float(mine.metrics["train_loss"]) == pytest.approx(want, rel=1e-5)


def test_each_client_keeps_its_trained_model_and_the_store_counts_it() -> None:
    """After every round a client's state holds its trained model (the received model plus its
    upload), untouched while it sits out; the client store holds one model per client."""
    algo = _moon()
    run = Run(algo, "none", [[0, 1, 2], [0, 1], [0, 1, 2]], kind="features")
    init = model_arrays(_model())
    for rnd, replies in enumerate(run.got):
        for cid, reply in replies.items():
            assert isinstance(reply, Reply)
            sent = select(run.sent[rnd][cid].arrays, "model.")
            kept = select(run.clients[rnd][cid].arrays, PREV)
            assert set(kept) == set(init)
            for k in init:
                torch.testing.assert_close(kept[k], sent[k] + reply.arrays["update." + k])
    away = run.clients[0][2], run.clients[1][2]
    assert all(torch.equal(away[0].arrays[k], away[1].arrays[k]) for k in away[0].arrays)
    assert run.store.stats()["memory_bytes"] == N * nbytes(init)


def test_a_model_without_a_head_and_bad_settings_are_refused() -> None:
    """Each refusal whole: a model without a ``head`` (naming its first 8 modules), μ and τ not
    above 0 (NaN included)."""
    headless = nn.Sequential(nn.Linear(8, 12), *(nn.ReLU() for _ in range(8)), nn.Linear(12, 4))
    message = (
        "moon: the model has no `head` module; MOON contrasts the representation z, the input of "
        "the model's output layer, which it finds as the module named `head` (as every fedlore "
        "classifier names it); this model's modules: ['0', '1', '2', '3', '4', '5', '6', '7']"
    )
    with pytest.raises(ValueError) as info:
        _moon().init_server(headless, torch.Generator())
    assert str(info.value) == message
    state = _moon().init_server(_model(), torch.Generator())
    with pytest.raises(ValueError) as info:
        _moon().client_update(
            Broadcast({"model." + k: v for k, v in model_arrays(headless).items()}, {"round": 0}),
            None, headless, _client(0), torch.Generator(),
        )  # fmt: skip
    assert str(info.value) == message
    assert state.arrays
    mu = "moon: mu must be > 0 (the contrastive term's weight; 0 is FedAvg), got {}"
    tau = "moon: temperature must be > 0 (it divides the similarities), got {}"
    for bad, want in ((dict(mu=0.0), mu.format(0.0)), (dict(mu=-1.0), mu.format(-1.0)),
                      (dict(mu=math.nan), mu.format(math.nan)),
                      (dict(temperature=0.0), tau.format(0.0)),
                      (dict(temperature=-1.0), tau.format(-1.0)),
                      (dict(temperature=math.nan), tau.format(math.nan))):  # fmt: skip
        with pytest.raises(ValueError) as info:
            _moon(**bad)
        assert str(info.value) == want
    small = _moon(mu=1e-9, temperature=1e-9)
    assert (small.mu, small.temperature) == (1e-9, 1e-9)
    for mode in ("secure_aggregation=true", "dp.clip_norm=1,dp.noise_multiplier=1.0"):
        cfg = load_config(None, ["algorithms=[moon]", *mode.split(","), "weighting=uniform"])
        assert make_algorithm("moon", cfg).train.upload_increments  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="method 'moon' does not offer upload compression"):
        make_algorithm("moon", load_config(None, ["method.moon.compression=topk"]))


def test_16_bit_uploads_a_robust_mean_and_a_server_optimizer_work() -> None:
    """FedAvg's server, unchanged: a bf16 upload (the kept model stays fp32), the coordinate-wise
    median of the deltas, FedAdam's moments for every tensor."""
    every = {n for n, _ in _model().named_parameters()}
    for settings in SERVER_SETTINGS:
        check_fedavg_server(_moon(**settings), settings, every, lambda kept: kept.arrays)


def test_frozen_tensors_are_sent_once_and_never_move() -> None:
    """``params.freeze`` with MOON: after first contact the broadcast leaves the frozen bias
    out, the client fills it from its cache (kept beside its previous model), no reply carries
    it and no model, kept or global, moves it."""
    algo = _moon(freeze=["body.0.bias"])
    run = Run(algo, "none", [[0, 1], [0, 1], [0, 1]], kind="features")
    init = model_arrays(_model())
    full = {"model." + k for k in init}
    assert all(set(m.arrays) == full for m in run.sent[0].values())
    for sent in run.sent[1:]:
        assert all(set(m.arrays) == full - {"model.body.0.bias"} for m in sent.values())
    for replies in run.got:
        for reply in replies.values():
            assert isinstance(reply, Reply)
            assert set(reply.arrays) == {"update." + k for k in init} - {"update.body.0.bias"}
    for cid in (0, 1):
        kept = run.store.get(cid)
        assert kept is not None
        assert set(kept.arrays) == {PREV + k for k in init} | {"cache.body.0.bias"}
        assert torch.equal(kept.arrays["cache.body.0.bias"], init["body.0.bias"])
        assert torch.equal(kept.arrays[PREV + "body.0.bias"], init["body.0.bias"])
        assert not torch.equal(kept.arrays[PREV + "body.0.weight"], init["body.0.weight"])
    assert torch.equal(run.states[-1].arrays["model.body.0.bias"], init["body.0.bias"])
