"""``fedlore run ... --dry-run`` (:mod:`fedlore.dry_run`): it says, run by run, what the command
would do (train, continue, keep, refuse) without touching a file, and what it says is what the
command then does: each scenario is checked by running the real command after the dry run and
seeing which runs trained (their records changed), which continued (after the round said) and
which were kept (their files unchanged)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from fedlore.cli import main
from fedlore.config import Config, load_config
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one

SEEDS = (1, 2)
METHODS = ("fedavg", "fedfull")


def _overrides(out: Path, *extra: str) -> list[str]:
    return [
        "algorithms=[fedavg, fedfull]",
        "seeds=[1, 2]",
        "num_clients=3",
        "rounds=3",
        "local_steps=2",
        "batch_size=16",
        "model.kwargs={hidden: [16]}",
        "partition.min_size=10",
        "progress=false",
        f"output_dir={out}",
        *extra,
    ]


def _file(out: Path) -> Path:
    """The experiment's YAML file, beside ``out``."""
    path = out.parent / "dry.yaml"
    if not path.exists():
        path.write_text("name: dry\n", encoding="utf-8")
    return path


def _args(out: Path, *extra: str) -> list[str]:
    """``fedlore run`` arguments: the file, then the overrides."""
    return [str(_file(out)), *_overrides(out, *extra)]


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(_file(out), _overrides(out, *extra))


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` -> a digest of its bytes (with its mtime: a rewrite counts)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
        + str(p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _dry(out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, str]]:
    """``fedlore run ... --dry-run``: its exit status and each run's line (``fedavg seed 1``
    -> ``train: ...``); no file under ``out`` changes."""
    before = _snapshot(out)
    capsys.readouterr()
    status = main(["run", *_args(out), *extra, "--dry-run"])
    text = capsys.readouterr().out
    assert _snapshot(out) == before, "a dry run wrote"
    lines = {}
    for line in text.splitlines()[1:-1]:
        m = re.match(r"\s+(\S+ seed \d+)\s+(\w+: .*)$", line)
        assert m, text
        lines[m.group(1)] = m.group(2)
    assert text.startswith(f"dry run of {out / 'dry'} (nothing is trained or written): 4 run(s)")
    return status, lines


def _summary_stamp(out: Path, method: str, seed: int) -> str | None:
    path = run_dir(_cfg(out), method, seed) / "summary.json"
    return hashlib.sha1(path.read_bytes()).hexdigest() if path.exists() else None


def test_a_dry_run_with_early_stopping_says_up_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that may stop early trains at most its rounds, and the dry run says so."""
    out = tmp_path / "runs"
    stop = ("data.selection_fraction=0.2", "early_stopping.metric=selection_accuracy")
    status, lines = _dry(out, capsys, *stop)
    assert status == 0 and set(lines.values()) == {"train: trains up to 3 rounds"}
    status, lines = _dry(out, capsys, *stop, "rounds=1")  # one round: singular
    assert status == 0 and set(lines.values()) == {"train: trains up to 1 round"}
    # a killed run says it too, resumed or started over, as the fresh runs beside it do
    assert run_one(_cfg(out, *stop), "fedavg", 1, stop_after=0) is None
    status, lines = _dry(out, capsys, *stop, "--resume")
    assert status == 0
    assert lines["fedavg seed 1"] == "continue: continues after round 0; trains up to 3 rounds"
    assert lines["fedfull seed 1"] == (  # no folder yet: --resume trains it from the start
        "train: has no checkpoint: trains from its first round (as --resume does); trains up "
        "to 3 rounds"
    )
    status, lines = _dry(out, capsys, *stop)
    assert lines["fedavg seed 1"] == (
        "train: starts over, discarding the 1 complete round(s) of the unfinished run there "
        "(--resume continues it); trains up to 3 rounds"
    )
    from fedlore.dry_run import plan_runs

    fedlore = _cfg(tmp_path / "setup", *stop, "algorithms=[fedlore]", "seeds=[1]")
    assert run_one(fedlore, "fedlore", 1, stop_after=-1) is None  # its setup round only
    (p,) = plan_runs(fedlore, resume=True)
    assert p.why == "continues after its setup round (round -1); trains up to 3 rounds"
    from fedlore.dry_run import _continue

    # FedBuff on the wall clock: a new simulation starts over, as far
    wall = ["asynchronous.buffer=2", "asynchronous.clock=wall", "engine=flower-sim"]
    sim = _cfg(out, *stop, *wall)
    assert _continue(sim, "fedavg", tmp_path)[1].endswith(
        "(its clients keep no states to resume from: checkpoint: false, or FedBuff on the wall "
        "clock); trains up to 3 rounds"
    )


def test_a_dry_run_says_what_the_command_then_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    # nothing there: every run trains, and no folder is made
    status, lines = _dry(out, capsys)
    assert status == 0 and not out.exists()
    assert set(lines.values()) == {"train: trains 3 rounds"} and len(lines) == 4

    # fedavg seed 1 finished, fedfull seed 1 killed after round 1, seed 2 never started
    cfg = _cfg(out)
    assert run_one(cfg, "fedavg", 1) is not None
    assert run_one(cfg, "fedfull", 1, stop_after=1) is None
    status, lines = _dry(out, capsys)
    assert status == 0
    assert lines["fedavg seed 1"].startswith("keep: finished already")
    assert lines["fedfull seed 1"] == (
        "train: starts over, discarding the 2 complete round(s) of the unfinished run there "
        "(--resume continues it)"
    )
    assert lines["fedavg seed 2"] == lines["fedfull seed 2"] == "train: trains 3 rounds"
    status, lines = _dry(out, capsys, "--resume")
    assert status == 0
    assert lines["fedfull seed 1"] == "continue: continues after round 1 of 3"
    assert lines["fedavg seed 1"].startswith("keep: ")

    # the command does what the dry run said: fedavg seed 1 kept, fedfull seed 1 resumed after
    # round 1 (its first two rows stay as they were), seed 2 trained
    kept = _summary_stamp(out, "fedavg", 1)
    rows_before = (run_dir(cfg, "fedfull", 1) / "metrics.jsonl").read_text().splitlines()
    assert main(["run", *_args(out), "--resume"]) == 0
    assert _summary_stamp(out, "fedavg", 1) == kept
    rows = (run_dir(cfg, "fedfull", 1) / "metrics.jsonl").read_text().splitlines()
    assert rows[:2] == rows_before[:2] and len(rows) == 3
    assert all(_summary_stamp(out, m, 2) is not None for m in METHODS)

    # everything finished: all kept
    status, lines = _dry(out, capsys)
    assert status == 0 and all(v.startswith("keep: finished already") for v in lines.values())

    # another config: refused (exit 2, as the command would), every run named; --overwrite
    # trains them again beside the finished ones
    capsys.readouterr()
    status, lines = _dry(out, capsys, "lr=0.5")
    assert status == 2
    assert all(v.startswith("refuse: ") and "another config (lr: " in v for v in lines.values())
    assert main(["run", *_args(out), "lr=0.5"]) == 2  # the command refuses it too
    status, lines = _dry(out, capsys, "lr=0.5", "--overwrite")
    assert status == 0
    assert all(v.startswith("train: trains again beside the finished run") for v in lines.values())
    status, lines = _dry(out, capsys, "lr=0.5", "--resume")
    assert status == 2 and all(v.startswith("refuse: ") for v in lines.values())


def test_a_dry_run_of_an_interrupted_overwrite_says_what_overwrite_resume_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    assert main(["run", *_args(out)]) == 0
    finished = {(m, s): _summary_stamp(out, m, s) for m in METHODS for s in SEEDS}
    # an --overwrite with lr 0.5 that replaced seed 1's runs and was killed in fedavg seed 2
    cfg = _cfg(out, "lr=0.5")
    from fedlore.engine import overwriting

    overwriting.begin(cfg, resume=False, overwrite=True)
    for m in METHODS:
        assert run_one(cfg, m, 1, overwrite=True) is not None
        overwriting.record_finished(cfg, m, 1, overwrite=True)
    assert run_one(cfg, "fedavg", 2, overwrite=True, stop_after=0) is None
    capsys.readouterr()
    status, lines = _dry(out, capsys, "lr=0.5", "--resume")
    assert status == 2  # plain --resume: the runs not reached are another config's
    status, lines = _dry(out, capsys, "lr=0.5", "--overwrite", "--resume")
    assert status == 0
    assert (
        lines["fedavg seed 1"]
        == lines["fedfull seed 1"]
        == ("keep: replaced already by the --overwrite: kept")
    )
    assert lines["fedavg seed 2"] == (
        "continue: the interrupted replacement continues after round 0 of 3"
    )
    assert lines["fedfull seed 2"] == "train: trains again, replacing the finished run"
    replaced = {m: _summary_stamp(out, m, 1) for m in METHODS}
    assert main(["run", *_args(out), "lr=0.5", "--overwrite", "--resume"]) == 0
    assert {m: _summary_stamp(out, m, 1) for m in METHODS} == replaced  # kept
    for m in METHODS:  # replaced
        assert _summary_stamp(out, m, 2) != finished[(m, 2)]
        recorded = json.loads((run_dir(cfg, m, 2) / "config.json").read_text())
        assert recorded["lr"] == 0.5
    capsys.readouterr()  # the --overwrite has ended: nothing left to continue, as the command says
    assert main(["run", *_args(out), "lr=0.5", "--overwrite", "--resume", "--dry-run"]) == 2
    assert "holds none" in capsys.readouterr().err


def test_a_dry_run_refuses_what_the_command_refuses_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    assert main(["run", *_args(out), "--resume", "--overwrite", "--dry-run"]) == 2
    assert "holds none" in capsys.readouterr().err
    assert main(["run", *_args(out), "method.fedavg.lr=-1", "--dry-run"]) == 2
    assert "invalid config" in capsys.readouterr().err
    assert not out.exists()


def test_a_dry_run_reports_a_cut_swap_and_a_simulation_as_the_command_leaves_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished replacement whose swap a kill cut in two is swapped in first by the command:
    the dry run says so (and does not swap); an unfinished run on the Flower simulation
    resumes from its first round."""
    import shutil

    from fedlore.dry_run import plan_runs
    from fedlore.engine.rerun import staging_dir

    out = tmp_path / "runs"
    assert main(["run", *_args(out)]) == 0
    target = run_dir(_cfg(out), "fedavg", 1)
    shutil.copytree(target, staging_dir(target))  # a replacement of this config, not swapped
    status, lines = _dry(out, capsys)
    assert status == 0 and staging_dir(target).is_dir()
    assert lines["fedavg seed 1"] == (
        "keep: finished already: kept (--overwrite trains it again) (its finished replacement "
        "in the .overwrite folder is swapped in first)"
    )
    assert main(["run", *_args(out)]) == 0
    assert not staging_dir(target).exists()  # the command swapped it in

    cfg = _cfg(out, "engine=flower-sim", "rounds=4")
    planned = {(p.method, p.seed): p for p in plan_runs(cfg, resume=True)}
    assert planned["fedavg", 1].action == "refuse"  # 3 rounds run: another config
    cfg = _cfg(tmp_path / "sim", "engine=flower-sim")
    assert run_one(cfg, "fedavg", 1, stop_after=0) is None
    (p,) = [p for p in plan_runs(cfg, resume=True) if (p.method, p.seed) == ("fedavg", 1)]
    # its clients keep their states in the run folder: continued from the checkpoint
    assert (p.action, p.why) == ("continue", "continues after round 0 of 3")


def test_overwrite_resume_judges_kept_and_continued_runs_by_their_data_and_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--overwrite --resume`` keeps a replaced run, or continues an unfinished one, only when
    it is of this config *and data* (:func:`fedlore.engine.overwriting.plan`); on other data it
    trains it again rather than refusing, and a replaced run whose summary is damaged stops the
    command rather than being kept. The dry run says the same."""
    from fedlore.engine import overwriting

    out = tmp_path / "runs"
    assert main(["run", *_args(out)]) == 0
    cfg = _cfg(out)
    overwriting.begin(cfg, resume=False, overwrite=True)  # an --overwrite that replaced seed 1
    for m in METHODS:
        overwriting.record_finished(cfg, m, 1, overwrite=True)
    # fedavg seed 1 replaced on other data; fedfull seed 2 unfinished, on other data
    for m, s in (("fedavg", 1), ("fedfull", 2)):
        path = run_dir(cfg, m, s) / "config.json"
        recorded = json.loads(path.read_text())
        recorded["data_fingerprint"] = "0" * 16
        path.write_text(json.dumps(recorded))
    (run_dir(cfg, "fedfull", 2) / "summary.json").unlink()
    status, lines = _dry(out, capsys, "--overwrite", "--resume")
    assert status == 0, lines
    assert lines["fedavg seed 1"] == "train: trains again, replacing the finished run"
    assert lines["fedfull seed 1"] == "keep: replaced already by the --overwrite: kept"
    assert lines["fedfull seed 2"].startswith(
        "train: starts over, discarding the 3 complete round(s)"
    )
    before = {(m, s): _summary_stamp(out, m, s) for m in METHODS for s in SEEDS}
    assert main(["run", *_args(out), "--overwrite", "--resume"]) == 0  # as said
    assert _summary_stamp(out, "fedavg", 1) != before["fedavg", 1]  # trained again
    assert _summary_stamp(out, "fedfull", 1) == before["fedfull", 1]  # kept
    assert _summary_stamp(out, "fedfull", 2) is not None

    # a replaced run whose summary is damaged: the command refuses, and so does the dry run
    overwriting.begin(cfg, resume=False, overwrite=True)
    overwriting.record_finished(cfg, "fedavg", 1, overwrite=True)
    (run_dir(cfg, "fedavg", 1) / "summary.json").write_text('{"method": "fedavg"}')
    status, lines = _dry(out, capsys, "--overwrite", "--resume")
    assert status == 2, lines
    assert lines["fedavg seed 1"].startswith("refuse: ") and "lacks seed" in lines["fedavg seed 1"]
    assert main(["run", *_args(out), "--overwrite", "--resume"]) == 2


def test_a_cut_swap_over_another_configs_run_is_completed_not_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An ``--overwrite`` replaced another config's finished run, and a kill came between the
    replacement's summary and its swap: the next plain run swaps it in and keeps it (as the dry
    run says), rather than refusing the run about to be replaced. A replacement copied from
    another seed is refused by both."""
    import shutil

    from fedlore.engine.rerun import staging_dir

    out = tmp_path / "runs"
    assert main(["run", *_args(out)]) == 0
    target = run_dir(_cfg(out), "fedavg", 1)
    shutil.copytree(target, staging_dir(target))  # the finished replacement, of this config
    path = target / "config.json"  # the run it replaces: another config's
    recorded = json.loads(path.read_text())
    recorded["lr"] = recorded["hyper"]["lr"] = 0.5
    path.write_text(json.dumps(recorded))
    status, lines = _dry(out, capsys)
    assert status == 0 and lines["fedavg seed 1"].startswith("keep: finished already")
    assert main(["run", *_args(out)]) == 0
    assert not staging_dir(target).exists()
    assert json.loads(path.read_text())["lr"] != 0.5  # the replacement took its place

    shutil.copytree(run_dir(_cfg(out), "fedavg", 2), staging_dir(target))  # seed 2's run
    status, lines = _dry(out, capsys)
    assert status == 2 and "is of seed 2, not of seed-1.overwrite" in lines["fedavg seed 1"]
    assert main(["run", *_args(out)]) == 2


def test_a_dry_run_says_which_runs_train_before_the_command_stops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refusal found as the command reaches a run (a resume of another config's run) or a
    seed (a finished run on other data) comes after the runs before it have trained: the dry run
    names them and where the command stops, rather than saying nothing trains."""
    out = tmp_path / "runs"
    cfg = _cfg(out)
    assert run_one(cfg, "fedfull", 2) is not None  # finished, then its data "changed"
    path = run_dir(cfg, "fedfull", 2) / "config.json"
    recorded = json.loads(path.read_text())
    recorded["data_fingerprint"] = "0" * 16
    path.write_text(json.dumps(recorded))
    capsys.readouterr()
    status = main(["run", *_args(out), "--dry-run"])
    text = capsys.readouterr().out
    assert status == 2
    assert text.splitlines()[-1] == (
        "3 train, 1 refuse: `fedlore run` would first train or continue 2 run(s) (fedavg seed "
        "1, fedfull seed 1), then stop at fedfull seed 2"
    ), text
    assert main(["run", *_args(out)]) == 2  # as said: seed 1 trained, seed 2 not reached
    assert all(_summary_stamp(out, m, 1) is not None for m in METHODS)
    assert _summary_stamp(out, "fedavg", 2) is None

    # --resume of another config's unfinished run: refused when reached, after fedavg seed 1
    other = tmp_path / "other"
    assert run_one(_cfg(other, "lr=0.5"), "fedfull", 1, stop_after=0) is None
    capsys.readouterr()
    status = main(["run", *_args(other), "--resume", "--dry-run"])
    text = capsys.readouterr().out
    assert status == 2
    assert text.splitlines()[-1].endswith(
        "`fedlore run` would first train or continue 1 run(s) (fedavg seed 1), then stop at "
        "fedfull seed 1"
    ), text
    assert main(["run", *_args(other), "--resume"]) == 2
    assert _summary_stamp(other, "fedavg", 1) is not None

    # a finished run of another config is refused before any run trains
    assert main(["run", *_args(out), "lr=0.5", "--dry-run"]) == 2
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .endswith("`fedlore run` would stop before training anything")
    )


def test_a_resume_continues_after_its_checkpoints_round_and_is_refused_as_the_command_does(
    tmp_path: Path,
) -> None:
    """``continue`` names the checkpoint's round (a kill while the checkpoint was being saved
    leaves ``metrics.jsonl`` a row ahead of it), and a resume the command refuses (rows cut
    short of the checkpoint, a damaged checkpoint) is a refusal in the dry run too."""
    from fedlore.dry_run import plan_runs

    out = tmp_path / "runs"
    cfg = _cfg(out, "seeds=[1]", "algorithms=[fedavg]")
    assert run_one(cfg, "fedavg", 1, stop_after=1) is None  # checkpoint after round 1
    metrics = run_dir(cfg, "fedavg", 1) / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    ahead = {**json.loads(rows[-1]), "round": 2}  # round 2's row written, its checkpoint not
    metrics.write_text("\n".join([*rows, json.dumps(ahead)]) + "\n")
    (p,) = plan_runs(cfg, resume=True)
    assert (p.action, p.why) == ("continue", "continues after round 1 of 3")

    metrics.write_text(rows[0] + "\n")  # cut short of the checkpoint
    (p,) = plan_runs(cfg, resume=True)
    assert p.action == "refuse" and "lacks the rows of round 1" in p.why, p
    args = [*_args(out), "seeds=[1]", "algorithms=[fedavg]", "--resume"]
    assert main(["run", *args]) == 2  # the command refuses it too

    metrics.write_text("\n".join(rows) + "\n")
    ckpt = run_dir(cfg, "fedavg", 1) / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])  # torn
    (p,) = plan_runs(cfg, resume=True)
    assert p.action == "refuse" and "is damaged and cannot be read" in p.why, p
    assert main(["run", *args]) == 2


def test_a_dp_resume_with_a_damaged_ledger_is_refused_as_the_command_does(
    tmp_path: Path,
) -> None:
    from fedlore.dry_run import plan_runs
    from fedlore.engine.dp_ledger import LEDGER

    out = tmp_path / "runs"
    dp = ("dp.clip_norm=1.0", "dp.noise_multiplier=1.0", "weighting=uniform")
    cfg = _cfg(out, "seeds=[1]", "algorithms=[fedavg]", *dp)
    assert run_one(cfg, "fedavg", 1, stop_after=0) is None
    (run_dir(cfg, "fedavg", 1) / LEDGER).write_text("{")
    (p,) = plan_runs(cfg, resume=True)
    assert p.action == "refuse" and "not a DP ledger" in p.why, p
    args = [*_args(out), "seeds=[1]", "algorithms=[fedavg]", *dp, "--resume"]
    assert main(["run", *args]) == 2


def test_a_dry_run_refuses_a_model_or_data_the_command_refuses_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command checks the first seed's data and the model on it before any run (its
    preflight): the dry run makes the same checks, not only the config's and the folders'."""
    import numpy as np

    out = tmp_path / "runs"
    assert main(["run", *_args(out), "model.name=cnn", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert main(["run", *_args(out), "model.name=cnn"]) == 2
    assert capsys.readouterr().err == err
    site = tmp_path / "one-class"  # every label 3: refused by the npz loader
    site.mkdir()
    x = np.random.default_rng(0).random((60, 64)).astype(np.float32)
    np.savez(site / "train.npz", x=x, y=np.full(60, 3))
    np.savez(site / "test.npz", x=x[:10], y=np.full(10, 3))
    npz = ("data.name=npz", f"data.root={site}")
    assert main(["run", *_args(out), *npz, "--dry-run"]) == 2
    assert "every label is 3" in capsys.readouterr().err
    assert not out.exists()


def test_a_file_where_a_run_folder_goes_is_refused_before_anything_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file named like a method's folder or a run's: the command refuses before it makes
    any folder or lock (it made the others', then failed with 'Not a directory'), and the dry
    run says so (it said train)."""
    out = tmp_path / "runs"
    (out / "dry").mkdir(parents=True)
    (out / "dry" / "fedfull").write_text("not a folder")
    status, lines = _dry(out, capsys)
    assert status == 2
    assert lines["fedfull seed 1"].startswith("refuse: ") and "is a file" in lines["fedfull seed 1"]
    assert lines["fedavg seed 1"].startswith("train: ")
    capsys.readouterr()
    assert main(["run", *_args(out)]) == 2
    assert "fedfull is a file, not a folder" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "dry").iterdir()) == ["fedfull"]  # nothing made


def test_a_resume_of_a_run_whose_config_json_is_torn_is_refused_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a bare JSON error naming no file, from the command and the dry run alike (which
    then printed no plan)."""
    out = tmp_path / "runs"
    cfg = _cfg(out)
    assert run_one(cfg, "fedfull", 2, stop_after=0) is None
    record = run_dir(cfg, "fedfull", 2) / "config.json"
    record.write_text("{")
    status, lines = _dry(out, capsys, "--resume")
    assert status == 2
    assert lines["fedfull seed 2"].startswith(f"refuse: --resume: {record} cannot be read")
    assert main(["run", *_args(out), "--resume"]) == 2
    assert f"--resume: {record} cannot be read" in capsys.readouterr().err


def test_a_run_in_progress_in_another_process_is_refused_as_the_command_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dry run while the sweep runs: the command would be refused at the folder another
    process holds (its lock), and the dry run says so (without taking the lock)."""
    import fcntl
    import os
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("the lock is read from Linux's /proc/locks")
    out = tmp_path / "runs"
    folder = run_dir(_cfg(out), "fedavg", 2)
    folder.mkdir(parents=True)
    fd = os.open(folder / "run.lock", os.O_RDWR | os.O_CREAT)
    try:  # held as another process would hold it (not through this process's RunLock)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"PID 4242 on elsewhere since now\n")
        status, lines = _dry(out, capsys)
        assert status == 2
        assert lines["fedavg seed 2"] == (
            f"refuse: {folder} is in use by another fedlore run (PID 4242 on elsewhere since "
            "now); wait for it to finish, stop it, or give this run another name=..."
        )
        assert main(["run", *_args(out)]) == 2
        assert "is in use by another fedlore run (PID 4242" in capsys.readouterr().err
    finally:
        os.close(fd)
    status, lines = _dry(out, capsys)  # released: nothing in the way
    assert status == 0 and lines["fedavg seed 2"] == "train: trains 3 rounds"


def test_a_dry_run_counts_rounds_as_the_interrupt_message_does(tmp_path: Path) -> None:
    """FedLore's setup round (-1) is not one of the run's rounds: a run killed after it is said
    to hold "the setup round", and one killed after round 1 "2 complete round(s) and the setup
    round" (the interrupt message's count: "stopped after 2 complete rounds")."""
    from fedlore.dry_run import plan_runs

    cfg = _cfg(tmp_path / "runs", "algorithms=[fedlore]", "seeds=[1]")
    assert run_one(cfg, "fedlore", 1, stop_after=-1) is None
    (p,) = plan_runs(cfg)
    assert p.why == (
        "starts over, discarding the setup round of the unfinished run there (--resume "
        "continues it)"
    )
    (p,) = plan_runs(cfg, resume=True)
    assert (p.action, p.why) == ("continue", "continues after its setup round (round -1)")
    assert run_one(cfg, "fedlore", 1, resume=True, stop_after=1) is None
    (p,) = plan_runs(cfg)
    assert p.why.startswith("starts over, discarding the 2 complete round(s) and the setup round")
