"""HeteroFL (and FedRolex's rolling extraction): the overlap average against a hand computation,
FedAvg bit for bit at rate 1, the sub-models' sizes and bytes, the rolling window's coverage,
the scaler, the rate draws, reply validation and the refused configs. Kill-and-resume is in
``tests/engine/test_resume.py`` (``heterofl`` under rolling extraction)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fedlore.algorithms.heterofl import HeteroFL
from fedlore.algorithms.heterofl_plan import (
    add_scaler,
    sub_model,
    sub_width,
    unit_index,
    width_plan,
)
from fedlore.config import Config, ConfigError, load_config
from fedlore.data.federation import build_federation
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.loop import validate_reply
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_experiment, run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.models.cnn import cnn
from fedlore.models.mlp import mlp
from fedlore.seeding import CLIENT, generator
from fedlore.tensors import model_arrays, nbytes, select
from fedlore.types import Reply, State

SEED = 1


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
            "model.kwargs={hidden: [32]}",
            "partition.min_size=10",
            "progress=false",
            f"output_dir={out}",
            *extra,
        ],
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _tiny(hidden: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return mlp((3,), 2, hidden=[hidden])


def _client_with(algo: HeteroFL, state: State, rate: float) -> int:
    return next(c for c in range(200) if algo.client_rate(state, c, 0) == rate)


def _reply(delta: dict[str, torch.Tensor], n: int) -> Reply:
    return Reply({"update." + k: v for k, v in delta.items()}, {"num_examples": n})


# ------------------------------------------------------------------ the server's average


def test_overlapping_slices_average_as_by_hand() -> None:
    """A rate-1 client (n = 1) and a rate-1/2 client (n = 3) on the 3-4-2 MLP: the entries both
    hold get ``(1 Δ_A + 3 Δ_B) / 4``, those only A holds get ``Δ_A``."""
    algo = HeteroFL.of(rates=(1.0, 0.5))
    state = algo.init_server(_tiny(), torch.Generator().manual_seed(0))
    a, b = _client_with(algo, state, 1.0), _client_with(algo, state, 0.5)
    w = select(state.arrays, "model.")
    g = torch.Generator().manual_seed(1)
    d_a = {k: torch.randn(v.shape, generator=g) for k, v in w.items()}
    d_b = {
        "body.0.weight": torch.randn(2, 3, generator=g),
        "body.0.bias": torch.randn(2, generator=g),
        "head.weight": torch.randn(2, 2, generator=g),
        "head.bias": torch.randn(2, generator=g),
    }
    sent = select(algo.broadcast(state, 0, b).arrays, "model.")
    assert torch.equal(sent["body.0.weight"], w["body.0.weight"][:2])
    assert torch.equal(sent["head.weight"], w["head.weight"][:, :2])
    new, metrics = algo.aggregate(state, [(a, _reply(d_a, 1)), (b, _reply(d_b, 3)), (7, None)], 0)
    got = select(new.arrays, "model.")
    want = {k: v.clone().double() for k, v in w.items()}
    both = (d_a["body.0.weight"][:2].double() + 3 * d_b["body.0.weight"].double()) / 4
    want["body.0.weight"][:2] += both
    want["body.0.weight"][2:] += d_a["body.0.weight"][2:].double()
    want["body.0.bias"][:2] += (d_a["body.0.bias"][:2].double() + 3 * d_b["body.0.bias"]) / 4
    want["body.0.bias"][2:] += d_a["body.0.bias"][2:].double()
    want["head.weight"][:, :2] += (d_a["head.weight"][:, :2].double() + 3 * d_b["head.weight"]) / 4
    want["head.weight"][:, 2:] += d_a["head.weight"][:, 2:].double()
    want["head.bias"] += (d_a["head.bias"].double() + 3 * d_b["head.bias"].double()) / 4
    for k in w:
        assert torch.allclose(got[k].double(), want[k], rtol=0, atol=1e-6), k
    assert metrics == {"aggregated": 2, "covered": 1.0}


def test_entries_no_client_holds_keep_their_value_and_the_window_rolls() -> None:
    """One rate-1/2 client under rolling extraction in round 3: its window of the 4 hidden units
    is (3, 0); those rows (and head columns) move by its delta, the others keep their bits."""
    algo = HeteroFL.of(rates=(0.5,), extraction="rolling")
    state = algo.init_server(_tiny(), torch.Generator().manual_seed(0))
    w = select(state.arrays, "model.")
    sent = select(algo.broadcast(state, 3, 5).arrays, "model.")
    assert torch.equal(sent["body.0.weight"], w["body.0.weight"][[3, 0]])
    assert torch.equal(sent["head.weight"], w["head.weight"][:, [3, 0]])
    d = {
        k: torch.randn(v.shape, generator=torch.Generator().manual_seed(2)) for k, v in sent.items()
    }
    new, metrics = algo.aggregate(state, [(5, _reply(d, 4))], 3)
    got = select(new.arrays, "model.")
    for row, unit in ((0, 3), (1, 0)):
        assert torch.allclose(
            got["body.0.weight"][unit], w["body.0.weight"][unit] + d["body.0.weight"][row]
        )
        assert torch.allclose(
            got["body.0.bias"][unit], w["body.0.bias"][unit] + d["body.0.bias"][row]
        )
        assert torch.allclose(
            got["head.weight"][:, unit], w["head.weight"][:, unit] + d["head.weight"][:, row]
        )
    for unit in (1, 2):
        assert torch.equal(got["body.0.weight"][unit], w["body.0.weight"][unit])
        assert torch.equal(got["body.0.bias"][unit], w["body.0.bias"][unit])
        assert torch.equal(got["head.weight"][:, unit], w["head.weight"][:, unit])
    assert torch.allclose(got["head.bias"], w["head.bias"] + d["head.bias"])
    held = 2 * 3 + 2 + 2 * 2 + 2
    assert metrics == {"aggregated": 1, "covered": held / (12 + 4 + 8 + 2)}


def test_no_accepted_reply_keeps_the_state() -> None:
    algo = HeteroFL.of(rates=(0.5,))
    state = algo.init_server(_tiny(), torch.Generator().manual_seed(0))
    new, metrics = algo.aggregate(state, [(0, None)], 0)
    assert metrics == {"aggregated": 0} and new.values == state.values
    assert all(torch.equal(new.arrays[k], v) for k, v in state.arrays.items())


# ------------------------------------------------------------------ FedAvg at rate 1


@pytest.mark.parametrize("extraction", ["static", "rolling"])
def test_every_rate_one_is_fedavg_bit_for_bit(tmp_path: Path, extraction: str) -> None:
    cfg = _cfg(
        tmp_path,
        "method.heterofl.rates=[1.0]",
        f"method.heterofl.extraction={extraction}",
        "method.heterofl.roll_by=unit",
    )
    runs = {m: run_one(cfg, m, SEED) for m in ("fedavg", "heterofl")}
    assert runs["fedavg"] is not None and runs["heterofl"] is not None
    for key in ("final_loss", "final_accuracy", "bytes_up_total", "bytes_down_total"):
        assert runs["heterofl"][key] == runs["fedavg"][key], key
    rows = {m: _rows(run_dir(cfg, m, SEED) / "metrics.jsonl") for m in runs}
    for ra, rb in zip(rows["fedavg"], rows["heterofl"], strict=True):
        for key in ("loss", "accuracy", "train_loss", "bytes_up", "bytes_down"):
            assert ra[key] == rb[key], (ra["round"], key)
    states = {m: Checkpointer.load(run_dir(cfg, m, SEED) / "checkpoint.pt")[1] for m in runs}
    want, got = (
        select(states["fedavg"].arrays, "model."),
        select(states["heterofl"].arrays, "model."),
    )
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


# ------------------------------------------------------------------ sizes and bytes


@pytest.mark.parametrize(("rate", "count"), [(1.0, 2410), (0.5, 1210), (0.25, 610)])
def test_sub_model_size_bytes_and_optimizer_state(rate: float, count: int) -> None:
    """The 64-32-10 MLP on digits: 64·m + m + 10·m + 10 parameters for m = 32 r hidden units;
    down and up are 4 bytes each, AdamW's two moments 8."""
    cfg = load_config(None, ["num_clients=3", "model.kwargs={hidden: [32]}", "lr=0.03"])
    algo = make_algorithm("heterofl", cfg)
    assert isinstance(algo, HeteroFL)
    algo = HeteroFL.of(rates=(rate,), local_optimizer="adamw", local_steps=2, batch_size=8)
    model = mlp((1, 8, 8), 10, hidden=[32])
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    msg = algo.broadcast(state, 0, 0)
    assert sum(v.numel() for v in msg.arrays.values()) == count
    assert nbytes(msg.arrays) == 4 * count
    data = build_federation(_cfg(Path("unused")), SEED).client(0)
    reply, _ = algo.client_update(msg, None, model, data, generator(SEED, CLIENT, 0, 0))
    assert nbytes(reply.arrays) == 4 * count
    assert reply.metrics["optimizer_state_bytes"] == 8 * count
    assert reply.metrics["width_rate"] == rate
    assert validate_reply(reply, algo.expected_reply(state, 0, 0)) is None


