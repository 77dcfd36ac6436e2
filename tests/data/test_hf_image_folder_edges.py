"""The ``hf`` source on image folders as users hand them over: greyscale and colour mixed over
the splits, 16-bit and 32-bit images, a greyscale image with alpha, camera-rotated photos,
symlinked class folders, class folders named like a split, a single class, empty class folders,
images below their class folder, a test split alone (a site-local server), and the site check
that every site names its classes as the server does. Each error names its file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("datasets", reason="needs the [hf] extra: pip install -e '.[hf]'")
from PIL import Image

from fedlore.config import load_config
from fedlore.data.hf import load_hf
from fedlore.flower.sites import (
    SITE_CLASSES,
    check_site,
    server_federation,
    site_config,
    site_federation,
)


def _grey(folder: Path, n: int = 2, value: int = 7, size: tuple[int, int] = (4, 3)) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        Image.fromarray(np.full(size[::-1], value + k, np.uint8)).save(folder / f"{k}.png")


def test_one_colour_image_makes_every_split_rgb(tmp_path: Path) -> None:
    for split in ("train", "test"):
        for name in ("a", "b"):
            _grey(tmp_path / split / name)
    Image.fromarray(np.full((3, 4, 3), (10, 20, 30), np.uint8)).save(tmp_path / "train/b/c.png")
    src = load_hf(str(tmp_path))
    assert src.input_shape == (3, 3, 4) and tuple(src.test.x.shape[1:]) == (3, 3, 4)
    grey = src.test.x * 255.0  # greyscale repeated over the three channels
    assert torch.equal(grey[:, 0], grey[:, 2]) and sorted(set(grey.round().flatten().tolist())) == [
        7.0,
        8.0,
    ]


def test_sixteen_bit_greyscale_is_scaled_and_32_bit_images_are_named(tmp_path: Path) -> None:
    for split in ("train", "test"):
        for name in ("a", "b"):
            (tmp_path / split / name).mkdir(parents=True)
            a = np.full((3, 4), 40000, np.uint16)
            a[0, 0], a[0, 1] = 65535, 0
            Image.fromarray(a).save(tmp_path / split / name / "0.png")  # PIL mode I;16
    assert Image.open(tmp_path / "train/a/0.png").mode.startswith("I")
    src = load_hf(str(tmp_path))
    assert src.input_shape == (1, 3, 4)  # greyscale, one channel
    x = src.train.x[0, 0] * 255.0
    assert (x[0, 0], x[0, 1], x[1, 1]) == (255.0, 0.0, 156.0)  # 40000 * 255 / 65535 = 155.6
    wide = tmp_path / "wide"
    for name in ("a", "b"):
        (wide / "train" / name).mkdir(parents=True)
        Image.fromarray(np.full((3, 4), 70000, np.int32)).save(wide / "train" / name / "0.tif")
    with pytest.raises(ValueError, match=r"\(.*train/a/0\.tif\): a 32-bit integer image .*"):
        load_hf(str(wide))
    real = tmp_path / "real"
    for name in ("a", "b"):
        (real / "train" / name).mkdir(parents=True)
        Image.fromarray(np.full((3, 4), 0.5, np.float32)).save(real / "train" / name / "0.tif")
    with pytest.raises(ValueError, match=r"\(.*train/a/0\.tif\): a 32-bit floating-point image"):
        load_hf(str(real))


def test_greyscale_with_alpha_is_one_channel_and_photos_are_turned_upright(
    tmp_path: Path,
) -> None:
    for name in ("a", "b"):
        (tmp_path / "train" / name).mkdir(parents=True)
        la = np.zeros((3, 4, 2), np.uint8)
        la[..., 0], la[..., 1] = 200, 255
        Image.fromarray(la, "LA").save(tmp_path / "train" / name / "0.png")
    src = load_hf(str(tmp_path))
    assert src.input_shape == (1, 3, 4) and float(src.train.x.max()) * 255 == pytest.approx(200)
    photo = tmp_path / "photo"
    for name in ("a", "b"):
        (photo / "train" / name).mkdir(parents=True)
        im = Image.fromarray(np.full((3, 4), 100, np.uint8))
        exif = im.getexif()
        exif[0x0112] = 6  # "rotate 90° clockwise to view": a 4x3 photo shows 3 wide, 4 high
        im.save(photo / "train" / name / "0.jpg", exif=exif, quality=100)
    assert load_hf(str(photo)).input_shape == (1, 4, 3)


def test_images_of_another_size_are_named_with_their_file(tmp_path: Path) -> None:
    for name in ("a", "b"):
        _grey(tmp_path / "train" / name)
    _grey(tmp_path / "train" / "b" / "big", n=1, size=(5, 3))
    os.replace(tmp_path / "train/b/big/0.png", tmp_path / "train/b/odd.png")
    with pytest.raises(ValueError, match=r"row 4 of column 'image' \(.*train/b/odd\.png\) is 5x3"):
        load_hf(str(tmp_path))


def test_symlinked_class_folders_are_read_once_and_loops_end(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _grey(root / "train" / "a")
    _grey(tmp_path / "elsewhere" / "shared", n=3)  # the link's name is the class
    os.symlink(tmp_path / "elsewhere" / "shared", root / "train" / "b")
    os.symlink(root / "train", root / "train" / "a" / "loop")  # a folder linked into itself
    src = load_hf(str(root))
    assert src.class_names == ["a", "b"]
    assert torch.bincount(src.train.y).tolist() == [2, 3]


def test_class_folders_named_like_a_split_stay_in_their_split(tmp_path: Path) -> None:
    for split, other in (("train", "test"), ("test", "train")):
        _grey(tmp_path / split / "cat")
        _grey(tmp_path / split / other, n=3)  # train/test/ and test/train/ are classes
    _grey(tmp_path / "validation" / "cat", n=5)  # another split's folder: left out
    src = load_hf(str(tmp_path))
    assert src.class_names == ["cat", "test", "train"]
    assert torch.bincount(src.train.y, minlength=3).tolist() == [2, 3, 0]
    assert torch.bincount(src.test.y, minlength=3).tolist() == [2, 0, 3]


def test_one_class_is_refused_and_empty_class_folders_are_classes(tmp_path: Path) -> None:
    _grey(tmp_path / "one" / "train" / "only", n=3)
    with pytest.raises(ValueError, match=r"one class only \('only' in column 'label'\)"):
        load_hf(str(tmp_path / "one"))  # datasets alone would drop the label column
    (tmp_path / "one" / "train" / "other").mkdir()
    src = load_hf(str(tmp_path / "one"))
    assert src.class_names == ["only", "other"] and src.train.y.tolist() == [0, 0, 0]
    root = tmp_path / "some"
    _grey(root / "train" / "cat")
    _grey(root / "train" / "owl")
    (root / "train" / "dog").mkdir()  # a class this site has no image of
    (root / "train" / ".ipynb_checkpoints").mkdir()  # hidden: not a class
    src = load_hf(str(root))
    assert src.class_names == ["cat", "dog", "owl"]
    assert torch.bincount(src.train.y, minlength=3).tolist() == [2, 0, 2]


def test_an_image_below_its_class_folder_is_named(tmp_path: Path) -> None:
    for name in ("a", "b"):
        _grey(tmp_path / "train" / name)
    _grey(tmp_path / "train" / "b" / "small", n=1)
    with pytest.raises(ValueError, match=r"train/b/small/0\.png in .* lies below its class"):
        load_hf(str(tmp_path))
    flat = tmp_path / "flat"
    _grey(flat / "cat" / "kitten", n=1)
    _grey(flat / "dog", n=1)
    with pytest.raises(ValueError, match=r"cat/kitten/0\.png in .* lies below its class"):
        load_hf(str(flat))


def test_a_test_split_alone_is_a_site_servers_folder(tmp_path: Path) -> None:
    server = tmp_path / "server"
    for name in ("a", "b", "c"):
        _grey(server / "test" / name)
    src = load_hf(str(server))
    assert len(src.train) == 0 and len(src.test) == 6 and src.class_names == ["a", "b", "c"]
    typo = tmp_path / "typo"
    _grey(typo / "train" / "a")
    _grey(typo / "test" / "a")
    with pytest.raises(FileNotFoundError, match=r"no data file for the training split 'training'"):
        load_hf(str(typo), train_split="training")


def test_sites_must_name_their_classes_as_the_server_does(tmp_path: Path) -> None:
    for name in ("bag", "coat", "shoe"):
        _grey(tmp_path / "server" / "test" / name)
        _grey(tmp_path / "site0" / "train" / name, n=5)
    (tmp_path / "site1" / "train" / "coat").mkdir(parents=True)  # no coats at this site
    _grey(tmp_path / "site1" / "train" / "bag", n=5)
    _grey(tmp_path / "site1" / "train" / "shoe", n=5)
    _grey(tmp_path / "site2" / "train" / "bag", n=5)
    _grey(tmp_path / "site2" / "train" / "hat", n=5)
    _grey(tmp_path / "site2" / "train" / "shoe", n=5)
    cfg = load_config(
        None,
        ["data.name=hf", f"data.root={tmp_path / 'server'}", "num_clients=3",
         "flower.site_data=true"],
    )  # fmt: skip
    said = site_config(server_federation(cfg, 42))
    assert json.loads(str(said[SITE_CLASSES])) == ["bag", "coat", "shoe"]
    for site in (0, 1):
        check_site(site_federation(cfg, 42, site, str(tmp_path / f"site{site}")), said, site, "x")
    site2 = site_federation(cfg, 42, 2, str(tmp_path / "site2"))
    with pytest.raises(ValueError, match=r"site 2: data-root=s2 names class 1 'hat', the server"):
        check_site(site2, said, 2, "s2")
    _grey(tmp_path / "site3" / "train" / "bag", n=5)  # two classes, no empty folder for coat
    _grey(tmp_path / "site3" / "train" / "shoe", n=5)
    fewer = site_federation(cfg, 42, 0, str(tmp_path / "site3"))
    with pytest.raises(ValueError, match=r"gives 2\|1,3,4 \(classes\|input shape\)"):
        check_site(fewer, said, 0, "b")


def test_hidden_files_and_folders_are_not_images(tmp_path: Path) -> None:
    for name in ("a", "b"):
        _grey(tmp_path / "train" / name)
    (tmp_path / "train" / "a" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (tmp_path / "train" / "a" / "._0.png").write_bytes(b"\0\5\26\7\0\2\0\0Mac OS X")  # a fork
    _grey(tmp_path / "train" / "b" / ".ipynb_checkpoints", n=1)  # would lie below its class
    src = load_hf(str(tmp_path))
    assert src.class_names == ["a", "b"] and len(src.train) == 4


def test_the_class_order_is_the_servers_own(tmp_path: Path) -> None:
    from types import SimpleNamespace

    def fed(*names: str) -> Any:
        return SimpleNamespace(num_classes=len(names), input_shape=(1, 2, 2), class_names=names)

    said = site_config(fed("zebra", "ant"))  # an npz's class_names, in its own order
    check_site(fed("zebra", "ant"), said, 0, "s0")
    with pytest.raises(ValueError, match=r"names class 0 'ant', the server's test set 'zebra'"):
        check_site(fed("ant", "zebra"), said, 1, "s1")
    # an npz without class_names numbers its classes: it names none, so names are not compared
    check_site(fed("0", "1"), said, 2, "s2")
    check_site(fed("zebra", "ant"), site_config(fed("0", "1")), 3, "s3")
