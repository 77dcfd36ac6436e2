"""Rerunning a finished run never replaces it unasked (issue 29, item 1), end to end.

* The same command again says each finished method x seed is finished and where, trains nothing
  (every file of the run keeps its bytes and its modification time) and exits 0; the unfinished
  runs of the same experiment run.
* A finished run of another config, of other data, or whose record is not whole (``config.json``
  or ``summary.json`` unreadable or missing, a summary emptied or of another method, no
  ``metrics.jsonl``) is refused, with and without ``--resume``, and left as it was.
* ``--overwrite`` retrains, in ``seed-<s>.overwrite``: until the new run has finished, the finished
  one stays whole in its folder (an interrupted replacement leaves it byte for byte, and a report
  shows it); ``--resume`` continues the replacement exactly; the swap at the end leaves no other
  folder behind, also where two folders cannot be exchanged in one step, and a swap a kill cut in
  two is completed by the next run.
* Under ``engine=flower-sim`` a finished run is reported without starting the simulation.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from interrupting import Interrupt

from fedlore import progress
from fedlore.cli import ENGINES, main
from fedlore.config import Config, ConfigError, effective_overrides, load_config
from fedlore.dry_run import plan_runs
from fedlore.engine import rerun
from fedlore.engine.rerun import staging_dir
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_experiment, run_one
from fedlore.results.store import load_runs

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def _args(out: Path, *extra: str) -> list[str]:
    return [
        str(QUICKSTART),
        "name=rerun",
        "num_clients=3",
        "rounds=3",
        "local_steps=2",
        "batch_size=16",
        "rank=4",
        "model.kwargs={hidden: [16]}",
        "algorithms=[fedavg]",
        "seeds=[0]",
        f"output_dir={out}",
        *extra,
    ]


def _cfg(out: Path, *extra: str) -> Config:
    path, *overrides = _args(out, "progress=false", *extra)
    return load_config(Path(path), overrides)


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of a run folder but its lock (whose holder line each run rewrites): bytes and
    modification time."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }


def _rounds(folder: Path) -> list[int]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["round"] for line in lines if line.strip()]


def _no_timing(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if not (k.endswith("_s") or "_s_" in k)}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p != folder)


def _finished_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[Path, dict[str, tuple[bytes, int]]]:
    """Run the tiny config to the end: its folder and its files' state, output cleared."""
    assert main(["run", *_args(tmp_path)]) == 0
    folder = run_dir(_cfg(tmp_path), "fedavg", 0)
    before = _files(folder)
    capsys.readouterr()
    return folder, before


