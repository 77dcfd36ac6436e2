"""Client states on the nodes' disks (``flower.node_states``) on a real loopback deployment:
``flwr run`` of SCAFFOLD on 1 SuperLink + 3 SuperNodes, each SuperNode given a ``state-dir``
node config. The SuperLink is killed (SIGKILL) during round 1, once a node has written that
round's state file; ``resume=true`` on a new SuperLink and new SuperNodes over the same
folders gives the in-process run's rows: the nodes read the control variates of the
checkpoint's round, not the killed round's (a client that read those, as when a file's round
is checked one round too late, trains another model: round 1's ``train_loss`` 2.3275 instead
of 2.3135), and none restarts without them. The in-process harness of ``test_node_files.py``
checks the rules one by one (and their mutations); this test checks that real processes and
real disks keep them. Every process is stopped by PID."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")

from fedlore.flower.loopback import LoopbackFederation

pytestmark = [pytest.mark.flower, pytest.mark.xdist_group("deployment")]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "quickstart.yaml"
N = 3
SEED = 42
METHOD = "scaffold"
COMMON = [
    f"num_clients={N}",
    "rounds=3",
    "local_steps=2",
    "progress=false",
    "model.kwargs.hidden=[16]",
    "flower.node_states=true",
]
DEPLOYED = [
    "flower.round_timeout_s=60",
    "flower.wait_for_nodes_s=60",
    "flower.superlink_timeout_s=5",  # the killed attempt's ServerApp frees the run folder soon
]
WALL_CLOCK = {"wall_s", "eval_s", "client_train_s"}


def _rows(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def _wait(done: Callable[[], bool], limit: float, what: str, fed: LoopbackFederation) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"{what} not within {limit} s; see {fed.work}"
        time.sleep(0.1)


def _federation(work: Path, disks: Path) -> LoopbackFederation:
    return LoopbackFederation(
        work, num_nodes=N, node_config={i: f'state-dir="{disks / f"node{i}"}"' for i in range(N)}
    )


@pytest.mark.slow  # ~4 min on two cores: two deployments, a ClientApp process per message
def test_a_deployment_killed_mid_round_resumes_with_the_states_on_its_nodes_disks(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    from fedlore.config import load_config
    from fedlore.engine.rundir import run_dir
    from fedlore.experiment import run_one

    out_dir, disks = tmp_path / "runs", tmp_path / "disks"
    overrides = " ".join([*COMMON, *DEPLOYED, *digits_npz, f"output_dir={out_dir}"])
    cfg = load_config(CONFIG, [*COMMON, *digits_npz, f"output_dir={out_dir}"])
    folder = run_dir(cfg, METHOD, SEED)
    fed = _federation(tmp_path / "first", disks)
    try:
        fed.start()
        fed.submit(CONFIG, METHOD, SEED, overrides)
        _wait(lambda: any(r["round"] == 0 for r in _rows(folder)), 300, "round 0", fed)
        _wait(lambda: any(disks.rglob("state.1.*.pt")), 120, "a state file of round 1", fed)
        assert fed.superlink is not None
        fed.superlink.send_signal(signal.SIGKILL)
        fed.superlink.wait(timeout=30)
        killed_at = [r["round"] for r in _rows(folder)]
        time.sleep(10)  # the ServerApp gives up on the dead SuperLink and frees the folder
    finally:
        fed.close()
    assert 1 not in killed_at, f"round 1 was recorded before the kill: {killed_at}"
    fed = _federation(tmp_path / "second", disks)
    try:
        fed.start()
        fed.submit(CONFIG, METHOD, SEED, overrides, resume=True)
        _wait(lambda: (folder / "summary.json").exists(), 300, "the resumed run", fed)
    finally:
        fed.close()
    local = load_config(CONFIG, [*COMMON, *digits_npz, f"output_dir={tmp_path / 'local'}"])
    run_one(local, METHOD, SEED)
    want, got = _rows(run_dir(local, METHOD, SEED)), _rows(folder)
    assert [r["round"] for r in got] == [r["round"] for r in want] and want[-1]["round"] == 2
    for a, b in zip(want, got, strict=True):
        for k in a.keys() - WALL_CLOCK:
            if isinstance(a[k], float):  # float32 training in other processes: to 1e-5
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (a["round"], k)
            else:  # bytes_down included: a restarted client would get the dense model
                assert b[k] == a[k], (a["round"], k)
    # each node kept at most three files for its client, none of them a leftover .tmp
    for node in range(N):
        files = list((disks / f"node{node}").rglob("state.*"))
        assert 0 < len(files) <= 3 and not [p for p in files if p.suffix == ".tmp"], files
