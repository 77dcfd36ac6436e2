"""``fedlore report`` on early-stopping runs and on folders that are not (quite) runs: a run
without a readable summary keeps the round its rule kept (replayed over ``metrics.jsonl``);
``report.csv`` carries each run's early stopping and audit intervals; a hollow summary without a
config is a note, not a row; the walk follows no symbolic link and survives unreadable folders."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from fedlore.results.folders import UnreadableFolderWarning
from fedlore.results.report import report
from fedlore.results.stopping import DERIVED_NOTE
from fedlore.results.store import IncompleteRunWarning, load_runs

SEL = [0.5, 0.8, 0.7, 0.6]  # best round 1, two evaluations without improvement: stop after 3
ACC = [0.4, 0.75, 0.7, 0.9]  # the last round's test accuracy is the highest


def _rows(sel: list[float], acc: list[float], key: str = "selection_accuracy") -> list[dict]:
    costs = {"bytes_up": 10, "bytes_down": 20, "optimizer_state_bytes": 5, "wall_s": 0.1}
    return [
        {"round": t, key: s, "accuracy": a, "loss": 1.0 - a, **costs}
        for t, (s, a) in enumerate(zip(sel, acc, strict=True))
    ]


def _run(
    exp: Path,
    seed: int,
    rows: list[dict[str, Any]] | None,
    summary: str | None = None,
    config: dict[str, Any] | None = None,
    method: str = "fedavg",
) -> Path:
    run = exp / method / f"seed-{seed}"
    run.mkdir(parents=True)
    if rows is not None:
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (run / "summary.json").write_text(summary)
    if config is not None:
        (run / "config.json").write_text(json.dumps(config))
    return run


def _early(metric: str = "selection_accuracy", **kw: Any) -> dict[str, Any]:
    rule = {"metric": metric, "mode": "auto", "patience": 2, "min_delta": 0.0,
            "restore_best": True, "allow_test": False}  # fmt: skip
    return {"name": "x", "early_stopping": {**rule, **kw}, "eval": {"metrics": []}}


def _load(exp: Path) -> dict[str, list[Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        return load_runs(exp)


# 4. a run without a readable summary: the kept round's values, said to be derived


@pytest.mark.parametrize("summary", [None, '{"method": "fedavg", "se'], ids=["missing", "torn"])
@pytest.mark.parametrize(
    ("metric", "sel", "mode"),
    [("selection_accuracy", SEL, "auto"), ("selection_loss", [1.0, 0.5, 0.6, 0.7], "auto"),
     ("selection_loss", [1.0, 0.5, 0.6, 0.7], "min")],
)  # fmt: skip
def test_restore_best_without_a_summary_derives_the_kept_rounds_values(
    tmp_path: Path, summary: str | None, metric: str, sel: list[float], mode: str
) -> None:
    exp = tmp_path / "exp"
    _run(exp, 1, _rows(sel, ACC, metric), summary, _early(metric, mode=mode))
    with pytest.warns(IncompleteRunWarning, match="its final values those of round 1, the best"):
        (record,) = load_runs(exp)["fedavg"]
    s = record.summary
    assert (s["best_round"], s["stopped_round"], s["restored_best"]) == (1, 3, True)
    assert s[f"best_{metric}"] == sel[1] and s["early_stopping_metric"] == metric
    assert s["final_accuracy"] == 0.75 and s["final_loss"] == 0.25  # round 1's, not round 3's
    assert s["best_accuracy"] == 0.9 and s["early_stopping_derived"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        text = report(exp, write=False)
    assert "| fedavg | 1 (derived) |" in text and DERIVED_NOTE in text
    assert "| 75.00 |" in text and "| 90.00 | 90.00 |" not in text


def test_rows_without_the_cost_keys_still_give_the_kept_rounds_values(tmp_path: Path) -> None:
    """Derived as the rest of a summary without one (``derive_summary``), a row lacking a key
    every finished run's rows hold (``wall_s``, bytes) is no error."""
    exp = tmp_path / "exp"
    rows = [{"round": t, "selection_accuracy": s, "accuracy": a} for t, (s, a) in
            enumerate(zip(SEL, ACC, strict=True))]  # fmt: skip
    _run(exp, 1, rows, None, _early())
    s = _load(exp)["fedavg"][0].summary
    assert (s["best_round"], s["final_accuracy"]) == (1, 0.75)


