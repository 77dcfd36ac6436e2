"""No run corrupts another, nothing is overwritten unasked, and a damaged file says what to do.

* two ``fedlore run`` processes on one run folder: the second is refused naming the first's PID,
  and the first run's ``metrics.jsonl`` holds its rounds in order; a lock left by a dead process
  is taken over;
* a fresh run that would delete a *finished* run of another config asks for ``--overwrite``;
* a damaged ``checkpoint.pt`` (truncated, garbage, empty, foreign, missing keys) and a damaged
  spilled client state are reported at the start of ``--resume`` naming the file and the ways
  out; ``output_dir=<a file>`` is refused;
* method values that spell numbers are stored as numbers; every invalid method value is
  reported at once; settings that would be ignored are implemented or refused.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedlore.cli import main
from fedlore.config import Config, ConfigError, load_config
from fedlore.engine.callbacks import DamagedCheckpoint
from fedlore.engine.lock import RunLock, RunLocked
from fedlore.engine.rundir import run_dir
from fedlore.engine.store import StoreError
from fedlore.experiment import run_experiment, run_one

SEED = 0
ROOT = Path(__file__).resolve().parents[2]


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "name=safe",
        "num_clients=3",
        "rounds=3",
        "local_steps=2",
        "batch_size=16",
        "rank=4",
        "model.kwargs={hidden: [16]}",
        "progress=false",
        "seeds=[0]",
        f"output_dir={out}",
        *extra,
    ]


QUICKSTART = ROOT / "experiments" / "quickstart.yaml"  # what `fedlore run` loads by default


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(QUICKSTART, _args(out, *extra))


def _rounds(path: Path) -> list[int]:
    return [json.loads(x)["round"] for x in path.read_text().splitlines() if x.strip()]


# --- 1. one run per folder -------------------------------------------------------------------


def test_two_concurrent_runs_of_one_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture, digits_npz: list[str]
) -> None:
    # digits from npz: the `fedlore run` process does not import scikit-learn
    args = _args(tmp_path, "algorithms=[fedavg]", "rounds=40", "local_steps=5", *digits_npz)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    first = subprocess.Popen(
        [sys.executable, "-m", "fedlore.cli", "run", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    lock = tmp_path / "safe" / "fedavg" / "seed-0" / "run.lock"
    try:
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text().strip()):  # the first run holds it
            assert first.poll() is None, first.communicate()[1].decode()
            assert time.monotonic() < deadline, "the first run never took its lock"
            time.sleep(0.1)
        assert main(["run", *args]) == 2
        err = capsys.readouterr().err
        assert f"PID {first.pid}" in err and "in use by another fedlore run" in err
    finally:
        _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr.decode()
    metrics = tmp_path / "safe" / "fedavg" / "seed-0" / "metrics.jsonl"
    assert _rounds(metrics) == list(range(40))  # one run's rounds, in order
    summary = json.loads((metrics.parent / "summary.json").read_text())
    assert summary["rounds"] == 40


def test_a_held_folder_refuses_a_second_run_and_a_dead_holder_is_stale(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    out = run_dir(cfg, "fedavg", SEED)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from fedlore.engine.lock import RunLock\n"
            f"with RunLock(Path({str(out)!r})):\n    print('held', flush=True); time.sleep(60)",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        with pytest.raises(RunLocked, match=f"PID {holder.pid} on "):
            run_one(cfg, "fedavg", SEED)
        assert not (out / "metrics.jsonl").exists()  # refused before anything was written
    finally:
        holder.kill()
        holder.wait()
    # the holder died (SIGKILL: no cleanup ran); its lock file remains but is stale
    assert (out / "run.lock").read_text().startswith(f"PID {holder.pid}")
    assert run_one(cfg, "fedavg", SEED) is not None


def test_the_lock_is_released_when_a_run_fails(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    out = run_dir(cfg, "fedavg", SEED)

    class Boom(Exception):
        pass

    class Explode:
        def on_round_end(self, rnd: int, row: dict, state: object) -> None:
            raise Boom

    with pytest.raises(Boom):
        run_one(cfg, "fedavg", SEED, extra_callbacks=(Explode(),))
    assert not (out / "run.lock").exists()  # removed on the way out, as by a finished run
    with RunLock(out):  # free again
        pass


def test_a_finished_run_folder_has_no_lock_and_a_second_run_after_it_works(
    tmp_path: Path,
) -> None:
    """A finished run folder kept ``run.lock`` (a newcomer's finding): the lock file goes when
    the run ends, and the next run of the folder takes and removes it again."""
    cfg = _cfg(tmp_path, "algorithms=[fedavg]")
    out = run_dir(cfg, "fedavg", SEED)
    first = run_experiment(cfg)["fedavg"][0]
    assert (out / "summary.json").is_file() and not (out / "run.lock").exists()
    assert run_experiment(cfg)["fedavg"][0] == first  # reported, locked and released again
    assert not (out / "run.lock").exists()
    replaced = run_one(_cfg(tmp_path, "rounds=2"), "fedavg", SEED, overwrite=True)
    assert replaced is not None and replaced["rounds"] == 2  # swapped in, with the lock it held
    assert not (out / "run.lock").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["seed-0"]
    with RunLock(out):  # the folder is free, and still held against a second process
        assert subprocess.run([sys.executable, "-c", _TRY.format(folder=str(out))],
                              capture_output=True, text=True).stdout == "in use"  # fmt: skip
    assert not (out / "run.lock").exists()


_TRY = """
from pathlib import Path
from fedlore.engine.lock import RunLock, RunLocked
try:
    RunLock(Path({folder!r})).__enter__()
except RunLocked:
    print("in use", end="")
"""


def test_a_lock_file_removed_between_its_open_and_its_lock_is_opened_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that opened ``run.lock`` just before its holder removed it (on release) and
    locked it after must not hold the folder: the file it locked is no longer the folder's
    ``run.lock``, which a third process may create and lock. It opens the path again."""
    import fcntl

    import fedlore.engine.lock as lock

    folder = tmp_path / "a"
    folder.mkdir()
    real, opened = os.open, list[Path]()

    def open_then_removed(path: Path, *args: int) -> int:
        fd = real(path, *args)
        if not opened:  # the holder's release, right after this open
            opened.append(path)
            os.unlink(path)
        return fd

    monkeypatch.setattr(lock.os, "open", open_then_removed)
    with RunLock(folder):
        monkeypatch.undo()
        assert opened  # opened once, removed, opened again
        other = os.open(folder / "run.lock", os.O_RDWR)  # what a third process finds there
        try:
            with pytest.raises(BlockingIOError):  # held
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)


