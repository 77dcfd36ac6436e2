"""FedMask: masked layers (straight-through scores over fixed W), bit packing and upload bytes,
the server's overlap rule, one-shot pruning, the personal model in the client state, P-local
evaluation, and a tiny digits run."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import fedlore.algorithms.fedmask  # noqa: F401  (registers "fedmask")
from fedlore.algorithms.fedmask import FedMask
from fedlore.algorithms.fedmask_bits import overlap_mean, pack_mask, unpack_mask
from fedlore.algorithms.fedmask_layers import MaskedLinear, masked_layers, maskify
from fedlore.config import Config, load_config
from fedlore.data.federation import Federation, build_federation
from fedlore.engine.loop import RoundLoop, validate_reply
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.seeding import CLIENT, SERVER_INIT, generator
from fedlore.tensors import load_model_arrays, nbytes, select
from fedlore.train.local import local_train
from fedlore.types import Reply, State

SEED = 1


def _cfg(*extra: str) -> Config:
    return load_config(
        None,
        [
            "name=fedmask",
            "num_clients=3",
            "rounds=3",
            "local_steps=5",
            "batch_size=16",
            "lr=3e-2",
            "model.kwargs={hidden: [32]}",
            "partition.min_size=10",
            "progress=false",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def fed() -> Federation:
    return build_federation(_cfg(), SEED)


def _setup(fed: Federation, *extra: str) -> tuple[FedMask, Config, State]:
    cfg = _cfg(*extra)
    algo = make_algorithm("fedmask", cfg)
    assert isinstance(algo, FedMask)
    state = algo.init_server(model_factory(cfg, fed, SEED)(), generator(SEED, SERVER_INIT))
    return algo, cfg, state


def _loop(
    algo: FedMask, cfg: Config, fed: Federation, store: ClientStore, schedule: dict[int, list[int]]
) -> RoundLoop:
    transport = LocalTransport(algo, fed.client, model_factory(cfg, fed, SEED), SEED, store)
    return RoundLoop(algo, transport, lambda rnd: schedule[rnd])


# ------------------------------------------------------------------------------ layers


def test_straight_through_gradient_reaches_scores_and_w_never_changes() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(6, 3)
    layer = MaskedLinear(lin, score=0.5)
    params = dict(layer.named_parameters())
    weight_score, bias_score = params["weight_score"], params["bias_score"]
    with torch.no_grad():
        weight_score.copy_(torch.randn(3, 6))
        bias_score.copy_(torch.randn(3))
    assert layer.bias is not None
    w0, b0 = layer.weight.clone(), layer.bias.clone()
    x = torch.randn(4, 6)
    out = layer(x)
    m = (weight_score > 0).float()
    mb = (bias_score > 0).float()
    torch.testing.assert_close(out, x @ (w0 * m).T + b0 * mb)  # forward: the hard mask exactly
    out.pow(2).sum().backward()
    # dL/ds = dL/dW_eff * W * sigmoid'(s), with dL/dW_eff = g^T x
    g = 2 * out.detach()
    sig = torch.sigmoid(weight_score.detach())
    expect = (g.T @ x) * w0 * sig * (1 - sig)
    torch.testing.assert_close(weight_score.grad, expect)
    assert bias_score.grad is not None and bias_score.grad.abs().sum() > 0
    assert [n for n, _ in layer.named_parameters()] == ["weight_score", "bias_score"]

    model = maskify(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    fixed = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_score")}
    scores = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_score")}
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
    y = torch.randint(0, 3, (16,))
    local_train(model, [(torch.randn(16, 6), y)] * 5, opt, [0.1] * 5)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in fixed.items())  # W, b, keep untouched
    assert any(not torch.equal(after[k], v) for k, v in scores.items())


def test_maskify_is_idempotent_and_masks_the_last_layers() -> None:
    first, head = nn.Linear(4, 5), nn.Linear(5, 3)
    net = nn.Sequential(first, nn.ReLU(), head)
    w_head = head.weight.detach().clone()
    once = maskify(copy.deepcopy(net), weights="init")
    keys = list(once.state_dict())
    twice = maskify(once)
    assert twice is once and list(twice.state_dict()) == keys
    assert [n for n, p in once.named_parameters() if p.requires_grad] == [
        "0.weight_score",
        "0.bias_score",
        "2.weight_score",
        "2.bias_score",
    ]
    last = maskify(copy.deepcopy(net), last=1, weights="init")
    assert list(masked_layers(last)) == ["2"]
    assert isinstance(last[2], MaskedLinear) and torch.equal(last[2].weight, w_head)
    assert isinstance(last[0], nn.Linear) and not last[0].weight.requires_grad  # fixed
    sc = maskify(copy.deepcopy(net), weights="signed_constant")
    expect = torch.sign(w_head) * math.sqrt(2 / 5)
    assert isinstance(sc[2], MaskedLinear)
    torch.testing.assert_close(sc[2].weight, expect)
    with pytest.raises(ValueError, match="last 3"):
        maskify(copy.deepcopy(net), last=3)


# --------------------------------------------------------------------- packing and bytes


def test_packing_round_trip_and_upload_is_one_bit_per_parameter(fed: Federation) -> None:
    g = torch.Generator().manual_seed(0)
    for shape in [(1,), (7,), (8,), (3, 5, 2), (32, 64)]:
        m = torch.rand(shape, generator=g) > 0.5
        packed = pack_mask(m)
        assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(m.numel() / 8),)
        assert torch.equal(unpack_mask(packed, shape), m)
    with pytest.raises(ValueError, match="uint8"):
        unpack_mask(torch.zeros(3, dtype=torch.uint8), (32,))

    algo, cfg, state = _setup(fed)
    model = model_factory(cfg, fed, SEED)()
    n = {
        k[:-6]: v.numel() for k, v in select(state.arrays, "model.").items() if k.endswith("_score")
    }
    assert set(n) == {"body.0.weight", "body.0.bias", "head.weight", "head.bias"}
    reply, _ = algo.client_update(
        algo.broadcast(state, 0, 0), None, model, fed.client(0), generator(SEED, CLIENT, 0, 0)
    )
    assert nbytes(reply.arrays) == sum(math.ceil(v / 8) for v in n.values())  # 302 bytes
    assert nbytes(reply.arrays) <= sum(n.values()) / 8 + len(n)
    spec = algo.expected_reply(state, 0, 0)
    assert validate_reply(reply, spec) is None
    bad = dict(reply.arrays)
    bad["mask.head.weight"] = bad["mask.head.weight"].float()
    assert "dtype" in str(validate_reply(Reply(bad, reply.metrics), spec))
    bad["mask.head.weight"] = torch.zeros(41, dtype=torch.uint8)
    assert "shape" in str(validate_reply(Reply(bad, reply.metrics), spec))

    # down: A as float32 every round, the fixed tensors only until the client has replied
    first = algo.broadcast(state, 0, 0)
    fixed = sum(v.numel() for k, v in first.arrays.items() if k.startswith("model."))
    assert nbytes(first.arrays) == 4 * (sum(n.values()) + fixed)
    after, _ = algo.aggregate(state, [(0, reply)], 0)
    assert nbytes(algo.broadcast(after, 1, 0).arrays) == 4 * sum(n.values())
    lost, _ = algo.aggregate(after, [(0, None)], 1)  # a lost reply: send W again
    assert nbytes(algo.broadcast(lost, 2, 0).arrays) == nbytes(first.arrays)


# ---------------------------------------------------------------------------- server rule


def test_overlap_mean_on_three_clients_by_hand() -> None:
    m1 = torch.tensor([1, 1, 0, 0, 1, 0], dtype=torch.bool)
    m2 = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.bool)
    m3 = torch.tensor([1, 0, 0, 1, 0, 0], dtype=torch.bool)
    # counts 3, 1, 1, 1, 2, 0 -> only positions 0 and 4 have >= 2 ones
    uniform = overlap_mean([m1, m2, m3], [1.0, 1.0, 1.0])
    torch.testing.assert_close(uniform, torch.tensor([1.0, 0, 0, 0, 2 / 3, 0]))
    weighted = overlap_mean([m1, m2, m3], [1.0, 2.0, 1.0])
    torch.testing.assert_close(weighted, torch.tensor([1.0, 0, 0, 0, 3 / 4, 0]))
    assert overlap_mean([m1, m2, m3], [1.0, 1.0, 1.0], min_overlap=1)[1] == pytest.approx(1 / 3)
    assert overlap_mean([m1], [1.0]).sum() == 0  # one client never reaches an overlap of 2
    with pytest.raises(ValueError):
        overlap_mean([m1, m2], [1.0])


def test_aggregate_stores_the_overlap_mean_of_the_uploads(fed: Federation) -> None:
    algo, _, state = _setup(fed, "weighting=uniform")
    shapes = algo.masked_tensors(state)
    g = torch.Generator().manual_seed(3)
    masks = [{t: torch.rand(s, generator=g) > 0.5 for t, s in shapes.items()} for _ in range(3)]
    replies: list[tuple[int, Reply | None]] = [
        (c, Reply({"mask." + t: pack_mask(b) for t, b in m.items()}, {"num_examples": 10}))
        for c, m in enumerate(masks)
    ]
    new, metrics = algo.aggregate(state, [*replies, (7, None)], 0)
    assert metrics["aggregated"] == 3
    for t in shapes:
        count = torch.stack([m[t].double() for m in masks]).sum(0)
        expect = torch.where(count >= 2, count / 3, torch.zeros_like(count)).float()
        torch.testing.assert_close(new.arrays[f"model.{t}_score"], expect)
        torch.testing.assert_close(algo.broadcast(new, 1, 0).arrays["mask." + t], expect)
    glob = algo.global_arrays(new)
    assert all(bool(v.all()) for k, v in glob.items() if k.endswith("_keep"))
    assert {k: v for k, v in glob.items() if not k.endswith("_score")}.keys() == {
        k for k in select(state.arrays, "model.") if not k.endswith("_score")
    }


# -------------------------------------------------------------------------------- pruning


@pytest.mark.parametrize("persistent", [False, True])
def test_first_round_prunes_to_the_top_share(fed: Federation, persistent: bool) -> None:
    algo, cfg, state = _setup(fed, f"method.fedmask.persistent_prune={str(persistent).lower()}")
    model = algo.prepare_model(model_factory(cfg, fed, SEED)())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in masked_layers(model).values():
            for t in layer.masked:
                getattr(layer, t + "_score").copy_(
                    torch.randn(getattr(layer, t).shape, generator=g)
                )
    before = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("_score")}
    algo.prune(model)
    for k, s0 in before.items():
        s = model.state_dict()[k]
        kept = s != 0
        n_keep = max(1, round(0.2 * s0.numel()))
        assert int(kept.sum()) == n_keep
        # exactly the largest scores survive, unchanged
        assert float(s0[kept].min()) >= float(s0[~kept].max())
        assert torch.equal(s[kept], s0[kept])
        keep = model.state_dict()[k[: -len("_score")] + "_keep"]
        assert torch.equal(keep, kept) if persistent else bool(keep.all())

    # in a real first round the upload has at most the kept share of ones
    reply, new = algo.client_update(
        algo.broadcast(state, 0, 1), None, model, fed.client(1), generator(SEED, CLIENT, 0, 1)
    )
    for t, shape in algo.masked_tensors(state).items():
        ones = int(unpack_mask(reply.arrays["mask." + t], shape).sum())
        assert 0 < ones <= max(1, round(0.2 * math.prod(shape)))
    # a later round does not prune again; with persistent pruning the mask stays inside keep
    after, _ = algo.aggregate(state, [(0, reply), (1, reply)], 0)  # two alike: A = its mask
    reply2, new2 = algo.client_update(
        algo.broadcast(after, 1, 1), new, model, fed.client(1), generator(SEED, CLIENT, 1, 1)
    )
    for t, shape in algo.masked_tensors(state).items():
        mask = unpack_mask(reply2.arrays["mask." + t], shape)
        keep = new2.arrays[f"personal.{t}_keep"]
        assert torch.equal(keep, new.arrays[f"personal.{t}_keep"])
        if persistent:
            assert not bool((mask & ~keep).any())
    if not persistent:  # non-persistent: round 1 turns on positions outside the first top share
        dens = [float(reply2.metrics["density"]), float(reply.metrics["density"])]
        assert dens[0] > dens[1], dens


# ---------------------------------------------------------------------- personal model


def test_personal_state_survives_a_skipped_round_and_differs(fed: Federation) -> None:
    algo, cfg, state = _setup(fed)
    store = ClientStore()
    loop = _loop(algo, cfg, fed, store, {0: [0, 1, 2], 1: [0, 1], 2: [1, 2]})
    state, _ = loop.run_round(state, 0, 2)
    two = store.get(2)
    assert two is not None
    snapshot = {k: v.clone() for k, v in two.arrays.items()}
    assert snapshot and all(k.startswith("personal.") for k in snapshot)
    state, _ = loop.run_round(state, 1, 2)
    kept = store.get(2)
    assert kept is not None
    assert snapshot.keys() == kept.arrays.keys()
    assert all(torch.equal(v, kept.arrays[k]) for k, v in snapshot.items())  # sat out: intact
    s0, s1 = store.get(0), store.get(1)
    assert s0 is not None and s1 is not None
    scores = [k for k in snapshot if k.endswith("_score")]
    assert any(not torch.equal(s0.arrays[k], s1.arrays[k]) for k in scores)  # personal
    fixed = [k for k in snapshot if not k.endswith(("_score", "_keep"))]
    assert all(torch.equal(s0.arrays[k], s1.arrays[k]) for k in fixed)  # W is shared
    # client 2 comes back in round 2 without W in its broadcast, from its own copy
    msg = algo.broadcast(state, 2, 2)
    assert not any(k.startswith("model.") for k in msg.arrays)
    state, row = loop.run_round(state, 2, 2)
    assert row["accepted"] == 2
    with pytest.raises(RuntimeError, match="state was lost"):
        algo.client_update(
            msg, None, model_factory(cfg, fed, SEED)(), fed.client(2), generator(SEED, CLIENT, 2, 2)
        )


def test_evaluate_personal_reads_the_personal_mask_not_the_workspace(fed: Federation) -> None:
    algo, cfg, state = _setup(fed)
    data = fed.client(0)
    model = model_factory(cfg, fed, SEED)()
    _, personal = algo.client_update(
        algo.broadcast(state, 0, 0), None, model, data, generator(SEED, CLIENT, 0, 0)
    )
    base = algo.evaluate_personal(personal, model, data)
    assert set(base) == {"local_accuracy", "local_loss", "local_ece", "local_n"}
    # the workspace holds another mask (the global one, then garbage): the score is the same
    other = dict(algo.global_arrays(state))
    for k in other:
        if k.endswith("_score"):
            other[k] = -other[k]
    load_model_arrays(model, other)
    assert algo.evaluate_personal(personal, model, data) == base
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    assert algo.evaluate_personal(personal, model, data) == base
    # flipping the personal mask changes the score
    flipped = State(
        {k: (-v if k.endswith("_score") else v) for k, v in personal.arrays.items()},
        dict(personal.values),
    )
    assert algo.evaluate_personal(flipped, model, data)["local_loss"] != base["local_loss"]
    with pytest.raises(ValueError, match="no personal model"):
        algo.evaluate_personal(State(), model, data)


def test_p_local_is_reported_in_the_last_round(fed: Federation) -> None:
    algo, cfg, state = _setup(fed, "eval.local=true", "rounds=1")
    data = fed.client(1)
    model = model_factory(cfg, fed, SEED)()
    reply, personal = algo.client_update(
        algo.broadcast(state, 0, 1), None, model, data, generator(SEED, CLIENT, 0, 1)
    )
    assert reply.metrics["local_n"] == len(data.test)
    again = algo.evaluate_personal(personal, model_factory(cfg, fed, SEED)(), data)
    assert reply.metrics["local_accuracy"] == again["local_accuracy"]


# ------------------------------------------------------------------------------ tiny run


def test_tiny_run_learns_above_chance(fed: Federation, tmp_path: Path) -> None:
    cfg = _cfg("rounds=5", "local_steps=20", "eval.local=true", f"output_dir={tmp_path}")
    summary = run_one(cfg, "fedmask", SEED, fed=fed)
    assert summary is not None
    chance = 1.0 / fed.num_classes
    assert summary["final_accuracy"] > chance + 0.2, summary  # G-central
    assert summary["local_accuracy"] > chance + 0.2, summary  # P-local
    assert summary["final_loss"] < math.log(fed.num_classes)
    assert summary["rejected_total"] == 0
    # 1 bit per masked parameter up: 302 bytes per client per round for the 64-32-10 MLP
    # (ceil(2048 / 8) + ceil(32 / 8) + ceil(320 / 8) + ceil(10 / 8) = 256 + 4 + 40 + 2)
    assert summary["bytes_up_total"] == 5 * 3 * 302


def test_fedmask_module_keeps_the_names_it_used_to_define() -> None:
    """The masked layers and the mask codec moved to fedmask_layers.py and fedmask_bits.py;
    ``fedlore.algorithms.fedmask`` still exports them."""
    from fedlore.algorithms import fedmask, fedmask_bits, fedmask_layers

    for name in fedmask.__all__:
        obj = getattr(fedmask, name)
        home = fedmask_bits if hasattr(fedmask_bits, name) else fedmask_layers
        assert name == "FedMask" or obj is getattr(home, name)
