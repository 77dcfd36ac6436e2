"""A real loopback Flower deployment: 1 SuperLink + 3 SuperNodes, ``flwr run`` of fedlore.

One SuperNode is killed while the server is in a round: the round completes after
``flower.round_timeout_s`` with the replies that arrived, nothing of the dead client enters the
model, and when the node comes back (a fresh process, so its ``Context.state`` is empty) FedLore
resynchronizes it with the dense model and it trains again. A DP run audited with canaries
(``dp.audit``) reports the in-process run's audit. Every process started here is stopped by
PID.

Every message starts a ClientApp process (Flower's SuperNode runs each in a subprocess), so the
runs are as short as their assertions allow, and the digits come from the ``digits_npz``
fixture (the same federation, without importing scikit-learn in each of those processes).
"""

from __future__ import annotations

import json
import re
import time
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")

from fedlore.engine.sampling import sample_clients
from fedlore.flower.loopback import LoopbackFederation

pytestmark = [pytest.mark.flower, pytest.mark.xdist_group("deployment")]

ROOT = Path(__file__).resolve().parents[2]
N = 3
SEED = 42
ROUNDS = 4  # the victim is sampled in rounds 1 (dead), 2 (back) and 3 (synced) (seed 42)


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LoopbackFederation]:
    fed = LoopbackFederation(tmp_path / "fed", num_nodes=N)
    try:
        yield fed
    finally:
        fed.close()


def _deployed(
    work: Path,
    nodes: int,
    method: str,
    overrides: list[str],
    out_dir: Path,
    data_roots: list[Path] | None = None,
) -> Path:
    """``flwr run`` of METHOD (seed SEED) on ``experiments/quickstart.yaml`` with OVERRIDES, on a
    loopback federation of NODES SuperNodes in WORK (stopped after); the finished run's
    ``summary.json`` under OUT_DIR (the test fails if it is not written within 5 minutes)."""
    fed = LoopbackFederation(work, num_nodes=nodes, data_roots=data_roots)
    try:
        fed.start()
        fed.submit(ROOT / "experiments" / "quickstart.yaml", method, SEED, " ".join(overrides))
        summary = out_dir / "quickstart" / method / f"seed-{SEED}" / "summary.json"
        deadline = time.monotonic() + 300
        while not summary.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert summary.exists(), "the deployed run did not finish; see " + str(fed.work)
    finally:
        fed.close()
    return summary


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
    federation: LoopbackFederation, tmp_path: Path, digits_npz: list[str]
) -> None:
    out_dir = tmp_path / "runs"
    overrides = " ".join(
        [
            f"num_clients={N}",
            "participation=0.67",  # 2 of 3 clients per round
            f"rounds={ROUNDS}",
            "local_steps=3",
            "progress=false",
            # every exchange waits at most this long: the dead node's round all of it; a live
            # exchange (a ClientApp process per node) takes about 10 s on two idle cores and has
            # taken over 30 s on two cores busy with other tests
            "flower.round_timeout_s=45",
            "flower.wait_for_nodes_s=60",
            f"output_dir={out_dir}",
            "model.kwargs.hidden=[32]",
            *digits_npz,
        ]
    )
    # the victim: a client sampled in rounds 1 (killed once round 0 is recorded) and 2 (back:
    # restarted at once, it has registered while round 1 waited for the dead node), and in a
    # later round
    in_round = {r: sample_clients(N, 2, SEED, r) for r in range(ROUNDS)}
    victim = next(c for c in in_round[1] if c in in_round[2] and c in in_round[3])
    federation.start()
    config = ROOT / "experiments" / "quickstart.yaml"
    federation.submit(config, "fedlore", SEED, overrides)
    metrics = out_dir / "quickstart" / "fedlore" / f"seed-{SEED}" / "metrics.jsonl"
    summary = metrics.with_name("summary.json")
    deadline = time.monotonic() + 420
    killed = False
    while not summary.exists() and time.monotonic() < deadline:
        if not killed and 0 in {r["round"] for r in _rows(metrics)}:
            federation.kill_node(victim)  # round 1 is under way and waits for it
            federation.start_node(victim)  # a fresh SuperNode, a new node id, an empty state
            killed = True
        time.sleep(0.5)
    assert summary.exists(), "the deployed run did not finish; see " + str(federation.work)
    rows = {r["round"]: r for r in _rows(metrics)}
    faulty = rows[1]
    assert victim not in faulty["accepted_clients"]
    assert faulty["rejected"] == 1 and faulty["aggregated"] == faulty["accepted"] == 1
    # no reply within the round's timeout, or (on a loaded machine, when the SuperLink noticed
    # the dead node first) Flower's error reply for a message its node never took
    reasons = faulty["rejected_reasons"]
    assert [r.split(":")[0] for r in reasons] == [str(victim)], reasons
    # back and resynchronized: the victim's replies are accepted again in a later round
    later = [r for t, r in rows.items() if t >= 3 and victim in in_round[t]]
    assert later and all(victim in r["accepted_clients"] for r in later)
    # round 2 rejects no other client; the victim is back in it (its new SuperNode registered
    # while round 1 waited, and answers the server's query for the partition ids it lacks)
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
    # the bytes measured on the wire are in the summary as it is first written (one write)
    result = json.loads(summary.read_text())
    assert result["rounds"] == ROUNDS and result["final_accuracy"] > 0.1
    assert result["wire_bytes_up_total"] >= result["bytes_up_total"]


