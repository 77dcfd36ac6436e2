"""Images of the ``hf`` source (:mod:`fedlore.data.hf`): the image folders it reads with the
``datasets`` ``imagefolder`` builder (``train/<class>/<image>``, the layout of torchvision's
``ImageFolder``), their classes named by the class folders (an empty one too), and an ``Image``
column turned into uint8 ``[B, C, H, W]`` pixels, each image decoded here so that a broken one
is named with its row and file."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

IMAGES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
"""Image suffixes (any case) of a folder read with the ``imagefolder`` builder."""

GREY = ("1", "L", "LA", "La", "I;16", "I;16L", "I;16B", "I;16N", "I")
"""PIL modes read as one channel (alpha dropped; 16-bit values scaled to 8 bits)."""

ORIENTATION = 0x0112
"""The EXIF tag of a photo's rotation, applied as ``datasets``' ``Image`` feature does."""


def walk(folder: Path) -> Iterator[Path]:
    """Every file under ``folder``, following symlinked folders (as torchvision's
    ``ImageFolder`` does; each real folder once), skipping hidden files and folders (``.git``,
    ``.DS_Store``, macOS's ``._<name>`` resource forks)."""
    seen: set[str] = set()
    for here, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:  # a symlink loop, or a folder linked twice
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        yield from (Path(here, n) for n in sorted(names) if not n.startswith("."))


def image_splits(folder: Path, found: list[Path], splits: tuple[str, ...]) -> dict[str, list[str]]:
    """The images of ``found`` grouped by split: ``<split>/<class>/<image>`` (the split folder
    may lie deeper, ``data/train/cat/1.png``), else, when no image lies so, every image as
    ``<class>/<image>`` of the training split. Images of other folders (``validation/`` when
    the test split is ``test``) are left out.

    Raises:
        ValueError: naming the first image that lies outside a class folder (in ``folder`` or
            in a split folder) or below one (``train/cat/small/1.png``: its class is unclear).
    """
    parts = {p: p.relative_to(folder).parts for p in found}
    files = {s: [p for p in found if len(parts[p]) >= 3 and parts[p][-3] == s] for s in splits}
    files = {s: ps for s, ps in files.items() if ps}
    by_split = bool(files)
    if not by_split:
        files = {splits[0]: [p for p in found if len(parts[p]) == 2 and parts[p][0] not in splits]}
    placed = {p for ps in files.values() for p in ps}
    for p in found:
        where = parts[p][:-1]
        if p in placed or (by_split and where and not any(s in where for s in splits)):
            continue
        if not where or where[-1] in splits:
            raise ValueError(
                f"hf: {Path(*parts[p])} in {folder} is not in a class folder: an image's folder "
                f"names its class ({splits[0]}/<class>/<image>, or <class>/<image> for the "
                "training split alone)"
            )
        raise ValueError(
            f"hf: {Path(*parts[p])} in {folder} lies below its class folder: an image's own "
            f"folder names its class, as {splits[0]}/<class>/<image> (or <class>/<image>); "
            "move it up into its class folder"
        )
    return {s: [str(p) for p in ps] for s, ps in files.items()}


def class_folders(files: dict[str, list[str]]) -> list[str]:
    """The class names of an image folder, sorted: every folder beside the images' class
    folders (an empty class folder is a class with no image, so that every site of a
    federation can have the same classes), hidden ones left out."""
    folders = {os.path.dirname(f) for fs in files.values() for f in fs}
    parents = {os.path.dirname(d) for d in folders}
    return sorted(
        {os.path.basename(d) for d in folders}
        | {d.name for p in parents for d in os.scandir(p) if d.is_dir() and d.name[0] != "."}
    )


def decoded(ds: Any, column: str, where: str) -> list[Any]:
    """The PIL images of ``ds``'s ``Image`` column ``column``, decoded one by one (turned
    upright by their EXIF orientation, as ``datasets`` decodes them).

    Raises:
        ValueError: naming ``where``, the row and the file of an image that is missing or that
            PIL cannot read (``datasets`` decoding the column says neither).
    """
    import datasets
    from PIL import Image, ImageOps

    stored = list(ds.cast_column(column, datasets.Image(decode=False))[column])
    images = []
    for k, cell in enumerate(stored):
        if cell is None:
            raise ValueError(f"hf: {where}: row {k} of column {column!r} holds no image")
        source, name = cell.get("bytes"), cell.get("path")
        try:
            image: Any = Image.open(io.BytesIO(source) if source else str(name))
            image.load()
        except (OSError, ValueError, SyntaxError) as e:  # PIL's errors on a broken file
            raise ValueError(
                f"hf: {where}: row {k} of column {column!r}"
                + (f" ({name})" if name else "")
                + f": not an image PIL can read ({type(e).__name__}: {e})"
            ) from e
        if image.getexif().get(ORIENTATION, 1) != 1:  # a camera's rotation, as datasets applies
            image = ImageOps.exif_transpose(image)
            setattr(image, "filename", name or "")  # noqa: B010 (named in later errors)
        images.append(image)
    return images


def image_mode(images: list[Any]) -> str:
    """``"L"`` when every image (of every split) is greyscale (:data:`GREY`), else ``"RGB"``."""
    return "L" if all(im.mode in GREY for im in images) else "RGB"


def _array(im: Any, mode: str, row: str) -> np.ndarray:
    """One PIL image as uint8 ``[H, W]`` (mode ``L``) or ``[H, W, 3]``: 16-bit greyscale
    scaled to 8 bits (65535 -> 255), not clipped as PIL's own conversion does."""
    if im.mode.startswith("I"):
        a = np.asarray(im)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise ValueError(
                f"hf: {row}: a 32-bit integer image with values outside 0..65535 "
                f"({int(a.min())}..{int(a.max())}); save it as an 8- or 16-bit image"
            )
        a = ((a.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
        return a if mode == "L" else np.repeat(a[..., None], 3, axis=2)
    if im.mode == "F":
        raise ValueError(
            f"hf: {row}: a 32-bit floating-point image (PIL mode F) has no fixed pixel range; "
            "save it as an 8- or 16-bit image"
        )
    return np.asarray(im.convert(mode), dtype=np.uint8)


def pixels(images: list[Any], column: str, where: str, mode: str | None = None) -> np.ndarray:
    """PIL images -> uint8 ``[B, C, H, W]``: one channel when ``mode`` is ``"L"``, else RGB
    (``mode`` None: :func:`image_mode` of ``images``; give the mode of every split's images so
    that the splits agree).

    Raises:
        ValueError: naming ``where``, the row and file of the first image whose size differs
            from row 0's, or of a 32-bit image (floats, or integers beyond 16 bits).
    """
    mode = mode or image_mode(images)

    def row(k: int) -> str:
        name = getattr(images[k], "filename", "")
        return f"{where}: row {k} of column {column!r}" + (f" ({name})" if name else "")

    arrays = [_array(im, mode, row(k)) for k, im in enumerate(images)]
    for k, a in enumerate(arrays):
        if a.shape != arrays[0].shape:
            raise ValueError(
                f"hf: {row(k)} is {a.shape[1]}x{a.shape[0]} pixels, row 0 "
                f"{arrays[0].shape[1]}x{arrays[0].shape[0]}: the images of column {column!r} "
                "differ in size; resize them to one size first"
            )
    if not arrays:
        return np.zeros((0, 1, 1, 1), dtype=np.uint8)
    x = np.stack(arrays)
    return x[:, None] if mode == "L" else x.transpose(0, 3, 1, 2)
