"""The ``leaf`` source: a folder in the JSON layout of the LEAF benchmark (Caldas et al. 2018,
"LEAF: A Benchmark for Federated Settings"), with its users as natural ids.

``data.root`` holds ``train/*.json`` and ``test/*.json`` (or ``data/train`` and ``data/test``,
as LEAF's scripts write them); each file is

.. code-block:: text

    {"users": [u, ...], "num_samples": [n_u, ...],
     "user_data": {u: {"x": [x_1, ..., x_n], "y": [y_1, ..., y_n]}, ...}}

A user's examples in ``train/`` are its training data and those in ``test/`` its test data (a
user in several files of one folder has their examples in file order). Two layouts, told apart by
the first ``x``:

* numbers (FEMNIST: 784 pixels of a 28x28 character image in [0, 1] as LEAF stores them, label
  ``0..61``; LEAF's Synthetic: feature vectors): inputs float32, ``[B, 1, 28, 28]`` for 784
  values (62 classes named by :data:`FEMNIST_CLASSES`), else ``[B, F]`` (classes ``0 ..
  largest``);
* strings (Shakespeare: 80 characters of a role's lines, ``y`` the next character): int64
  character ids ``[B, L]`` in LEAF's own vocabulary :data:`LEAF_LETTERS` (the index LEAF's
  reference models use), every other character mapped to one more id, :data:`UNKNOWN`; the
  classes are those :data:`VOCABULARY` ids (81).

Users are numbered in sorted order over both folders (``train_ids``, ``test_ids``): with
``partition.name: natural`` and ``num_clients`` equal to the number of users, client ``k`` is the
``k``-th user, and (``data.local_test``) its local test split is the user's own LEAF test data.
The central test set is every user's test data. Without ``test/`` a share of ``train/`` is
held out (``data.missing_test``).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlore.data.checks import check_rows
from fedlore.data.client_data import TensorSplit
from fedlore.data.datasource import DataSource
from fedlore.data.text import label_order
from fedlore.registry import register_source

LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
"""LEAF's Shakespeare characters (``models/utils/language_utils.py``, ``ALL_LETTERS``): the id of
a character is its index here."""

UNKNOWN = "<unk>"
"""The class name of the id every character outside :data:`LEAF_LETTERS` maps to."""

VOCABULARY = (*LEAF_LETTERS, UNKNOWN)
"""The character classes of the Shakespeare layout: 80 characters, then :data:`UNKNOWN`."""

FEMNIST_CLASSES = tuple(string.digits + string.ascii_uppercase + string.ascii_lowercase)
"""FEMNIST's 62 classes (NIST's by_class order): digits, upper case, lower case letters."""

FEMNIST_PIXELS = 28 * 28
"""An ``x`` of this many numbers is a 28x28 FEMNIST image."""

Users = list[tuple[str, list[Any], list[Any]]]


def leaf_folders(root: str | None) -> tuple[Path, Path | None]:
    """The ``train`` folder of a LEAF data set and its ``test`` folder (None when absent).

    Raises:
        FileNotFoundError: naming every folder looked at.
    """
    if root is None:
        raise FileNotFoundError(
            "leaf: no data.root given; point data.root=... at a LEAF folder holding "
            "train/*.json and test/*.json (or data/train and data/test)"
        )
    looked = []
    for base in (Path(root), Path(root) / "data"):
        looked.append(base / "train")
        if (base / "train").is_dir():
            test = base / "test"
            return base / "train", test if test.is_dir() else None
    raise FileNotFoundError(
        "leaf: no train/ folder of LEAF JSON files. Looked at:\n  "
        + "\n  ".join(str(p) for p in looked)
        + "\ndata.root must be a LEAF data folder (train/*.json, test/*.json)"
    )


def read_leaf_file(path: str | Path) -> Users:
    """The users of one LEAF JSON file: ``[(user, xs, ys), ...]`` in the order of ``users``.

    Raises:
        ValueError: naming the file (and the user) when it is not JSON, lacks ``users`` or
            ``user_data``, a user has no data or ``x`` and ``y`` of different lengths, or
            ``num_samples`` disagrees with them.
    """
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable LEAF JSON file ({e})") from e
    if not isinstance(obj, dict) or "users" not in obj or "user_data" not in obj:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{path}: a LEAF file needs 'users' and 'user_data', it holds {keys}")
    users, data = obj["users"], obj["user_data"]
    counts = obj.get("num_samples")
    if counts is not None and len(counts) != len(users):
        raise ValueError(f"{path}: {len(users)} users but {len(counts)} num_samples")
    out: Users = []
    for k, user in enumerate(users):
        record = data.get(user) if isinstance(data, dict) else None
        if not isinstance(record, dict) or "x" not in record or "y" not in record:
            raise ValueError(f"{path}: user {user!r} has no user_data with 'x' and 'y'")
        xs, ys = record["x"], record["y"]
        if len(xs) != len(ys):
            raise ValueError(f"{path}: user {user!r} has {len(xs)} x but {len(ys)} y")
        if counts is not None and counts[k] != len(ys):
            raise ValueError(
                f"{path}: user {user!r} has {len(ys)} examples, num_samples says {counts[k]}"
            )
        out.append((str(user), xs, ys))
    return out


def _read_folder(folder: Path) -> Users:
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"leaf: {folder} holds no .json file")
    return [u for f in files for u in read_leaf_file(f)]


def _char_ids(texts: list[str], where: str) -> np.ndarray:
    """Strings of one length L -> int64 ids ``[B, L]`` in :data:`VOCABULARY`."""
    if not all(isinstance(t, str) for t in texts):
        raise ValueError(f"leaf: {where}: every x (and y) of a text layout must be a string")
    lengths = {len(t) for t in texts}
    if len(lengths) > 1:
        first = next(k for k, t in enumerate(texts) if len(t) != len(texts[0]))
        raise ValueError(
            f"leaf: {where}: strings differ in length ({len(texts[0])} and {len(texts[first])} "
            f"at example {first}); LEAF's Shakespeare holds {len(texts[0])}-character windows"
        )
    width = lengths.pop() if lengths else 0
    codes = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    table = np.full(max(int(codes.max(initial=0)) + 1, 256), len(LEAF_LETTERS), dtype=np.int64)
    table[[ord(c) for c in LEAF_LETTERS]] = np.arange(len(LEAF_LETTERS))
    return table[codes].reshape(len(texts), width)


def _split(users: Users, text: bool, where: str, non_finite: str) -> tuple[Any, ...]:
    """``(x, y, user of each example)`` of one folder's users."""
    xs = [x for _, u_x, _ in users for x in u_x]
    ys = [y for _, _, u_y in users for y in u_y]
    owners = [name for name, u_x, _ in users for _ in u_x]
    if not xs:
        raise ValueError(f"leaf: {where} holds no examples")
    if text:
        if not all(isinstance(y, str) and len(y) == 1 for y in ys):
            raise ValueError(f"leaf: {where}: every y of a text layout must be one character")
        return _char_ids(xs, where), _char_ids(ys, where)[:, 0], owners
    try:
        x = np.asarray(xs, dtype=np.float32)
        y = np.asarray(ys)
    except (ValueError, TypeError) as e:
        raise ValueError(f"leaf: {where}: x must be lists of numbers of one length ({e})") from e
    if x.ndim != 2 or y.ndim != 1 or y.dtype.kind not in "iu" or (len(y) and y.min() < 0):
        raise ValueError(
            f"leaf: {where}: x must be lists of numbers of one length and y non-negative "
            f"integers (got x {x.shape}, y {y.dtype} {y.shape})"
        )
    x, kept = check_rows(where, x, np.arange(len(x)), non_finite)
    return x, y[kept].astype(np.int64), [owners[k] for k in kept]


