"""Image data sources read from local files: digits, Fashion-MNIST (IDX), CIFAR-10/100 (pickle).

Every loader has the signature ``f(root: str | None = None, **options) -> DataSource`` and is
registered under its name with :func:`fedlore.registry.register_source`. Nothing is downloaded: a
loader reads the files under ``root`` (or a documented default) and fails with a message that
names every path it looked at and how to get the data. Text sources (``fortunes``, ``text_csv``,
``text_jsonl``) live in :mod:`fedlore.data.text` and take keyword options (tokenizer, length);
``hf`` (:mod:`fedlore.data.hf`) and ``leaf`` (:mod:`fedlore.data.leaf`) read data sets of the
federated-learning ecosystem, and ``npz`` (:mod:`fedlore.data.npz`) a user's own arrays.

Images are float32 ``[B, C, H, W]`` scaled to [0, 1]; labels are int64 ``[B]``.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Importing this module registers every source (registry.get imports it): the image sources
# below, the text sources, the pre-training corpora, Hugging Face datasets on disk and LEAF.
from fedlore.data import c4 as _c4  # noqa: F401
from fedlore.data import fortunes_c4 as _fortunes_c4  # noqa: F401
from fedlore.data import hf as _hf  # noqa: F401
from fedlore.data import leaf as _leaf  # noqa: F401
from fedlore.data import text as _text  # noqa: F401
from fedlore.data.client_data import TensorSplit, numpy_split
from fedlore.data.datasource import DataSource
from fedlore.data.npz import load_npz as load_npz  # registered there; importable here too
from fedlore.registry import register_source

DIGITS_SPLIT_SEED = 0
"""Seed of the fixed stratified 80/20 train/test split of sklearn's digits (1,437 / 360)."""

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist/"
"""Default Fashion-MNIST folder: where the Debian package ``dataset-fashion-mnist`` puts it."""

FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip

_IDX_UBYTE = 0x08  # IDX type code of unsigned bytes, the only one MNIST-style files use


@register_source("digits")
def load_digits(root: str | None = None) -> DataSource:
    """sklearn's 8x8 handwritten digits (1,797 images, 10 classes), shipped with scikit-learn.

    Pixel values 0..16 are divided by 16. The train/test split is a fixed stratified 80/20 split
    (``sklearn.model_selection.train_test_split`` with ``random_state=DIGITS_SPLIT_SEED``), so it
    is the same for every run and every experiment seed.

    Args:
        root: must be None (the data ship with scikit-learn).

    Returns:
        A :class:`DataSource` with images ``[B, 1, 8, 8]``.

    Raises:
        ValueError: when ``root`` is given (it would have no effect).
    """
    if root is not None:
        raise ValueError(
            f"data.root={root!r} has no effect on source 'digits' (it ships with "
            "scikit-learn); leave data.root unset"
        )
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sk_load_digits()
    images = (np.asarray(bunch.images, dtype=np.float32) / 16.0)[:, None, :, :]
    labels = np.asarray(bunch.target, dtype=np.int64)
    idx_train, idx_test = train_test_split(
        np.arange(len(labels)), test_size=0.2, stratify=labels, random_state=DIGITS_SPLIT_SEED
    )
    idx_train, idx_test = np.sort(idx_train), np.sort(idx_test)
    return DataSource(
        name="digits",
        train=numpy_split(images[idx_train], labels[idx_train]),
        test=numpy_split(images[idx_test], labels[idx_test]),
        num_classes=10,
        input_shape=(1, 8, 8),
        class_names=[str(d) for d in range(10)],
    )


DIABETES_SPLIT_SEED = 0
"""Seed of the fixed 80/20 train/test split of sklearn's diabetes data (353 / 89)."""


@register_source("diabetes")
def load_diabetes(root: str | None = None) -> DataSource:
    """sklearn's diabetes regression data (Efron et al. 2004): 442 patients, 10 baseline
    features, a real target (disease progression one year later), shipped with scikit-learn.

    A fixed 80/20 train/test split (``train_test_split``, ``random_state=DIABETES_SPLIT_SEED``);
    features and target are standardized with the training split's mean and standard deviation
    (the raw ``scaled=False`` values), so the unit-noise Gaussian likelihood of the task loss is
    on the target's own scale (RMSE 1 = one standard deviation of the training targets).

    Args:
        root: must be None (the data ships with scikit-learn).

    Returns:
        A regression :class:`DataSource` (inputs float32 ``[B, 10]``, targets float32 ``[B]``).

    Raises:
        ValueError: when ``root`` is given.
    """
    if root is not None:
        raise ValueError(
            f"data.root={root!r} has no effect on source 'diabetes' (it ships with "
            "scikit-learn); leave data.root unset"
        )
    from sklearn.datasets import load_diabetes as sk_load_diabetes
    from sklearn.model_selection import train_test_split

    bunch = sk_load_diabetes(scaled=False)
    x = np.asarray(bunch.data, dtype=np.float64)
    y = np.asarray(bunch.target, dtype=np.float64)
    idx_train, idx_test = train_test_split(
        np.arange(len(y)), test_size=0.2, random_state=DIABETES_SPLIT_SEED
    )
    idx_train, idx_test = np.sort(idx_train), np.sort(idx_test)
    mu, sd = x[idx_train].mean(0), x[idx_train].std(0)
    y_mu, y_sd = y[idx_train].mean(), y[idx_train].std()

    def split(idx: np.ndarray) -> TensorSplit:
        xs = ((x[idx] - mu) / sd).astype(np.float32)
        ys = ((y[idx] - y_mu) / y_sd).astype(np.float32)
        return TensorSplit(torch.from_numpy(xs), torch.from_numpy(ys))

    return DataSource(
        name="diabetes",
        train=split(idx_train),
        test=split(idx_test),
        num_classes=1,
        input_shape=(x.shape[1],),
        class_names=["progression"],
        task="regression",
    )