# ------------------------------------------------------------------ site-local data


SITES = 2  # sites of different sizes; each is a SuperNode, and each node a ClientApp per message


def _write_sites(root: Path) -> tuple[list[Path], Path]:
    """``SITES`` sites with their own disjoint digits shards (of different sizes) and a server
    folder holding only the test split; every folder has the same class names."""
    import numpy as np

    from fedlore.data.sources import load_digits

    src = load_digits()
    names = np.asarray(src.class_names)
    x, y = src.train.x.numpy(), src.train.y.numpy()
    sites = []
    order = np.random.default_rng(0).permutation(len(y))
    bounds = np.cumsum([0, 300, 400, 500])  # sizes 300, 400, 500 of the 1,437
    for i in range(SITES):
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
        f"num_clients={SITES}",
        # one round of 60 steps: final accuracy about 0.8 (in process, 2 iid clients of
        # digits: 0.81) where an untrained model scores 0.1; a round costs a ClientApp
        # process per node
        "rounds=1",
        "local_steps=60",
        "progress=false",
        "flower.site_data=true",
        "data.name=npz",
        f"data.root={server}",
        "flower.round_timeout_s=60",
        f"output_dir={out_dir}",
        "model.kwargs.hidden=[32]",
    ]
    config = ROOT / "experiments" / "quickstart.yaml"
    summary = _deployed(tmp_path / "fed", SITES, "fedfull", overrides, out_dir, data_roots=sites)
    result = json.loads(summary.read_text())
    rows = _rows(summary.with_name("metrics.jsonl"))
    assert all(r["accepted"] == SITES and r["rejected"] == 0 for r in rows)
    assert result["final_accuracy"] > 0.5  # trained on the sites' data, scored on the server's
    # client i trained on exactly what its own folder holds (the sites differ in size)
    cfg = load_config(config, overrides)
    own = {str(i): int(site_federation(cfg, SEED, i, str(s)).client_sizes()[0])
           for i, s in enumerate(sites)}  # fmt: skip
    assert result["client_num_examples"] == own
    assert len(set(own.values())) == SITES
    # the server evaluated on its test set only: it never had a training split to read
    assert not (server / "train.npz").exists()


# ------------------------------------------------------- the script keeps the main job's runs


