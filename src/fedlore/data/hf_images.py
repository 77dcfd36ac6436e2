"""Images of the ``hf`` source (:mod:`fedlore.data.hf`): the image folders it reads with the
``datasets`` ``imagefolder`` builder (``train/<class>/<image>``, the layout of torchvision's
``ImageFolder``), and an ``Image`` column turned into uint8 ``[B, C, H, W]`` pixels, each
image decoded here so that a broken one is named with its row and file."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

IMAGES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
"""Image suffixes (any case) of a folder read with the ``imagefolder`` builder."""


def check_class_folders(folder: Path, files: dict[str, list[str]]) -> None:
    """Every image of an image folder lies in a class folder: its parent is neither ``folder``
    nor its split's folder (``datasets`` would take the split's name, ``train``, for its class).

    Raises:
        ValueError: naming the first image that does not, and the layout.
    """
    for split, paths in files.items():
        for f in paths:
            parent = Path(f).parent
            if parent == folder or parent.name == split:
                raise ValueError(
                    f"hf: {Path(f).relative_to(folder)} in {folder} is not in a class folder: "
                    f"an image's folder names its class ({split}/<class>/<image>, or "
                    "<class>/<image> for the training split alone)"
                )


def decoded(ds: Any, column: str, where: str) -> list[Any]:
    """The PIL images of ``ds``'s ``Image`` column ``column``, decoded one by one.

    Raises:
        ValueError: naming ``where``, the row and the file of an image that is missing or that
            PIL cannot read (``datasets`` decoding the column says neither).
    """
    import datasets
    from PIL import Image

    stored = list(ds.cast_column(column, datasets.Image(decode=False))[column])
    images = []
    for k, cell in enumerate(stored):
        if cell is None:
            raise ValueError(f"hf: {where}: row {k} of column {column!r} holds no image")
        source, name = cell.get("bytes"), cell.get("path")
        try:
            image = Image.open(io.BytesIO(source) if source else str(name))
            image.load()
        except (OSError, ValueError, SyntaxError) as e:  # PIL's errors on a broken file
            raise ValueError(
                f"hf: {where}: row {k} of column {column!r}"
                + (f" ({name})" if name else "")
                + f": not an image PIL can read ({type(e).__name__}: {e})"
            ) from e
        images.append(image)
    return images


def pixels(images: list[Any], column: str, where: str) -> np.ndarray:
    """PIL images -> uint8 ``[B, C, H, W]``: one channel when all are greyscale, else RGB.

    Raises:
        ValueError: naming ``where`` and the first row whose size differs from row 0's.
    """
    mode = "L" if all(im.mode in ("L", "1") for im in images) else "RGB"
    arrays = [np.asarray(im.convert(mode), dtype=np.uint8) for im in images]
    for k, a in enumerate(arrays):
        if a.shape != arrays[0].shape:
            raise ValueError(
                f"hf: {where}: the images of column {column!r} differ in size ({arrays[0].shape} "
                f"at row 0, {a.shape} at row {k}); resize them to one size first"
            )
    if not arrays:
        return np.zeros((0, 1, 1, 1), dtype=np.uint8)
    x = np.stack(arrays)
    return x[:, None] if mode == "L" else x.transpose(0, 3, 1, 2)
