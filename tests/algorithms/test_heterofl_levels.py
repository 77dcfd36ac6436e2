"""HeteroFL's complexity levels (``eval_levels``) and the capacity-aware static batch norm query
(:mod:`fedlore.algorithms.heterofl_levels`): each level's accuracy against the sub-model sliced
by hand (static and rolling, each with and without BatchNorm), each level's statistics the fp64 mean
and unbiased variance of the data of the clients able to run it, no client sent a tensor wider
than its level, the query's bytes the sum of the sub-models sent, the default rows unchanged,
the refusals and a reply missing a level its client was sent left out of every level."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fedlore.algorithms.heterofl import HeteroFL
from fedlore.algorithms.heterofl_plan import unit_index
from fedlore.config import Config, ConfigError, load_config
from fedlore.data.federation import build_federation
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.models.mlp import mlp
from fedlore.types import Reply, State

SEED = 1
F64 = torch.float64
RATES = (1.0, 0.5, 0.25)
WIDTH = 32


def _cfg(out: Path, *extra: str, norm: bool = True) -> Config:
    kwargs = "{hidden: [32], norm: batch}" if norm else "{hidden: [32]}"
    return load_config(
        None,
        [
            "name=levels",
            "num_clients=6",
            "rounds=2",
            "local_steps=3",
            "batch_size=16",
            "lr=0.3",
            f"model.kwargs={kwargs}",
            "partition.min_size=10",
            "progress=false",
            "algorithms=[heterofl]",
            "method.heterofl.rates=[1.0, 0.5, 0.25]",
            f"output_dir={out}",
            *extra,
        ],
    )


def _run(cfg: Config) -> tuple[list[dict[str, Any]], State, dict[str, Any]]:
    summary = run_one(cfg, "heterofl", SEED)
    assert summary is not None
    folder = run_dir(cfg, "heterofl", SEED)
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x]
    return rows, Checkpointer.load(folder / "checkpoint.pt")[1], summary


def _units(rate: float, rnd: int, extraction: str) -> torch.Tensor:
    return unit_index(WIDTH, rate, rnd, extraction, "unit")


def _hidden(w: dict[str, torch.Tensor], x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The sliced first Linear's output (units ``u``), in float64."""
    return (x.flatten(1).to(F64) @ w["model.body.0.weight"][u].T.to(F64)) + w["model.body.0.bias"][
        u
    ].to(F64)


def _stats_key(rate: float, j: int, name: str) -> str:
    return f"model.body.1.{name}" if rate == 1.0 else f"levels.{j}.body.1.{name}"


def _by_hand(w: dict[str, torch.Tensor], x: torch.Tensor, u: torch.Tensor, j: int, norm: bool):
    z = _hidden(w, x, u)
    if norm:
        rate = RATES[j]
        mean = w[_stats_key(rate, j, "running_mean")].to(F64)
        var = w[_stats_key(rate, j, "running_var")].to(F64)
        z = (z - mean) / torch.sqrt(var + 1e-5)
        z = z * w["model.body.1.weight"][u].to(F64) + w["model.body.1.bias"][u].to(F64)
    h = torch.relu(z)
    head = w["model.head.weight"][:, u].to(F64)
    return h @ head.T + w["model.head.bias"].to(F64)


