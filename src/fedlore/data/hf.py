"""The ``hf`` source: a Hugging Face dataset read from local files with the ``datasets``
library's own readers (nothing is downloaded).

``data.root`` is one of

* a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (it holds
  ``dataset_dict.json`` or ``state.json``), read with ``datasets.load_from_disk``; a single
  ``Dataset`` is the training split;
* a ``.parquet``, ``.csv``, ``.json`` or ``.jsonl`` file: the training split;
* a folder of such files (in subfolders too, e.g. ``data/`` of the Hub's layout; hidden ones
  such as ``.cache/`` are skipped): a file belongs to a split when its name starts with the
  split's name (``train.csv``, ``data/test-00000-of-00001.parquet``) or it lies in a folder
  named after it (``train/0.jsonl``);
* a folder of images (:data:`fedlore.data.hf_images.IMAGES`: PNG, JPEG, BMP, GIF, WebP,
  TIFF) in the layout of torchvision's ``ImageFolder`` and of the Hub's ``imagefolder``,
  ``train/<class>/<image>`` and ``test/<class>/<image>``: an image's folder names its class
  (column ``image``, a ``ClassLabel`` ``label`` of every class folder of both splits, an
  empty one too), and its split folder alone its split (``train/cat/test_3.png`` is a training
  image, ``train/test/1.png`` one of class ``test``); a folder of class folders alone
  (``<class>/<image>``) is the training split, a folder of ``test/<class>/<image>`` alone a
  test split (a site-local server's). Symlinked folders are followed, hidden ones skipped.

Files are read with ``datasets.load_dataset("parquet" | "csv" | "json" | "imagefolder",
data_files=...)``, which caches them as Arrow files in the ``datasets`` cache
(``HF_DATASETS_CACHE``).

The splits are ``data.train_split`` and ``data.test_split`` (default ``train`` / ``test``); a
dataset without the test split is tested on a held-out share of its training split
(``data.missing_test``, :func:`fedlore.data.checks.central_splits`). The columns:

* ``data.input_column`` (default: the first of :data:`INPUT_COLUMNS` present): a
  ``datasets.Image`` column becomes float32 ``[B, C, H, W]`` in [0, 1] (one channel when every
  image is greyscale, else RGB; every image must have one size); a column of arrays or lists of
  numbers becomes float32 (uint8 scaled to [0, 1] as ``npz`` does; ``[B, H, W]`` gets one
  channel, ``[B, H, W, C]`` with C of 1 or 3 is moved to ``[B, C, H, W]``); a string column is
  tokenized as the text sources do (``data.tokenizer``, ``data.max_length``), and a list of two
  string columns (``[sentence1, sentence2]``) is a sentence pair, encoded with the tokenizer's
  pair call (:mod:`fedlore.data.hf_text`).
* ``data.label_column`` (default ``label``): a ``ClassLabel`` gives the classes and their names;
  non-negative integers are classes ``0 .. largest``; strings are numbered in sorted order
  (numerically when every label is an integer), over both splits; a test split with no label
  of the training split is refused, a test label no training example has warned of
  (:func:`fedlore.data.hf_columns.refuse_unseen`).
* ``data.id_column`` (optional): the natural owner of each example (writer, speaker, user), the
  ids of ``partition.name: natural``, numbered in sorted order over both splits.

``datasets`` is imported only when this source loads data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlore.data.checks import check_rows
from fedlore.data.client_data import TensorSplit
from fedlore.data.datasource import DataSource
from fedlore.data.hf_columns import (
    class_ids,
    column_values,
    feature_of,
    raw_labels,
    refuse_missing,
)
from fedlore.data.hf_images import (
    IMAGES,
    class_folders,
    decoded,
    image_mode,
    image_splits,
    pixels,
    walk,
)
from fedlore.data.hf_text import encode, input_columns, is_text, read_texts
from fedlore.data.text import label_order, load_tokenizer
from fedlore.registry import register_source

INPUT_COLUMNS = ("image", "img", "text", "sentence")
"""Input columns looked for, in order, when ``data.input_column`` is not set."""

BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}
"""File suffix -> the ``datasets`` builder that reads it."""

_SAVED = ("dataset_dict.json", "state.json")  # what save_to_disk writes at the top of a folder
_FORMATS = (
    "a save_to_disk folder, a .parquet / .csv / .json / .jsonl file or folder of them, or a "
    "folder of images as train/<class>/<image> (and test/<class>/<image>)"
)


def _builder(path: Path) -> str | None:
    """The ``datasets`` builder of a data file (None: not one)."""
    return "imagefolder" if path.suffix.lower() in IMAGES else BUILDERS.get(path.suffix)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """``datasets`` without its progress bars (restored afterwards)."""
    import datasets

    bars = datasets.are_progress_bars_disabled()
    level = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # errors: said by fedlore
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if not bars:
            datasets.enable_progress_bars()


def _split_files(folder: Path, splits: tuple[str, str]) -> tuple[dict[str, list[str]], str]:
    """The data files of a folder grouped by split, and the builder that reads them."""
    found = sorted(p for p in walk(folder) if _builder(p) is not None)
    if {_builder(p) for p in found} == {"imagefolder"}:  # <split>/<class>/<image>, by folder
        files = image_splits(folder, found, splits)
    else:  # by name (train-00000.parquet) or folder (train/0.jsonl); images mixed in are refused
        files = {}
        parts = [(p, p.relative_to(folder).parts[:-1]) for p in found]
        for split in splits:
            mine = [str(p) for p, up in parts if split in up or p.name.startswith(split)]
            if mine:
                files[split] = mine
    test_only = list(files) == [splits[1]] and len(files[splits[1]]) == len(found)
    if splits[0] not in files and not test_only:  # a test split alone: a site's server
        shown = [str(p.relative_to(folder)) for p in found[:10]]
        raise FileNotFoundError(
            f"hf: no data file for the training split {splits[0]!r} in {folder} (looked for "
            f"{', '.join('*' + s for s in BUILDERS)} files named {splits[0]}* or in a folder "
            f"{splits[0]}/, and images in a folder {splits[0]}/, in subfolders too; found "
            f"{shown or 'none'}). data.root must be {_FORMATS}; data.train_split names the split"
        )
    kinds = {_builder(Path(f)) for fs in files.values() for f in fs}
    if len(kinds) > 1:
        raise ValueError(f"hf: {folder} mixes file formats {sorted(map(str, kinds))}; keep one")
    return files, str(kinds.pop())


def _unreadable(root: str, error: BaseException, files: Any) -> str:
    """Why ``datasets`` could not read ``root``, in one line. Its own error says only "An error
    occurred while generating the dataset": a text file (CSV, JSON) with a byte that is not
    UTF-8 is named with its line, else the innermost error it wraps is said."""
    paths = files if isinstance(files, list) else [f for fs in files.values() for f in fs]
    for f in paths:
        if Path(f).suffix == ".parquet" or _builder(Path(f)) == "imagefolder":  # not text
            continue
        data = Path(f).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as bad:
            line = data.count(b"\n", 0, bad.start) + 1
            return (
                f"hf: {f}:{line}: not UTF-8 text ({bad.reason}, byte {bad.start}: "
                f"{data[bad.start : bad.start + 1]!r}); save the file as UTF-8"
            )
    cause, said = error, f"{type(error).__name__}: {error}"
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    if cause is not error:
        said += f"; caused by {type(cause).__name__}: {cause}"
    return f"hf: datasets cannot read {root} ({said})"


def read_splits(root: str | None, train_split: str, test_split: str) -> dict[str, Any]:
    """The ``datasets.Dataset`` of each split present of ``root`` (the training split always).

    Raises:
        FileNotFoundError: when ``root`` is None or does not exist, or holds no training split
            (naming where it looked and the splits or files it found).
        ValueError: naming ``root`` when ``datasets`` cannot read it.
    """
    if root is None:
        raise FileNotFoundError(f"hf: no data.root given; point data.root=... at {_FORMATS}")
    path = Path(root)
    if not path.exists():
        raise FileNotFoundError(f"hf: data.root={root} does not exist; it must be {_FORMATS}")
    import datasets

    splits = (train_split, test_split)
    if path.is_file() and path.suffix not in BUILDERS:
        raise FileNotFoundError(
            f"hf: data.root={root} is a {path.suffix or 'suffix-less'} file; it must be {_FORMATS}"
        )
    saved = path.is_dir() and any((path / f).is_file() for f in _SAVED)
    files, builder = ({}, "") if saved or path.is_file() else _split_files(path, splits)
    with _quiet():
        try:
            if saved:
                loaded = datasets.load_from_disk(str(path))
                if isinstance(loaded, datasets.Dataset):
                    loaded = {train_split: loaded}
            elif path.is_file():
                loaded = datasets.load_dataset(
                    BUILDERS[path.suffix], data_files={train_split: str(path)}
                )
            elif builder == "imagefolder":  # classes by folder name, below (one class too)
                loaded = datasets.load_dataset(builder, data_files=files, drop_labels=True)
                names = class_folders(files)
                loaded = {s: _folder_labels(ds, names) for s, ds in loaded.items()}
            else:
                loaded = datasets.load_dataset(builder, data_files=files)
        except Exception as e:  # pyarrow's, json's and datasets' own errors on a corrupt file
            raise ValueError(_unreadable(root, e, [path] if path.is_file() else files)) from e
    if train_split not in loaded and (saved or list(loaded) != [test_split]):
        raise FileNotFoundError(
            f"hf: {root} has no split {train_split!r} (data.train_split); its splits: "
            f"{sorted(loaded)}"
        )
    return {s: loaded[s] for s in splits if s in loaded}


def _folder_labels(ds: Any, names: list[str]) -> Any:
    """An image folder's split with the column ``label``: the ``ClassLabel`` ``names`` (every
    class folder, sorted), each image's class the name of its folder."""
    import datasets
    import pyarrow.compute as pc

    stored = ds.with_format("arrow")["image"]  # {bytes, path} structs, nothing decoded
    index = {n: k for k, n in enumerate(names)}
    paths = [p for chunk in stored.chunks for p in pc.struct_field(chunk, "path").to_pylist()]
    labels = [index[Path(p).parent.name] for p in paths]
    ds = ds.remove_columns([c for c in ds.column_names if c == "label"])
    return ds.add_column("label", labels, feature=datasets.ClassLabel(names=names))


