"""Paired comparisons against a baseline (``fedlore report --baseline``): differences are taken
seed by seed (never by position), the interval is Student's t as scipy's paired t-test gives it,
runs that did not finish, diverged or trained on other data are left out and counted, language
models compare perplexity, and a baseline that names nothing, or several config rows, is refused
with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from test_report import rows_for, summ, write_run

from fedlore.cli import main
from fedlore.results.paired import NoBaselineWarning, paired_stats, paired_table
from fedlore.results.report import report
from fedlore.results.store import load_runs, split_by_config


def _run(e: Path, method: str, seed: int, acc: float | None, loss: float = 0.5, **extra: object):
    summary = {**summ(acc or 0.0, acc or 0.0, 1, 1, 1, 1), "final_loss": loss, **extra}
    if acc is None:
        summary["final_accuracy"] = None  # diverged: no final score
    return write_run(e, method, seed, rows_for([acc], 1, 1), summary)


def test_the_interval_is_scipys_paired_t_interval() -> None:
    rng = np.random.default_rng(3)
    for n in (2, 3, 5, 9):
        a, b = rng.normal(70, 5, n), rng.normal(68, 5, n)
        mean, half = paired_stats(list(a - b))
        ci = stats.ttest_rel(a, b).confidence_interval(0.95)
        assert mean == pytest.approx(float(np.mean(a - b)))
        assert half is not None
        assert (mean - half, mean + half) == pytest.approx((ci.low, ci.high))
    assert paired_stats([1.5]) == (1.5, None)


def test_differences_pair_by_seed_and_see_what_the_spread_hides(tmp_path: Path) -> None:
    """The seeds move both methods by ±10 points; the method is 1 point ahead on each seed.
    Side by side the rows overlap; paired, the interval excludes 0."""
    e = tmp_path / "exp"
    for seed, base in ((1, 0.60), (2, 0.80), (3, 0.70), (4, 0.75)):
        _run(e, "fedavg", seed, base, loss=1.0)
        _run(e, "mine", 5 - seed, {1: 0.60, 2: 0.80, 3: 0.70, 4: 0.75}[5 - seed] + 0.01, 0.9)
    (row,) = paired_table(split_by_config(load_runs(e)), "fedavg")
    assert row["paired"] == 4 and row["left_out"] == [] and row["better"] == 4
    assert row["delta"] == pytest.approx(1.0) and row["ci"] == pytest.approx(0.0, abs=1e-9)
    assert row["delta_nll"] == pytest.approx(-0.1)
    # by position instead of seed, the differences would be -20..+20 points
    text = report(e, write=False, baseline="fedavg").split("## Paired against fedavg")[1]
    assert "| mine | 4 | +1.00 | [+1.00, +1.00] | 4 of 4 | -0.1 |" in text


def test_unfinished_diverged_and_other_data_runs_are_left_out_and_counted(tmp_path: Path) -> None:
    from fedlore.config import load_config

    e = tmp_path / "exp"
    config = load_config(None, []).model_dump(mode="json")

    def record(run: Path, fingerprint: str) -> None:
        (run / "config.json").write_text(json.dumps({**config, "data_fingerprint": fingerprint}))

    for seed, acc in ((1, 0.5), (2, 0.6), (3, 0.7), (5, 0.7), (6, 0.5), (7, 0.5)):
        record(_run(e, "fedavg", seed, acc), f"fp{seed}")
    record(_run(e, "mine", 1, 0.55), "fp1")
    record(_run(e, "mine", 2, None), "fp2")  # no final score
    unfinished = e / "mine" / "seed-3"
    unfinished.mkdir(parents=True)
    (unfinished / "metrics.jsonl").write_text(json.dumps(rows_for([0.99], 1, 1)[0]) + "\n")
    record(unfinished, "fp3")
    record(_run(e, "mine", 4, 0.9), "fp4")  # no baseline run of seed 4
    diverged = _run(e, "mine", 6, 0.9, diverged="the final test loss is 1e+12 nats")
    record(diverged, "fp6")  # a finite accuracy all the same
    record(_run(e, "mine", 7, 0.9), "another")  # trained on other data
    # seed 5: the baseline's only
    with pytest.warns(UserWarning):
        runs = split_by_config(load_runs(e))
    (row,) = paired_table(runs, "fedavg")
    assert row["paired"] == 1 and row["left_out"] == [2, 3, 4, 5, 6, 7]
    assert row["delta"] == pytest.approx(5.0) and row["ci"] is None
    with pytest.warns(UserWarning):
        text = report(e, write=False, baseline="fedavg").split("## Paired against fedavg")[1]
    assert "| mine | 1 (6 left out) | +5.00 | – | 1 of 1 |" in text


def test_ties_are_not_better_and_small_nll_differences_keep_their_digits(tmp_path: Path) -> None:
    e = tmp_path / "exp"
    for seed in (1, 2):
        _run(e, "fedavg", seed, 0.5, loss=0.4)
        _run(e, "mine", seed, 0.5, loss=0.4 + 2e-7 * seed)
    text = report(e, write=False, baseline="fedavg").split("## Paired against fedavg")[1]
    assert "| mine | 2 | +0.00 | [+0.00, +0.00] | 0 of 2 (2 tied) | +3e-07 |" in text


def test_language_models_compare_perplexity_lower_is_better(tmp_path: Path) -> None:
    """A language model's summary holds a token accuracy too; its headline is perplexity."""
    e = tmp_path / "lm"
    for seed, (base, mine) in enumerate(((30.0, 25.0), (32.0, 33.0), (31.0, 29.0))):
        for method, ppl in (("fedfull", base), ("fedlore", mine)):
            run = write_run(e, method, seed, [{"round": 0, "perplexity": ppl}], None)
            summary = {"final_perplexity": ppl, "final_accuracy": 100 / ppl}
            (run / "summary.json").write_text(
                json.dumps({"method": method, "seed": seed, **summary})
            )
    (row,) = paired_table(split_by_config(load_runs(e)), "fedfull")
    assert row["label"] == "perplexity" and not row["higher_better"]
    assert row["delta"] == pytest.approx(-2.0) and row["better"] == 2


