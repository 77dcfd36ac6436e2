"""``benchmarks/gpu_check.sh`` works before a GPU is at hand: its Python part, dry run (the
smallest shapes on the CPU), writes both reports with every table filled."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FORTUNES = ROOT / "tests" / "fixtures" / "fortunes"


def test_gpu_check_dry_run_writes_its_tables(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "gpu_tables", ROOT / "benchmarks" / "gpu_tables.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    corpus = tmp_path / "fortunes"  # a copy: the quality runs write nothing beside the fixture
    shutil.copytree(FORTUNES, corpus)
    out = tmp_path / "out"
    rc = mod.main(["--dry-run", "--skip-tests", "--out", str(out), "--fortunes", str(corpus)])
    assert rc == 0
    result = json.loads((out / "gpu_check.json").read_text())
    shapes = {r["shape"] for r in result["costs"]}
    assert shapes == {"LLaMA-micro", "ViT-tiny"}
    for r in result["costs"]:
        assert r["s_per_round"] > 0 and r["bytes_up_per_client"] > 0
        assert r["peak_memory_bytes"] is None  # the CPU measures none
    fedfull = [r for r in result["costs"] if r["method"] == "fedfull"]
    assert all(r["ratio_vs_fedfull"] == pytest.approx(1.0) for r in fedfull)
    lore = next(r for r in result["costs"] if r["method"] == "fedlore")
    full = next(
        r for r in result["costs"] if r["method"] == "fedfull" and r["shape"] == lore["shape"]
    )
    assert lore["bytes_up_per_client"] < full["bytes_up_per_client"]  # low-rank uploads
    quality = result["quality"]["methods"]
    assert set(quality) == {"fedlore", "fedfull"}
    assert all(v["val_perplexity"] is not None for v in quality.values())
    md = (out / "gpu_check.md").read_text()
    assert "| LLaMA-micro | fedlore |" in md and "Quality check" in md
