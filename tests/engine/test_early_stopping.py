"""Early stopping in real runs (:mod:`fedlore.engine.early_stopping`): the round a run stops at
(worked out from the configuration where it is forced, replayed from an uninterrupted run's rows
where it is not), the best round's model and evaluation under ``restore_best`` (the same as a run
of ``best_round + 1`` rounds), and a killed run resumed to the very same end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.config import Config, load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.checkpoint_io import load_tensors
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.results.report import report
from fedlore.trained import load_trained

SEED = 3
ROUNDS = 12
METHOD = "fedfull"
ES = [
    "early_stopping.metric=selection_accuracy",
    "early_stopping.patience=2",
    "early_stopping.restore_best=true",
]


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(
        None,
        [
            "name=es",
            "num_clients=3",
            f"rounds={ROUNDS}",
            "local_steps=3",
            "batch_size=16",
            "lr=1e-2",
            "model.kwargs={hidden: [32]}",
            "partition.min_size=10",
            "data.selection_fraction=0.2",
            "progress=false",
            f"algorithms=[{METHOD}]",
            f"output_dir={out}",
            *extra,
        ],
    )


def _rows(cfg: Config) -> list[dict[str, Any]]:
    path = run_dir(cfg, METHOD, SEED) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _untimed(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not (k.endswith("_s") or "_s_" in k)}


def _replay(values: list[float], patience: int, min_delta: float, mode: str) -> tuple[Any, int]:
    """(stopped round or None, best round) of the rule, written out independently."""
    best_round, best, wait = 0, values[0], 0
    for rnd, v in enumerate(values[1:], start=1):
        if (v > best + min_delta) if mode == "max" else (v < best - min_delta):
            best_round, best, wait = rnd, v, 0
            continue
        wait += 1
        if wait == patience:
            return rnd, best_round
    return None, best_round


_CACHE: dict[tuple[str, ...], tuple[dict[str, Any], Config]] = {}


def _run(factory: pytest.TempPathFactory, *extra: str) -> tuple[dict[str, Any], Config]:
    """An uninterrupted run (cached per config): its summary and config."""
    if extra not in _CACHE:
        cfg = _cfg(factory.mktemp("es"), *extra)
        summary = run_one(cfg, METHOD, SEED)
        assert summary is not None
        _CACHE[extra] = (summary, cfg)
    return _CACHE[extra]


@pytest.mark.parametrize(("every", "patience"), [(1, 1), (1, 3), (2, 2)])
def test_stops_after_patience_evaluations_when_nothing_can_improve(
    tmp_path: Path, every: int, patience: int
) -> None:
    # an accuracy cannot beat its first value by more than 1: the first evaluation (round
    # every - 1) is the best and the run stops at the patience-th evaluation after it, round
    # every * (patience + 1) - 1 (evaluations, not rounds, are counted)
    cfg = _cfg(
        tmp_path,
        "early_stopping.metric=selection_accuracy",
        f"early_stopping.patience={patience}",
        "early_stopping.min_delta=1.0",
        f"eval.every={every}",
    )
    summary = run_one(cfg, METHOD, SEED)
    assert summary is not None
    stop = every * (patience + 1) - 1
    assert summary["stopped_round"] == stop
    assert summary["best_round"] == every - 1
    assert summary["rounds"] == stop + 1 == len(_rows(cfg))
    assert summary["restored_best"] is False  # restore_best is off: final_* are the last round's
    assert summary["final_accuracy"] == _rows(cfg)[-1]["accuracy"]
    assert (run_dir(cfg, METHOD, SEED) / "summary.json").is_file()


@pytest.mark.parametrize(
    ("metric", "patience", "min_delta", "mode"),
    [("selection_accuracy", 2, 0.0, "max"), ("selection_accuracy", 3, 0.0, "max"),
     ("selection_loss", 1, 0.08, "min")],
)  # fmt: skip
def test_stops_where_the_rule_says_on_the_uninterrupted_runs_rows(
    tmp_path_factory: pytest.TempPathFactory,
    metric: str,
    patience: int,
    min_delta: float,
    mode: str,
) -> None:
    _, plain = _run(tmp_path_factory)  # no early stopping: every round's metric
    reference = _rows(plain)
    want_stop, want_best = _replay([r[metric] for r in reference], patience, min_delta, mode)
    assert want_stop is not None and want_stop < ROUNDS - 1  # the case is not vacuous
    es = [f"early_stopping.metric={metric}", f"early_stopping.patience={patience}",
          f"early_stopping.min_delta={min_delta}"]  # fmt: skip
    summary, cfg = _run(tmp_path_factory, *es)
    assert (summary["stopped_round"], summary["best_round"]) == (want_stop, want_best)
    assert summary[f"best_{metric}"] == reference[want_best][metric]
    got = _rows(cfg)  # early stopping changes nothing but where the run ends
    assert [_untimed(r) for r in got] == [_untimed(r) for r in reference[: want_stop + 1]]


def test_restore_best_reports_and_keeps_the_best_rounds_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    summary, cfg = _run(tmp_path_factory, *ES)
    best, stop = summary["best_round"], summary["stopped_round"]
    assert stop is not None and best < stop  # the best model is not the last one
    rows = _rows(cfg)
    assert summary["restored_best"] is True
    for key in ("accuracy", "loss", "ece", "selection_accuracy", "selection_loss"):
        assert summary[f"final_{key}"] == rows[best][key], key
    assert summary["final_accuracy"] != rows[-1]["accuracy"] or rows[-1] == rows[best]
    # the same model as a run of best + 1 rounds, which ends there
    short = _cfg(tmp_path_factory.mktemp("short"), f"rounds={best + 1}")
    twin = run_one(short, METHOD, SEED)
    assert twin is not None
    assert twin["final_accuracy"] == summary["final_accuracy"]
    assert twin["final_selection_loss"] == summary["final_selection_loss"]
    _, state, _ = Checkpointer.load(run_dir(short, METHOD, SEED) / "checkpoint.pt")
    kept = load_tensors(run_dir(cfg, METHOD, SEED) / "checkpoint.pt", torch.device("cpu"))
    best_state = kept["early_stopping"]["best_state"]
    assert best_state["arrays"].keys() == state.arrays.keys()
    for k, v in state.arrays.items():
        assert torch.equal(best_state["arrays"][k], v), k
    assert kept["round"] == stop  # the checkpoint's own state stays the last round's
    trained = load_trained(run_dir(cfg, METHOD, SEED))
    assert trained.round == best
    mine = load_trained(run_dir(short, METHOD, SEED))
    for (name, a), (_, b) in zip(
        trained.model.state_dict().items(), mine.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def _same_end(got: Config, want: Config, got_summary: dict[str, Any], want_summary: Any) -> None:
    assert _untimed(got_summary) == _untimed(want_summary)
    assert [_untimed(r) for r in _rows(got)] == [_untimed(r) for r in _rows(want)]
    a = load_tensors(run_dir(got, METHOD, SEED) / "checkpoint.pt", torch.device("cpu"))
    b = load_tensors(run_dir(want, METHOD, SEED) / "checkpoint.pt", torch.device("cpu"))
    ea, eb = a["early_stopping"], b["early_stopping"]
    assert {k: v for k, v in ea.items() if k != "best_state"} == {
        k: v for k, v in eb.items() if k != "best_state"
    }
    for k, v in eb["best_state"]["arrays"].items():
        assert torch.equal(ea["best_state"]["arrays"][k], v), k
    for k, v in b["server"]["arrays"].items():
        assert torch.equal(a["server"]["arrays"][k], v), k


@pytest.mark.parametrize("kill", ["before_best", "at_best", "before_stop"])
def test_a_killed_run_resumes_to_the_same_stop_and_best_model(
    tmp_path_factory: pytest.TempPathFactory, kill: str
) -> None:
    want_summary, want = _run(tmp_path_factory, *ES)
    best, stop = want_summary["best_round"], want_summary["stopped_round"]
    after = {"before_best": best - 1, "at_best": best, "before_stop": stop - 1}[kill]
    assert 0 <= after < stop
    cfg = _cfg(tmp_path_factory.mktemp("killed"), *ES)
    assert run_one(cfg, METHOD, SEED, stop_after=after) is None  # killed after round `after`
    got = run_one(cfg, METHOD, SEED, resume=True)
    assert got is not None
    _same_end(cfg, want, got, want_summary)


def test_a_run_that_stopped_before_its_summary_was_written_ends_alike(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    want_summary, want = _run(tmp_path_factory, *ES)
    stop = want_summary["stopped_round"]
    # a kill after the stopping round's checkpoint, before summary.json: nothing left to train
    cfg = _cfg(tmp_path_factory.mktemp("late"), *ES)
    shutil.copytree(run_dir(want, METHOD, SEED), run_dir(cfg, METHOD, SEED))
    (run_dir(cfg, METHOD, SEED) / "summary.json").unlink()
    got = run_one(cfg, METHOD, SEED, resume=True)
    assert got is not None and got["stopped_round"] == stop
    _same_end(cfg, want, got, want_summary)
    # stop_after past the stop: the run stopped on its own and is finished, not killed
    past = _cfg(tmp_path_factory.mktemp("past"), *ES)
    assert run_one(past, METHOD, SEED, stop_after=stop + 2) is not None


def test_report_shows_the_stop_and_the_best_round(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    summary, cfg = _run(tmp_path_factory, *ES)
    text = report(Path(cfg.output_dir) / cfg.name, write=False)
    assert "## Early stopping" in text
    line = next(x for x in text.splitlines() if x.startswith(f"| {METHOD} | {SEED} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:5] == [
        "selection_accuracy",
        str(summary["stopped_round"]),
        str(summary["best_round"]),
    ]
    assert cells[6] == str(summary["best_round"])  # final values of the best round
    _, plain = _run(tmp_path_factory)
    assert "Early stopping" not in report(Path(plain.output_dir) / plain.name, write=False)
