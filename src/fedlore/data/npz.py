"""``npz``: a user's own labelled data set, NumPy archives ``train.npz`` and ``test.npz``.

The source a deployed site's own data (``flower.site_data``) and any data set fedlore has no
loader for take: arrays ``x`` and ``y`` (and optionally ``class_names``) per file, checked as
they are read, each problem named with its file.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from fedlore.data.checks import DataWarning, check_rows
from fedlore.data.client_data import TensorSplit, numpy_split
from fedlore.data.datasource import DataSource
from fedlore.registry import register_source

Read = tuple[np.ndarray, np.ndarray, list[str] | None]
"""One file's ``(x, y, class_names or None)``."""


_STORE_AS = {
    "x": "numbers, x.astype(np.float32) (a table's text columns converted first)",
    "y": "integers (text labels numbered: names, y = np.unique(y, return_inverse=True))",
    "class_names": "strings, np.array(names, dtype=str)",
}
"""How to store each array that ``np.savez`` wrote as Python objects (``dtype=object``)."""


def _array(f: Any, path: Path, name: str) -> np.ndarray:
    """Array ``name`` of the open archive ``f``; one that holds Python objects (a pandas
    column or Index of mixed types saved as it is), which a run does not unpickle, is an error
    naming it and how to store it."""
    try:
        return np.asarray(f[name])
    except ValueError as e:
        if "allow_pickle" not in str(e):
            raise
        raise ValueError(
            f"{path}: array {name!r} holds Python objects (dtype object), which are not read; "
            f"store it as {_STORE_AS[name]}"
        ) from None


def _label_type_error(path: Path, y: np.ndarray) -> ValueError:
    """The refusal of labels ``y`` that are not integers, with the remedy for their kind:
    text is numbered, whole numbers of another type are cast, and the first label that is no
    whole number is named with its row."""
    got = f"{path}: labels y must be integers, got {y.dtype}"
    if y.dtype.kind in "US":
        return ValueError(
            f"{got} (text, such as y[0] = {str(y[0])!r}): number the classes, names, y = "
            "np.unique(y, return_inverse=True), and store names as class_names"
        )
    if y.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            off = ~np.isfinite(y) | (y != np.round(y))
        if off.any():
            i = int(np.argmax(off))
            return ValueError(f"{got}, and y[{i}] is {y[i]}, not a class number")
    whole = "whole numbers: " if y.dtype.kind == "f" else ""
    return ValueError(f"{got} ({whole}store y.astype(np.int64))")


def _read_npz(path: Path, non_finite: str) -> Read:
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in ("x", "y") if k not in f.files]
            if missing:
                raise ValueError(
                    f"{path}: needs arrays 'x' (inputs) and 'y' (labels), missing {missing} "
                    f"(it holds {sorted(f.files)})"
                )
            x, y = _array(f, path, "x"), _array(f, path, "y")
            has_names = "class_names" in f.files
            names = [str(c) for c in _array(f, path, "class_names")] if has_names else None
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as e:  # BadZipFile: a cut file
        if isinstance(e, ValueError) and str(path) in str(e):
            raise
        raise ValueError(f"{path}: cannot read the npz file ({e})") from e
    if x.ndim == 0:
        raise ValueError(f"{path}: inputs x must have one row per example, got a scalar")
    if x.ndim == 1:
        raise ValueError(
            f"{path}: inputs x must be [examples, features...], got 1-D shape {x.shape} (one "
            "feature per example: store x.reshape(-1, 1))"
        )
    if y.ndim != 1:
        raise ValueError(f"{path}: labels y must be 1-D (one int per example), got shape {y.shape}")
    if len(x) != len(y):
        raise ValueError(f"{path}: x has {len(x)} rows but y has {len(y)}")
    if y.dtype.kind not in "iu":
        raise _label_type_error(path, y)
    if len(y) and y.min() < 0:
        i = int(np.argmax(y < 0))
        raise ValueError(f"{path}: y[{i}] is {int(y[i])}; labels must be non-negative integers")
    if names is not None and len(y) and int(y.max()) >= len(names):  # a row of this file
        i = int(np.argmax(y >= len(names)))
        raise ValueError(
            f"{path}: y[{i}] is {int(y[i])}, but its class_names has {len(names)} entries "
            f"(labels 0 to {len(names) - 1})"
        )
    x, y = check_rows(path, x, y, non_finite)  # not empty; NaN/inf refused or dropped
    if x.dtype == np.uint8 and int(x.max()) <= 1:  # 0/1 columns or pixels, not 0-255 grey levels
        warnings.warn(
            f"{path}: x is uint8 and holds only 0 and 1, but uint8 inputs are read as 0-255 "
            "images and divided by 255 (1 becomes 0.0039); store x as float32 or bool to keep "
            "0 and 1",
            DataWarning,
            stacklevel=4,
        )
    return x, y, names


