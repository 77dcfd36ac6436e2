"""Report: mean ± std over seeds with hand-checkable numbers, CSV, plots, fallbacks, errors."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from fedlore.results.markdown import to_markdown
from fedlore.results.plots import plot
from fedlore.results.report import report, to_csv
from fedlore.results.store import IncompleteRunWarning, load_runs
from fedlore.results.tables import COLUMNS, summary_table

SQRT2 = math.sqrt(2.0)


def write_run(
    exp: Path, method: str, seed: int, rows: list[dict[str, Any]], summary: dict[str, Any] | None
) -> Path:
    run = exp / method / f"seed-{seed}"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:  # as a finished run's: it counts the rounds its rows hold
        rounds = {"rounds": len(rows)} if rows and "rounds" in summary else {}
        (run / "summary.json").write_text(
            json.dumps({"method": method, "seed": seed, **summary, **rounds})
        )
    return run


def rows_for(accs: list[float | None], up: float, down: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for t, a in enumerate(accs):
        row: dict[str, Any] = {
            "round": t,
            "loss": 1.0 / (t + 1),
            "bytes_up": up,
            "bytes_down": down,
            "optimizer_state_bytes": 500,
            "wall_s": 0.5,
            "retained_energy": 0.1 * t,
        }
        if a is not None:
            row["accuracy"] = a
        rows.append(row)
    return rows


def summ(final: float, best: float, up: float, down: float, opt: float, wall: float) -> dict:
    return {
        "final_accuracy": final,
        "best_accuracy": best,
        "bytes_up_total": up,
        "bytes_down_total": down,
        "optimizer_state_bytes": opt,
        "wall_s_per_round": wall,
        "rounds": 3,
    }


@pytest.fixture
def exp(tmp_path: Path) -> Path:
    """2 methods x 2 seeds with known summaries."""
    e = tmp_path / "runs" / "quick"
    write_run(
        e, "fedavg", 1, rows_for([0.5, None, 0.8], 1e6, 2e6), summ(0.80, 0.82, 2e6, 4e6, 1000, 1.0)
    )
    write_run(
        e, "fedavg", 2, rows_for([0.6, 0.7, 0.84], 2e6, 3e6), summ(0.84, 0.86, 4e6, 6e6, 3000, 3.0)
    )
    write_run(
        e, "fedlore", 1, rows_for([0.4, 0.6, 0.9], 1e5, 1e5), summ(0.90, 0.90, 3e5, 3e5, 2e6, 0.5)
    )
    write_run(
        e, "fedlore", 2, rows_for([0.5, 0.7, 0.9], 1e5, 1e5), summ(0.90, 0.91, 3e5, 3e5, 2e6, 0.5)
    )
    return e


def test_summary_table_mean_and_sample_std(exp: Path) -> None:
    runs = load_runs(exp)
    assert list(runs) == ["fedavg", "fedlore"]
    assert [r.seed for r in runs["fedavg"]] == [1, 2]
    assert [r["round"] for r in runs["fedavg"][0].rows] == [0, 1, 2]
    fedavg, fedlore = summary_table(runs)
    assert fedavg["method"] == "fedavg" and fedavg["n_seeds"] == 2
    # final: 80 and 84 % -> mean 82, sample std sqrt(((80-82)^2 + (84-82)^2) / 1) = 2 sqrt 2.
    assert fedavg["final_accuracy_pct_mean"] == pytest.approx(82.0)
    assert fedavg["final_accuracy_pct_std"] == pytest.approx(2 * SQRT2)
    assert fedavg["best_accuracy_pct_mean"] == pytest.approx(84.0)
    assert fedavg["best_accuracy_pct_std"] == pytest.approx(2 * SQRT2)
    assert fedavg["mb_up_mean"] == pytest.approx(3.0)
    assert fedavg["mb_down_mean"] == pytest.approx(5.0)
    assert fedavg["optimizer_state_bytes_mean"] == pytest.approx(2000.0)
    assert fedavg["wall_s_per_round_mean"] == pytest.approx(2.0)
    assert fedavg["wall_s_per_round_std"] == pytest.approx(SQRT2)
    assert fedlore["final_accuracy_pct_std"] == 0.0
    assert fedlore["best_accuracy_pct_mean"] == pytest.approx(90.5)
    assert fedlore["best_accuracy_pct_std"] == pytest.approx(0.5 * SQRT2)
    assert fedlore["mb_up_mean"] == pytest.approx(0.3)


def test_single_seed_std_is_zero(tmp_path: Path) -> None:
    write_run(tmp_path, "a", 7, rows_for([0.3], 10, 10), summ(0.3, 0.3, 10, 10, 8, 0.2))
    (row,) = summary_table(load_runs(tmp_path))
    assert row["n_seeds"] == 1
    assert row["final_accuracy_pct_mean"] == pytest.approx(30.0)
    assert row["final_accuracy_pct_std"] == 0.0 and row["wall_s_per_round_std"] == 0.0


def test_markdown_and_csv(exp: Path, tmp_path: Path) -> None:
    table = summary_table(load_runs(exp))
    md = to_markdown(table)
    assert "| fedavg | 2 | 82.00 ± 2.83 | 84.00 ± 2.83 | 3.00 | 5.00 | 2.00 KB |" in md
    assert "| fedlore | 2 | 90.00 ± 0.00 | 90.50 ± 0.71 | 0.3 | 0.3 | 2.00 MB |" in md
    out = tmp_path / "t.csv"
    to_csv(table, out)
    with out.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert [r["method"] for r in rows] == ["fedavg", "fedlore"]
    assert float(rows[0]["final_accuracy_pct_std"]) == pytest.approx(2 * SQRT2)
    assert float(rows[0]["mb_down_mean"]) == pytest.approx(5.0)


def test_plots_written(exp: Path, tmp_path: Path) -> None:
    out = tmp_path / "plots"
    paths = plot(load_runs(exp), out, keys=["retained_energy"])
    names = sorted(p.name for p in paths)
    assert names == [
        "accuracy_vs_bytes.png",
        "accuracy_vs_round.png",
        "retained_energy_vs_round.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    with pytest.raises(ValueError, match="'nope'"):
        plot(load_runs(exp), out, keys=["nope"])


def test_missing_summary_is_derived_with_warning(tmp_path: Path) -> None:
    run = write_run(tmp_path, "m", 3, rows_for([0.5, 0.9, None, 0.7], 100, 200), None)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"round": 4, "accur')  # a run killed mid-write
    with pytest.warns(IncompleteRunWarning) as caught:
        runs = load_runs(tmp_path)
    messages = " ".join(str(w.message) for w in caught)
    assert "no summary.json" in messages and "unreadable line" in messages
    (record,) = runs["m"]
    s = record.summary
    assert s["derived"] is True and s["method"] == "m" and s["seed"] == 3
    assert s["final_accuracy"] == 0.7 and s["best_accuracy"] == 0.9 and s["rounds"] == 4
    assert s["bytes_up_total"] == 400 and s["bytes_down_total"] == 800
    assert s["optimizer_state_bytes"] == 500 and s["wall_s_per_round"] == 0.5


def test_bytes_that_are_not_utf8_are_a_damaged_file_not_a_failed_report(tmp_path: Path) -> None:
    """A summary.json or metrics line of raw bytes (a disk error, a binary copied over it) is
    unreadable like torn JSON: the run is derived from its rows, the bad line skipped; before,
    one such file ended the whole report with a UnicodeDecodeError naming no file."""
    run = write_run(tmp_path, "m", 3, rows_for([0.5, 0.9, 0.7], 100, 200), None)
    (run / "summary.json").write_bytes(b"\xff\xfe\x00garbage")
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(b"\xff\xfe not utf-8\n")
    with pytest.warns(IncompleteRunWarning) as caught:
        runs = load_runs(tmp_path)
    messages = " ".join(str(w.message) for w in caught)
    assert f"{run / 'summary.json'}: unreadable" in messages
    assert "metrics.jsonl:4: skipping unreadable line" in messages
    (record,) = runs["m"]
    assert record.summary["derived"] is True and record.summary["final_accuracy"] == 0.7


def test_empty_run_dir_is_skipped(exp: Path) -> None:
    (exp / "fedavg" / "seed-9").mkdir()
    (exp / "fedavg" / "notes").mkdir()  # not a seed directory: ignored silently
    with pytest.warns(IncompleteRunWarning, match="skipping the run"):
        runs = load_runs(exp)
    assert [r.seed for r in runs["fedavg"]] == [1, 2]


def test_nothing_found_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no runs found"):
        load_runs(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_runs(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no runs found"):
        report(tmp_path)


def test_a_method_or_run_folder_points_at_its_experiment(exp: Path) -> None:
    """`fedlore report runs/quick/fedavg` (one level too deep) names the folder to report."""
    for folder, kind in ((exp / "fedavg", "a method's"), (exp / "fedavg" / "seed-1", "a run's")):
        with pytest.raises(FileNotFoundError) as e:
            report(folder)
        assert str(e.value).endswith(f"it is {kind} folder: report its experiment, "
                                     f"`fedlore report {exp}`")  # fmt: skip


def test_report_experiment_and_output_dir(exp: Path) -> None:
    text = report(exp)
    assert text.startswith("# quick\n") and "82.00 ± 2.83" in text
    for name in ["report.md", "report.csv", "accuracy_vs_round.png", "accuracy_vs_bytes.png"]:
        assert (exp / name).stat().st_size > 0
    assert (exp / "report.md").read_text() == text
    other = exp.parent / "other"
    write_run(other, "fedfull", 0, rows_for([0.1, 0.2], 5, 5), summ(0.2, 0.2, 10, 10, 1, 1.0))
    both = report(exp.parent)
    assert both.index("# other") < both.index("# quick")  # name order
    assert (other / "report.csv").is_file() and (other / "accuracy_vs_bytes.png").is_file()


def test_calibration_local_and_client_time_columns(tmp_path: Path) -> None:
    e = tmp_path / "runs" / "bayes"
    extra = {
        "final_loss": 0.5,
        "final_ece": 0.04,
        "local_accuracy": 0.9,
        "final_client_accuracy": 0.75,
        "client_train_s_per_round": 0.25,
    }
    for seed, ece, train in ((1, 0.04, 0.25), (2, 0.08, 0.35)):
        write_run(
            e,
            "bayfl",
            seed,
            rows_for([0.7], 1e6, 1e6),
            {
                **summ(0.7, 0.7, 1e6, 1e6, 0, 1.0),
                **extra,
                "final_ece": ece,
                "client_train_s_per_round": train,
            },
        )
    (row,) = summary_table(load_runs(e))
    assert row["final_ece_mean"] == pytest.approx(0.06)
    assert row["local_accuracy_pct_mean"] == pytest.approx(90.0)
    assert row["client_accuracy_pct_mean"] == pytest.approx(75.0)
    md = to_markdown([row])
    header = md.splitlines()[0]
    assert "NLL" in header and "ECE" in header and "P-local acc. (%)" in header
    # global (G-local) and personal (P-local) accuracy side by side
    assert header.index("G-local acc. (%)") < header.index("P-local acc. (%)")
    assert "75.00 ± 0.00 | 90.00 ± 0.00" in md
    assert "client train s / round" in header
    assert "0.060 ± 0.028" in md
    assert "| 0.300 ± 0.071 |" in md  # client seconds per round: mean ± std over the seeds
    assert row["client_train_s_per_round_std"] == pytest.approx(0.0707, abs=1e-4)


def test_a_method_keeps_its_colour_in_every_figure(tmp_path: Path) -> None:
    """fedavg has no retained_energy: fedlore must not take fedavg's colour in that figure."""
    from fedlore.results.plots import _curve_figure, by_round, method_colors

    e = tmp_path / "colours"
    rows = rows_for([0.5, 0.6], 10, 10)
    for r in rows:
        del r["retained_energy"]
    write_run(e, "fedavg", 1, rows, None)
    write_run(e, "fedlore", 1, rows_for([0.4, 0.7], 10, 10), None)
    with pytest.warns(IncompleteRunWarning):
        runs = load_runs(e)
    styles = method_colors(list(runs))

    def axis(key: str) -> Any:
        return lambda r: ({t: float(t) for t in by_round(r.rows, key)}, by_round(r.rows, key))

    acc = _curve_figure(runs, axis("accuracy"), "round", "accuracy", styles=styles)
    energy = _curve_figure(runs, axis("retained_energy"), "round", "energy", styles=styles)
    colour = {ln.get_label(): ln.get_color() for ln in acc.axes[0].get_lines()}
    assert colour["fedavg (n=1)"] != colour["fedlore (n=1)"]
    (only,) = energy.axes[0].get_lines()
    assert only.get_label() == "fedlore (n=1)" and only.get_color() == colour["fedlore (n=1)"]
    # config variants of one method share its colour and differ by line style
    v = method_colors(["fedlore [lr=0.1]", "fedavg", "fedlore [lr=0.01]"])
    assert v["fedlore [lr=0.1]"][0] == v["fedlore [lr=0.01]"][0] != v["fedavg"][0]
    assert v["fedlore [lr=0.1]"][1] != v["fedlore [lr=0.01]"][1]
    # a method keeps its colour from report to report, whatever else the report holds
    a = method_colors(["fedlore", "fedfull", "local_galore"])
    b = method_colors(["fedfull", "fedit", "fedlore", "custom_method", "another_one"])
    assert a["fedlore"] == b["fedlore"] and a["fedfull"] == b["fedfull"]
    assert len({c for c, _ in b.values()}) == len(b)  # and no two methods of one report share


