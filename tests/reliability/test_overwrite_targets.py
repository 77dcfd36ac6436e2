"""An interrupted ``--overwrite`` continues only on the runs it was started on (its record's
targets, :mod:`fedlore.engine.overwriting`).

The loss this guards against: ``fedlore run cfg.yaml algorithms=[fedavg] --overwrite`` is
interrupted, and the continuation leaves the override off (``fedlore run cfg.yaml --overwrite
--resume``), so it names the config's other methods too, whose finished runs the first command
never meant to replace. That continuation is refused, in the command and in its dry run, and
every finished run keeps its bytes; a continuation of only some targets keeps the record until
the rest have finished.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from interrupting import Interrupt, folder_bytes

from fedlore.cli import main
from fedlore.config import Config, load_config
from fedlore.engine import overwriting
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_experiment

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def _args(out: Path, *extra: str) -> list[str]:
    return [
        str(QUICKSTART),
        "name=targets",
        "num_clients=3",
        "rounds=2",
        "local_steps=2",
        "batch_size=16",
        "rank=4",
        "model.kwargs={hidden: [16]}",
        "algorithms=[fedavg,fedfull]",
        "seeds=[0]",
        f"output_dir={out}",
        "progress=false",
        *extra,
    ]


def _cfg(out: Path, *extra: str) -> Config:
    path, *overrides = _args(out, *extra)
    return load_config(Path(path), overrides)


def _interrupted_overwrite(tmp_path: Path, methods: str) -> tuple[Config, Path]:
    """Both methods finished at the old lr; then ``--overwrite`` of ``methods`` at lr 0.01,
    stopped in fedavg's round 0. The new config (both methods) and the record."""
    assert main(["run", *_args(tmp_path)]) == 0
    new = _cfg(tmp_path, "lr=0.01", methods)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(new, overwrite=True, callbacks=lambda m, s: [Interrupt(0)])
    return _cfg(tmp_path, "lr=0.01"), tmp_path / "targets" / overwriting.RECORD


def test_the_record_names_the_runs_the_overwrite_was_started_on(tmp_path: Path) -> None:
    _, record = _interrupted_overwrite(tmp_path, "algorithms=[fedavg]")
    assert json.loads(record.read_text()) == {
        "finished": [],
        "targets": ["fedavg/seed-0"],
        "started": ["fedavg/seed-0"],
    }


def test_a_continuation_that_names_other_runs_is_refused_and_they_stay_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new, record = _interrupted_overwrite(tmp_path, "algorithms=[fedavg]")
    fedfull = run_dir(new, "fedfull", 0)
    before = folder_bytes(fedfull)
    capsys.readouterr()
    for dry in ([], ["--dry-run"]):
        assert main(["run", *_args(tmp_path, "lr=0.01"), "--overwrite", "--resume", *dry]) == 2
        err = capsys.readouterr().err
        assert "was started on fedavg/seed-0" in err and "also names fedfull/seed-0" in err
        assert "algorithms=[fedavg] seeds=[0]" in err
    assert folder_bytes(fedfull) == before and record.is_file()
    # another seed is another run too
    argv = _args(tmp_path, "lr=0.01", "algorithms=[fedavg]", "seeds=[0,1]")
    assert main(["run", *argv, "--overwrite", "--resume"]) == 2
    assert "also names fedavg/seed-1" in capsys.readouterr().err
    # the command the message gives continues it; the other method's run is untouched
    argv = _args(tmp_path, "lr=0.01", "algorithms=[fedavg]", "seeds=[0]")
    assert main(["run", *argv, "--overwrite", "--resume"]) == 0
    assert json.loads((run_dir(new, "fedavg", 0) / "config.json").read_text())["lr"] == 0.01
    assert folder_bytes(fedfull) == before and not record.exists()


def test_continuing_some_targets_keeps_the_record_for_the_rest(tmp_path: Path) -> None:
    new, record = _interrupted_overwrite(tmp_path, "algorithms=[fedavg,fedfull]")
    only = _cfg(tmp_path, "lr=0.01", "algorithms=[fedavg]")
    run_experiment(only, resume=True, overwrite=True)
    kept = json.loads(record.read_text())
    assert kept == {
        "finished": ["fedavg/seed-0"],
        "targets": ["fedavg/seed-0", "fedfull/seed-0"],
        "started": ["fedavg/seed-0"],
    }
    replaced = folder_bytes(run_dir(new, "fedavg", 0))
    run_experiment(new, resume=True, overwrite=True)  # the rest: fedavg kept, fedfull replaced
    assert folder_bytes(run_dir(new, "fedavg", 0)) == replaced
    assert json.loads((run_dir(new, "fedfull", 0) / "config.json").read_text())["lr"] == 0.01
    assert not record.exists()


def test_a_record_without_targets_counts_every_run_as_one(tmp_path: Path) -> None:
    """A record written before targets were kept: the continuation replaces every run of the
    command that it has not finished, as before."""
    new, record = _interrupted_overwrite(tmp_path, "algorithms=[fedavg]")
    record.write_text(json.dumps({"finished": []}))
    run_experiment(new, resume=True, overwrite=True)
    for m in ("fedavg", "fedfull"):
        assert json.loads((run_dir(new, m, 0) / "config.json").read_text())["lr"] == 0.01
    assert not record.exists()
