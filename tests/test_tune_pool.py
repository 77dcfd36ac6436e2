"""The worker processes of ``fedlore tune --workers`` kept for a whole search
(:func:`fedlore.tune_parallel.kept`): a job on a worker that ran others ends exactly as on a
fresh one (its federation a copy of the kept one, the torch generator a fresh process's), a
worker that dies is reported and replaced, and a search's batches share its workers."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from fedlore import progress
from fedlore import tune_parallel as parallel
from fedlore.config import apply_overrides, validate
from fedlore.tune_parallel import Ended, kept, run_jobs

RUN = [
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
]


def train(out: str, lr: float) -> None:
    """A job: one run of the tiny config at ``lr`` in ``out``."""
    from fedlore.experiment import run_experiment

    run_experiment(validate(apply_overrides({}, [*RUN, f"output_dir={out}", f"lr={lr}"])))


def spoil(out: str) -> None:
    """A job whose run changes its federation's tensors in place and draws from torch's
    generator (what a careless method might do)."""
    from fedlore.data.federation import build_federation

    fed = build_federation(validate(apply_overrides({}, [*RUN, f"output_dir={out}"])), 1)
    fed.pool.x.mul_(0)
    fed.train_labels.zero_()
    fed.train_indices[0][:] = 0
    torch.rand(1000)


def draw(path: str) -> None:
    Path(path).write_text(json.dumps(torch.rand(4).tolist()))


def pid(path: str) -> None:
    Path(path).write_text(str(os.getpid()))


def die(path: str) -> None:
    """A job whose process is killed while it runs."""
    pid(path)
    os.kill(os.getpid(), signal.SIGKILL)


def fail() -> None:
    raise ValueError("a bug")


def result(out: Path) -> tuple[list[dict[str, object]], dict[str, torch.Tensor]]:
    """A run's rows (without their timings) and its final server arrays."""
    run = out / "tiny/fedavg/seed-1"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]
    state = torch.load(run / "checkpoint.pt", weights_only=False)["server"]["arrays"]
    return rows, state


def test_a_job_after_others_on_one_worker_ends_as_it_does_alone(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Trial B after a job that spoils its federation (twice: once built, once kept) and trial
    A, all on one worker, equals B alone on a fresh one, bit for bit; B's federation was the
    kept one. A job draws from torch's generator as a fresh process does."""
    jobs = [
        ("spoil 1", (str(tmp_path / "s1"),)),
        ("spoil 2", (str(tmp_path / "s2"),)),
        ("A", (str(tmp_path / "a"), 0.3)),
        ("B", (str(tmp_path / "b"), 0.05)),
    ]
    progress.enable(True)
    try:
        with kept(1):  # one worker for both calls
            ended = run_jobs(spoil, jobs[:2], 1) + run_jobs(train, jobs[2:], 1)
    finally:
        progress.enable(False)
    assert [e.kind for e in ended] == ["done"] * 4
    err = capfd.readouterr().err
    assert "fedlore: B: the federation as built for the last run" in err
    assert run_jobs(train, [("B alone", (str(tmp_path / "alone"), 0.05))], 1)[0].kind == "done"
    rows, state = result(tmp_path / "b")
    alone_rows, alone_state = result(tmp_path / "alone")
    assert rows == alone_rows
    assert state.keys() == alone_state.keys()
    assert all(torch.equal(state[k], alone_state[k]) for k in state)
    draws = [("d1", (str(tmp_path / "d1"),)), ("d2", (str(tmp_path / "d2"),))]
    run_jobs(draw, draws, 1)
    assert (tmp_path / "d1").read_text() == (tmp_path / "d2").read_text()


def test_a_worker_that_dies_or_fails_is_reported_and_replaced(tmp_path: Path) -> None:
    """Kept workers serve one call after another; one killed during its job is reported as
    died and the next job goes to a new one, as after a job that failed (that worker ends) or
    a worker killed between two jobs; none outlives the pool."""

    def ran(target: object, name: str) -> Ended:
        (ended,) = run_jobs(target, [(name, (str(tmp_path / name),))], 1)  # type: ignore[arg-type]
        return ended

    with kept(1):
        assert ran(pid, "p1") == Ended("p1", "done") and ran(pid, "p2") == Ended("p2", "done")
        first = int((tmp_path / "p1").read_text())
        assert int((tmp_path / "p2").read_text()) == first  # kept from one call to the next
        assert ran(die, "d") == Ended("d", "died", f"exit status {-signal.SIGKILL}")
        assert int((tmp_path / "d").read_text()) == first
        assert ran(pid, "p3") == Ended("p3", "done")
        second = int((tmp_path / "p3").read_text())
        assert second != first
        assert run_jobs(fail, [("bug", ())], 1) == [Ended("bug", "error", "ValueError: a bug")]
        deadline = time.monotonic() + 30
        while psutil.pid_exists(second) and psutil.Process(second).status() != "zombie":
            assert time.monotonic() < deadline, "the failed job's worker lives on"
            time.sleep(0.05)
        assert ran(pid, "p4") == Ended("p4", "done")
        third = int((tmp_path / "p4").read_text())
        assert third != second  # the failed job's worker ended
        os.kill(third, signal.SIGKILL)  # while idle
        assert parallel._open is not None
        (idle,) = parallel._open._workers
        deadline = time.monotonic() + 30
        while idle.proc.poll() is None:  # ended (all its threads: a zombie is not yet)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ran(pid, "p5") == Ended("p5", "done")
        fourth = int((tmp_path / "p5").read_text())
        assert fourth not in (first, second, third)
    assert not psutil.pid_exists(fourth)  # waited for by the pool


def test_a_search_keeps_its_workers_and_their_federation_from_batch_to_batch(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Four trials on two workers: each worker builds the federation for its first trial and
    gives its second the copy it kept (the trial's lines say which)."""
    from fedlore.tune import plan_search
    from fedlore.tune_study import run_search

    raw = apply_overrides(
        {},
        [
            *RUN,
            f"output_dir={tmp_path}",
            "tune.space={lr: 'log:1e-3:0.3'}",
            "tune.sampler=random",
            "tune.trials=4",
            "tune.workers=2",
        ],
    )
    search = plan_search(validate(raw), raw, "tiny.yaml")
    capfd.readouterr()
    progress.enable(True)
    try:
        outcome = run_search(search)
    finally:
        progress.enable(False)
    assert [r.state for r in outcome.rows] == ["complete"] * 4
    lines = capfd.readouterr().err.splitlines()
    built = [x.split(":")[1] for x in lines if "building the federation" in x]
    kept_ = [x.split(":")[1] for x in lines if "the federation as built for the last run" in x]
    assert sorted(built) == [" trial 0", " trial 1"]
    assert sorted(kept_) == [" trial 2", " trial 3"]
