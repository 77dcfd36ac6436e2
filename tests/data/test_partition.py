"""Partitioners and corruption helpers."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from fedlore import registry
from fedlore.data.corruption import add_gaussian_noise, flip_labels, subsample_stratified
from fedlore.data.partition import (
    partition_dirichlet,
    partition_source_dirichlet,
    partition_step,
)

LABELS = np.repeat(np.arange(10), 200)  # 2,000 examples, 10 balanced classes
ALL_KWARGS = {"alpha": 0.5, "min_size": 5, "major_classes": 2, "major_share": 0.8}


def _entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    ent = []
    for p in parts:
        q = np.bincount(labels[p], minlength=10) / max(len(p), 1)
        q = q[q > 0]
        ent.append(float(-(q * np.log(q)).sum()))
    return float(np.mean(ent))


@pytest.mark.parametrize("name", ["iid", "dirichlet", "step", "source_dirichlet"])
def test_cover_sorted_deterministic(name: str) -> None:
    part = registry.get("partition", name)
    a = part(LABELS, 7, np.random.default_rng(1), **ALL_KWARGS)
    b = part(LABELS, 7, np.random.default_rng(1), **ALL_KWARGS)
    c = part(LABELS, 7, np.random.default_rng(2), **ALL_KWARGS)
    assert len(a) == 7
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in a)
    assert np.array_equal(np.sort(np.concatenate(a)), np.arange(len(LABELS)))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_iid_sizes_equal() -> None:
    parts = registry.get("partition", "iid")(LABELS, 3, np.random.default_rng(0))
    assert sorted(len(p) for p in parts) == [666, 667, 667]
    with pytest.raises(ValueError, match="num_clients=3"):
        registry.get("partition", "iid")(np.zeros(2, np.int64), 3, np.random.default_rng(0))


def test_dirichlet_small_alpha_more_skewed() -> None:
    ent = {}
    for alpha in (0.05, 100.0):
        vals = [
            _entropy(LABELS, partition_dirichlet(LABELS, 10, np.random.default_rng(s), alpha))
            for s in range(3)
        ]
        ent[alpha] = np.mean(vals)
    assert ent[0.05] < 1.0 < 2.0 < ent[100.0]  # log(10) = 2.30 is perfectly mixed


def test_dirichlet_min_size_and_infeasible() -> None:
    parts = partition_dirichlet(LABELS, 20, np.random.default_rng(0), alpha=0.3, min_size=30)
    assert min(len(p) for p in parts) >= 30
    with pytest.raises(ValueError, match=r"alpha=0\.3, min_size=150, num_clients=20"):
        partition_dirichlet(LABELS, 20, np.random.default_rng(0), alpha=0.3, min_size=150)
    with pytest.raises(ValueError, match=r"alpha=0\.01, min_size=99"):
        partition_dirichlet(LABELS, 20, np.random.default_rng(0), alpha=0.01, min_size=99)
    with pytest.raises(ValueError, match="alpha"):
        partition_dirichlet(LABELS, 5, np.random.default_rng(0), alpha=0.0)


def test_a_refused_dirichlet_partition_announces_its_redraws_in_five_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A slow partition is announced (after 50 draws), but a refusal after 1,000 draws is
    preceded by five lines (50, 100, 200, 400, 800 draws), not the nineteen of every 50."""
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match="infeasible"):
        partition_dirichlet(LABELS, 20, np.random.default_rng(0), alpha=0.01, min_size=99)
    said = [r.getMessage() for r in caplog.records if "draws so far" in r.getMessage()]
    assert [int(m.split(": ")[1].split()[0]) for m in said] == [50, 100, 200, 400, 800]


@pytest.mark.parametrize(("num_clients", "share"), [(10, 0.8), (5, 0.98), (20, 0.6)])
def test_step_major_share(num_clients: int, share: float) -> None:
    parts = partition_step(LABELS, num_clients, np.random.default_rng(3), 2, share)
    for p in parts:
        counts = np.sort(np.bincount(LABELS[p], minlength=10))[::-1]
        assert counts[:2].sum() / len(p) == pytest.approx(share, abs=0.02)
        assert np.all(counts[2:] > 0)  # every minor class gets a slice
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 10


def test_step_reproduces_paper_numbers() -> None:
    # Meta-BayFL Sec. V-B: 10 clients, 4,000 images per class -> 1,960 per major, 10 per minor.
    labels = np.repeat(np.arange(10), 4000)
    for p in partition_step(labels, 10, np.random.default_rng(0), 2, 0.98):
        assert sorted(np.bincount(labels[p], minlength=10).tolist()) == [10] * 8 + [1960] * 2


def test_step_invalid() -> None:
    with pytest.raises(ValueError, match="major_classes"):
        partition_step(LABELS, 4, np.random.default_rng(0), major_classes=11)
    with pytest.raises(ValueError, match="infeasible"):
        partition_step(LABELS, 2, np.random.default_rng(0), major_classes=2, major_share=1.0)


