"""What a run leaves in its folder, and what a re-run or resume may trust.

* ``--overwrite`` trains beside a finished run, which stays whole until the new one has finished
  (an interrupted replacement resumes; tests/reliability/test_reruns.py has the rest);
* ``--resume`` refuses a config that differs from the one that started the run (``config.json``);
* a missing spill file stops the run with an error naming it, instead of dropping the client
  round after round; a spill directory that is a file is refused up front; a finished run's
  spill files are removed, and two runs never share a spill folder;
* text data with a float-input model (and the reverse) is refused before any work.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedlore.config import Config, ConfigError, load_config
from fedlore.engine.rundir import run_dir, spill_dir
from fedlore.engine.store import StoreError
from fedlore.experiment import run_one

SEED = 1
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(
        None,
        [
            "name=folder",
            "num_clients=4",
            "rounds=3",
            "local_steps=2",
            "batch_size=16",
            "rank=4",
            "model.kwargs={hidden: [32]}",
            "partition.min_size=10",
            "progress=false",
            f"output_dir={out}",
            *extra,
        ],
    )


def test_an_interrupted_replacement_leaves_the_finished_run_whole(tmp_path: Path) -> None:
    old = _cfg(tmp_path)
    run_one(old, "fedlore", SEED)
    out = run_dir(old, "fedlore", SEED)
    finished = (out / "summary.json").read_bytes()
    new = _cfg(tmp_path, "rounds=5", "lr=0.01")
    assert run_one(new, "fedlore", SEED, stop_after=1, overwrite=True) is None  # interrupted
    assert (out / "summary.json").read_bytes() == finished  # replaced only once finished
    summary = run_one(new, "fedlore", SEED, resume=True)
    assert summary is not None and summary["rounds"] == 5


def test_resume_refuses_a_changed_config(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    run_one(cfg, "fedlore", SEED, stop_after=0)
    with pytest.raises(ConfigError, match=r"lr: 0\.001 -> 0\.5"):
        run_one(_cfg(tmp_path, "lr=0.5"), "fedlore", SEED, resume=True)
    # settings that do not change results may differ (progress, other methods' sections)
    same = _cfg(tmp_path, "progress=true", "method.fedfull.lr=0.2")
    assert run_one(same, "fedlore", SEED, resume=True) is not None
    with pytest.raises(ConfigError, match="rounds"):  # also once finished
        run_one(_cfg(tmp_path, "rounds=6"), "fedlore", SEED, resume=True)


def test_missing_spill_file_stops_the_run_naming_it(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "store.max_memory_mb=0.0001", "rounds=4")
    run_one(cfg, "fedlore", SEED, stop_after=1)
    spill = spill_dir(cfg, "fedlore", SEED)
    assert any(spill.iterdir())
    shutil.rmtree(spill)
    with pytest.raises(StoreError, match=r"client_states/\d+\.\d+\.pt"):
        run_one(cfg, "fedlore", SEED, resume=True)


def test_finished_run_removes_its_spill_files(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "store.max_memory_mb=0.0001")
    run_one(cfg, "fedlore", SEED)
    assert not spill_dir(cfg, "fedlore", SEED).exists()
    rows = (run_dir(cfg, "fedlore", SEED) / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(r)["rejected"] == 0 for r in rows)


def test_spill_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    cfg = _cfg(tmp_path, "store.max_memory_mb=0.0001", f"store.spill_dir={target}")
    with pytest.raises(ValueError, match="cannot use spill_dir"):
        run_one(cfg, "fedlore", SEED)


def test_runs_in_different_output_dirs_never_share_a_spill_folder(tmp_path: Path) -> None:
    shared = tmp_path / "spill"
    a = _cfg(tmp_path / "a", f"store.spill_dir={shared}")
    b = _cfg(tmp_path / "b", f"store.spill_dir={shared}")
    assert spill_dir(a, "fedlore", SEED) != spill_dir(b, "fedlore", SEED)
    assert spill_dir(a, "fedlore", SEED).parent == shared


def test_text_data_needs_a_token_model_and_back(tmp_path: Path) -> None:
    text = _cfg(
        tmp_path,
        "data.name=fortunes",
        f"data.root={FIXTURES / 'fortunes'}",
        "data.max_length=16",
        "data.categories=[animals, space, tea]",
        "num_clients=2",
        "partition.min_size=1",
    )
    with pytest.raises(ConfigError, match=r"token ids.*text_encoder"):
        run_one(text, "fedfull", SEED)
    images = _cfg(tmp_path, "model.name=text_encoder", "model.kwargs={}")
    with pytest.raises(ConfigError, match="takes token ids"):
        run_one(images, "fedfull", SEED)
