"""A summary.json the report cannot trust as it is: values of the wrong type
(:mod:`fedlore.results.typed`), and a summary or metrics file that is a symbolic link or a
special file (:func:`fedlore.results.folders.regular_file`): noted, derived around, never the
reason a run is dropped."""

from __future__ import annotations

import csv
import json
import os
import warnings
from pathlib import Path

import pytest
from test_report import rows_for, summ, write_run

from fedlore.results.report import report
from fedlore.results.store import IncompleteRunWarning, load_runs

EARLY = {"early_stopping": {"metric": "accuracy", "mode": "max", "patience": 1}}


def _said(caught: pytest.WarningsRecorder) -> str:
    return " | ".join(str(w.message) for w in caught if w.category is IncompleteRunWarning)


def test_values_of_the_wrong_type_are_derived_or_left_missing(tmp_path: Path) -> None:
    e = tmp_path / "exp"
    write_run(e, "fedavg", 1, rows_for([0.5, 0.8, 0.6], 1, 1), summ(0.6, 0.8, 1, 1, 1, 0.5))
    run = write_run(e, "fedavg", 2, rows_for([0.5, 0.9, 0.7], 1, 1), None)
    (run / "config.json").write_text(json.dumps(EARLY))
    bad = {
        **summ(0.7, 0.9, 1, 1, 1, 0.5),
        "method": "fedavg",
        "seed": "2",  # its folder's: the run is not taken for another's
        "final_accuracy": [0.7],
        "wall_s_per_round": "fast",
        "stopped_round": "a",
        "early_stopping_metric": "accuracy",
        "final_ece": "low",  # no row has it: left missing
        "rounds": 3,
    }
    (run / "summary.json").write_text(json.dumps(bad))
    with pytest.warns(IncompleteRunWarning) as caught:
        runs = load_runs(e)
    assert len(runs["fedavg"]) == 2  # no run dropped
    s = next(r for r in runs["fedavg"] if r.seed == 2).summary
    assert s["seed"] == 2 and s["final_accuracy"] == 0.7 and s["wall_s_per_round"] == 0.5
    assert s["stopped_round"] == 2  # the rule of config.json replayed: best 0.9, then worse
    assert "final_ece" not in s  # missing, as if never recorded
    said = _said(caught)
    assert f"{run / 'summary.json'}: values of the wrong type not trusted" in said
    assert 'stopped_round ("a", not an int or null: derived from metrics.jsonl and config' in said
    assert "final_accuracy ([0.7], not a number or null: derived from metrics.jsonl)" in said
    assert 'final_ece ("low", not a number or null: left missing)' in said
    assert 'seed ("2", not an int: derived from the folder\'s name)' in said
    with pytest.warns(IncompleteRunWarning):
        text = report(e)
    assert "[0.7]" not in text and "fast" not in text and "| 2 |" in text  # both seeds
    with (e / "report.csv").open() as f:
        cells = " ".join(" ".join(str(v) for v in row.values()) for row in csv.DictReader(f))
    assert "[0.7]" not in cells and "fast" not in cells and "low" not in cells


def test_a_summary_of_good_types_is_left_alone(tmp_path: Path) -> None:
    e = tmp_path / "exp"
    run = write_run(e, "fedavg", 1, rows_for([0.5, 0.8], 1, 1), summ(0.8, 0.8, 1, 1, 1, 0.5))
    summary = json.loads((run / "summary.json").read_text())
    summary.update(stopped_round=None, best_round=1, restored_best=False, eval_metrics=["brier"],
                   early_stopping_metric="accuracy", diverged_after_best="nan loss")  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note
        runs = load_runs(e)
    assert runs["fedavg"][0].summary == summary


