"""experiments/sweep.py: a sweep reuses and tabulates only its own finished runs, never another
sweep's whose ``--set`` values differ under the same run names."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

from fedlore.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = (
    "name: tiny\nrounds: 2\nnum_clients: 3\nlocal_steps: 2\nbatch_size: 16\n"
    "algorithms: [fedavg]\nseeds: [1]\npartition: {min_size: 10}\n"
    "model: {name: mlp, kwargs: {hidden: [16]}}\n"
)
"""A two-round FedAvg config of a few seconds."""


def _sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "experiments" / "sweep.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_sweep_tabulates_only_runs_of_its_own_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    sweep = _sweep()
    common = [str(config), "--vary", "data.noise=0", "--runs", str(tmp_path / "runs")]
    assert sweep.main([*common, "--set", "lr=0.01", "--out", str(tmp_path / "a")]) == 0
    (row,) = json.loads((tmp_path / "a" / "table.json").read_text())
    assert row["seeds"] == 1
    # each seed's values, for comparisons seed by seed
    assert list(row["by_seed"]) == ["1"]
    assert row["by_seed"]["1"]["final_accuracy"] == row["final_accuracy"][0]
    # another --set under the same run names: not reused, not tabulated, and said
    assert sweep.main([*common, "--set", "lr=0.02", "--out", str(tmp_path / "b")]) == 1
    assert json.loads((tmp_path / "b" / "table.json").read_text()) == []
    out = capsys.readouterr().out
    assert "holds a run of another config" in out and "lr" in out
    assert (
        sweep.main([*common, "--set", "lr=0.01", "--out", str(tmp_path / "c"), "--table-only"]) == 0
    )
    assert len(json.loads((tmp_path / "c" / "table.json").read_text())) == 1


def test_bad_sweeps_are_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text("name: tiny\nalgorithms: [fedavg]\nseeds: [1]\n")
    sweep = _sweep()
    out = ["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]
    # a --set of a --vary key would label the table with values the runs do not have
    assert sweep.main([str(config), "--vary", "lr=0.1,0.2", "--set", "lr=0.3", *out]) == 2
    assert "--set ['lr'] would override the --vary values" in capsys.readouterr().err
    assert sweep.main([str(config), "--methods", "fedavgg", *out]) == 2
    assert "fedavgg" in capsys.readouterr().err
    assert sweep.main([str(config), "--vary", "lr=fast", *out]) == 2
    assert "lr" in capsys.readouterr().err
    assert sweep.main([str(tmp_path / "missing.yaml"), *out]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    refused = {
        ("--methods", "fedavg", "--set", "algorithms=[fedprox]"): "give the methods once",
        ("--vary", "rank=2,4", "--set", "method.fedavg.rank=3"): "would override the --vary",
        ("--vary", "lr=0.1,0.2", "--set", "lr =0.3"): "would override the --vary",
        ("--vary", "lr=0.1,0.1"): r"--vary lr: \['0.1'\] named twice",
        ("--methods", "fedavg,fedavg"): r"--methods: \['fedavg'\] named twice",
        ("--methods", "fedlore_bayes", "--set", "method.fedlore_bayes.temp_steps=0"): "temp_steps",
        ("--set", "secure_aggregation=true", "--methods", "fedlore"): "cannot run under it",
    }
    for extra, match in refused.items():
        assert sweep.main([str(config), *extra, *out]) == 2, extra
        assert re.search(match, capsys.readouterr().err), extra
    (tmp_path / "afile").write_text("")
    assert (
        sweep.main(
            [str(config), "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "afile")]
        )
        == 2
    )
    assert "is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main([str(config), "--jobs", "0", *out])
    assert "--jobs: must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing ran


def test_a_sweep_with_a_failed_run_exits_1_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.yaml"  # a data root that does not exist: every run exits 2
    config.write_text(
        "name: tiny\nrounds: 1\nalgorithms: [fedavg]\nseeds: [1]\n"
        f"data: {{name: text_csv, root: {tmp_path / 'nothing.csv'}}}\n"
    )
    out = ["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--jobs", "1"]
    assert _sweep().main([str(config), *out]) == 1
    assert "1 run(s) failed: base fedavg seed 1 (rc=2" in capsys.readouterr().err


def test_an_interrupted_sweep_starts_no_further_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C reaches the running runs (one process group): they exit 130, and the sweep then
    starts none of its queued runs (it used to start every one of them) and exits 130."""
    sweep = _sweep()
    calls: list[list[str]] = []

    class Done:
        returncode = 130

    def fake_run(cmd: list[str], **_: object) -> Done:
        calls.append(cmd)
        return Done()

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    config = tmp_path / "tiny.yaml"
    config.write_text("name: tiny\nrounds: 1\nalgorithms: [fedavg, fedprox]\nseeds: [1, 2, 3]\n")
    out = ["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--jobs", "1"]
    assert sweep.main([str(config), *out]) == 130
    assert len(calls) == 1 and "interrupted" in capsys.readouterr().out


