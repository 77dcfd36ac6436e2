"""The ``leaf`` source (LEAF's JSON folders, FEMNIST and Shakespeare layouts) and its users as
the natural partition: one client per user, each client's local test split the user's own LEAF
test data. The folders are written small in a temporary folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from ecosystem_data import femnist_users, shakespeare_users, write_leaf

from fedlore.config import ConfigError, load_config
from fedlore.data.datasource import DataSource
from fedlore.data.federation import build_federation, load_source
from fedlore.data.leaf import FEMNIST_CLASSES, LEAF_LETTERS, UNKNOWN, load_leaf


def leaf(root: Path, *over: str) -> list[str]:
    return ["data.name=leaf", f"data.root={root}", *over]


def test_femnist_layout_gives_28x28_images_62_classes_and_users_as_ids(tmp_path: Path) -> None:
    users = femnist_users(num_users=4, n_train=12, n_test=3)
    write_leaf(tmp_path / "femnist", users, files=2)  # users spread over two files
    src = load_leaf(str(tmp_path / "femnist"))
    names = sorted(users)
    assert src.name == "leaf" and src.input_shape == (1, 28, 28) and src.num_classes == 62
    assert src.class_names == list(FEMNIST_CLASSES) and src.class_names[10] == "A"
    assert src.id_names == tuple(names) and len(src.train) == 48 and len(src.test) == 12
    for k, name in enumerate(names):  # every user's rows, in its file order, with its id
        rows = np.flatnonzero(src.train_ids == k)
        x, y = users[name]["train"]
        assert torch.equal(src.train.x[rows], torch.tensor(x).reshape(-1, 1, 28, 28))
        assert src.train.y[rows].tolist() == y
        assert src.test.y[np.flatnonzero(src.test_ids == k)].tolist() == users[name]["test"][1]


def test_shakespeare_layout_gives_leaf_character_ids(tmp_path: Path) -> None:
    users = shakespeare_users(num_users=3, n_train=8, n_test=2)
    first = next(iter(users))
    x, y = users[first]["train"]
    users[first]["train"] = (["~" + x[0][1:], *x[1:]], y)  # '~' is not in LEAF's vocabulary
    write_leaf(tmp_path / "shakespeare" / "data", users)  # LEAF's own data/ layout
    src = load_source(load_config(None, leaf(tmp_path / "shakespeare")).data)
    assert isinstance(src, DataSource) and src.train_ids is not None
    assert src.train.x.dtype == torch.int64 and src.input_shape == (80,)
    assert src.num_classes == len(LEAF_LETTERS) + 1 == 81 and src.class_names[-1] == UNKNOWN
    assert src.class_names[:3] == ["\\n", " ", "!"]
    row = np.flatnonzero(src.train_ids == sorted(users).index(first))[0]
    want = [len(LEAF_LETTERS)] + [LEAF_LETTERS.index(c) for c in x[0][1:]]
    assert src.train.x[row].tolist() == want
    assert src.train.y[row].item() == LEAF_LETTERS.index(y[0])


def test_one_client_per_user_with_the_users_own_test_data(tmp_path: Path) -> None:
    users = femnist_users(num_users=5, n_train=10, n_test=4, seed=3)
    write_leaf(tmp_path / "f", users)
    cfg = load_config(None, leaf(tmp_path / "f", "partition.name=natural", "num_clients=5"))
    fed = build_federation(cfg, 7)
    assert len(fed.central_test) == 20  # every user's test data
    for k, name in enumerate(sorted(users)):  # client k is the k-th user
        client = fed.client(k)
        x, y = users[name]["train"]
        assert torch.equal(client.train.x, torch.tensor(x).reshape(-1, 1, 28, 28))
        assert client.train.y.tolist() == y
        tx, ty = users[name]["test"]
        assert torch.equal(client.test.x, torch.tensor(tx).reshape(-1, 1, 28, 28))
        assert client.test.y.tolist() == ty
    # the same federation for every seed: nothing is drawn
    again = build_federation(cfg, 8)
    assert all(
        np.array_equal(a, b) for a, b in zip(fed.train_indices, again.train_indices, strict=True)
    )
    # data.local_test=split: a random test_fraction of each user's training data instead
    over = leaf(tmp_path / "f", "partition.name=natural", "num_clients=5", "data.local_test=split")
    split = build_federation(load_config(None, over), 7)
    assert [len(t) for t in split.test_indices] == [2] * 5
    assert [len(t) for t in split.train_indices] == [8] * 5


def test_fewer_clients_group_whole_users_and_more_are_refused(tmp_path: Path) -> None:
    users = femnist_users(num_users=6, n_train=5, n_test=2)
    write_leaf(tmp_path / "f", users)
    src = load_leaf(str(tmp_path / "f"))
    assert src.train_ids is not None and src.test_ids is not None
    natural = leaf(tmp_path / "f", "partition.name=natural")
    fed = build_federation(load_config(None, [*natural, "num_clients=4"]), 0)
    owners = [set(src.train_ids[tr].tolist()) for tr in fed.train_indices]
    assert sorted(len(o) for o in owners) == [1, 1, 2, 2]  # 6 users in 4 near-equal groups
    assert set().union(*owners) == set(range(6)) and sum(len(o) for o in owners) == 6
    for tr, te in zip(fed.train_indices, fed.test_indices, strict=True):
        assert set(src.test_ids[te - len(src.train)]) <= set(src.train_ids[tr])
    with pytest.raises(ValueError, match=r"num_clients=7, but the clients' data hold 6 ids"):
        build_federation(load_config(None, [*natural, "num_clients=7"]), 0)


def test_by_id_tests_need_ids_and_users_kept_whole(tmp_path: Path) -> None:
    write_leaf(tmp_path / "f", femnist_users(num_users=3, n_train=20, n_test=2))
    over = leaf(tmp_path / "f", "num_clients=3", "partition.name=iid", "data.local_test=by_id")
    with pytest.raises(ConfigError, match="by_id needs every id on one client"):
        build_federation(load_config(None, over), 0)
    with pytest.raises(ConfigError, match=r"data\.local_test=by_id needs a source whose examples"):
        build_federation(load_config(None, ["data.local_test=by_id"]), 0)


def test_a_folder_without_test_holds_out_test_data_with_their_users(tmp_path: Path) -> None:
    write_leaf(tmp_path / "f", femnist_users(num_users=3, n_train=20, n_test=2))
    for f in (tmp_path / "f" / "test").iterdir():
        f.unlink()
    (tmp_path / "f" / "test").rmdir()
    cfg = load_config(None, leaf(tmp_path / "f", "partition.name=natural", "num_clients=3"))
    fed = build_federation(cfg, 0)
    assert fed.test_split is not None and len(fed.central_test) > 0
    # by_id (the default under natural): each client tests on its own user's held-out examples
    assert all(len(t) > 0 for t in fed.test_indices)


def test_bad_folders_and_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(
        FileNotFoundError, match=r"(?s)no train/ folder.*nope/train.*nope/data/train"
    ):
        load_leaf(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"no data\.root"):
        load_leaf(None)
    (tmp_path / "e" / "train").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"holds no \.json file"):
        load_leaf(str(tmp_path / "e"))
    users = femnist_users(num_users=2, n_train=3, n_test=1)
    write_leaf(tmp_path / "b", users)
    train_file = next((tmp_path / "b" / "train").glob("*.json"))
    obj = json.loads(train_file.read_text())
    obj["num_samples"][1] = 9
    train_file.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=r"user 'f0001_01' has 3 examples, num_samples says 9"):
        load_leaf(str(tmp_path / "b"))
    train_file.write_text(json.dumps({"users": ["a"]}))
    with pytest.raises(ValueError, match="needs 'users' and 'user_data'"):
        load_leaf(str(tmp_path / "b"))
    train_file.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable LEAF JSON file"):
        load_leaf(str(tmp_path / "b"))
    bad = femnist_users(num_users=1, n_train=2, n_test=1)
    name = next(iter(bad))
    bad[name]["train"] = (bad[name]["train"][0], [3, 62])
    write_leaf(tmp_path / "c", bad)
    with pytest.raises(ValueError, match="FEMNIST label 62 beyond its 62 classes"):
        load_leaf(str(tmp_path / "c"))
    ragged = shakespeare_users(num_users=1, n_train=2, n_test=1)
    name = next(iter(ragged))
    xs, ys = ragged[name]["train"]
    ragged[name]["train"] = ([xs[0], xs[1][:70]], ys)
    write_leaf(tmp_path / "r", ragged)
    with pytest.raises(ValueError, match=r"strings differ in length \(80 and 70 at example 1\)"):
        load_leaf(str(tmp_path / "r"))


def test_per_client_metrics_need_a_local_test_split(tmp_path: Path) -> None:
    """LEAF split by user (its test users hold no training data): under ``natural`` no client
    has a test example of its own, so ``eval.clients`` (G-local) and ``eval.local`` (P-local)
    would record nothing; each is refused, naming why and the way out that applies. With some
    clients left without one, they are named in a warning (once) and the run goes on."""
    import warnings

    from fedlore.checks import check_eval, model_data
    from fedlore.data.checks import DataWarning

    users = femnist_users(num_users=5, n_train=6, n_test=3, seed=4)
    names = sorted(users)
    for name in names[:3]:  # training users: no test data
        users[name]["test"] = ([], [])
    for name in names[3:]:  # test users: no training data
        users[name]["train"] = ([], [])
    write_leaf(tmp_path / "f", users)
    base = leaf(tmp_path / "f", "partition.name=natural", "num_clients=3")
    fed = build_federation(load_config(None, base), 0)
    for setting in ("eval.clients", "eval.local"):
        cfg = load_config(None, [*base, f"{setting}=true"])
        with pytest.raises(
            ConfigError,
            match=rf"{setting}=true: none of the 3 clients has a local test split: under "
            r"data.local_test=by_id .*LEAF.*; set data.local_test=split",
        ):
            check_eval(cfg, fed)
    check_eval(load_config(None, base), fed)  # neither asked: fine
    # under data.local_test=split the reason is the clients' size, and the way out is more data
    tiny = load_config(None, ["data.fraction=0.01", "num_clients=10", "partition.name=iid",
                              "eval.clients=true"])  # fmt: skip
    tiny_fed = build_federation(tiny, 0)
    sizes = [len(tiny_fed.client(c).train) + len(tiny_fed.client(c).test) for c in range(10)]
    assert max(sizes) < 2  # every client too small to hold one out
    with pytest.raises(ConfigError, match=r"at least two examples .*; use fewer clients or more"):
        check_eval(tiny, tiny_fed)
    users = femnist_users(num_users=3, n_train=6, n_test=3, seed=4)
    users[sorted(users)[0]]["test"] = ([], [])
    write_leaf(tmp_path / "g", users)
    cfg = load_config(None, leaf(tmp_path / "g", "partition.name=natural", "num_clients=3",
                                 "eval.clients=true"))  # fmt: skip
    model_data._WARNED.clear()
    some = build_federation(cfg, 0)
    with pytest.warns(
        DataWarning, match=r"1 of the 3 clients have no local test split .*\(clients 0\)"
    ):
        check_eval(cfg, some)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)
        check_eval(cfg, some)  # the next seed: said already