def test_the_same_command_again_reports_the_finished_run_and_trains_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, before = _finished_run(tmp_path, capsys)
    assert main(["run", *_args(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert f"fedavg seed 0: finished already; results in {folder}" in captured.err
    assert "--overwrite trains it again" in captured.err
    assert "starting over" not in captured.err and "round 1/3" not in captured.err
    assert _files(folder) == before  # not one byte rewritten
    assert f"results in {tmp_path / 'rerun'}/" in captured.out  # the table, then where
    assert "| fedavg | 1 |" in captured.out


def test_a_copied_experiment_under_another_name_reports_its_finished_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``name`` names the folder and decides no result: a copy of the experiment folder, run
    under its new name, is the same config (it was refused as ``name: 'rerun' -> 'copy'``)."""
    _finished_run(tmp_path, capsys)
    shutil.copytree(tmp_path / "rerun", tmp_path / "copy")
    copied = tmp_path / "copy" / "fedavg" / "seed-0"
    before = _files(copied)
    assert main(["run", *_args(tmp_path), "name=copy"]) == 0
    assert f"fedavg seed 0: finished already; results in {copied}" in capsys.readouterr().err
    assert _files(copied) == before  # nothing trained or rewritten


def test_an_experiment_reruns_only_its_unfinished_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    both = ("algorithms=[fedavg, fedfull]", "seeds=[0, 1]")
    cfg = _cfg(tmp_path, *both)
    run_one(cfg, "fedavg", 0)
    run_one(cfg, "fedfull", 1)
    assert run_one(cfg, "fedfull", 0, stop_after=0) is None  # killed after its first round
    finished = {(m, s): _files(run_dir(cfg, m, s)) for m, s in (("fedavg", 0), ("fedfull", 1))}
    capsys.readouterr()
    assert main(["run", *_args(tmp_path, *both)]) == 0
    err = capsys.readouterr().err
    for (method, seed), files in finished.items():
        assert f"{method} seed {seed}: finished already; results in" in err
        assert _files(run_dir(cfg, method, seed)) == files
    assert "round 3/3 fedfull seed 0" in err and "round 3/3 fedavg seed 1" in err
    for method, seed in (("fedfull", 0), ("fedavg", 1)):
        assert _rounds(run_dir(cfg, method, seed)) == [0, 1, 2]
        assert f"{method} seed {seed}: finished already" not in err


CHANGES = {
    "config": "holds a finished run of another config (rounds: 3 -> 2)",
    "data": "holds a finished run of this config made on other data (fingerprint "
    "0123456789abcdef -> ",
    "unreadable": "holds a finished run whose config.json is missing or unreadable",
    "no_config": "holds a finished run whose config.json is missing or unreadable",
    "torn_summary": "holds a finished run whose summary.json is unreadable",
    "empty_summary": "holds a finished run whose summary.json lacks method, seed, rounds, "
    "final_loss, bytes_up_total",
    "foreign_summary": "holds a finished run whose summary.json is fedfull's, not fedavg's",
    "other_seed": "holds a finished run whose summary.json is of seed 1, not of seed-0",
    "cut_metrics": "holds a finished run whose metrics.jsonl lacks the rows of rounds 1 to 2 "
    "(its summary counts 3 rounds)",
    "row_gone": "holds a finished run whose metrics.jsonl lacks the rows of round 1 (its "
    "summary counts 3 rounds)",
    "garbled_metrics": "holds a finished run whose metrics.jsonl has an unreadable line 4",
    "no_metrics": "holds a finished run whose metrics.jsonl is missing",
}


@pytest.mark.parametrize("resume", [False, True], ids=["rerun", "resume"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_finished_run_of_another_config_or_other_data_is_refused_and_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str, resume: bool
) -> None:
    """Refused the same way with and without ``--resume``: a run folder copied from another
    machine (experiments/runs/, continued by ``experiments/lr_grid.py``, which always resumes)
    is reported only when its record is whole and its config and data are this run's."""
    assert main(["run", *_args(tmp_path)]) == 0
    folder = run_dir(_cfg(tmp_path), "fedavg", 0)
    extra: tuple[str, ...] = ("--resume",) if resume else ()
    summary = json.loads((folder / "summary.json").read_text())
    if change == "config":
        extra += ("rounds=2",)
    elif change == "data":  # as if the files under data.root had changed since
        recorded = json.loads((folder / "config.json").read_text())
        recorded["data_fingerprint"] = "0123456789abcdef"
        (folder / "config.json").write_text(json.dumps(recorded))
    elif change == "unreadable":
        (folder / "config.json").write_text("{ torn")
    elif change == "no_config":
        (folder / "config.json").unlink()
    elif change == "torn_summary":
        (folder / "summary.json").write_text(json.dumps(summary)[:200])
    elif change == "empty_summary":
        (folder / "summary.json").write_text("{}")
    elif change == "foreign_summary":  # another method's summary copied into this folder
        (folder / "summary.json").write_text(json.dumps({**summary, "method": "fedfull"}))
    elif change == "other_seed":
        (folder / "summary.json").write_text(json.dumps({**summary, "seed": 1}))
    elif change in ("cut_metrics", "row_gone", "garbled_metrics"):
        lines = (folder / "metrics.jsonl").read_text().splitlines(keepends=True)
        kept = {"cut_metrics": lines[:1], "row_gone": [lines[0], lines[2]]}
        (folder / "metrics.jsonl").write_text("".join(kept.get(change, [*lines, "oops\n"])))
    else:
        (folder / "metrics.jsonl").unlink()
    before = _files(folder)
    capsys.readouterr()
    assert main(["run", *_args(tmp_path, *extra)]) == 2
    err = capsys.readouterr().err
    assert CHANGES[change] in err and "--overwrite" in err and "Traceback" not in err, err
    assert str(folder) in err
    assert _files(folder) == before
    replace = [a for a in extra if a != "--resume"]
    assert main(["run", *_args(tmp_path, *replace), "--overwrite"]) == 0
    rounds = 2 if change == "config" else 3
    assert json.loads((folder / "summary.json").read_text())["rounds"] == rounds
    assert _leftovers(folder) == []


def test_overwrite_keeps_the_finished_run_whole_until_the_new_one_has_finished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _cfg(tmp_path)
    assert run_one(old, "fedavg", 0) is not None
    folder = run_dir(old, "fedavg", 0)
    before = _files(folder)
    new = _cfg(tmp_path, "rounds=4", "lr=0.01")
    # interrupted twice (a kill after round 1, Ctrl-C in round 2): the finished run is untouched
    assert run_one(new, "fedavg", 0, overwrite=True, stop_after=1) is None
    assert _rounds(staging_dir(folder)) == [0, 1]
    assert _files(folder) == before
    with pytest.raises(KeyboardInterrupt):
        run_one(new, "fedavg", 0, overwrite=True, extra_callbacks=(Interrupt(2),))
    assert _files(folder) == before
    runs = load_runs(folder.parents[1])  # a report sees the finished run only
    assert [r.summary["rounds"] for r in runs["fedavg"]] == [3]
    capsys.readouterr()
    assert main(["run", *_args(tmp_path)]) == 0  # the finished run's own command
    err = capsys.readouterr().err
    assert "finished already" in err and "holds an interrupted --overwrite of it" in err
    assert _files(folder) == before
    with pytest.raises(ConfigError, match="holds a finished run of another config"):
        run_one(new, "fedavg", 0)  # without --overwrite: still refused
    summary = run_one(new, "fedavg", 0, overwrite=True)
    assert summary is not None and summary["rounds"] == 4
    assert json.loads((folder / "summary.json").read_text()) == summary
    assert _rounds(folder) == [0, 1, 2, 3]
    assert json.loads((folder / "config.json").read_text())["lr"] == 0.01
    assert _leftovers(folder) == []


def test_resume_continues_an_interrupted_overwrite_exactly(tmp_path: Path) -> None:
    run_one(_cfg(tmp_path), "fedavg", 0)
    folder = run_dir(_cfg(tmp_path), "fedavg", 0)
    new = _cfg(tmp_path, "rounds=4", "lr=0.01")
    assert run_one(new, "fedavg", 0, overwrite=True, stop_after=1) is None
    partial = (staging_dir(folder) / "metrics.jsonl").read_text().splitlines()
    resumed = run_one(new, "fedavg", 0, resume=True)
    assert resumed is not None and resumed["rounds"] == 4
    # rounds 0 and 1 were not trained again (their wall times are the interrupted run's)
    assert (folder / "metrics.jsonl").read_text().splitlines()[:2] == partial
    reference = run_one(_cfg(tmp_path / "reference", "rounds=4", "lr=0.01"), "fedavg", 0)
    assert reference is not None and _no_timing(resumed) == _no_timing(reference)
    assert _leftovers(folder) == []


def test_overwrite_then_resume_continues_an_interrupted_overwrite_of_an_experiment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An --overwrite of three methods interrupted in the second: the command the interrupt
    prints (the same line with --resume) keeps the run already replaced (bytes and times),
    continues the interrupted replacement from its checkpoint to the uninterrupted result, and
    replaces the run not reached yet; the record of the --overwrite then goes. --resume alone
    refused the old config's finished run, and --overwrite alone trained everything again."""
    from fedlore.cli import _resume_hint
    from fedlore.engine import overwriting

    methods = "algorithms=[fedavg,fedfull,fedprox]"
    old = [a if not a.startswith("algorithms=") else methods for a in _args(tmp_path)]
    assert main(["run", *old, "progress=false"]) == 0
    argv = [*old, "rounds=4", "lr=0.01", "--overwrite"]  # the later rounds= wins

    def config(*extra: str) -> Config:
        return load_config(Path(old[0]), [*old[1:], "rounds=4", "lr=0.01", "progress=false",
                                          *extra])  # fmt: skip

    new = config()
    stop = {"fedfull": [Interrupt(1)]}
    with pytest.raises(KeyboardInterrupt):
        run_experiment(new, overwrite=True, callbacks=lambda m, s: stop.get(m, []))
    record = tmp_path / "rerun" / overwriting.RECORD
    targets = [f"{m}/seed-0" for m in ("fedavg", "fedfull", "fedprox")]
    assert json.loads(record.read_text()) == {
        "finished": ["fedavg/seed-0"],
        "targets": targets,
        "started": ["fedavg/seed-0", "fedfull/seed-0"],  # fedfull: the run it was training
    }
    replaced = _files(run_dir(new, "fedavg", 0))
    fedfull = run_dir(new, "fedfull", 0)
    partial = (staging_dir(fedfull) / "metrics.jsonl").read_text()
    assert _rounds(run_dir(new, "fedprox", 0)) == [0, 1, 2]  # the old run, not reached
    with pytest.raises(ConfigError, match="holds a finished run of another config"):
        run_experiment(new, resume=True)
    hint = _resume_hint(["run", *argv])
    once = shlex.join(effective_overrides(argv))  # rounds=3 ... rounds=4: said once, as 4
    assert hint.startswith(f"`fedlore run {once} --resume`") and "rounds=3" not in hint
    capsys.readouterr()
    assert main(["run", *argv, "--resume"]) == 0
    assert "fedavg seed 0: finished already" in capsys.readouterr().err
    assert _files(run_dir(new, "fedavg", 0)) == replaced
    assert (fedfull / "metrics.jsonl").read_text().startswith(partial)  # not trained again
    for m in ("fedfull", "fedprox"):
        assert _rounds(run_dir(new, m, 0)) == [0, 1, 2, 3]
        assert json.loads((run_dir(new, m, 0) / "config.json").read_text())["lr"] == 0.01
        assert _leftovers(run_dir(new, m, 0)) == []
    reference = run_one(config(f"output_dir={tmp_path / 'reference'}"), "fedfull", 0)
    summary = json.loads((fedfull / "summary.json").read_text())
    assert reference is not None and _no_timing(summary) == _no_timing(reference)
    assert not record.exists()


def test_a_plain_resume_that_finishes_an_interrupted_overwrite_ends_its_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An --overwrite killed in its last run, finished by --resume alone (the runs it replaced
    are this config's, so nothing is refused): the record goes, so a later --overwrite --resume
    is refused instead of training the replaced run again (a newcomer's finding)."""
    from fedlore.engine import overwriting

    old = [a if not a.startswith("algorithms=") else "algorithms=[fedavg,fedfull]"
           for a in _args(tmp_path)]  # fmt: skip
    assert main(["run", *old, "progress=false"]) == 0
    new = load_config(Path(old[0]), [*old[1:], "lr=0.01", "progress=false"])
    stop = {"fedfull": [Interrupt(1)]}
    with pytest.raises(KeyboardInterrupt):
        run_experiment(new, overwrite=True, callbacks=lambda m, s: stop.get(m, []))
    record = tmp_path / "rerun" / overwriting.RECORD
    assert record.is_file()
    assert main(["run", *old, "lr=0.01", "--resume"]) == 0
    assert not record.exists()
    capsys.readouterr()
    assert main(["run", *old, "lr=0.01", "--resume", "--overwrite"]) == 2
    assert "holds none" in capsys.readouterr().err


def test_overwrite_of_the_same_config_retrains_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, before = _finished_run(tmp_path, capsys)
    assert main(["run", *_args(tmp_path), "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert f"replacing the finished run in {folder}" in err and "round 3/3 fedavg" in err
    after = _files(folder)
    assert after["metrics.jsonl"][1] != before["metrics.jsonl"][1]  # written anew
    assert _rounds(folder) == [0, 1, 2] and _leftovers(folder) == []


def test_the_swap_without_an_atomic_exchange_and_one_cut_in_two(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rerun, "_exchange", lambda a, b: False)  # a file system that cannot
    run_one(_cfg(tmp_path), "fedavg", 0)
    folder = run_dir(_cfg(tmp_path), "fedavg", 0)
    new = _cfg(tmp_path, "rounds=2")
    assert run_one(new, "fedavg", 0, overwrite=True) is not None
    assert _rounds(folder) == [0, 1] and _leftovers(folder) == []
    monkeypatch.undo()  # the next run may exchange folders again (or not: the same either way)
    # a kill between the two renames: the finished run moved aside, the new one not yet in place
    other = _cfg(tmp_path / "other", "rounds=2", "lr=0.01")
    run_one(other, "fedavg", 0)
    shutil.copytree(run_dir(other, "fedavg", 0), staging_dir(folder))
    folder.rename(folder.with_name(folder.name + rerun.REPLACED))
    replacement = _files(staging_dir(folder))
    again = run_experiment(_cfg(tmp_path, "rounds=2", "lr=0.01"))  # the next plain run
    assert again["fedavg"][0]["rounds"] == 2
    assert _files(folder) == replacement  # completed the swap, trained nothing
    assert _leftovers(folder) == []


def test_atomic_exchange_of_two_folders(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("in a")
    (b / "y").write_text("in b")
    if not rerun._exchange(a, b):
        pytest.skip("this system or file system has no renameat2(RENAME_EXCHANGE)")
    assert [p.name for p in a.iterdir()] == ["y"] and [p.name for p in b.iterdir()] == ["x"]


def test_a_finished_simulated_run_is_reported_without_starting_the_simulation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(tmp_path, "engine=flower-sim")
    finished = run_one(cfg, "fedavg", 0)  # in process: the same records as a simulated run
    before = _files(run_dir(cfg, "fedavg", 0))
    monkeypatch.setitem(sys.modules, "fedlore.flower.simulation", None)  # importing it fails
    assert run_experiment(cfg, engine=ENGINES["flower-sim"]()) == {"fedavg": [finished]}
    assert _files(run_dir(cfg, "fedavg", 0)) == before


@pytest.mark.parametrize("change", [(), ("lr=0.01",)], ids=["same_config", "other_config"])
def test_a_simulated_resume_continues_an_interrupted_replacement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: tuple[str, ...]
) -> None:
    """On flower-sim, --resume (and so --overwrite --resume) with an interrupted replacement of
    this config beside the finished run simulates that replacement again (from its checkpoint,
    as a resumed simulation does): it returned the finished run it was to replace (same config, so
    the record of the --overwrite went and the replacement was left behind) or refused it as
    another config's (the config changed)."""
    from fedlore.flower import simulation

    old = _cfg(tmp_path, "engine=flower-sim")
    assert run_one(old, "fedavg", 0) is not None  # in process: the same records
    new = _cfg(tmp_path, "engine=flower-sim", *change)
    assert run_one(new, "fedavg", 0, overwrite=True, stop_after=0) is None  # interrupted
    asked: dict[str, Any] = {}

    def capture(*args: Any, **kwargs: Any) -> Any:
        asked.update(kwargs, overwrite=args[4])
        raise RuntimeError("captured")

    monkeypatch.setattr(simulation, "make_apps", capture)
    with pytest.raises(RuntimeError, match="captured"):  # it simulates, not reports the old run
        simulation.run_simulated(new, "fedavg", 0, resume=True)
    assert (asked["restart"], asked["overwrite"]) == (True, False)
    # its clients' states beside it: the replacement continues from its checkpoint
    assert asked["state_dir"] == staging_dir(run_dir(new, "fedavg", 0)).resolve() / "clients"


def test_a_refused_second_overwrite_leaves_the_running_ones_record(tmp_path: Path) -> None:
    """A second `--overwrite` of an experiment another process is running is refused at its
    locks, before it touches the running one's record of what it has finished."""
    import subprocess

    from fedlore.engine import overwriting

    cfg = _cfg(tmp_path)
    assert run_one(cfg, "fedavg", 0) is not None
    record = tmp_path / "rerun" / overwriting.RECORD
    record.write_text('{"finished": ["fedavg/seed-0"]}')
    hold = (  # the other process, holding the run's lock
        "import sys, time; from fedlore.engine.lock import RunLock\n"
        "with RunLock(__import__('pathlib').Path(sys.argv[1])):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", hold, str(run_dir(cfg, "fedavg", 0))], stdout=subprocess.PIPE
    )
    try:
        assert other.stdout is not None and other.stdout.readline() == b"held\n"
        with pytest.raises(ConfigError, match="in use"):
            run_experiment(cfg, overwrite=True)
    finally:
        other.kill()
        other.wait()
    assert json.loads(record.read_text()) == {"finished": ["fedavg/seed-0"]}


def test_a_swap_whose_cleanup_is_cut_short_is_never_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the atomic exchange the sibling folder holds the replaced run, summary and all,
    until it is deleted: a kill (or a failed removal) before then must not leave it looking like
    a finished replacement, which the next run would swap back in, deleting the new run."""
    folder = run_dir(_cfg(tmp_path), "fedavg", 0)
    run_one(_cfg(tmp_path), "fedavg", 0)
    if not rerun._exchange(folder, folder):  # a same-path exchange: a no-op where supported
        pytest.skip("this system or file system has no renameat2(RENAME_EXCHANGE)")
    new = _cfg(tmp_path, "rounds=2")
    monkeypatch.setattr(rerun.shutil, "rmtree", lambda *a, **k: None)  # the removal cut short
    assert run_one(new, "fedavg", 0, overwrite=True) is not None
    monkeypatch.undo()
    assert _rounds(folder) == [0, 1]
    again = run_experiment(new)  # the next plain run keeps the new run
    assert again["fedavg"][0]["rounds"] == 2 and _rounds(folder) == [0, 1]


def _killed_after(what: Any) -> Any:
    """``what`` (a function of the swap) run for real and then a kill, like Ctrl-C."""

    def call(*args: Any, **kwargs: Any) -> Any:
        what(*args, **kwargs)
        raise KeyboardInterrupt

    return call


def test_a_swap_killed_right_after_its_exchange_keeps_the_new_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Between the atomic exchange and the next rename the sibling folder holds the replaced
    run, summary and all: a kill there left what looked like a finished replacement, which the
    next run swapped back in, deleting the new run. The journal tells the two apart."""
    folder = run_dir(_cfg(tmp_path), "fedavg", 0)
    run_one(_cfg(tmp_path), "fedavg", 0)
    if not rerun._exchange(folder, folder):
        pytest.skip("this system or file system has no renameat2(RENAME_EXCHANGE)")
    new = _cfg(tmp_path, "rounds=2")
    monkeypatch.setattr(rerun, "_exchange", _killed_after(rerun._exchange))
    with pytest.raises(KeyboardInterrupt):
        run_one(new, "fedavg", 0, overwrite=True)
    monkeypatch.undo()
    assert _rounds(folder) == [0, 1]  # the new run is in place ...
    assert _rounds(staging_dir(folder)) == [0, 1, 2]  # ... the replaced one beside it
    assert rerun.pending_replacement(folder) is None
    assert plan_runs(new)[0].action == "keep"  # the dry run says what the run does
    progress.enable(False)  # the deletion is told with progress: false too
    capsys.readouterr()
    again = run_experiment(new)  # the next plain run keeps the new run
    assert again["fedavg"][0]["rounds"] == 2 and _rounds(folder) == [0, 1]
    assert _leftovers(folder) == []
    told = f"fedlore: deleted the run that a swap cut short had replaced, beside {folder}"
    assert told in capsys.readouterr().err


def test_a_swap_killed_before_its_exchange_is_completed_by_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill once the journal is written but before the exchange: the sibling holds the
    finished replacement, which the next run swaps in (and a journal left by an earlier swap
    cut short, naming other folders, does not stop it)."""
    folder = run_dir(_cfg(tmp_path), "fedavg", 0)
    run_one(_cfg(tmp_path), "fedavg", 0)
    new = _cfg(tmp_path, "rounds=2")
    monkeypatch.setattr(rerun, "_exchange", _killed_after(lambda a, b: None))
    with pytest.raises(KeyboardInterrupt):
        run_one(new, "fedavg", 0, overwrite=True)
    monkeypatch.undo()
    assert _rounds(folder) == [0, 1, 2] and rerun.pending_replacement(folder) is not None
    stale = {"replacement": rerun._identity(folder), "replaced": rerun._identity(tmp_path)}
    (folder.parent / (folder.name + rerun.JOURNAL)).write_text(json.dumps(stale))
    assert rerun.pending_replacement(folder) == staging_dir(folder)
    again = run_experiment(new)
    assert again["fedavg"][0]["rounds"] == 2 and _rounds(folder) == [0, 1]
    assert _leftovers(folder) == []


def test_an_overwrite_killed_right_after_a_swap_keeps_that_replacement_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill after a replacement took its place but before the --overwrite recorded it as
    finished made --overwrite --resume train it again, discarding a finished result (a
    newcomer's finding: under DP, releases no ε counts). It is recorded before the swap."""
    from fedlore.engine import overwriting

    old = _cfg(tmp_path, "algorithms=[fedavg,fedfull]")
    run_experiment(old)
    new = _cfg(tmp_path, "algorithms=[fedavg,fedfull]", "lr=0.01")
    real = rerun.swap_in
    monkeypatch.setattr(overwriting, "swap_in", _killed_after(real), raising=False)
    monkeypatch.setattr("fedlore.experiment.swap_in", _killed_after(real), raising=False)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(new, overwrite=True)
    monkeypatch.undo()
    first = run_dir(new, "fedavg", 0)
    assert json.loads((first / "config.json").read_text())["lr"] == 0.01  # swapped in
    replaced = _files(first)
    assert plan_runs(new, resume=True, overwrite=True)[0].action == "keep"
    run_experiment(new, resume=True, overwrite=True)
    assert _files(first) == replaced  # kept, not trained again
    assert json.loads((run_dir(new, "fedfull", 0) / "config.json").read_text())["lr"] == 0.01


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_plain_run_that_completes_an_overwrites_swap_ends_it_as_if_uninterrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An --overwrite killed inside its last swap: the next plain run completes the swap, and
    left ``overwriting.json`` behind, which said the --overwrite was still going (a newcomer's
    finding). Every target finished, it goes: the experiment folder holds what an uninterrupted
    --overwrite leaves. A plain run replaces nothing, so a record of an --overwrite with a run
    still to replace (or an older one, naming no targets) stays for --overwrite --resume."""
    from fedlore.engine import overwriting

    run_experiment(_cfg(tmp_path))
    new = _cfg(tmp_path, "rounds=2")
    folder = run_dir(new, "fedavg", 0)
    record = tmp_path / "rerun" / overwriting.RECORD
    monkeypatch.setattr(rerun, "_exchange", _killed_after(lambda a, b: None))  # before it
    with pytest.raises(KeyboardInterrupt):
        run_experiment(new, overwrite=True)
    monkeypatch.undo()
    assert record.is_file() and rerun.pending_replacement(folder) is not None
    assert run_experiment(new)["fedavg"][0]["rounds"] == 2  # the swap completed, kept
    assert _rounds(folder) == [0, 1] and not record.exists()
    reference = tmp_path / "reference"
    run_experiment(_cfg(reference))
    run_experiment(_cfg(reference, "rounds=2"), overwrite=True)
    assert _tree(tmp_path / "rerun") == _tree(reference / "rerun")
    # interrupted while it trains: a plain run keeps the finished run and the record
    stop = [Interrupt(0)]
    with pytest.raises(KeyboardInterrupt):
        run_experiment(_cfg(tmp_path, "rounds=3"), overwrite=True, callbacks=lambda m, s: stop)
    assert run_experiment(new)["fedavg"][0]["rounds"] == 2 and record.is_file()
    assert run_experiment(_cfg(tmp_path, "rounds=3"), resume=True, overwrite=True)
    assert _rounds(folder) == [0, 1, 2] and not record.exists()
    record.write_text(json.dumps({"finished": ["fedavg/seed-0"]}))  # an older record
    run_experiment(_cfg(tmp_path, "rounds=3"))
    assert record.is_file()
