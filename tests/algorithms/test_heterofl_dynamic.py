"""HeteroFL's dynamic assignment (a level drawn per round and client) and label-split masking
(``mask_labels``): the draws' shares, determinism and resume; the masked loss against a hand
computation; the output rows averaged over their holders only, in float64 by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.algorithms.heterofl import HeteroFL
from fedlore.algorithms.heterofl_labels import mask_logits
from fedlore.config import Config, load_config
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.loop import validate_reply
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.models.mlp import mlp
from fedlore.tensors import select
from fedlore.types import Reply, State

SEED = 1


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(
        None,
        [
            "name=heterofl",
            "num_clients=4",
            "rounds=4",
            "local_steps=2",
            "batch_size=16",
            "lr=0.3",
            "model.kwargs={hidden: [16], norm: batch}",
            "partition.min_size=10",
            "algorithms=[heterofl]",
            "method.heterofl.rates=[1.0, 0.5]",
            "method.heterofl.shares=[3, 1]",
            "method.heterofl.assignment=dynamic",
            "progress=false",
            f"output_dir={out}",
            *extra,
        ],
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ------------------------------------------------------------------ dynamic assignment


def test_dynamic_levels_are_drawn_every_round_in_the_shares_proportions() -> None:
    algo = HeteroFL.of(rates=(1.0, 0.25), shares=(3, 1), assignment="dynamic")
    drawn = [[algo.rate_of(11, c, t) for c in range(10)] for t in range(400)]
    flat = [r for row in drawn for r in row]
    assert abs(flat.count(1.0) / len(flat) - 0.75) < 0.03  # 4000 draws: sd 0.007
    for c in range(10):  # every client's level moves over the rounds, in the same shares
        assert abs([row[c] for row in drawn].count(1.0) / 400 - 0.75) < 0.1
    assert sum(len(set(row)) > 1 for row in drawn) > 300  # a round's clients differ
    even = HeteroFL.of(rates=(1.0, 0.5, 0.25), assignment="dynamic")
    draws = [even.rate_of(3, c, t) for t in range(300) for c in range(10)]
    assert all(abs(draws.count(r) / 3000 - 1 / 3) < 0.04 for r in (1.0, 0.5, 0.25))
    fixed = HeteroFL.of(rates=(1.0, 0.25), shares=(3, 1))
    assert all(
        fixed.rate_of(11, c, t) == fixed.rate_of(11, c, 0) for t in range(9) for c in range(8)
    )


def test_dynamic_draws_depend_on_seed_round_and_client_only() -> None:
    algo = HeteroFL.of(rates=(1.0, 0.5, 0.25), assignment="dynamic")
    pairs = [(t, c) for t in range(30) for c in range(10)]
    first = [algo.rate_of(7, c, t) for t, c in pairs]
    assert [algo.rate_of(7, c, t) for t, c in reversed(pairs)] == first[::-1]  # no hidden state
    assert [
        HeteroFL.of(rates=(1.0, 0.5, 0.25), assignment="dynamic").rate_of(7, c, t) for t, c in pairs
    ] == first
    assert [algo.rate_of(8, c, t) for t, c in pairs] != first
    state = algo.init_server(mlp((3,), 2, hidden=[4]), torch.Generator().manual_seed(0))
    salt = int(state.values["heterofl.salt"])
    assert all(algo.client_rate(state, c, t) == algo.rate_of(salt, c, t) for t, c in pairs)


def test_the_round_s_level_is_the_one_broadcast_expected_and_queried() -> None:
    """A client whose level changes between two rounds is sent, expected to upload and queried
    with the level of each round."""
    algo = HeteroFL.of(rates=(1.0, 0.5), assignment="dynamic")
    model = mlp((3,), 2, hidden=[4], norm="batch")
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    t_full, t_half = (
        next(t for t in range(50) if algo.client_rate(state, 0, t) == r) for r in (1.0, 0.5)
    )
    for t, rate, hidden in ((t_full, 1.0, 4), (t_half, 0.5, 2)):
        msg = algo.broadcast(state, t, 0)
        assert msg.config["rate"] == rate
        assert msg.arrays["model.body.0.weight"].shape == (hidden, 3)
        assert algo.expected_reply(state, t, 0)["update.body.0.weight"][0] == (hidden, 3)
        query = algo.query(state, t, 0)  # only a client of rate 1 can run the full model
        assert (query is not None) == (rate == 1.0)
    # the server pools a query reply by the client's level of the round it was queried in
    c = next(c for c in range(50) if algo.client_rate(state, c, 0) == 0.5)
    t = next(t for t in range(1, 50) if algo.client_rate(state, c, t) == 1.0)
    query = algo.query(state, t, c)
    assert query is not None
    data = _data(torch.randn(8, 3), torch.tensor([0, 1] * 4))
    reply, _ = algo.client_update(query, None, model, data, torch.Generator().manual_seed(0))
    new, metrics = algo.absorb_query(state, [(c, reply)], t)
    assert metrics["sbn_clients"] == 1
    assert not torch.equal(new.arrays["model.body.1.running_mean"], torch.zeros(4))


def test_eval_levels_count_each_levels_clients_of_the_last_aggregated_round() -> None:
    algo = HeteroFL.of(rates=(1.0, 0.5), assignment="dynamic", eval_levels=True)
    model = mlp((3,), 2, hidden=[4])
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    seen = set()
    for t in range(6):
        at = State(state.arrays, {**state.values, "heterofl.round": t})
        got = {rate: info["clients"] for rate, _, info in algo.level_models(at, model, 20)}
        want = {r: float(sum(algo.client_rate(state, c, t) == r for c in range(20))) for r in got}
        assert got == want
        seen.add(got[1.0])
    assert len(seen) > 1


def _no_timing(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.endswith("_s") and "time" not in k}


def test_a_dynamic_run_resumed_after_a_kill_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    extra = ["method.heterofl.eval_levels=true", "method.heterofl.mask_labels=true"]
    want_cfg, cfg = _cfg(tmp_path / "want", *extra), _cfg(tmp_path / "got", *extra)
    assert run_one(want_cfg, "heterofl", SEED) is not None
    assert run_one(cfg, "heterofl", SEED, stop_after=2) is None
    assert run_one(cfg, "heterofl", SEED, resume=True) is not None
    got, want = (run_dir(c, "heterofl", SEED) for c in (cfg, want_cfg))
    a, b = _rows(got / "metrics.jsonl"), _rows(want / "metrics.jsonl")
    assert [_no_timing(r) for r in a] == [_no_timing(r) for r in b]
    levels = [tuple(sorted(r["width_rate"].items())) for r in b if "width_rate" in r]
    assert len(set(levels)) > 1  # the clients' levels change from round to round
    sa, sb = (Checkpointer.load(p / "checkpoint.pt")[1] for p in (got, want))
    assert sa.values == sb.values and sa.arrays.keys() == sb.arrays.keys()
    for k in sa.arrays:
        assert torch.equal(sa.arrays[k], sb.arrays[k]), k


def test_a_bad_assignment_is_refused() -> None:
    with pytest.raises(ValueError, match="assignment"):
        HeteroFL.of(assignment="sometimes")


# ------------------------------------------------------------------ label-split masking


def _data(x: torch.Tensor, y: torch.Tensor) -> ClientData:
    return ClientData(0, TensorSplit(x, y), TensorSplit(x[:1], y[:1]))


@pytest.mark.parametrize(("masked", "fill"), [(True, "exclude"), (True, "zero"), (False, "")])
def test_the_masked_loss_step_equals_a_hand_computation(masked: bool, fill: str) -> None:
    """One full-batch SGD step of a client holding classes 0 and 2 of 4: the update is
    ``-lr ∇`` of the cross-entropy over its own classes' logits (all four unmasked); with
    ``mask_fill: zero`` (the authors' code) over all four, the absent two fixed at 0."""
    torch.manual_seed(0)
    model = mlp((3,), 4, hidden=[5])
    x, y = torch.randn(6, 3), torch.tensor([0, 2, 2, 0, 2, 0])
    kw = {"mask_fill": fill} if fill else {}
    algo = HeteroFL.of(rates=(1.0,), mask_labels=masked, local_steps=1, batch_size=6, lr=0.5, **kw)
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    reply, _ = algo.client_update(
        algo.broadcast(state, 0, 0), None, model, _data(x, y), torch.Generator().manual_seed(1)
    )
    w = {k: v.double().requires_grad_() for k, v in select(state.arrays, "model.").items()}
    h = torch.relu(x.double() @ w["body.0.weight"].T + w["body.0.bias"])
    logits = h @ w["head.weight"].T + w["head.bias"]
    keep = [0, 2] if masked and fill == "exclude" else [0, 1, 2, 3]
    if fill == "zero":  # the absent classes' logits are a constant 0, not a function of w
        logits = logits * torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=logits.dtype)
    target = torch.tensor([keep.index(int(c)) for c in y])
    loss = -torch.log_softmax(logits[:, keep], 1)[torch.arange(6), target].mean()
    grads = dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))
    for k, g in grads.items():
        got = reply.arrays["update." + k].double()
        assert torch.allclose(got, -0.5 * g, rtol=0, atol=1e-6), k
    if masked:
        assert torch.equal(reply.arrays["labels"], torch.tensor([True, False, True, False]))
        assert torch.equal(reply.arrays["update.head.bias"][[1, 3]], torch.zeros(2))
    else:
        assert "labels" not in reply.arrays
    model.train()
    assert torch.isfinite(model(x)).all()  # the hook is gone from the caller's model


