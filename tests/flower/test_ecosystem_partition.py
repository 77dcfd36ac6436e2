"""The same config and seed give the same clients in process and on the Flower engines for the
data of the ecosystem: an ``hf`` dataset split by flwr-datasets' partitioners (by label and by
natural id) and a LEAF folder split by its users. Each Flower client builds its data in the
ClientApp (:func:`fedlore.flower.app.client_data`, from the config's JSON, as a simulated node
or a SuperNode does); here it does so in this process and in another Python process with its own
hash seed (as a Ray actor or SuperNode runs), and every client's tensors must equal the
in-process federation's (:func:`fedlore.data.federation.build_federation`)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
pytest.importorskip("flwr_datasets", reason="needs the [hf] extra: pip install -e '.[hf]'")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
import torch
from ecosystem_data import femnist_users, write_hf_digits, write_leaf
from flwr.app import Context, RecordDict

from fedlore.config import Config, load_config
from fedlore.data.client_data import ClientData
from fedlore.data.federation import build_federation
from fedlore.flower.app import client_data
from fedlore.types import Broadcast

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[2]
SEED = 3


def overrides(data: Path) -> dict[str, list[str]]:
    hf = ["data.name=hf", f"data.root={data / 'hf'}", "data.id_column=writer"]
    return {
        "hf-shards": [
            *hf,
            "partition.name=flwr:ShardPartitioner",
            "partition.kwargs={num_shards_per_partition: 2, shard_size: 20}",
            "num_clients=4",
        ],
        "hf-dirichlet": [
            *hf,
            "partition.name=flwr:DirichletPartitioner",
            "partition.kwargs={alpha: 0.5, min_partition_size: 10}",
            "num_clients=4",
        ],
        "hf-writers": [
            *hf,
            "partition.name=flwr:NaturalIdPartitioner",
            "partition.kwargs={partition_by: id}",
            "num_clients=5",
        ],
        "leaf-users": [
            "data.name=leaf",
            f"data.root={data / 'leaf'}",
            "partition.name=natural",
            "num_clients=4",
        ],
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ecosystem")
    write_hf_digits(folder / "hf", n_train=160, n_test=40, writers=5)
    write_leaf(folder / "leaf", femnist_users(num_users=4, n_train=10, n_test=3))
    return folder


def node_clients(cfg: Config, seed: int) -> list[ClientData]:
    """Every client's data as its ClientApp builds them (``partition-id`` = client id)."""
    out = []
    for c in range(cfg.num_clients):
        ctx = Context(
            run_id=1, node_id=c + 1, node_config={"partition-id": c}, state=RecordDict(),
            run_config={},
        )  # fmt: skip
        out.append(client_data(cfg, ctx, seed, torch.device("cpu"), Broadcast())[1])
    return out


def digest(clients: list[ClientData]) -> str:
    h = hashlib.sha1()
    for c in clients:
        for t in (c.train.x, c.train.y, c.test.x, c.test.y):
            h.update(t.contiguous().numpy().tobytes() + b"|")
    return h.hexdigest()


@pytest.mark.parametrize("case", ["hf-shards", "hf-dirichlet", "hf-writers", "leaf-users"])
def test_the_client_app_builds_the_in_process_clients(case: str, data: Path) -> None:
    cfg = load_config(None, overrides(data)[case])
    fed = build_federation(cfg, SEED)
    nodes = node_clients(cfg, SEED)
    assert len(nodes) == fed.num_clients == cfg.num_clients
    for c, node in enumerate(nodes):
        here = fed.client(c)
        assert node.client_id == c and len(node.train) > 0
        for a, b in ((here.train, node.train), (here.test, node.test)):
            assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)


def test_another_process_builds_the_same_clients(data: Path) -> None:
    """A Ray actor or a SuperNode is another process (another hash seed): the same clients."""
    cases = overrides(data)
    here = {
        case: digest(node_clients(load_config(None, over), SEED)) for case, over in cases.items()
    }
    script = (
        "import json, sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_ecosystem_partition import digest, node_clients\n"
        "from fedlore.config import load_config\n"
        "cases = json.loads(sys.argv[1])\n"
        f"print(json.dumps({{c: digest(node_clients(load_config(None, o), {SEED})) "
        "for c, o in cases.items()}))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=env,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here
