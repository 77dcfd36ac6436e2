"""A shared BatchNorm's running variance under DP on the servers that are not FedAvg's.

DP's noise on the summed increments can take a running variance below 0, and BatchNorm then
scores with the square root of a negative number: NaN. FedAvg's server clamps every running
variance at 0 after its step (``tests/privacy/test_personal_methods.py``). The other
DP-capable servers clamp too:

* FedLore's (FedLore-Random, -Sketch, -fixed, FedSLoP), whose clients replay the logged
  increments: the server clamps the *increment* it logs and applies
  (:func:`~fedlore.tensors.nonnegative_increments`), so every client's replayed cache is the
  server's clamped model, bit for bit; a clamp of the model alone would leave the caches
  behind with the negative variance;
* FedLore's without increments (no DP, values travel): the mean value it keeps and sends;
* FedIT's and FFA-LoRA's with ``average_buffers`` (the running statistics averaged, their
  values travel).

Through the real round loop and in-process transport (``personal_bed.py``) at σ = 50 against
variances near 1, with seeded noise (the clamp, not the noise, is under test).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from personal_bed import SEED, D, N, model, privacy, run

from fedlore.algorithm import Algorithm
from fedlore.algorithms.fedlore import FedLore, FedLoreFixed, FedLoreRandom, FedLoreSketch
from fedlore.algorithms.fedslop import FedSLoP
from fedlore.algorithms.lora_fedit import FedIT
from fedlore.algorithms.lora_ffa import FFALoRA
from fedlore.config import load_config
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.privacy import SeededSource
from fedlore.seeding import generator
from fedlore.tensors import load_model_arrays, select
from fedlore.types import Reply

HIDDEN = [12]
EVERY = [list(range(N))] * 3
VAR, MEAN = "model.body.1.running_var", "model.body.1.running_mean"
SETTINGS: dict[str, Any] = {"lr": 0.05, "local_steps": 4, "batch_size": 16, "rank": 2}
FEDLORE: dict[str, tuple[type[FedLore], dict[str, Any]]] = {
    "fedlore_random": (FedLoreRandom, {}),
    "fedlore_sketch": (FedLoreSketch, {"init_basis": "random"}),  # the bed runs no setup
    "fedlore_fixed": (FedLoreFixed, {"init_basis": "random"}),
    "fedslop": (FedSLoP, {}),
}


def _noised_run(algo: Algorithm, monkeypatch: pytest.MonkeyPatch) -> Any:
    priv = privacy("dp", SeededSource(SEED), sigma=50.0)
    trace = run(algo, "batch", priv, EVERY, monkeypatch, HIDDEN)
    for state in trace.states[1:]:
        var = state.arrays[VAR]
        assert bool((var >= 0).all()) and int((var == 0).sum()) >= 1  # clamped, not luck
        assert float(state.arrays[MEAN].min()) < 0  # noised, not clamped
    net = model("batch", HIDDEN)
    load_model_arrays(net, algo.global_arrays(trace.states[-1]), strict=False)
    net.eval()
    assert bool(torch.isfinite(net(torch.randn(5, D))).all())
    return trace


@pytest.mark.parametrize("method", list(FEDLORE))
def test_fedlores_server_clamps_the_increment_its_clients_replay(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three rounds under central DP: the server's running variances stay at or above 0, and
    every client's cache at the start of each round (after replaying the server's logged
    increments from round 1 on) is the server's model, every tensor bit for bit."""
    cls, extra = FEDLORE[method]
    algo = cls.of(**SETTINGS, **extra, upload_increments=True)
    trace = _noised_run(algo, monkeypatch)
    for rnd in range(1, len(EVERY)):
        server = select(trace.states[rnd].arrays, "model.")
        for cid in EVERY[rnd]:
            cache = select(trace.clients[rnd][cid].arrays, "cache.")
            assert cache.keys() == server.keys()
            for k, v in server.items():
                assert torch.equal(cache[k], v), (rnd, cid, k)


def test_fedlores_server_clamps_the_values_it_keeps_without_increments() -> None:
    """Without ``upload_increments`` (no DP) the unprojected tensors travel as values: a mean
    running variance below 0 (here uploaded as such) is kept, and sent, as 0; every other
    entry and tensor is the mean of the uploads."""
    algo = FedLoreRandom.of(**SETTINGS)
    net = model("batch", HIDDEN)
    state = algo.init_server(net, generator(SEED, 2))
    spec = algo.expected_reply(state, 0, 0)
    replies: list[tuple[int, Reply | None]] = []
    for cid, var in enumerate(([-3.0] * 6 + [1.0] * 6, [1.0] * 6 + [2.0] * 6)):
        arrays = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in spec.items()}
        arrays["dense.body.1.running_var"] = torch.tensor(var)
        arrays["dense.body.1.running_mean"] = torch.full((12,), -1.0 - cid)
        replies.append((cid, Reply(arrays, {"num_examples": 1})))
    new, _ = algo.aggregate(state, replies, 0)
    want = torch.tensor([0.0] * 6 + [1.5] * 6)
    assert torch.equal(new.arrays[VAR], want)
    assert torch.equal(new.arrays[MEAN], torch.full((12,), -1.5))
    sent = algo.broadcast(new, 1, 0)  # the log's round 0 and the values of the dense tensors
    assert sent.config["mode"] == "log" and torch.equal(
        sent.arrays["dense.body.1.running_var"], want
    )


@pytest.mark.parametrize("cls", [FedIT, FFALoRA])
def test_lora_servers_averaging_buffers_clamp_the_running_variances(
    cls: type[FedIT] | type[FFALoRA], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedIT and FFA-LoRA with ``average_buffers`` (the running statistics uploaded as
    increments under DP and averaged): the global running variances stay at or above 0."""
    algo = cls.of(**SETTINGS, average_buffers=True, upload_increments=True)
    _noised_run(algo, monkeypatch)


def test_a_dp_fedlore_run_on_a_batchnorm_model_scores_every_round(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    """The user's case, a whole run (FedLore-Random, central DP at σ = 20, the MLP with
    BatchNorm): every round's test scores are numbers. Before the clamp, DP's noise took a
    running variance below 0 in round 0 and every row's scores were NaN (null)."""
    cfg = load_config(
        None,
        [
            *digits_npz,
            "num_clients=4",
            "rounds=3",
            "local_steps=2",
            "batch_size=16",
            "rank=2",
            "progress=false",
            "algorithms=[fedlore_random]",
            "model.kwargs={hidden: [16], norm: batch}",
            "weighting=uniform",
            "dp.clip_norm=0.5",
            "dp.noise_multiplier=20",
            "dp.reproducible_noise=true",  # the same noise every time (no privacy)
            f"output_dir={tmp_path}",
        ],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seeded noise: no privacy
        run_one(cfg, "fedlore_random", 42)
    path = run_dir(cfg, "fedlore_random", 42) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert isinstance(r["loss"], float) and math.isfinite(r["loss"]), r["round"]
        assert isinstance(r["accuracy"], float), r["round"]