def test_a_folder_the_lock_made_goes_when_nothing_was_written_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run refused after it took its folders' locks left empty folders (before, holding only
    ``run.lock``, which the report skips): a folder the lock created goes with the lock when
    it is empty; one that was there stays, and one removed under a process about to lock it
    is made again."""
    import fedlore.engine.lock as lock

    with RunLock(tmp_path / "new" / "seed-0"):
        pass
    assert not (tmp_path / "new").exists()  # its method folder too: the lock made both
    (tmp_path / "out").mkdir()
    with RunLock(tmp_path / "out" / "a" / "seed-0"), RunLock(tmp_path / "out" / "a" / "seed-1"):
        (tmp_path / "out" / "a" / "seed-1" / "metrics.jsonl").write_text("")  # a run's file
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["a", "metrics.jsonl", "seed-1"]
    with RunLock(tmp_path / "out" / "b" / "seed-0"):  # the method folder of a run that never ran
        pass
    assert not (tmp_path / "out" / "b").exists() and (tmp_path / "out").is_dir()  # not made: kept
    (tmp_path / "kept").mkdir()
    with RunLock(tmp_path / "kept"):
        pass
    assert (tmp_path / "kept").is_dir() and not list((tmp_path / "kept").iterdir())
    real, removed = os.open, list[Path]()

    def folder_removed(path: Path, *args: int) -> int:
        if not removed:  # its last holder removed the empty folder after this mkdir
            removed.append(path)
            os.rmdir(Path(path).parent)
        return real(path, *args)

    monkeypatch.setattr(lock.os, "open", folder_removed)
    with RunLock(tmp_path / "kept"):
        monkeypatch.undo()
        assert removed and (tmp_path / "kept" / "run.lock").is_file()


# --- 2. nothing is overwritten unasked --------------------------------------------------------


def test_a_finished_run_of_another_config_needs_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["run", *_args(tmp_path, "algorithms=[fedavg]")]) == 0
    metrics = tmp_path / "safe" / "fedavg" / "seed-0" / "metrics.jsonl"
    before = metrics.read_text()
    capsys.readouterr()
    assert main(["run", *_args(tmp_path, "algorithms=[fedavg]", "rounds=2", "lr=0.01")]) == 2
    err = capsys.readouterr().err
    assert "holds a finished run of another config" in err and "--overwrite" in err
    assert "lr: 0.003 -> 0.01" in err and "rounds: 3 -> 2" in err and "hyper.lr" not in err
    assert metrics.read_text() == before  # untouched
    # the same config again is reported finished (exit 0); --overwrite replaces the other one
    assert main(["run", *_args(tmp_path, "algorithms=[fedavg]")]) == 0
    assert main(["run", *_args(tmp_path, "algorithms=[fedavg]", "rounds=2"), "--overwrite"]) == 0
    assert _rounds(metrics) == [0, 1]
    assert f"results in {tmp_path / 'safe'}/" in capsys.readouterr().out


# --- 4. damaged files --------------------------------------------------------------------------


def _damage(kind: str, path: Path) -> None:
    good = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "garbage":
        path.write_bytes(os.urandom(4096))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "foreign":  # a pickle that weights_only refuses
        path.write_bytes(pickle.dumps(Config()))
    elif kind == "missing_keys":
        torch.save({"round": 101}, path)


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty", "foreign", "missing_keys"])
def test_a_damaged_checkpoint_names_the_file_and_the_ways_out(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture
) -> None:
    cfg = _cfg(tmp_path)
    assert run_one(cfg, "fedavg", SEED, stop_after=0) is None
    ckpt = run_dir(cfg, "fedavg", SEED) / "checkpoint.pt"
    _damage(kind, ckpt)
    with pytest.raises(DamagedCheckpoint, match="is damaged and cannot be read") as e:
        run_one(cfg, "fedavg", SEED, resume=True)
    msg = str(e.value)
    assert str(ckpt) in msg and "without --resume" in msg and f"remove {ckpt}" in msg
    assert "weights_only" not in msg
    reason = {
        "garbage": "not a PyTorch checkpoint",
        "foreign": "not a PyTorch checkpoint",  # a plain pickle: not torch.save's zip archive
        "empty": "the file is empty",
        "missing_keys": "not a fedlore checkpoint",
    }.get(kind)
    if reason is not None:
        assert reason in msg, msg
    # the command line says the same in one line, exit status 2
    args = [*_args(tmp_path), "algorithms=[fedavg]", "--resume"]
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlore: error: the checkpoint") and "Traceback" not in err
    assert run_one(cfg, "fedavg", SEED) is not None  # the way out: start over


def test_a_damaged_spilled_state_is_found_when_the_resume_starts(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "store.max_memory_mb=1e-6")  # every client state spills to a file
    assert run_one(cfg, "fedlore", SEED, stop_after=0) is None
    spilled = sorted((run_dir(cfg, "fedlore", SEED) / "client_states").glob("*.pt"))
    assert spilled
    spilled[-1].write_bytes(b"not a tensor file")
    with pytest.raises(StoreError, match=r"spilled state of client \d+ .* is missing or damaged"):
        run_one(cfg, "fedlore", SEED, resume=True)


def test_output_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "results.txt"
    f.write_text("mine")
    assert main(["run", *_args(f, "algorithms=[fedavg]")]) == 2
    assert f"output_dir: {f} is a file, not a folder" in capsys.readouterr().err
    assert f.read_text() == "mine"
    # a path below a file, and a run name that is a file: the same clear error, no traceback
    assert main(["run", *_args(f / "sub", "algorithms=[fedavg]")]) == 2
    assert f"output_dir: {f} is a file, not a folder" in capsys.readouterr().err
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "safe").write_text("mine too")
    assert main(["run", *_args(tmp_path / "runs", "algorithms=[fedavg]")]) == 2
    assert f"name: {tmp_path / 'runs' / 'safe'} is a file" in capsys.readouterr().err


def test_a_spill_dir_in_the_way_is_refused_before_any_run_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``store.spill_dir`` is checked with the output folder, in the command and its dry run:
    not when the first run builds its store (after the earlier methods had trained), and not
    said to train by a dry run."""
    f = tmp_path / "states.txt"
    f.write_text("mine")
    args = _args(tmp_path / "out", "algorithms=[fedavg,fedlore]", f"store.spill_dir={f / 'x'}")
    for dry in ([], ["--dry-run"]):
        assert main(["run", *args, "store.max_memory_mb=1e-6", *dry]) == 2
        assert f"store.spill_dir: {f} is a file, not a folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and f.read_text() == "mine"
    args = _args(tmp_path / "elsewhere", "algorithms=[fedavg]")
    # states never spill without a memory limit: the setting is not used, so not checked
    assert main(["run", *args, "store.max_memory_mb=null", f"store.spill_dir={f}"]) == 0