def test_the_mask_applies_in_training_only() -> None:
    model = mlp((3,), 3, hidden=[4])
    handle = mask_logits(model, torch.tensor([False, True, True]))
    x = torch.randn(2, 3)
    model.train()
    out = model(x)
    assert torch.isneginf(out[:, 0]).all() and torch.isfinite(out[:, 1:]).all()
    model.eval()
    assert torch.isfinite(model(x)).all()
    handle.remove()


def test_output_rows_average_over_the_clients_holding_their_class_in_fp64() -> None:
    """A rate-1 client (n = 1, classes {0, 1}) and a rate-1/2 client (n = 3, classes {1, 2}) on
    the float64 3-4-4 MLP: head row 0 moves by A's delta, row 1 by the weighted mean of both
    (B only over its 2 hidden columns), row 2 by B's over its columns only, row 3 (nobody's
    class) keeps its bits; the hidden layer is averaged as without masking."""
    torch.manual_seed(0)
    algo = HeteroFL.of(rates=(1.0, 0.5), mask_labels=True)
    state = algo.init_server(mlp((3,), 4, hidden=[4]).double(), torch.Generator().manual_seed(0))
    a = next(c for c in range(50) if algo.client_rate(state, c, 0) == 1.0)
    b = next(c for c in range(50) if algo.client_rate(state, c, 0) == 0.5)
    w = select(state.arrays, "model.")
    g = torch.Generator().manual_seed(1)
    d_a = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in w.items()}
    shapes = {
        "body.0.weight": (2, 3),
        "body.0.bias": (2,),
        "head.weight": (4, 2),
        "head.bias": (4,),
    }
    d_b = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    lab_a = torch.tensor([True, True, False, False])
    lab_b = torch.tensor([False, True, True, False])
    r_a = Reply(
        {**{"update." + k: v for k, v in d_a.items()}, "labels": lab_a}, {"num_examples": 1}
    )
    r_b = Reply(
        {**{"update." + k: v for k, v in d_b.items()}, "labels": lab_b}, {"num_examples": 3}
    )
    for c, r in ((a, r_a), (b, r_b)):
        assert validate_reply(r, algo.expected_reply(state, 0, c)) is None
    no_labels = Reply({k: v for k, v in r_a.arrays.items() if k != "labels"}, r_a.metrics)
    assert validate_reply(no_labels, algo.expected_reply(state, 0, a)) is not None
    new, _ = algo.aggregate(state, [(a, r_a), (b, r_b)], 0)
    got = select(new.arrays, "model.")
    want = {k: v.clone() for k, v in w.items()}
    want["body.0.weight"][:2] += (d_a["body.0.weight"][:2] + 3 * d_b["body.0.weight"]) / 4
    want["body.0.weight"][2:] += d_a["body.0.weight"][2:]
    want["body.0.bias"][:2] += (d_a["body.0.bias"][:2] + 3 * d_b["body.0.bias"]) / 4
    want["body.0.bias"][2:] += d_a["body.0.bias"][2:]
    hw, hb = d_a["head.weight"], d_a["head.bias"]
    want["head.weight"][0] += hw[0]
    want["head.weight"][1, :2] += (hw[1, :2] + 3 * d_b["head.weight"][1]) / 4
    want["head.weight"][1, 2:] += hw[1, 2:]
    want["head.weight"][2, :2] += d_b["head.weight"][2]
    want["head.bias"][0] += hb[0]
    want["head.bias"][1] += (hb[1] + 3 * d_b["head.bias"][1]) / 4
    want["head.bias"][2] += d_b["head.bias"][2]
    for k in w:
        assert got[k].dtype == torch.float64
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-12), k
    assert torch.equal(got["head.weight"][3], w["head.weight"][3])
    assert torch.equal(got["head.weight"][2, 2:], w["head.weight"][2, 2:])
    assert torch.equal(got["head.bias"][3], w["head.bias"][3])


def test_masking_runs_on_label_skewed_digits_and_uploads_the_label_sets(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        "method.heterofl.mask_labels=true",
        "partition.alpha=0.1",
        "model.kwargs={hidden: [16]}",
        "rounds=2",
    )
    assert run_one(cfg, "heterofl", SEED) is not None
    rows = _rows(run_dir(cfg, "heterofl", SEED) / "metrics.jsonl")
    assert all(r["accepted"] == r["clients"] == 4 for r in rows)
    assert all(r["bytes_up"] > 0 for r in rows)