def test_a_run_counts_each_clients_sub_model_bytes(tmp_path: Path) -> None:
    """bytes_up and bytes_down of every round are the sum over the sampled clients of their
    sub-model's bytes (rates from the per-client ``width_rate``)."""
    size = {1.0: 4 * 2410, 0.5: 4 * 1210, 0.25: 4 * 610}
    cfg = _cfg(tmp_path, "num_clients=6", "method.heterofl.rates=[1.0, 0.5, 0.25]")
    assert run_one(cfg, "heterofl", SEED) is not None
    for row in _rows(run_dir(cfg, "heterofl", SEED) / "metrics.jsonl"):
        rates = row["width_rate"]
        assert len(rates) == 6 and len(set(rates.values())) > 1
        want = sum(size[r] for r in rates.values())
        assert row["bytes_up"] == row["bytes_down"] == want


def test_widths_round_up_and_the_cnn_plan_follows_its_channels() -> None:
    assert [sub_width(5, r) for r in (1.0, 0.5, 0.25, 0.0625)] == [5, 3, 2, 1]
    assert sub_width(100, 0.55) == 55 and sub_width(32, 1 / 3) == 11  # 0.55 * 100 > 55
    assert sub_width(1, 1e-12) == 1
    model = cnn((1, 8, 8), 10, channels=(4, 8), hidden=16)
    plan = width_plan(model)
    assert plan.widths == (4, 8, 16)
    algo = HeteroFL.of(rates=(0.5,))
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    sent = select(algo.broadcast(state, 0, 0).arrays, "model.")
    shapes = {k: tuple(v.shape) for k, v in sent.items()}
    assert shapes == {
        "features.0.weight": (2, 1, 5, 5),
        "features.0.bias": (2,),
        "features.3.weight": (4, 2, 5, 5),
        "features.3.bias": (4,),
        "fc.weight": (8, 16),  # 4 channels x the 2x2 map
        "fc.bias": (8,),
        "head.weight": (10, 8),
        "head.bias": (10,),
    }
    full = model_arrays(model)
    # fc's input columns of channel c are 4c .. 4c + 3: the first 4 channels' columns
    assert torch.equal(sent["fc.weight"], full["fc.weight"][:8, :16])
    sub = sub_model(model, {k: v.shape for k, v in sent.items()})
    assert sub(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert sum(p.numel() for p in sub.parameters()) == 52 + 204 + 136 + 90


def test_rolling_covers_a_layer_in_1_over_r_rounds_by_window_and_n_minus_m_plus_1_by_unit() -> None:
    n, r = 32, 0.25

    def covered(rounds: int, roll_by: str) -> set[int]:
        return {int(u) for t in range(rounds) for u in unit_index(n, r, t, "rolling", roll_by)}

    assert covered(4, "window") == set(range(n)) and len(covered(3, "window")) == 24
    assert covered(25, "unit") == set(range(n)) and len(covered(24, "unit")) == 31
    assert unit_index(n, r, 30, "rolling", "unit").tolist() == [30, 31, *range(6)]
    assert unit_index(n, r, 9, "static", "window").tolist() == list(range(8))
    # a single client of rate 1/4 moves every entry of the hidden layer within 4 rounds
    algo = HeteroFL.of(rates=(r,), extraction="rolling", roll_by="window")
    state = algo.init_server(mlp((1, 8, 8), 10, hidden=[n]), torch.Generator().manual_seed(0))
    start = select(state.arrays, "model.")
    for t in range(4):
        d = {k[7:]: torch.ones(s) for k, (s, _) in algo.expected_reply(state, t, 0).items()}
        state, metrics = algo.aggregate(state, [(0, _reply(d, 1))], t)
        assert float(metrics["covered"]) < 1
    end = select(state.arrays, "model.")
    assert all(bool((end[k] != start[k]).all()) for k in start)


# ------------------------------------------------------------------ the scaler


def test_scaler_divides_hidden_outputs_in_training_only() -> None:
    model = mlp((3,), 2, hidden=[4, 4])
    sub = sub_model(model, {k: v[: v.shape[0]].shape for k, v in model.state_dict().items()})
    sub.load_state_dict(model.state_dict())
    add_scaler(sub, width_plan(sub), 0.25)
    x = torch.randn(5, 3)
    h1 = torch.relu(model.body[0](x) / 0.25)
    want = model.head(torch.relu(model.body[2](h1) / 0.25))
    sub.train()
    assert torch.allclose(sub(x), want)
    sub.eval()
    assert torch.equal(sub(x), model(x))


def test_the_scaler_setting_changes_a_small_clients_training() -> None:
    model = mlp((1, 8, 8), 10, hidden=[32])
    data = build_federation(_cfg(Path("unused")), SEED).client(0)
    deltas = []
    for scaler in (True, False):
        algo = HeteroFL.of(rates=(0.5,), scaler=scaler, local_steps=2, batch_size=8, lr=0.1)
        state = algo.init_server(model, torch.Generator().manual_seed(0))
        reply, _ = algo.client_update(
            algo.broadcast(state, 0, 0), None, model, data, generator(SEED, CLIENT, 0, 0)
        )
        deltas.append(reply.arrays["update.head.weight"])
    assert not torch.allclose(deltas[0], deltas[1])


# ------------------------------------------------------------------ rates and replies


def test_rates_come_in_exact_shares_per_block_drawn_from_seed_and_id() -> None:
    algo = HeteroFL.of(rates=(1.0, 0.25), shares=(3, 1))
    drawn = [algo.rate_of(11, c) for c in range(2000)]
    for b in range(0, 2000, 4):  # every block of 4 ids: three at full width, one at 1/4
        assert sorted(drawn[b : b + 4]) == [0.25, 1.0, 1.0, 1.0]
    assert drawn[:50] == [algo.rate_of(11, c) for c in range(50)]
    assert drawn[:50] != [algo.rate_of(12, c) for c in range(50)]
    assert len({tuple(drawn[b : b + 4]) for b in range(0, 400, 4)}) == 4  # the order is drawn
    even = HeteroFL.of(rates=(1.0, 0.5, 0.25))
    assert sorted(even.rate_of(5, c) for c in range(9)) == [0.25] * 3 + [0.5] * 3 + [1.0] * 3
    salts = {
        int(
            HeteroFL.of()
            .init_server(_tiny(), torch.Generator().manual_seed(s))
            .values["heterofl.salt"]
        )
        for s in range(3)
    }
    assert len(salts) == 3  # the salt comes from the server's seeded generator


def test_a_reply_of_another_rates_shapes_is_rejected() -> None:
    algo = HeteroFL.of(rates=(1.0, 0.5))
    state = algo.init_server(_tiny(), torch.Generator().manual_seed(0))
    a, b = _client_with(algo, state, 1.0), _client_with(algo, state, 0.5)
    full = _reply(select(state.arrays, "model."), 3)
    assert validate_reply(full, algo.expected_reply(state, 0, a)) is None
    assert validate_reply(full, algo.expected_reply(state, 0, b)) is not None
    with pytest.raises(ValueError, match="client_id"):
        algo.expected_reply(state, 0)
    one = HeteroFL.of(rates=(0.5,))
    assert one.expected_reply(one.init_server(_tiny(), torch.Generator()), 0)[
        "update.body.0.weight"
    ] == ((2, 3), torch.float32)


# ------------------------------------------------------------------ refused configs


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("method.heterofl.rates=[]", "rates must be a non-empty"),
        ("method.heterofl.rates=[1.0, 0.0]", "rates must be a non-empty"),
        ("method.heterofl.rates=[1.5]", "rates must be a non-empty"),
        ("method.heterofl.rates=[0.5, 0.5]", "rates must be distinct"),
        ("method.heterofl.shares=[1]", "shares must be empty or one"),
        ("method.heterofl.shares=[1, 0, 1, 1, 1]", "shares must be empty or one"),
        ("method.heterofl.shares=[1, 0.5, 1, 1, 1]", "shares"),
        ("method.heterofl.extraction=random", "extraction"),
        ("method.heterofl.roll_by=half", "roll_by"),
        ("method.heterofl.mask_fill=-inf", "mask_fill"),
        ("params.freeze=[head.bias]", "params.freeze"),
        ("method.heterofl.compression=topk", "does not offer upload compression"),
    ],
)
def test_bad_settings_are_refused(override: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_algorithm("heterofl", load_config(None, [override]))


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["model.name=resnet20", "model.kwargs={norm: group}"], "resnet with norm=group is not"),
        (["secure_aggregation=true"], "per-client shapes"),
        (["asynchronous.buffer=2"], "entry over the clients of one round"),
        (["transport_dtype=bf16"], "transport"),
    ],
)
def test_unsupported_runs_are_refused_before_they_start(
    tmp_path: Path, extra: list[str], match: str
) -> None:
    cfg = _cfg(tmp_path, "algorithms=[heterofl]", *extra)
    with pytest.raises(ConfigError, match=match) as err:
        run_experiment(cfg)
    assert not (tmp_path / "heterofl").exists()
    assert all(len(line) < 400 for line in str(err.value).splitlines())


