"""The early-stopping rule (:mod:`fedlore.engine.early_stopping`) on metric sequences worked out
by hand: when it stops, which round is best, ``min_delta`` and ``mode``, rounds without the
metric, non-finite values, and the best state it keeps."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from fedlore.config import ConfigError, load_config
from fedlore.engine.early_stopping import EarlyStopping
from fedlore.results.summary import summarize
from fedlore.types import State


def _feed(
    values: Sequence[float | None], mode: str = "max", patience: int = 2, min_delta: float = 0.0
) -> EarlyStopping:
    """The rule after one evaluation per round (round i has ``values[i]``), as the loop feeds
    it: after a stop the loop runs no further round."""
    es = EarlyStopping("selection_accuracy", mode, patience, min_delta, restore_best=False)
    for rnd, v in enumerate(values):
        if es.stopped():
            break
        es.on_round_end(rnd, {"round": rnd, "selection_accuracy": v}, State())
    return es


def test_max_mode_stops_at_the_patience_th_evaluation_without_improvement() -> None:
    # best 0.5 (r0), 0.6 (r1); r2 ties 0.6: no improvement (wait 1); r3 0.55 (wait 2): stop
    es = _feed([0.5, 0.6, 0.6, 0.55, 0.7, 0.8])
    assert (es.stopped_round, es.best_round, es.best_value, es.wait) == (3, 1, 0.6, 2)


def test_an_improvement_resets_the_count() -> None:
    # r1 wait 1, r2 improves (best, wait 0), r3 wait 1, r4 wait 2: stop at 4, not at 2
    es = _feed([0.5, 0.4, 0.7, 0.6, 0.65, 0.9])
    assert (es.stopped_round, es.best_round, es.best_value) == (4, 2, 0.7)


@pytest.mark.parametrize(("patience", "stop"), [(1, 2), (2, 3), (3, 4), (4, 5), (5, None)])
def test_patience_counts_evaluations_in_a_row(patience: int, stop: int | None) -> None:
    # best at r1, then four evaluations without an improvement (r2..r5): patience p stops at
    # the p-th of them, round 1 + p; with 5 the run reaches its last round
    es = _feed([0.1, 0.5, 0.4, 0.3, 0.2, 0.45], patience=patience)
    assert es.stopped_round == stop
    assert es.best_round == 1


def test_runs_to_the_end_when_it_keeps_improving() -> None:
    es = _feed([0.1, 0.2, 0.3, 0.4], patience=1)
    assert (es.stopped_round, es.best_round, es.wait) == (None, 3, 0)


def test_min_mode_prefers_smaller_values() -> None:
    seq = [1.0, 0.9, 0.95, 0.92, 0.8]
    low = _feed(seq, mode="min")  # r1 best; r2, r3 worse: stop at 3
    assert (low.stopped_round, low.best_round, low.best_value) == (3, 1, 0.9)
    high = _feed(seq, mode="max")  # r0 best; r1, r2 worse: stop at 2
    assert (high.stopped_round, high.best_round, high.best_value) == (2, 0, 1.0)


def test_min_delta_is_a_strict_margin_on_the_best() -> None:
    # min_delta 0.25 (exact in binary): 0.75 = 0.5 + 0.25 is no improvement, 0.875 is
    es = _feed([0.5, 0.75, 0.875, 0.9, 1.0], min_delta=0.25)
    # r1 wait 1; r2 0.875 > 0.75: best (r2), wait 0; r3 0.9 (wait 1); r4 1.0 <= 1.125 (wait 2)
    assert (es.stopped_round, es.best_round, es.best_value) == (4, 2, 0.875)
    # measured from the best, not from the last value: 0.6, 0.7, 0.8 each beat the one before
    # by 0.1 but the best (0.5) by more than 0.25 only at 0.8
    creep = _feed([0.5, 0.6, 0.7, 0.8], min_delta=0.25, patience=3)
    assert (creep.stopped_round, creep.best_round) == (None, 3)


def test_min_delta_in_min_mode() -> None:
    es = _feed([1.0, 0.75, 0.5, 0.45, 0.3], mode="min", min_delta=0.25)
    # r1 0.75 = 1.0 - 0.25: no (wait 1); r2 0.5 < 0.75: best; r3 wait 1; r4 0.3 > 0.25: wait 2
    assert (es.stopped_round, es.best_round, es.best_value) == (4, 2, 0.5)
    # exact binary values on the margin: r1 0.75 (= 1 - 0.25) and r3 0.375 (= 0.625 - 0.25)
    # are no improvements, r2 0.625 and r4 0.25 are
    edge = _feed([1.0, 0.75, 0.625, 0.375, 0.25], mode="min", min_delta=0.25)
    assert (edge.stopped_round, edge.best_round, edge.best_value) == (None, 4, 0.25)


def test_a_tie_is_no_improvement_in_min_mode() -> None:
    es = _feed([1.0, 0.9, 0.9, 0.95, 0.5], mode="min")  # r2 ties: wait 1, r3 wait 2: stop
    assert (es.stopped_round, es.best_round, es.best_value) == (3, 1, 0.9)


def test_rounds_without_the_metric_and_non_finite_values() -> None:
    es = EarlyStopping("selection_loss", "min", 2, 0.0, restore_best=False)
    es.on_round_end(-1, {"round": -1}, State())  # a setup exchange
    es.on_round_end(0, {"round": 0}, State())  # not evaluated (eval.every)
    es.on_round_end(1, {"selection_loss": math.nan}, State())  # diverged: never a best
    assert es.best_round is None and es.wait == 1
    es.on_round_end(2, {"selection_loss": 2.0}, State())
    es.on_round_end(3, {"train_loss": 0.1}, State())
    es.on_round_end(4, {"selection_loss": None}, State())  # null in metrics.jsonl
    assert (es.best_round, es.wait, es.stopped_round) == (2, 1, None)
    es.on_round_end(5, {"selection_loss": math.inf}, State())
    assert (es.stopped_round, es.best_round) == (5, 2)


def test_restore_best_keeps_a_copy_later_rounds_cannot_change() -> None:
    es = EarlyStopping("selection_accuracy", "max", 2, 0.0, restore_best=True)
    w = torch.zeros(3)
    es.on_round_end(0, {"selection_accuracy": 0.5}, State({"model.w": w}, {"t": 1}))
    w += 1.0  # a method that updates its tensors in place
    es.on_round_end(1, {"selection_accuracy": 0.4}, State({"model.w": w}, {"t": 2}))
    assert es.best_state is not None
    assert torch.equal(es.best_state.arrays["model.w"], torch.zeros(3))
    assert es.best_state.values == {"t": 1}
    entry = es.checkpoint_entry()["early_stopping"]
    assert entry["best_state"]["arrays"]["model.w"].device.type == "cpu"
    again = EarlyStopping("selection_accuracy", "max", 2, 0.0, restore_best=True)
    again.restore({"early_stopping": entry})
    assert (again.best_round, again.best_value, again.wait) == (0, 0.5, 1)
    assert again.best_state is not None
    assert torch.equal(again.best_state.arrays["model.w"], torch.zeros(3))


@pytest.mark.parametrize(
    ("metric", "mode"),
    [
        ("selection_accuracy", "max"),
        ("selection_loss", "min"),
        ("selection_perplexity", "min"),
        ("selection_rmse", "min"),
        ("selection_f1_macro", "max"),
        ("selection_brier", "min"),
        ("client_accuracy_min", "max"),
        ("client_accuracy_std", "min"),
        ("train_loss", "min"),
        ("accuracy", "max"),
    ],
)
def test_mode_auto_knows_fedlores_scores(metric: str, mode: str) -> None:
    """``auto`` resolves each known score; an explicit mode agreeing with it is kept, and the
    opposite one is refused, naming the metric, its direction and the fix."""
    cfg = load_config(None, [f"early_stopping.metric={metric}"])
    assert cfg.early_stopping.direction() == mode
    explicit = load_config(None, [f"early_stopping.metric={metric}", f"early_stopping.mode={mode}"])
    assert explicit.early_stopping.direction() == mode
    other = "min" if mode == "max" else "max"
    how = "maximized" if mode == "max" else "minimized"
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"early_stopping.metric={metric}", f"early_stopping.mode={other}"])
    assert (
        f"early_stopping.mode={other} contradicts early_stopping.metric={metric}, which is "
        f"{how}" in str(e.value)
    )
    assert f"set early_stopping.mode=auto (or {mode})" in str(e.value)


def _rows(path: Path, accuracies: list[float | None]) -> Path:
    """A ``metrics.jsonl`` with one evaluated round per accuracy (None: the predictions were not
    finite, as a diverged model's)."""
    lines = []
    for rnd, acc in enumerate(accuracies):
        row = {
            "round": rnd, "accepted": 2, "train_loss": 1.0, "accuracy": acc,
            "loss": None if acc is None else 1.0 - acc, "selection_accuracy": acc,
            "bytes_up": 10, "bytes_down": 10, "optimizer_state_bytes": 0, "wall_s": 1.0,
        }  # fmt: skip
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_restore_best_judges_divergence_on_the_best_rounds_rows(tmp_path: Path) -> None:
    """A run that diverges after its best round: its result (the best round's model) did not
    diverge, so ``diverged`` moves to ``diverged_after_best`` and the final values stay."""
    rows = _rows(tmp_path / "metrics.jsonl", [0.5, 0.7, None, None])
    summary = summarize("fedfull", 0, rows)
    assert "diverged" in summary and summary["final_accuracy"] is None
    es = EarlyStopping("selection_accuracy", "max", 2, 0.0, restore_best=True)
    es.best_round, es.best_value, es.stopped_round = 1, 0.7, 3
    es.finish(summary, rows, ())
    assert summary["final_accuracy"] == 0.7 and summary["final_loss"] == pytest.approx(0.3)
    assert "diverged" not in summary
    assert "not finite" in summary["diverged_after_best"]
    # without restore_best the result is the last round's model, which diverged
    plain = summarize("fedfull", 0, rows)
    EarlyStopping("selection_accuracy", "max", 2, 0.0, restore_best=False).finish(plain, rows, ())
    assert "diverged" in plain and "diverged_after_best" not in plain


def test_restore_best_keeps_a_divergence_of_the_best_round_itself(tmp_path: Path) -> None:
    rows = _rows(tmp_path / "metrics.jsonl", [0.5, None, None])
    summary = summarize("fedfull", 0, rows)
    es = EarlyStopping("selection_accuracy", "max", 2, 0.0, restore_best=True)
    es.best_round, es.best_value = 1, 0.5  # as if the best round's predictions went non-finite
    es.finish(summary, rows, ())
    assert "diverged" in summary and "diverged_after_best" not in summary