def _warn_absent_labels(folder: Path, present: np.ndarray, top: int) -> None:
    """A :class:`~fedlore.data.checks.DataWarning` when, without ``class_names``, labels below
    the largest have no example in either file: the model gets ``top`` outputs, some of which
    nothing trains (a site holding part of a federation's classes means that; a labelling that
    skips values rarely does)."""
    have, first = {int(c) for c in present}, []
    for c in range(top):  # the first five absent labels, in O(classes present) memory
        if c not in have:
            first.append(c)
            if len(first) == 6:
                break
    shown = ", ".join(str(c) for c in first[:5]) + (" ..." if len(first) > 5 else "")
    warnings.warn(
        f"npz in {folder}: label(s) {shown} have no example, yet the model gets {top} outputs "
        f"(the largest label + 1, as there is no class_names): store class_names, the full "
        "list of classes, to say that is meant (a site of a federation), or number the "
        f"{len(present)} classes 0 to {len(present) - 1}",
        DataWarning,
        stacklevel=3,
    )


def _warn_unseen_test_labels(folder: Path, read: dict[str, Read]) -> None:
    """A :class:`~fedlore.data.checks.DataWarning` when ``test.npz`` holds labels that no
    example of ``train.npz`` has: no client trains on them, and each such test example counts
    as a miss."""
    if "train" not in read or "test" not in read:
        return
    train, test = read["train"][1], read["test"][1]
    unseen = np.setdiff1d(np.unique(test), np.unique(train))
    if len(unseen):
        shown = ", ".join(str(int(c)) for c in unseen[:5]) + (" ..." if len(unseen) > 5 else "")
        warnings.warn(
            f"npz in {folder}: test.npz holds label(s) {shown} that no example of train.npz "
            f"has ({int(np.isin(test, unseen).sum())} of its {len(test)} examples): no model "
            "can learn them, and each counts as a miss",
            DataWarning,
            stacklevel=3,
        )


