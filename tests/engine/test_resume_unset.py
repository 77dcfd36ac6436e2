"""``--resume`` and the check of a finished run compare a setting whose unset value stands for a
value the other settings decide (:data:`fedlore.config_unset.UNSET_MEANS`) at that value: a run
that spells the value out is the run that left it unset; another value is still a different
config. The recorded ``config.json`` keeps the setting as the config gave it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.config import Config, ConfigError, load_config
from fedlore.config_unset import (
    UNSET_MEANS,
    clients_per_round,
    resolve_unset,
    unset_rules,
)
from fedlore.engine.run_record import _run_config, config_diff, resolved_hyper
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.optim.server import ServerOpt
from fedlore.privacy.dp import default_clipped_count_stddev

SEED = 3
FEDBUFF = ["num_clients=3", "asynchronous.buffer=2"]  # concurrency unset: the 3 per round
ADAPTIVE = ["server.optimizer=adam", "server.lr=0.01"]
DP = ["dp.clip_norm=1.0", "dp.noise_multiplier=0.5", "dp.target_quantile=0.5", "weighting=uniform"]
AUDIT = [*DP[:2], "weighting=uniform", "dp.audit.canaries=10"]


def _record(over: list[str], method: str = "fedavg", hyper: bool = True) -> dict[str, Any]:
    cfg = load_config(None, over)
    out = _run_config(cfg, method)
    if hyper:
        out["hyper"] = resolved_hyper(make_algorithm(method, cfg))
    return out


def _diff(was: list[str], now: list[str], method: str = "fedavg", hyper: bool = True) -> str:
    cfg = load_config(None, now)
    return config_diff(cfg, method, _record(was, method, hyper), make_algorithm)


@pytest.mark.parametrize("hyper", [True, False])
@pytest.mark.parametrize(
    ("was", "same", "other", "message"),
    [
        (FEDBUFF, "asynchronous.concurrency=3", "asynchronous.concurrency=2",
         "asynchronous.concurrency: 3 -> 2"),
        ([*FEDBUFF, "participation=0.7"], "asynchronous.concurrency=2",
         "asynchronous.concurrency=3", "asynchronous.concurrency: 2 -> 3"),
        (ADAPTIVE, "server.v0=1e-6", "server.v0=0", "server.v0: 1e-06 -> 0.0"),
        ([*ADAPTIVE, "server.tau=0.1"], "server.v0=0.010000000000000002", "server.v0=0.01",
         "server.v0: 0.010000000000000002 -> 0.01"),
        (DP, "dp.clipped_count_stddev=0.5", "dp.clipped_count_stddev=0.6",
         "dp.clipped_count_stddev: 0.5 -> 0.6"),
        (AUDIT, "dp.audit.unseen=10", "dp.audit.unseen=4", "dp.audit.unseen: 10 -> 4"),
    ],
)  # fmt: skip
def test_a_value_spelled_out_at_what_unset_means_is_no_difference(
    was: list[str], same: str, other: str, message: str, hyper: bool
) -> None:
    """With a recorded ``hyper`` and without (a record of an older fedlore), and in both
    directions: the run left it unset and the config spells it out, or the other way round."""
    assert _diff(was, [*was, same], hyper=hyper) == ""
    assert _diff([*was, same], was, hyper=hyper) == ""
    assert _diff(was, [*was, other], hyper=hyper) == message


def test_compression_error_feedback_of_a_record_without_hyper() -> None:
    """``compression.error_feedback`` unset is on under top-k, off under QSGD, and stands for
    nothing without compression (a record of a fedlore that did not record ``hyper`` compares
    the config path)."""
    for kind, same, other in (("topk", "true", "false"), ("qsgd", "false", "true")):
        was = [f"compression.kind={kind}"]
        assert _diff(was, [*was, f"compression.error_feedback={same}"], hyper=False) == ""
        assert _diff(was, [*was, f"compression.error_feedback={other}"], hyper=False) == (
            f"compression.error_feedback: {same.title()} -> {other.title()}"
        )


def test_the_methods_own_server_v0_is_its_own_tau_squared() -> None:
    """``method.fedavg.server_v0`` unset is the method's τ² (``method.fedavg.server_tau``),
    not the run-wide ``server.tau``'s."""
    own = [*ADAPTIVE, "method.fedavg.server_tau=0.1"]
    assert _diff(own, [*own, "method.fedavg.server_v0=0.010000000000000002"]) == ""
    assert _diff(own, [*own, "method.fedavg.server_v0=1e-6"]) == (
        "hyper.server_v0: 0.010000000000000002 -> 1e-06"
    )


def test_a_record_from_before_a_setting_existed_compares_it_at_the_default() -> None:
    """A record that lacks ``asynchronous`` (fedlore before FedBuff) was a synchronous run: it
    is this config's while the section keeps its defaults, and not FedBuff's. One that lacks
    ``server.v0`` ran at its default, τ²."""
    old = _record(["num_clients=3"])
    del old["asynchronous"]
    assert config_diff(load_config(None, ["num_clients=3"]), "fedavg", old, make_algorithm) == ""
    # a record that lacks the setting compares it at its default, unset: what unset means
    lacks = _record(ADAPTIVE)
    del lacks["server"]["v0"]
    spelled = load_config(None, [*ADAPTIVE, "server.v0=1e-6"])
    assert config_diff(spelled, "fedavg", lacks, make_algorithm) == ""
    fedbuff = load_config(None, [*FEDBUFF, "asynchronous.concurrency=3"])
    assert config_diff(fedbuff, "fedavg", old, make_algorithm).startswith(
        "asynchronous.buffer: None -> 2"
    )


