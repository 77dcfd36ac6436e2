"""Devices and precision on the CPU (issue 17): the settings, bfloat16 autocast of local training
with fp32 masters, device-independent checkpoints, no whole-model copy per local step, and the
Flower simulation's client resources. The CUDA side is in ``tests/gpu`` (run by
``benchmarks/gpu_check.sh`` on a GPU)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fedlore import device as device_keys
from fedlore.checks import setup_rounds
from fedlore.config import Config, ConfigError, load_config
from fedlore.data.client_data import ClientData, TensorSplit, minibatches
from fedlore.device import PeakMemory, autocast, resolve_device, training_precision
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.results import store as store_keys
from fedlore.seeding import generator
from fedlore.train.local import local_train

NO_CUDA = not torch.cuda.is_available()


def test_device_setting_is_validated() -> None:
    for ok in ("auto", "cpu", "cuda", "cuda:1"):
        assert load_config(None, [f"device={ok}"]).device == ok
    for bad in ("gpu", "cuda:", "cuda:x", "tpu"):
        with pytest.raises(ConfigError, match="device"):
            load_config(None, [f"device={bad}"])


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-only machine")
def test_auto_is_the_cpu_and_cuda_without_cuda_is_a_clear_error() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match="no CUDA device is available"):
            resolve_device(name)
    cfg = load_config(None, ["device=cuda", "rounds=1", "progress=false"])
    with pytest.raises(ConfigError, match="device=cuda"):
        run_one(cfg, "fedfull", 0)


def test_a_device_that_is_not_there_is_refused_before_any_folder_but_not_for_a_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fedlore run ... device=<no such device>`` built the data, refused, and left an empty
    experiment folder; ``--dry-run`` said it would train (exit 0). Both now refuse in one line
    naming the device (exit 2) and make no folder; an experiment whose runs are all finished
    is still reported (a report needs no device). ``cuda:99`` is missing on any machine."""
    from fedlore.cli import main

    base = ["run", "rounds=1", "algorithms=[fedfull]", "seeds=[0]", "progress=false"]
    base += ["model.name=mlp", f"output_dir={tmp_path}"]
    for dry in (["--dry-run"], []):
        assert main([*base, "name=new", "device=cuda:99", *dry]) == 2
        err = capsys.readouterr().err
        assert "device=cuda:99" in err and "Traceback" not in err
        assert not (tmp_path / "new").exists()
    assert main([*base, "name=done", "device=cpu"]) == 0
    capsys.readouterr()
    for dry in (["--dry-run"], []):
        assert main([*base, "name=done", "device=cuda:99", *dry]) == 0
        assert "fedfull" in capsys.readouterr().out


SEEN: list[torch.dtype] = []
"""The dtypes of Probe's hidden activations in training (module level: methods may train a deep
copy of the model they are given)."""


