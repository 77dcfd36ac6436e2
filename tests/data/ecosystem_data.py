"""Tiny data sets of the federated-learning ecosystem written on disk for the tests: Hugging Face
datasets (``save_to_disk`` folders, parquet / CSV / JSON files) and LEAF folders (FEMNIST and
Shakespeare layouts). Everything is made from scikit-learn's digits or a few made-up strings, in
a fraction of a second."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

Users = dict[str, dict[str, tuple[list[Any], list[Any]]]]


def digits(n: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` of sklearn's digits from ``offset``: uint8 pixels ``[n, 8, 8]`` (0..255), labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    rows = np.arange(offset, offset + n)
    return (d.images[rows] * 255 / 16).astype(np.uint8), d.target[rows].astype(np.int64)


def hf_images(n: int, offset: int = 0, writers: int = 5, rgb: bool = False) -> Any:
    """A ``datasets.Dataset`` of ``n`` digit images (PIL, greyscale or RGB) with a ``ClassLabel``
    ``label`` (names ``d0`` .. ``d9``) and a string ``writer`` column (``w0`` .. by row)."""
    from datasets import ClassLabel, Dataset, Features, Image, Value
    from PIL import Image as PILImage

    pix, y = digits(n, offset)
    images = [PILImage.fromarray(p) for p in pix]
    if rgb:
        images = [PILImage.merge("RGB", (im, im.point(lambda v: 255 - v), im)) for im in images]
    features = Features(
        {
            "image": Image(),
            "label": ClassLabel(names=[f"d{k}" for k in range(10)]),
            "writer": Value("string"),
        }
    )
    return Dataset.from_dict(
        {
            "image": images,
            "label": y.tolist(),
            "writer": [f"w{(offset + i) % writers}" for i in range(n)],
        },
        features=features,
    )


def write_hf_digits(folder: Path, n_train: int = 200, n_test: int = 60, **kw: Any) -> Path:
    """A ``DatasetDict`` with ``train`` and ``test`` splits of :func:`hf_images`, saved."""
    from datasets import DatasetDict

    DatasetDict(
        {"train": hf_images(n_train, **kw), "test": hf_images(n_test, offset=n_train, **kw)}
    ).save_to_disk(str(folder))
    return folder


def write_leaf(folder: Path, users: Users, files: int = 1) -> Path:
    """A LEAF folder: ``train/`` and ``test/``, the users spread over ``files`` JSON files each."""
    names = list(users)
    for part in ("train", "test"):
        (folder / part).mkdir(parents=True, exist_ok=True)
        for k in range(files):
            mine = names[k::files]
            obj = {
                "users": mine,
                "num_samples": [len(users[u][part][1]) for u in mine],
                "user_data": {u: {"x": users[u][part][0], "y": users[u][part][1]} for u in mine},
            }
            (folder / part / f"all_data_{k}_niid_0_keep_0_{part}_9.json").write_text(
                json.dumps(obj), encoding="utf-8"
            )
    return folder


def femnist_users(num_users: int = 4, n_train: int = 12, n_test: int = 3, seed: int = 0) -> Users:
    """FEMNIST-layout users (``f0000_00`` ..): 784 values in [0, 1], labels in 0..61, each user
    with its own set of labels."""
    rng = np.random.default_rng(seed)
    out: Users = {}
    for u in range(num_users):
        classes = rng.choice(62, size=3, replace=False)
        out[f"f{u:04d}_{u % 3:02d}"] = {
            part: (
                rng.random((n, 784)).round(3).tolist(),
                rng.choice(classes, size=n).astype(int).tolist(),
            )
            for part, n in (("train", n_train), ("test", n_test))
        }
    return out


PLAY = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles "
    "And by opposing end them. To die: to sleep; No more; and by a sleep to say we end"
)


def shakespeare_users(num_users: int = 3, n_train: int = 8, n_test: int = 2) -> Users:
    """Shakespeare-layout users: 80-character windows of :data:`PLAY` and the next character."""
    out: Users = {}
    for u in range(num_users):
        start = 13 * u
        windows = [PLAY[start + i : start + i + 80] for i in range(n_train + n_test)]
        nexts = [PLAY[start + i + 80] for i in range(n_train + n_test)]
        out[f"PRINCE_OF_DENMARK_{u}"] = {
            "train": (windows[:n_train], nexts[:n_train]),
            "test": (windows[n_train:], nexts[n_train:]),
        }
    return out
