"""``fedlore tune --workers W`` (:mod:`fedlore.tune_study`, :mod:`fedlore.tune_parallel`): trials
proposed W at a time, before any of them trains, and trained each in a process of its own; a
trial pruned by comparison with the trials before its batch only; a cut-off batch proposed in
full, then resumed; what a worker process reports, its threads and output, and a signal passed
on to it once."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest

from fedlore.config import ConfigError, apply_overrides, validate
from fedlore.engine import interrupt
from fedlore.progress import say
from fedlore.tune import Search, plan_search
from fedlore.tune_outcome import Outcome
from fedlore.tune_parallel import Ended, run_jobs, threads_each
from fedlore.tune_study import BATCH, _ask, _pruner, _study, run_search

TINY = [
    "name=tiny",
    "rounds=2",
    "num_clients=3",
    "local_steps=5",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "partition.min_size=10",
    "progress=false",
    "algorithms=[fedavg]",
    "seeds=[1]",
    "data.selection_fraction=0.2",
    "threads=1",
    "device=cpu",
    "tune.space={lr: 'log:1e-3:0.3', local_steps: 'int:1:6'}",
    "tune.sampler=random",
    "tune.seed=3",
]


def plan(out: Path, *extra: str) -> Search:
    raw = apply_overrides({}, [*TINY, f"output_dir={out}", *extra])
    return plan_search(validate(raw), raw, "tiny.yaml")


def table(outcome: Outcome) -> list[tuple[int, str, dict[str, Any], float | None]]:
    return [(r.number, r.state, r.params, r.value) for r in outcome.rows]


def load(out: Path) -> optuna.Study:
    return optuna.load_study(study_name="tiny", storage=f"sqlite:///{out}/tiny/tune/study.db")


def test_trials_in_processes_of_their_own_equal_the_same_trials_in_turn(tmp_path: Path) -> None:
    """The random sampler proposes by the search seed and trial number alone, so the same
    trials result whatever the batches: each trained in a process of its own ends with the
    score it has trained here (one thread each), and the batches are recorded."""
    alone = run_search(plan(tmp_path / "alone", "tune.trials=3"))
    together = run_search(plan(tmp_path / "together", "tune.trials=3", "tune.workers=2"))
    assert table(together) == table(alone)
    assert [r.state for r in together.rows] == ["complete"] * 3
    study = load(tmp_path / "together")
    assert [t.user_attrs.get(BATCH) for t in study.trials] == [[0, 2], [0, 2], None]
    assert [t.user_attrs.get(BATCH) for t in load(tmp_path / "alone").trials] == [None] * 3
    assert (tmp_path / "together/tiny/tune/best.json").read_bytes() == (
        tmp_path / "alone/tiny/tune/best.json"
    ).read_bytes().replace(b"alone", b"together")


def test_a_batch_is_proposed_in_full_before_any_of_it_trains(tmp_path: Path) -> None:
    """TPE (constant liar) proposes each trial of a batch seeing its siblings as running, not
    finished: the proposals are made in this process, before a worker starts."""
    search = plan(tmp_path, "tune.sampler=tpe", "tune.workers=2")
    search.folder.mkdir(parents=True)
    study = _study(optuna.storages.RDBStorage(f"sqlite:///{search.folder / 'study.db'}"), search)
    batch = [_ask(study, search, 0, 2) for _ in range(2)]
    frozen = study.get_trials(deepcopy=False)
    assert [t.number for t in batch] == [0, 1]
    assert all(set(t.params) == {"lr", "local_steps"} for t in frozen)
    assert [t.state.name for t in frozen] == ["RUNNING", "RUNNING"]
    assert [t.user_attrs[BATCH] for t in frozen] == [[0, 2], [0, 2]]
    alone = _ask(study, search, 2, 1)
    assert BATCH not in study.trials[alone.number].user_attrs  # a batch of one is no batch


def test_a_cut_off_batch_is_proposed_in_full_then_resumed_to_the_same_end(tmp_path: Path) -> None:
    """A search killed between the two proposals of its first batch: the same command proposes
    the second as the uninterrupted search did (same batch), trains both, and ends alike."""
    whole = run_search(plan(tmp_path / "whole", "tune.trials=4", "tune.workers=2"))
    search = plan(tmp_path / "cut", "tune.trials=4", "tune.workers=2")
    search.folder.mkdir(parents=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{search.folder / 'study.db'}")
    _ask(_study(storage, search), search, 0, 2)  # then the kill
    storage.engine.dispose()
    resumed = run_search(search)
    assert table(resumed) == table(whole)
    attrs = [t.user_attrs.get(BATCH) for t in load(tmp_path / "cut").trials]
    assert attrs == [[0, 2], [0, 2], [2, 2], [2, 2]]


def test_a_cut_off_batch_continues_with_one_worker_as_its_own_batch(tmp_path: Path) -> None:
    """Continued with ``--workers 1``, the cut-off batch is still proposed in full (its second
    trial as a member of the batch), then the search goes on one trial at a time."""
    search = plan(tmp_path, "tune.trials=3", "tune.workers=2")
    search.folder.mkdir(parents=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{search.folder / 'study.db'}")
    _ask(_study(storage, search), search, 0, 2)
    storage.engine.dispose()
    out = run_search(plan(tmp_path, "tune.trials=3"))
    assert [r.state for r in out.rows] == ["complete"] * 3
    assert [t.user_attrs.get(BATCH) for t in load(tmp_path).trials] == [[0, 2], [0, 2], None]


def _median_search() -> Search:
    tune = SimpleNamespace(prune="median", prune_startup_trials=1, prune_warmup_rounds=0)
    return SimpleNamespace(cfg=SimpleNamespace(tune=tune))  # type: ignore[return-value]


def _finished(study: optuna.Study, score: float, batch: list[int] | None = None) -> None:
    trial = study.ask()
    if batch is not None:
        trial.set_user_attr(BATCH, batch)
    trial.report(score, 0)
    study.tell(trial, score)


def test_a_trial_is_pruned_by_the_trials_before_its_batch_alone() -> None:
    """Trial 1 (batch [1, 2]) scores 0.6 at round 0; trial 0 scored 0.5 and its sibling, trial
    2, finished first with 0.9. Against trial 0 alone it is above the median and goes on; had
    the sibling counted (median 0.7) it would be pruned. Proposed alone, a trial compares with
    every trial before it."""
    study = optuna.create_study(direction="maximize", pruner=_pruner(_median_search()))
    _finished(study, 0.5)
    trial = study.ask()
    trial.set_user_attr(BATCH, [1, 2])
    _finished(study, 0.9, [1, 2])
    trial.report(0.6, 0)
    assert not trial.should_prune()
    study.tell(trial, 0.6)
    later = study.ask()  # trial 3, alone: trials 0-2 (median 0.6) are before it
    later.report(0.55, 0)
    assert later.should_prune()
    again = study.ask()  # trial 4, in a batch from 3: trials 0-2 too
    again.set_user_attr(BATCH, [3, 2])
    again.report(0.62, 0)
    assert not again.should_prune()
    first = study.ask()  # trial 5, in a batch from 1: trial 0 alone (median 0.5, not 0.55)
    first.set_user_attr(BATCH, [1, 2])
    first.report(0.52, 0)
    assert not first.should_prune()


def test_several_workers_are_refused_off_the_in_process_engine_and_with_callbacks(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"--workers 2 \(tune.workers\) needs engine: local"):
        plan(tmp_path, "tune.workers=2", "engine=flower-sim")
    with pytest.raises(ConfigError, match=r"needs tune\.workers=1"):
        run_search(plan(tmp_path, "tune.workers=2"), callbacks=lambda n: [])
    with pytest.raises(ValueError, match="workers"):
        plan(tmp_path, "tune.workers=0")


@pytest.mark.parametrize(
    ("kind", "raised"),
    [
        ("interrupted", interrupt.Interrupted),
        ("oserror", OSError),
        ("error", RuntimeError),
        ("died", RuntimeError),
    ],
)
def test_how_a_worker_ended_decides_how_the_search_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, raised: type[BaseException]
) -> None:
    """An interrupt stops the search as one; a full disk raises the ``OSError`` (the trial stays
    running); an unexpected error or a process that ended without a word stops it, naming the
    trial; a trial that ended as it should is no reason to stop."""
    import fedlore.tune_parallel as parallel

    message = {"interrupted": str(int(signal.SIGTERM)), "died": "exit status -9"}.get(kind, "boom")

    def ended(target: Any, jobs: Any, workers: int) -> list[Ended]:
        return [Ended(jobs[0][0], "done"), Ended(jobs[1][0], kind, message)]

    monkeypatch.setattr(parallel, "run_jobs", ended)
    with pytest.raises(raised) as err:
        run_search(plan(tmp_path, "tune.trials=2", "tune.workers=2"))
    if kind == "interrupted":
        assert err.value.signum == signal.SIGTERM  # type: ignore[attr-defined]
    else:
        assert "trial 1" in str(err.value) and message in str(err.value)
    if kind == "died":
        assert "run the same command to resume it" in str(err.value)
    assert [t.state.name for t in load(tmp_path).trials] == ["RUNNING", "RUNNING"]


# --- the worker processes -------------------------------------------------------------------


def finish(path: str) -> None:
    """A job: record this process's threads and whether standard error looks like a terminal."""
    import sys

    import torch

    say("hello")
    Path(path).write_text(
        f"{torch.get_num_threads()} {os.environ['OMP_NUM_THREADS']} {sys.stderr.isatty()} "
        f"{os.getpgrp() == os.getpid()}"
    )