@pytest.mark.parametrize("target", ["/proc/self/mem", "fifo", "missing"])
def test_a_summary_that_is_a_link_or_special_file_is_damaged_not_read(
    tmp_path: Path, target: str
) -> None:
    e = tmp_path / "exp"
    run = write_run(e, "fedavg", 1, rows_for([0.5, 0.9, 0.7], 1, 1), None)
    summary = run / "summary.json"
    if target == "fifo":
        os.mkfifo(summary)  # reading it would wait for a writer forever
        os.mkfifo(run / "config.json")
    else:
        summary.symlink_to(target if target != "missing" else tmp_path / "nowhere")
    with pytest.warns(IncompleteRunWarning) as caught:
        runs = load_runs(e)
    (record,) = runs["fedavg"]
    assert record.summary["derived"] is True and record.summary["final_accuracy"] == 0.7
    assert record.summary["unreadable_summary"] is True
    assert (
        f"{summary}: a symbolic link or special file, not a regular file, not read; deriving "
        "the run from its 3 metrics rows"
    ) in _said(caught)


def test_metrics_that_are_a_link_are_not_read(tmp_path: Path) -> None:
    e = tmp_path / "exp"
    run = write_run(e, "fedavg", 1, [], summ(0.7, 0.9, 1, 1, 1, 0.5))
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to("/proc/self/mem")
    with pytest.warns(IncompleteRunWarning) as caught:
        runs = load_runs(e)
    (record,) = runs["fedavg"]
    assert record.rows == [] and record.summary["final_accuracy"] == 0.7
    assert f"{run / 'metrics.jsonl'}: a symbolic link or special file" in _said(caught)


def test_a_wrongly_typed_count_without_rows_is_left_missing_not_a_failed_report(
    tmp_path: Path,
) -> None:
    e = tmp_path / "exp"
    run = write_run(e, "fedavg", 1, [], {**summ(0.7, 0.9, 1, 1, 1, 0.5), "rounds": "3"})
    summary = json.loads((run / "summary.json").read_text())
    summary.update(rounds="3", best_round=[1], early_stopping_metric="accuracy")
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.warns(IncompleteRunWarning) as caught:
        text = report(e)
    assert 'rounds ("3", not an int: left missing)' in _said(caught)
    assert "| fedavg |" in text


def test_null_and_nan_values_are_noted_and_told_apart_from_missing_ones(tmp_path: Path) -> None:
    """A null or NaN in a summary showed as "–", as a value the run never recorded, with no
    note (a newcomer's finding): now one note names each, NaN apart from null (a value that
    was not finite when last measured: a diverged run's), while a value the rows never recorded
    (a regression's accuracy, an ε without DP) stays as silent as a key the summary lacks."""
    e = tmp_path / "exp"
    run = write_run(e, "fedavg", 1, rows_for([0.5, 0.8], 1, 1), summ(0.8, 0.8, 1, 1, 1, 0.5))
    summary = json.loads((run / "summary.json").read_text())
    summary.update(final_accuracy=None, final_loss=float("nan"), bytes_up_total=float("inf"),
                   final_ece=None, local_accuracy=None, dp_epsilon=None, best_perplexity=None,
                   dp_audit_epsilon=float("inf"),  # an ε the report shows as ∞: no note
                   final_client_accuracy_min=float("-inf"))  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.warns(IncompleteRunWarning) as caught:
        text = report(e)
    said = _said(caught)
    assert f"{run / 'summary.json'}: values that are not finite numbers" in said
    assert "final_accuracy (null: not finite)" in said
    assert "final_loss (NaN)" in said and "bytes_up_total (Infinity)" in said
    assert "final_client_accuracy_min (-Infinity)" in said
    for silent in ("final_ece", "local_accuracy", "dp_epsilon", "dp_audit_epsilon", "best_"):
        assert silent not in said
    assert "| fedavg | 1 | – | 80.00 |" in text  # the table's format is as before
    bare = write_run(e, "fedprox", 1, [], {**summ(0.8, 0.8, 1, 1, 1, 0.5), "final_loss": None})
    with pytest.warns(IncompleteRunWarning) as caught:
        load_runs(e)
    assert f"{bare / 'summary.json'}: values that are not finite numbers" in _said(caught)
