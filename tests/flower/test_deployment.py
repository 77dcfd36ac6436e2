"""A real loopback Flower deployment: 1 SuperLink + 3 SuperNodes, ``flwr run .`` of fedlore.

One SuperNode is killed while the server is in a round: the round completes after
``flower.round_timeout_s`` with the replies that arrived, nothing of the dead client enters the
model, and when the node comes back (a fresh process, so its ``Context.state`` is empty) FedLore
resynchronizes it with the dense model and it trains again. Every process started here is
stopped by PID.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")

from fedlore.engine.sampling import sample_clients
from fedlore.flower.loopback import LoopbackFederation

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[2]
N = 3
SEED = 42
ROUNDS = 5  # the victim is sampled in round 1 and again in rounds 3 and 4 (seed 42)


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path / "fed", num_nodes=N)
    try:
        yield fed
    finally:
        fed.close()


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def test_dead_supernode_is_left_out_then_resynchronized(
    federation: LoopbackFederation, tmp_path: Path
) -> None:
    out_dir = tmp_path / "runs"
    overrides = " ".join(
        [
            f"num_clients={N}",
            "participation=0.67",  # 2 of 3 clients per round
            f"rounds={ROUNDS}",
            "local_steps=3",
            "progress=false",
            "flower.round_timeout_s=45",  # generous: a busy machine is slow to start ClientApps
            "flower.wait_for_nodes_s=60",
            f"output_dir={out_dir}",
            "model.kwargs.hidden=[32]",
        ]
    )
    # the victim: a client sampled in round 1 (killed once round 0 is recorded) and sampled
    # again in a later round after it has been restarted
    in_round = {r: sample_clients(N, 2, SEED, r) for r in range(ROUNDS)}
    victim = next(c for c in in_round[1] if any(c in in_round[r] for r in range(3, ROUNDS)))
    federation.start()
    config = ROOT / "experiments" / "quickstart.yaml"
    federation.submit(config, "fedlore", SEED, overrides)
    metrics = out_dir / "quickstart" / "fedlore" / f"seed-{SEED}" / "metrics.jsonl"
    summary = metrics.with_name("summary.json")
    deadline = time.monotonic() + 300
    killed = restarted = False
    while not summary.exists() and time.monotonic() < deadline:
        rows = _rows(metrics)
        done = {r["round"] for r in rows}
        if not killed and 0 in done:
            federation.kill_node(victim)  # round 1 is under way and waits for it
            killed = True
        if killed and not restarted and 1 in done:
            federation.start_node(victim)
            restarted = True
        time.sleep(0.5)
    assert summary.exists(), "the deployed run did not finish; see " + str(federation.work)
    rows = {r["round"]: r for r in _rows(metrics)}
    faulty = rows[1]
    assert victim not in faulty["accepted_clients"]
    assert faulty["rejected"] == 1 and faulty["aggregated"] == faulty["accepted"] == 1
    assert any(f"{victim}: no reply" in reason for reason in faulty["rejected_reasons"])
    # back and resynchronized: the victim's replies are accepted again in a later round
    later = [r for t, r in rows.items() if t >= 3 and victim in in_round[t]]
    assert later and all(victim in r["accepted_clients"] for r in later)
    # round 2 may still miss it (a restarted SuperNode needs a few seconds to register)
    assert all(
        reason.split(":")[0] == str(victim) for reason in rows[2].get("rejected_reasons", [])
    )
    assert all(r["rejected"] == 0 for t, r in rows.items() if t not in (1, 2))
    # its state was lost with the process: the server sent it the dense model (a resync),
    # so the round it returned in cost more download than a round of two synced clients
    back = min(t for t, r in rows.items() if t >= 2 and victim in r["accepted_clients"])
    synced = [
        r["bytes_down"]
        for t, r in rows.items()
        if t > back and r["accepted"] == 2 and r["rejected"] == 0
    ]
    assert synced and rows[back]["bytes_down"] > min(synced)
    result = json.loads(summary.read_text())
    assert result["rounds"] == ROUNDS and result["final_accuracy"] > 0.1
    assert result["wire_bytes_up_total"] >= result["bytes_up_total"]


# ------------------------------------------------------------------ site-local data


def _write_sites(root: Path) -> tuple[list[Path], Path]:
    """Three sites with their own disjoint digits shards (of different sizes) and a server
    folder holding only the test split; every folder has the same class names."""
    import numpy as np

    from fedlore.data.sources import load_digits

    src = load_digits()
    names = np.asarray(src.class_names)
    x, y = src.train.x.numpy(), src.train.y.numpy()
    sites = []
    order = np.random.default_rng(0).permutation(len(y))
    bounds = np.cumsum([0, 300, 400, 500])  # sizes 300, 400, 500 of the 1,437
    for i in range(N):
        keep = np.sort(order[bounds[i] : bounds[i + 1]])
        folder = root / f"site-{i}"
        folder.mkdir(parents=True)
        np.savez(folder / "train.npz", x=x[keep], y=y[keep], class_names=names)
        sites.append(folder)
    server = root / "server"
    server.mkdir()
    np.savez(server / "test.npz", x=src.test.x.numpy(), y=src.test.y.numpy(), class_names=names)
    return sites, server


def test_site_local_deployment_each_node_reads_only_its_own_folder(tmp_path: Path) -> None:
    from fedlore.config import load_config
    from fedlore.flower.sites import site_federation

    sites, server = _write_sites(tmp_path / "data")
    out_dir = tmp_path / "runs"
    overrides = [
        f"num_clients={N}",
        "rounds=3",  # final accuracy 0.64 (0.79 after 5 rounds), the same as in-process
        "local_steps=10",
        "progress=false",
        "flower.site_data=true",
        "data.name=npz",
        f"data.root={server}",
        "flower.round_timeout_s=60",
        f"output_dir={out_dir}",
        "model.kwargs.hidden=[32]",
    ]
    fed = LoopbackFederation(tmp_path / "fed", num_nodes=N, data_roots=sites)
    try:
        fed.start()
        config = ROOT / "experiments" / "quickstart.yaml"
        fed.submit(config, "fedfull", SEED, " ".join(overrides))
        summary = out_dir / "quickstart" / "fedfull" / f"seed-{SEED}" / "summary.json"
        deadline = time.monotonic() + 300
        while not summary.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert summary.exists(), "the deployed run did not finish; see " + str(fed.work)
    finally:
        fed.close()
    result = json.loads(summary.read_text())
    rows = _rows(summary.with_name("metrics.jsonl"))
    assert all(r["accepted"] == N and r["rejected"] == 0 for r in rows)
    assert result["final_accuracy"] > 0.5  # trained on the sites' data, scored on the server's
    # client i trained on exactly what its own folder holds (the sites differ in size)
    cfg = load_config(config, overrides)
    own = {str(i): int(site_federation(cfg, SEED, i, str(s)).client_sizes()[0])
           for i, s in enumerate(sites)}  # fmt: skip
    assert result["client_num_examples"] == own
    assert len(set(own.values())) == N
    # the server evaluated on its test set only: it never had a training split to read
    assert not (server / "train.npz").exists()


# ------------------------------------------------------- the script keeps the main job's runs


def test_deployment_script_leaves_the_main_job_alone(tmp_path: Path) -> None:
    """``scripts/flower_local_federation.sh`` in a copy of the project holding a finished
    ``runs/quickstart`` run: the deployment writes its own ``runs/flower_local`` and says so."""
    import shutil
    import socket
    import subprocess
    import sys

    proj = tmp_path / "proj"
    (proj / "scripts").mkdir(parents=True)
    (proj / "experiments").mkdir()
    shutil.copy(ROOT / "scripts" / "flower_local_federation.sh", proj / "scripts")
    shutil.copy(ROOT / "pyproject.toml", proj)
    shutil.copy(ROOT / "experiments" / "quickstart.yaml", proj / "experiments")
    main_job = proj / "runs" / "quickstart" / "fedlore" / f"seed-{SEED}"
    main_job.mkdir(parents=True)
    (main_job / "summary.json").write_text('{"rounds": 30, "final_accuracy": 0.9}')
    (main_job / "metrics.jsonl").write_text('{"round": 29}\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **__import__("os").environ,
        "BIN": str(Path(sys.executable).parent),
        "BASE_PORT": str(port),
        "METHOD": "fedavg",
    }
    res = subprocess.run(
        ["bash", str(proj / "scripts" / "flower_local_federation.sh"), "2", "rounds=1",
         "local_steps=2", "model.kwargs.hidden=[16]", "flower.wait_for_nodes_s=60"],
        env=env, cwd=proj, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads((main_job / "summary.json").read_text())["rounds"] == 30  # untouched
    assert (main_job / "metrics.jsonl").read_text() == '{"round": 29}\n'
    own = proj / "runs" / "flower_local" / "fedavg" / f"seed-{SEED}" / "summary.json"
    assert own.exists(), res.stdout[-3000:]
    assert json.loads(own.read_text())["rounds"] == 1
    assert f"results in {proj / 'runs'}/flower_local/fedavg/" in res.stdout

    def again(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(proj / "scripts" / "flower_local_federation.sh"), "2", "rounds=2",
             "local_steps=2", "model.kwargs.hidden=[16]", "flower.wait_for_nodes_s=60", *extra],
            env=env, cwd=proj, capture_output=True, text=True, timeout=400,
        )  # fmt: skip

    # another config under the same name: refused in the server's own words, and the script
    # fails instead of announcing results; --overwrite replaces the run
    refused = again()
    assert refused.returncode == 1
    assert "holds a finished run of another config (rounds: 1 -> 2)" in refused.stdout
    assert "the deployed run did not finish" in refused.stderr
    assert "results in" not in refused.stdout
    assert json.loads(own.read_text())["rounds"] == 1
    replaced = again("--overwrite")
    assert replaced.returncode == 0, replaced.stdout[-3000:] + replaced.stderr[-3000:]
    assert json.loads(own.read_text())["rounds"] == 2
