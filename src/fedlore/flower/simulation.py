"""``engine=flower-sim``: one method x seed on Flower's Simulation Engine (Ray backend).

The ServerApp runs fedlore's round loop in a thread of this process; ``num_clients`` virtual
SuperNodes (``partition-id`` 0..N-1) run the ClientApp in Ray actors, one CPU each.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fedlore.config import Config
from fedlore.flower.app import make_apps

log = logging.getLogger(__name__)


def run_simulated(cfg: Config, method: str, seed: int, resume: bool = False) -> dict[str, Any]:
    """Run ``method`` for ``seed`` on the Simulation Engine; returns the run summary.

    Raises:
        RuntimeError: if the simulation ended without writing a summary (its log says why).
    """
    from flwr.simulation import run_simulation

    from fedlore.run import run_dir

    summary_path = run_dir(cfg, method, seed) / "summary.json"
    if resume and summary_path.exists():
        done: dict[str, Any] = json.loads(summary_path.read_text())
        return done
    server, client = make_apps(cfg, method, seed)
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=cfg.num_clients,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": cfg.flower.num_cpus, "include_dashboard": False},
        },
    )
    if not summary_path.exists():
        raise RuntimeError(f"the Flower simulation of {method} (seed {seed}) wrote no summary")
    result: dict[str, Any] = json.loads(summary_path.read_text())
    return result
