"""An interrupted ``fedlore tune`` continues to the same end (:mod:`fedlore.tune_study`): a
trial cut off by Ctrl-C (the reliability tests' :class:`~interrupting.Interrupt`), with or
without pruning, stays running in the study; the same search again resumes it from its
checkpoint with the parameters it was given (not a new trial, not retrained from round 0),
keeps every finished trial's folder as it was, and proposes, prunes and ends exactly as an
uninterrupted search: the same trials, values and best, and the same ``best.json``."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from interrupting import Interrupt, folder_bytes

from fedlore import progress
from fedlore.config import apply_overrides, validate
from fedlore.tune import Search, plan_search
from fedlore.tune_study import Outcome, run_search

TINY = [
    "name=tiny",
    "rounds=3",
    "num_clients=3",
    "local_steps=5",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "partition.min_size=10",
    "progress=false",
    "algorithms=[fedavg]",
    "seeds=[1]",
    "data.selection_fraction=0.2",
    "threads=1",
    "device=cpu",
]
SEARCHES = {
    "tpe": ("{lr: 'log:1e-3:0.3', local_steps: 'int:1:6'}", ["tune.trials=3", "tune.seed=4"]),
    "pruned grid": (
        "{lr: 'cat:0.3,1e-5,2e-5'}",
        [
            "tune.sampler=grid",
            "tune.seed=1",
            "tune.trials=3",
            "tune.prune=median",
            "tune.prune_startup_trials=1",
        ],
    ),
}


def plan(out: Path, name: str) -> Search:
    space, extra = SEARCHES[name]
    raw = apply_overrides({}, [*TINY, f"output_dir={out}", f"tune.space={space}", *extra])
    return plan_search(validate(raw), raw, "tiny.yaml")


def table(outcome: Outcome) -> list[tuple[int, str, dict[str, object], float | None, str]]:
    return [(r.number, r.state, r.params, r.value, r.note) for r in outcome.rows]


@pytest.mark.parametrize(("name", "cut"), [("tpe", 1), ("pruned grid", 0), ("pruned grid", 1)])
def test_a_search_cut_off_in_a_trial_continues_to_the_same_best(
    tmp_path: Path, name: str, cut: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cut``: the trial interrupted after its round 0 (of 3) was written, before the round was
    reported to the study (the window a kill can hit): the search's second trial; pruned, its
    first, which completes, or its second, which the pruner stops after that round: the
    resumed trial reports the round from its ``metrics.jsonl`` and is pruned without training
    another."""
    whole = run_search(plan(tmp_path / "whole", name))
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run_search(plan(out, name), callbacks=lambda n: [Interrupt(at=0)] if n == cut else [])
    folder = out / "tiny" / "tune"
    storage = f"sqlite:///{folder / 'study.db'}"
    study = optuna.load_study(study_name="tiny", storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * cut + ["RUNNING"]
    given = study.trials[cut].params
    run = folder / f"trial-{cut}" / "fedavg" / "seed-1"
    first_row = (run / "metrics.jsonl").read_text()
    assert len(first_row.splitlines()) == 1 and (run / "checkpoint.pt").is_file()
    finished = {n: folder_bytes(folder / f"trial-{n}") for n in range(cut)}
    progress.enable(False)  # as `fedlore tune` with progress: false
    capsys.readouterr()
    again = run_search(plan(out, name))
    assert f"fedlore: trial {cut} was cut off: resumed" in capsys.readouterr().err  # told
    assert table(again) == table(whole)  # the same trials, values and best
    assert again.best is not None and whole.best is not None
    assert again.best.number == whole.best.number
    best = json.loads((folder / "best.json").read_text())
    assert best == json.loads((tmp_path / "whole/tiny/tune/best.json").read_text())
    study = optuna.load_study(study_name="tiny", storage=storage)
    assert len(study.trials) == 3 and study.trials[cut].params == given  # resumed, not new
    assert (run / "metrics.jsonl").read_text().startswith(first_row)  # not retrained
    for n, files in finished.items():  # finished trials are kept as they were
        assert folder_bytes(folder / f"trial-{n}") == files
    for t, u in zip(study.trials, optuna.load_study(
        study_name="tiny", storage=f"sqlite:///{tmp_path / 'whole/tiny/tune/study.db'}"
    ).trials, strict=True):  # fmt: skip
        assert t.intermediate_values == u.intermediate_values  # no round reported twice
