"""A full disk, a quota, a lost permission or a read-only file system (issue 29, item 3), end to
end: the run stops with one line on standard error naming the file, the error and its errno and
what to do, exit status 2; no temporary file is left; the last checkpoint stays usable, so
``--resume`` finishes the run, exactly as an uninterrupted one, once the cause is gone.

The errors are injected where fedlore opens or writes a file (:mod:`fedlore.atomic`, ``os.write``
for the appended ``metrics.jsonl``), at the checkpoint, a spilled client state, ``config.json``,
``summary.json``, the report and a plot; and, where the test may mount one (root, ``mount``), a
real tmpfs too small for the run fills up.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedlore import atomic
from fedlore.cli import main
from fedlore.config import Config, load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
SEED = 0


def _args(out: Path, *extra: str) -> list[str]:
    return [
        str(QUICKSTART),
        "name=disk",
        "num_clients=3",
        "rounds=4",
        "local_steps=2",
        "batch_size=16",
        "rank=4",
        "model.kwargs={hidden: [16]}",
        "algorithms=[fedavg]",
        f"seeds=[{SEED}]",
        "progress=false",
        f"output_dir={out}",
        *extra,
    ]


def _cfg(out: Path, *extra: str) -> Config:
    path, *overrides = _args(out, *extra)
    return load_config(Path(path), overrides)


def _rounds(folder: Path) -> list[int]:
    text = (folder / "metrics.jsonl").read_text()
    assert text.endswith("\n")  # never a torn last line
    return [json.loads(line)["round"] for line in text.splitlines()]


def _no_timing(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if not (k.endswith("_s") or "_s_" in k)}


class _FillingUp:
    """A file on a disk that fills up: once ``room`` bytes are written, every write fails."""

    def __init__(self, f: Any, code: int, room: int) -> None:
        self.f, self.code, self.room = f, code, room

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            self.f.write(bytes(memoryview(data).cast("B")[: self.room]))
            self.room = 0
            raise OSError(self.code, os.strerror(self.code))
        self.room -= n
        return int(self.f.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> _FillingUp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def _fail(monkeypatch: pytest.MonkeyPatch, code: int, name: str, skip: int = 0) -> None:
    """Fail the write of the file whose name matches the regex ``name`` after ``skip`` good
    writes of it: a full disk or quota part-way through the file, a permission or read-only
    error when the temporary file is created."""
    real = atomic._open_temp
    seen = {"n": 0}

    def open_temp(tmp: Path, mode: str, compress: bool, **kwargs: Any) -> Any:
        # <name>.tmp, or <name>.<pid>.<thread>.tmp for a file several runs may write at once
        target = re.sub(r"(\.\d+\.\d+)?" + re.escape(atomic.TMP_SUFFIX) + "$", "", tmp.name)
        if re.fullmatch(name, target):
            seen["n"] += 1
            if seen["n"] > skip:
                if code in (errno.EACCES, errno.EROFS):
                    raise OSError(code, os.strerror(code), str(tmp))
                return _FillingUp(real(tmp, mode, compress, **kwargs), code, 200)
        return real(tmp, mode, compress, **kwargs)

    monkeypatch.setattr(atomic, "_open_temp", open_temp)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fedlore: error: cannot write ")
    return lines[0]


def _no_temporary_files(root: Path) -> None:
    assert not [p for p in root.rglob("*") if p.name.endswith(atomic.TMP_SUFFIX)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The summary of the run uninterrupted."""
    summary = run_one(_cfg(tmp_path_factory.mktemp("reference")), "fedavg", SEED)
    assert summary is not None
    return summary


