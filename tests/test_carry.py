"""``experiments/carry.py``: an unfinished run packed on one machine and unpacked on a fresh one
resumes to the result of an uninterrupted run; finished runs and runs further along are kept."""

from __future__ import annotations

import importlib.util
import json
import shutil
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from fedlore.config import Config, load_config
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one

ROOT = Path(__file__).resolve().parents[1]


def _carry() -> ModuleType:
    spec = importlib.util.spec_from_file_location("carry", ROOT / "experiments" / "carry.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


carry = _carry()


def _cfg(out: Path) -> Config:
    return load_config(
        None,
        [
            "name=carry",
            "num_clients=3",
            "rounds=4",
            "local_steps=2",
            "batch_size=16",
            "rank=4",
            "model.kwargs={hidden: [16]}",
            "partition.min_size=10",
            "progress=false",
            f"output_dir={out}",
        ],
    )


def _untimed(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not (k.endswith("_s") or "_s_" in k)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return _untimed(a) == _untimed(b)


def test_a_packed_run_resumes_elsewhere_to_the_uninterrupted_result(tmp_path: Path) -> None:
    want = run_one(_cfg(tmp_path / "reference"), "fedlore", 1)
    assert want is not None

    here = _cfg(tmp_path / "here")
    assert run_one(here, "fedlore", 1, stop_after=2) is None  # killed after round 2
    assert run_one(here, "fedavg", 1) is not None  # finished: never packed
    root = Path(here.output_dir)
    assert carry.pack(root) == 1
    archive = root / carry.ARCHIVE

    # a fresh clone: the committed archive and nothing else of the unfinished run
    there = tmp_path / "there"
    there.mkdir()
    shutil.copy(archive, there / carry.ARCHIVE)
    assert carry.unpack(there) == 1
    assert carry.unpack(there) == 0  # a second unpack keeps what is there
    cfg = _cfg(there)
    folder = run_dir(cfg, "fedlore", 1)
    assert json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])["round"] == 2
    got = run_one(cfg, "fedlore", 1, resume=True)
    assert got is not None and _same(got, want)
    assert not (run_dir(cfg, "fedavg", 1)).exists()

    # unpacking onto the finished run leaves it byte for byte
    summary = (folder / "summary.json").read_bytes()
    metrics = (folder / "metrics.jsonl").read_bytes()
    assert carry.unpack(there) == 0
    assert (folder / "summary.json").read_bytes() == summary
    assert (folder / "metrics.jsonl").read_bytes() == metrics

    # once every run has finished, pack removes the stale archive
    assert run_one(here, "fedlore", 1, resume=True) is not None
    assert carry.pack(root) == 0 and not archive.exists()


def test_a_folder_without_checkpoint_is_restored_and_a_bad_archive_refused(tmp_path: Path) -> None:
    run = tmp_path / "t" / "m" / "seed-0"
    run.mkdir(parents=True)
    for name, text in (("config.json", "{}"), ("metrics.jsonl", '{"round": 1}\n')):
        (run / name).write_text(text)
    (run / "checkpoint.pt").write_bytes(b"ckpt")
    assert carry.pack(tmp_path) == 1
    (run / "checkpoint.pt").unlink()
    (run / "metrics.jsonl").write_text("")  # a fresh start left by a clone without checkpoint
    assert carry.unpack(tmp_path) == 1
    assert (run / "checkpoint.pt").read_bytes() == b"ckpt"
    assert (run / "metrics.jsonl").read_text() == '{"round": 1}\n'

    with tarfile.open(tmp_path / carry.ARCHIVE, "w:gz") as tar:
        tar.add(run / "config.json", arcname="../escape/config.json")
    with pytest.raises(SystemExit, match=r"refusing member '\.\./escape/config\.json'"):
        carry.unpack(tmp_path)
    assert not (tmp_path.parent / "escape").exists()
