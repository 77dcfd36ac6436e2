"""The ``hf`` source on a folder of images (``train/<class>/<image>``, ``test/<class>/<image>``,
torchvision's ``ImageFolder`` layout): pixels, classes named by the folders and numbered over
both splits, a split chosen by folder alone, a folder of class folders as the training split,
and the errors that name the image and the layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("datasets", reason="needs the [hf] extra: pip install -e '.[hf]'")
from ecosystem_data import digits
from PIL import Image

from fedlore.config import load_config
from fedlore.data.datasource import DataSource
from fedlore.data.federation import build_federation, load_source
from fedlore.data.hf import load_hf

CLASSES = ("cat", "dog", "owl")


def _write(root: Path, split: str | None, per_class: dict[str, int], offset: int = 0) -> None:
    """Digits as PNG files, class k of CLASSES holding digits whose label mod 3 is k (so the
    pixels of each image are known): ``root/<split>/<class>/<n>.png``."""
    pix, y = digits(300, offset)
    for k, name in enumerate(CLASSES):
        if not per_class.get(name):
            continue
        folder = root / split / name if split else root / name
        folder.mkdir(parents=True, exist_ok=True)
        rows = np.flatnonzero(y % 3 == k)[: per_class[name]]
        for n, r in enumerate(rows):
            Image.fromarray(pix[r]).save(folder / f"{n:03d}.png")


def _pixels(root: Path, split: str, name: str) -> torch.Tensor:
    files = sorted((root / split / name).glob("*.png"))
    return torch.stack([torch.from_numpy(np.array(Image.open(f))) for f in files])


def test_split_and_class_folders_give_pixels_and_classes_numbered_over_both_splits(
    tmp_path: Path,
) -> None:
    root = tmp_path / "pets"
    _write(root, "train", {"cat": 4, "dog": 5, "owl": 6})
    _write(root, "test", {"cat": 2, "dog": 3}, offset=300)  # no owl in the test split
    # a training image whose name starts with "test" is a training image (by its folder)
    Image.fromarray(digits(1, 299)[0][0]).save(root / "train" / "dog" / "test_9.png")
    src = load_source(load_config(None, ["data.name=hf", f"data.root={root}"]).data)
    assert isinstance(src, DataSource)
    assert src.class_names == list(CLASSES) and src.num_classes == 3
    assert src.input_shape == (1, 8, 8) and src.train.x.dtype == torch.float32
    assert torch.bincount(src.train.y, minlength=3).tolist() == [4, 6, 6]
    assert torch.bincount(src.test.y, minlength=3).tolist() == [2, 3, 0]  # owl is still 2
    for split, part in (("train", src.train), ("test", src.test)):
        for k, name in enumerate(CLASSES):
            if not (root / split / name).is_dir():
                continue
            got = part.x[part.y == k][:, 0] * 255.0  # scaled to [0, 1] as npz does
            want = _pixels(root, split, name).float()
            # the same images, in some order: compare as sorted rows
            assert torch.equal(
                torch.sort(got.reshape(len(got), -1).round(), dim=0).values,
                torch.sort(want.reshape(len(want), -1), dim=0).values,
            ), (split, name)


def test_a_folder_of_class_folders_is_the_training_split_with_its_test_held_out(
    tmp_path: Path,
) -> None:
    root = tmp_path / "only"
    _write(root, None, {"cat": 10, "dog": 10, "owl": 10})
    src = load_hf(str(root))
    assert len(src.train.y) == 30 and len(src.test.y) == 0
    cfg = load_config(None, ["data.name=hf", f"data.root={root}", "num_clients=2"])
    fed = build_federation(cfg, seed=42)
    assert len(fed.central_test) == 6  # a stratified 20 % held out (data.missing_test: hold_out)


def test_colour_images_become_rgb_channels_first(tmp_path: Path) -> None:
    root = tmp_path / "rgb"
    for k, name in enumerate(CLASSES[:2]):
        (root / "train" / name).mkdir(parents=True)
        for n in range(3):
            pix = np.full((6, 5, 3), (10 * k, 100 + n, 200), dtype=np.uint8)
            Image.fromarray(pix).save(root / "train" / name / f"{n}.jpg", quality=100)
    src = load_hf(str(root))
    assert src.input_shape == (3, 6, 5) and src.class_names == ["cat", "dog"]
    blue = src.train.x[:, 2] * 255.0
    assert torch.allclose(blue, torch.full_like(blue, 200.0), atol=3.0)  # JPEG rounds a little


def test_a_broken_or_missing_image_is_named_with_its_file_or_row(tmp_path: Path) -> None:
    from datasets import Dataset, Features, Value
    from datasets import Image as ImageFeature

    root = tmp_path / "broken"
    _write(root, "train", {"cat": 2, "dog": 2})
    (root / "train" / "dog" / "009.png").write_bytes(b"not a png at all")
    with pytest.raises(ValueError, match=r"\(.*train/dog/009\.png\): not an image PIL can read"):
        load_hf(str(root))
    cut = tmp_path / "cut"  # a PNG cut short: its header opens, its pixels do not
    _write(cut, "train", {"cat": 2, "dog": 2})
    whole = (cut / "train" / "cat" / "001.png").read_bytes()
    (cut / "train" / "cat" / "001.png").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"\(.*train/cat/001\.png\): not an image PIL can read"):
        load_hf(str(cut))
    features = Features({"image": ImageFeature(), "label": Value("int64")})
    Dataset.from_dict(
        {"image": [Image.new("L", (4, 4)), None], "label": [0, 1]}, features=features
    ).save_to_disk(str(tmp_path / "gap"))
    with pytest.raises(
        ValueError, match=r"split 'train'\): row 1 of column 'image' holds no image"
    ):
        load_hf(str(tmp_path / "gap"))


def test_a_folder_datasets_cannot_read_is_not_called_text(tmp_path: Path) -> None:
    from fedlore.data.hf import _unreadable

    png = tmp_path / "a.png"
    Image.new("L", (4, 4)).save(png)  # its bytes are not UTF-8, and need not be
    said = _unreadable(str(tmp_path), RuntimeError("boom"), [str(png)])
    assert said == f"hf: datasets cannot read {tmp_path} (RuntimeError: boom)"


def test_images_outside_class_folders_and_mixed_files_are_refused(tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    (flat / "train").mkdir(parents=True)
    (flat / "test").mkdir()
    for split in ("train", "test"):
        for n in range(2):
            Image.fromarray(digits(1, n)[0][0]).save(flat / split / f"{n}.png")
    # datasets alone would take the split folders' names, train and test, for two classes
    with pytest.raises(ValueError, match=r"(train|test)/0\.png in .* is not in a class folder"):
        load_hf(str(flat))
    top = tmp_path / "top"
    _write(top, None, {"cat": 2, "dog": 2})
    Image.fromarray(digits(1)[0][0]).save(top / "stray.png")
    with pytest.raises(ValueError, match=r"stray\.png in .* is not in a class folder"):
        load_hf(str(top))
    mixed = tmp_path / "mixed"
    _write(mixed, "train", {"cat": 2, "dog": 2})
    (mixed / "train" / "labels.csv").write_text("image,label\n")
    with pytest.raises(ValueError, match=r"mixes file formats \['csv', 'imagefolder'\]"):
        load_hf(str(mixed))
    with pytest.raises(FileNotFoundError, match=r"is a \.png file; it must be .*folder of images"):
        load_hf(str(top / "stray.png"))


def test_upper_case_suffixes_are_images(tmp_path: Path) -> None:
    root = tmp_path / "camera"
    for name in CLASSES[:2]:
        (root / "train" / name).mkdir(parents=True)
        Image.fromarray(digits(1)[0][0]).save(root / "train" / name / "IMG_1.PNG", format="PNG")
    assert len(load_hf(str(root)).train.y) == 2
