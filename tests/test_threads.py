"""The ``threads`` setting: auto = one thread per CPU other work leaves free; a resumed run keeps
the count it started with (issue 19)."""

import json

import pytest
import torch

from fedlore.config import ConfigError, load_config
from fedlore.device import auto_threads, use_threads
from fedlore.run import run_dir, run_one


@pytest.fixture
def no_env_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.usefixtures("no_env_threads")
def test_auto_takes_the_free_cpus() -> None:
    assert auto_threads(cpus=2, busy=0.0) == 2  # an idle machine: every CPU
    assert auto_threads(cpus=2, busy=1.2) == 1  # a competing process: one thread
    assert auto_threads(cpus=2, busy=7.5) == 1  # never fewer than one
    assert auto_threads(cpus=16, busy=3.4) == 13
    assert auto_threads(cpus=4, busy=-1.0) == 4  # never more than the CPUs


def test_an_explicit_omp_num_threads_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    assert auto_threads(cpus=8, busy=0.0) == before


def test_use_threads_sets_torch_and_reuses_a_recorded_count() -> None:
    before = torch.get_num_threads()
    try:
        assert use_threads(2) == 2 and torch.get_num_threads() == 2
        assert use_threads("auto", recorded=3) == 3 and torch.get_num_threads() == 3
        assert use_threads(1, recorded=3) == 1  # an explicit count is not overridden
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -2, "many", 1.5, True])
def test_bad_thread_counts_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="threads"):
        load_config(None, [f"threads={bad}"] if not isinstance(bad, bool) else ["threads=true"])


def test_a_run_records_its_threads_and_resume_keeps_them(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    cfg = load_config(
        None,
        [
            "data.name=digits", "model.name=mlp", "num_clients=2", "rounds=2", "local_steps=1",
            "algorithms=[fedfull]", "progress=false", f"output_dir={tmp_path}", "threads=auto",
        ],
    )  # fmt: skip
    try:
        monkeypatch.setattr("fedlore.device.available_cpus", lambda: 3)
        monkeypatch.setattr("fedlore.device.busy_cpus", lambda: 0.0)
        assert run_one(cfg, "fedfull", 42, stop_after=0) is None
        out = run_dir(cfg, "fedfull", 42)
        assert json.loads((out / "config.json").read_text())["ran_threads"] == 3
        monkeypatch.setattr("fedlore.device.busy_cpus", lambda: 2.0)  # now auto would take 1
        assert run_one(cfg, "fedfull", 42, resume=True) is not None
        assert torch.get_num_threads() == 3  # the count the run started with
        fresh = run_one(cfg.model_copy(update={"name": "other"}), "fedfull", 42)
        assert fresh is not None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