def test_without_restore_best_the_finals_stay_the_last_rounds(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    _run(exp, 1, _rows(SEL, ACC), None, _early(restore_best=False))
    s = _load(exp)["fedavg"][0].summary
    assert (s["best_round"], s["stopped_round"], s["restored_best"]) == (1, 3, False)
    assert s["final_accuracy"] == 0.9
    # no config.json: nothing says a rule ran; the last round's values as before
    bare = tmp_path / "bare"
    _run(bare, 1, _rows(SEL, ACC), None, None)
    s = _load(bare)["fedavg"][0].summary
    assert s["final_accuracy"] == 0.9 and "best_round" not in s


def test_a_derived_run_agrees_with_the_finished_runs_summary(tmp_path: Path) -> None:
    """The replay is the engine's rule: a real run that stopped early and kept its best round,
    its summary.json removed, is derived to the same outcome and final values."""
    from fedlore.config import load_config
    from fedlore.experiment import run_one

    cfg = load_config(None, [
        "num_clients=3", "rounds=5", "local_steps=5", "lr=0.05", "batch_size=16",
        "partition.min_size=10", "model.kwargs={hidden: [16]}", "progress=false",
        f"output_dir={tmp_path}",
        "data.selection_fraction=0.2", "early_stopping.metric=selection_accuracy",
        "early_stopping.patience=2", "early_stopping.min_delta=0.5",  # round 0 stays the best
        "early_stopping.restore_best=true", "eval.metrics=[brier]",
    ])  # fmt: skip
    real = run_one(cfg, "fedavg", 0)
    assert real is not None and (real["best_round"], real["stopped_round"]) == (0, 2)
    folder = tmp_path / cfg.name / "fedavg" / "seed-0"
    (folder / "summary.json").unlink()
    derived = _load(tmp_path / cfg.name)["fedavg"][0].summary
    keys = [k for k in real if k.startswith(("final_", "best_", "early_stopping_"))]
    keys += ["stopped_round", "restored_best", "rounds"]
    assert {k: derived.get(k) for k in keys} == {k: real[k] for k in keys}
    assert derived["final_accuracy"] != _rows_last(folder)["accuracy"]


def _rows_last(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])


# 5. report.csv: each run's early stopping and audit intervals