@pytest.mark.parametrize("key", ["store.spill_dir", "output_dir"])
def test_a_folder_that_cannot_hold_files_is_refused_even_as_root(
    tmp_path: Path, capsys: pytest.CaptureFixture, key: str
) -> None:
    """``/proc`` takes no new files, but ``os.access`` says it is writable to root (these tests
    run as root in CI): the up-front check creates a file to find out, so the command and its
    dry run refuse it in one line before any run trains, not when a run builds its store."""
    assert os.access("/proc", os.W_OK | os.X_OK) == (os.geteuid() == 0)  # the trap, as root
    where = Path("/proc") / f"fedlore-{key.replace('.', '-')}"
    out = where if key == "output_dir" else tmp_path / "out"
    args = [*_args(out, "algorithms=[fedavg]", "store.max_memory_mb=1e-6"), f"{key}={where}"]
    target = where / "safe" if key == "output_dir" else where
    for dry in ([], ["--dry-run"]):
        assert main(["run", *args, *dry]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(
            f"fedlore: error: {key}: cannot create or write {target} (/proc cannot hold files: "
        ), err
        assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "out").exists()


def test_a_read_only_folder_is_refused_as_a_write_there_would_be(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A folder without write permission: refused where a file cannot be written in it (not as
    root, who may write there anyway: then the run goes ahead), and the probe leaves no file."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        try:
            (ro / "try").write_text("")
            (ro / "try").unlink()
            writable = True
        except PermissionError:
            writable = False
        assert writable == (os.geteuid() == 0)
        args = _args(tmp_path / "out", "algorithms=[fedavg]", "store.max_memory_mb=1e-6")
        assert main(["run", *args, f"store.spill_dir={ro / 'spill'}", "--dry-run"]) == (
            0 if writable else 2
        )
        err = capsys.readouterr().err
        if not writable:
            assert f"({ro} cannot hold files: Permission denied; store.spill_dir=" in err
        assert list(ro.iterdir()) == [] and list((tmp_path).glob("**/.fedlore-probe-*")) == []
    finally:
        ro.chmod(0o700)


# --- 4. the command line and method values ---------------------------------------------------


def test_method_values_that_spell_numbers_are_stored_as_numbers(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "algorithms=[fedfull]", "method.fedfull.lr=1e-4", "rounds=1")
    assert cfg.method["fedfull"]["lr"] == pytest.approx(1e-4)
    run_one(cfg, "fedfull", SEED)
    written = json.loads((run_dir(cfg, "fedfull", SEED) / "config.json").read_text())
    assert written["method"]["lr"] == 1e-4  # the run's own method section
    assert written["hyper"]["lr"] == 1e-4


def test_every_invalid_method_value_is_reported_at_once(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        "algorithms=[fedlore, fedavg]",
        "method.fedlore.rank=four",
        "method.fedlore.nonsense=1",
        "method.fedavg.lr=fast",
        "method.fedmagic.lr=1",
    )
    with pytest.raises(ConfigError) as e:
        run_experiment(cfg)
    msg = str(e.value)
    for part in ("rank", "nonsense", "lr", "fedmagic"):
        assert part in msg, msg
    assert not (tmp_path / "safe").exists()


def test_every_out_of_range_value_of_a_method_and_of_every_method(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        "algorithms=[fedlore, fedfull]",
        "method.fedlore.lr=-1",
        "method.fedlore.candidate_svd=maybe",
        "method.fedfull.lr=-1",
        "method.fedfull.weight_decay=-5",
    )
    with pytest.raises(ConfigError) as e:
        run_experiment(cfg)
    msg = str(e.value)
    assert "method.fedlore.lr: Input should be greater than 0 (got -1)" in msg
    assert "method.fedlore.candidate_svd:" in msg
    assert "'auto', 'exact' or 'randomized'" in msg or "'auto', 'exact', 'randomized'" in msg
    assert "method.fedfull.lr: Input should be greater than 0 (got -1)" in msg
    assert "method.fedfull.weight_decay: Input should be greater than or equal to 0 (got -5)" in msg
    # problems found on the real model are collected over methods too
    wide = _cfg(tmp_path, "algorithms=[fedit, local_galore]", "rank=200")
    with pytest.raises(ConfigError) as e:
        run_experiment(wide)
    assert "method 'fedit'" in str(e.value) and "method 'local_galore'" in str(e.value)


def test_a_second_run_of_the_same_experiment_is_refused_before_it_redoes_anything(
    tmp_path: Path,
) -> None:
    """The first process is still on its second method: the second process must not retrain
    (and rewrite) the finished first method before it reaches the busy folder."""
    cfg = _cfg(tmp_path, "algorithms=[fedavg, fedfull]")
    run_one(cfg, "fedavg", SEED)  # the first method, finished
    finished = (run_dir(cfg, "fedavg", SEED) / "metrics.jsonl").read_bytes()
    busy = run_dir(cfg, "fedfull", SEED)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD.format(folder=str(busy))], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        with pytest.raises(RunLocked, match=f"PID {holder.pid}"):
            run_experiment(cfg)
    finally:
        holder.kill()
        holder.wait()
    assert (run_dir(cfg, "fedavg", SEED) / "metrics.jsonl").read_bytes() == finished


