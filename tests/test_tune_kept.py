"""``fedlore tune --workers 1`` keeps the federation it built for the search, as each of several
workers does (:func:`fedlore.data.federation.keeping_built`): one build for every trial of the
same data settings and seed, each trial given a deep copy, so each ends bit for bit as the same
trial run alone; the process forgets the kept federation when the search ends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedlore.config import apply_overrides, validate
from fedlore.data import federation
from fedlore.experiment import run_one
from fedlore.tune import Search, override, plan_search
from fedlore.tune_study import run_search

TINY = [
    "name=tiny",
    "rounds=2",
    "num_clients=3",
    "local_steps=5",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "partition.min_size=10",
    "progress=false",
    "algorithms=[fedavg]",
    "seeds=[1]",
    "data.selection_fraction=0.2",
    "data.noise=0.05",
    "threads=1",
    "device=cpu",
    "tune.space={lr: 'log:1e-3:0.3', local_steps: 'int:1:6'}",
    "tune.sampler=random",
    "tune.seed=3",
]


def plan(out: Path, *extra: str) -> Search:
    raw = apply_overrides({}, [*TINY, f"output_dir={out}", *extra])
    return plan_search(validate(raw), raw, "tiny.yaml")


def _rows(path: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl without its timings (wall seconds differ from run to run)."""
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if "wall" not in k and not k.endswith("_s")} for r in rows]


def test_one_worker_builds_the_federation_once_and_each_trial_equals_it_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[int] = []
    real = federation.labelled_federation

    def counted(cfg: Any, seed: int, source: Any) -> Any:
        builds.append(seed)
        return real(cfg, seed, source)

    monkeypatch.setattr(federation, "labelled_federation", counted)
    search = plan(tmp_path / "kept", "tune.trials=3")
    builds.clear()
    outcome = run_search(search)
    assert [r.state for r in outcome.rows] == ["complete"] * 3
    assert builds == [1]  # it was built for each trial: [1, 1, 1]
    assert federation._kept is None  # forgotten when the search ended: its memory freed
    for r in outcome.rows:
        raw = apply_overrides(search.base, [override(k, v) for k, v in r.params.items()])
        raw.update(output_dir=str(tmp_path / "alone"), name=f"trial-{r.number}")
        alone = run_one(validate(raw), search.method, search.run_seed)
        assert alone is not None
        seed = f"{search.method}/seed-{search.run_seed}"
        kept = search.folder / f"trial-{r.number}" / seed / "metrics.jsonl"
        assert _rows(kept) == _rows(
            tmp_path / "alone" / f"trial-{r.number}" / seed / "metrics.jsonl"
        )
    assert builds == [1, 1, 1, 1]  # alone: each built its own


def test_keeping_built_leaves_a_workers_kept_federation_alone() -> None:
    assert federation._kept is None
    with federation.keeping_built():
        assert federation._kept == {}
    assert federation._kept is None
    federation.keep_built()  # a worker keeps built federations for its life
    try:
        held = federation._kept
        with federation.keeping_built():
            assert federation._kept is held
        assert federation._kept is held
    finally:
        federation._kept = None
