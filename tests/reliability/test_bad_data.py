"""Issue 29, items 4-5, end to end: bad data and misspelt settings stop a run with one clear
line (exit 2) before any run folder is touched, or run in a mode the output and the report name.

Each scenario runs ``fedlore run`` in this process (:func:`fedlore.cli.main`) on a tiny ``npz``
folder (random 4x4 images of 4 classes) or the embedded digits, one method, one round.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedlore.cli import main

TINY = [
    "num_clients=2",
    "rounds=1",
    "local_steps=1",
    "batch_size=16",
    "partition.name=iid",
    "model.name=mlp",
    "model.kwargs={hidden: [8]}",
    "algorithms=[fedavg]",
    "seeds=[0]",
]


def _npz(folder: Path, part: str, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    x = rng.random((n, 1, 4, 4), dtype=np.float32)
    y = rng.integers(0, 4, n)
    np.savez(folder / f"{part}.npz", x=x, y=y)
    return x, y


def _run(tmp_path: Path, root: Path, *extra: str) -> int:
    return main(
        ["run", *TINY, "data.name=npz", f"data.root={root}", f"output_dir={tmp_path / 'out'}",
         "name=bad", *extra]
    )  # fmt: skip


def _error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("fedlore: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_only_train_npz_holds_out_a_named_test_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _npz(tmp_path / "d", "train", 100)
    assert _run(tmp_path, tmp_path / "d", "progress=true") == 0
    out, err = capsys.readouterr()
    test_npz = tmp_path / "d" / "test.npz"
    assert f"no test split ({test_npz} does not exist): the test set is a held-out 20 %" in err
    assert "accuracy nan" not in err and "diverged" not in err  # the CLI's warnings
    assert "(1 diverged)" not in out and "| – |" not in out  # the table's seeds and accuracy
    assert "Test set: held out 20 % of train.npz (" in out
    summary = json.loads((tmp_path / "out/bad/fedavg/seed-0/summary.json").read_text())
    assert summary["data_test_split"].startswith("held out 20 % of train.npz")
    assert 0.0 <= summary["final_accuracy"] <= 1.0 and "diverged" not in summary
    report = (tmp_path / "out" / "bad" / "report.md").read_text()
    assert "Test set: held out 20 % of train.npz" in report


def test_only_train_npz_is_refused_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _npz(tmp_path / "d", "train", 100)
    assert _run(tmp_path, tmp_path / "d", "data.missing_test=error") == 2
    line = _error_line(capsys.readouterr().err)
    assert f"no test split: {tmp_path / 'd' / 'test.npz'} does not exist" in line
    assert not (tmp_path / "out").exists()


def test_only_test_npz_names_the_missing_training_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _npz(tmp_path / "d", "test", 50)
    assert _run(tmp_path, tmp_path / "d") == 2
    line = _error_line(capsys.readouterr().err)
    assert f"no training examples: {tmp_path / 'd' / 'train.npz'} is missing or empty" in line


def test_a_nan_feature_is_refused_naming_file_array_and_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x, y = _npz(tmp_path / "d", "train", 100)
    _npz(tmp_path / "d", "test", 40, seed=1)
    x[37, 0, 2, 3] = np.nan
    np.savez(tmp_path / "d" / "train.npz", x=x, y=y)
    assert _run(tmp_path, tmp_path / "d") == 2
    line = _error_line(capsys.readouterr().err)
    assert f"{tmp_path / 'd' / 'train.npz'}: x[37, 0, 2, 3] is nan (1 of its 100 rows" in line
    assert "data.non_finite=drop" in line
    assert not (tmp_path / "out").exists()


def test_non_finite_rows_are_dropped_with_a_count_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x, y = _npz(tmp_path / "d", "train", 100)
    _npz(tmp_path / "d", "test", 40, seed=1)
    x[5, 0, 0, 0], x[9, 0, 1, 1] = np.inf, np.nan
    np.savez(tmp_path / "d" / "train.npz", x=x, y=y)
    assert _run(tmp_path, tmp_path / "d", "data.non_finite=drop") == 0
    err = capsys.readouterr().err
    assert "fedlore: warning:" in err and "left out 2 of its 100 rows" in err
    summary = json.loads((tmp_path / "out/bad/fedavg/seed-0/summary.json").read_text())
    assert summary["rejected_total"] == 0 and summary["skipped_steps_total"] == 0


def test_an_empty_train_npz_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "d"
    _npz(folder, "test", 40)
    np.savez(folder / "train.npz", x=np.zeros((0, 1, 4, 4), np.float32), y=np.zeros(0, np.int64))
    assert _run(tmp_path, folder) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"{folder / 'train.npz'}: holds no examples" in line
    assert "dirichlet" not in line and "partition" not in line


def _digits(tmp_path: Path, *extra: str) -> int:
    return main(["run", *TINY, f"output_dir={tmp_path / 'out'}", "name=typo", *extra])


def test_a_setting_of_a_method_not_in_algorithms_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _digits(tmp_path, "algorithms=[fedfull]", "method.fedlore.rnak=4") == 2
    line = _error_line(capsys.readouterr().err)
    assert "method.fedlore.rnak=4: method 'fedlore' is not in algorithms [fedfull]" in line
    assert not (tmp_path / "out").exists()


def test_a_misspelt_hyperparameter_of_a_method_in_the_run_is_still_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _digits(tmp_path, "algorithms=[fedlore]", "method.fedlore.rnak=4") == 2
    err = capsys.readouterr().err
    assert "FedLore has no hyperparameter(s) ['rnak']" in err
    assert not (tmp_path / "out").exists()


def test_an_unknown_source_is_named_before_the_run_folder_is_looked_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _digits(tmp_path) == 0  # a finished run under the name
    capsys.readouterr()
    assert _digits(tmp_path, "data.name=digitz") == 2
    err = capsys.readouterr().err
    assert "data.name: unknown source 'digitz'" in err
    assert "--overwrite" not in err
