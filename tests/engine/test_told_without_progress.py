"""What happened to the results is told whether or not ``progress`` is on.

``progress: false`` turns off the bar and the step-by-step lines; it used to silence, with them,
the lines that say a finished run was kept instead of trained, replaced by ``--overwrite``, or
resumed from its checkpoint (and early stopping's end of a run). Those go through
:func:`fedlore.progress.tell` now: one plain ``fedlore: ...`` line each, with progress on or
off, and said once when progress is on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedlore.cli import main
from fedlore.config import Config, load_config
from fedlore.engine.rerun import staging_dir
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "run",
        str(QUICKSTART),
        "name=told",
        "num_clients=3",
        "rounds=3",
        "local_steps=2",
        "batch_size=16",
        "model.kwargs={hidden: [16]}",
        "algorithms=[fedavg]",
        "seeds=[0]",
        f"output_dir={out}",
        *extra,
    ]


def _cfg(out: Path) -> Config:
    _, path, *overrides = _args(out, "progress=false")
    return load_config(Path(path), overrides)


@pytest.mark.parametrize("progress", ["false", "true"])
def test_kept_and_replaced_finished_runs_are_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], progress: str
) -> None:
    args = _args(tmp_path, f"progress={progress}")
    assert main(args) == 0
    capsys.readouterr()
    folder = run_dir(_cfg(tmp_path), "fedavg", 0)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count(f"fedlore: fedavg seed 0: finished already; results in {folder}") == 1
    assert main([*args, "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert err.count(f"fedlore: replacing the finished run in {folder}") == 1
    assert err.count(f"fedlore: the new run took the place of the finished one in {folder}") == 1


def test_a_resume_and_an_interrupted_replacement_are_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path)
    args = _args(tmp_path, "progress=false")
    assert run_one(cfg, "fedavg", 0, stop_after=0) is None  # killed after round 0
    assert main([*args, "--resume"]) == 0
    assert "fedlore: fedavg seed 0: resuming after round 0" in capsys.readouterr().err
    folder = run_dir(cfg, "fedavg", 0)
    assert run_one(cfg, "fedavg", 0, overwrite=True, stop_after=0) is None  # a replacement
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"fedlore: fedavg seed 0: {staging_dir(folder)} holds an interrupted --overwrite" in err
    assert main([*args, "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"fedlore: continuing the replacement of the finished run in {folder}" in err


def test_a_resume_without_a_checkpoint_is_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path)
    assert run_one(cfg, "fedavg", 0, stop_after=0) is None
    (run_dir(cfg, "fedavg", 0) / "checkpoint.pt").unlink()
    assert main([*_args(tmp_path, "progress=false"), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "fedlore: fedavg seed 0: no checkpoint in" in err
    assert "starting from the first round" in err
    # a run that never started has no rounds to train again: nothing to tell (fedlore tune
    # resumes every trial's run)
    assert main([*_args(tmp_path, "progress=false", "seeds=[1]"), "--resume"]) == 0
    assert "no checkpoint" not in capsys.readouterr().err


def test_early_stopping_is_told(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(
        tmp_path,
        "progress=false",
        "rounds=6",
        "early_stopping.min_delta=0.9",  # no round improves by that much
        "early_stopping.metric=accuracy",
        "early_stopping.patience=1",
        "early_stopping.allow_test=true",
    )
    assert main(args) == 0
    assert "fedlore: early stopping: accuracy did not improve" in capsys.readouterr().err


def test_a_line_told_once_is_told_once_per_command(capsys: pytest.CaptureFixture[str]) -> None:
    from fedlore import progress

    progress.enable(False)
    with progress.command():
        progress.tell_once("replacing %s", "x")
        progress.tell_once("replacing %s", "x")
        progress.tell_once("replacing %s", "y")
    with progress.command():  # the next command tells it again
        progress.tell_once("replacing %s", "x")
    assert capsys.readouterr().err.splitlines() == [
        "fedlore: replacing x",
        "fedlore: replacing y",
        "fedlore: replacing x",
    ]