def test_subsample_stratified() -> None:
    labels = np.concatenate([np.repeat(np.arange(4), 100), [4]])
    keep = subsample_stratified(labels, 0.25, np.random.default_rng(0))
    assert np.bincount(labels[keep]).tolist() == [25, 25, 25, 25, 1]
    assert np.all(np.diff(keep) > 0)
    with pytest.raises(ValueError, match=r"1\.5"):
        subsample_stratified(labels, 1.5, np.random.default_rng(0))


def test_gaussian_noise_clipped_and_seeded() -> None:
    x = torch.rand(50, 1, 4, 4)
    a = add_gaussian_noise(x, 0.3, torch.Generator().manual_seed(0))
    b = add_gaussian_noise(x, 0.3, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and not torch.equal(a, x)
    assert float(a.min()) >= 0.0 and float(a.max()) <= 1.0
    assert torch.equal(add_gaussian_noise(x, 0.0, torch.Generator()), x)


def test_gaussian_noise_is_eps_times_a_standard_normal_per_pixel() -> None:
    """The noise model docs/explanation/protocols.md states: x <- clip(x + eps * N(0, 1), 0, 1),
    one independent standard normal per pixel, eps its standard deviation in pixel units."""
    x = torch.full((400, 1, 8, 8), 0.5)
    out = add_gaussian_noise(x, 0.1, torch.Generator().manual_seed(3))
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(out, (x + 0.1 * z).clamp(0.0, 1.0), atol=1e-7)
    noise = out - x  # eps 0.1 around 0.5: 5 sigma from either bound, so nothing is clipped
    assert abs(float(noise.std()) - 0.1) < 0.002 and abs(float(noise.mean())) < 0.002
    edge = add_gaussian_noise(torch.zeros(1000), 0.1, torch.Generator().manual_seed(3))
    assert float(edge.min()) == 0.0 and 0.4 < float((edge == 0).float().mean()) < 0.6


def test_flip_labels_always_other_class() -> None:
    y = np.arange(1000) % 10
    out = flip_labels(y, 0.3, 10, np.random.default_rng(0))
    changed = out != y
    assert changed.sum() == 300 and out.min() >= 0 and out.max() < 10
    assert np.array_equal(flip_labels(y, 0.0, 10, np.random.default_rng(0)), y)
    with pytest.raises(ValueError, match=r"1\.2"):
        flip_labels(y, 1.2, 10, np.random.default_rng(0))


def _seed_protocol_first_draw(
    groups: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Seed 000's allocation written out step by step (Eqs. 68-70), one draw, no redraw."""
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c in np.unique(groups):
        idx = np.flatnonzero(groups == c)
        m = len(idx)
        p = rng.dirichlet(np.full(num_clients, alpha))
        n = np.floor(m * p).astype(int)
        frac = m * p - n
        for i in sorted(range(num_clients), key=lambda i: (-frac[i], i))[: m - n.sum()]:
            n[i] += 1
        shuffled = rng.permutation(idx)
        start = 0
        for i in range(num_clients):
            parts[i] += shuffled[start : start + n[i]].tolist()
            start += n[i]
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def test_source_dirichlet_follows_the_seed_protocol() -> None:
    rng = np.random.default_rng(3)
    groups = rng.integers(0, 7, size=500)
    parts = partition_source_dirichlet(groups, 20, np.random.default_rng(11), alpha=0.5)
    expected = _seed_protocol_first_draw(groups, 20, 0.5, np.random.default_rng(11))
    assert all(len(p) for p in expected)  # this draw needs no redraw
    assert all(np.array_equal(a, b) for a, b in zip(parts, expected, strict=True))
    flat = np.concatenate(parts)
    assert np.array_equal(np.sort(flat), np.arange(500))  # disjoint and covering
    for c in range(7):  # per group, the client counts add up to the group's size
        counts = [int((groups[p] == c).sum()) for p in parts]
        assert sum(counts) == int((groups == c).sum())


def test_source_dirichlet_redraws_an_empty_client_reproducibly() -> None:
    groups = np.array([0] * 4 + [1] * 6)  # two groups, 10 documents over 5 clients
    first = _seed_protocol_first_draw(groups, 5, 0.5, np.random.default_rng(0))
    assert min(len(p) for p in first) == 0  # the first draw leaves a client empty
    a = partition_source_dirichlet(groups, 5, np.random.default_rng(0), alpha=0.5)
    b = partition_source_dirichlet(groups, 5, np.random.default_rng(0), alpha=0.5)
    assert min(len(p) for p in a) >= 1
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    # the redraw continued the same generator: replaying draws until none is empty gives it
    rng = np.random.default_rng(0)
    draw = _seed_protocol_first_draw(groups, 5, 0.5, rng)
    while min(len(p) for p in draw) == 0:
        draw = _seed_protocol_first_draw(groups, 5, 0.5, rng)
    assert all(np.array_equal(x, y) for x, y in zip(a, draw, strict=True))


def test_source_dirichlet_min_size() -> None:
    groups = np.random.default_rng(0).integers(0, 4, size=200)
    parts = partition_source_dirichlet(groups, 10, np.random.default_rng(1), 0.3, min_size=8)
    assert min(len(p) for p in parts) >= 8
    with pytest.raises(ValueError, match=r"lower partition\.min_size"):
        partition_source_dirichlet(groups, 10, np.random.default_rng(1), 0.01, min_size=19)


def test_source_dirichlet_errors() -> None:
    with pytest.raises(ValueError, match="exceeds the 3 documents"):
        partition_source_dirichlet(np.zeros(3, dtype=np.int64), 4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="alpha must be > 0"):
        partition_source_dirichlet(np.zeros(3, dtype=np.int64), 2, np.random.default_rng(0), 0.0)


def test_a_partition_setting_the_partitioner_never_reads_is_named() -> None:
    """``partition.alpha=0.1`` with ``iid`` (a sweep that switches the partition keeps the base
    config's alpha) still runs, with a warning naming the unread setting and what the
    partitioner reads, once per process (not once per seed); a setting it reads, or an unread
    one left at its default (also when the config was dumped and validated again, as on
    Flower), says nothing."""
    import warnings

    from fedlore.config import Config, load_config
    from fedlore.data import checks as data_checks
    from fedlore.data.checks import DataWarning
    from fedlore.data.partition import partition_labels

    data_checks._WARNED.clear()
    cfg = load_config(None, ["partition.name=iid", "partition.alpha=0.1", "num_clients=4"])
    with pytest.warns(DataWarning, match=r"partition.alpha=0.1 not used: partition 'iid' reads"):
        parts = partition_labels(cfg, 0, LABELS)
    assert len(parts) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)
        partition_labels(cfg, 1, LABELS)  # the next seed: said already
    cfg = load_config(None, ["partition.name=step", "partition.min_size=5", "num_clients=4"])
    with pytest.warns(DataWarning, match=r"partition.min_size=5 not used: .* reads partition.maj"):
        partition_labels(cfg, 0, LABELS)
    quiet = [
        ["partition.name=dirichlet", "partition.alpha=0.1"],
        ["partition.name=iid"],
        ["partition.name=iid", "partition.alpha=0.5", "partition.major_classes=2"],  # defaults
    ]
    for over in quiet:
        cfg = load_config(None, [*over, "num_clients=4"])
        again = Config.model_validate_json(cfg.model_dump_json())  # every field "set"
        for c in (cfg, again):
            with warnings.catch_warnings():
                warnings.simplefilter("error", DataWarning)
                partition_labels(c, 0, LABELS)


def test_a_registered_partition_must_return_one_integer_array_per_client() -> None:
    """A partitioner of one's own that returns fewer parts than clients (the run would train
    with the missing clients rejected every round, and exit 0) or float indices is refused with
    one line naming it."""
    from fedlore.config import load_config
    from fedlore.data.partition import partition_labels

    cfg = load_config(None, ["num_clients=3", "partition.name=_test_odd_parts"])
    for parts, says in [
        ([np.arange(len(LABELS))], "returned 1 parts for num_clients=3"),
        (None, "returned NoneType for num_clients=3"),
        (np.array_split(np.arange(len(LABELS), dtype=float), 3), "dtype ['float64']"),
    ]:
        registry.register_partition("_test_odd_parts")(lambda *a, _p=parts, **k: _p)
        try:
            with pytest.raises(ValueError, match=r"partition '_test_odd_parts' .*") as e:
                partition_labels(cfg, 42, LABELS)
            assert says in str(e.value)
        finally:
            registry._TABLES["partition"].pop("_test_odd_parts")
    empty = [np.arange(len(LABELS)), np.array([]), np.array([], dtype=np.int64)]  # empty: any dtype
    registry.register_partition("_test_odd_parts")(lambda *a, **k: empty)
    try:
        assert len(partition_labels(cfg, 42, LABELS)) == 3
    finally:
        registry._TABLES["partition"].pop("_test_odd_parts")


def test_a_partitioner_without_settings_gets_only_the_keys_it_names() -> None:
    """`def f(labels, num_clients, rng)` (no ``**settings``) was called with alpha, min_size,
    ... and failed with a TypeError traceback; it now gets the partition keys it names."""
    from fedlore.config import load_config
    from fedlore.data.partition import partition_labels

    seen: dict[str, float] = {}

    def bare(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        return np.array_split(np.arange(len(labels)), num_clients)

    def alpha_only(
        labels: np.ndarray, num_clients: int, rng: np.random.Generator, alpha: float = 0.0
    ) -> list[np.ndarray]:
        seen["alpha"] = alpha
        return bare(labels, num_clients, rng)

    for name, fn in [("_test_bare", bare), ("_test_alpha_only", alpha_only)]:
        registry.register_partition(name)(fn)
        try:
            cfg = load_config(None, ["num_clients=4", f"partition.name={name}"])
            assert len(partition_labels(cfg, 42, LABELS)) == 4
        finally:
            registry._TABLES["partition"].pop(name)
    assert seen == {"alpha": load_config(None, []).partition.alpha}
