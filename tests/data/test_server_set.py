"""The server's unlabeled set U (``data.server_fraction``): held out of every client's data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedlore.config import ConfigError, load_config
from fedlore.data.federation import Federation, build_federation
from fedlore.data.holdout import hold_out_server

C4 = Path(__file__).parents[1] / "fixtures" / "c4"


def _fed(seed: int = 0, *extra: str) -> Federation:
    return build_federation(load_config(None, ["num_clients=5", *extra]), seed)


def test_u_is_disjoint_from_every_client_and_stratified() -> None:
    fed = _fed(0, "data.server_fraction=0.2")
    u = fed.server_indices
    assert u is not None and len(u) > 0
    clients = np.concatenate([*fed.train_indices, *fed.test_indices])
    assert not set(u.tolist()) & set(clients.tolist())
    assert np.array_equal(np.sort(np.concatenate([u, clients])), np.arange(len(fed.pool)))
    # stratified: about 20 % of every class
    y = fed.pool.y.numpy()
    for c in range(fed.num_classes):
        n_c = int((y == c).sum())
        assert int((y[u] == c).sum()) == max(1, round(0.2 * n_c))
    x = fed.server_unlabeled
    assert x is not None and torch.equal(x, fed.pool.x[torch.from_numpy(u)])
    assert x.shape == (len(u), *fed.input_shape)
    # the clients' rows are not in U
    for i in range(fed.num_clients):
        for split in (fed.client(i).train, fed.client(i).test):
            assert not (split.x[:, None] == x[None]).flatten(2).all(-1).any()


def test_u_is_deterministic_and_seeded() -> None:
    a = _fed(0, "data.server_fraction=0.2")
    b = _fed(0, "data.server_fraction=0.2")
    c = _fed(1, "data.server_fraction=0.2")
    assert a.server_indices is not None and b.server_indices is not None
    assert np.array_equal(a.server_indices, b.server_indices)
    assert a.fingerprint() == b.fingerprint()
    assert c.server_indices is not None
    assert not np.array_equal(a.server_indices, c.server_indices)


def test_no_server_set_leaves_the_federation_as_before() -> None:
    plain, zero = _fed(0), _fed(0, "data.server_fraction=0")
    assert plain.server_indices is None and plain.server_unlabeled is None
    assert plain.fingerprint() == zero.fingerprint()
    for i in range(plain.num_clients):
        assert np.array_equal(plain.train_indices[i], zero.train_indices[i])
    held = _fed(0, "data.server_fraction=0.2")
    assert held.fingerprint() != plain.fingerprint()  # U is part of the data's identity
    assert sum(len(t) for t in held.train_indices) < sum(len(t) for t in plain.train_indices)


def test_u_gets_the_clients_input_noise() -> None:
    clean = _fed(0, "data.server_fraction=0.2")
    noisy = _fed(0, "data.server_fraction=0.2", "data.noise=0.3")
    assert clean.server_indices is not None and noisy.server_indices is not None
    assert np.array_equal(clean.server_indices, noisy.server_indices)
    u_clean, u_noisy = clean.server_unlabeled, noisy.server_unlabeled
    assert u_clean is not None and u_noisy is not None
    assert not torch.equal(u_clean, u_noisy)
    assert torch.equal(u_noisy, noisy.pool.x[torch.from_numpy(noisy.server_indices)])
    assert float(u_noisy.min()) >= 0.0 and float(u_noisy.max()) <= 1.0


@pytest.mark.parametrize("value", ["1.0", "-0.1", "1.5", "abc", "true"])
def test_bad_server_fraction_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match="server_fraction"):
        load_config(None, [f"data.server_fraction={value}"])


def test_server_fraction_that_leaves_clients_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"data\.server_fraction=0\.9999 .* nothing is left"):
        _fed(0, "data.server_fraction=0.9999")
    with pytest.raises(ConfigError, match="must be in"):
        hold_out_server(np.zeros(4, dtype=np.int64), 1.0, np.random.default_rng(0))


def test_pretraining_corpus_refuses_a_server_set() -> None:
    over: list[Any] = [
        "data.name=c4",
        f"data.root={C4}",
        "data.max_length=16",
        "data.vocab_size=300",
        "partition.name=source_dirichlet",
        "data.server_fraction=0.1",
    ]
    with pytest.raises(ConfigError, match=r"data\.server_fraction has no effect"):
        build_federation(load_config(None, over), 0)
