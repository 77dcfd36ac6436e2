"""``fedlore run --keep-going``: a run that raises is recorded as failed and the others go on.

* A user's method (registered through ``imports:``) that raises at round 1: with
  ``--keep-going`` every other run still runs; each failed run's folder holds ``failed.json``
  (error, message, round, traceback); the command ends with one line per failed run and
  ``N of M runs failed``, exit status 1. Without it the first error stops the command as before
  (exit 2, one line naming the ``--resume`` command, no record).
* ``--resume`` retries the failed runs from their checkpoints; the record goes once a run
  trains again.
* A failed ``--overwrite`` replacement records its failure beside the finished run, which stays
  byte for byte.
* An interrupt and a refusal of the command still stop everything; the Python API raises
  :class:`~fedlore.experiment.RunsFailed` with the finished runs' summaries.
* ``fedlore report`` names each failed run in one line and leaves it out of the table (it used
  to pool the cut-off run's last round with the finished ones), and counts it in the seeds cell
  of the row of its method and settings (``2 (+1 failed)``).
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedlore import plugins, registry
from fedlore.cli import main
from fedlore.config import Config, load_config
from fedlore.engine import failed
from fedlore.engine.rundir import run_dir
from fedlore.experiment import RunsFailed, run_experiment
from fedlore.results.report import report
from fedlore.results.store import IncompleteRunWarning

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
PLUGIN = '''
import os
from dataclasses import dataclass
from typing import ClassVar

from fedlore.algorithms.fedavg import FedAvg
from fedlore.config import ConfigError
from fedlore.registry import register_algorithm


@register_algorithm("boom")
@dataclass(frozen=True)
class Boom(FedAvg):
    """FedAvg whose aggregation raises from round BOOM_ROUND on (BOOM_KIND: the error)."""

    name: ClassVar[str] = "boom"

    def aggregate(self, state, replies, rnd):
        if rnd >= int(os.environ.get("BOOM_ROUND", "1")):
            kind = os.environ.get("BOOM_KIND", "value")
            if kind == "interrupt":
                raise KeyboardInterrupt
            if kind == "config":
                raise ConfigError("a refusal of fedlore's own")
            raise ValueError(f"boom at round {rnd}")
        return super().aggregate(state, replies, rnd)
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "boom.py"
    path.write_text(PLUGIN)
    monkeypatch.delenv("BOOM_ROUND", raising=False)
    monkeypatch.delenv("BOOM_KIND", raising=False)
    yield path
    registry._TABLES["algorithm"].pop("boom", None)
    sys.modules.pop(plugins.module_name(str(path.resolve())), None)


def _args(out: Path, plugin: Path, *extra: str) -> list[str]:
    return [
        "run",
        str(QUICKSTART),
        "name=kg",
        "num_clients=3",
        "rounds=3",
        "local_steps=2",
        "batch_size=16",
        "model.kwargs={hidden: [16]}",
        "progress=false",
        f"imports=[{plugin}]",
        "algorithms=[boom,fedavg]",
        "seeds=[42,43]",
        f"output_dir={out}",
        *extra,
    ]


def _cfg(out: Path, plugin: Path) -> Config:
    _, path, *overrides = _args(out, plugin)
    return load_config(Path(path), overrides)


def test_keep_going_runs_every_other_run_and_records_each_failure(
    tmp_path: Path, plugin: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    assert main([*_args(out, plugin), "--keep-going"]) == 1
    cfg = _cfg(out, plugin)
    for seed in (42, 43):  # the method after the failing one ran, for both seeds
        assert (run_dir(cfg, "fedavg", seed) / "summary.json").is_file()
        folder = run_dir(cfg, "boom", seed)
        assert not (folder / "summary.json").exists()
        record = json.loads((folder / failed.FAILED).read_text())
        assert record["method"] == "boom" and record["seed"] == seed
        assert record["error"] == "ValueError" and record["message"] == "boom at round 1"
        assert record["round"] == 1
        assert "boom at round 1" in record["traceback"] and "Traceback" in record["traceback"]
        assert not list(folder.glob("*.tmp"))  # written atomically
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert err[-1].startswith("fedlore: error: 2 of 4 runs failed; after a fix, `fedlore run")
    assert "--keep-going --resume` retries them" in err[-1]
    ends = [line for line in err if line.startswith("fedlore: error: boom seed")]
    assert ends == [
        f"fedlore: error: boom seed {s}, round 1: ValueError: boom at round 1 (traceback in "
        f"{run_dir(cfg, 'boom', s) / failed.FAILED})"
        for s in (42, 43)
    ]
    # the table of the finished runs, and the failed ones named once each, not pooled
    assert "| fedavg | 2 |" in captured.out and "| boom |" not in captured.out
    assert "Failed runs, left out of the table (2;" in captured.out
    for s in (42, 43):
        assert sum(f"seed-{s}: failed at round 1 (ValueError" in line for line in err) == 1


def test_without_keep_going_the_first_error_stops_the_command(
    tmp_path: Path, plugin: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    assert main(_args(out, plugin)) == 2
    cfg = _cfg(out, plugin)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedlore: error: boom seed 42, round 1: ValueError")
    assert "--resume` resumes" in err[0]
    assert not run_dir(cfg, "fedavg", 42).exists()  # nothing after it ran
    assert not (run_dir(cfg, "boom", 42) / failed.FAILED).exists()


def test_resume_retries_the_failed_runs_and_their_records_go(
    tmp_path: Path,
    plugin: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "runs"
    monkeypatch.setenv("BOOM_ROUND", "2")
    assert main([*_args(out, plugin), "--keep-going"]) == 1
    cfg = _cfg(out, plugin)
    assert json.loads((run_dir(cfg, "boom", 42) / failed.FAILED).read_text())["round"] == 2
    monkeypatch.setenv("BOOM_ROUND", "99")  # the fix
    capsys.readouterr()
    assert main([*_args(out, plugin), "--keep-going", "--resume"]) == 0
    err = capsys.readouterr().err
    for seed in (42, 43):
        folder = run_dir(cfg, "boom", seed)
        assert (folder / "summary.json").is_file() and not (folder / failed.FAILED).exists()
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [0, 1, 2]
        assert f"boom seed {seed}: resuming after round 1" in err  # from its checkpoint
        assert f"fedavg seed {seed}: finished already" in err  # kept


def test_a_failed_replacement_leaves_the_finished_run_as_it_was(
    tmp_path: Path, plugin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "runs"
    monkeypatch.setenv("BOOM_ROUND", "99")
    assert main([*_args(out, plugin), "seeds=[42]"]) == 0
    cfg = _cfg(out, plugin)
    target = run_dir(cfg, "boom", 42)
    before = {
        p.name: p.read_bytes() for p in target.iterdir() if p.is_file() and "lock" not in p.name
    }
    monkeypatch.setenv("BOOM_ROUND", "1")
    assert main([*_args(out, plugin), "seeds=[42]", "--overwrite", "--keep-going"]) == 1
    after = {
        p.name: p.read_bytes() for p in target.iterdir() if p.is_file() and "lock" not in p.name
    }
    assert after == before and failed.FAILED not in after
    staged = target.with_name("seed-42.overwrite")
    assert json.loads((staged / failed.FAILED).read_text())["error"] == "ValueError"
    assert (run_dir(cfg, "fedavg", 42) / "summary.json").is_file()
    assert (out / "kg" / "overwriting.json").is_file()  # --overwrite --resume continues it


def test_a_record_is_never_written_beside_a_finished_run(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text("{}")
    got = failed.record("m", 1, tmp_path, ValueError("x"))
    assert got.record is None and not (tmp_path / failed.FAILED).exists()
    fresh = tmp_path / "new" / "seed-1"  # a run that failed before making its folder
    got = failed.record("m", 1, fresh, ValueError("x"))
    assert got.record == fresh / failed.FAILED and got.round is None


@pytest.mark.parametrize(("kind", "status"), [("interrupt", 130), ("config", 2)])
def test_an_interrupt_or_a_refusal_stops_everything_under_keep_going(
    tmp_path: Path, plugin: Path, monkeypatch: pytest.MonkeyPatch, kind: str, status: int
) -> None:
    out = tmp_path / "runs"
    monkeypatch.setenv("BOOM_KIND", kind)
    assert main([*_args(out, plugin), "--keep-going"]) == status
    cfg = _cfg(out, plugin)
    assert not run_dir(cfg, "fedavg", 42).exists()  # nothing after it ran
    assert not (run_dir(cfg, "boom", 42) / failed.FAILED).exists()  # not a failure


def test_the_python_api_raises_runs_failed_with_the_finished_summaries(
    tmp_path: Path, plugin: Path
) -> None:
    cfg = _cfg(tmp_path / "runs", plugin)
    with pytest.raises(RunsFailed, match="2 of 4 runs failed") as e:
        run_experiment(cfg, keep_going=True)
    assert [(f.method, f.seed, f.round) for f in e.value.failures] == [
        ("boom", 42, 1),
        ("boom", 43, 1),
    ]
    assert e.value.total == 4 and e.value.summaries["boom"] == []
    assert [s["seed"] for s in e.value.summaries["fedavg"]] == [42, 43]


def test_report_names_each_failed_run_and_leaves_it_out(tmp_path: Path, plugin: Path) -> None:
    out = tmp_path / "runs"
    cfg = _cfg(out, plugin)
    with pytest.raises(RunsFailed):
        run_experiment(cfg, keep_going=True)
    with pytest.warns(IncompleteRunWarning) as caught:
        text = report(out / "kg", write=False)
    said = [str(w.message) for w in caught if "failed at round" in str(w.message)]
    assert len(said) == 2 and all("left out of the table" in s for s in said)
    assert "| boom |" not in text and "| fedavg | 2 |" in text
    assert "boom seed 42 failed at round 1 (ValueError: boom at round 1)" in text
    for seed in (42, 43):  # every run failed: one line, no crash
        (run_dir(cfg, "fedavg", seed) / "summary.json").unlink()
        failed.record("fedavg", seed, run_dir(cfg, "fedavg", seed), ValueError("x"))
    every = "every run failed \\(boom seed 42, boom seed 43"
    with pytest.raises(FileNotFoundError, match=every), pytest.warns(IncompleteRunWarning):
        report(out / "kg", write=False)


def test_a_failure_before_the_run_folder_of_a_replacement_is_recorded_beside_it(
    tmp_path: Path, plugin: Path
) -> None:
    """An error raised before the run named its folder (while a replacement was built): the
    record goes to the replacement's folder, never into the finished run's."""
    from fedlore.experiment_sweep import _failed

    cfg = _cfg(tmp_path / "runs", plugin)
    target = run_dir(cfg, "boom", 42)
    target.mkdir(parents=True)
    (target / "summary.json").write_text("{}")
    got = _failed(cfg, "boom", 42, ValueError("while building"))
    assert got.record == target.with_name("seed-42.overwrite") / failed.FAILED
    assert not (target / failed.FAILED).exists()


def test_a_record_beside_a_finished_run_is_not_a_failure(tmp_path: Path) -> None:
    from fedlore.results.failed_runs import failed_runs, read_failure

    folder = tmp_path / "exp" / "m" / "seed-1"
    folder.mkdir(parents=True)
    (folder / failed.FAILED).write_text('{"error": "ValueError", "round": 2}')
    assert failed_runs(tmp_path / "exp") == [("m", 1, {"error": "ValueError", "round": 2})]
    (folder / "summary.json").write_text("{}")  # finished since (a copied folder)
    assert read_failure(folder) is None and failed_runs(tmp_path / "exp") == []


def test_dry_run_says_which_run_it_retries(
    tmp_path: Path, plugin: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    assert main([*_args(out, plugin), "seeds=[42]", "--keep-going"]) == 1
    capsys.readouterr()
    assert main([*_args(out, plugin), "seeds=[42]", "--resume", "--dry-run"]) == 0
    lines = capsys.readouterr().out
    assert (
        "continue: the run that failed at round 1 (ValueError: boom at round 1) continues after "
        "round 0 of 3" in lines
    )


def _fail(folder: Path) -> None:
    """Turn a finished run into one that failed under --keep-going."""
    (folder / "summary.json").unlink()
    failed.record(folder.parent.name, int(folder.name[5:]), folder, ValueError("x"))


def test_the_seeds_cell_counts_the_failed_runs_of_its_row(tmp_path: Path) -> None:
    """``1 (+1 failed)``: a failed run counts in the row of its method and settings, not among
    the seeds of the statistics; one made with settings no finished run has counts nowhere."""
    out = tmp_path / "runs"
    args = _args(out, tmp_path / "none.py")
    cfg = load_config(Path(args[1]), [a for a in args[2:] if not a.startswith(("imports", "alg"))])
    run_experiment(cfg.model_copy(update={"algorithms": ["fedavg"], "seeds": [42, 43, 44]}))
    folder = {s: run_dir(cfg, "fedavg", s) for s in (42, 43, 44)}
    finished = (folder[43] / "summary.json").read_text()
    _fail(folder[43])
    with pytest.warns(IncompleteRunWarning):
        assert "| fedavg | 2 (+1 failed) |" in report(out / "kg")
    with (out / "kg" / "report.csv").open() as f:
        (row,) = csv.DictReader(f)
    assert (row["n_seeds"], row["failed_runs"], row["unfinished_runs"]) == ("2", "1", "0")
    _fail(folder[44])
    with pytest.warns(IncompleteRunWarning):
        assert "| fedavg | 1 (+2 failed) |" in report(out / "kg", write=False)
    settings = json.loads((folder[44] / "config.json").read_text())
    (folder[44] / "config.json").write_text(json.dumps({**settings, "lr": 0.5}))
    with pytest.warns(IncompleteRunWarning):  # settings of no finished run: named only
        text = report(out / "kg", write=False)
    assert "| fedavg | 1 (+1 failed) |" in text and "fedavg seed 44 failed" in text
    (folder[42] / "config.json").write_text(json.dumps({**settings, "lr": 0.5}))
    shown = f"{cfg.lr}"
    (folder[43] / "summary.json").write_text(finished)  # 43 finished (lr as made), 42 at 0.5
    (folder[43] / failed.FAILED).unlink()
    with pytest.warns(IncompleteRunWarning):
        text = report(out / "kg", write=False)
    assert "| fedavg [lr=0.5] | 1 (+1 failed) |" in text
    assert f"| fedavg [lr={shown}] | 1 |" in text
