"""A kept federation (:func:`fedlore.data.federation.keep_built`, a ``fedlore tune --workers``
worker's): built once per data settings and seed, each call given a copy of its own, and the
settings it is kept by are all that the builders read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.config import load_config
from fedlore.data import federation
from fedlore.data.federation import FEDERATION_FIELDS, build_federation

FIXTURES = Path(__file__).parents[1] / "fixtures"


class Reads:
    """A config that records the names of the settings read from it (top level)."""

    def __init__(self, cfg: Any, seen: set[str]) -> None:
        self._cfg, self._seen = cfg, seen

    def __getattr__(self, name: str) -> Any:
        self._seen.add(name)
        return getattr(self._cfg, name)


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "num_clients=4",
            "data.noise=0.1",
            "data.label_flip=0.1",
            "data.server_fraction=0.1",
            "data.selection_fraction=0.1",
            "data.fraction=0.5",
            "precision=fp64",
        ],
        ["num_clients=3", "partition.name=iid", "data.test_fraction=0.2"],
        [
            "data.name=c4",
            f"data.root={FIXTURES / 'c4'}",
            "data.max_length=16",
            "data.vocab_size=300",
            "partition.name=source_dirichlet",
            "num_clients=5",
        ],
    ],
    ids=["digits-noisy", "digits-iid", "c4-corpus"],
)
def test_the_builders_read_no_setting_the_federation_is_not_kept_by(
    overrides: list[str],
) -> None:
    seen: set[str] = set()
    build_federation(Reads(load_config(None, overrides), seen), 0)  # type: ignore[arg-type]
    assert seen and seen <= set(FEDERATION_FIELDS), seen - set(FEDERATION_FIELDS)


def test_a_kept_federation_is_built_once_and_each_call_gets_its_own_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Built once for the same settings and seed, whatever else the config says (a trial's
    learning rate); a call that changes its copy's tensors in place changes nothing a later one
    gets; other data settings or another seed build anew, and only the last is kept."""
    cfg = load_config(None, ["num_clients=3", "lr=0.1"])
    fresh = build_federation(cfg, 1).fingerprint()
    loads: list[str] = []
    load_source = federation.load_source

    def counted(data: Any) -> Any:
        loads.append(data.name)
        return load_source(data)

    monkeypatch.setattr(federation, "load_source", counted)
    monkeypatch.setattr(federation, "_kept", {})
    first = build_federation(cfg, 1)
    first.pool.x.mul_(0)  # a run that spoils its federation
    first.train_indices[0][:] = 0
    again = build_federation(load_config(None, ["num_clients=3", "lr=0.3"]), 1)
    again.pool.y.zero_()
    third = build_federation(cfg, 1)
    assert len(loads) == 1
    assert third.fingerprint() == fresh and third is not again
    assert not torch.equal(first.pool.x, third.pool.x)
    other = build_federation(load_config(None, ["num_clients=4", "lr=0.1"]), 1)
    assert other.num_clients == 4 and len(loads) == 2
    seed = build_federation(cfg, 2)
    assert seed.fingerprint() != fresh and len(loads) == 3
    assert len(federation._kept) == 1  # type: ignore[arg-type]
    assert build_federation(cfg, 1).fingerprint() == fresh and len(loads) == 4