class Probe(nn.Module):
    """Records the dtype of its hidden activations (what autocast computes in)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.training:
            SEEN.append(h.dtype)
        return self.head(torch.relu(h))


def _data(n: int = 48) -> ClientData:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)
    return ClientData(0, TensorSplit(x, y), TensorSplit(x[:8], y[:8]))


def test_bf16_autocasts_the_forward_and_keeps_fp32_masters() -> None:
    model = Probe()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = _data()
    SEEN.clear()
    with training_precision("bf16"):
        stats = local_train(
            model, minibatches(data.train, 16, 3, torch.Generator()), opt, [1e-2] * 3
        )
    assert [torch.bfloat16] * 3 == SEEN and stats.skipped_steps == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.ndim)  # fmt: skip
    # outside the context, full precision again
    SEEN.clear()
    local_train(model, minibatches(data.train, 16, 1, torch.Generator()), opt, [1e-2])
    assert [torch.float32] == SEEN
    with training_precision("bf16"), autocast(torch.device("cpu")):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


@pytest.mark.parametrize("method", ["fedlore", "fedfull", "fedit", "bayfl", "apfl", "perfedavg"])
def test_bf16_replies_bases_and_coordinates_stay_fp32(method: str) -> None:
    cfg = load_config(None, ["local_steps=3", "rank=4", "batch_size=16", "precision=bf16"])
    algo = make_algorithm(method, cfg)
    model = Probe()
    state = algo.init_server(model, generator(0, 2))
    data = _data()
    client_state = None
    SEEN.clear()
    with training_precision("bf16"):
        if setup_rounds(algo):
            rep, client_state = algo.client_update(
                algo.broadcast(state, -1, 0), None, Probe(), data, generator(1)
            )
            state, _ = algo.aggregate(state, [(0, rep)], -1)
        work = Probe()
        reply, new = algo.client_update(algo.broadcast(state, 0, 0), client_state, work, data,
                                        generator(2))  # fmt: skip
    assert SEEN and all(d == torch.bfloat16 for d in SEEN)
    floats = [v for v in {**reply.arrays, **new.arrays, **state.arrays}.values()
              if v.is_floating_point()]  # fmt: skip
    assert floats and all(v.dtype == torch.float32 for v in floats)


def _three_clients(tmp_path: Path, rounds: int, local_steps: int) -> Config:
    """The default config cut to 3 clients at rank 4, writing under ``tmp_path``."""
    return load_config(
        None,
        [f"rounds={rounds}", "num_clients=3", f"local_steps={local_steps}", "rank=4",
         "partition.min_size=10", f"output_dir={tmp_path}", "progress=false"],
    )  # fmt: skip


def test_checkpoints_hold_cpu_tensors_and_load_onto_the_asked_device(tmp_path: Path) -> None:
    cfg = _three_clients(tmp_path, rounds=3, local_steps=2)
    assert run_one(cfg, "fedlore", 0, stop_after=1) is None
    path = run_dir(cfg, "fedlore", 0) / "checkpoint.pt"
    raw = torch.load(path, weights_only=True)  # no map_location: what the file holds
    tensors = [*raw["server"]["arrays"].values()]
    for entry in raw["clients"].values():
        tensors += list(entry.get("arrays", {}).values())
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    # map_location puts every tensor where the run computes (here the meta device stands in)
    _, server, store = Checkpointer.load(path, device="meta")
    assert all(t.device.type == "meta" for t in server.arrays.values())
    cid = store.client_ids()[0]
    client = store.get(cid)
    assert client is not None and all(t.device.type == "meta" for t in client.arrays.values())
    recorded = json.loads((run_dir(cfg, "fedlore", 0) / "config.json").read_text())
    assert recorded["ran_on"] == "cpu" and "device" not in recorded


def test_a_run_records_its_platform_and_resumes_on_another(tmp_path: Path) -> None:
    """``config.json`` records the torch and NumPy versions and torch's CPU kernels (floats
    depend on them); a run recorded on another platform still resumes (a record, not a
    setting), and reading results knows the keys as records."""
    cfg = _three_clients(tmp_path, rounds=2, local_steps=1)
    assert run_one(cfg, "fedfull", 0, stop_after=0) is None
    path = run_dir(cfg, "fedfull", 0) / "config.json"
    recorded = json.loads(path.read_text())
    assert recorded["ran_torch"] == torch.__version__
    assert recorded["ran_cpu"] == torch.backends.cpu.get_cpu_capability()
    assert recorded["ran_numpy"] == np.__version__ and "ran_gpu" not in recorded
    from fedlore import __version__

    assert recorded["ran_fedlore"].startswith(__version__)  # and the git commit in a checkout
    if (Path(device_keys.__file__).parents[2] / ".git").exists():
        assert re.search(r" \(git [0-9a-f]{12}(, modified)?\)$", recorded["ran_fedlore"])
    path.write_text(
        json.dumps({**recorded, "ran_cpu": "AVX2", "ran_torch": "0.0", "ran_fedlore": "0.0.1"})
    )
    summary = run_one(cfg, "fedfull", 0, resume=True)
    assert summary is not None and summary["rounds"] == 2
    assert json.loads(path.read_text())["ran_cpu"] == recorded["ran_cpu"]  # this part's platform
    assert store_keys.PLATFORM_KEYS == device_keys.PLATFORM_KEYS
    assert set(device_keys.PLATFORM_KEYS) <= set(store_keys.RECORD_KEYS)


def test_data_follow_the_federation_to_its_device() -> None:
    """Federation.to moves the tensors once; clients' splits and minibatches are slices made
    there, from CPU-generator draws (the meta device stands in for a GPU)."""
    from fedlore.data.federation import build_federation

    fed = build_federation(load_config(None, ["num_clients=3", "data.selection_fraction=0.1"]), 0)
    meta = fed.to("meta")
    assert meta.device.type == "meta" and meta.to("meta") is meta
    assert meta.selection is not None and meta.selection.x.device.type == "meta"
    client = meta.client(1)
    assert client.train.x.device.type == "meta"
    x, _ = next(iter(minibatches(client.train, 8, 1, torch.Generator().manual_seed(0))))
    assert x.device.type == "meta" and x.shape == (8, *fed.input_shape)


class CopyCounter(TorchDispatchMode):
    """Counts copies (clone, copy_, device/dtype conversions) of tensors of at least ``size``
    elements."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default,
                    torch.ops.aten._to_copy.default):  # fmt: skip
            t = args[0] if func is torch.ops.aten.copy_.default else out
            if isinstance(t, torch.Tensor) and t.numel() >= self.size:
                self.copies += 1
        return out


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(256, 256)
        self.head = nn.Linear(256, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


@pytest.mark.parametrize("method", ["fedfull", "fedlore", "local_galore", "fedit", "bayfl",
                                    "ditto", "fedlore_random", "apfl", "perfedavg"])  # fmt: skip
def test_no_whole_model_copy_per_local_step(method: str) -> None:
    """Copies of the 256 x 256 weight in one client update do not grow with the number of local
    steps: per client and round only loading the broadcast and forming the reply copy it."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 3, (64,), generator=g)
    data = ClientData(0, TensorSplit(x, y), TensorSplit(x[:8], y[:8]))
    counts = {}
    for k in (2, 6):
        algo = make_algorithm(method, load_config(None, [f"local_steps={k}", "rank=8"]))
        torch.manual_seed(0)
        state = algo.init_server(Wide(), generator(0, 2))
        client_state = None
        if setup_rounds(algo):
            rep, client_state = algo.client_update(
                algo.broadcast(state, -1, 0), None, Wide(), data, generator(1)
            )
            state, _ = algo.aggregate(state, [(0, rep)], -1)
        msg, work = algo.broadcast(state, 0, 0), Wide()
        with CopyCounter(256 * 256 // 2) as counter:
            algo.client_update(msg, client_state, work, data, generator(2))
        counts[k] = counter.copies
    assert counts[6] == counts[2] <= 6, counts  # a BNN has two weight-size tensors (mu, rho)


def test_peak_memory_is_measured_on_cuda_only(tmp_path: Path) -> None:
    with PeakMemory(torch.device("cpu")) as peak:
        torch.ones(1000)
    assert peak.bytes is None
    cfg = load_config(None, ["rounds=1", "num_clients=2", "local_steps=1", f"output_dir={tmp_path}",
                             "progress=false", "partition.min_size=5"])  # fmt: skip
    summary = run_one(cfg, "fedfull", 0)
    assert summary is not None and "peak_memory_bytes" not in summary


def test_flower_simulation_client_resources() -> None:
    pytest.importorskip("flwr")
    from fedlore.flower.simulation import backend_config

    cfg = load_config(None, ["flower.client_cpus=2", "flower.num_cpus=4"])
    bc = backend_config(cfg)
    assert bc["client_resources"] == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert bc["init_args"]["num_cpus"] == 4
    if NO_CUDA:
        with pytest.raises(ConfigError, match="client_gpus"):
            backend_config(load_config(None, ["flower.client_gpus=0.25"]))
