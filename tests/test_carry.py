"""``experiments/carry.py``: an unfinished run packed on one machine and unpacked on a fresh one
resumes to the result of an uninterrupted run; finished runs and runs further along are kept."""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import io
import json
import shutil
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from fedlore.atomic import WriteError
from fedlore.config import Config, load_config
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one

ROOT = Path(__file__).resolve().parents[1]


def _carry() -> ModuleType:
    spec = importlib.util.spec_from_file_location("carry", ROOT / "experiments" / "carry.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


carry = _carry()


def _over(out: Path) -> list[str]:
    return [
        "name=carry",
        "num_clients=3",
        "rounds=4",
        "local_steps=2",
        "batch_size=16",
        "rank=4",
        "model.kwargs={hidden: [16]}",
        "partition.min_size=10",
        "progress=false",
        f"output_dir={out}",
    ]


def _cfg(out: Path) -> Config:
    return load_config(None, _over(out))


def _untimed(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not (k.endswith("_s") or "_s_" in k)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return _untimed(a) == _untimed(b)


def test_a_packed_run_resumes_elsewhere_to_the_uninterrupted_result(tmp_path: Path) -> None:
    want = run_one(_cfg(tmp_path / "reference"), "fedlore", 1)
    assert want is not None

    here = _cfg(tmp_path / "here")
    assert run_one(here, "fedlore", 1, stop_after=2) is None  # killed after round 2
    assert run_one(here, "fedavg", 1) is not None  # finished: never packed
    root = Path(here.output_dir)
    assert carry.pack(root) == (1, [])
    archive = root / carry.ARCHIVE

    # a fresh clone: the committed archive and nothing else of the unfinished run
    there = tmp_path / "there"
    there.mkdir()
    shutil.copy(archive, there / carry.ARCHIVE)
    assert carry.unpack(there) == 1
    assert carry.unpack(there) == 0  # a second unpack keeps what is there
    cfg = _cfg(there)
    folder = run_dir(cfg, "fedlore", 1)
    assert json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])["round"] == 2
    got = run_one(cfg, "fedlore", 1, resume=True)
    assert got is not None and _same(got, want)
    assert not (run_dir(cfg, "fedavg", 1)).exists()

    # unpacking onto the finished run leaves it byte for byte
    summary = (folder / "summary.json").read_bytes()
    metrics = (folder / "metrics.jsonl").read_bytes()
    assert carry.unpack(there) == 0
    assert (folder / "summary.json").read_bytes() == summary
    assert (folder / "metrics.jsonl").read_bytes() == metrics

    # once every run has finished, pack removes the stale archive
    assert run_one(here, "fedlore", 1, resume=True) is not None
    assert carry.pack(root) == (0, []) and not archive.exists()


def _fake_run(root: Path, name: str, rnd: int) -> Path:
    """A run folder as a run killed after round ``rnd`` leaves it."""
    run = root / "t" / name / "seed-0"
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(f'{{"round": {r}}}\n' for r in range(rnd + 1)))
    torch.save({"round": rnd}, run / "checkpoint.pt")
    return run


def _archived(root: Path) -> dict[str, int]:
    return {
        str(run): carry._round(files)
        for run, files in carry.read_archive(root / carry.ARCHIVE).items()
    }


def test_pack_keeps_what_the_archive_holds_unless_superseded(tmp_path: Path) -> None:
    a = _fake_run(tmp_path, "a", 5)
    assert carry.pack(tmp_path) == (1, [])
    shutil.rmtree(a)  # a fresh clone, before unpack: only the archive
    assert carry.pack(tmp_path) == (1, [])  # never removed for want of local runs
    _fake_run(tmp_path, "b", 2)  # another table's run, packed beside it
    assert carry.pack(tmp_path) == (2, [])
    assert _archived(tmp_path) == {"t/a/seed-0": 5, "t/b/seed-0": 2}
    _fake_run(tmp_path, "a", 1)  # started over here, behind the archived copy
    carry.pack(tmp_path)
    assert _archived(tmp_path)["t/a/seed-0"] == 5
    assert carry.unpack(tmp_path) == 1  # the archived round 5 replaces round 1
    assert torch.load(a / "checkpoint.pt", weights_only=True)["round"] == 5
    assert len((a / "metrics.jsonl").read_text().splitlines()) == 6
    (a / "summary.json").write_text("{}")  # finished here: it leaves the archive
    carry.pack(tmp_path)
    assert _archived(tmp_path) == {"t/b/seed-0": 2}


