"""HeteroFL with BatchNorm (static batch norm, the paper's Section 3) and on the CIFAR ResNets:
the pooled statistics against torch on the union of the data, FedAvg's parameters with the
pooled statistics at rate 1, no running statistics in training or on the wire, the scaler
before BatchNorm, the ResNet sub-models (sizes, a width-``r·w`` ResNet's shapes, the global
model with the other channels removed), the query's bytes and rounds, bad query replies, a
ResNet run on digits and kill-and-resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fedlore.algorithms.heterofl import HeteroFL
from fedlore.algorithms.heterofl_bn import (
    _batches,
    pooled,
    query_stats,
    static_bn,
)
from fedlore.algorithms.heterofl_plan import WidthPlan, add_scaler, width_plan
from fedlore.config import Config, ConfigError, load_config
from fedlore.data.federation import build_federation
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.models.mlp import mlp
from fedlore.models.resnet import BasicBlock, resnet20
from fedlore.tensors import load_model_arrays, select
from fedlore.types import Reply, State

SEED = 1
F64 = torch.float64
RATES = ("method.heterofl.rates=[1.0, 0.5, 0.25]",)


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(
        None,
        [
            "name=heterofl",
            "num_clients=3",
            "rounds=3",
            "local_steps=3",
            "batch_size=16",
            "lr=0.3",
            "model.kwargs={hidden: [32], norm: batch}",
            "partition.min_size=10",
            "progress=false",
            f"output_dir={out}",
            *extra,
        ],
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _nbytes(arrays: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in arrays.values())


# ------------------------------------------------------------------ the pooled statistics


def test_one_pass_pooled_statistics_equal_torch_on_the_concatenation() -> None:
    """Three clients' count, sum and sum of squares (far from zero mean, unequal sizes) give
    the mean and unbiased variance of the concatenated data, in float64."""
    g = torch.Generator().manual_seed(0)
    parts = [3.0 + 0.5 * torch.randn(n, 5, generator=g, dtype=F64) for n in (7, 40, 2)]
    count = torch.tensor(float(sum(len(p) for p in parts)), dtype=F64)
    total = torch.stack([p.sum(0) for p in parts]).sum(0)
    squares = torch.stack([p.square().sum(0) for p in parts]).sum(0)
    mean, var = pooled(count, total, squares)
    union = torch.cat(parts)
    torch.testing.assert_close(mean, union.mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(var, union.var(0, unbiased=True), rtol=1e-10, atol=0)


def test_a_client_reports_per_channel_sums_of_its_batchnorm_inputs() -> None:
    """A conv's output feeds a BatchNorm2d: ``count`` is the values per channel (N·H·W) and the
    sums run over batch, height and width, whatever the minibatches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
    static_bn(model)
    x = torch.randn(11, 2, 4, 4)
    got = query_stats(model, ("1",), x, batch_size=4)
    with torch.no_grad():
        z = model[0](x).to(F64)
    assert float(got["stats.1.count"]) == 11 * 4 * 4
    torch.testing.assert_close(got["stats.1.sum"], z.sum((0, 2, 3)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["stats.1.sumsq"], z.square().sum((0, 2, 3)), rtol=1e-12, atol=0)
    assert all(v.dtype == F64 for v in got.values())


def test_a_last_minibatch_of_one_joins_the_one_before() -> None:
    assert _batches(33, 16) == [16, 17]
    assert _batches(32, 16) == [16, 16]
    assert _batches(30, 16) == [16, 14]
    assert _batches(1, 16) == [1]


def test_a_static_batchnorm_takes_a_batch_of_one_in_training_and_in_the_query() -> None:
    """A client whose size is 1 mod batch_size ends a pass on one example: torch refuses it
    without running statistics; the MLP's BatchNorm normalizes it by its own (the bias)."""
    model = mlp((8,), 3, hidden=[4], norm="batch")
    static_bn(model)
    norm, linear = model.body[1], model.body[0]
    assert isinstance(norm, nn.BatchNorm1d) and isinstance(linear, nn.Linear)
    with torch.no_grad():
        norm.bias.copy_(torch.arange(4.0))
    x = torch.randn(1, 8)
    for training in (True, False):
        model.train(training)
        assert torch.equal(norm(linear(x)), torch.arange(4.0)[None])
        assert model(x).shape == (1, 3)
    stats = query_stats(model, ("body.1",), torch.randn(1, 8), batch_size=16)
    assert float(stats["stats.body.1.count"]) == 1.0


def test_heterofl_with_batchnorm_trains_every_client_at_batch_size_one(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "rounds=1", "batch_size=1", "algorithms=[heterofl]", *RATES)
    assert run_one(cfg, "heterofl", SEED) is not None
    (row,) = _rows(run_dir(cfg, "heterofl", SEED) / "metrics.jsonl")
    assert row["rejected"] == 0 and row["sbn_clients"] == 1  # the one client of rate 1


# ------------------------------------------------------------------ FedAvg at rate 1


def test_every_rate_one_with_batchnorm_is_fedavgs_parameters_with_pooled_statistics(
    tmp_path: Path,
) -> None:
    """Rate 1 on the BatchNorm MLP: every trained tensor equals FedAvg's bit for bit (batch
    statistics in training either way); the running statistics are the mean and unbiased
    variance of the BatchNorm's input over all clients' training data (not FedAvg's average
    of the clients' running averages); the bytes are FedAvg's without the running statistics,
    plus the query's."""
    cfg = _cfg(tmp_path, "method.heterofl.rates=[1.0]", "algorithms=[fedavg, heterofl]")
    for m in ("fedavg", "heterofl"):
        assert run_one(cfg, m, SEED) is not None
    states = {
        m: Checkpointer.load(run_dir(cfg, m, SEED) / "checkpoint.pt")[1] for m in cfg.algorithms
    }
    ours, theirs = (select(states[m].arrays, "model.") for m in ("heterofl", "fedavg"))
    stats = {"body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"}
    for k in set(ours) - stats:
        assert torch.equal(ours[k], theirs[k]), k
    fed = build_federation(cfg, SEED)
    with torch.no_grad():
        z = torch.cat(
            [
                nn.functional.linear(
                    fed.client(c).train.x.flatten(1), ours["body.0.weight"], ours["body.0.bias"]
                )
                for c in range(3)
            ]
        ).to(F64)
    torch.testing.assert_close(
        ours["body.1.running_mean"].double(), z.mean(0), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(ours["body.1.running_var"].double(), z.var(0), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours["body.1.running_var"], theirs["body.1.running_var"])
    rows = {m: _rows(run_dir(cfg, m, SEED) / "metrics.jsonl") for m in cfg.algorithms}
    buffers = 3 * (2 * 32 * 4 + 8)  # three clients' running mean, var (fp32), count (int64)
    query_up = 3 * (8 + 2 * 32 * 8)  # three clients' count, sums and sums of squares (fp64)
    query_down = 3 * _nbytes({k: v for k, v in ours.items() if k not in stats})
    for ra, rb in zip(rows["fedavg"], rows["heterofl"], strict=True):
        assert ra["train_loss"] == rb["train_loss"]
        assert (rb["query_bytes_up"], rb["query_bytes_down"]) == (query_up, query_down)
        assert rb["bytes_up"] == ra["bytes_up"] - buffers + query_up
        assert rb["bytes_down"] == ra["bytes_down"] - buffers + query_down
        assert rb["sbn_clients"] == 3 and "query_bytes_up" not in ra


def test_the_query_runs_on_the_rounds_that_evaluate_and_the_last(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "rounds=3", "eval.every=2", "algorithms=[heterofl]", *RATES)
    assert run_one(cfg, "heterofl", SEED) is not None
    rows = _rows(run_dir(cfg, "heterofl", SEED) / "metrics.jsonl")
    assert ["sbn_clients" in r for r in rows] == [False, True, True]
    assert ["accuracy" in r for r in rows] == [False, True, True]
    assert rows[0]["bytes_up"] < rows[1]["bytes_up"]


def test_a_model_without_batchnorm_has_no_query_and_its_plan_keeps_its_json() -> None:
    algo = HeteroFL.of(rates=(1.0, 0.5))
    state = algo.init_server(mlp((3,), 2, hidden=[4]), torch.Generator().manual_seed(0))
    assert algo.query(state, 0, 0) is None
    assert set(json.loads(str(state.values["heterofl.plan"]))) == {"widths", "dims", "scaled"}
    plan = width_plan(mlp((3,), 2, hidden=[4], norm="batch"))
    assert WidthPlan.from_json(plan.to_json()) == plan and plan.norms == ("body.1",)


# ------------------------------------------------------------------ training and the wire


def test_no_running_statistics_are_sent_trained_or_uploaded_and_bn_affines_are_sliced() -> None:
    torch.manual_seed(0)
    model = mlp((1, 8, 8), 10, hidden=[8], norm="batch")
    algo = HeteroFL.of(rates=(0.5,), local_steps=2, batch_size=8, lr=0.1)
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    msg = algo.broadcast(state, 0, 0)
    assert set(msg.arrays) == {
        f"model.body.{i}.{p}" for i in (0, 1) for p in ("weight", "bias")
    } | {
        "model.head.weight",
        "model.head.bias",
    }
    w = select(state.arrays, "model.")
    assert torch.equal(msg.arrays["model.body.1.weight"], w["body.1.weight"][:4])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = build_federation(_cfg(Path("unused")), SEED).client(0)
    reply, _ = algo.client_update(msg, None, model, data, torch.Generator().manual_seed(1))
    assert not any("running" in k or "num_batches" in k for k in reply.arrays)
    assert reply.arrays["update.body.1.weight"].shape == (4,)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    new, _ = algo.aggregate(state, [(0, reply)], 0)
    got = select(new.arrays, "model.")
    torch.testing.assert_close(
        got["body.1.weight"][:4], w["body.1.weight"][:4] + reply.arrays["update.body.1.weight"]
    )
    assert torch.equal(got["body.1.weight"][4:], w["body.1.weight"][4:])
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(got[f"body.1.{k}"], w[f"body.1.{k}"])


def test_the_scaler_divides_the_conv_output_before_batchnorm() -> None:
    """In a ResNet sub-model the scaled modules are the convolutions: a BatchNorm's input in
    training is its conv's output divided by r (the paper: scaler, then BatchNorm); in
    evaluation it is the conv's output."""
    bn_mlp = width_plan(mlp((3,), 2, hidden=[4, 4], norm="batch"))
    assert (bn_mlp.scaled, bn_mlp.norms) == (("body.0", "body.3"), ("body.1", "body.4"))
    plan = width_plan(resnet20((1, 8, 8), 10))
    assert not set(plan.scaled) & set(plan.norms)
    assert len(plan.scaled) == 19 and plan.scaled[:3] == (
        "stem",
        "blocks.0.conv1",
        "blocks.0.conv2",
    )
    torch.manual_seed(0)
    sub = resnet20((1, 8, 8), 10, width=8)
    static_bn(sub)
    add_scaler(sub, plan, 0.5)
    seen: dict[str, torch.Tensor] = {}
    conv, norm = sub.get_submodule("blocks.0.conv1"), sub.get_submodule("blocks.0.norm1")
    assert isinstance(conv, nn.Conv2d)
    conv.register_forward_pre_hook(lambda _m, i: seen.update(x=i[0]))
    norm.register_forward_pre_hook(lambda _m, i: seen.update(bn=i[0]))
    x = torch.randn(4, 1, 8, 8)
    for training, divisor in ((True, 0.5), (False, 1.0)):
        sub.train(training)
        with torch.no_grad():
            sub(x)
            want = nn.functional.conv2d(seen["x"], conv.weight, padding=1) / divisor
        torch.testing.assert_close(seen["bn"], want)


# ------------------------------------------------------------------ ResNet sub-models


def _resnet20_params(c: int, w: int, k: int) -> int:
    """ResNet-20's parameters (3 stages of 3 blocks, BatchNorm, no conv bias) by hand."""
    total = 9 * c * w + 2 * w
    prev = w
    for ch in (w, 2 * w, 4 * w):
        for _ in range(3):
            total += 9 * prev * ch + 9 * ch * ch + 4 * ch
            prev = ch
    return total + k * prev + k


@pytest.mark.parametrize(("rate", "width"), [(1.0, 16), (0.5, 8), (0.25, 4)])
def test_resnet_sub_models_are_resnets_of_width_r_w(rate: float, width: int) -> None:
    algo = HeteroFL.of(rates=(rate,))
    state = algo.init_server(resnet20((1, 8, 8), 10), torch.Generator().manual_seed(0))
    sent = select(algo.broadcast(state, 0, 0).arrays, "model.")
    narrow = resnet20((1, 8, 8), 10, width=width).state_dict()
    assert {k: tuple(v.shape) for k, v in sent.items()} == {
        k: tuple(v.shape)
        for k, v in narrow.items()
        if "running" not in k and "num_batches" not in k
    }
    assert sum(v.numel() for v in sent.values()) == _resnet20_params(1, width, 10)
    assert {1.0: 269_434, 0.5: 67_906, 0.25: 17_254}[rate] == _resnet20_params(1, width, 10)


def _zero_outside(model: nn.Module, where: dict[str, torch.Tensor | None]) -> None:
    """Zero every entry of ``model`` a sub-model does not hold (BatchNorm biases included)."""
    with torch.no_grad():
        for k, v in model.state_dict().items():
            pos = where.get(k)
            if pos is None:
                continue
            keep = torch.zeros(v.numel(), dtype=torch.bool)
            keep[pos.reshape(-1)] = True
            v.view(-1)[~keep] = 0


@pytest.mark.parametrize(
    ("rate", "extraction", "rnd"),
    [(0.5, "static", 0), (0.25, "static", 0), (0.5, "rolling", 13), (0.25, "rolling", 5)],
)
def test_a_resnet_sub_model_is_the_global_model_with_the_other_channels_removed(
    rate: float, extraction: str, rnd: int
) -> None:
    """The client's sub-model (its shortcuts routed as the global model's) computes the global
    model's logits when every entry it does not hold is zero and every channel it does not hold
    is removed (zeroed after each block: under rolling windows option A's shortcut would carry a
    held channel into a removed one and back): option A's channel offsets are the global ones
    (a sub-model padding at its own width would feed other channels)."""
    torch.manual_seed(0)
    full = resnet20((1, 8, 8), 10)
    with torch.no_grad():
        for m in full.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    algo = HeteroFL.of(rates=(rate,), extraction=extraction, roll_by="unit")
    state = algo.init_server(full, torch.Generator().manual_seed(0))
    msg = algo.broadcast(state, rnd, 0)
    start = select(msg.arrays, "model.")
    plan = width_plan(full)
    sub = algo.client_model(full, plan, start, rate, rnd)  # what client_update trains
    load_model_arrays(sub, start)
    masked = resnet20((1, 8, 8), 10)
    masked.load_state_dict(full.state_dict())
    _zero_outside(masked, algo.positions(state, rnd, rate))
    static_bn(masked)
    units = algo.units(plan, rnd, rate)
    for b in range(len(masked.blocks)):  # removed channels: no shortcut carries them on
        block = masked.get_submodule(f"blocks.{b}")
        assert isinstance(block, BasicBlock)
        keep = torch.zeros(block.conv2.out_channels)
        keep[units[plan.dims[f"blocks.{b}.conv2.weight"][0][0]]] = 1.0
        block.register_forward_hook(lambda _m, _i, out, keep=keep: out * keep[:, None, None])
    x = torch.randn(6, 1, 8, 8)
    sub.eval()
    masked.eval()
    with torch.no_grad():
        torch.testing.assert_close(sub(x), masked(x), rtol=1e-5, atol=1e-5)
    for name, *_ in plan.routes:  # each stage change's shortcut is routed
        block = sub.get_submodule(name)
        assert isinstance(block, BasicBlock) and block.route is not None


def test_resnet_with_group_norm_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^heterofl: resnet with norm=group is not supported"):
        width_plan(resnet20((1, 8, 8), 10, norm="group"))


def test_a_resnet_runs_on_digits(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        "rounds=2",
        "local_steps=2",
        "model.name=resnet20",
        "model.kwargs={}",
        "method.heterofl.rates=[1.0, 0.5, 0.25]",
        "algorithms=[heterofl]",
    )
    summary = run_one(cfg, "heterofl", SEED)
    assert summary is not None and math.isfinite(summary["final_accuracy"])
    rows = _rows(run_dir(cfg, "heterofl", SEED) / "metrics.jsonl")
    per_rate = {1.0: 269_434, 0.5: 67_906, 0.25: 17_254}
    for r in rows:
        assert r["sbn_clients"] == 1 and r["rejected"] == 0  # the client of rate 1 only
        assert sorted(r["width_rate"].values()) == [0.25, 0.5, 1.0]
        train_up = 4 * sum(per_rate[x] for x in r["width_rate"].values())
        assert r["bytes_up"] == train_up + r["query_bytes_up"]
        # 19 BatchNorms: a count and 2 x channels sums, fp64, from the full-width client
        assert r["query_bytes_up"] == 19 * 8 + 16 * (16 + 6 * 16 + 6 * 32 + 6 * 64)
        assert r["query_bytes_down"] == 4 * per_rate[1.0]
    state = Checkpointer.load(run_dir(cfg, "heterofl", SEED) / "checkpoint.pt")[1]
    assert float(state.arrays["model.stem_norm.running_var"].min()) > 0


# ------------------------------------------------------------------ bad query replies, resume


def test_unusable_query_replies_are_left_out_of_the_pooled_statistics() -> None:
    model = mlp((3,), 2, hidden=[4], norm="batch")
    algo = HeteroFL.of(rates=(1.0,))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    good = {
        "stats.0.body.1.count": torch.tensor(4.0, dtype=F64),
        "stats.0.body.1.sum": torch.tensor([4.0, 8.0, 0.0, 4.0], dtype=F64),
        "stats.0.body.1.sumsq": torch.tensor([6.0, 18.0, 4.0, 4.0], dtype=F64),
    }
    bad = [
        {**good, "stats.0.body.1.sum": torch.zeros(3, dtype=F64)},
        {**good, "stats.0.body.1.sum": torch.zeros(4)},
        {**good, "stats.0.body.1.count": torch.tensor(0.0, dtype=F64)},
        {**good, "stats.0.body.1.sumsq": torch.full((4,), math.nan, dtype=F64)},
        {k: v for k, v in good.items() if k != "stats.0.body.1.sumsq"},
        {**good, "stats.1.body.1.count": torch.tensor(4.0, dtype=F64)},  # a level not sent
    ]
    replies: list[tuple[int, Reply | None]] = [(0, Reply(good, {})), (1, None)]
    replies += [(2 + i, Reply(b, {})) for i, b in enumerate(bad)]
    new, metrics = algo.absorb_query(state, replies, 0)
    assert metrics == {"sbn_clients": 1}
    torch.testing.assert_close(
        new.arrays["model.body.1.running_mean"], torch.tensor([1.0, 2.0, 0.0, 1.0])
    )
    torch.testing.assert_close(
        new.arrays["model.body.1.running_var"], torch.tensor([2 / 3, 2 / 3, 4 / 3, 0.0])
    )
    none, metrics = algo.absorb_query(new, [(1, None)], 1)  # set before: they stay
    assert metrics == {"sbn_clients": 0}
    assert torch.equal(
        none.arrays["model.body.1.running_var"], new.arrays["model.body.1.running_var"]
    )
    assert isinstance(none, State)
    with pytest.raises(ConfigError, match=r"round 0: no client of the round could run .* 1\.0"):
        algo.absorb_query(state, [(1, None)], 0)  # never set: refused


def _no_timing(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.endswith("_s") and "time" not in k}


@pytest.mark.parametrize("model", ["mlp", "resnet20"])
def test_kill_and_resume_is_bit_identical(tmp_path: Path, model: str) -> None:
    extra = ["method.heterofl.rates=[1.0, 0.5, 0.25]", "method.heterofl.extraction=rolling"]
    if model == "resnet20":
        extra += ["model.name=resnet20", "model.kwargs={}", "local_steps=1"]
    want_cfg = _cfg(tmp_path / "want", "algorithms=[heterofl]", *extra)
    cfg = _cfg(tmp_path / "got", "algorithms=[heterofl]", *extra)
    assert run_one(want_cfg, "heterofl", SEED) is not None
    assert run_one(cfg, "heterofl", SEED, stop_after=1) is None
    assert run_one(cfg, "heterofl", SEED, resume=True) is not None
    got, want = (run_dir(c, "heterofl", SEED) for c in (cfg, want_cfg))
    a, b = _rows(got / "metrics.jsonl"), _rows(want / "metrics.jsonl")
    assert [_no_timing(r) for r in a] == [_no_timing(r) for r in b]
    sa, sb = (Checkpointer.load(p / "checkpoint.pt")[1] for p in (got, want))
    assert sa.values == sb.values and sa.arrays.keys() == sb.arrays.keys()
    for k in sa.arrays:
        assert torch.equal(sa.arrays[k], sb.arrays[k]), k