def test_a_full_disk_at_a_checkpoint_is_one_line_and_resume_finishes_the_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    reference: dict[str, Any],
) -> None:
    folder = run_dir(_cfg(tmp_path), "fedavg", SEED)
    ckpt = folder / "checkpoint.pt"
    _fail(monkeypatch, errno.ENOSPC, "checkpoint.pt", skip=2)  # rounds 0 and 1 are saved
    assert main(["run", *_args(tmp_path)]) == 2
    assert _one_line(capsys) == (
        f"fedlore: error: cannot write {ckpt}: No space left on device (errno 28); the "
        "previous checkpoint is intact: free space and rerun with --resume"
    )
    _no_temporary_files(tmp_path)
    assert Checkpointer.load(ckpt)[0] == 1  # the last good checkpoint, readable
    assert _rounds(folder) == [0, 1, 2]  # round 2's row: dropped by the resume
    monkeypatch.undo()  # space freed
    assert main(["run", *_args(tmp_path), "--resume"]) == 0
    summary = json.loads((folder / "summary.json").read_text())
    assert _rounds(folder) == [0, 1, 2, 3]
    assert _no_timing(summary) == _no_timing(reference)


WRITES = [
    # (errno, file name regex, config overrides, good writes before the failure)
    (errno.EDQUOT, r"\d+\.\d+\.pt", ("algorithms=[fedlore]", "store.max_memory_mb=1e-6"), 3),
    (errno.EACCES, "summary.json", (), 0),
    (errno.EROFS, "config.json", (), 0),
    (errno.ENOSPC, "report.md", (), 0),
    (errno.EDQUOT, "accuracy_vs_round.png", (), 0),
]


@pytest.mark.parametrize(("code", "name", "extra", "skip"), WRITES)
def test_each_kind_of_file_and_error_is_one_line_and_the_way_out_works(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    code: int,
    name: str,
    extra: tuple[str, ...],
    skip: int,
) -> None:
    _fail(monkeypatch, code, name, skip)
    assert main(["run", *_args(tmp_path, *extra)]) == 2
    line = _one_line(capsys)
    m = re.fullmatch(r"fedlore: error: cannot write (\S+): (.+) \(errno (\d+)\); (.+)", line)
    assert m is not None, line
    path, reason, number, what_to_do = m.groups()
    assert re.fullmatch(name, Path(path).name) and Path(path).is_relative_to(tmp_path)
    assert (reason, int(number)) == (os.strerror(code), code)
    assert atomic.ADVICE[code] in what_to_do
    _no_temporary_files(tmp_path)
    monkeypatch.undo()
    exp = tmp_path / "disk"
    if name.startswith(("report", "accuracy")):  # the runs are saved: only the report is missing
        assert f"run `fedlore report {exp}`" in what_to_do
        assert main(["report", str(exp)]) == 0
    else:
        assert "rerun with --resume" in what_to_do or "run again" in what_to_do
        assert main(["run", *_args(tmp_path, *extra), "--resume"]) == 0
    method = "fedlore" if extra else "fedavg"
    assert _rounds(exp / method / f"seed-{SEED}") == [-1, 0, 1, 2, 3][(0 if extra else 1) :]
    assert (exp / "report.md").is_file() and (exp / "accuracy_vs_round.png").is_file()


