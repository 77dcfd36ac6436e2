"""Data checked where it is read (:mod:`fedlore.data.checks`): an empty file and a NaN or
infinite value are named with the file, the array and the index (or, by ``data.non_finite``,
left out with a count); a central federation without a test split holds out a fixed stratified
share of the training data and says so (or refuses, by ``data.missing_test``); site-local data
are read as they are."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlore.config import ConfigError, DataConfig, load_config
from fedlore.data.checks import HOLDOUT_FRACTION, DataWarning, central_splits, check_rows
from fedlore.data.client_data import TensorSplit
from fedlore.data.datasource import DataSource
from fedlore.data.federation import build_federation, load_source
from fedlore.data.sources import load_npz


def _npz(folder: Path, part: str, n: int, seed: int = 0, **arrays: np.ndarray) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    x = rng.random((n, 1, 4, 4)).astype(np.float32)
    data: dict[str, np.ndarray] = {"x": x, "y": rng.integers(0, 4, n), **arrays}
    # allow_pickle named (numpy's default): the unpacked arrays then fill only **kwds
    np.savez(folder / f"{part}.npz", allow_pickle=True, **data)


def test_an_empty_file_is_named() -> None:
    with pytest.raises(ValueError, match=r"^f\.npz: holds no examples \(x and y have 0 rows\)"):
        check_rows("f.npz", np.zeros((0, 3), np.float32), np.zeros(0, np.int64))


@pytest.mark.parametrize(
    ("where", "value", "expect"),
    [
        ((2, 1), np.inf, "x[2, 1] is inf (1 of its 5 rows"),
        ((0, 0), -np.inf, "x[0, 0] is -inf (1 of its 5 rows"),
        ((4, 2), np.nan, "x[4, 2] is nan (1 of its 5 rows"),
    ],
)
def test_the_first_non_finite_value_is_named(
    where: tuple[int, int], value: float, expect: str
) -> None:
    x = np.ones((5, 3), np.float32)
    x[where] = value
    with pytest.raises(ValueError) as e:
        check_rows("f.npz", x, np.arange(5))
    assert str(e.value).startswith(f"f.npz: {expect}"), e.value
    assert "data.non_finite=drop" in str(e.value)


def test_non_finite_targets_count_and_integers_pass() -> None:
    x = np.ones((4, 2), np.float64)
    y = np.array([0.5, np.nan, 1.0, np.nan])
    with pytest.raises(ValueError, match=r"y\[1\] is nan \(2 of its 4 rows"):
        check_rows("f.npz", x, y)
    ints = np.arange(8, dtype=np.uint8).reshape(4, 2)
    out_x, out_y = check_rows("f.npz", ints, np.arange(4))
    assert out_x is ints and len(out_y) == 4
    with pytest.raises(ValueError, match=r"f\.npz: array 'x' must hold numbers, got dtype <U1"):
        check_rows("f.npz", np.array([["a"], ["b"]]), np.arange(2))
    with pytest.raises(ValueError, match="non_finite must be 'error' or 'drop', got 'keep'"):
        check_rows("f.npz", np.full((2, 1), np.nan), np.arange(2), "keep")


def test_drop_leaves_out_the_bad_rows_with_a_count() -> None:
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    x[1, 0], x[4, 1] = np.nan, np.inf
    with pytest.warns(DataWarning, match=r"f\.npz: left out 2 of its 6 rows, .*first: x\[1, 0\]"):
        out_x, out_y = check_rows("f.npz", x, np.arange(6), "drop")
    assert out_y.tolist() == [0, 2, 3, 5] and np.isfinite(out_x).all()
    with pytest.raises(ValueError, match="every row holds a NaN or infinite value"):
        check_rows("f.npz", np.full((2, 2), np.nan), np.arange(2), "drop")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # clean data: no warning
        check_rows("f.npz", np.ones((2, 2)), np.arange(2), "drop")


def test_the_npz_loader_checks_each_file(tmp_path: Path) -> None:
    _npz(tmp_path, "train", 10)
    bad = np.ones((4, 1, 4, 4), np.float32)
    bad[3, 0, 1, 2] = np.nan
    _npz(tmp_path, "test", 4, x=bad)
    with pytest.raises(ValueError, match=r"test\.npz: x\[3, 0, 1, 2\] is nan"):
        load_npz(str(tmp_path))
    with (
        pytest.warns(DataWarning, match="left out 1 of its 4 rows"),
        pytest.warns(DataWarning, match=r"label\(s\) 0 have no example"),  # 10 drawn labels, no 0
    ):
        src = load_npz(str(tmp_path), non_finite="drop")
    assert len(src.test) == 3 and len(src.train) == 10
    _npz(tmp_path, "test", 0)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'test.npz'}: holds no examples"):
        load_npz(str(tmp_path))


def test_the_npz_loader_names_labels_no_model_can_use(tmp_path: Path) -> None:
    """Labels a classifier cannot work with are said, naming the files: labels that are not
    one int per example; a single class (refused before any run folder exists: torchmetrics
    failed after it with a message naming no file); test labels no training example has (a
    warning: every such example counts as a miss, silently 0 %)."""
    _npz(tmp_path, "train", 12, y=np.zeros((12, 1), np.int64))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'train.npz'}: labels y must be 1-D"):
        load_npz(str(tmp_path))
    _npz(tmp_path, "train", 12, y=np.zeros(12, np.int64))
    _npz(tmp_path, "test", 4, y=np.zeros(4, np.int64))
    with pytest.raises(ValueError, match=rf"npz in {tmp_path}: every label is 0, so there is 1"):
        load_npz(str(tmp_path))
    _npz(tmp_path, "train", 12, y=np.full(12, 3, np.int64))  # one class, not 4 with 3 empty
    _npz(tmp_path, "test", 4, y=np.full(4, 3, np.int64))
    with pytest.raises(ValueError, match=rf"npz in {tmp_path}: every label is 3, so there is 1"):
        load_npz(str(tmp_path))
    site = tmp_path / "site"  # one class of a federation's ten, said by class_names: no fuss
    _npz(site, "train", 12, y=np.full(12, 3, np.int64), class_names=np.array(list("abcdefghij")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_npz(str(site)).num_classes == 10
    _npz(tmp_path, "train", 12, y=np.arange(12) % 3 * 2)  # 0, 2, 4: 1 and 3 have no example
    _npz(tmp_path, "test", 4, y=np.array([0, 2, 2, 4]))
    with pytest.warns(DataWarning, match=r"label\(s\) 1, 3 have no example, yet the model gets 5 "
                      r"outputs .* number the 3 classes 0 to 2"):  # fmt: skip
        assert load_npz(str(tmp_path)).num_classes == 5
    _npz(tmp_path, "train", 12, y=np.arange(12) % 3)
    _npz(tmp_path, "test", 4, y=np.array([0, 7, 7, 9]))
    with (
        pytest.warns(DataWarning, match=r"test\.npz holds label\(s\) 7, 9 that no example of "
                     r"train\.npz has \(3 of its 4 examples\)"),
        pytest.warns(DataWarning, match=r"label\(s\) 3, 4, 5, 6, 8 have no example"),
    ):  # fmt: skip
        assert load_npz(str(tmp_path)).num_classes == 10
    _npz(tmp_path, "test", 4, y=np.array([0, 1, 2, 2]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every test label trained on: no warning
        load_npz(str(tmp_path))


def test_a_label_far_past_the_classes_is_refused_not_allocated(tmp_path: Path) -> None:
    """Without class_names the model gets the largest label + 1 outputs: a sentinel label
    (10**9) made the loader list 10**9 class names and the run was killed for memory after a
    warning. Labels no example has may be as many as the examples (a warning), not more."""
    y = np.arange(12) % 2
    _npz(tmp_path, "test", 4, y=np.array([0, 1, 1, 0]))
    _npz(tmp_path, "train", 12, y=np.where(np.arange(12) == 5, 19, y))  # 17 absent > 16
    with pytest.raises(ValueError, match="outputs, 17 of them for labels no example has"):
        load_npz(str(tmp_path))  # first: without the check, 10**9 below would fill the memory
    _npz(tmp_path, "train", 12, y=np.where(np.arange(12) == 5, 10**9, y))
    with pytest.raises(ValueError) as e:
        load_npz(str(tmp_path))
    assert str(e.value) == (
        f"npz in {tmp_path}: the largest label is 1000000000, so the model would get 1000000001 "
        "outputs, 999999998 of them for labels no example has (more than the 16 examples): "
        "number the 3 classes 0 to 2, or store class_names, the full list of classes"
    )
    _npz(tmp_path, "train", 12, y=np.where(np.arange(12) == 5, 18, y))  # 16 absent: a warning
    with pytest.warns(DataWarning, match=r"label\(s\) 2, 3, 4, 5, 6 \.\.\. have no example"):
        assert load_npz(str(tmp_path)).num_classes == 19
    names = np.array([str(c) for c in range(40)])  # class_names says the classes are meant
    _npz(tmp_path, "train", 12, y=np.where(np.arange(12) == 5, 39, y), class_names=names)
    _npz(tmp_path, "test", 4, y=np.array([0, 1, 1, 0]), class_names=names)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_npz(str(tmp_path)).num_classes == 40


def test_uint8_inputs_of_only_0_and_1_are_said_to_be_scaled(tmp_path: Path) -> None:
    """uint8 inputs are read as 0-255 images and divided by 255, whatever their shape: a table
    of 0/1 columns stored as uint8 (one-hot, a binarized image) silently became 0 and 1/255."""
    onehot = np.eye(3, dtype=np.uint8)[np.arange(12) % 3]
    _npz(tmp_path, "train", 12, x=onehot, y=np.arange(12) % 3)
    _npz(tmp_path, "test", 3, x=onehot[:3] * 200, y=np.arange(3))  # grey levels: no warning
    with pytest.warns(DataWarning) as caught:
        src = load_npz(str(tmp_path))
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'train.npz'}: x is uint8 and holds only 0 and 1, but uint8 inputs are read "
        "as 0-255 images and divided by 255 (1 becomes 0.0039); store x as float32 or bool to "
        "keep 0 and 1"
    ]
    assert src.train.x.max().item() == pytest.approx(1 / 255)  # the warning says what happens
    _npz(tmp_path, "train", 12, x=onehot.astype(bool), y=np.arange(12) % 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bool and float 0/1 stay 0 and 1, silently
        assert load_npz(str(tmp_path)).train.x.max().item() == 1.0
        _npz(tmp_path, "train", 12, x=onehot.astype(np.float32), y=np.arange(12) % 3)
        assert load_npz(str(tmp_path)).train.x.max().item() == 1.0
        _npz(tmp_path, "train", 12, x=onehot * 2, y=np.arange(12) % 3)  # a 2: grey levels
        load_npz(str(tmp_path))


def _labelled(data: DataConfig) -> DataSource:
    source = load_source(data)
    assert isinstance(source, DataSource)
    return source


def test_input_noise_is_refused_for_inputs_outside_0_1(tmp_path: Path) -> None:
    """data.noise adds Gaussian noise and clips to [0, 1] (pixels): on standardized features
    the clip silently turned every value into 0 or 1 (76 % -> 61 % at eps = 0.1 on a
    3-class table)."""
    noisy = DataConfig(name="npz", root=str(tmp_path), noise=0.1)
    edges = np.zeros((12, 1, 4, 4), np.float32)
    edges[0, 0, 0, 0] = 1.0  # exactly [0, 1]: images, accepted
    _npz(tmp_path, "train", 12, x=edges, y=np.arange(12) % 3)
    _npz(tmp_path, "test", 4, y=np.arange(4) % 3)
    assert len(_labelled(noisy).train) == 12
    for part, value, span in (("train", -0.5, "[-0.5, 1]"), ("test", 1.25, "[0, 1.25]")):
        x = edges.copy() if part == "train" else np.zeros((4, 1, 4, 4), np.float32)
        x[-1, 0, 1, 1] = value
        _npz(tmp_path, part, len(x), x=x, y=np.arange(len(x)) % 3)
        with pytest.raises(ValueError) as e:
            load_source(noisy)
        assert str(e.value) == (
            "data.noise=0.1 adds pixel noise and clips every input to [0, 1], but the inputs "
            f"of source 'npz' span {span}: the clip would replace every value outside [0, 1] "
            "(standardized features become 0 or 1); scale the inputs to [0, 1] first, or "
            "leave data.noise at 0"
        )
        assert len(_labelled(DataConfig(name="npz", root=str(tmp_path))).train) == 12
        _npz(tmp_path, part, len(x), x=np.clip(x, 0, 1), y=np.arange(len(x)) % 3)


def test_the_npz_loader_refuses_files_that_disagree_or_cannot_be_read(tmp_path: Path) -> None:
    """What a careless copy gives, each named in one line: class_names that differ between the
    two files (label k would mean one class in training and another in the test: the accuracy
    would be wrong without a word), a train.npz cut short (a zip error, not a traceback), 1-D
    inputs (the model's error named no file)."""
    names = np.array(["a", "b", "c"])
    _npz(tmp_path, "train", 12, y=np.arange(12) % 3, class_names=names)
    _npz(tmp_path, "test", 4, y=np.array([0, 1, 2, 2]), class_names=names[::-1])
    with pytest.raises(ValueError, match=r"class_names differ between train\.npz \['a', 'b', "
                       r"'c'\] and test\.npz \['c', 'b', 'a'\]"):  # fmt: skip
        load_npz(str(tmp_path))
    _npz(tmp_path, "test", 4, y=np.array([0, 1, 2, 2]), class_names=names)
    assert load_npz(str(tmp_path)).class_names == ["a", "b", "c"]
    _npz(tmp_path, "test", 4, y=np.array([0, 1, 2, 2]))  # one file names them: its list holds
    assert load_npz(str(tmp_path)).class_names == ["a", "b", "c"]
    whole = (tmp_path / "train.npz").read_bytes()
    (tmp_path / "train.npz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=rf"{tmp_path / 'train.npz'}: cannot read the npz file"):
        load_npz(str(tmp_path))
    _npz(tmp_path, "train", 12, x=np.ones(12, np.float32), y=np.arange(12) % 3)
    with pytest.raises(ValueError, match=r"train\.npz: inputs x must be \[examples, features"):
        load_npz(str(tmp_path))


def test_non_finite_is_an_option_of_the_npz_source_only() -> None:
    with pytest.raises(
        ValueError, match=r"data\.non_finite='drop' has no effect on source 'digits'"
    ):
        load_source(DataConfig(name="digits", non_finite="drop"))


def _cfg(root: Path, *more: str):
    return load_config(
        None,
        ["data.name=npz", f"data.root={root}", "num_clients=2", "partition.name=iid",
         "progress=false", *more],
    )  # fmt: skip


def test_without_test_npz_a_fixed_stratified_share_is_held_out(tmp_path: Path) -> None:
    _npz(tmp_path, "train", 100)
    fed = build_federation(_cfg(tmp_path), 0)
    n = len(fed.central_test)
    assert 15 <= n <= 25 and len(fed.pool) == 100 - n  # 20 % of each class, rounded
    assert fed.test_split == (
        f"held out 20 % of train.npz ({n} of 100 examples, stratified, seed 0): no test.npz"
    )
    other = build_federation(_cfg(tmp_path), 7)  # the same test set for every experiment seed
    assert torch.equal(other.central_test.x, fed.central_test.x)
    # the held-out rows are rows of train.npz, never also a client's
    with np.load(tmp_path / "train.npz") as f:
        x = torch.from_numpy(f["x"]).flatten(1)
    held = fed.central_test.x.flatten(1)
    assert all(bool((x == row).all(1).any()) for row in held)
    assert not any(bool((fed.pool.x.flatten(1) == row).all(1).any()) for row in held)
    with_test = tmp_path / "both"
    _npz(with_test, "train", 100)
    _npz(with_test, "test", 30, seed=1)
    fed = build_federation(_cfg(with_test), 0)
    assert fed.test_split is None and len(fed.central_test) == 30 and len(fed.pool) == 100


def test_a_missing_test_split_is_refused_when_asked(tmp_path: Path) -> None:
    _npz(tmp_path, "train", 100)
    with pytest.raises(ConfigError, match=rf"no test split: {tmp_path / 'test.npz'} does not "):
        build_federation(_cfg(tmp_path, "data.missing_test=error"), 0)


def test_a_central_run_needs_training_data(tmp_path: Path) -> None:
    _npz(tmp_path, "test", 30)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'train.npz'} is missing or empty"):
        build_federation(_cfg(tmp_path), 0)


def _source(y: torch.Tensor, task: str = "classification") -> DataSource:
    x = torch.arange(len(y), dtype=torch.float32)[:, None]
    empty = TensorSplit(x[:0], y[:0])
    return DataSource("mine", TensorSplit(x, y), empty, 3, (1,), ["a", "b", "c"], task)


def test_hold_out_of_a_regression_source_and_too_few_examples() -> None:
    y = torch.linspace(0.0, 1.0, 50)
    held, note = central_splits(_source(y, "regression"), DataConfig(name="mine"))
    assert len(held.test) == round(HOLDOUT_FRACTION * 50) and len(held.train) == 40
    assert note is not None and note.startswith("held out 20 % of the training data")
    with pytest.raises(ConfigError, match="too few training examples"):
        central_splits(_source(torch.tensor([0, 1, 2])), DataConfig(name="mine"))


@pytest.mark.parametrize(
    ("overrides", "remedy"),
    [
        (["partition.min_size=0"], "set partition.min_size >= 1 or use fewer clients"),
        # step never reads min_size: raising it (here 10 already) would change nothing
        (["partition.name=step", "partition.min_size=10"], "use fewer clients (num_clients) or"),
    ],
)
def test_an_empty_client_is_told_a_remedy_its_partition_reads(
    tmp_path: Path, overrides: list[str], remedy: str
) -> None:
    """A client left without training data is named with the settings its partitioner reads
    and a remedy that applies to it: ``partition.min_size`` only where it is read and below 1
    (the step partition was told to set a min_size it never reads, already 10)."""
    _npz(tmp_path, "train", 40)
    _npz(tmp_path, "test", 8, seed=1)
    cfg = load_config(None, ["data.name=npz", f"data.root={tmp_path}", "num_clients=39",
                             "partition.alpha=0.05", *overrides])  # fmt: skip
    with pytest.raises(ValueError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)  # step: min_size=10 is not used
        build_federation(cfg, 42)
    message = str(e.value)
    assert message.startswith("client ") and "received no training data" in message
    assert message.endswith(remedy + ("" if "min_size" in remedy else " a partition that gives "
                                      "every client data"))  # fmt: skip
    assert "\n" not in message
    assert ("alpha" in message) == ("step" not in overrides[0])  # only the keys it reads


def test_a_partition_refusal_says_where_the_rest_of_the_data_went(tmp_path: Path) -> None:
    """A partition counts only the examples the clients share: "for 4 examples" of a file of
    450 left the user to guess that data.fraction had kept 4; the refusal names the keys that
    shrank the pool, and says nothing more when nothing did."""
    _npz(tmp_path, "train", 200)
    _npz(tmp_path, "test", 8, seed=1)
    base = ["data.name=npz", f"data.root={tmp_path}", "num_clients=5", "partition.min_size=10"]
    with pytest.raises(ValueError) as e:
        build_federation(load_config(None, [*base, "data.fraction=0.1"]), 42)
    assert str(e.value).endswith(
        " for 21 examples (min_size * num_clients > number of examples); lower min_size or "
        "num_clients until min_size * num_clients <= 21 (the clients share 21 of the 200 "
        "training examples: data.fraction=0.1)"
    )
    with pytest.raises(ValueError) as e:  # an empty client, after a selection split
        over = ["data.selection_fraction=0.5", "num_clients=150", "partition.min_size=0"]
        build_federation(load_config(None, [*base, *over]), 42)
    assert str(e.value).endswith(
        "(the clients share 100 of the 200 training examples: data.selection_fraction=0.5)"
    )
    with pytest.raises(ValueError) as e:  # the whole file shared: nothing to add
        build_federation(load_config(None, [*base, "num_clients=30"]), 42)
    assert str(e.value).endswith(
        "(min_size * num_clients > number of examples); lower min_size or num_clients until "
        "min_size * num_clients <= 200"
    )  # a remedy, as the exhausted redraws give one


def test_more_clients_than_examples_are_told_only_the_remedy_that_can_work(
    tmp_path: Path,
) -> None:
    """With more clients than examples, ``partition.min_size >= 1`` cannot be met: the refusal
    of the client left empty says to use fewer clients than the examples, not to raise it."""
    _npz(tmp_path, "train", 40)
    _npz(tmp_path, "test", 8, seed=1)
    over = ["data.name=npz", f"data.root={tmp_path}", "num_clients=60", "partition.min_size=0"]
    with pytest.raises(ValueError) as e:
        build_federation(load_config(None, over), 42)
    message = str(e.value)
    assert "received no training data" in message and "min_size >= 1" not in message
    assert message.endswith("; use fewer clients (num_clients) than the 40 examples")


def test_loose_npy_arrays_are_told_how_to_become_an_archive(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((3, 2), np.float32))
    np.save(tmp_path / "y.npy", np.zeros(3, np.int64))
    with pytest.raises(FileNotFoundError) as e:
        load_npz(str(tmp_path))
    assert str(e.value).endswith(
        '; it holds x.npy, y.npy: pack each split\'s arrays into one archive, np.savez("train.npz",'
        " x=x, y=y)"
    )
    with pytest.raises(FileNotFoundError) as e:  # nothing there: no hint
        load_npz(str(tmp_path / "none"))
    assert str(e.value).endswith("(arrays x, y and optionally class_names)")


def test_a_file_given_as_data_root_is_told_it_is_a_file(tmp_path: Path) -> None:
    """data.root=wine/train.npz (the archive, not its folder) or data.root=wine.csv (a table
    not yet converted) used to read "neither wine/train.npz/train.npz nor ... exists"."""
    _npz(tmp_path, "train", 6)
    with pytest.raises(FileNotFoundError) as e:
        load_npz(str(tmp_path / "train.npz"))
    assert str(e.value).endswith(f"; {tmp_path / 'train.npz'} is a file, not a folder: name "
                                 f"its folder, data.root={tmp_path}")  # fmt: skip
    (tmp_path / "wine.csv").write_text("a,b\n1,2\n")
    with pytest.raises(FileNotFoundError) as e:
        load_npz(str(tmp_path / "wine.csv"))
    assert str(e.value).endswith(" is a file, not a folder (convert a table to the archives "
                                 "first; labelled text: data.name=text_csv)")  # fmt: skip


def test_an_archive_of_another_name_given_as_data_root_is_told_to_rename_it(
    tmp_path: Path,
) -> None:
    """data.root=wine/all.npz was told "name its folder, data.root=wine", a folder without
    train.npz or test.npz that is refused again: the archive must be named train.npz."""
    np.savez(tmp_path / "all.npz", x=np.zeros((4, 2), np.float32), y=np.array([0, 1, 0, 1]))
    with pytest.raises(FileNotFoundError) as e:
        load_npz(str(tmp_path / "all.npz"))
    told = f"; {tmp_path / 'all.npz'} is a file, not a folder: name it train.npz (or test.npz)"
    assert str(e.value).endswith(f"{told} and data.root its folder, {tmp_path}")


@pytest.mark.parametrize(
    ("arrays", "told"),
    [
        ({"y": np.array(["cat", "dog"] * 3)}, "got <U3 (text, such as y[0] = 'cat'): number the "
         "classes, names, y = np.unique(y, return_inverse=True), and store names as class_names"),
        ({"y": np.arange(6, dtype=np.float32) % 2}, "got float32 (whole numbers: store "
         "y.astype(np.int64))"),
        ({"y": np.array([0, 1, 0.5, 1, np.nan, 0])}, "got float64, and y[2] is 0.5, not a class "
         "number"),
        ({"y": np.array(["cat", 1] * 3, dtype=object)}, "array 'y' holds Python objects (dtype "
         "object), which are not read; store it as integers"),
        ({"x": np.array([[1.0, "n/a"]] * 6, dtype=object)}, "array 'x' holds Python objects"),
        ({"class_names": np.array(["a", "b"], dtype=object)}, "array 'class_names' holds Python "
         "objects (dtype object), which are not read; store it as strings, np.array(names, "
         "dtype=str)"),
    ],
)  # fmt: skip
def test_labels_of_another_type_and_object_arrays_are_told_how_to_store_them(
    tmp_path: Path, arrays: dict[str, np.ndarray], told: str
) -> None:
    """Text labels (a CSV's class column saved as it is), floats and arrays of Python objects
    (a pandas column or Index saved as it is) are refused naming the file and the array, with
    how to store it: "labels y must be integers, got <U3" alone left the newcomer to find out
    how; "cannot read the npz file (Object arrays cannot be loaded ...)" named no array."""
    data: dict[str, np.ndarray] = {"x": np.zeros((6, 2), np.float32), "y": np.arange(6) % 2}
    np.savez(tmp_path / "train.npz", allow_pickle=True, **{**data, **arrays})
    with pytest.raises(ValueError) as e:
        load_npz(str(tmp_path))
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'train.npz'}: ") and told in message
    assert "\n" not in message