def test_fairness_adds_the_spread_of_the_clients_accuracies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--fairness``: the global model's per-client accuracy mean, worst, p10 and std, each
    run's own (from its summary), as columns of table.md and values of table.json."""
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "name: tiny\nrounds: 2\nnum_clients: 4\nlocal_steps: 2\nbatch_size: 16\n"
        "algorithms: [fedavg]\nseeds: [1]\npartition: {min_size: 10}\neval: {clients: true}\n"
        "model: {name: mlp, kwargs: {hidden: [16]}}\n"
    )
    out = tmp_path / "out"
    args = [str(config), "--runs", str(tmp_path / "runs"), "--out", str(out), "--fairness"]
    assert _sweep().main(args) == 0
    (row,) = json.loads((out / "table.json").read_text())
    summary = json.loads((tmp_path / "runs/tiny-base/fedavg/seed-1/summary.json").read_text())
    for key in ("mean", "min", "p10", "std"):
        assert row[f"final_client_accuracy_{key}"] == [summary[f"final_client_accuracy_{key}"]]
    assert row["final_client_accuracy_min"][0] <= row["final_client_accuracy_p10"][0]
    assert row["final_client_accuracy_p10"][0] <= row["final_client_accuracy_mean"][0]
    head = (out / "table.md").read_text().splitlines()[0]
    assert "| worst client (%) | client p10 (%) | client std (pts) |" in head
    # the same table made without --fairness would drop those columns: kept, named, exit 1
    published = (out / "table.json").read_bytes()
    assert _sweep().main([*args[:-1], "--table-only"]) == 1
    err = capsys.readouterr().err
    assert "final_client_accuracy_mean, final_client_accuracy_min" in err, err
    assert "pass --fairness" in err and (out / "table.json").read_bytes() == published
    assert _sweep().main([*args, "--table-only"]) == 0  # with it: the same table, written
    # with the flag, but runs whose summaries lost the columns' values: kept, named, exit 1
    path = tmp_path / "runs/tiny-base/fedavg/seed-1/summary.json"
    path.write_text(
        json.dumps({k: v for k, v in summary.items() if k != "final_client_accuracy_min"})
    )
    assert _sweep().main([*args, "--table-only"]) == 1
    err = capsys.readouterr().err
    assert "final_client_accuracy_min: fewer values in the runs now" in err, err
    assert (out / "table.json").read_bytes() == published


