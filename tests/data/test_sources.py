"""Data sources: digits, and Fashion-MNIST / CIFAR loaders on small fake files."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlore import registry
from fedlore.data.sources import load_cifar10, load_cifar100, load_digits, load_fashion_mnist


def _idx_bytes(arr: np.ndarray, magic: int | None = None) -> bytes:
    arr = np.asarray(arr, dtype=np.uint8)
    if magic is None:
        magic = 0x0800 | arr.ndim
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in arr.shape)
    return header + arr.tobytes()


def _write_fashion(folder: Path, gz: bool, n_train: int = 12, n_test: int = 5) -> None:
    rng = np.random.default_rng(0)
    files = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": np.arange(n_test) % 10,
    }
    folder.mkdir(parents=True, exist_ok=True)
    for stem, arr in files.items():
        data = _idx_bytes(arr)
        if gz:
            (folder / f"{stem}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / stem).write_bytes(data)


def test_digits_shapes_range_and_fixed_split() -> None:
    a, b = load_digits(), load_digits()
    assert a.train.x.shape == (1437, 1, 8, 8) and a.test.x.shape == (360, 1, 8, 8)
    assert a.train.x.dtype == torch.float32 and a.train.y.dtype == torch.int64
    assert float(a.train.x.min()) >= 0.0 and float(a.train.x.max()) == 1.0
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    # Stratified: every class is in the test set in proportion (about 36 each).
    counts = np.bincount(a.test.y.numpy(), minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    assert a.num_classes == 10 and a.input_shape == (1, 8, 8) and len(a.class_names) == 10


def test_the_digits_npz_fixture_is_the_digits_federation(digits_npz: list[str]) -> None:
    """The Flower tests read digits from the ``digits_npz`` folder (tests/conftest.py) so that
    their processes skip importing scikit-learn: it must build the very federation of
    ``data.name=digits``."""
    from fedlore.config import load_config
    from fedlore.data.federation import build_federation

    base = ["num_clients=3", "data.server_fraction=0.2"]
    a = build_federation(load_config(None, base), 42)
    b = build_federation(load_config(None, [*base, *digits_npz]), 42)
    assert (b.num_classes, b.input_shape, b.class_names) == (
        a.num_classes,
        a.input_shape,
        a.class_names,
    )
    for name in ("pool", "central_test"):
        assert torch.equal(getattr(a, name).x, getattr(b, name).x), name
        assert torch.equal(getattr(a, name).y, getattr(b, name).y), name
    assert torch.equal(a.train_labels, b.train_labels)
    for got, want in [(b.train_indices, a.train_indices), (b.test_indices, a.test_indices)]:
        pairs = zip(got, want, strict=True)
        assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in pairs)
    assert np.array_equal(np.asarray(b.server_indices), np.asarray(a.server_indices))


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_reads_raw_and_gz(tmp_path: Path, gz: bool) -> None:
    _write_fashion(tmp_path, gz)
    src = registry.get("source", "fashion_mnist")(str(tmp_path))
    assert src.train.x.shape == (12, 1, 28, 28) and src.test.x.shape == (5, 1, 28, 28)
    assert src.train.x.dtype == torch.float32 and float(src.train.x.min()) >= 0.0
    assert float(src.train.x.max()) <= 1.0
    assert src.train.y.tolist() == [i % 10 for i in range(12)]
    assert src.class_names[9] == "Ankle boot" and src.input_shape == (1, 28, 28)


def test_fashion_mnist_missing_lists_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        load_fashion_mnist(str(tmp_path / "nowhere"))
    msg = str(err.value)
    for stem in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert str(tmp_path / "nowhere" / stem) in msg
        assert str(tmp_path / "nowhere" / f"{stem}.gz") in msg
    assert "apt-get install dataset-fashion-mnist" in msg and "data.root" in msg


def test_fashion_mnist_corrupt_magic_and_size(tmp_path: Path) -> None:
    _write_fashion(tmp_path, gz=False)
    bad = tmp_path / "train-images-idx3-ubyte"
    bad.write_bytes(_idx_bytes(np.zeros((12, 28, 28)), magic=0x0D03))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.*magic"):
        load_fashion_mnist(str(tmp_path))
    bad.write_bytes(_idx_bytes(np.zeros((12, 28, 28)))[:-7])
    with pytest.raises(ValueError, match="train-images-idx3-ubyte"):
        load_fashion_mnist(str(tmp_path))


def test_fashion_mnist_count_mismatch(tmp_path: Path) -> None:
    _write_fashion(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(np.zeros(4))))
    with pytest.raises(ValueError, match="t10k"):
        load_fashion_mnist(str(tmp_path))


def _dump(path: Path, obj: object) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def _batch(n: int, key: bytes, num_classes: int, seed: int) -> dict[bytes, object]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    return {b"data": data, key: [int(v) for v in rng.integers(0, num_classes, n)]}


def test_cifar10_fake_folder(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(1, 6):
        _dump(folder / f"data_batch_{i}", _batch(4, b"labels", 10, i))
    test_batch = _batch(3, b"labels", 10, 9)
    _dump(folder / "test_batch", test_batch)
    _dump(folder / "batches.meta", {b"label_names": [f"c{i}".encode() for i in range(10)]})
    for root in (folder, tmp_path):  # the batches folder itself or its parent
        src = registry.get("source", "cifar10")(str(root))
        assert src.train.x.shape == (20, 3, 32, 32) and src.test.x.shape == (3, 3, 32, 32)
        assert src.class_names[3] == "c3" and src.num_classes == 10
    raw = np.asarray(test_batch[b"data"])[1].reshape(3, 32, 32)
    assert torch.allclose(src.test.x[1], torch.from_numpy(raw.astype(np.float32) / 255.0))
    assert src.test.y.tolist() == test_batch[b"labels"]


def test_cifar100_fake_folder(tmp_path: Path) -> None:
    _dump(tmp_path / "train", _batch(6, b"fine_labels", 100, 1))
    _dump(tmp_path / "test", _batch(2, b"fine_labels", 100, 2))
    _dump(tmp_path / "meta", {b"fine_label_names": [f"f{i}".encode() for i in range(100)]})
    src = load_cifar100(str(tmp_path))
    assert src.train.x.shape == (6, 3, 32, 32) and src.num_classes == 100
    assert src.class_names[99] == "f99" and src.train.y.dtype == torch.int64


def test_cifar_missing_root_and_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data\.root"):
        load_cifar10(None)
    with pytest.raises(FileNotFoundError) as err:
        load_cifar100(str(tmp_path))
    assert str(tmp_path / "cifar-100-python" / "train") in str(err.value)
    assert str(tmp_path / "meta") in str(err.value)


def test_cifar_malformed_batch(tmp_path: Path) -> None:
    _dump(tmp_path / "train", {b"data": np.zeros((2, 10), np.uint8), b"fine_labels": [0, 1]})
    _dump(tmp_path / "test", _batch(2, b"fine_labels", 100, 2))
    _dump(tmp_path / "meta", {b"fine_label_names": [b"x"] * 100})
    with pytest.raises(ValueError, match="train"):
        load_cifar100(str(tmp_path))
