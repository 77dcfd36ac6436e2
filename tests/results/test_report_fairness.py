"""The report's fairness columns (``eval.clients``): the worst client's accuracy, the 10th
percentile over the clients and their spread, for every method whose runs recorded them (q-FFL's
case for existing, FedAvg's as its baseline), "–" for a method whose runs did not."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from fedlore.config import load_config
from fedlore.experiment import run_experiment
from fedlore.results.markdown import to_markdown
from fedlore.results.report import report
from fedlore.results.store import load_runs
from fedlore.results.tables import summary_table

HEADER = ["worst client (%)", "client p10 (%)", "client spread (pts)"]


def write_run(exp: Path, method: str, seed: int, summary: dict[str, Any]) -> None:
    run = exp / method / f"seed-{seed}"
    run.mkdir(parents=True)
    row = {"round": 0, "accuracy": summary["final_accuracy"], "bytes_up": 1e6, "bytes_down": 1e6}
    (run / "metrics.jsonl").write_text(json.dumps({**row, "wall_s": 1.0}) + "\n")
    (run / "summary.json").write_text(
        json.dumps(
            {
                "method": method,
                "seed": seed,
                "rounds": 1,
                "best_accuracy": summary["final_accuracy"],
                "bytes_up_total": 1e6,
                "bytes_down_total": 1e6,
                "optimizer_state_bytes": 0,
                "wall_s_per_round": 1.0,
                **summary,
            }
        )
    )


def fair(acc: float, worst: float, p10: float, std: float) -> dict[str, float]:
    return {
        "final_accuracy": acc,
        "final_client_accuracy": acc,
        "final_client_accuracy_min": worst,
        "final_client_accuracy_p10": p10,
        "final_client_accuracy_std": std,
    }


@pytest.fixture
def exp(tmp_path: Path) -> Path:
    """q-FFL with the fairness figures over two seeds; FedAvg from an older fedlore, with only
    the pooled G-local accuracy."""
    e = tmp_path / "runs" / "fairness"
    write_run(e, "qffl", 1, fair(0.80, 0.40, 0.50, 0.10))
    write_run(e, "qffl", 2, fair(0.82, 0.50, 0.60, 0.20))
    for seed in (1, 2):
        write_run(e, "fedavg", seed, {"final_accuracy": 0.85, "final_client_accuracy": 0.85})
    return e


def cells(md: str, method: str) -> dict[str, str]:
    lines = [line for line in md.splitlines() if line.startswith("|")]  # the first table
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        row = [c.strip() for c in line.strip("|").split("|")]
        if row[0] == method:
            return dict(zip(header, row, strict=True))
    raise AssertionError(f"no row {method} in\n{md}")


def test_the_fairness_figures_are_columns_and_missing_ones_a_dash(exp: Path) -> None:
    table = summary_table(load_runs(exp))
    qffl = next(r for r in table if r["method"] == "qffl")
    # each figure in percent, mean ± sample std over the seeds (worst: 40 and 50)
    assert qffl["client_worst_pct_mean"] == pytest.approx(45.0)
    assert qffl["client_worst_pct_std"] == pytest.approx(7.0711, abs=1e-4)
    assert qffl["client_p10_pct_mean"] == pytest.approx(55.0)
    assert qffl["client_spread_pct_mean"] == pytest.approx(15.0)
    md = to_markdown(table)
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    at = header.index("G-local acc. (%)")
    assert header[at + 1 : at + 4] == HEADER  # beside the pooled G-local accuracy
    row = cells(md, "qffl")
    assert [row[h] for h in HEADER] == ["45.00 ± 7.07", "55.00 ± 7.07", "15.00 ± 7.07"]
    assert [cells(md, "fedavg")[h] for h in HEADER] == ["–", "–", "–"]


def test_no_fairness_columns_without_the_figures(exp: Path) -> None:
    (exp / "qffl").rename(exp.parent / "elsewhere")
    md = to_markdown(summary_table(load_runs(exp)))
    assert "G-local acc. (%)" in md and not any(h in md for h in HEADER)
    text = report(exp, write=False)
    assert "Worst client, client p10" not in text


def test_one_seed_without_the_figures_is_counted(exp: Path) -> None:
    """A seed of an older fedlore beside one with the figures: the cell says over how many."""
    write_run(exp, "qffl", 3, {"final_accuracy": 0.8, "final_client_accuracy": 0.8})
    row = cells(to_markdown(summary_table(load_runs(exp))), "qffl")
    assert row["worst client (%)"] == "45.00 ± 7.07 (2 of 3 seeds)"


def test_report_csv_and_page_carry_the_figures(exp: Path) -> None:
    text = report(exp)
    assert "Worst client, client p10 and client spread (eval.clients)" in text
    with (exp / "report.csv").open() as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert float(rows["qffl"]["client_worst_pct_mean"]) == pytest.approx(45.0)
    assert float(rows["qffl"]["client_p10_pct_std"]) == pytest.approx(7.0711, abs=1e-4)
    assert float(rows["qffl"]["client_spread_pct_mean"]) == pytest.approx(15.0)
    assert rows["fedavg"]["client_worst_pct_mean"] == ""


def test_fedavg_and_qffl_both_record_them_under_eval_clients(tmp_path: Path) -> None:
    """The figures come from the evaluation, not from the method: a real run of each method
    with ``eval.clients`` fills every column, consistent with the clients it measured."""
    cfg = load_config(
        None,
        [
            "num_clients=4",
            "rounds=2",
            "local_steps=2",
            "batch_size=16",
            "model.kwargs={hidden: [16]}",
            "seeds=[5]",
            "progress=false",
            "eval.clients=true",
            "algorithms=[fedavg, qffl]",
            f"output_dir={tmp_path}",
        ],
    )
    run_experiment(cfg)
    exp = tmp_path / "experiment"
    md = report(exp, write=False)
    for method in ("fedavg", "qffl"):
        summary = json.loads((exp / method / "seed-5" / "summary.json").read_text())
        worst, p10 = summary["final_client_accuracy_min"], summary["final_client_accuracy_p10"]
        assert worst <= p10 <= summary["final_client_accuracy_mean"]
        row = cells(md, method)
        assert row["worst client (%)"] == f"{100 * worst:.2f}"
        assert row["client p10 (%)"] == f"{100 * p10:.2f}"
        assert row["client spread (pts)"] == f"{100 * summary['final_client_accuracy_std']:.2f}"