@register_source("npz")
def load_npz(root: str | None = None, *, non_finite: str = "error") -> DataSource:
    """A labelled data set from ``root/train.npz`` and ``root/test.npz``, NumPy archives with
    arrays ``x`` (inputs ``[B, ...]``: uint8 inputs, of any shape, are read as 0-255 images and
    scaled to [0, 1], other inputs are cast to float32; images as ``[B, C, H, W]``, tabular data
    as ``[B, F]``), ``y`` (int labels
    ``[B]``) and, optionally, ``class_names`` (strings, index = label).

    Either file may be missing (an empty split), not both: a deployed site
    (``flower.site_data``) may hold only ``train.npz``, the server only ``test.npz``; a central
    run without ``test.npz`` holds out part of ``train.npz`` (``data.missing_test``,
    :func:`fedlore.data.checks.central_splits`). With
    ``class_names`` in a file, ``num_classes`` is its length (every site of a federation should
    store the same list, so that every site's model has the same output layer); else it is the
    largest label + 1, and a single label value is refused as one class.

    Args:
        root: the folder (required).
        non_finite: ``data.non_finite``: ``"error"`` or ``"drop"`` rows holding NaN or inf
            (:func:`fedlore.data.checks.check_rows`).

    Returns:
        A :class:`DataSource` named ``"npz"``.

    Raises:
        FileNotFoundError: when ``root`` is None, not a folder, or holds neither file.
        ValueError: naming the file when an array is missing, x and y disagree in length,
            labels are not non-negative integers one per example, inputs are 1-D or differ
            in shape between the two files, the files' ``class_names`` differ, a label reaches
            past ``class_names``, there is one class only, labels absent from both files
            outnumber their examples (without ``class_names``: a sentinel such as 65535), a
            file holds no rows, or (``non_finite="error"``) an input is NaN or infinite
            (naming the array and the index).

    Warns:
        DataWarning: when ``test.npz`` holds labels no example of ``train.npz`` has; without
            ``class_names``, when labels below the largest have no example at all; and when a
            uint8 ``x`` holds only 0 and 1 (scaled as 0-255 images, 1 becomes 1/255).
    """
    if root is None:
        raise FileNotFoundError(
            "npz: no data.root given; point data.root=... at a folder with train.npz and/or "
            "test.npz (arrays x, y and optionally class_names)"
        )
    folder = Path(root)
    paths = {part: folder / f"{part}.npz" for part in ("train", "test")}
    found = {part: p for part, p in paths.items() if p.is_file()}
    if not found:
        npy = sorted(p.name for p in folder.glob("*.npy")) if folder.is_dir() else []
        hint = (  # loose arrays: the archive is one np.savez away
            f"; it holds {', '.join(npy[:4])}{' ...' if len(npy) > 4 else ''}: pack each "
            'split\'s arrays into one archive, np.savez("train.npz", x=x, y=y)'
            if npy
            else ""
        )
        if folder.is_file():  # the archive itself, or a table not yet converted
            hint = f"; {folder} is a file, not a folder" + (
                f": name its folder, data.root={folder.parent}"
                if folder.name in ("train.npz", "test.npz")
                else f": name it train.npz (or test.npz) and data.root its folder, {folder.parent}"
                if folder.suffix == ".npz"
                else " (convert a table to the archives first; labelled text: data.name=text_csv)"
            )
        raise FileNotFoundError(
            f"npz: neither {paths['train']} nor {paths['test']} exists; data.root must name a "
            "folder with train.npz and/or test.npz (arrays x, y and optionally class_names)" + hint
        )
    read = {part: _read_npz(p, non_finite) for part, p in found.items()}
    shapes = {part: x.shape[1:] for part, (x, _, _) in read.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"npz in {folder}: inputs differ in shape between the files: {shapes}")
    names = next((n for _, _, n in read.values() if n is not None), None)
    listed = {part: n for part, (_, _, n) in read.items() if n is not None}
    if len(listed) == 2 and listed["train"] != listed["test"]:  # label k would mean two things
        raise ValueError(
            f"npz in {folder}: class_names differ between train.npz {listed['train']} and "
            f"test.npz {listed['test']}: label k must name the same class in both files"
        )
    top = max((int(y.max()) + 1 for _, y, _ in read.values() if len(y)), default=1)
    if names is not None and top > len(names):
        raise ValueError(
            f"npz in {folder}: label {top - 1} but class_names has {len(names)} entries"
        )
    num_classes = len(names) if names is not None else top
    present = np.unique(np.concatenate([y for _, y, _ in read.values()]))
    if num_classes < 2 or (names is None and len(present) < 2):
        raise ValueError(
            f"npz in {folder}: every label is {int(present[0])}, so there is 1 class; a "
            "classifier needs 2 or more (a site that holds one class of a federation's data "
            "gives class_names, the federation's list, in its file)"
        )
    examples = sum(len(y) for _, y, _ in read.values())
    if names is None and top - len(present) > examples:  # a sentinel or a typo, not classes
        raise ValueError(
            f"npz in {folder}: the largest label is {top - 1}, so the model would get {top} "
            f"outputs, {top - len(present)} of them for labels no example has (more than the "
            f"{examples} examples): number the {len(present)} classes 0 to {len(present) - 1}, "
            "or store class_names, the full list of classes"
        )
    if names is None and len(present) < top:
        _warn_absent_labels(folder, present, top)
    _warn_unseen_test_labels(folder, read)
    shape = next(iter(shapes.values()))
    template = next(iter(read.values()))[0]

    def split(part: str) -> TensorSplit:
        if part not in read:
            return numpy_split(np.zeros((0, *shape), dtype=template.dtype), np.zeros(0, np.int64))
        x, y, _ = read[part]
        if x.dtype != np.uint8:
            x = x.astype(np.float32)
        return numpy_split(x, y)

    return DataSource(
        name="npz",
        train=split("train"),
        test=split("test"),
        num_classes=num_classes,
        input_shape=tuple(int(s) for s in shape),
        class_names=names if names is not None else [str(c) for c in range(num_classes)],
    )