@pytest.mark.parametrize(
    "over",
    [
        FEDBUFF,
        [*FEDBUFF, "participation=0.7"],
        ["num_clients=7", "participation=0.5", "asynchronous.buffer=1"],
        ["num_clients=10", "participation=0.3"],
        ["num_clients=9", "participation=1.0"],
    ],
)
def test_each_rule_is_the_value_the_run_uses(over: list[str]) -> None:
    """What :data:`UNSET_MEANS` says an unset value is, is what the run makes of it: FedBuff's
    C (``Config.async_concurrency``), σ_b of adaptive clipping, the audit's k', the adaptive
    server optimizers' first v."""
    cfg = load_config(None, over)
    flat: dict[str, Any] = {
        "participation": cfg.participation,
        "num_clients": cfg.num_clients,
        "asynchronous.buffer": cfg.asynchronous.buffer,
        "asynchronous.concurrency": None,
        "dp.clipped_count_stddev": None,
        "dp.audit.canaries": 12,
        "dp.audit.unseen": None,
        "server.tau": 0.03,
        "server.v0": None,
        "compression.kind": "none",
        "compression.error_feedback": None,
    }
    resolve_unset(flat, UNSET_MEANS, {})
    assert clients_per_round(cfg.participation, cfg.num_clients) == cfg.clients_per_round()
    want_c = cfg.async_concurrency() if cfg.asynchronous.enabled else None
    assert flat["asynchronous.concurrency"] == want_c
    assert flat["dp.clipped_count_stddev"] == default_clipped_count_stddev(cfg.clients_per_round())
    audit = load_config(None, [*AUDIT[:3], "dp.audit.canaries=12"]).dp.audit
    assert flat["dp.audit.unseen"] == audit.unseen_count == 12
    assert flat["compression.error_feedback"] is None  # no compression: it stands for nothing
    delta = {"w": torch.tensor([0.5, -2.0, 1e-4])}
    unset = ServerOpt(kind="adam", tau=0.03).step(delta, {}, 1)
    spelled = ServerOpt(kind="adam", tau=0.03, v0=flat["server.v0"]).step(delta, {}, 1)
    for a, b in zip(unset, spelled, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_rule_applies_to_the_method_setting_that_copies_its_path() -> None:
    rules = unset_rules({"server_v0": "server.v0", "server_tau": "server.tau"})
    assert rules["hyper.server_v0"][0] == ("hyper.server_tau",)
    # a rule whose inputs are not all method settings stays at its config path only
    assert "hyper.concurrency" not in unset_rules({"concurrency": "asynchronous.concurrency"})


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(
        None,
        [*FEDBUFF, "rounds=3", "local_steps=2", "batch_size=16", "model.kwargs={hidden: [16]}",
         "partition.min_size=10", "progress=false", f"output_dir={out}", *extra],
    )  # fmt: skip


def test_a_fedbuff_run_resumes_with_the_concurrency_unset_means(tmp_path: Path) -> None:
    """The newcomer's finding: a FedBuff run with concurrency unset, killed, resumed with
    ``asynchronous.concurrency=3`` (what unset means with 3 clients per round) continues.
    ``config.json`` records the setting as each config gave it (null, then 3), never a value
    resolved in its place."""
    cfg = _cfg(tmp_path)
    assert run_one(cfg, "fedavg", SEED, stop_after=0) is None
    path = run_dir(cfg, "fedavg", SEED) / "config.json"
    assert json.loads(path.read_text())["asynchronous"]["concurrency"] is None
    with pytest.raises(ConfigError, match=r"different config \(asynchronous\.concurrency: 3 -> 2"):
        run_one(_cfg(tmp_path, "asynchronous.concurrency=2"), "fedavg", SEED, resume=True)
    summary = run_one(_cfg(tmp_path, "asynchronous.concurrency=3"), "fedavg", SEED, resume=True)
    assert summary is not None
    assert json.loads(path.read_text())["asynchronous"]["concurrency"] == 3
    rows = [json.loads(line) for line in path.with_name("metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if r["round"] >= 0] == [0, 1, 2]


def test_a_finished_fedbuff_run_is_this_configs_run_with_the_value_spelled_out(
    tmp_path: Path,
) -> None:
    """The check of a finished run agrees with ``--resume``: the spelled-out config reports the
    finished run (nothing trained, nothing written); another concurrency is refused."""
    cfg = _cfg(tmp_path, "rounds=2")
    first = run_one(cfg, "fedavg", SEED)
    out = run_dir(cfg, "fedavg", SEED)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    spelled = _cfg(tmp_path, "rounds=2", "asynchronous.concurrency=3")
    for resume in (False, True):
        assert run_one(spelled, "fedavg", SEED, resume=resume) == first
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before
    with pytest.raises(ConfigError, match=r"asynchronous\.concurrency: 3 -> 2"):
        run_one(_cfg(tmp_path, "rounds=2", "asynchronous.concurrency=2"), "fedavg", SEED)


@pytest.mark.parametrize("hyper", [True, False])
def test_unset_on_both_sides_is_no_difference_whatever_it_stands_for(hyper: bool) -> None:
    # participation changes what an unset concurrency (FedBuff) or count stddev (DP) stands
    # for; the change is participation's, named once
    for run in (FEDBUFF, ["num_clients=3", *DP]):
        diff = _diff(run, [*run, "participation=0.7"], hyper=hyper)
        assert diff.count(" -> ") == 1 and "participation: 1.0 -> 0.7" in diff, diff