def _innermost(feature: Any) -> str | None:
    """The dtype of the numbers of a (nested) list or array feature, e.g. ``"uint8"``."""
    while not hasattr(feature, "dtype") and hasattr(feature, "feature"):
        feature = feature.feature  # List / Sequence / LargeList of ...
    return getattr(feature, "dtype", None)


def _arrays(ds: Any, column: str, where: str) -> np.ndarray:
    """A column of numbers, arrays or nested lists -> ``[B, F]`` or ``[B, C, H, W]`` (uint8
    kept as uint8: ``datasets``' numpy format widens integers to int64)."""
    x = np.asarray(ds.select_columns([column]).with_format("numpy")[:][column])
    if _innermost(ds.features[column]) == "uint8" and x.dtype.kind in "iu":
        x = x.astype(np.uint8)
    if x.dtype == object or x.dtype.kind not in "biuf":
        raise ValueError(
            f"hf: {where}: column {column!r} holds {ds.features[column]}, not images, text or "
            "arrays of numbers of one shape (data.input_column names the input)"
        )
    if x.ndim in (1, 3):  # one number per example: one feature; [H, W]: one channel
        x = x[:, None]
    elif x.ndim == 4 and x.shape[1] not in (1, 3):
        if x.shape[3] not in (1, 3):
            raise ValueError(
                f"hf: {where}: column {column!r} holds arrays of shape {x.shape[1:]}; images "
                "must be [C, H, W] or [H, W, C] with 1 or 3 channels"
            )
        x = x.transpose(0, 3, 1, 2)
    elif x.ndim > 4:
        raise ValueError(f"hf: {where}: column {column!r} holds arrays of shape {x.shape[1:]}")
    return x if x.dtype == np.uint8 else x.astype(np.float32)