def test_a_full_disk_while_appending_metrics_cuts_back_the_torn_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = run_dir(_cfg(tmp_path), "fedavg", SEED)
    real_write = os.write
    appended = {"n": 0}

    def write(fd: int, data: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            appended["n"] += 1
            if appended["n"] == 3:  # round 2's row: half of it fits
                real_write(fd, bytes(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to tell metrics.jsonl's descriptor")
    monkeypatch.setattr(os, "write", write)
    assert main(["run", *_args(tmp_path)]) == 2
    assert _one_line(capsys) == (
        f"fedlore: error: cannot write {folder / 'metrics.jsonl'}: No space left on device "
        f"(errno 28); the last checkpoint ({folder / 'checkpoint.pt'}) is intact: free space and "
        "rerun with --resume"
    )
    assert _rounds(folder) == [0, 1]
    monkeypatch.undo()
    assert main(["run", *_args(tmp_path), "--resume"]) == 0
    assert _rounds(folder) == [0, 1, 2, 3]


def test_a_failed_replace_keeps_the_old_file_and_unwraps_torch(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    atomic.write_text(path, "old")

    import torch

    with pytest.raises(atomic.WriteError) as e, atomic.replacing(path) as f:
        f.write(b"half")
        with pytest.raises(RuntimeError, match="enforce fail") as wrapped:
            torch.save({"x": torch.zeros(1000)}, _FillingUp(f, errno.ENOSPC, 100))
        raise wrapped.value  # as torch raises it: an OSError inside a RuntimeError
    assert e.value.errno == errno.ENOSPC and str(e.value) == (
        f"cannot write {path}: No space left on device (errno 28)"
    )
    assert path.read_text() == "old" and not atomic.temp_path(path).exists()
    with pytest.raises(ValueError, match="not an OSError"), atomic.replacing(path) as f:
        f.write(b"new")
        raise ValueError("not an OSError")
    assert path.read_text() == "old" and not atomic.temp_path(path).exists()


# ---------------------------------------------------------------- a real tmpfs that fills up


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A mounted tmpfs (its size set by the test with ``mount -o remount``), unmounted after."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)  # fmt: skip
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _resize(mnt: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mnt)], check=True)


def test_a_real_tmpfs_too_small_for_the_run(
    tmp_path: Path, tmpfs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk holds the first checkpoint but not a second one beside it (the temporary file
    of the next round's): the run stops there, and resumes once the disk is larger."""
    big = ("model.kwargs={hidden: [256]}",)  # a checkpoint of ~80 KB
    probe = _cfg(tmp_path / "probe", *big, "rounds=1")
    run_one(probe, "fedavg", SEED)
    page = 4096
    pages = {
        p.name: math.ceil(p.stat().st_size / page) for p in run_dir(probe, "fedavg", SEED).iterdir()
    }
    room = sum(pages.values()) - pages["summary.json"] + 2  # round 0's files and a little
    assert room < sum(pages.values()) + pages["checkpoint.pt"] - 4
    _resize(tmpfs, room * page)
    args = _args(tmpfs, *big)
    assert main(["run", *args]) == 2
    line = _one_line(capsys)
    folder = tmpfs / "disk" / "fedavg" / f"seed-{SEED}"
    ckpt = folder / "checkpoint.pt"
    assert line.startswith(
        f"fedlore: error: cannot write {ckpt}: No space left on device (errno 28)"
    )
    assert line.endswith("free space and rerun with --resume")
    _no_temporary_files(tmpfs)
    assert Checkpointer.load(folder / "checkpoint.pt")[0] == 0
    _resize(tmpfs, 8 * 1024 * 1024)  # space freed
    assert main(["run", *args, "--resume"]) == 0
    assert _rounds(folder) == [0, 1, 2, 3]


def test_concurrent_writers_of_a_shared_file_never_take_each_others_temporary_file(
    tmp_path: Path,
) -> None:
    """Every run of an experiment that finishes writes the experiment's report and plots; two
    runs finishing at once (a sweep's parallel jobs) once failed with ``cannot write
    .../accuracy_vs_bytes.png: No such file or directory``: one writer's rename took the shared
    ``<name>.tmp`` from under the other's fsync. With ``shared=True`` each writer has its own
    temporary file, every write succeeds and the file holds one writer's whole content."""
    import multiprocessing as mp

    from fedlore.atomic import temp_path

    target = tmp_path / "report.md"
    assert temp_path(target) == tmp_path / "report.md.tmp"
    assert temp_path(target, shared=True) != temp_path(target)
    ctx = mp.get_context("fork")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_write_many, [(str(target), i) for i in range(4)])
    assert results == [200] * 4
    assert target.read_text() in {f"writer {i}\n" * 1000 for i in range(4)}
    assert not list(tmp_path.glob("*.tmp"))


def _write_many(path: str, who: int) -> int:
    from fedlore.atomic import write_text

    for _ in range(200):
        write_text(path, f"writer {who}\n" * 1000, shared=True)
    return 200


@pytest.mark.parametrize("name", [r"report\.md", r"report\.csv", r".*\.png"])
def test_a_report_on_a_read_only_folder_still_prints_its_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """``fedlore report`` where its files cannot be written: the table on standard output all
    the same, then one line naming the file and what to do (exit 2); the runs are untouched."""
    assert main(["run", *_args(tmp_path)]) == 0
    exp = tmp_path / "disk"
    summary = (exp / "fedavg" / f"seed-{SEED}" / "summary.json").read_bytes()
    capsys.readouterr()
    _fail(monkeypatch, errno.EROFS, name)
    assert main(["report", str(exp)]) == 2
    out, err = capsys.readouterr()
    assert "| method | seeds |" in out and "| fedavg | 1 |" in out, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedlore: error: cannot write "), err
    assert "the runs themselves are untouched" in lines[0]
    assert f"run `fedlore report {exp}` again" in lines[0]
    assert "or give --out DIR to write the report elsewhere" in lines[0]
    assert (exp / "fedavg" / f"seed-{SEED}" / "summary.json").read_bytes() == summary
    _no_temporary_files(tmp_path)


def test_a_read_only_experiment_reports_elsewhere_or_only_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Results one cannot write in (a colleague's, a read-only share): ``--print-only`` prints
    the table and writes nothing; ``--out DIR`` writes the report there (``DIR/<experiment>/``
    for an output folder of several) and nothing in the runs' folder."""
    assert main(["run", *_args(tmp_path)]) == 0
    exp = tmp_path / "disk"
    before = sorted(p.relative_to(exp) for p in exp.rglob("*") if p.name != "report.md")
    (exp / "report.md").unlink()
    capsys.readouterr()
    real = atomic._open_temp

    def read_only(tmp: Path, mode: str, compress: bool, **kwargs: Any) -> Any:
        if tmp.is_relative_to(exp):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp))
        return real(tmp, mode, compress, **kwargs)

    monkeypatch.setattr(atomic, "_open_temp", read_only)
    assert main(["report", str(exp), "--print-only"]) == 0
    out, err = capsys.readouterr()
    assert "| fedavg | 1 |" in out and not err, err
    assert main(["report", str(exp), "--out", str(tmp_path / "mine")]) == 0
    out, err = capsys.readouterr()
    assert "| fedavg | 1 |" in out and f"report written to {tmp_path / 'mine'}/report.md" in out
    text = (tmp_path / "mine" / "report.md").read_text(encoding="utf-8")
    assert "| fedavg | 1 |" in text and "![accuracy vs round](accuracy_vs_round.png)" in text
    assert (tmp_path / "mine" / "report.csv").is_file()
    assert (tmp_path / "mine" / "accuracy_vs_round.png").is_file()
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "all")]) == 0
    assert (tmp_path / "all" / "disk" / "report.md").is_file()
    assert "a folder per experiment under" in capsys.readouterr().out
    after = sorted(p.relative_to(exp) for p in exp.rglob("*"))
    assert after == before  # nothing written in the experiment folder
    with pytest.raises(SystemExit):  # one or the other
        main(["report", str(exp), "--out", str(tmp_path / "x"), "--print-only"])
    capsys.readouterr()
    run = exp / "fedavg" / f"seed-{SEED}"
    assert main(["report", str(exp), "--out", str(run / "plots")]) == 2  # inside a run's folder
    assert f"--out {run / 'plots'} is inside the run folder {run}" in capsys.readouterr().err
    other = tmp_path / "other"
    shutil.copytree(exp / "fedavg", other / "fedavg")  # another experiment's results
    assert main(["report", str(exp), "--out", str(other)]) == 2
    assert f"would write into {other}, in another experiment's folder" in capsys.readouterr().err
    assert main(["report", str(exp), "--out", str(other / "fedavg")]) == 2  # one of its folders
    assert not (other / "report.md").exists() and not (other / "fedavg" / "report.md").exists()
    # inside the reported experiment's own folder: among its method folders
    assert main(["report", str(exp), "--out", str(exp / "fedavg")]) == 2
    assert f"inside the experiment folder {exp} (among its method" in capsys.readouterr().err
    assert main(["report", str(tmp_path), "--out", str(exp)]) == 2  # would write exp/disk/
    assert not (exp / "fedavg" / "report.md").exists() and not (exp / "disk").exists()