def read_idx(path: str | Path, ndim: int) -> np.ndarray:
    """Read one IDX file of unsigned bytes (raw or gzip-compressed, by the ``.gz`` suffix).

    Format (LeCun's MNIST page): 2 zero bytes, a type byte (0x08 = ubyte), a byte giving the
    number of dimensions, then each dimension as a big-endian int32, then the data.

    Args:
        path: the file.
        ndim: expected number of dimensions (3 for images, 1 for labels).

    Returns:
        A uint8 array of the shape stored in the header.

    Raises:
        ValueError: naming the file when the magic number, type, dimension count or data size is
            wrong (a corrupt or truncated file).
    """
    path = Path(path)
    opener: Any = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # gzip raises BadGzipFile (an OSError) or EOFError
        raise ValueError(f"{path}: cannot read IDX file ({e})") from e
    if len(raw) < 4:
        raise ValueError(f"{path}: corrupt IDX file, only {len(raw)} bytes")
    magic = int.from_bytes(raw[:4], "big")
    expected = (_IDX_UBYTE << 8) | ndim
    if magic != expected:
        raise ValueError(
            f"{path}: corrupt IDX file, magic number 0x{magic:08x} (expected 0x{expected:08x}, "
            f"unsigned bytes with {ndim} dimension(s))"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: corrupt IDX file, header truncated ({len(raw)} bytes)")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    size = int(np.prod(dims))
    if len(raw) - header != size:
        raise ValueError(
            f"{path}: corrupt IDX file, header says shape {dims} ({size} bytes of data) but the "
            f"file holds {len(raw) - header} bytes of data"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_idx(folder: Path, stem: str, looked: list[Path]) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        looked.append(candidate)
        if candidate.is_file():
            return candidate
    return None


@register_source("fashion_mnist")
def load_fashion_mnist(root: str | None = None) -> DataSource:
    """Fashion-MNIST (Xiao et al. 2017) from its original IDX files, raw or ``.gz``.

    Reads ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``
    and ``t10k-labels-idx1-ubyte`` (each with or without ``.gz``) from ``root``, by default
    :data:`FASHION_MNIST_ROOT`.

    Args:
        root: folder holding the four files; ``None`` for the Debian package's folder.

    Returns:
        A :class:`DataSource` with images ``[B, 1, 28, 28]`` (60,000 train, 10,000 test).

    Raises:
        FileNotFoundError: listing every path looked at and how to get the data.
        ValueError: naming the file when one is corrupt or images and labels disagree in count.
    """
    folder = Path(root) if root is not None else Path(FASHION_MNIST_ROOT)
    looked: list[Path] = []
    stems = {
        "train_x": "train-images-idx3-ubyte",
        "train_y": "train-labels-idx1-ubyte",
        "test_x": "t10k-images-idx3-ubyte",
        "test_y": "t10k-labels-idx1-ubyte",
    }
    found = {key: _find_idx(folder, stem, looked) for key, stem in stems.items()}
    if any(p is None for p in found.values()):
        missing = [stems[k] for k, p in found.items() if p is None]
        raise FileNotFoundError(
            f"Fashion-MNIST files missing: {', '.join(missing)}. Looked at:\n  "
            + "\n  ".join(str(p) for p in looked)
            + "\nInstall the data with `apt-get install dataset-fashion-mnist` or point "
            "data.root=... at a folder holding the four IDX files (raw or .gz)."
        )
    splits = []
    for part in ("train", "test"):
        x_path, y_path = found[f"{part}_x"], found[f"{part}_y"]
        assert x_path is not None and y_path is not None
        images, labels = read_idx(x_path, ndim=3), read_idx(y_path, ndim=1)
        if len(images) != len(labels):
            raise ValueError(f"{x_path} has {len(images)} images but {y_path} has {len(labels)}")
        if labels.size and labels.max() >= len(FASHION_MNIST_CLASSES):
            raise ValueError(f"{y_path}: label {int(labels.max())} outside [0, 10)")
        splits.append(numpy_split(images[:, None, :, :], labels))
    return DataSource(
        name="fashion_mnist",
        train=splits[0],
        test=splits[1],
        num_classes=10,
        input_shape=(1, *splits[0].x.shape[2:]),
        class_names=list(FASHION_MNIST_CLASSES),
    )


def _unpickle(path: Path) -> dict[bytes, Any]:
    # CIFAR's python batches are pickles: only load folders you trust.
    try:
        with open(path, "rb") as f:
            obj = pickle.load(f, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise ValueError(f"{path}: not a readable CIFAR pickle ({e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return obj


def _cifar_folder(root: str | None, name: str, subdir: str, files: list[str]) -> Path:
    """The folder holding ``files``: ``root`` itself or ``root/subdir``."""
    hint = (
        f"{name} needs data.root=... pointing at the extracted '{subdir}' folder of the python "
        "version of the data set (or its parent)"
    )
    if root is None:
        raise FileNotFoundError(f"{name}: no data.root given; {hint}")
    candidates = [Path(root), Path(root) / subdir]
    for folder in candidates:
        if all((folder / f).is_file() for f in files):
            return folder
    looked = [str(folder / f) for folder in candidates for f in files]
    raise FileNotFoundError(
        f"{name}: files not found. Looked at:\n  " + "\n  ".join(looked) + f"\n{hint}."
    )


def _cifar_split(path: Path, label_key: bytes, num_classes: int) -> TensorSplit:
    batch = _unpickle(path)
    if b"data" not in batch or label_key not in batch:
        raise ValueError(f"{path}: missing key b'data' or {label_key!r}; keys: {sorted(batch)}")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise ValueError(
            f"{path}: expected data [B, 3072] and B labels, got data {data.shape} and "
            f"{len(labels)} labels"
        )
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"{path}: labels outside [0, {num_classes})")
    return numpy_split(data.reshape(-1, 3, 32, 32), labels)


def _class_names(path: Path, key: bytes, num_classes: int) -> list[str]:
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in _unpickle(path).get(key, [])]
    if len(names) != num_classes:
        raise ValueError(f"{path}: expected {num_classes} names under {key!r}, got {len(names)}")
    return names


@register_source("cifar10")
def load_cifar10(root: str | None = None) -> DataSource:
    """CIFAR-10 (Krizhevsky 2009) from the python batches (``cifar-10-python.tar.gz``, extracted).

    Reads ``data_batch_1..5`` (train), ``test_batch`` and ``batches.meta`` (class names), each a
    pickled dict with ``b"data"`` (uint8 ``[B, 3072]``, channel-major) and ``b"labels"``.

    Args:
        root: the ``cifar-10-batches-py`` folder or its parent (required).

    Returns:
        A :class:`DataSource` with images ``[B, 3, 32, 32]``.

    Raises:
        FileNotFoundError: when ``root`` is ``None`` or files are missing (lists the paths).
        ValueError: naming the file when a batch is malformed.
    """
    train_files = [f"data_batch_{i}" for i in range(1, 6)]
    folder = _cifar_folder(
        root, "cifar10", "cifar-10-batches-py", [*train_files, "test_batch", "batches.meta"]
    )
    return DataSource(
        name="cifar10",
        train=TensorSplit.concat([_cifar_split(folder / f, b"labels", 10) for f in train_files]),
        test=_cifar_split(folder / "test_batch", b"labels", 10),
        num_classes=10,
        input_shape=(3, 32, 32),
        class_names=_class_names(folder / "batches.meta", b"label_names", 10),
    )


@register_source("cifar100")
def load_cifar100(root: str | None = None) -> DataSource:
    """CIFAR-100 (Krizhevsky 2009) with its 100 fine labels, from the extracted python version.

    Reads ``train``, ``test`` (pickled dicts with ``b"data"`` and ``b"fine_labels"``) and ``meta``
    (``b"fine_label_names"``).

    Args:
        root: the ``cifar-100-python`` folder or its parent (required).

    Returns:
        A :class:`DataSource` with images ``[B, 3, 32, 32]`` and 100 classes.

    Raises:
        FileNotFoundError: when ``root`` is ``None`` or files are missing (lists the paths).
        ValueError: naming the file when a batch is malformed.
    """
    folder = _cifar_folder(root, "cifar100", "cifar-100-python", ["train", "test", "meta"])
    return DataSource(
        name="cifar100",
        train=_cifar_split(folder / "train", b"fine_labels", 100),
        test=_cifar_split(folder / "test", b"fine_labels", 100),
        num_classes=100,
        input_shape=(3, 32, 32),
        class_names=_class_names(folder / "meta", b"fine_label_names", 100),
    )