@register_source("hf")
def load_hf(
    root: str | None = None,
    *,
    input_column: str | list[str] | None = None,
    label_column: str = "label",
    id_column: str | None = None,
    train_split: str = "train",
    test_split: str = "test",
    tokenizer: str | None = None,
    max_length: int = 64,
    non_finite: str = "error",
) -> DataSource:
    """A labelled Hugging Face dataset from local files (see the module docstring).

    Args:
        root: ``data.root``: a ``save_to_disk`` folder, or a parquet / CSV / JSON(L) file or
            folder of them.
        input_column: ``data.input_column``: a column, or the two string columns of a
            sentence pair (None: the first of :data:`INPUT_COLUMNS`).
        label_column: ``data.label_column``.
        id_column: ``data.id_column``: the natural ids, or None.
        train_split: ``data.train_split``.
        test_split: ``data.test_split``.
        tokenizer: a string input's tokenizer folder (None: all-MiniLM-L6-v2).
        max_length: a string input's (or pair's) tokens per example.
        non_finite: ``data.non_finite``, for inputs of numbers (``error`` or ``drop``).

    Returns:
        A :class:`DataSource` named ``"hf"`` (with ``train_ids`` / ``test_ids`` given an
        ``id_column``); an empty test split when the dataset has no ``test_split``.

    Raises:
        FileNotFoundError: when ``root`` is missing or holds no training split (naming where it
            looked).
        ValueError: without the ``datasets`` package (naming the ``pip install`` line), or
            naming the root, the split and the column when a column is missing or
            holds what this source cannot read, images differ in size, there is one class
            only, labels are negative or differ in kind between the splits,
            (``non_finite="error"``) an input is NaN, or a sentence pair is refused
            (:mod:`fedlore.data.hf_text`: not two string columns, an empty sentence).
    """
    try:
        import datasets
    except ImportError as e:
        raise ValueError(
            f"data.name=hf reads with Hugging Face's datasets package, which is not installed "
            f"({e}); install the hf extra: pip install -e '.[hf]'"
        ) from e

    data = read_splits(root, train_split, test_split)
    assert root is not None
    first = data[train_split if train_split in data else test_split]  # a site server's: test
    if input_column is None:
        input_column = next((c for c in INPUT_COLUMNS if c in first.column_names), None)
        if input_column is None:
            raise ValueError(
                f"hf: {root} (split {train_split!r}) has none of the input columns "
                f"{list(INPUT_COLUMNS)}; name it with data.input_column (its columns: "
                f"{first.column_names})"
            )
    columns = input_columns(input_column)
    inputs: dict[str, Any] = {}
    raw: dict[str, tuple[np.ndarray, list[str] | None]] = {}
    owners: dict[str, list[str]] = {}
    images: dict[str, list[Any]] = {}
    texts: dict[str, list[tuple[str, ...]]] = {}
    for split, ds in data.items():
        where = f"{root} (split {split!r})"
        features = [feature_of(ds, c, "input_column", where) for c in columns]
        feature, column = features[0], columns[0]
        raw[split] = raw_labels(ds, label_column, where)
        if id_column is not None:
            feature_of(ds, id_column, "id_column", where)
            owner = column_values(ds, id_column)
            refuse_missing(owner, id_column, where)
            owners[split] = [str(v) for v in owner]
        if len(columns) == 2 or is_text(feature):  # tokenized below
            texts[split] = read_texts(ds, columns, features, where)
        elif isinstance(feature, datasets.Image):
            images[split] = decoded(ds, column, where)
        else:
            x = _arrays(ds, column, where)
            _, kept = check_rows(where, x, np.arange(len(x)), non_finite)
            if len(kept) < len(x):
                x = x[kept]
                raw[split] = (raw[split][0][kept], raw[split][1])
                if id_column is not None:
                    owners[split] = [owners[split][k] for k in kept]
            inputs[split] = x
    mode = image_mode([im for ims in images.values() for im in ims])  # one for every split
    for split, ims in images.items():
        inputs[split] = pixels(ims, columns[0], f"{root} (split {split!r})", mode)
    labels, class_names = class_ids(raw, label_column, root, train_split)
    if len(class_names) < 2:
        raise ValueError(
            f"hf: {root}: one class only ({class_names[0]!r} in column {label_column!r}); a "
            "classifier needs two or more (an image folder: a folder per class, an empty one "
            "for a class with no image)"
        )
    if texts:
        if len(texts) < len(data):  # a text column in one split, another kind in the other
            raise ValueError(
                f"hf: {root}: input column {columns[0]!r} holds strings in split(s) "
                f"{sorted(texts)} but not in {sorted(set(data) - set(texts))}"
            )
        tok = load_tokenizer(tokenizer)
        xs = {s: encode(tok, v, max_length, f"{root} (split {s!r})") for s, v in texts.items()}
    else:
        shapes = {s: x.shape[1:] for s, x in inputs.items()}
        if len(set(shapes.values())) > 1:
            firsts = {s: getattr(ims[0], "filename", "") for s, ims in images.items() if ims}
            raise ValueError(
                f"hf: {root}: the splits' inputs differ in shape: {shapes}"
                + (f" (their first images: {firsts})" if any(firsts.values()) else "")
            )
        xs = {s: _float(x) for s, x in inputs.items()}
    if train_split in xs:
        train = TensorSplit(xs[train_split], torch.from_numpy(labels[train_split]))
    else:  # a test split alone (a site-local deployment's server): no training examples
        train = TensorSplit(xs[test_split][:0].clone(), torch.from_numpy(labels[test_split][:0]))
    if test_split in xs:
        test = TensorSplit(xs[test_split], torch.from_numpy(labels[test_split]))
    else:
        test = TensorSplit(train.x[:0].clone(), train.y[:0].clone())
    ids: dict[str, np.ndarray] = {}
    id_names: list[str] = []
    if id_column is not None:
        id_names = label_order([o for v in owners.values() for o in v])
        index = {o: k for k, o in enumerate(id_names)}
        ids = {s: np.asarray([index[o] for o in v], dtype=np.int64) for s, v in owners.items()}
    return DataSource(
        name="hf",
        train=train,
        test=test,
        num_classes=len(class_names),
        input_shape=tuple(int(d) for d in train.x.shape[1:]),
        class_names=class_names,
        train_ids=ids.get(train_split),
        test_ids=ids.get(test_split, np.zeros(0, np.int64)) if ids else None,
        id_names=tuple(id_names),
    )


def _float(x: np.ndarray) -> torch.Tensor:
    """uint8 pixels scaled to [0, 1], other numbers cast to float32 (as ``npz``)."""
    out = x.astype(np.float32)
    if x.dtype == np.uint8:
        out /= 255.0
    return torch.from_numpy(out)
