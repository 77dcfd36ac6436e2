"""What the Flower simulation tests share: small configs and the comparison of a simulated run
with its in-process twin (imported by ``test_simulation.py`` and ``test_simulation_methods.py``;
not a test module)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fedlore import registry
from fedlore.config import Config, load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir

SMALL = [
    "num_clients=3",
    "local_steps=2",
    "batch_size=16",
    "progress=false",
    # one Ray actor runs the three clients in turn: every actor is a new process that imports
    # torch and fedlore (about 4 s of CPU); test_simulation.py's experiment test keeps two
    "flower.client_cpus=2",
    "lr=0.01",
    "model.kwargs={hidden: [16]}",
    "flower.num_cpus=2",
]
OWN_MODEL = {"fedbn": ["model.kwargs={hidden: [16], norm: batch}"]}
"""A method's own model: FedBN refuses one without BatchNorm."""


def sim_cfg(tmp: Path, engine: str, rounds: int, method: str, data: list[str]) -> Config:
    """``SMALL`` with ``data`` (the ``digits_npz`` fixture's overrides: digits without importing
    scikit-learn in every Ray actor)."""
    # a method that distils on the server (FedBE) needs the server's unlabeled set U
    needs_u = registry.get("algorithm", method).capabilities.server_data
    return load_config(
        None,
        [
            *SMALL,
            *data,
            *(["data.server_fraction=0.2"] if needs_u else []),
            *OWN_MODEL.get(method, []),
            f"rounds={rounds}",
            f"algorithms=[{method}]",
            f"output_dir={tmp / engine}",
        ],
    )


def rows(cfg: Config, method: str) -> list[dict]:
    path = run_dir(cfg, method, 42) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_matches(local: Config, sim: Config, method: str, summary: dict[str, Any]) -> None:
    """The simulated run of ``method`` ended with the in-process run's global model, bytes and
    client state sizes."""
    _, s_local, _ = Checkpointer.load(run_dir(local, method, 42) / "checkpoint.pt")
    _, s_sim, _ = Checkpointer.load(run_dir(sim, method, 42) / "checkpoint.pt")
    model_keys = [k for k in s_local.arrays if k.startswith("model.")]
    assert model_keys and set(model_keys) <= set(s_sim.arrays)
    for k in model_keys:
        torch.testing.assert_close(s_sim.arrays[k], s_local.arrays[k], rtol=1e-5, atol=1e-6)
    rows_local, rows_sim = rows(local, method), rows(sim, method)
    assert [r["round"] for r in rows_sim] == [r["round"] for r in rows_local]
    for a, b in zip(rows_local, rows_sim, strict=True):
        assert (a["bytes_up"], a["bytes_down"]) == (b["bytes_up"], b["bytes_down"])
        # the state each client keeps, measured where it lives (a Ray actor's node state)
        assert a["client_state_bytes"] == b["client_state_bytes"]
        assert b["rejected"] == 0
    # bytes measured on the wire (numpy payload + header) sit next to our accounting
    ours_up = sum(r["bytes_up"] for r in rows_sim)
    assert ours_up <= summary["wire_bytes_up_total"] <= ours_up * 1.05 + 10_000