def test_a_set_of_the_sweeps_own_keys_chooses_what_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--set algorithms=... seeds=... name=... output_dir=...`` choose the methods, seeds,
    run names and runs root, as in lr_grid.py (the sweep refused them once); each run gets its
    own method, seed, name and folder, and never the --set text, which came after them and
    overrode them in every run."""
    sweep = _sweep()
    calls: list[list[str]] = []

    class Done:
        returncode = 0

    def fake_run(cmd: list[str], **_: object) -> Done:
        calls.append(cmd)
        return Done()

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    config = tmp_path / "tiny.yaml"
    config.write_text("name: tiny\nrounds: 1\nalgorithms: [fedavg]\nseeds: [1, 2, 3]\n")
    own = ["algorithms=[fedprox,fedavg]", "seeds=[2,3]", "name=other"]
    sets = [a for kv in [*own, f"output_dir={tmp_path / 'runs'}", "lr=0.5"] for a in ("--set", kv)]
    args = [str(config), "--vary", "rank=2", *sets, "--out", str(tmp_path / "out"), "--jobs", "1"]
    assert sweep.main(args) == 0
    picked = sorted(tuple(a for a in c if a.startswith(("algorithms=", "seeds="))) for c in calls)
    assert picked == [
        (f"algorithms={m}", f"seeds={s}") for m in ("fedavg", "fedprox") for s in (2, 3)
    ]
    for cmd in calls:
        for kv in own:  # each own key once, the run's own value; other --set values passed on
            assert kv not in cmd and sum(a.startswith(kv.split("=")[0] + "=") for a in cmd) == 1
        assert "name=other-rank-2" in cmd and f"output_dir={tmp_path / 'runs'}" in cmd
        assert "lr=0.5" in cmd


def test_a_vary_that_a_methods_own_setting_outranks_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config with ``method.fedavg.lr`` (as the lr-sweep how-to's chosen.yaml) ran every
    fedavg run of ``--vary lr=...`` at its own rate, under the --vary values' labels: refused
    before any run, in one line; a method without its own rate, or another key, still sweeps."""
    config = tmp_path / "chosen.yaml"
    config.write_text(
        "name: tiny\nalgorithms: [fedavg, fedprox]\nseeds: [1]\n"
        "method: {fedavg: {lr: 0.05, local_steps: 3}}\n"
    )
    sweep = _sweep()
    out = ["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]
    for key, own in (("lr", "lr"), ("local_steps", "local_steps")):
        assert sweep.main([str(config), "--vary", f"{key}=1,2", *out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].endswith(
            f"--vary {key}: the config sets method.fedavg.{own}, which outranks {key} in fedavg's "
            f"runs (each would run at its one value under the --vary labels); remove it from the "
            f"config, or --vary method.fedavg.{own}"
        ), err
    assert not (tmp_path / "runs").exists()  # nothing ran
    sweep.refuse_outranked([("lr", ["0.1"])], {}, "fedprox")  # no own rate: it sweeps
    sweep.refuse_outranked([("rank", ["2"])], {"lr": 0.05}, "fedavg")
    with pytest.raises(ConfigError, match=r"--vary server\.lr: the config sets method\.fedavg\."):
        sweep.refuse_outranked([("server.lr", ["0.1"])], {"server_eta": 0.5}, "fedavg")


def test_a_published_table_loses_no_row_unasked_and_a_damaged_run_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--table-only`` over a runs root that lacks the table's runs (another ``--runs``, a
    fresh clone) wrote an empty table over the published one and exited 0; a torn
    ``summary.json`` or ``config.json`` was a traceback. The published table is kept (exit 1,
    naming what would go) unless ``--overwrite``; a damaged run is named and left out."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    sweep = _sweep()
    pub = tmp_path / "pub"
    common = [str(config), "--vary", "lr=0.01,0.02", "--out", str(pub)]
    runs = tmp_path / "runs"
    assert sweep.main([*common, "--runs", str(runs)]) == 0
    published = {f: (pub / f).read_bytes() for f in ("table.json", "table.md")}
    assert len(json.loads(published["table.json"])) == 2

    elsewhere = ["--runs", str(tmp_path / "elsewhere"), "--table-only"]
    assert sweep.main([*common, *elsewhere]) == 1
    err = capsys.readouterr().err
    assert "holds results the new table lacks (2 row(s)" in err and "--overwrite" in err
    assert {f: (pub / f).read_bytes() for f in published} == published

    summary = runs / "tiny-lr-0.01" / "fedavg" / "seed-1" / "summary.json"
    good = summary.read_bytes()
    summary.write_bytes(good[:40])  # torn
    assert sweep.main([*common, "--runs", str(runs), "--table-only"]) == 1
    captured = capsys.readouterr()
    assert f"{summary} cannot be read (JSONDecodeError" in captured.out
    assert "lacks (1 row(s): lr-0.01 fedavg (seeds 1))" in captured.err
    assert {f: (pub / f).read_bytes() for f in published} == published
    record = summary.with_name("config.json")
    kept = record.read_bytes()
    summary.write_bytes(good)
    record.write_bytes(kept[:40])
    assert sweep.main([*common, "--runs", str(runs)]) == 1
    assert f"{record} cannot be read" in capsys.readouterr().out
    assert {f: (pub / f).read_bytes() for f in published} == published
    record.write_bytes(kept)

    assert sweep.main([*common, *elsewhere, "--overwrite"]) == 0  # told to: replaced
    assert json.loads((pub / "table.json").read_text()) == []
