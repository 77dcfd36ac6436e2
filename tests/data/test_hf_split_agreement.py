"""The ``hf`` source's splits must agree: a label of the test split that no training example
has (labels written as words in one split and as numbers in the other, which ``datasets``
casts to ``"0"`` beside ``"yes"``) is refused, and a column one split's files lack is named as
missing from the whole split, not as an empty first row."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

pytest.importorskip("datasets", reason="needs the [hf] extra: pip install -e '.[hf]'")

from fedlore.data.checks import DataWarning
from fedlore.data.hf import load_hf


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def splits(root: Path, train: list[object], test: list[object], fmt: str = "jsonl") -> Path:
    """``root/train.<fmt>`` and ``root/test.<fmt>``: a number ``x`` and the given labels."""
    import pandas as pd

    root.mkdir(parents=True, exist_ok=True)
    for name, labels in (("train", train), ("test", test)):
        rows = [{"x": float(k), "label": y} for k, y in enumerate(labels)]
        if fmt == "jsonl":
            write_jsonl(root / f"{name}.jsonl", rows)
        elif fmt == "csv":
            pd.DataFrame(rows).to_csv(root / f"{name}.csv", index=False)
        else:
            pd.DataFrame(rows).to_parquet(root / f"{name}.parquet")
    return root


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_words_in_training_and_numbers_in_the_test_split_are_refused(
    tmp_path: Path, fmt: str
) -> None:
    root = splits(tmp_path / fmt, ["no", "yes", "yes", "no"], [0, 1, 1], fmt)
    with pytest.raises(ValueError) as caught:
        load_hf(str(root), input_column="x")
    said = str(caught.value)
    assert "(split 'test'): label '0' in column 'label' (row 0; 3 of its 3 rows" in said
    assert "no label of the training split 'train' (its labels: ['no', 'yes']), nor is" in said
    assert "\n" not in said


def test_a_test_label_no_training_example_has_is_said_with_its_row(tmp_path: Path) -> None:
    root = splits(tmp_path / "ints", [0, 1, 0, 1], [1, 0, 2, 0])
    with pytest.warns(DataWarning) as caught:
        src = load_hf(str(root), input_column="x")
    said = [str(w.message) for w in caught if issubclass(w.category, DataWarning)]
    assert len(said) == 1 and "label '2' in column 'label' (row 2; 1 of its 4 rows" in said[0]
    assert said[0].endswith("the model cannot learn it, so those rows count as errors")
    assert src.class_names == ["0", "1", "2"] and src.test.y.tolist() == [1, 0, 2, 0]
    root = splits(tmp_path / "words", ["cat", "dog"], ["dog", "cow", "cat", "ant"])
    with pytest.warns(DataWarning, match=r"label 'cow' .*\(row 1; 2 of its 4 rows, labels "):
        load_hf(str(root), input_column="x")  # the first row's label, not the first in order
    root = splits(tmp_path / "words2", ["cat", "dog"], ["dog", "cow"])
    with pytest.warns(DataWarning, match=r"labels \['cow'\]\) .*\(its labels: \['cat', 'dog'\]\)"):
        load_hf(str(root), input_column="x")
    root = splits(tmp_path / "apart", ["cat", "dog"], ["cow", "cow"])  # nothing in common
    with pytest.raises(ValueError, match=r"label 'cow' .* nor is any other of its labels"):
        load_hf(str(root), input_column="x")


def test_splits_whose_labels_agree_and_class_labels_are_kept(tmp_path: Path) -> None:
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    src = load_hf(
        str(splits(tmp_path / "ok", ["no", "yes", "yes"], ["yes", "no"])), input_column="x"
    )
    assert src.class_names == ["no", "yes"] and src.test.y.tolist() == [1, 0]
    # a test split with fewer classes than the training split is fine
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)
        src = load_hf(str(splits(tmp_path / "few", [0, 1, 2, 1], [2, 2])), input_column="x")
    assert src.num_classes == 3 and src.test.y.tolist() == [2, 2]
    # a ClassLabel names its classes itself: one no training example has is kept
    features = Features({"x": Value("float32"), "label": ClassLabel(names=["a", "b", "c"])})
    DatasetDict(
        {
            "train": Dataset.from_dict({"x": [0.0, 1.0], "label": [0, 1]}, features=features),
            "test": Dataset.from_dict({"x": [2.0], "label": [2]}, features=features),
        }
    ).save_to_disk(str(tmp_path / "named"))
    src = load_hf(str(tmp_path / "named"), input_column="x")
    assert src.class_names == ["a", "b", "c"] and src.test.y.tolist() == [2]
    # a test split alone (a site-local server's) has no training labels to compare with
    write_jsonl(
        tmp_path / "server" / "test.jsonl", [{"x": 1.0, "label": "a"}, {"x": 2.0, "label": "b"}]
    )
    src = load_hf(str(tmp_path / "server"), input_column="x")
    assert len(src.train.y) == 0 and src.test.y.tolist() == [0, 1]


def test_a_column_the_test_files_lack_is_named_for_the_whole_split(tmp_path: Path) -> None:
    write_jsonl(
        tmp_path / "train.jsonl", [{"x": float(k), "w": "a", "label": k % 2} for k in range(4)]
    )
    write_jsonl(tmp_path / "test.jsonl", [{"x": float(k), "label": k % 2} for k in range(3)])
    with pytest.raises(
        ValueError,
        match=r"\(split 'test'\) has no value in column 'w' in any of its 3 rows \(its files "
        r"lack the column, which another split has\)",
    ):
        load_hf(str(tmp_path), input_column="x", id_column="w")
    write_jsonl(tmp_path / "test.jsonl", [{"x": 1.0, "w": "a", "label": 0}, {"x": 2.0, "label": 1}])
    with pytest.raises(ValueError, match=r"\(split 'test'\): row 1 has no value in column 'w'"):
        load_hf(str(tmp_path), input_column="x", id_column="w")
