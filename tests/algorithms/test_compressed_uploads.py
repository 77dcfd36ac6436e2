"""Upload compression of FedFull, FedAvg and FedProx (``compression``, :mod:`fedlore.compression`)
as the methods use it: the reply carries the compact encoding and nothing else, so the bytes of a
round are the closed-form size; the server decodes and then averages exactly as FedAvg averages
the decoded deltas (a robust aggregate and a server optimizer included); the client keeps its
error-feedback memory in its state; malformed encodings are rejected by the round loop and the
round goes on as if they had never arrived; and the combinations that cannot work are refused
with their reason."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_federation import build, client_data

from fedlore import registry
from fedlore.algorithms.fedavg import FedAvg, FedFull, FedProx
from fedlore.cli import main
from fedlore.compression import decode_update
from fedlore.config import Config, ConfigError, load_config
from fedlore.data.federation import Federation, build_federation
from fedlore.engine.loop import RoundLoop
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.engine.validate import method_problem, validate_reply
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.robust import combine_updates
from fedlore.seeding import SERVER_INIT, generator
from fedlore.settings import hyperparameter_names
from fedlore.tensors import select, with_prefix
from fedlore.types import Broadcast, Reply, State

SETTINGS = {
    "topk-1%": ["compression.kind=topk", "compression.fraction=0.01"],
    "topk-10%": ["compression.kind=topk", "compression.fraction=0.1"],
    "topk-bf16": ["compression.kind=topk", "compression.fraction=0.1", "transport_dtype=bf16"],
    "qsgd-127": ["compression.kind=qsgd"],
    "qsgd-1000": ["compression.kind=qsgd", "compression.levels=1000"],
    "qsgd-fp16": ["compression.kind=qsgd", "compression.levels=15", "transport_dtype=fp16"],
}
"""Settings under test, by name; the dense run has none."""


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def closed_form(model: torch.nn.Module, extra: list[str]) -> int:
    """One client's upload in bytes from the setting alone: per floating tensor of n entries
    ``ceil(f n) (w + 4)`` for top-k, ``w + n c`` for QSGD (w: 4 bytes, 2 in 16 bits; c: 1 byte
    up to 127 levels, else 2); ``4 n`` dense."""
    s = dict(item.split("=") for item in extra)
    w = 2 if s.get("transport_dtype") in ("bf16", "fp16") else 4
    kind, total = s.get("compression.kind", "none"), 0
    for t in model.state_dict().values():
        n = t.numel()
        if not t.is_floating_point():
            total += n * t.element_size()
        elif kind == "topk":
            total += math.ceil(round(float(s["compression.fraction"]) * n, 9)) * (w + 4)
        elif kind == "qsgd":
            total += w + n * (1 if int(s.get("compression.levels", 127)) <= 127 else 2)
        else:
            total += w * n
    return total


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(
        None,
        [
            "name=compress",
            "num_clients=4",
            "rounds=2",
            "local_steps=2",
            "batch_size=16",
            "lr=0.05",
            "model.kwargs={hidden: [32]}",
            "partition.min_size=10",
            "progress=false",
            "algorithms=[fedavg]",
            f"output_dir={out}",
            *extra,
        ],
    )


# ------------------------------------------------------------------------------------ bytes


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_rounds_bytes_up_are_the_closed_form_size(tmp_path: Path, setting: str) -> None:
    extra = SETTINGS[setting]
    cfg = _cfg(tmp_path, *extra)
    assert run_one(cfg, "fedavg", 0) is not None
    rows = [json.loads(x) for x in (tmp_path / "compress/fedavg/seed-0/metrics.jsonl").open()]
    fed = build_federation(cfg, 0)
    model = model_factory(cfg, fed, 0)()
    per_client, dense = closed_form(model, extra), closed_form(model, [])
    for row in rows:
        assert row["rejected"] == 0 and row["accepted"] == 4
        assert row["bytes_up"] == 4 * per_client, setting
        assert row["bytes_down"] == 4 * dense  # the broadcast is the dense model
    n = sum(t.numel() for t in model.state_dict().values())
    tensors = len(model.state_dict())
    if "topk" in setting:  # values + int32 indices: k (w + 4) bytes, k = f n give or take a ceil
        f = float(dict(x.split("=") for x in extra)["compression.fraction"])
        w = 2 if "bf16" in setting else 4
        assert f * n * (w + 4) <= per_client <= (f * n + tensors) * (w + 4)
    else:  # one byte per entry (two above 127 levels) and a norm per tensor
        c = 1 if setting in ("qsgd-127", "qsgd-fp16") else 2
        assert per_client == pytest.approx(c * dense / 4, rel=0.01)
    assert per_client < dense and n > 1000


# ------------------------------------------------------------- the client and the server


def _algo(cls: type[FedFull] = FedAvg, **kw: Any) -> FedFull:
    common: dict[str, Any] = {"lr": 0.1, "local_steps": 3, "batch_size": 8}
    return cls.of(**{**common, **kw})


def _replies(
    algo: FedFull, state: State, rnd: int = 0, clients: tuple[int, ...] = (0, 1, 2, 3)
) -> tuple[list[tuple[int, Reply | None]], dict[int, State]]:
    out: list[tuple[int, Reply | None]] = []
    kept = {}
    for c in clients:
        msg = algo.broadcast(state, rnd, c)
        reply, kept[c] = algo.client_update(msg, None, build(), client_data(c), generator(9, c))
        assert validate_reply(reply, algo.expected_reply(state, rnd, c)) is None
        assert method_problem(algo, state, rnd, c, reply) is None
        out.append((c, reply))
    return out, kept


@pytest.mark.parametrize(
    "kw",
    [
        {"compression": "topk", "compression_fraction": 0.05},
        {"compression": "topk", "compression_fraction": 0.05, "transport_dtype": "bf16"},
        {"compression": "qsgd", "compression_levels": 7},
        {"compression": "topk", "compression_fraction": 0.2, "robust_aggregate": "median"},
        {"compression": "qsgd", "robust_aggregate": "multi_krum", "multi_krum_keep": 2},
        {"compression": "topk", "server_optimizer": "momentum", "server_eta": 0.5},
    ],
    ids=lambda kw: "-".join(str(v) for v in kw.values()),
)
def test_the_server_decodes_then_aggregates_as_fedavg(kw: dict[str, Any]) -> None:
    """Aggregating the compressed replies gives bit for bit the state that the same method
    without compression reaches from the decoded deltas sent dense."""
    algo = _algo(**kw)
    plain = _algo(**{k: v for k, v in kw.items() if not k.startswith("compression")})
    state = algo.init_server(build(), torch.Generator())
    replies, _ = _replies(algo, state)
    model = select(state.arrays, "model.")
    like = {k: (tuple(v.shape), v.dtype) for k, v in model.items()}
    decoded: list[tuple[int, Reply | None]] = []
    for c, r in replies:
        assert r is not None
        up = decode_update(algo.codec(), select(r.arrays, "update."), like)  # type: ignore[arg-type]
        decoded.append((c, Reply(with_prefix(up, "update."), dict(r.metrics))))
    got, _ = algo.aggregate(state, replies, 0)
    want, _ = plain.aggregate(state, decoded, 0)
    assert got.arrays.keys() == want.arrays.keys()
    for k in got.arrays:
        assert torch.equal(got.arrays[k], want.arrays[k]), k
    if kw.get("robust_aggregate") == "median":  # guard: the median is not the mean here
        ups = [select(r.arrays, "update.") for _, r in decoded if r is not None]
        mean = combine_updates(ups, [1.0] * 4, "mean")
        med = combine_updates(ups, [1.0] * 4, "median")
        assert any(not torch.equal(mean[k], med[k]) for k in mean)


def test_the_client_keeps_what_it_left_out_and_sends_it_next_round() -> None:
    dense = _algo()
    topk = _algo(compression="topk", compression_fraction=0.05)
    state = dense.init_server(build(), torch.Generator())
    like = {k: (tuple(v.shape), v.dtype) for k, v in select(state.arrays, "model.").items()}
    memory: State | None = None
    for rnd in range(2):
        msg = dense.broadcast(state, rnd, 1)
        full, _ = dense.client_update(msg, None, build(), client_data(1), generator(9, rnd))
        reply, kept = topk.client_update(msg, memory, build(), client_data(1), generator(9, rnd))
        delta = select(full.arrays, "update.")
        before = select(memory.arrays, "ef.") if memory is not None else {}
        sent = decode_update(topk.codec(), select(reply.arrays, "update."), like)  # type: ignore[arg-type]
        ef = select(kept.arrays, "ef.")
        assert ef.keys() == delta.keys()
        for k, d in delta.items():
            x = d + before[k] if k in before else d
            assert torch.equal(sent[k] + ef[k], x), (rnd, k)  # nothing lost, nothing doubled
            assert int((sent[k] != 0).sum()) <= math.ceil(0.05 * d.numel())
        memory = kept
    # QSGD is unbiased: no memory by default, one when asked; top-k without feedback keeps none
    for kw, has in (
        ({"compression": "qsgd"}, False),
        ({"compression": "qsgd", "error_feedback": True}, True),
        ({"compression": "topk", "error_feedback": False}, False),
    ):
        algo = _algo(**kw)
        _, kept = algo.client_update(
            algo.broadcast(state, 0, 1), None, build(), client_data(1), generator(9, 0)
        )
        assert bool(select(kept.arrays, "ef.")) == has, kw


def test_qsgd_codes_come_from_the_clients_round_generator() -> None:
    algo = _algo(compression="qsgd", compression_levels=3)
    state = algo.init_server(build(), torch.Generator())
    msg = algo.broadcast(state, 0, 2)
    a, _ = algo.client_update(msg, None, build(), client_data(2), generator(9, 2))
    b, _ = algo.client_update(msg, None, build(), client_data(2), generator(9, 2))
    c, _ = algo.client_update(msg, None, build(), client_data(2), generator(9, 3))
    assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
    assert any(not torch.equal(a.arrays[k], c.arrays[k]) for k in a.arrays if "code" in k)


def test_frozen_tensors_are_neither_compressed_nor_sent() -> None:
    algo = _algo(compression="topk", freeze=("fc1.*",))
    state = algo.init_server(build(), torch.Generator())
    replies, kept = _replies(algo, state, clients=(0,))
    reply = replies[0][1]
    assert reply is not None
    assert not any(k.startswith("update.fc1.") for k in reply.arrays)
    assert {k for k in reply.arrays if k.startswith("update.head.weight")} == {
        "update.head.weight.values",
        "update.head.weight.index",
    }
    assert not any(k.startswith("ef.fc1.") for k in kept[0].arrays)
    assert any(k.startswith("cache.fc1.") for k in kept[0].arrays)
    algo.aggregate(state, replies, 0)


# --------------------------------------------------------------- malformed replies, rejected

VICTIM, BAD_ROUND = 1, 0


def _key(r: Reply, part: str) -> str:
    """The largest array of the reply that is a ``part`` (its first weight matrix's)."""
    return max(
        sorted(k for k in r.arrays if k.endswith("." + part)), key=lambda k: r.arrays[k].numel()
    )


def _set(part: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Reply], Reply]:
    def corrupt(r: Reply) -> Reply:
        k = _key(r, part)
        return Reply({**r.arrays, k: change(r.arrays[k].clone())}, dict(r.metrics))

    return corrupt


