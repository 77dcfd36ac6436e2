"""Site-local data (``flower.site_data``): the ``npz`` source, the server's test-only
federation and a site's own one-client federation; what the mode refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedlore.config import ConfigError, load_config
from fedlore.data.sources import load_npz
from fedlore.experiment import run_one
from fedlore.flower.sites import server_federation, site_federation

NAMES = np.asarray([f"c{i}" for i in range(4)])


def _write(folder: Path, part: str, n: int, seed: int = 0, names: bool = True) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    extra = {"class_names": NAMES} if names else {}
    x = rng.integers(0, 256, size=(n, 1, 4, 4), dtype=np.uint8)
    # allow_pickle named (numpy's default): the unpacked arrays then fill only **kwds
    np.savez(folder / f"{part}.npz", x=x, y=rng.integers(0, 4, n), allow_pickle=True, **extra)


def _cfg(root: Path, *more: str):
    return load_config(
        None,
        ["data.name=npz", f"data.root={root}", "num_clients=3", "flower.site_data=true",
         "progress=false", *more],
    )  # fmt: skip


def test_npz_source_reads_either_file(tmp_path: Path) -> None:
    _write(tmp_path / "a", "train", 20)
    src = load_npz(str(tmp_path / "a"))
    assert src.train.x.shape == (20, 1, 4, 4) and len(src.test) == 0
    assert float(src.train.x.max()) <= 1.0  # uint8 scaled to [0, 1]
    assert src.num_classes == 4 and src.class_names == list(NAMES)
    _write(tmp_path / "b", "test", 7, names=False)
    only_test = load_npz(str(tmp_path / "b"))
    assert len(only_test.train) == 0 and len(only_test.test) == 7
    with pytest.raises(FileNotFoundError, match=r"neither .*train\.npz nor .*test\.npz"):
        load_npz(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"no data\.root given"):
        load_npz(None)
    bad = tmp_path / "c"
    bad.mkdir()
    np.savez(bad / "train.npz", x=np.zeros((3, 2)), y=np.array([0, 4, 5]), class_names=NAMES)
    with pytest.raises(ValueError) as e:  # the file and the first row of such a label are named
        load_npz(str(bad))
    assert str(e.value) == (
        f"{bad / 'train.npz'}: y[1] is 4, but its class_names has 4 entries (labels 0 to 3)"
    )
    np.savez(bad / "train.npz", x=np.zeros((3, 2)), y=np.array([0, 1, 4]), class_names=NAMES)
    with pytest.raises(ValueError, match=r"train\.npz: y\[2\] is 4, but its class_names has 4 "):
        load_npz(str(bad))  # 4 is one past the last of 4 names
    np.savez(bad / "train.npz", x=np.zeros((3, 2)), y=np.array([0, 1, -2]), class_names=NAMES)
    with pytest.raises(ValueError) as e:
        load_npz(str(bad))
    assert str(e.value) == f"{bad / 'train.npz'}: y[2] is -2; labels must be non-negative integers"
    np.savez(bad / "train.npz", x=np.zeros((3, 2)), y=np.array([0, 5, 1]))  # names in test only
    np.savez(bad / "test.npz", x=np.zeros((2, 2)), y=np.array([0, 1]), class_names=NAMES)
    with pytest.raises(ValueError, match="label 5 but class_names has 4 entries"):
        load_npz(str(bad))
    (bad / "test.npz").unlink()
    np.savez(bad / "train.npz", x=np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"needs arrays 'x' \(inputs\) and 'y'"):
        load_npz(str(bad))


def test_server_holds_only_the_test_set_and_sites_only_their_own(tmp_path: Path) -> None:
    _write(tmp_path / "server", "test", 30)
    for i, n in enumerate((40, 50, 60)):
        _write(tmp_path / f"site-{i}", "train", n, seed=i + 1)
    cfg = _cfg(tmp_path / "server")
    server = server_federation(cfg, 42)
    assert len(server.central_test) == 30 and len(server.pool) == 0
    assert server.num_clients == 3 and all(len(t) == 0 for t in server.train_indices)
    sizes = []
    for i in range(3):
        site = site_federation(cfg, 42, i, str(tmp_path / f"site-{i}"))
        assert site.num_clients == 1
        data = site.client(0)
        assert len(data.train) + len(data.test) == 40 + 10 * i  # all of its own, nothing else
        sizes.append(len(data.train))
    assert len(set(sizes)) == 3


def test_site_mode_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    _write(tmp_path / "server", "test", 30)
    cfg = _cfg(tmp_path / "server", "eval.clients=true", "data.selection_fraction=0.1")
    with pytest.raises(ConfigError) as err:
        server_federation(cfg, 42)
    assert "eval.clients" in str(err.value) and "data.selection_fraction" in str(err.value)
    with pytest.raises(ConfigError, match="needs a `flwr run` deployment"):
        run_one(_cfg(tmp_path / "server", f"output_dir={tmp_path / 'runs'}"), "fedavg", 42)
    empty = tmp_path / "server-without-test"
    _write(empty, "train", 10)
    with pytest.raises(ConfigError, match="holds no test examples"):
        server_federation(_cfg(empty), 42)


def test_run_and_partition_refuse_site_mode_before_reading_the_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fedlore run` / `fedlore partition` of a site-local config (the server's folder holds
    only test.npz) say that the mode needs a deployment, not that a client got no data from
    the Dirichlet partition (what building the federation first said)."""
    from fedlore.cli import main
    from fedlore.experiment import run_experiment

    _write(tmp_path / "server", "test", 30)
    cfg = _cfg(tmp_path / "server", f"output_dir={tmp_path / 'runs'}")
    with pytest.raises(ConfigError, match="needs a `flwr run` deployment"):
        run_experiment(cfg)
    args = ["data.name=npz", f"data.root={tmp_path / 'server'}", "flower.site_data=true"]
    assert main(["partition", *args]) == 2
    assert "no partition to show" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