def test_models_without_a_width_plan_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"model Sequential is not supported.*mlp and cnn"):
        width_plan(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))

    odd = _tiny()
    odd.extra = nn.Parameter(torch.zeros(1))
    with pytest.raises(ConfigError, match="tensors outside its width plan"):
        width_plan(odd)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shares": (2, 0)}, "shares must be empty or one integer"),
        ({"extraction": "random"}, "invalid extraction"),
        ({"roll_by": "half"}, "invalid roll_by"),
        ({"mask_fill": "inf"}, "invalid mask_fill"),
    ],
)
def test_settings_that_bypass_the_config_are_checked_by_the_method(
    kwargs: dict[str, Any], match: str
) -> None:
    """Built directly (tests, benchmarks), the method checks what pydantic checks in a config."""
    with pytest.raises(ValueError, match=match):
        HeteroFL.of(rates=(1.0, 0.5), **kwargs)


def test_roll_by_is_read_only_under_rolling_extraction() -> None:
    from fedlore.engine.run_record import unread_given

    masked = {"hyper.mask_labels": True}
    assert unread_given(HeteroFL, {"hyper.extraction": "static", **masked}) == {"hyper.roll_by"}
    assert unread_given(HeteroFL, {"hyper.extraction": "rolling", **masked}) == set()


def test_mask_fill_is_read_only_with_mask_labels() -> None:
    from fedlore.engine.run_record import unread_given

    plain = {"hyper.extraction": "rolling", "hyper.mask_labels": False}
    assert unread_given(HeteroFL, plain) == {"hyper.mask_fill"}
    assert unread_given(HeteroFL, {**plain, "hyper.mask_labels": True}) == set()