def _put(i: int, value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[i] = value
        return t

    return change


BAD: dict[str, tuple[str, Callable[[Reply], Reply], str]] = {
    "index_out_of_range": ("topk", _set("index", _put(0, 10**6)), "out of range [0, "),
    "negative_index": ("topk", _set("index", _put(0, -3)), "index -3 out of range"),
    "duplicate_index": (
        "topk",
        _set("index", lambda t: torch.cat([t[:1], t[:1], t[2:]])),
        "given twice",
    ),
    "short_values": ("topk", _set("values", lambda t: t[:-1]), "shape"),
    "int64_index": ("topk", _set("index", lambda t: t.to(torch.int64)), "dtype torch.int64"),
    "nan_value": ("topk", _set("values", _put(0, float("nan"))), "contains NaN or Inf"),
    "code_out_of_range": ("qsgd", _set("code", _put(0, -128)), "code -128 outside [-127, 127]"),
    "nan_norm": ("qsgd", _set("norm", lambda t: torch.full_like(t, float("nan"))), "NaN or Inf"),
    "negative_norm": ("qsgd", _set("norm", lambda t: -t - 1), "is not a finite number >= 0"),
    "int16_codes": ("qsgd", _set("code", lambda t: t.to(torch.int16)), "dtype torch.int16"),
    "dense_delta": (
        "qsgd",
        lambda r: Reply({**r.arrays, "update.smuggled": torch.zeros(10)}, dict(r.metrics)),
        "unexpected ['update.smuggled']",
    ),
}


class Tamper:
    def __init__(self, inner: LocalTransport, mode: str) -> None:
        self.inner, self.mode = inner, mode

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out = self.inner.send(rnd, messages)
        if rnd == BAD_ROUND and VICTIM in out:
            if self.mode == "drop":
                del out[VICTIM]
            elif self.mode != "clean":
                res = out[VICTIM]
                assert isinstance(res, Reply)
                out[VICTIM] = BAD[self.mode][1](res)
        return out


def _loop(cfg: Config, fed: Federation, mode: str) -> tuple[dict[int, Any], dict[int, State]]:
    algo = make_algorithm("fedavg", cfg)
    build_model = model_factory(cfg, fed, 0)
    state = algo.init_server(build_model(), generator(0, SERVER_INIT))
    transport = Tamper(LocalTransport(algo, fed.client, build_model, 0, ClientStore()), mode)
    rows: dict[int, Any] = {}
    states: dict[int, State] = {}

    class Rec:
        def on_round_end(self, rnd: int, row: dict[str, Any], st: State) -> None:
            rows[rnd], states[rnd] = row, st

    def sampler(rnd: int) -> list[int]:
        return sample_clients(cfg.num_clients, cfg.clients_per_round(), 0, rnd)

    RoundLoop(algo, transport, sampler, None, 1, [Rec()]).run(state, 0, cfg.rounds)
    return rows, states


@pytest.mark.parametrize("kind", list(BAD))
def test_a_malformed_compressed_reply_is_rejected_and_the_round_goes_on(
    tmp_path: Path, kind: str
) -> None:
    codec, _, needle = BAD[kind]
    extra = ["compression.kind=topk", "compression.fraction=0.1"] if codec == "topk" else []
    cfg = _cfg(tmp_path, *(extra or ["compression.kind=qsgd"]))
    fed = build_federation(cfg, 0)
    rows, states = _loop(cfg, fed, kind)
    _, dropped = _loop(cfg, fed, "drop")
    row = rows[BAD_ROUND]
    assert row["rejected"] == 1 and row["accepted"] == 3 and row["aggregated"] == 3
    (reason,) = row["rejected_reasons"]
    assert reason.startswith(f"{VICTIM}: ") and needle in reason, reason
    assert rows[1]["rejected"] == 0 and sorted(rows) == [0, 1]  # the next round, as usual
    for rnd in states:  # the reply never entered the model
        for k, v in states[rnd].arrays.items():
            assert torch.equal(v, dropped[rnd].arrays[k]), (rnd, k)
            assert bool(torch.isfinite(v).all())
    clean_rows, clean = _loop(cfg, fed, "clean")  # guard: the victim's reply matters
    assert clean_rows[BAD_ROUND]["rejected"] == 0
    assert any(
        not torch.equal(v, dropped[BAD_ROUND].arrays[k]) for k, v in clean[BAD_ROUND].arrays.items()
    )


# ---------------------------------------------------------------------------- refusals


def test_only_fedfull_fedavg_and_fedprox_compress() -> None:
    """The capability and the settings agree: the methods that declare ``compress_uploads`` are
    those whose ``method.<name>`` section takes ``compression``; FedFull's subclasses that
    upload anything else declare the settings not applicable."""
    takes = {
        n
        for n in registry.names("algorithm")
        if registry.get("algorithm", n).capabilities.compress_uploads
    }
    assert takes == {"fedfull", "fedavg", "fedprox"}
    names = {
        n
        for n in registry.names("algorithm")
        if "compression" in hyperparameter_names(registry.get("algorithm", n))
    }
    assert names == takes
    for name in sorted(set(registry.names("algorithm")) - takes):
        with pytest.raises(ConfigError, match=rf"compression.kind=topk: method '{name}' does not"):
            make_algorithm(name, load_config(None, ["compression.kind=topk"]))
    for cls in (FedFull, FedAvg, FedProx):
        assert cls.of(compression="qsgd").codec() is not None


DP = ["dp.clip_norm=1", "dp.noise_multiplier=1", "weighting=uniform"]
REFUSED = [
    (
        ["secure_aggregation=true", "compression.kind=topk"],
        "secure_aggregation: compression.kind=topk is not supported: each client's top-k indices "
        "differ",
    ),
    (
        ["secure_aggregation=true", "method.fedavg.compression=topk"],
        "invalid compression='topk' with upload_increments=True",
    ),
    ([*DP, "compression.kind=qsgd"], "dp: compression.kind=qsgd is not supported"),
    (
        [*DP, "method.fedavg.compression=qsgd"],
        "invalid compression='qsgd' with upload_increments=True",
    ),
    (
        ["attack.kind=sign_flip", "attack.fraction=0.25", "compression.kind=topk"],
        "attack.kind=sign_flip with compression.kind=topk",
    ),
    (
        ["attack.kind=gaussian", "attack.fraction=0.25", "method.fedavg.compression=qsgd"],
        "attack.kind=gaussian with method.fedavg.compression=qsgd",
    ),
    (
        ["algorithms=[fedlore]", "method.fedlore.compression=topk"],
        "method.fedlore.compression=topk: method 'fedlore' does not offer upload compression",
    ),
    (
        ["algorithms=[ditto]", "method.ditto.compression=topk"],
        "method.ditto.compression=topk: method 'ditto' does not",
    ),
    (["compression.fraction=0"], "compression.fraction"),
    (["compression.levels=40000"], "compression.levels"),
    (
        ["method.fedavg.compression=topk", "method.fedavg.compression_fraction=1.5"],
        "compression_fraction must be in (0, 1]",
    ),
    (
        ["method.fedavg.compression=qsgd", "method.fedavg.compression_levels=0"],
        "compression_levels must be in [1, 32767]",
    ),
    (  # a compression setting without a kind: it would change nothing (a forgotten kind)
        ["compression.fraction=0.1"],
        "compression.fraction=0.1: compression.kind=none, so method 'fedavg' uploads dense",
    ),
    (["method.fedavg.error_feedback=true"], "method.fedavg.error_feedback=True: compression"),
    (  # the other codec's setting: QSGD never reads a fraction, top-k never reads levels
        ["compression.kind=qsgd", "compression.fraction=0.1"],
        "compression.fraction=0.1: a top-k setting that no method of the run reads "
        "(compression.kind=qsgd for 'fedavg')",
    ),
    (
        ["method.fedavg.compression=topk", "method.fedavg.compression_levels=4"],
        "method.fedavg.compression_levels=4: a QSGD setting that no method of the run reads",
    ),
    (  # top-k's supports differ: a coordinate-wise median of them is zero almost everywhere
        ["compression.kind=topk", "robust.aggregate=median"],
        "robust.aggregate=median with compression.kind=topk: each client's top-k",
    ),
    (["method.fedavg.compression=gzip"], "method.fedavg.compression"),
]


@pytest.mark.parametrize(("overrides", "needle"), REFUSED)
def test_combinations_that_cannot_work_exit_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], needle: str
) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        "name: refuse\nnum_clients: 4\nrounds: 1\nalgorithms: [fedavg]\nprogress: false\n"
        f"output_dir: {tmp_path}\n"
    )
    assert main(["run", str(cfg_file), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlore: error:") and needle in err, err
    assert not (tmp_path / "refuse").exists()


def test_the_not_applicable_settings_of_fedfulls_other_subclasses() -> None:
    cfg = load_config(None, ["algorithms=[scaffold]", "method.scaffold.compression_fraction=0.1"])
    with pytest.raises(ValueError, match=r"method\.scaffold\.compression_fraction: does not apply"):
        make_algorithm("scaffold", cfg)


# ------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize(
    "extra",
    [
        ["compression.kind=topk", "compression.fraction=0.1"],
        ["compression.kind=qsgd", "compression.levels=15"],
    ],
    ids=["topk-10%", "qsgd-15"],
)
def test_fedlore_run_trains_with_compressed_uploads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    """Digits, 10 clients, FedAvg at lr 0.1: well above chance (10 %) after 8 rounds, with the
    uploads at the closed-form size."""
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        "name: e2e\nnum_clients: 10\nrounds: 8\nlocal_steps: 10\nbatch_size: 32\n"
        "algorithms: [fedavg]\nseeds: [0]\nprogress: false\n"
        f"output_dir: {tmp_path}\nmethod: {{fedavg: {{lr: 0.1}}}}\n"
        "data: {name: digits}\npartition: {name: dirichlet, alpha: 0.5, min_size: 10}\n"
        "eval: {every: 8}\n"
    )
    assert main(["run", str(cfg_file), *extra]) == 0
    summary = json.loads((tmp_path / "e2e/fedavg/seed-0/summary.json").read_text())
    assert summary["final_accuracy"] > 0.6, summary["final_accuracy"]
    assert summary["rejected_total"] == 0
    cfg = load_config(str(cfg_file), extra)
    model = model_factory(cfg, build_federation(cfg, 0), 0)()
    assert summary["bytes_up_total"] == 8 * 10 * closed_form(model, extra)
    recorded = json.loads((tmp_path / "e2e/fedavg/seed-0/config.json").read_text())
    assert recorded["hyper"]["compression"] == extra[0].split("=")[1]