def test_deployment_script_leaves_the_main_job_alone(tmp_path: Path, digits_npz: list[str]) -> None:
    """``scripts/flower_local_federation.sh`` in a copy of the project holding a finished
    ``runs/quickstart`` run and a finished ``runs/flower_local`` run of another config: the
    script refuses to replace the latter unasked (in the server's own words, failing instead of
    announcing results), replaces it with ``--overwrite``, leaves the main job alone and says
    where its results are. Each deployment costs a SuperLink, SuperNodes and a ClientApp
    process per message, so the other config's run is made here, in process, and the runs
    are one round long."""
    import shutil
    import socket
    import subprocess
    import sys

    from fedlore.config import load_config
    from fedlore.experiment import run_one

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
    common = ["rounds=1", "model.kwargs.hidden=[16]", "flower.wait_for_nodes_s=60", *digits_npz]
    # what the script runs with local_steps=2 (its own overrides first), finished
    other = load_config(
        proj / "experiments" / "quickstart.yaml",
        ["num_clients=2", "progress=false", "name=flower_local",
         f"output_dir={proj.resolve() / 'runs'}", "local_steps=2", *common],
    )  # fmt: skip
    assert run_one(other, "fedavg", SEED) is not None
    own = proj / "runs" / "flower_local" / "fedavg" / f"seed-{SEED}" / "summary.json"

    def script(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(proj / "scripts" / "flower_local_federation.sh"), "2", *common,
             "local_steps=3", *extra],
            env=env, cwd=proj, capture_output=True, text=True, timeout=400,
        )  # fmt: skip

    def steps() -> int:
        return int(json.loads(own.with_name("config.json").read_text())["local_steps"])

    # another config under the same name: refused in the server's own words, and the script
    # fails instead of announcing results; --overwrite replaces the run
    assert steps() == 2
    refused = script()
    assert refused.returncode == 1
    assert "holds a finished run of another config (local_steps: 2 -> 3)" in refused.stdout
    assert "the deployed run did not finish" in refused.stderr
    assert "results in" not in refused.stdout
    assert steps() == 2

    def work(out: str) -> Path:  # the SuperLink's folder (its state and the logs)
        found = re.search(r"\(logs in (\S+), removed once the run has finished\)", out)
        assert found, out[:2000]
        return Path(found.group(1).rstrip(","))

    kept = work(refused.stdout)
    assert (kept / "superlink.log").is_file()  # a failed run keeps its logs
    shutil.rmtree(kept)
    replaced = script("--overwrite")
    assert replaced.returncode == 0, replaced.stdout[-3000:] + replaced.stderr[-3000:]
    assert not work(replaced.stdout).exists()  # a finished one leaves nothing in /tmp
    assert steps() == 3 and json.loads(own.read_text())["rounds"] == 1
    assert f"results in {proj / 'runs'}/flower_local/fedavg/" in replaced.stdout
    # the main job's run is untouched
    assert json.loads((main_job / "summary.json").read_text())["rounds"] == 30
    assert (main_job / "metrics.jsonl").read_text() == '{"round": 29}\n'


# ------------------------------------------------------------------ the canary audit


def test_a_deployed_audit_reports_what_the_in_process_audit_reports(
    tmp_path: Path, digits_npz: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The canary audit (``dp.audit``) under ``flwr run``: the ServerApp process adds the
    canaries to the noised sum (:meth:`~fedlore.privacy.aggregation.Privacy.combine`) and
    writes the estimate into the summary, as in process. The canaries' directions come from an
    AES key of OS entropy (two in-process runs differ as much), so the in-process twin runs
    with the key the deployed run kept in its checkpoint; every client takes part, so every
    canary is inserted on both sides (no canary sample to differ), and
    ``dp.reproducible_noise`` draws the same DP noise. Then the summary's DP and audit entries
    are the same keys with the same values (the estimates to 1e-5, relative: the deployed
    clients' float32 training is the in-process one's). One round of two SuperNodes (a
    ClientApp process each): what the server does across rounds is the same process's code
    on every engine."""
    from fedlore.config import load_config
    from fedlore.engine.callbacks import Checkpointer
    from fedlore.experiment import run_one
    from fedlore.privacy import canaries

    nodes = 2
    common = [
        f"num_clients={nodes}",
        "rounds=1",
        "local_steps=2",
        "progress=false",
        "weighting=uniform",
        "dp.clip_norm=0.5",
        "dp.noise_multiplier=0.3",
        "dp.reproducible_noise=true",  # the same noise on both sides (no privacy)
        "dp.audit.canaries=8",
        "dp.audit.unseen=8",
        "model.kwargs.hidden=[16]",
        *digits_npz,
    ]
    out_dir = tmp_path / "runs"
    deploy = [*common, "flower.round_timeout_s=60", "flower.wait_for_nodes_s=60"]
    config = ROOT / "experiments" / "quickstart.yaml"
    summary = _deployed(
        tmp_path / "fed", nodes, "fedavg", [*deploy, f"output_dir={out_dir}"], out_dir
    )
    deployed = json.loads(summary.read_text())
    _, state, _ = Checkpointer.load(summary.with_name("checkpoint.pt"))
    key = bytes.fromhex(str(state.values[canaries.KEY]))
    monkeypatch.setattr(canaries, "os", types.SimpleNamespace(urandom=lambda n: key[:n]))
    local = load_config(config, [*common, f"output_dir={tmp_path / 'local'}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seeded noise: no privacy; few canaries
        here = run_one(local, "fedavg", SEED)
    assert here is not None
    want = {k: v for k, v in here.items() if k.startswith("dp_")}
    got = {k: v for k, v in deployed.items() if k.startswith("dp_")}
    assert got.keys() == want.keys()
    assert "dp_audit_epsilon" in want and "dp_audit_epsilon_all_iterates" in want
    assert want["dp_audit_canaries_per_round"] == 8 and want["dp_audit_dimension"] > 1000
    for k, v in want.items():
        if isinstance(v, float):
            assert got[k] == pytest.approx(v, rel=1e-5), k
        else:
            assert got[k] == v, k