def test_log_bytes_axis_has_plain_ticks_and_the_figure_a_title(tmp_path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from fedlore.results.plots import _curve_figure, by_round, cumulative_mb

    e = tmp_path / "ticks"
    write_run(e, "fedavg", 1, rows_for([0.5, 0.6, 0.7, 0.8], 3e5, 3e5), None)
    with pytest.warns(IncompleteRunWarning):
        runs = load_runs(e)
    fig = _curve_figure(
        runs,
        lambda r: (cumulative_mb(r.rows), by_round(r.rows, "accuracy")),
        "MB",
        "accuracy",
        logx=True,
        title="ticks: digits",
    )
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    labels = [t.get_text() for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]
    # 0.6 .. 2.4 MB lies within one decade: still labelled at 1 and 2, as plain numbers
    assert "1" in labels and "2" in labels
    assert all("10^" not in s and "$" not in s for s in labels)
    assert ax.get_title() == "ticks: digits"


def test_report_titles_name_the_experiment_and_setting(tmp_path: Path) -> None:
    from fedlore.config import load_config
    from fedlore.results.report import setting_title
    from fedlore.results.store import load_runs as load

    cfg = load_config(None, ["num_clients=7", "rounds=2", "partition.alpha=0.1"])
    e = tmp_path / "titled"
    for m in ("fedavg", "fedlore"):
        run = write_run(e, m, 1, rows_for([0.5, 0.6], 10, 10), summ(0.6, 0.6, 20, 20, 1, 1))
        (run / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    title = setting_title("titled", load(e))
    assert title == "titled: digits, dirichlet α=0.1, 7 clients, 2 rounds, mlp"


def test_a_held_out_test_set_is_stated_under_the_table(tmp_path: Path) -> None:
    e = tmp_path / "runs" / "own"
    held = "held out 20 % of train.npz (120 of 600 examples, stratified, seed 0): no test.npz"
    for seed in (1, 2):
        summary = {**summ(0.8, 0.8, 1e6, 1e6, 10, 1.0), "data_test_split": held}
        write_run(e, "fedavg", seed, rows_for([0.5, 0.8], 1e6, 1e6), summary)
    text = report(e)
    assert text.count(f"Test set: {held}.") == 1
    assert f"Test set: {held}." in (e / "report.md").read_text()
    assert "Test set:" not in report(_exp_without_note(tmp_path))


def _exp_without_note(tmp_path: Path) -> Path:
    e = tmp_path / "runs" / "plain"
    write_run(e, "fedavg", 1, rows_for([0.5, 0.8], 1e6, 1e6), summ(0.8, 0.8, 1e6, 1e6, 10, 1.0))
    return e


def test_report_module_keeps_the_names_it_used_to_define() -> None:
    """The statistics and the Markdown moved to results/tables.py and results/markdown.py;
    ``fedlore.results.report`` still exports them (one object, two import paths)."""
    from fedlore.results import markdown, report, tables

    for name in ("COLUMNS", "DIAGNOSTIC_KEYS", "summary_table", "diagnostics_table"):
        assert getattr(report, name) is getattr(tables, name)
    for name in ("to_markdown", "diagnostics_markdown", "seeds_cell"):
        assert getattr(report, name) is getattr(markdown, name)
    assert set(report.__all__) <= set(dir(report))


def test_seconds_per_round_leave_out_round_zeros_start_up(tmp_path: Path) -> None:
    """The first run of a process pays its start-up in round 0 (1.4 s against 0.01 s later on
    a small FedAvg): s / round is the mean over rounds 1, 2, ... (round 0 alone for a one-round
    run), in a finished run's summary and in one derived from its rows; the total keeps it."""
    from fedlore.results.summary import derive_summary, per_round_wall, summarize

    rows = [
        {"round": -1, "wall_s": 9.0, "bytes_up": 1, "bytes_down": 1, "optimizer_state_bytes": 0},
        *[
            {"round": r, "wall_s": w, "bytes_up": 1, "bytes_down": 1, "optimizer_state_bytes": 0}
            for r, w in enumerate([1.4, 0.01, 0.03])
        ],
    ]
    assert per_round_wall(rows) == pytest.approx(0.02)
    assert per_round_wall(rows[:2]) == pytest.approx(1.4)  # one round: itself
    assert per_round_wall([{"round": 0}]) is None
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = summarize("m", 0, path)
    assert done["wall_s_per_round"] == pytest.approx(0.02)
    assert done["wall_s_total"] == pytest.approx(9.0 + 1.4 + 0.04)
    assert derive_summary("m", 0, rows)["wall_s_per_round"] == pytest.approx(0.02)


def test_runs_split_by_what_they_trained_with_only(tmp_path: Path) -> None:
    """Runs are one group when their records differ only by a setting added to fedlore after
    the earlier one ran (missing: at its default) or by eval.metrics; a setting that changes
    training (lr) still splits them."""
    from fedlore.config import load_config
    from fedlore.results.store import split_by_config

    e = tmp_path / "grouped"
    base = load_config(None, []).model_dump(mode="json")
    older = {k: v for k, v in base.items() if k != "imports"}  # before `imports` existed
    scored = {**base, "eval": {**base["eval"], "metrics": ["brier"]}}
    faster = {**base, "lr": base["lr"] * 10}
    for seed, cfg in ((1, older), (2, base), (3, scored), (4, faster)):
        run = write_run(e, "fedavg", seed, rows_for([0.5], 1, 1), summ(0.5, 0.5, 1, 1, 1, 1))
        (run / "config.json").write_text(json.dumps(cfg))
    groups = split_by_config(load_runs(e))
    lr = base["lr"]
    assert {k: [r.seed for r in v] for k, v in groups.items()} == {
        f"fedavg [lr={lr}]": [1, 2, 3],
        f"fedavg [lr={lr * 10}]": [4],
    }


def test_methods_run_on_other_data_under_one_name_are_marked(tmp_path: Path) -> None:
    """Two commands under one ``name`` (fedavg on one data set, fedfull on another) gave rows
    labelled by method alone, side by side in the table as if comparable: every row is now
    marked by the shared settings that differ between the methods' runs; a method's own
    overrides (``method``) never mark a row, and a method split by its own lr marks the other
    method's row with the lr it ran at."""
    from fedlore.config import load_config
    from fedlore.results.store import split_by_config

    base = load_config(None, []).model_dump(mode="json")
    wine = {**base, "data": {**base["data"], "name": "npz", "root": "wine"}}

    def experiment(name: str, configs: dict[str, list[dict[str, Any]]]) -> Path:
        e = tmp_path / name
        for method, cfgs in configs.items():
            for seed, cfg in enumerate(cfgs, start=1):
                run = write_run(e, method, seed, rows_for([0.5], 1, 1), summ(0.5, 0.5, 1, 1, 1, 1))
                (run / "config.json").write_text(json.dumps(cfg))
        return e

    def labels(e: Path) -> dict[str, list[int]]:
        return {k: [r.seed for r in v] for k, v in split_by_config(load_runs(e)).items()}

    mixed = experiment("mixed", {"fedavg": [wine, wine], "fedfull": [base]})
    assert labels(mixed) == {
        "fedavg [data.name=npz, data.root=wine]": [1, 2],
        f"fedfull [data.name={base['data']['name']}, data.root={base['data']['root']}]": [1],
    }
    own = {**base, "method": {"local_optimizer": "adamw"}}  # one command, per-method overrides
    assert labels(experiment("one", {"fedavg": [own], "fedfull": [base]})) == {
        "fedavg": [1],
        "fedfull": [1],
    }
    faster = {**base, "lr": base["lr"] * 10}
    lr = base["lr"]
    assert labels(experiment("lrs", {"fedavg": [base, faster], "fedfull": [base]})) == {
        f"fedavg [lr={lr}]": [1],
        f"fedavg [lr={lr * 10}]": [2],
        f"fedfull [lr={lr}]": [1],
    }
    table = report(mixed, write=False)
    assert "| fedavg [data.name=npz, data.root=wine] |" in table, table


def _config_experiment(e: Path, configs: dict[str, list[dict[str, Any]]]) -> dict[str, list[int]]:
    """An experiment whose runs hold ``configs`` (per method, seeds 1, 2, ...), as
    ``split_by_config``'s labels -> seeds."""
    from fedlore.results.store import split_by_config

    for method, cfgs in configs.items():
        for seed, cfg in enumerate(cfgs, start=1):
            run = write_run(e, method, seed, rows_for([0.5], 1, 1), summ(0.5, 0.5, 1, 1, 1, 1))
            (run / "config.json").write_text(json.dumps(cfg))
    return {k: [r.seed for r in v] for k, v in split_by_config(load_runs(e)).items()}


def test_one_dp_command_is_not_marked_by_each_methods_sigma(tmp_path: Path) -> None:
    """One DP command with σ solved from dp.epsilon records each method's σ in its
    ``config.json`` (``dp_noise_multiplier``), solved over its own exchanges (fedlore_sketch's
    setup exchange among them): every row of that one command was marked
    ``[dp_noise_multiplier=...]`` as if of another experiment."""
    from fedlore.config import load_config

    base = load_config(None, ["dp.epsilon=5", "dp.clip_norm=1"]).model_dump(mode="json")
    sketch = {**base, "dp_noise_multiplier": 3.3, "dp_noise_source": "os"}
    full = {**base, "dp_noise_multiplier": 2.69, "dp_noise_source": "os"}
    got = _config_experiment(tmp_path / "dp", {"fedlore_sketch": [sketch], "fedfull": [full]})
    assert got == {"fedlore_sketch": [1], "fedfull": [1]}


def test_groups_of_one_method_never_share_a_label(tmp_path: Path) -> None:
    """Another command under one name that changed four settings marks every row by them; a
    method's groups told apart by a fifth (rounds, after them in sorted order) got one label
    ``fedavg [batch_size=..., data.name=..., data.root=..., local_steps=..., ...]``, and one
    group's runs silently replaced the other's in the report."""
    from fedlore.config import load_config

    base = load_config(None, []).model_dump(mode="json")
    wine = {**base["data"], "name": "npz", "root": "wine"}
    other = {**base, "batch_size": 7, "local_steps": 3, "data": wine}
    longer = {**base, "rounds": base["rounds"] + 5}
    got = _config_experiment(tmp_path / "x", {"fedavg": [base, longer], "fedfull": [other]})
    assert sorted(s for seeds in got.values() for s in seeds) == [1, 1, 2], got
    assert len([k for k in got if k.startswith("fedavg [")]) == 2, got
    assert all("rounds=" in k for k in got if k.startswith("fedavg [")), got


def scored_experiment(e: Path) -> Path:
    """fedavg over seeds 1-3 with eval.metrics brier (every seed) and f1_macro (seed 1 only);
    fedlore naming none."""
    for seed, brier, f1 in ((1, 0.2, 0.5), (2, 0.4, None), (3, 0.6, None)):
        extra = {"eval_metrics": ["brier", "f1_macro"], "final_brier": brier, "final_f1_macro": f1}
        write_run(e, "fedavg", seed, rows_for([0.5], 1, 1), {**summ(0.5, 0.5, 1, 1, 1, 1), **extra})
    write_run(e, "fedlore", 1, rows_for([0.5], 1, 1), summ(0.5, 0.5, 1, 1, 1, 1))
    return e


def test_evaluation_metrics_table_counts_the_seeds_behind_each_value(tmp_path: Path) -> None:
    e = scored_experiment(tmp_path / "scored")
    section = report(e, write=False).split("## Evaluation metrics")[1].splitlines()
    assert section[2] == "| method | brier | f1_macro |"
    assert section[4] == "| fedavg | 0.4000 ± 0.2000 | 0.5000 (1 of 3 seeds) |"
    assert section[5] == "| fedlore | – | – |"


def test_report_csv_has_the_evaluation_metrics_beside_the_summary(tmp_path: Path) -> None:
    e = scored_experiment(tmp_path / "scored")
    report(e)
    with (e / "report.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames is not None
        assert reader.fieldnames[: len(COLUMNS)] == COLUMNS
        assert reader.fieldnames[len(COLUMNS) :] == [
            f"final_{m}_{s}" for m in ("brier", "f1_macro") for s in ("mean", "std", "n")
        ]
        fedavg, fedlore = reader
    assert float(fedavg["final_brier_mean"]) == pytest.approx(0.4)
    assert float(fedavg["final_brier_std"]) == pytest.approx(0.2)
    assert fedavg["final_brier_n"] == "3"
    assert float(fedavg["final_f1_macro_mean"]) == pytest.approx(0.5)
    assert fedavg["final_f1_macro_std"] == "0.0" and fedavg["final_f1_macro_n"] == "1"
    assert fedlore["final_brier_mean"] == "" and fedlore["final_brier_n"] == "0"
    assert float(fedlore["final_accuracy_pct_mean"]) == pytest.approx(50.0)
    # no eval.metrics anywhere: the header is COLUMNS alone
    plain = tmp_path / "plain"
    write_run(plain, "fedavg", 1, rows_for([0.5], 1, 1), summ(0.5, 0.5, 1, 1, 1, 1))
    report(plain)
    with (plain / "report.csv").open() as f:
        assert csv.DictReader(f).fieldnames == COLUMNS


def test_a_diverged_runs_scores_are_left_out_its_costs_kept(tmp_path: Path) -> None:
    """A model that blew up can keep a finite accuracy (its NLL at 1e12): the seeds column says
    it diverged, and its scores stay out of the means while its bytes and seconds count."""
    e = tmp_path / "div"
    write_run(e, "fedavg", 1, rows_for([0.8], 1, 1), {**summ(0.8, 0.8, 2e6, 2e6, 1, 1.0)})
    blown = {**summ(0.3, 0.9, 4e6, 4e6, 1, 3.0), "final_loss": 1e12, "diverged": "blew up"}
    write_run(e, "fedavg", 2, rows_for([0.3], 1, 1), blown)
    (row,) = summary_table(load_runs(e))
    assert row["diverged_runs"] == 1
    assert row["final_accuracy_pct_mean"] == pytest.approx(80.0)
    assert row["best_accuracy_pct_mean"] == pytest.approx(80.0) and row["final_loss_mean"] is None
    assert row["mb_up_mean"] == pytest.approx(3.0) and row["wall_s_per_round_mean"] == 2.0


def test_a_summary_without_its_final_score_is_counted_not_hidden(tmp_path: Path) -> None:
    """A finished run whose summary.json lost its final_accuracy (edited, damaged) is left out
    of that column with a warning, and the cell says over how many seeds it is: not a mean of
    one seed with a spread of 0 under a seeds column of 2."""
    e = tmp_path / "exp"
    write_run(e, "fedavg", 1, rows_for([0.5, 0.8], 1, 1), summ(0.80, 0.80, 1, 1, 1, 1.0))
    damaged = summ(0.90, 0.90, 1, 1, 1, 1.0)
    del damaged["final_accuracy"]
    write_run(e, "fedavg", 2, rows_for([0.5, 0.9], 1, 1), damaged)
    with pytest.warns(IncompleteRunWarning, match="no final_accuracy number"):
        text = report(e)
    row = next(line for line in text.splitlines() if line.startswith("| fedavg"))
    assert "| 2 | 80.00 (1 of 2 seeds) | 85.00 ± 7.07 |" in row
    (e / "fedavg" / "seed-2" / "summary.json").write_text(
        json.dumps({"method": "fedavg", "seed": 2, **summ(0.90, 0.90, 1, 1, 1, 1.0), "rounds": 2})
    )
    row = next(line for line in report(e).splitlines() if line.startswith("| fedavg"))
    assert "| 2 | 85.00 ± 7.07 | 85.00 ± 7.07 |" in row


def test_a_summary_of_another_run_or_rows_it_lacks_are_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A summary that names another method (or seed) than its folder's was copied from that
    run's folder, and the metrics rows beside it most likely with it (nothing in them names a
    method): the run is left out with a warning, never shown as this method's (its rows used
    to make a derived row of the other method's numbers under this name); a finished run whose
    metrics.jsonl lost rows keeps its table row and is
    warned about (its curves are incomplete), also in `fedlore report`'s output."""
    from fedlore.cli import main

    e = tmp_path / "exp"
    write_run(e, "fedavg", 1, rows_for([0.5, 0.6], 1, 1), summ(0.6, 0.6, 2, 2, 1, 1.0))
    fedfull = write_run(e, "fedfull", 1, rows_for([0.5, 0.9], 1, 1), summ(0.9, 0.9, 2, 2, 1, 1.0))
    copied = fedfull / "summary.json"
    copied.write_text(copied.read_text().replace('"fedfull"', '"fedavg"'))
    with pytest.warns(IncompleteRunWarning, match="the summary of fedavg seed 1, not of fedfull"):
        runs = load_runs(e)
    assert "fedfull" not in runs and len(runs["fedavg"]) == 1
    copied.write_text(
        copied.read_text().replace('"fedavg"', '"fedfull"').replace('"seed": 1', '"seed": 2')
    )
    with pytest.warns(
        IncompleteRunWarning, match="the summary of fedfull seed 2, not of fedfull seed 1"
    ):
        load_runs(e)
    copied.write_text(copied.read_text().replace('"seed": 2', '"seed": 1'))
    rows = (fedfull / "metrics.jsonl").read_text().splitlines(keepends=True)
    (fedfull / "metrics.jsonl").write_text(rows[0])
    assert main(["report", str(e)]) == 0
    err = capsys.readouterr().err
    assert "rows of 1 of the 2 rounds its summary counts" in err and "curves" in err
    (fedfull / "metrics.jsonl").write_text("".join([*rows, rows[1]]))
    with pytest.warns(IncompleteRunWarning, match="a round twice among the 2 rounds"):
        load_runs(e)


def test_a_setup_round_is_no_row_a_finished_run_lacks_or_repeats(tmp_path: Path) -> None:
    """FedLore's setup exchange writes round -1 before rounds 0 .. R-1, and its summary counts R
    rounds: no warning (a check counting every row would call round -1 a repeat)."""
    e = tmp_path / "exp"
    rows = [{**rows_for([None], 1, 1)[0], "round": -1}, *rows_for([0.5, 0.7], 1, 1)]
    run = write_run(e, "fedlore", 1, rows, summ(0.7, 0.7, 3, 3, 1, 1.0))
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "rounds": 2}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", IncompleteRunWarning)
        load_runs(e)


def test_report_keeps_drawn_plots_when_there_is_nothing_to_draw(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Runs kept without their metrics rows (a published summary) leave the plots drawn
    earlier as they were, instead of replacing them with empty axes."""
    from fedlore.cli import main

    e = tmp_path / "exp"
    write_run(e, "fedavg", 1, rows_for([0.5, 0.8], 1, 1), summ(0.80, 0.80, 1, 1, 1, 1.0))
    report(e)
    drawn = (e / "accuracy_vs_round.png").read_bytes()
    (e / "fedavg" / "seed-1" / "metrics.jsonl").unlink()
    with pytest.warns(UserWarning) as caught:  # no rows, and so no plots
        text = report(e)
    said = [str(w.message) for w in caught]
    kept = "accuracy_vs_round.png and accuracy_vs_bytes.png not redrawn (the ones there are kept)"
    assert any(kept in m for m in said)
    assert (e / "accuracy_vs_round.png").read_bytes() == drawn
    assert "![accuracy vs round](accuracy_vs_round.png)" in text  # still linked
    # rows without the score: the extra keys are drawn all the same, a missing key refused
    rows = [{k: v for k, v in r.items() if k != "accuracy"} for r in rows_for([0.5, 0.8], 1, 1)]
    (e / "fedavg" / "seed-1" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    runs = load_runs(e)
    with pytest.warns(UserWarning, match="not redrawn"):
        paths = plot(runs, e, keys=["retained_energy"])
    assert e / "retained_energy_vs_round.png" in paths
    with pytest.raises(ValueError, match="no_such"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the score's plots, said above
        plot(runs, e, keys=["no_such"])
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0  # a folder of experiments
    out, err = capsys.readouterr()
    assert f"reports written in each experiment folder under {tmp_path}" in out
    assert "fedlore: warning: " in err and "not redrawn (the ones there are kept)" in err


def test_a_finished_run_with_an_unreadable_summary_is_not_called_unfinished(
    tmp_path: Path,
) -> None:
    e = tmp_path / "exp"
    write_run(e, "fedavg", 1, rows_for([0.5, 0.8], 1, 1), summ(0.80, 0.80, 1, 1, 1, 1.0))
    run = write_run(e, "fedavg", 2, rows_for([0.5, 0.9], 1, 1), summ(0.90, 0.90, 1, 1, 1, 1.0))
    (run / "summary.json").write_text('{"method": "fedavg", "se')  # cut short
    with pytest.warns(IncompleteRunWarning) as warned:
        text = report(e)
    row = next(line for line in text.splitlines() if line.startswith("| fedavg"))
    assert "| 2 (1 with an unreadable summary) |" in row and "unfinished" not in row
    # one warning for the one damaged file, saying what the report does instead
    said = [str(w.message) for w in warned if issubclass(w.category, IncompleteRunWarning)]
    assert said == [f"{run / 'summary.json'}: unreadable; deriving the run from its 2 metrics rows"]
    (run / "metrics.jsonl").unlink()
    with pytest.warns(IncompleteRunWarning, match="unreadable and no metrics rows; skipping"):
        report(e)


def test_client_time_over_fewer_seeds_says_so_rather_than_a_spread_of_zero(tmp_path: Path) -> None:
    """A seed whose summary lacks the client training time (a run of an older fedlore): the
    cell is the other seed's value, ``(1 of 2 seeds)``, not ``± 0.000``."""
    e = tmp_path / "runs" / "timed"
    base = summ(0.7, 0.7, 1e6, 1e6, 0, 1.0)
    write_run(
        e, "fedlore", 1, rows_for([0.7], 1e6, 1e6), {**base, "client_train_s_per_round": 0.25}
    )
    write_run(e, "fedlore", 2, rows_for([0.7], 1e6, 1e6), base)
    md = to_markdown(summary_table(load_runs(e)))
    assert "| 0.250 (1 of 2 seeds) |" in md, md
