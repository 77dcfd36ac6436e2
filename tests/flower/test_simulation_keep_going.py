"""``fedlore run --keep-going`` on Flower's Simulation Engine: a run whose server raises is
recorded as failed, and the experiment's one Ray goes on to the next run, which ends as its
in-process twin does; ``--resume`` then retries the failed run on a new Ray. (The in-process
engine's keep-going: ``tests/reliability/test_keep_going.py``.)"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")

from sim_helpers import SMALL, assert_matches

from fedlore import plugins, registry
from fedlore.config import load_config
from fedlore.engine import failed
from fedlore.engine.rundir import run_dir
from fedlore.experiment import RunsFailed, run_experiment, run_one

pytestmark = pytest.mark.flower

PLUGIN = '''
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from fedlore.algorithms.fedavg import FedAvg
from fedlore.registry import register_algorithm


@register_algorithm("sim_boom")
@dataclass(frozen=True)
class SimBoom(FedAvg):
    """FedAvg whose server raises at round 1 while the file ARMED is there."""

    name: ClassVar[str] = "sim_boom"

    def aggregate(self, state, replies, rnd):
        if rnd >= 1 and (Path(__file__).parent / "ARMED").exists():
            raise ValueError(f"sim_boom at round {rnd}")
        return super().aggregate(state, replies, rnd)
'''


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "sim_boom.py"
    path.write_text(PLUGIN)
    (tmp_path / "ARMED").touch()
    yield path
    registry._TABLES["algorithm"].pop("sim_boom", None)
    sys.modules.pop(plugins.module_name(str(path.resolve())), None)


def test_a_failed_simulated_run_is_recorded_and_the_next_run_goes_on(
    tmp_path: Path, plugin: Path, digits_npz: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from fedlore.cli import ENGINES
    from fedlore.flower import simulation

    inits: list[int] = []
    init = ray.init

    def counted(*args: Any, **kwargs: Any) -> Any:
        inits.append(1)
        return init(*args, **kwargs)

    monkeypatch.setattr(ray, "init", counted)

    tiny = [*SMALL, *digits_npz, "rounds=3", f"imports=[{plugin}]"]
    sim = load_config(
        None,
        [*tiny, "algorithms=[sim_boom, fedavg]", "engine=flower-sim", f"output_dir={tmp_path}/s"],
    )
    with pytest.raises(RunsFailed) as e:
        run_experiment(sim, engine=ENGINES["flower-sim"](), keep_going=True)
    assert [(f.method, f.seed) for f in e.value.failures] == [("sim_boom", 42)]
    record = json.loads((run_dir(sim, "sim_boom", 42) / failed.FAILED).read_text())
    assert record["error"] == "ValueError" and record["round"] == 1
    assert "sim_boom at round 1" in record["message"]
    assert inits == [1] and not simulation.ray_processes()  # one Ray, gone at the end
    local = load_config(None, [*tiny, "algorithms=[fedavg]", f"output_dir={tmp_path}/local"])
    run_one(local, "fedavg", 42)  # the run after the failure: its in-process result
    assert_matches(local, sim, "fedavg", e.value.summaries["fedavg"][0])

    (tmp_path / "ARMED").unlink()  # fixed: --resume retries it from its checkpoint
    got = run_experiment(sim, resume=True, engine=ENGINES["flower-sim"]())
    assert [s["rounds"] for s in got["sim_boom"]] == [3]
    assert not (run_dir(sim, "sim_boom", 42) / failed.FAILED).exists()
