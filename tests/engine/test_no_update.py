"""A finished run none of whose rounds aggregated an update says so in one line
(:func:`fedlore.experiment_loop.warn_no_update`): its scores alone would not tell that its
model is the initial one (newbie10: a round deadline no client meets ran to the end silently)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from fedlore.config import load_config
from fedlore.experiment import run_one
from fedlore.experiment_loop import NoUpdateWarning, warn_no_update

COMMON = ["num_clients=3", "rounds=2", "local_steps=2", "progress=false", "algorithms=[fedavg]"]
COMMON += ["model.kwargs={hidden: [8]}", "partition.min_size=10", "clients.speed=lognormal"]


def _said(tmp_path: Path, *extra: str) -> list[str]:
    cfg = load_config(None, [*COMMON, f"output_dir={tmp_path}", *extra])
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        run_one(cfg, "fedavg", 1)
    return [str(w.message) for w in got if w.category is NoUpdateWarning]


def test_a_run_whose_every_reply_was_lost_says_its_model_is_the_initial_one(
    tmp_path: Path,
) -> None:
    said = _said(tmp_path / "lost", "clients.round_deadline_s=0.000001")
    assert len(said) == 1
    assert said[0].startswith(
        "fedavg seed 1: no round of 2 aggregated a client update: every reply was lost or "
        "rejected (the first: 0: ClientDropped: straggler: "
    )
    assert said[0].endswith("> clients.round_deadline_s 1e-06); the model is the initial one")
    assert _said(tmp_path / "fine") == []


class _Named:
    """What the warning reads of a run: its method and seed."""

    method, seed = "m", 0


def test_one_round_with_an_update_is_enough_to_say_nothing() -> None:
    run: Any = _Named()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails
        warn_no_update(run, [{"round": 0, "accepted": 0}, {"round": 1, "accepted": 1}])
        warn_no_update(run, [])
        warn_no_update(run, [{"round": 0}])  # a row without ``accepted``: not judged
        warn_no_update(run, [{"round": -1, "accepted": 0}])  # a setup row is not a round
    with pytest.warns(NoUpdateWarning, match="m seed 0: no round of 2 aggregated"):
        warn_no_update(run, [{"round": 0, "accepted": 0}, {"round": 1, "accepted": 0}])


def test_a_finished_run_reads_its_metrics_once_for_the_summary_the_warning_and_the_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary, this warning and the early-stopping rule's outcome each read the whole
    ``metrics.jsonl`` again at the end of a run (three reads of a file that grows with the
    rounds); they now share one read."""
    from fedlore import experiment_loop
    from fedlore.engine import early_stopping
    from fedlore.results import summary

    reads: list[Path] = []
    real = summary.read_metrics

    def counted(path: Path) -> list[dict[str, Any]]:
        reads.append(path)
        return real(path)

    for module in (summary, experiment_loop, early_stopping):
        monkeypatch.setattr(module, "read_metrics", counted)
    extra = ["early_stopping.metric=selection_accuracy", "data.selection_fraction=0.2"]
    cfg = load_config(None, [*COMMON, f"output_dir={tmp_path}", *extra])
    done = run_one(cfg, "fedavg", 1)
    assert done is not None and done["best_round"] is not None
    assert [p.name for p in reads].count("metrics.jsonl") == 1, reads