def test_a_dp_runs_ledger_travels_with_it(tmp_path: Path) -> None:
    """A DP run's ``dp_ledger.json`` (releases a resume ran again) is packed and unpacked with
    its run: without it, the resume on the next machine would count ε without them."""
    run = _fake_run(tmp_path, "a", 3)
    (run / "dp_ledger.json").write_text('{"repeated_exchanges": 2}')
    carry.pack(tmp_path)
    shutil.rmtree(tmp_path / "t")  # a fresh clone: only the archive
    assert carry.unpack(tmp_path) == 1
    assert json.loads((run / "dp_ledger.json").read_text()) == {"repeated_exchanges": 2}


def test_unpack_never_writes_under_a_training_run(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "a", 3)
    carry.pack(tmp_path)
    (run / "checkpoint.pt").unlink()
    (run / "metrics.jsonl").write_text('{"round": 0}\n')  # started over, now training
    with open(run / "run.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert carry.unpack(tmp_path) == 0
    assert not (run / "checkpoint.pt").exists()
    assert carry.unpack(tmp_path) == 1  # once it stopped
    assert torch.load(run / "checkpoint.pt", weights_only=True)["round"] == 3


def test_a_bad_archive_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _fake_run(tmp_path, "a", 1)
    archive = tmp_path / carry.ARCHIVE
    for member, why in (
        ("../escape/seed-0/config.json", "refusing member '../escape/seed-0/config.json'"),
        ("in-progress.tar.gz", "refusing member 'in-progress.tar.gz'"),
        ("t/a/seed-0/config.json", "its run t/a/seed-0 has no checkpoint.pt"),
    ):
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(run / "config.json", arcname=member)
        assert carry.main(["unpack", "--root", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1
    for broken in (b"", b"not a tar", archive.read_bytes()[:40]):
        archive.write_bytes(broken)
        before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
        for action in ("unpack", "pack"):
            assert carry.main([action, "--root", str(tmp_path)]) == 2
            assert "cannot read it" in capsys.readouterr().err
        assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
    assert not (tmp_path.parent / "escape").exists()


def test_a_run_left_out_keeps_its_archived_copy_and_pack_says_so(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "a", 2)
    (run / "client_states").mkdir()
    (run / "client_states" / "0.pt").write_bytes(b"state")
    assert carry.pack(tmp_path) == (1, [])
    torch.save({"round": 4}, run / "checkpoint.pt")  # trained on, spilling, still training
    with open(run / "run.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert carry.main(["pack", "--root", str(tmp_path)]) == 1
    assert _archived(tmp_path) == {"t/a/seed-0": 2}
    assert carry.pack(tmp_path) == (1, [])  # stopped: packed at round 4
    assert _archived(tmp_path) == {"t/a/seed-0": 4}


def test_a_run_spilling_outside_its_folder_is_left_out_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``store.spill_dir`` the client states a checkpoint names live outside the run
    folder: packing the folder alone would carry a run no resume can continue. It is left out
    (pack exits 1, naming the setting); spilling inside the folder, it is packed whole and
    resumes elsewhere to the uninterrupted result."""
    spill = ["store.max_memory_mb=0.000001"]
    # an earlier unfinished run in the same folder spilled inside it, under the very file names
    # the new run's store gives: a fresh start clears them, or they would pass for the new run's
    earlier = load_config(None, [*_over(tmp_path / "a"), *spill, "lr=0.05"])
    assert run_one(earlier, "fedlore", 1, stop_after=1) is None
    folder = run_dir(earlier, "fedlore", 1)
    assert any((folder / "client_states").glob("*"))
    outside = load_config(
        None, [*_over(tmp_path / "a"), *spill, f"store.spill_dir={tmp_path / 'spill'}"]
    )
    assert run_one(outside, "fedlore", 1, stop_after=1) is None
    assert not (folder / "client_states").exists()
    assert carry.spilled_elsewhere(folder)  # the checkpoint names states the folder lacks
    assert carry.main(["pack", "--root", str(outside.output_dir)]) == 1
    assert "store.spill_dir keeps them elsewhere" in capsys.readouterr().out
    assert not (Path(outside.output_dir) / carry.ARCHIVE).exists()

    inside = load_config(None, [*_over(tmp_path / "b"), *spill])
    want = run_one(load_config(None, [*_over(tmp_path / "ref"), *spill]), "fedlore", 1)
    assert run_one(inside, "fedlore", 1, stop_after=1) is None
    assert any((run_dir(inside, "fedlore", 1) / "client_states").glob("*"))
    assert carry.pack(Path(inside.output_dir)) == (1, [])
    there = tmp_path / "there"
    there.mkdir()
    shutil.copy(Path(inside.output_dir) / carry.ARCHIVE, there / carry.ARCHIVE)
    assert carry.unpack(there) == 1
    got = run_one(load_config(None, [*_over(there), *spill]), "fedlore", 1, resume=True)
    assert got is not None and want is not None and _same(got, want)


def test_unpack_keeps_count_of_the_dp_releases_made_here(tmp_path: Path) -> None:
    """Machine B ran its own attempt of a DP run (rows 0-1 with its own noise) and then
    unpacks machine A's copy, further along: B's releases were made, so the restored ledger
    counts them (they vanished: a resume reported ε without them). Rows B holds that are the
    archive's own (an earlier unpack of the same run) are not counted again."""
    run = _fake_run(tmp_path, "a", 3)
    rows = "".join(f'{{"round": {r}, "dp_epsilon": {r + 1}.0}}\n' for r in range(4))
    (run / "metrics.jsonl").write_text(rows)
    (run / "dp_ledger.json").write_text('{"repeated_exchanges": 1}')
    carry.pack(tmp_path)
    shutil.rmtree(tmp_path / "t")
    run.mkdir(parents=True)  # machine B: its own attempt, killed after round 1
    mine = "".join(f'{{"round": {r}, "dp_epsilon": {r + 1}.5}}\n' for r in range(2))
    (run / "metrics.jsonl").write_text(mine)
    torch.save({"round": 1}, run / "checkpoint.pt")
    (run / "config.json").write_text("{}")
    assert carry.unpack(tmp_path) == 1
    assert json.loads((run / "dp_ledger.json").read_text()) == {"repeated_exchanges": 3}
    assert (run / "metrics.jsonl").read_text() == rows  # the archive's rows, restored
    (run / "checkpoint.pt").unlink()  # an unpack again, over the archive's own rows
    (run / "dp_ledger.json").write_text('{"repeated_exchanges": 1}')
    assert carry.unpack(tmp_path) == 1
    assert json.loads((run / "dp_ledger.json").read_text()) == {"repeated_exchanges": 1}


def test_training_asks_the_lock_without_making_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a run removes its run.lock when it ends: asking must not leave an empty one behind, even
    # when the run ends between a look at the folder and the open (played by a look that says
    # the lock is there)
    carry = _carry()
    assert carry.training(tmp_path) is False
    with monkeypatch.context() as m:
        m.setattr(Path, "exists", lambda self: True)
        assert carry.training(tmp_path) is False
    assert not (tmp_path / "run.lock").exists()
    lock = tmp_path / "run.lock"
    lock.touch()
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert carry.training(tmp_path) is True
    assert carry.training(tmp_path) is False


def test_unpack_keeps_a_run_of_another_config_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run folders are named by the grid, not the config: an archive made with other settings
    (another lr) must not replace the run this machine trained with its own (its checkpoint is
    in no archive and no commit). Where and how a copy ran (``ran_*``) is no difference."""
    run = _fake_run(tmp_path, "a", 3)
    (run / "config.json").write_text('{"lr": 0.1, "ran_on": "cuda", "ran_threads": 8}')
    carry.pack(tmp_path)
    (run / "config.json").write_text('{"lr": 0.2, "ran_on": "cpu"}')  # this machine's own run
    torch.save({"round": 1}, run / "checkpoint.pt")
    assert carry.main(["unpack", "--root", str(tmp_path)]) == 0
    assert "kept as it is (another config here: lr differ" in capsys.readouterr().out
    assert torch.load(run / "checkpoint.pt", weights_only=True)["round"] == 1
    assert json.loads((run / "config.json").read_text())["lr"] == 0.2
    (run / "config.json").write_text('{"lr": 0.1, "ran_on": "cpu"}')  # the same run, behind
    assert carry.unpack(tmp_path) == 1
    assert torch.load(run / "checkpoint.pt", weights_only=True)["round"] == 3


def test_a_damaged_checkpoint_or_a_foreign_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torn ``checkpoint.pt`` (archived or here) and an archived file pack never writes (a
    ``summary.json`` would pass the run off as finished) end in one line, not a traceback; a
    damaged run here is neither packed nor replaced."""
    run = _fake_run(tmp_path, "a", 2)
    carry.pack(tmp_path)
    good = (tmp_path / carry.ARCHIVE).read_bytes()
    torn = (run / "checkpoint.pt").read_bytes()[:40]
    for name, data in (("checkpoint.pt", torn), ("summary.json", b"{}")):
        with tarfile.open(tmp_path / carry.ARCHIVE, "w:gz") as tar:
            for member, content in (("checkpoint.pt", b""), (name, data)):
                info = tarfile.TarInfo(f"t/a/seed-0/{member}")
                content = content or (run / "checkpoint.pt").read_bytes()
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
        shutil.rmtree(tmp_path / "t")
        assert carry.main(["unpack", "--root", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"t/a/seed-0/{name}" in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "t").exists()
        run = _fake_run(tmp_path, "a", 2)
    (tmp_path / carry.ARCHIVE).write_bytes(good)
    (run / "checkpoint.pt").write_bytes(torn)  # damaged here: the archive's round 2 kept
    assert carry.main(["pack", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "left out (its checkpoint.pt cannot be read" in out and "Traceback" not in out
    assert _archived(tmp_path) == {"t/a/seed-0": 2}
    assert carry.main(["unpack", "--root", str(tmp_path)]) == 0
    assert "kept as it is (its checkpoint.pt here cannot be read" in capsys.readouterr().out
    assert (run / "checkpoint.pt").read_bytes() == torn


def test_a_full_disk_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_run(tmp_path, "a", 2)

    def full(path: Path, data: bytes) -> None:
        raise WriteError(path, OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(carry, "write_bytes", full)
    assert carry.main(["pack", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device (errno 28); free space" in err
    assert not (tmp_path / carry.ARCHIVE).exists()


def test_an_interrupted_unpack_is_one_line_and_a_rerun_restores_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _fake_run(tmp_path, "a", 3)
    carry.pack(tmp_path)
    torch.save({"round": 1}, run / "checkpoint.pt")  # behind here: the archive's replaces it
    real = carry.write_bytes
    writes: list[str] = []

    def ctrl_c(path: Path, data: bytes) -> None:
        if writes:
            raise KeyboardInterrupt
        writes.append(str(path))
        real(path, data)

    monkeypatch.setattr(carry, "write_bytes", ctrl_c)
    assert carry.main(["unpack", "--root", str(tmp_path)]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "carry.py: unpack interrupted; every file is whole: run it again"
    monkeypatch.setattr(carry, "write_bytes", real)
    assert carry.main(["unpack", "--root", str(tmp_path)]) == 0
    assert torch.load(run / "checkpoint.pt", weights_only=True)["round"] == 3


def test_pack_keeps_an_archived_run_of_another_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pack replaced an archived copy made with other settings (another machine's progress on
    another grid under the same folder name) once the run here got as far, and dropped it once
    the run here finished: both now keep it and say so; the unfinished run here is left out
    (exit 1), and the same config is still replaced or dropped as before."""
    run = _fake_run(tmp_path, "a", 3)
    (run / "config.json").write_text('{"lr": 0.1}')
    carry.pack(tmp_path)
    (run / "config.json").write_text('{"lr": 0.2}')
    torch.save({"round": 7}, run / "checkpoint.pt")
    assert carry.main(["pack", "--root", str(tmp_path)]) == 1
    assert "left out, the archived copy kept (another config here: lr differ" in (
        capsys.readouterr().out
    )
    assert _archived(tmp_path) == {"t/a/seed-0": 3}
    (run / "summary.json").write_text("{}")
    assert carry.main(["pack", "--root", str(tmp_path)]) == 0
    assert "kept the archived copy (another config here: lr differ" in capsys.readouterr().out
    assert _archived(tmp_path) == {"t/a/seed-0": 3}
    (run / "config.json").write_text('{"lr": 0.1}')  # the archived copy's config: it finished
    carry.pack(tmp_path)
    assert not (tmp_path / carry.ARCHIVE).exists()


def test_a_run_whose_config_json_cannot_be_read_is_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pack archived a run whose config.json is torn, and the archive it wrote was then refused
    by every later pack and unpack ("its .../config.json cannot be read"): the run is left out
    (exit 1) and named, and the others are packed into an archive that reads back."""
    good = _fake_run(tmp_path, "a", 3)
    torn = _fake_run(tmp_path, "b", 2)
    (torn / "config.json").write_text('{"lr": 0.')
    assert carry.main(["pack", "--root", str(tmp_path)]) == 1
    assert "left out (its t/b/seed-0/config.json cannot be read" in capsys.readouterr().out
    assert _archived(tmp_path) == {"t/a/seed-0": 3}
    assert good.is_dir() and carry.main(["pack", "--root", str(tmp_path)]) == 1