@pytest.mark.parametrize(
    ("extraction", "norm"),
    [("static", False), ("rolling", False), ("static", True), ("rolling", True)],
)
def test_each_levels_accuracy_is_its_sub_model_sliced_by_hand(
    tmp_path: Path, extraction: str, norm: bool
) -> None:
    """The row's ``levels``: per rate the accuracy and loss of the sub-model its clients hold
    after the last round (the rolling window of that round), sliced here by hand, with the
    level's own running statistics; its share, clients and parameters; rate 1 is the global
    model's row; the summary holds the last row's."""
    cfg = _cfg(
        tmp_path,
        "method.heterofl.eval_levels=true",
        f"method.heterofl.extraction={extraction}",
        norm=norm,
    )
    rows, state, summary = _run(cfg)
    test = build_federation(cfg, SEED).central_test
    last = rows[-1]
    assert summary["levels"] == last["levels"]
    assert last["levels"]["1.0"]["accuracy"] == last["accuracy"]
    clients = list(last["width_rate"].values())
    for j, rate in enumerate(RATES):
        u = _units(rate, 1, extraction)
        logits = _by_hand(state.arrays, test.x, u, j, norm)
        got = last["levels"][str(rate)]
        want = float((logits.argmax(1) == test.y).double().mean())
        assert got["accuracy"] == pytest.approx(want, abs=1e-6), rate  # float32
        nll = nn.functional.cross_entropy(logits, test.y)
        assert got["loss"] == pytest.approx(float(nll), rel=1e-4), rate
        m = len(u)
        params = 64 * m + m + 10 * m + 10 + (2 * m if norm else 0)
        assert (got["params"], got["share"]) == (params, pytest.approx(1 / 3))
        assert got["clients"] == clients.count(rate)


