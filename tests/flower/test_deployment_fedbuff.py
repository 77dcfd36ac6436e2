"""FedBuff (``asynchronous.buffer``) on a real loopback Flower deployment, ``flwr run`` of
fedlore on 1 SuperLink + 3 SuperNodes (:class:`~fedlore.flower.loopback.LoopbackFederation`;
every process is stopped by PID).

Under the simulated clock the deployed rows are the in-process run's (Flower carries each
client's training; the buffer's order is the configured speeds'). Under the wall clock a
SuperNode killed mid-run does not stall it: the two live clients keep the server stepping, and
the dead one's flight ends after ``asynchronous.flight_timeout_s``. Every message starts a
ClientApp process (about 10 s on two idle cores), so the simulated-clock run is short and the
wall-clock one is cut off as soon as it has shown what it is for.
"""

from __future__ import annotations

import json
import time
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
COMMON = [
    f"num_clients={N}",
    "local_steps=2",
    "progress=false",
    "model.kwargs.hidden=[16]",
    "algorithms=[fedavg]",
    "asynchronous.buffer=2",
]
WALL_CLOCK = {"wall_s", "eval_s", "client_train_s"}


def _rows(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def _metrics(out_dir: Path) -> Path:
    return out_dir / "quickstart" / "fedavg" / f"seed-{SEED}" / "metrics.jsonl"


def test_a_deployed_fedbuff_run_on_the_simulated_clock_gives_the_in_process_rows(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    from fedlore.config import load_config
    from fedlore.experiment import run_one

    # two steps: the first takes one client's reply twice (it was started again from version 0
    # while the slowest trained), the second a reply one version stale
    common = [*COMMON, "rounds=2", "clients.speed=lognormal", "clients.speed_spread=1.0"]
    common += digits_npz
    out_dir = tmp_path / "runs"
    deploy = [*common, "flower.wait_for_nodes_s=60", f"output_dir={out_dir}"]
    fed = LoopbackFederation(tmp_path / "fed", num_nodes=N)
    try:
        fed.start()
        fed.submit(CONFIG, "fedavg", SEED, " ".join(deploy))
        summary = _metrics(out_dir).with_name("summary.json")
        deadline = time.monotonic() + 300
        while not summary.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert summary.exists(), "the deployed run did not finish; see " + str(fed.work)
    finally:
        fed.close()
    local = load_config(CONFIG, [*common, f"output_dir={tmp_path / 'local'}"])
    run_one(local, "fedavg", SEED)
    want, got = _rows(_metrics(tmp_path / "local")), _rows(_metrics(out_dir))
    assert len(got) == len(want) == 2
    assert [r["staleness_max"] for r in got] == [0, 1]
    assert len(set(got[0]["accepted_clients"])) == 1  # one client's two replies
    for a, b in zip(want, got, strict=True):
        for k in a.keys() - WALL_CLOCK:
            if isinstance(a[k], float):  # float32 training on another process: to 1e-5
                assert b[k] == pytest.approx(a[k], rel=1e-5), k
            else:
                assert b[k] == a[k], k


def test_a_killed_supernode_does_not_stall_a_wall_clock_run(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    # The run is long (60 steps) and is cut off once the dead node's flight has ended and two
    # more steps followed: how many steps fit in flight_timeout_s depends on the machine's
    # speed, so a fixed short run could end before the timeout fires (it did, on a fast CI).
    out_dir = tmp_path / "runs"
    overrides = [
        *COMMON,
        "rounds=60",
        "asynchronous.clock=wall",
        "asynchronous.flight_timeout_s=30",
        "flower.wait_for_nodes_s=60",
        f"output_dir={out_dir}",
        *digits_npz,
    ]
    fed = LoopbackFederation(tmp_path / "fed", num_nodes=N)
    metrics = _metrics(out_dir)
    summary = metrics.with_name("summary.json")
    victim = 2

    def freed_and_stepped_on(rows: list[dict[str, Any]]) -> bool:
        ended = [i for i, r in enumerate(rows) if i > 0 and r.get("rejected_reasons")]
        return bool(ended) and len(rows) >= ended[0] + 3

    try:
        fed.start()
        fed.submit(CONFIG, "fedavg", SEED, " ".join(overrides))
        deadline = time.monotonic() + 400
        killed = False
        while time.monotonic() < deadline:
            rows = _rows(metrics)
            if not killed and rows:
                fed.kill_node(victim)  # its flight (started at the last step) never answers
                killed = True
            if freed_and_stepped_on(rows) or summary.exists():
                break
            time.sleep(0.5)
        rows = _rows(metrics)
        assert freed_and_stepped_on(rows), (
            f"{len(rows)} steps and no freed slot followed by two more; see {fed.work}"
        )
    finally:
        fed.close()
    assert [r["round"] for r in rows] == list(range(len(rows)))
    assert all(r["accepted"] == 2 for r in rows)
    clock = [r["elapsed_s"] for r in rows]
    assert clock == sorted(clock) and all("sim_time_s" not in r for r in rows)
    after = rows[1:]
    assert not any(victim in r["accepted_clients"] for r in after[1:])  # dead from step 1 on
    # the victim's flight timed out (or, the SuperLink having noticed the dead node first,
    # Flower's error reply for a message its node never took): its slot went to a live client,
    # and the two live clients went on stepping
    reasons = [why for r in after for why in r.get("rejected_reasons", [])]
    assert reasons and all(why.split(":")[0] == str(victim) for why in reasons), reasons