def test_a_baseline_that_names_nothing_or_several_rows_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedlore.config import load_config

    e = tmp_path / "exp"
    base = load_config(None, []).model_dump(mode="json")
    for seed, lr in ((1, base["lr"]), (2, base["lr"] * 10)):
        (_run(e, "fedavg", seed, 0.5) / "config.json").write_text(json.dumps({**base, "lr": lr}))
        (_run(e, "mine", seed, 0.6) / "config.json").write_text(json.dumps({**base, "lr": lr}))
    with pytest.raises(ValueError, match=r"its runs differ in config here \(fedavg \[lr="):
        report(e, write=False, baseline="fedavg")
    label = f"fedavg [lr={base['lr']}]"
    text = report(e, write=False, baseline=label)
    assert f"## Paired against {label}" in text and "| mine [lr=" in text
    assert main(["report", str(e), "--baseline", "fedavgg"]) == 2
    err = capsys.readouterr().err
    assert "--baseline fedavgg: no runs of it here (did you mean 'fedavg'?)" in err
    assert not (e / "report.md").exists()  # refused before anything is written


def test_a_folder_of_experiments_says_why_one_has_no_comparison(tmp_path: Path) -> None:
    from fedlore.config import load_config

    root = tmp_path / "runs"
    base = load_config(None, []).model_dump(mode="json")
    for seed in (1, 2):
        _run(root / "a", "fedavg", seed, 0.5)
        _run(root / "a", "mine", seed, 0.6)
        _run(root / "b", "mine", seed, 0.6)  # no fedavg
        _run(root / "c", "fedavg", seed, 0.5)  # fedavg alone
        split = {**base, "lr": base["lr"] * seed}  # fedavg's runs split by config in d
        (_run(root / "d", "fedavg", seed, 0.5) / "config.json").write_text(json.dumps(split))
    with pytest.warns(NoBaselineWarning) as said:  # a has it: no refusal
        text = report(root, write=False, baseline="fedavg")
    a, b, c, d = text.split("## Paired against fedavg")[1:]
    assert "| mine | 2 | +10.00 |" in a
    assert "No row fedavg here (rows: mine)." in b
    assert "fedavg is the only row here: nothing to compare with it." in c
    assert "Its runs differ in config here (fedavg [lr=" in d and "name one of these rows" in d
    # and one line beside the reports names the experiments without the baseline (b only)
    line = "--baseline fedavg: no runs of it in 1 of the 4 experiments, so their reports compare "
    assert [str(w.message) for w in said] == [line + "nothing with it: b"]