def test_each_levels_statistics_pool_the_clients_able_to_run_it_in_fp64(tmp_path: Path) -> None:
    """Level r's running statistics: the mean and unbiased variance (float64) of its
    sub-model's BatchNorm input over the training data of the round's clients of rate >= r,
    not of every client's: the full model's from the clients of rate 1 alone."""
    cfg = _cfg(tmp_path, "rounds=1", "method.heterofl.eval_levels=true")
    rows, state, _ = _run(cfg)
    fed = build_federation(cfg, SEED)
    rates = {int(c): r for c, r in rows[-1]["width_rate"].items()}
    assert rows[-1]["level_sbn_clients"] == {
        str(r): sum(x >= r for x in rates.values()) for r in RATES
    }
    for j, rate in enumerate(RATES):
        u = _units(rate, 0, "static")
        able = [c for c, r in rates.items() if r >= rate]
        z = torch.cat([_hidden(state.arrays, fed.client(c).train.x, u) for c in able])
        mean = state.arrays[_stats_key(rate, j, "running_mean")].to(F64)
        var = state.arrays[_stats_key(rate, j, "running_var")].to(F64)
        torch.testing.assert_close(mean, z.mean(0), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(var, z.var(0, unbiased=True), rtol=1e-5, atol=1e-6)
        everyone = torch.cat([_hidden(state.arrays, fed.client(c).train.x, u) for c in rates])
        if len(able) < len(rates):
            assert not torch.allclose(mean, everyone.mean(0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("eval_levels", [False, True])
def test_no_client_is_sent_a_tensor_wider_than_its_level(eval_levels: bool) -> None:
    """The query to a client of rate r holds the sub-models of the queried levels of rate <= r
    (only rate 1 without ``eval_levels``), each exactly that level's slice; a client below
    every queried level gets none."""
    model = mlp((1, 8, 8), 10, hidden=[WIDTH], norm="batch")
    algo = HeteroFL.of(rates=RATES, eval_levels=eval_levels)
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    full = {k: v.shape for k, v in model.state_dict().items()}
    for cid in range(6):
        rate = algo.client_rate(state, cid, 3)
        msg = algo.query(state, 3, cid)
        levels = [j for j, r in enumerate(RATES) if r <= rate and (eval_levels or r == 1.0)]
        if not levels:
            assert msg is None
            continue
        assert msg is not None
        want: dict[str, tuple[int, ...]] = {}
        for j in levels:
            m = len(_units(RATES[j], 3, "static"))
            want |= {
                f"sbn.{j}.body.0.weight": (m, 64),
                f"sbn.{j}.body.0.bias": (m,),
                f"sbn.{j}.body.1.weight": (m,),
                f"sbn.{j}.body.1.bias": (m,),
                f"sbn.{j}.head.weight": (10, m),
                f"sbn.{j}.head.bias": (10,),
            }
        assert {k: tuple(v.shape) for k, v in msg.arrays.items()} == want
        for k, v in msg.arrays.items():  # never wider than the client's own sub-model
            own = algo.positions(state, 3, rate)[k.split(".", 2)[2]]
            assert v.numel() <= (
                own.numel() if own is not None else full[k.split(".", 2)[2]].numel()
            )


@pytest.mark.parametrize("eval_levels", [False, True])
def test_the_query_bytes_are_the_sub_models_sent_and_their_statistics(
    tmp_path: Path, eval_levels: bool
) -> None:
    """Down: the sum over the round's clients of the sub-models of the levels each can run
    (fp32); up: per sub-model sent, a count and per-channel sums and sums of squares (fp64)."""
    cfg = _cfg(tmp_path, f"method.heterofl.eval_levels={str(eval_levels).lower()}")
    rows, _, summary = _run(cfg)
    params = {r: 64 * m + m + 2 * m + 10 * m + 10 for r, m in ((1.0, 32), (0.5, 16), (0.25, 8))}
    for row in rows:
        down = up = 0
        for rate in row["width_rate"].values():
            for r in RATES:
                if r <= rate and (eval_levels or r == 1.0):
                    down += 4 * params[r]
                    up += 8 + 16 * int(32 * r)
        assert (row["query_bytes_down"], row["query_bytes_up"]) == (down, up)
        assert ("levels" in row, "level_sbn_clients" in row) == (eval_levels, eval_levels)
        assert row["sbn_clients"] == list(row["width_rate"].values()).count(1.0)
    assert ("levels" in summary) == eval_levels


def test_a_batchnorm_model_without_a_full_width_level_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "method.heterofl.rates=[0.5, 0.25]")
    with pytest.raises(ConfigError, match=r"rates \[0.5, 0.25\] has none; add 1.0"):
        run_one(cfg, "heterofl", SEED)


def test_a_level_no_client_of_the_first_queried_round_can_run_is_refused(tmp_path: Path) -> None:
    """Two clients drawn from a block of one full-width and twenty half-width places (this
    seed: both of rate 1/2): the first query names the level it cannot set, whose evaluation
    would use statistics of no data."""
    cfg = _cfg(
        tmp_path,
        "num_clients=2",
        "method.heterofl.rates=[1.0, 0.5]",
        "method.heterofl.shares=[1, 20]",
    )
    with pytest.raises(ConfigError, match=r"round 0: no client of the round could run .* 1\.0"):
        run_one(cfg, "heterofl", SEED)


def test_a_reply_missing_a_level_its_client_was_sent_is_left_out_of_every_level() -> None:
    """A full-width client sent levels 1 and 1/2 that answers for level 1 only is left out of
    both, its usable level-1 statistics included (a reply must hold exactly the levels sent);
    the other full-width client's reply sets both levels alone."""
    model = mlp((3,), 2, hidden=[4], norm="batch")
    algo = HeteroFL.of(rates=(1.0, 0.5), eval_levels=True)
    state = algo.init_server(model, torch.Generator().manual_seed(0))
    full = [c for c in range(20) if algo.client_rate(state, c, 0) == 1.0][:2]
    assert len(full) == 2

    def stats(j: int, width: int, scale: float) -> dict[str, torch.Tensor]:
        return {
            f"stats.{j}.body.1.count": torch.tensor(4.0, dtype=F64),
            f"stats.{j}.body.1.sum": torch.full((width,), 4.0 * scale, dtype=F64),
            f"stats.{j}.body.1.sumsq": torch.full((width,), 8.0 * scale**2, dtype=F64),
        }

    good = Reply(stats(0, 4, 1.0) | stats(1, 2, 1.0), {})
    partial = Reply(stats(0, 4, 3.0), {})  # level 1/2 missing
    new, metrics = algo.absorb_query(state, [(full[0], good), (full[1], partial)], 0)
    assert metrics == {"sbn_clients": 1, "level_sbn_clients": {"1.0": 1, "0.5": 1}}
    torch.testing.assert_close(new.arrays["model.body.1.running_mean"], torch.ones(4))
    torch.testing.assert_close(new.arrays["levels.1.body.1.running_mean"], torch.ones(2))
