"""``data.root`` (and ``data.tokenizer``) are compared as the folder they name, not as spelled:
``good``, ``good/``, ``./good``, ``/home/me/good`` (from ``/home/me``) and a symbolic link to it
are one setting for ``--resume``, a finished run's check, a report's rows and a search's study.
A run records the folder it read (``data_folders`` of its ``config.json``) beside the path as
the config wrote it: relative to the working folder when inside it, so a project moved to
another folder or machine keeps its runs; absolute otherwise. A record without it (before
fedlore 2026-12-06) is named from the working folder now."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from fedlore.config import ConfigError, load_config
from fedlore.config_unset import FOLDERS_RECORD, resolved_folders, same_folder
from fedlore.engine.run_record import _run_config, config_diff, resolved_hyper
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.tune import record_diff

NPZ = ["data.name=npz"]


def _record(over: list[str], hyper: bool, folders: bool) -> dict[str, Any]:
    """A run's config.json for ``over`` made from the working folder now; without
    ``folders``, as fedlore wrote it before it recorded the folders."""
    cfg = load_config(None, over)
    out = _run_config(cfg, "fedavg")
    if hyper:
        out["hyper"] = resolved_hyper(make_algorithm("fedavg", cfg))
    if folders:
        out[FOLDERS_RECORD] = resolved_folders({"data.root": cfg.data.root})
        out[FOLDERS_RECORD].update(resolved_folders({"data.tokenizer": cfg.data.tokenizer}))
    return out


def _diff(was: list[str], now: list[str], hyper: bool, folders: bool) -> str:
    return config_diff(
        load_config(None, now), "fedavg", _record(was, hyper, folders), make_algorithm
    )


@pytest.mark.parametrize("folders", [True, False])
@pytest.mark.parametrize("hyper", [True, False])
def test_spellings_of_one_data_folder_are_one_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hyper: bool, folders: bool
) -> None:
    """data.root=good/ (a shell's completion adds the slash), ./good, the absolute path and a
    link name the folder data.root=good names: --resume and a finished run's check took them
    for another config and refused the run (`data.root: 'good' -> '/home/me/good'`), in both
    directions, with the folders recorded and without (a record of an older fedlore)."""
    work = tmp_path / "work"
    (work / "good").mkdir(parents=True)
    (work / "link").symlink_to(work / "good")
    monkeypatch.chdir(work)
    spellings = ["good/", "./good", "good//", "./good/.", str(work / "good"), "link", "x/../good"]
    for same in spellings:
        spelled = [*NPZ, f"data.root={same}"]
        assert _diff([*NPZ, "data.root=good"], spelled, hyper, folders) == "", same
        assert _diff(spelled, [*NPZ, "data.root=good"], hyper, folders) == "", same
    assert _diff([*NPZ, "data.root=good/"], [*NPZ, "data.root=other/"], hyper, folders) == (
        "data.root: 'good' -> 'other'"
    )
    assert f"data.root: 'good' -> {str(tmp_path / 'good')!r}" in _diff(
        [*NPZ, "data.root=good"], [*NPZ, "data.root=../good"], hyper, folders
    )
    tok = ["data.name=text_csv", "data.root=t.csv"]
    for same in ("tok/", str(work / "tok")):
        spelled = [*tok, f"data.tokenizer={same}"]
        assert _diff(spelled, [*tok, "data.tokenizer=tok"], hyper, folders) == ""
    assert _diff([*tok, "data.tokenizer=tok"], [*tok, "data.tokenizer=tik"], hyper, folders)


@pytest.mark.parametrize("hyper", [True, False])
def test_a_folder_is_named_relative_to_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hyper: bool
) -> None:
    """A run records the folder it read relative to its working folder (when inside it): the
    project moved to b/ (another machine, a clone) keeps its runs under the same words; a
    folder outside it is named absolutely, from anywhere. Whether the files are the same is the
    data fingerprint's to say."""
    for d in ("a", "b", "data"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    recorded = _record([*NPZ, "data.root=./good/"], hyper, folders=True)
    outside = _record([*NPZ, "data.root=../data"], hyper, folders=True)
    assert recorded["data"]["root"] == "./good/"  # as the config wrote it
    assert recorded[FOLDERS_RECORD] == {"data.root": "good"}
    assert outside[FOLDERS_RECORD] == {"data.root": str(tmp_path / "data")}
    monkeypatch.chdir(tmp_path / "b")

    def diff(record: dict[str, Any], root: str) -> str:
        cfg = load_config(None, [*NPZ, f"data.root={root}"])
        return config_diff(cfg, "fedavg", record, make_algorithm)

    assert diff(recorded, "good") == ""
    assert diff(recorded, str(tmp_path / "b" / "good")) == ""
    assert diff(recorded, str(tmp_path / "a" / "good")) == (
        f"data.root: 'good' -> {str(tmp_path / 'a/good')!r}"
    )
    assert diff(outside, "../data") == diff(outside, str(tmp_path / "data")) == ""
    old = _record([*NPZ, f"data.root={tmp_path / 'b' / 'good'}"], hyper, folders=False)
    assert diff(old, "good/") == ""  # a record of an older fedlore: named from here


def test_same_folder_leaves_what_names_no_local_folder_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    record: dict[str, Any] = {"data.root": "a/../b/", "data.tokenizer": "s3://bucket/tok/"}
    same_folder(record)
    assert record == {"data.root": "b", "data.tokenizer": "s3://bucket/tok/"}
    record = {"data.root": None, "data.tokenizer": "", "lr": "x/"}
    same_folder(record, {"data.root": "/elsewhere", "lr": "/y"})
    assert record == {"data.root": None, "data.tokenizer": "", "lr": "x/"}
    record = {"data.root": "good", "data.tokenizer": "tok"}
    same_folder(record, {"data.root": "/there/good", "data.tokenizer": None})
    assert record == {"data.root": "/there/good", "data.tokenizer": "tok"}
    record = {"data.root": str(tmp_path / "good")}
    same_folder(record, "not a mapping")  # a damaged record: named from here
    assert record == {"data.root": "good"}
    record = {"data.root": str(tmp_path)}
    same_folder(record)
    assert record == {"data.root": "."}


def _report_run(
    root: Path, seed: int, base: dict[str, Any], data_root: str, folders: dict[str, str] | None
) -> None:
    run = root / "fedavg" / f"seed-{seed}"
    run.mkdir(parents=True)
    record = {**base, "data": {**base["data"], "root": data_root}}
    if folders is not None:
        record[FOLDERS_RECORD] = folders
    (run / "config.json").write_text(json.dumps(record))
    (run / "metrics.jsonl").write_text(json.dumps({"round": 0, "accuracy": 0.5}) + "\n")
    summary = {"method": "fedavg", "seed": seed, "rounds": 1, "final_accuracy": 0.5}
    (run / "summary.json").write_text(json.dumps(summary))


def test_a_report_pools_runs_of_one_data_folder_spelled_two_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report groups runs by their config.json: seed 2 run with data.root=good/ beside seed 1
    with data.root=good got a row of its own, `fedavg [data.root=good/]`, and so did seed 5
    with the absolute path. Seed 6 recorded that it read another folder under the same words."""
    from fedlore.results.store import load_runs, split_by_config

    monkeypatch.chdir(tmp_path)
    good = str(tmp_path / "good")
    base = _record([*NPZ, "data.root=good"], hyper=False, folders=False)
    named = {"data.root": "good"}
    exp = tmp_path / "exp"
    for seed, root, folders in (
        (1, "good", None),
        (2, "good/", None),
        (3, "./good", named),
        (4, "other", None),
        (5, good, named),
        (7, good, None),
        (6, "good", {"data.root": "/elsewhere/good"}),
    ):
        _report_run(exp, seed, base, root, folders)
    groups = split_by_config(load_runs(exp))
    assert {k: [r.seed for r in v] for k, v in groups.items()} == {
        "fedavg [data.root=good]": [1, 2, 3, 5, 7],
        "fedavg [data.root=other]": [4],
        "fedavg [data.root=/elsewhere/good]": [6],
    }


def test_a_search_continues_with_its_data_folder_spelled_another_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search's study record compares data.root as the folder it names, like a run's."""
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")

    def record(root: str) -> dict[str, Any]:
        settings = {"data.root": root, "rounds": 2}
        return {"settings": settings, FOLDERS_RECORD: resolved_folders(settings), "seed": 0}

    made = record("good")
    assert record_diff(made, record("./good/")) == ""
    assert record_diff(made, record(str(tmp_path / "a" / "good"))) == ""
    old = {k: v for k, v in made.items() if k != FOLDERS_RECORD}  # a study of an older fedlore
    assert record_diff(old, record(str(tmp_path / "a" / "good"))) == ""
    assert record_diff(made, record("../good")) == (
        f"settings.data.root: 'good' -> {str(tmp_path / 'good')!r}"
    )
    monkeypatch.chdir(tmp_path)  # the project moved: the same words name its folder
    assert record_diff(made, record("good")) == ""
    assert record_diff(made, record("a/good")) == "settings.data.root: 'good' -> 'a/good'"


def test_a_run_resumes_and_is_found_finished_with_its_folder_spelled_another_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_npz: list[str]
) -> None:
    """The end to end finding: a run started with data.root relative to the working folder,
    resumed with the folder's absolute path (or a link to it), continues; the finished run is
    this config's. config.json keeps the path the config wrote and records the folder."""
    folder = Path(digits_npz[1].removeprefix("data.root="))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(folder)
    rel = os.path.relpath(folder, tmp_path)

    def cfg(root: str) -> Any:
        return load_config(
            None,
            ["rounds=2", "num_clients=3", "local_steps=2", "batch_size=16", "progress=false",
             "model.kwargs={hidden: [8]}", f"output_dir={tmp_path / 'out'}", *NPZ,
             f"data.root={root}"],
        )  # fmt: skip

    assert run_one(cfg(rel), "fedavg", 0, stop_after=0) is None
    path = run_dir(cfg(rel), "fedavg", 0) / "config.json"
    written = json.loads(path.read_text())
    assert written["data"]["root"] == rel and written[FOLDERS_RECORD] == {"data.root": str(folder)}
    summary = run_one(cfg(str(folder) + "/"), "fedavg", 0, resume=True)
    assert summary is not None
    assert json.loads(path.read_text())["data"]["root"] == str(folder) + "/"  # as written
    for root in (rel, "link", str(folder)):
        assert run_one(cfg(root), "fedavg", 0) == summary  # finished: reported, not rerun
    copy = tmp_path / "copy"  # the same files in another folder: another config
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ConfigError, match=rf"data\.root: '{folder}' -> 'copy'"):
        run_one(cfg("copy"), "fedavg", 0, resume=True)


def test_a_search_records_the_data_folder_beside_the_path_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_npz: list[str]
) -> None:
    from fedlore.config import apply_overrides, validate
    from fedlore.tune import plan_search, search_record

    folder = Path(digits_npz[1].removeprefix("data.root="))
    monkeypatch.chdir(tmp_path)
    rel = os.path.relpath(folder, tmp_path)
    raw = apply_overrides(
        {},
        ["num_clients=3", "seeds=[1]", "data.selection_fraction=0.2", *NPZ, f"data.root={rel}",
         f"output_dir={tmp_path}", "tune.space={lr: 'log:1e-3:0.3'}"],
    )  # fmt: skip
    record = search_record(plan_search(validate(raw), raw))
    assert record["settings"]["data.root"] == rel
    assert record[FOLDERS_RECORD] == {"data.root": str(folder)}