_HOLD = """
import sys, time
from pathlib import Path
from fedlore.engine.lock import RunLock
with RunLock(Path({folder!r})):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_finite_but_absurd_loss_is_marked_diverged() -> None:
    from fedlore.results.divergence import divergence

    rows = [{"round": 0, "accepted": 3, "train_loss": 9.0, "loss": 3.4e35, "accuracy": 0.1}]
    assert "blew up" in divergence(rows)["diverged"]
    assert divergence([{**rows[0], "loss": 2.3}]) == {}
    regression = [{**rows[0], "rmse": 80.0, "loss": 3.2e3}]  # large targets: not judged so
    assert divergence(regression) == {}


# --- 5. no setting silently ignored ----------------------------------------------------------


@pytest.mark.parametrize("method", ["fedlore", "local_galore", "fedit", "ffa_lora"])
def test_local_evaluation_and_client_time_for_low_rank_and_lora(
    tmp_path: Path, method: str
) -> None:
    cfg = _cfg(tmp_path, f"algorithms=[{method}]", "eval.local=true", "rounds=2")
    summary = run_one(cfg, method, SEED)
    assert summary is not None
    assert 0.0 <= summary["local_accuracy"] <= 1.0  # P-local, the last round
    assert summary["client_train_s_per_round"] > 0


def test_a_matrix_the_rank_covers_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(
        tmp_path, "algorithms=[fedlore]", "rank=16", "rounds=1", "model.kwargs={hidden: [48, 16]}"
    )
    with caplog.at_level("WARNING", logger="fedlore.experiment_parts"):
        run_experiment(cfg)
    warned = [r.getMessage() for r in caplog.records if "is not projected" in r.getMessage()]
    assert warned == [
        "fedlore: body.2.weight 16x48 is not projected (min(m, n) = 16 <= rank 16): it trains "
        "densely"
    ]


def test_a_projection_that_costs_more_than_the_matrix_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """48 x 64 at rank 30 is projected by the seed's rule (min(m, n) > r), but r(m + n) = 3360
    numbers exceed the 3072 of the matrix; Bayesian FedLore names its mean and scale alike."""
    from fedlore.experiment_parts import describe_parameters, make_algorithm
    from fedlore.models import build_model

    cfg = _cfg(tmp_path, "rank=30", "model.kwargs={hidden: [48, 16]}")
    with caplog.at_level("WARNING", logger="fedlore.experiment_parts"):
        for method in ("fedlore", "fedlore_bayes"):
            model = build_model(cfg.model.name, (1, 8, 8), 10, **cfg.model.kwargs)
            describe_parameters(method, make_algorithm(method, cfg), model)
    costly = [r.getMessage() for r in caplog.records if "cost more" in r.getMessage()]
    assert [m.split(" is projected")[0] for m in costly] == [
        "fedlore: body.0.weight 48x64",
        "fedlore_bayes: body.0.weight_mu 48x64",
        "fedlore_bayes: body.0.weight_rho 48x64",
    ]
    assert "(r(m+n) = 3360 numbers) cost more than the matrix itself (3072)" in costly[0]


def test_data_root_for_embedded_digits_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no effect on source 'digits'"):
        run_experiment(_cfg(tmp_path, "data.root=/somewhere"))


def test_a_full_disk_when_the_lock_is_taken_is_one_line_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The lock file's holder line is the first byte a run writes (even one that only reports
    finished runs): a full disk there said only "No space left on device". Now the error names
    the lock file and says what to do, and the lock is not left held."""
    import errno

    import fedlore.engine.lock as lock

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock.os, "write", full)
    with pytest.raises(OSError, match=r"cannot write .*run\.lock: No space left on device"):
        RunLock(tmp_path / "a").__enter__()
    assert main(["run", *_args(tmp_path), "rounds=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run.lock: No space left on device (errno 28)" in err[0]
    assert "free" in err[0]  # the advice for a full disk
    monkeypatch.undo()
    with RunLock(tmp_path / "a"):  # released: the next run takes it
        pass
