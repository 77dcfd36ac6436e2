"""GPU checks (issue 17), marked ``gpu``: skipped without CUDA ("needs CUDA"), run by
``benchmarks/gpu_check.sh`` on a GPU (``pytest -m gpu tests/gpu``).

* A few rounds on the GPU equal the CPU run within float tolerance, method by method: the same
  seeded generators draw the partition, the client sampling, the minibatches and (BNNs) the
  weight samples on every device, so only float rounding differs.
* bf16 autocast trains on the GPU.
* A checkpoint written on the GPU resumes on the CPU and back, and reaches what an uninterrupted
  run reaches.
* Each client's peak device memory is measured.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fedlore.config import Config, load_config
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

EQUAL_METHODS = [
    "fedlore", "fedfull", "local_galore", "fedit", "meta_bayfl", "ditto", "apfl", "perfedavg",
]  # fmt: skip


def _cfg(out: Path, device: str, *extra: str) -> Config:
    return load_config(
        None,
        [
            "name=gpu",
            "num_clients=3",
            "rounds=3",
            "local_steps=3",
            "batch_size=16",
            "lr=3e-3",
            "rank=4",
            "model.kwargs={hidden: [32]}",
            "partition.min_size=10",
            "eval.mc_samples=4",
            "progress=false",
            f"output_dir={out}",
            f"device={device}",
            *extra,
        ],
    )


def _rows(cfg: Config, method: str, seed: int) -> list[dict]:
    path = run_dir(cfg, method, seed) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def _close(a: float | None, b: float | None, tol: float) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


@pytest.mark.parametrize("method", EQUAL_METHODS)
def test_a_gpu_run_equals_the_cpu_run(method: str, tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 with fp32
    torch.backends.cudnn.allow_tf32 = False
    cpu = _cfg(tmp_path / "cpu", "cpu")
    gpu = _cfg(tmp_path / "gpu", "cuda")
    a, b = run_one(cpu, method, 0), run_one(gpu, method, 0)
    assert a is not None and b is not None
    for ra, rb in zip(_rows(cpu, method, 0), _rows(gpu, method, 0), strict=True):
        assert ra["round"] == rb["round"]
        assert ra["bytes_up"] == rb["bytes_up"] and ra["bytes_down"] == rb["bytes_down"]
        assert ra["accepted"] == rb["accepted"]
        for key in ("train_loss", "loss", "accuracy"):
            assert _close(ra.get(key), rb.get(key), 2e-3), (method, ra["round"], key, ra, rb)
        if "lr_chosen" in ra:  # the meta search picks the same rates
            assert ra["lr_chosen"] == rb["lr_chosen"]
    assert b["peak_memory_bytes"] > 0 and "peak_memory_bytes" not in a
    assert json.loads((run_dir(gpu, method, 0) / "config.json").read_text())["ran_on"] == "cuda:0"


@pytest.mark.parametrize("method", ["fedlore", "fedfull", "fedit"])
def test_bf16_trains_on_the_gpu(method: str, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "cuda", "precision=bf16", "rounds=5", "local_steps=5", "lr=3e-2")
    summary = run_one(cfg, method, 0)
    assert summary is not None and summary["rejected_total"] == 0
    assert summary["final_accuracy"] > 0.3  # digits: chance is 0.1
    assert summary["skipped_steps_total"] == 0


def test_a_checkpoint_written_on_the_gpu_resumes_on_the_cpu_and_back(tmp_path: Path) -> None:
    method = "fedlore"
    whole = _cfg(tmp_path / "whole", "cpu", "rounds=4")
    expect = run_one(whole, method, 0)
    assert expect is not None
    parts = tmp_path / "parts"
    assert run_one(_cfg(parts, "cuda", "rounds=4"), method, 0, stop_after=0) is None
    assert run_one(_cfg(parts, "cpu", "rounds=4"), method, 0, resume=True, stop_after=1) is None
    got = run_one(_cfg(parts, "cuda", "rounds=4"), method, 0, resume=True)
    assert got is not None
    assert got["rounds"] == expect["rounds"]
    assert _close(got["final_accuracy"], expect["final_accuracy"], 2e-3)
    assert _close(got["final_loss"], expect["final_loss"], 2e-3)
    assert got["bytes_up_total"] == expect["bytes_up_total"]