def test_a_report_names_the_experiments_without_the_baseline_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fedlore report runs --baseline fedavg`` over experiments of which some have no fedavg
    said so only inside each one's report.md: it prints one line naming them, and none when
    every experiment has the baseline."""
    root = tmp_path / "runs"
    for seed in (1, 2):
        for exp in ("a", "b", "c"):
            _run(root / exp, "mine", seed, 0.6)
        _run(root / "a", "fedavg", seed, 0.5)
    assert main(["report", str(root), "--baseline", "fedavg", "--print-only"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "fedlore: warning: --baseline fedavg: no runs of it in 2 of the 3 experiments, so their "
        "reports compare nothing with it: b, c"
    ]
    assert main(["report", str(root), "--baseline", "mine", "--print-only"]) == 0
    assert "--baseline" not in capsys.readouterr().err


def test_report_csv_carries_the_paired_columns_with_a_baseline(tmp_path: Path) -> None:
    """With --baseline, report.csv gets each row's paired difference, interval ends (scipy's
    paired t interval), seeds and wins; the baseline's row names it only; without a baseline
    the columns are absent."""
    import csv

    e = tmp_path / "exp"
    base, mine = (0.60, 0.80, 0.70), (0.62, 0.79, 0.75)
    for seed, (a, b) in enumerate(zip(base, mine, strict=True)):
        _run(e, "fedavg", seed, a, loss=1.0)
        _run(e, "mine", seed, b, loss=1.0 - 0.1 * seed)
    _run(e, "lonely", 9, 0.9)  # no fedavg run of seed 9
    report(e, baseline="fedavg")
    rows = {r["method"]: r for r in csv.DictReader((e / "report.csv").open())}
    row = rows["mine"]
    diffs = 100 * (np.array(mine) - np.array(base))
    low, high = stats.ttest_rel(np.array(mine) * 100, np.array(base) * 100).confidence_interval()
    assert row["paired_baseline"] == "fedavg" and row["paired_score"] == "final_accuracy"
    assert float(row["paired_delta"]) == pytest.approx(diffs.mean())
    assert float(row["paired_low"]) == pytest.approx(low)
    assert float(row["paired_high"]) == pytest.approx(high)
    assert (row["paired_seeds"], row["paired_left_out"], row["paired_better"]) == ("3", "", "2")
    assert float(row["paired_nll_delta"]) == pytest.approx(-0.1)
    assert row["paired_nll_seeds"] == "3" and row["paired_ties"] == "0"
    assert rows["fedavg"]["paired_baseline"] == "fedavg" and rows["fedavg"]["paired_delta"] == ""
    lonely = rows["lonely"]
    assert (lonely["paired_seeds"], lonely["paired_left_out"], lonely["paired_delta"]) == (
        "0",
        "0 1 2 9",
        "",
    )
    assert lonely["paired_better"] == "" and lonely["paired_low"] == ""
    report(e)  # no baseline: no paired columns
    assert "paired_delta" not in (e / "report.csv").read_text()
    report(e, baseline="lonely")  # no seed in common: rows without a difference, said so
    rows = {r["method"]: r for r in csv.DictReader((e / "report.csv").open())}
    assert (rows["mine"]["paired_seeds"], rows["mine"]["paired_delta"]) == ("0", "")
