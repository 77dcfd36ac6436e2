"""The canary audit (``dp.audit``) on Flower's Simulation Engine: the canaries enter the noised
sum on the server (the same :meth:`~fedlore.privacy.aggregation.Privacy.combine` as in
process), never reach a ClientApp, and the summary records the estimate."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
from sim_helpers import SMALL

from fedlore.config import Config, load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.flower.simulation import run_simulated
from fedlore.privacy.canaries import KEY, directions
from fedlore.types import State

pytestmark = pytest.mark.flower


def _model(cfg: Config) -> tuple[torch.Tensor, State]:
    _, state, _ = Checkpointer.load(run_dir(cfg, "fedavg", 42) / "checkpoint.pt")
    model = {k[6:]: v for k, v in state.arrays.items() if k.startswith("model.")}
    return torch.cat([model[k].reshape(-1).double() for k in sorted(model)]), state


def test_the_simulated_audit_adds_its_canaries_on_the_server(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    """One round under seeded noise: the simulated and the in-process run differ by exactly
    C (Σ c_i^sim − Σ c_i^local) / n, their canaries' difference (OS-entropy keys of their own),
    so the real clients, the noise and the count are the same on both engines."""
    common = [*SMALL, *digits_npz, "rounds=1", "algorithms=[fedavg]", "weighting=uniform"]
    common += ["dp.clip_norm=0.5", "dp.noise_multiplier=0.3", "dp.reproducible_noise=true"]
    common += ["dp.audit.canaries=6", "dp.audit.unseen=0"]
    local = load_config(None, [*common, f"output_dir={tmp_path / 'local'}"])
    sim = load_config(None, [*common, "engine=flower-sim", f"output_dir={tmp_path / 'sim'}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seeded noise: no privacy
        run_one(local, "fedavg", 42)
        summary = run_simulated(sim, "fedavg", 42)
    assert summary["dp_audit_canaries"] == 6 and "dp_audit_epsilon" in summary
    (a, state_a), (b, state_b) = _model(local), _model(sim)
    sums = []
    for state in (state_a, state_b):
        g = directions(bytes.fromhex(str(state.values[KEY])), 6, a.numel()).double()
        sums.append((g / g.norm(dim=1, keepdim=True)).sum(dim=0))
    assert state_a.values[KEY] != state_b.values[KEY]
    assert torch.allclose(b - a, 0.5 * (sums[1] - sums[0]) / 3, atol=2e-6)