@register_source("leaf")
def load_leaf(root: str | None = None, *, non_finite: str = "error") -> DataSource:
    """A LEAF data folder (FEMNIST, Shakespeare, Synthetic; see the module docstring).

    Args:
        root: the folder holding ``train/`` and ``test/`` (or ``data/train``, ``data/test``).
        non_finite: ``data.non_finite`` for inputs of numbers (``error`` or ``drop``).

    Returns:
        A :class:`DataSource` named ``"leaf"`` with the users as ``train_ids`` / ``test_ids``
        (``id_names``: the user names, sorted).

    Raises:
        FileNotFoundError: naming the folders looked at, or a folder without ``.json`` files.
        ValueError: naming the file or folder when a file is malformed, inputs differ in
            shape or kind between the folders, or a FEMNIST label is beyond its 62 classes.
    """
    train_dir, test_dir = leaf_folders(root)
    users = {"train": _read_folder(train_dir)}
    if test_dir is not None:
        users["test"] = _read_folder(test_dir)
    first = next((u_x[0] for _, u_x, _ in users["train"] if u_x), None)
    text = isinstance(first, str)
    read = {
        part: _split(u, text, str(train_dir if part == "train" else test_dir), non_finite)
        for part, u in users.items()
    }
    shapes = {part: x.shape[1:] for part, (x, _, _) in read.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"leaf: {root}: inputs differ in shape between the folders: {shapes}")
    width = shapes["train"][0]
    top = max(int(y.max()) + 1 for _, y, _ in read.values())
    shape: tuple[int, ...]
    if text:
        class_names, shape = [repr(c)[1:-1] for c in LEAF_LETTERS] + [UNKNOWN], (width,)
    elif width == FEMNIST_PIXELS:
        if top > len(FEMNIST_CLASSES):
            raise ValueError(f"leaf: {root}: FEMNIST label {top - 1} beyond its 62 classes")
        class_names, shape = list(FEMNIST_CLASSES), (1, 28, 28)
    else:
        class_names, shape = [str(c) for c in range(top)], (width,)
    id_names = label_order([o for _, _, owners in read.values() for o in owners])
    index = {name: k for k, name in enumerate(id_names)}

    def split(part: str) -> tuple[TensorSplit, np.ndarray]:
        if part not in read:
            empty = torch.zeros(0, *shape, dtype=torch.int64 if text else torch.float32)
            return TensorSplit(empty, torch.zeros(0, dtype=torch.int64)), np.zeros(0, np.int64)
        x, y, owners = read[part]
        ids = np.asarray([index[o] for o in owners], dtype=np.int64)
        return TensorSplit(torch.from_numpy(x).reshape(-1, *shape), torch.from_numpy(y)), ids

    (train, train_ids), (test, test_ids) = split("train"), split("test")
    return DataSource(
        name="leaf",
        train=train,
        test=test,
        num_classes=len(class_names),
        input_shape=shape,
        class_names=class_names,
        train_ids=train_ids,
        test_ids=test_ids,
        id_names=tuple(id_names),
    )