def test_report_csv_has_the_runs_early_stopping_and_audit_intervals(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    base = {"method": "fedavg", "rounds": 4, "final_accuracy": 0.7}
    stop = {"early_stopping_metric": "selection_accuracy", "best_selection_accuracy": 0.8,
            "restored_best": True, "best_round": 1}  # fmt: skip
    audit = {"dp_audit_epsilon_low": 0.5, "dp_audit_epsilon_high": 2.25,
             "dp_audit_epsilon_all_iterates_low": 1.0,
             "dp_audit_epsilon_all_iterates_high": math.inf}  # fmt: skip
    for seed, extra in ((1, {"stopped_round": 3}), (2, {"stopped_round": None})):
        summary = {**base, "seed": seed, **stop, **audit, **extra}
        _run(exp, seed, _rows(SEL, ACC), json.dumps(summary))
    _run(exp, 1, _rows(SEL, ACC), json.dumps({**base, "method": "fedfull", "seed": 1}),
         method="fedfull")  # fmt: skip
    report(exp)
    with (exp / "report.csv").open() as f:
        reader = csv.DictReader(f)
        rows = {r["method"]: r for r in reader}
        header = reader.fieldnames or []
    es = rows["fedavg"]
    assert es["early_stopping_metric"] == "selection_accuracy"
    assert es["stopped_round"] == "3 null"  # seed 2 ran every round
    assert (es["best_round"], es["restored_best"]) == ("1", "true")
    assert es["best_selection_accuracy"] == "0.8"
    assert (es["dp_audit_epsilon_low"], es["dp_audit_epsilon_high"]) == ("0.5", "2.25")
    assert es["dp_audit_epsilon_all_iterates_low"] == "1.0"
    assert es["dp_audit_epsilon_all_iterates_high"] == "inf"
    plain = rows["fedfull"]  # no early stopping, no audit: empty cells
    for key in ("early_stopping_metric", "stopped_round", "best_round", "restored_best",
                "best_selection_accuracy", "dp_audit_epsilon_low",
                "dp_audit_epsilon_all_iterates_high"):  # fmt: skip
        assert plain[key] == "", key
    assert header[-1] == "best_selection_accuracy"


# 6. a hollow summary without a config: a note, not a "[config unknown]" row


@pytest.mark.parametrize("rows", [True, False], ids=["with_rows", "without_rows"])
def test_an_empty_summary_without_a_config_is_a_note_not_a_row(tmp_path: Path, rows: bool) -> None:
    exp = tmp_path / "exp"
    real = {"method": "fedavg", "seed": 1, "rounds": 4, "final_accuracy": 0.9}
    _run(exp, 1, _rows(SEL, ACC), json.dumps(real), {"name": "x", "lr": 0.1})
    hollow = _run(exp, 2, _rows(SEL, ACC) if rows else None, "{}")
    with pytest.warns(IncompleteRunWarning) as warned:
        text = report(exp, write=False)
    said = [str(w.message) for w in warned if issubclass(w.category, IncompleteRunWarning)]
    assert said == [
        f"{hollow}: an incomplete run, left out: its summary.json holds no summary ({{}}) and "
        "it has no readable config.json"
    ]
    assert "config unknown" not in text and "| fedavg | 1 |" in text


def test_a_run_of_no_config_beside_one_config_keeps_the_methods_name(tmp_path: Path) -> None:
    """An unfinished run without a config.json (rows only) is a group of its own, and the
    configured runs keep the plain method name (not ``fedavg []``)."""
    exp = tmp_path / "exp"
    real = {"method": "fedavg", "seed": 1, "rounds": 4, "final_accuracy": 0.9}
    _run(exp, 1, _rows(SEL, ACC), json.dumps(real), {"name": "x", "lr": 0.1})
    _run(exp, 2, _rows(SEL, ACC), None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        text = report(exp, write=False)
    assert "| fedavg | 1 |" in text and "| fedavg [config unknown] | 1 (1 unfinished) |" in text


def test_an_empty_summary_with_a_config_is_derived_as_an_unreadable_one(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    _run(exp, 1, _rows(SEL, ACC), "{}", {"name": "x"})
    with pytest.warns(IncompleteRunWarning, match="unreadable; deriving the run from its 4"):
        text = report(exp, write=False)
    assert "| fedavg | 1 (1 with an unreadable summary) | 90.00 |" in text


# 7. the walk: no symbolic link followed, an unreadable folder a note


def test_the_walk_follows_no_symbolic_link_and_notes_them(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    real = {"method": "fedavg", "seed": 1, "rounds": 4, "final_accuracy": 0.9}
    _run(runs / "exp", 1, _rows(SEL, ACC), json.dumps(real))
    elsewhere = _run(tmp_path / "other", 2, _rows(SEL, ACC), json.dumps({**real, "seed": 2}))
    (runs / "back").symlink_to(tmp_path)  # a cycle: runs/back/runs/back/...
    (runs / "exp" / "fedavg" / "seed-2").symlink_to(elsewhere)
    with pytest.warns(UnreadableFolderWarning, match=r"1 symbolic link\(s\) to folders not"):
        text = report(runs, write=False)
    assert "| fedavg | 1 |" in text  # seed 2 is a link: left alone
    only_links = tmp_path / "links"
    only_links.mkdir()
    (only_links / "exp").symlink_to(runs / "exp")
    with pytest.raises(
        FileNotFoundError, match=r"symbolic links to folders are not followed \(exp\)"
    ):
        report(only_links, write=False)


def test_an_unreadable_folder_is_a_note_never_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedlore.cli import main

    runs = tmp_path / "runs"
    real = {"method": "fedavg", "seed": 1, "rounds": 4, "final_accuracy": 0.9}
    _run(runs / "exp", 1, _rows(SEL, ACC), json.dumps(real))
    locked_run = _run(runs / "exp", 2, _rows(SEL, ACC), json.dumps({**real, "seed": 2}))
    locked = runs / "locked"
    (locked / "inside").mkdir(parents=True)
    iterdir, read_text = Path.iterdir, Path.read_text

    def refuse(path: Path) -> Path:
        if path in (locked, locked_run) or locked_run in path.parents:
            raise PermissionError(13, "Permission denied", str(path))
        return path

    monkeypatch.setattr(Path, "iterdir", lambda self: iterdir(refuse(self)))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read_text(refuse(self), *a, **k))
    for _ in range(2):  # each report says it, once
        capsys.readouterr()
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # Python's own once-per-place filter off
            assert main(["report", str(runs), "--print-only"]) == 0
        out, err = capsys.readouterr()
        assert "Traceback" not in err and "| fedavg | 1 |" in out
        notes = [line for line in err.splitlines() if "cannot be read" in line]
        assert notes == [
            f"fedlore: warning: {locked}: cannot be read (Permission denied); left out",
            f"fedlore: warning: {locked_run}: cannot be read (Permission denied); left out",
        ]
    assert main(["report", str(locked)]) == 2  # nothing readable: one clear line
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"report: no runs found in {locked}" in err


def test_a_folder_whose_kind_cannot_be_told_is_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``is_dir`` itself can fail (no permission to look at a folder's entry): the folder is
    left out with a note, wherever the walk meets it."""
    from fedlore.results.folders import is_experiment_dir

    runs = tmp_path / "runs"
    real = {"method": "fedavg", "seed": 1, "rounds": 4, "final_accuracy": 0.9}
    _run(runs / "exp", 1, _rows(SEL, ACC), json.dumps(real))
    hidden = runs / "hidden"
    hidden.mkdir()
    is_dir = Path.is_dir

    def look(self: Path) -> bool:
        if self == hidden:
            raise PermissionError(13, "Permission denied", str(self))
        return is_dir(self)

    monkeypatch.setattr(Path, "is_dir", look)
    with pytest.warns(UnreadableFolderWarning, match="hidden: cannot be read"):
        assert "| fedavg | 1 |" in report(runs, write=False)
    with pytest.warns(UnreadableFolderWarning, match="hidden: cannot be read"):
        assert not is_experiment_dir(hidden)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc (not Linux)")
def test_report_of_proc_self_ends_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``/proc/self/root`` is ``/``, ``/proc/self/cwd`` the working folder: links the walk
    leaves alone, and nothing it reads can stop it."""
    from fedlore.cli import main

    capsys.readouterr()
    assert main(["report", "/proc/self"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Permission denied" not in err
    assert err.startswith("fedlore: error: report: no runs found in /proc/self")
    assert "symbolic links to folders are not followed" in err


def test_a_folder_gone_since_its_parent_was_listed_is_no_warning(tmp_path: Path) -> None:
    """``fedlore report /proc/self`` began with "cannot be read (No such file or directory)"
    warnings, one per thread that ended while the walk went (``/proc/self/task/<tid>``), about
    one call in three beside a busy pytest worker: a folder gone is skipped without a word; one
    that cannot be read is still said."""
    from fedlore.results.folders import subfolders

    with warnings.catch_warnings():
        warnings.simplefilter("error", UnreadableFolderWarning)
        assert subfolders(tmp_path / "removed-while-listed") == []
    with pytest.warns(UnreadableFolderWarning, match="cannot be read"):
        assert subfolders(Path("/proc/self/mem")) == []  # a file: NotADirectoryError
