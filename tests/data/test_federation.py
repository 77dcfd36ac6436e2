"""build_federation on the embedded digits source."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fedlore.config import load_config
from fedlore.data.federation import Federation, build_federation
from fedlore.data.holdout import split_local


def _fed(seed: int = 0, **over: Any) -> Federation:
    items = [f"{k.replace('__', '.')}={v}" for k, v in over.items()]
    return build_federation(load_config(None, ["data.name=digits", "num_clients=6", *items]), seed)


def test_same_seed_same_clients_other_seed_differs() -> None:
    a, b, c = _fed(0), _fed(0), _fed(1)
    for i in range(a.num_clients):
        ca, cb = a.client(i), b.client(i)
        assert torch.equal(ca.train.x, cb.train.x) and torch.equal(ca.train.y, cb.train.y)
        assert torch.equal(ca.test.y, cb.test.y)
    assert not np.array_equal(a.client_sizes(), c.client_sizes())
    assert torch.equal(a.client(2).train.x, a.client(2).train.x)  # repeated calls agree


def test_structure_disjoint_and_histogram() -> None:
    fed = _fed(0)
    assert fed.num_clients == 6 and fed.num_classes == 10 and fed.input_shape == (1, 8, 8)
    assert len(fed.central_test) == 360 and len(fed.class_names) == 10
    seen = []
    for i in range(fed.num_clients):
        tr, te = fed.train_indices[i], fed.test_indices[i]
        assert len(tr) >= 1 and len(te) >= 1 and not set(tr) & set(te)
        assert len(te) == pytest.approx(0.2 * (len(tr) + len(te)), abs=1)
        seen += [*tr, *te]
        assert fed.client(i).num_examples == fed.client_sizes()[i]
    assert sorted(seen) == list(range(1437))
    hist = fed.histogram()
    assert hist.shape == (6, 10)
    assert np.array_equal(hist.sum(axis=1), fed.client_sizes())
    table = fed.format_histogram()
    assert table.count("\n") == 6 + 4 and str(int(hist.sum())) in table.splitlines()[-1]
    with pytest.raises(IndexError, match="client 6"):
        fed.client(6)


def test_noise_changes_inputs_within_unit_range_and_keeps_partition() -> None:
    clean, noisy = _fed(0), _fed(0, data__noise=0.2)
    assert all(
        np.array_equal(x, y) for x, y in zip(clean.train_indices, noisy.train_indices, strict=True)
    )
    for split in (noisy.client(0).train, noisy.client(0).test, noisy.central_test):
        assert float(split.x.min()) >= 0.0 and float(split.x.max()) <= 1.0
    assert not torch.equal(clean.client(0).train.x, noisy.client(0).train.x)
    assert not torch.equal(clean.client(0).test.x, noisy.client(0).test.x)
    assert not torch.equal(clean.central_test.x, noisy.central_test.x)
    assert torch.equal(noisy.client(0).train.x, _fed(0, data__noise=0.2).client(0).train.x)


def test_label_flip_only_training_labels() -> None:
    clean, flipped = _fed(0), _fed(0, data__label_flip=0.5)
    tr_a, tr_b = clean.client(1).train.y, flipped.client(1).train.y
    assert (tr_a != tr_b).float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert torch.equal(clean.client(1).test.y, flipped.client(1).test.y)
    assert np.array_equal(clean.histogram(), flipped.histogram())


def test_fraction_shrinks_per_class() -> None:
    full, quarter = (
        _fed(0, partition__name="iid"),
        _fed(0, partition__name="iid", data__fraction=0.25),
    )
    per_class_full = full.pool.y.bincount(minlength=10).numpy()
    per_class_q = quarter.pool.y.bincount(minlength=10).numpy()
    assert np.array_equal(per_class_q, np.maximum(1, np.round(0.25 * per_class_full)))
    sizes = quarter.client_sizes() + np.array([len(t) for t in quarter.test_indices])
    assert sizes.sum() == per_class_q.sum()


def test_step_and_empty_client_error() -> None:
    fed = _fed(0, partition__name="step", partition__major_share=0.9)
    assert fed.histogram().sum() == fed.client_sizes().sum()
    with pytest.raises(ValueError, match="min_size"):
        _fed(0, num_clients=200, partition__alpha=0.01)


def test_split_local_edge_cases() -> None:
    rng = np.random.default_rng(0)
    tr, te = split_local(np.array([7]), 0.2, rng)
    assert tr.tolist() == [7] and te.size == 0
    tr, te = split_local(np.array([3, 5]), 0.9, rng)
    assert len(tr) == 1 and len(te) == 1


def test_a_loader_that_returns_no_data_source_is_named() -> None:
    """A registered loader returning something else (a dict) failed deep inside with
    AttributeError: 'dict' object has no attribute 'name'; the source is named instead."""
    from fedlore import registry

    registry.register_source("_test_dict_source")(lambda root=None: {"x": 1})
    try:
        cfg = load_config(None, ["data.name=_test_dict_source"])
        with pytest.raises(ValueError, match="'_test_dict_source': its loader returned a dict"):
            build_federation(cfg, 42)
    finally:
        registry._TABLES["source"].pop("_test_dict_source")