def fail(kind: str) -> None:
    if kind == "disk":
        raise OSError(28, "No space left on device")
    if kind == "bug":
        raise ValueError("a bug")
    os._exit(3)


def wait_for_signal(path: str) -> None:
    """A job that runs rounds of 50 ms until a signal stops it, as a trial would."""
    Path(path).write_text("started")
    with interrupt.deferred():  # as a trial's round loop: the signal is said, then raised
        for _ in range(1200):  # a minute at most: a signal that never comes fails the test
            time.sleep(0.05)
            interrupt.check()


def test_a_worker_reports_how_it_ended_with_its_share_of_threads_and_prefixed_lines(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedlore import progress

    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # this process's; each worker gets its share
    progress.enable(True)
    try:
        jobs = [("trial 7", (str(tmp_path / "a"),)), ("trial 8", (str(tmp_path / "b"),))]
        assert run_jobs(finish, jobs, 2) == [Ended("trial 7", "done"), Ended("trial 8", "done")]
    finally:
        progress.enable(False)
    share = threads_each(2)
    for name in "ab":
        assert (tmp_path / name).read_text() == f"{share} {share} False True"
    err = capfd.readouterr().err
    assert "fedlore: trial 7: hello" in err and "fedlore: trial 8: hello" in err
    failing = [("disk", ("disk",)), ("bug", ("bug",)), ("exit", ("exit",))]
    assert run_jobs(fail, failing, 2) == [
        Ended("disk", "oserror", "[Errno 28] No space left on device"),
        Ended("bug", "error", "ValueError: a bug"),
        Ended("exit", "died", "exit status 3"),
    ]
    assert threads_each(3, cpus=8) == 2 and threads_each(16, cpus=8) == 1


def test_a_signal_is_passed_on_once_and_no_other_job_starts(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM to this process while two jobs run: each gets it once (a second would kill it at
    once) and stops as a trial stops between rounds, saying so in a line named by its job
    (without the SIGTERM it was passed or a Ctrl-C hint that would not reach it); the third job
    never starts."""
    jobs = [(f"job {i}", (str(tmp_path / f"j{i}"),)) for i in range(3)]

    def send_when_started() -> None:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"j{i}").exists() for i in range(2)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send_when_started)
    sender.start()
    with interrupt.handling():
        ended = run_jobs(wait_for_signal, jobs, 2)
        assert interrupt.received() == signal.SIGTERM
    sender.join()
    assert ended == [
        Ended("job 0", "interrupted", str(int(signal.SIGTERM))),
        Ended("job 1", "interrupted", str(int(signal.SIGTERM))),
    ]
    assert not (tmp_path / "j2").exists()
    lines = capfd.readouterr().err.splitlines()
    for job in ("job 0", "job 1"):
        mine = [x for x in lines if x.startswith(f"fedlore: {job}: ")]
        assert mine == [f"fedlore: {job}: stopping before the next round (a round in progress "
                        "is discarded)"]  # fmt: skip
    # this process's own line, and the way to quit at once that a SIGTERM's sender has
    assert sum("send SIGTERM again to quit at once" in x for x in lines) == 1
    assert not any("Ctrl-C" in x for x in lines)
    assert sum("SIGTERM" in x for x in lines) == 1


def test_a_worker_on_a_terminal_writes_lines_not_bars(tmp_path: Path) -> None:
    """Standard error a terminal: each worker sees one that is not (its progress comes as lines;
    several progress bars on one terminal would overwrite each other)."""
    import pty

    leader, follower = pty.openpty()
    saved = os.dup(2)
    try:
        os.dup2(follower, 2)
        ended = run_jobs(finish, [("trial 1", (str(tmp_path / "t"),))], 1)
    finally:
        os.dup2(saved, 2)
        for fd in (saved, leader, follower):
            os.close(fd)
    assert ended == [Ended("trial 1", "done")]
    assert (tmp_path / "t").read_text().split()[2] == "False"


KILLED = """
import sys
from fedlore.config import apply_overrides, validate
from fedlore.tune import plan_search
from fedlore.tune_study import run_search
raw = apply_overrides({}, sys.argv[1:])
run_search(plan_search(validate(raw), raw, "tiny.yaml"))
"""


def test_a_search_killed_with_its_workers_resumes_to_the_same_end(tmp_path: Path) -> None:
    """SIGKILL to the search while both trials of its batch train: its worker processes end
    with it (none trains on, holding a trial's folder), and the same search again resumes both
    trials from their checkpoints and ends as the uninterrupted search."""
    import subprocess
    import sys

    import psutil

    extra = ["rounds=150", "eval.every=50", "tune.trials=2", "tune.workers=2"]
    whole = run_search(plan(tmp_path / "whole", *extra))
    out = tmp_path / "cut"
    args = [*TINY, f"output_dir={out}", *extra]
    proc = subprocess.Popen([sys.executable, "-c", KILLED, *args])
    metrics = [out / f"tiny/tune/trial-{n}/fedavg/seed-1/metrics.jsonl" for n in (0, 1)]
    deadline = time.monotonic() + 300
    while not all(m.is_file() and m.read_text().count("\n") >= 1 for m in metrics):
        assert proc.poll() is None and time.monotonic() < deadline, "the search did not start"
        time.sleep(0.05)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len(workers) >= 2
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, "a worker outlived the search"
    assert [t.state.name for t in load(out).trials] == ["RUNNING", "RUNNING"]
    cut = [m.read_text().count("\n") for m in metrics]
    assert all(0 < n < 150 for n in cut)  # cut off inside the 150 rounds
    assert table(run_search(plan(out, *extra))) == table(whole)


SCRIPT = """
from fedlore.config import apply_overrides, validate
from fedlore.tune import plan_search
from fedlore.tune_study import run_search

raw = apply_overrides({}, ARGS)
outcome = run_search(plan_search(validate(raw), raw, "tiny.yaml"))
print([r.state for r in outcome.rows])
"""


def test_a_script_without_a_main_guard_runs_workers(tmp_path: Path) -> None:
    """A user's script that calls the search at its top level (no ``if __name__ ==
    "__main__"``): the workers are fresh interpreters that never import it again (with
    ``multiprocessing``'s spawn each would, and fail)."""
    import subprocess
    import sys

    args = [*TINY, f"output_dir={tmp_path}", "tune.trials=2", "tune.workers=2"]
    script = tmp_path / "search.py"
    script.write_text(SCRIPT.replace("ARGS", repr(args)))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['complete', 'complete']"
