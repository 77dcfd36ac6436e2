"""``fedlore report`` on folders of another tool: a ``summary.json`` that holds none of the keys
fedlore writes (``{"acc": 0.9}``) is not a fedlore run. It is left out with a note beside fedlore
runs; a folder that holds no fedlore run at all is refused in one line naming it, and nothing is
written in it."""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import pytest
from test_report import rows_for, summ, write_run

from fedlore.cli import main
from fedlore.results.report import report
from fedlore.results.store import IncompleteRunWarning, NoFedloreRunError, load_runs
from fedlore.results.typed import written_by_fedlore

ROOT = Path(__file__).parents[2]


def _foreign(exp: Path, method: str = "algo", seed: int = 1, rows: bool = False) -> Path:
    run = exp / method / f"seed-{seed}"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"acc": 0.9}))
    if rows:
        (run / "metrics.jsonl").write_text(json.dumps({"round": 0, "acc": 0.9}) + "\n")
    return run


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_the_folder_of_another_tool_is_refused_in_one_line_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newcomer's finding: ``other/algo/seed-1/summary.json`` holding ``{"acc": 0.9}`` gave
    report.md and report.csv with a row of dashes, and exit 0."""
    other = tmp_path / "other"
    _foreign(other, rows=True)
    before = _files(other)
    assert main(["report", str(other)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"fedlore: error: report: {other} holds no fedlore run")
    assert str(other / "algo" / "seed-1" / "summary.json") in lines[0]
    assert captured.out == ""
    assert _files(other) == before  # no report.md, report.csv or plot
    # the output folder above it likewise (one line naming it)
    assert main(["report", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{tmp_path} holds no fedlore run" in lines[0]
    assert "(other)" in lines[0]
    assert _files(other) == before
    with pytest.raises(NoFedloreRunError):
        load_runs(other)


def test_a_run_folder_of_another_tool_beside_fedlore_runs_is_left_out_with_a_note(
    tmp_path: Path,
) -> None:
    exp = tmp_path / "exp"
    write_run(exp, "fedavg", 0, rows_for([0.5, 0.6], 1, 1), summ(0.6, 0.6, 2, 2, 500, 0.5))
    _foreign(exp, "algo", 1)
    _foreign(exp, "fedavg", 1, rows=True)  # a fedlore method's folder, a summary not fedlore's
    with pytest.warns(IncompleteRunWarning) as caught:
        runs = load_runs(exp)
    assert list(runs) == ["fedavg"] and [r.seed for r in runs["fedavg"]] == [0]
    notes = [str(w.message) for w in caught]
    algo, own = (str(exp / m / "seed-1" / "summary.json") for m in ("algo", "fedavg"))
    assert any(n.startswith(f"{algo}: not a fedlore run, left out") and "(acc)" in n
               and "metrics rows" not in n for n in notes)  # fmt: skip
    assert any(n.startswith(f"{own}: not a fedlore run") and "derive the run from its metrics "
               "rows" in n for n in notes)  # fmt: skip
    with pytest.warns(IncompleteRunWarning, match="not a fedlore run"):
        text = report(exp)
    assert "algo" not in text and "fedavg" in text


def test_another_tools_experiment_below_an_output_folder_is_left_out(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    write_run(out / "mine", "fedavg", 0, rows_for([0.5], 1, 1), summ(0.5, 0.5, 1, 1, 500, 0.5))
    _foreign(out / "theirs")
    before = _files(out / "theirs")
    with pytest.warns(IncompleteRunWarning, match=r"theirs: not a fedlore experiment, left out"):
        text = report(out)
    assert "# mine" in text and "# theirs" not in text
    assert (out / "mine" / "report.md").is_file()
    assert _files(out / "theirs") == before


@pytest.mark.parametrize(
    "summary",
    [
        {"method": "fedavg"},
        {"seed": 0},
        {"final_accuracy": 0.9},
        {"rounds": 3, "acc": 0.9},
        {"dp_mode": "central"},
        {"diverged": "train_loss"},
    ],
)
def test_a_summary_with_one_key_fedlore_writes_is_a_fedlore_runs(
    tmp_path: Path, summary: dict[str, object]
) -> None:
    """Kept (as before): the damage of a fedlore summary is said by the other notes."""
    run = tmp_path / "exp" / "fedavg" / "seed-0"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(summary))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert list(load_runs(tmp_path / "exp")) == ["fedavg"]


def _tracked_summaries() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*/seed-*/summary.json"], cwd=ROOT, capture_output=True, text=True
    )
    return [ROOT / p for p in out.stdout.split()]


def test_every_key_of_a_fedlore_summary_is_one_fedlore_writes() -> None:
    """Each key of every run summary kept in the repository (experiments/runs), and those of
    the DP mechanism, its audit, early stopping, Flower and the divergence mark, alone marks a
    summary as fedlore's; another tool's keys do not."""
    keys = {k for p in _tracked_summaries() for k in json.loads(p.read_text())}
    assert len(keys) > 20
    keys |= {
        "dp_noise_multiplier", "dp_clip_norm", "dp_clip_norm_final", "dp_adjacency",
        "dp_noise_source", "dp_accountant", "dp_mode", "dp_repeated_exchanges", "privacy",
        "dp_audit_canaries", "dp_epsilon", "dp_epsilon_sample_known", "early_stopping_metric",
        "stopped_round", "best_round", "best_selection_loss", "restored_best",
        "early_stopping_on_test", "early_stopping_derived", "diverged_after_best",
        "client_num_examples", "wire_bytes_up_total", "peak_memory_bytes", "eval_metrics",
        "final_f1", "data_test_split", "derived", "local_rmse",
    }  # fmt: skip
    assert [k for k in sorted(keys) if not written_by_fedlore(k)] == []
    assert not any(written_by_fedlore(k) for k in ("acc", "accuracy", "loss", "epoch", "step"))


def test_an_empty_or_torn_summary_is_a_damaged_fedlore_run_not_another_tools(
    tmp_path: Path,
) -> None:
    """``{}`` and a cut-short summary hold no key either: they are a fedlore run's damage, said
    as before (``{}`` without a config.json left out as incomplete, a torn one derived from its
    rows), never "not a fedlore run"."""
    exp = tmp_path / "exp"
    for seed, text in ((0, "{}"), (1, '{"method": "fedavg", "se')):
        run = write_run(exp, "fedavg", seed, rows_for([0.5], 1, 1), None)
        (run / "summary.json").write_text(text)
    with pytest.warns(IncompleteRunWarning) as caught:
        runs = load_runs(exp)
    assert [r.seed for r in runs["fedavg"]] == [1]
    notes = [str(w.message) for w in caught]
    assert any("seed-0: an incomplete run, left out" in n for n in notes)
    assert not any("not a fedlore run" in n for n in notes)
    alone = tmp_path / "alone" / "fedavg" / "seed-0"
    alone.mkdir(parents=True)
    (alone / "summary.json").write_text("{}")
    with (
        pytest.warns(IncompleteRunWarning, match="holds no summary"),
        pytest.raises(FileNotFoundError, match="no runs found") as refused,
    ):
        load_runs(tmp_path / "alone")
    assert not isinstance(refused.value, NoFedloreRunError)
