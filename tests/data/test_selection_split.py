"""The selection split (``data.selection_fraction``): held out of every client, scored with the
global model, and the only thing an ``experiments/lr_grid.py`` grid may choose a rate by."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from fedlore.config import ConfigError, load_config
from fedlore.data.federation import Federation, build_federation
from fedlore.data.holdout import hold_out_selection
from fedlore.experiment import run_one

ROOT = Path(__file__).parents[2]
C4 = Path(__file__).parents[1] / "fixtures" / "c4"


def _fed(seed: int = 0, *extra: str) -> Federation:
    return build_federation(load_config(None, ["num_clients=5", *extra]), seed)


def test_selection_split_is_disjoint_stratified_and_labelled() -> None:
    fed = _fed(0, "data.selection_fraction=0.1", "data.server_fraction=0.1")
    sel, u = fed.selection_indices, fed.server_indices
    assert sel is not None and u is not None and fed.selection is not None
    clients = np.concatenate([*fed.train_indices, *fed.test_indices])
    assert not set(sel.tolist()) & set(clients.tolist())
    assert not set(sel.tolist()) & set(u.tolist())
    everything = np.sort(np.concatenate([sel, u, clients]))
    assert np.array_equal(everything, np.arange(len(fed.pool)))
    y = fed.pool.y.numpy()
    rest = np.setdiff1d(np.arange(len(y)), u)
    for c in range(fed.num_classes):  # 10 % of what U left of every class
        assert int((y[sel] == c).sum()) == max(1, round(0.1 * int((y[rest] == c).sum())))
    assert np.array_equal(fed.selection.y.numpy(), y[sel])  # true labels
    assert fed.selection.x.shape == (len(sel), *fed.input_shape)


def test_no_selection_split_leaves_the_federation_as_before() -> None:
    plain, zero = _fed(0), _fed(0, "data.selection_fraction=0")
    assert plain.selection is None and plain.selection_indices is None
    assert plain.fingerprint() == zero.fingerprint()
    held = _fed(0, "data.selection_fraction=0.1")
    assert held.fingerprint() != plain.fingerprint()
    again = _fed(0, "data.selection_fraction=0.1")
    assert held.selection_indices is not None and again.selection_indices is not None
    assert np.array_equal(held.selection_indices, again.selection_indices)
    assert held.fingerprint() == again.fingerprint()


def test_noise_and_label_flips_keep_the_selection_split_honest() -> None:
    fed = _fed(0, "data.selection_fraction=0.2", "data.noise=0.3", "data.label_flip=0.5")
    assert fed.selection is not None and fed.selection_indices is not None
    idx = fed.selection_indices
    assert np.array_equal(fed.selection.x.numpy(), fed.pool.x.numpy()[idx])  # the clients' noise
    assert np.array_equal(fed.selection.y.numpy(), fed.pool.y.numpy()[idx])  # never flipped


def test_corpus_selection_documents_are_held_out_of_every_client() -> None:
    over: list[Any] = [
        "data.name=c4",
        f"data.root={C4}",
        "data.max_length=16",
        "data.vocab_size=300",
        "partition.name=source_dirichlet",
        "num_clients=3",
    ]
    plain = build_federation(load_config(None, over), 0)
    held = build_federation(load_config(None, [*over, "data.selection_fraction=0.2"]), 0)
    assert plain.selection is None
    docs = held.selection_indices
    assert docs is not None and held.selection is not None and len(docs) >= 1
    assert held.selection.y.dim() == 2  # packed sequences with next-token targets
    per_client_docs = held.histogram().sum()
    assert per_client_docs + len(docs) == plain.histogram().sum()


def test_bad_selection_fraction() -> None:
    with pytest.raises(ConfigError, match="selection_fraction"):
        load_config(None, ["data.selection_fraction=1.0"])
    with pytest.raises(ConfigError, match="nothing is left"):
        hold_out_selection(None, np.arange(1), 0.5, np.random.default_rng(0))


def test_a_run_reports_the_selection_scores(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "num_clients=3",
            "rounds=2",
            "local_steps=2",
            "algorithms=[fedfull]",
            "data.selection_fraction=0.1",
            f"output_dir={tmp_path}",
            "progress=false",
        ],
    )
    summary = run_one(cfg, "fedfull", 42)
    assert summary is not None
    assert 0.0 <= summary["final_selection_accuracy"] <= 1.0
    assert summary["final_selection_loss"] > 0
    rows = (tmp_path / cfg.name / "fedfull" / "seed-42" / "metrics.jsonl").read_text()
    assert all("selection_accuracy" in json.loads(r) for r in rows.splitlines())


def _lr_grid() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lr_grid", ROOT / "experiments" / "lr_grid.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _lr_select() -> ModuleType:
    """lr_grid's choice and cells (``experiments/lr_select.py``, importable once lr_grid is)."""
    _lr_grid()
    return importlib.import_module("lr_select")


def test_lr_grid_scores_the_selection_split_never_the_test_set() -> None:
    grid = _lr_grid()
    assert grid.SEED_GRID == (1e-4, 3e-4, 5e-4, 8e-4, 1e-3, 3e-3, 5e-3)
    # a higher test accuracy does not help a run with a lower selection accuracy
    a = {"final_accuracy": 0.9, "final_selection_accuracy": 0.5}
    b = {"final_accuracy": 0.1, "final_selection_accuracy": 0.6}
    assert grid.score(b) > grid.score(a)
    assert grid.score({"final_accuracy": None, "final_selection_accuracy": None}) == -float("inf")
    lm = {"final_perplexity": 10.0, "final_selection_perplexity": 50.0}
    assert grid.score(lm) == -50.0
    assert grid.score({**lm, "final_selection_perplexity": None}) == -float("inf")
    with pytest.raises(SystemExit, match="selection_fraction"):
        grid.score({"final_accuracy": 0.9})
    with pytest.raises(SystemExit, match="selection_fraction"):
        grid.score({"final_perplexity": 10.0})
    with pytest.raises(SystemExit, match="selection_fraction"):
        grid.main(["experiments/quickstart.yaml", "--grid", "fedlore=1e-3", "--out", "/tmp/x"])


def test_a_run_that_diverges_at_the_end_never_reports_an_earlier_score(tmp_path: Path) -> None:
    """metrics.jsonl writes NaN as null: the summary's final values are the last evaluation's,
    None when it was not finite, so the grid scores such a run -inf."""
    from fedlore.results.summary import summarize

    rows = [
        {"round": 0, "bytes_up": 1, "bytes_down": 1, "optimizer_state_bytes": 0, "wall_s": 1.0,
         "accuracy": 0.8, "loss": 0.5, "selection_accuracy": 0.9, "selection_rmse": 0.8},
        {"round": 1, "bytes_up": 1, "bytes_down": 1, "optimizer_state_bytes": 0, "wall_s": 1.0,
         "accuracy": None, "loss": None, "selection_accuracy": None, "selection_rmse": None},
    ]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize("fedfull", 0, path)
    assert summary["final_accuracy"] is None and summary["best_accuracy"] == 0.8
    assert summary["final_loss"] is None
    assert summary["final_selection_accuracy"] is None and summary["final_selection_rmse"] is None
    grid = _lr_grid()
    assert grid.score(summary) == -float("inf")
    # a run its summary calls diverged, whatever its (finite, blown-up) final score
    finite = (
        {"final_selection_accuracy": 0.9},
        {"final_perplexity": 9e9, "final_selection_perplexity": 9e9},
        {"final_rmse": 1e9, "final_selection_rmse": 1e9},
    )
    for done in finite:
        assert grid.score(done) > -float("inf")
        assert grid.score({**done, "diverged": "blew up"}) == -float("inf")
    lm_nan = {"final_perplexity": 1.0, "final_selection_perplexity": float("nan")}
    assert grid.score(lm_nan) == -float("inf")  # -NaN once: never the best, never the worst
    select = _lr_select()
    mean, std = select.mean_std([0.5, float("nan"), 0.7])
    assert mean == pytest.approx(0.6) and std == pytest.approx(0.1414, abs=1e-3)
    assert all(math.isnan(v) for v in select.mean_std([float("nan")]))


def test_a_rerun_of_the_grid_keeps_each_runs_earlier_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rerunning a grid resumes every run, finished ones included: the log of a run's training
    must survive the short 'already finished' output of the rerun (it was overwritten once)."""
    grid = _lr_grid()
    grid.NAME[0] = "cfg"
    outputs = iter(["round 0 ... round 59: training log\n", "already finished\n"])
    folder = grid.run_dir(str(tmp_path), "cfg", 1e-3, "fedlore", 42)

    def fake_call(cmd: list[str], stdout: Any, **_: Any) -> int:
        stdout.write(next(outputs))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "summary.json").write_text("{}")  # the run finished
        return 0

    monkeypatch.setattr(grid.subprocess, "call", fake_call)
    for _ in range(2):
        grid.launch("cfg.yaml", str(tmp_path), "fedlore", 42, 1e-3, tmp_path)
    text = (tmp_path / "fedlore-42-lr0.001.log").read_text()
    assert "training log" in text and "already finished" in text
    assert text.count("=== ") == 4 and text.index("training log") < text.index("already finished")
    # each launch says what the grid found in the run's folder, and no path of this machine
    new, finished = grid.FOUND["new"], grid.FOUND["finished"]
    assert text.index(new) < text.index("training log") < text.index(finished)
    assert sys.executable not in text and "=== " in text.splitlines()[0]


def test_every_failed_run_of_a_grid_is_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A grid whose runs fail names each of them with the last line of its log (not only the
    first failure of each method), writes no table and exits 1."""
    grid = _lr_grid()

    def fake_call(cmd: list[str], stdout: Any, **_: Any) -> int:
        lr = next(a for a in cmd if a.startswith("lr="))
        stdout.write(f"fedlore: error: refused at {lr}\n")
        return 2

    monkeypatch.setattr(grid.subprocess, "call", fake_call)
    config = tmp_path / "tiny.yaml"
    config.write_text("name: tiny\nalgorithms: [fedavg]\ndata: {selection_fraction: 0.1}\n")
    args = [str(config), "--grid", "fedavg=1e-3,3e-3", "--jobs", "1"]
    assert grid.main([*args, "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    for lr in ("0.001", "0.003"):
        assert f"fedavg seed 42 lr {lr} failed (2): fedlore: error: refused at lr={lr}" in err
    assert not (tmp_path / "out" / "table.md").exists()


def test_a_table_of_an_unfinished_grid_lists_the_missing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--table-only`` on a grid whose runs have not all finished names each missing run in one
    line (no traceback), writes no table and exits 1."""
    grid = _lr_grid()
    config = tmp_path / "tiny.yaml"
    config.write_text("name: tiny\nalgorithms: [fedavg]\ndata: {selection_fraction: 0.1}\n")
    runs, out = tmp_path / "runs", tmp_path / "out"
    done = grid.run_dir(str(runs), "tiny", 1e-3, "fedavg", 42)
    done.mkdir(parents=True)
    (done / "summary.json").write_text(json.dumps({"final_selection_accuracy": 0.5}))
    args = [str(config), "--grid", "fedavg=1e-3,3e-3", "--table-only", "--runs", str(runs)]
    assert grid.main([*args, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "have not finished" in err and "Traceback" not in err
    assert "fedavg seed 42 lr 0.003: not finished" in err and "lr 0.001" not in err
    assert not (out / "table.md").exists()
    # the grid's first seed finished: the chosen rate's other seeds are what is missing
    config.write_text(config.read_text() + "seeds: [42, 43]\n")
    other = grid.run_dir(str(runs), "tiny", 3e-3, "fedavg", 42)
    other.mkdir(parents=True)
    (other / "summary.json").write_text(json.dumps({"final_selection_accuracy": 0.7}))
    assert grid.main([*args, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "fedavg seed 43 lr 0.003: not finished" in err and "seed 42" not in err


def test_a_tables_seconds_per_round_are_the_median_over_its_seeds(tmp_path: Path) -> None:
    """Bytes come from the first seed (they do not vary); seconds per round are the median over
    the seeds, so one run finished on a slower sitting does not set a method's time."""
    grid = _lr_grid()
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "name: tiny\nalgorithms: [fedavg]\nseeds: [42, 43, 44]\ndata: {selection_fraction: 0.1}\n"
    )
    runs, out = tmp_path / "runs", tmp_path / "out"
    for seed, wall in ((42, 30.0), (43, 10.0), (44, 11.0)):
        folder = grid.run_dir(str(runs), "tiny", 1e-3, "fedavg", seed)
        folder.mkdir(parents=True)
        result = {"final_accuracy": 0.5, "final_selection_accuracy": 0.5, "final_loss": 1.0}
        (folder / "summary.json").write_text(json.dumps(result))
        rows = [
            {"round": r, "wall_s": wall, "bytes_up": 100, "bytes_down": 200, "clients": 2}
            for r in range(2)
        ]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [str(config), "--grid", "fedavg=1e-3", "--table-only", "--runs", str(runs)]
    assert grid.main([*args, "--out", str(out)]) == 0
    row = json.loads((out / "table.json").read_text())["methods"]["fedavg"]
    assert row["wall_s_per_round"] == 11.0
    assert row["wall_s_per_round_per_seed"] == {"42": 30.0, "43": 10.0, "44": 11.0}
    assert row["up_per_client"] == 50.0 and "| 11.0 |" in (out / "table.md").read_text()


def test_an_interrupted_grid_starts_no_further_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C reaches the running runs (one process group) and they exit 130: the grid then
    starts none of its queued runs, says so in one line and exits 130."""
    grid = _lr_grid()
    calls: list[list[str]] = []

    def fake_call(cmd: list[str], stdout: Any, **_: Any) -> int:
        calls.append(cmd)
        return 130

    monkeypatch.setattr(grid.subprocess, "call", fake_call)
    config = tmp_path / "tiny.yaml"
    config.write_text("name: tiny\nalgorithms: [fedavg]\ndata: {selection_fraction: 0.1}\n")
    args = [str(config), "--grid", "fedavg=1e-3,3e-3,1e-2", "--jobs", "1"]
    assert grid.main([*args, "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "o")]) == 130
    assert len(calls) == 1 and "interrupted" in capsys.readouterr().err


def test_a_rate_chosen_at_an_edge_of_its_grid_is_flagged() -> None:
    """The how-to's pitfall (widen a grid whose winner is an edge) is said by the tool itself:
    a warning naming the edge and a rate beyond it, and ``chosen_at_grid_edge`` in table.json."""
    grid = _lr_grid()
    select = _lr_select()
    assert select.grid_edge([3e-3, 1e-2], 1e-2) == "top"
    assert select.grid_edge([1e-4, 3e-4, 1e-3], 1e-4) == "bottom"
    assert select.grid_edge([1e-4, 3e-4, 1e-3], 3e-4) is None
    assert select.grid_edge([1e-3], 1e-3) is None  # one rate: nothing to widen
    line = grid.edge_warning("fedlore", [1e-2, 3e-3], 1e-2)
    assert line is not None and "the top of its grid 0.003,0.01" in line
    assert "--grid fedlore=0.033," in line  # one more step of the grid's own ratio upward
    low = grid.edge_warning("fedfull", [1e-4, 1e-3], 1e-4)  # a decade: still the grid's step
    assert low is not None and "bottom" in low and "fedfull=1e-05," in low
    assert grid.edge_warning("fedlore", [1e-3, 3e-3, 1e-2], 3e-3) is None


def test_a_grid_too_coarse_to_extend_is_filled_in_a_decade_at_a_time() -> None:
    """``--grid fedavg=1e-2,1e6`` chose 1e-2 (1e6 diverged): extending the grid by its own
    factor of 1e8 advised 1e-10; the advice is now a decade either side of the chosen rate."""
    grid = _lr_grid()
    low = grid.edge_warning("fedavg", [1e-2, 1e6], 1e-2)
    assert low is not None and "1e-10" not in low and "too coarse" in low
    assert "--grid fedavg=0.001,0.01,0.1)" in low and "a factor of 1e+08" in low
    top = grid.edge_warning("fedavg", [1e-5, 1e-3, 1.0], 1.0)  # 1e-3 to 1: a factor of 1000
    assert top is not None and "--grid fedavg=0.1,1,10)" in top
    # just above a decade: filled in; at a decade and below: one more step of the grid's own
    assert "too coarse" in (grid.edge_warning("m", [1e-3, 1.1e-2], 1.1e-2) or "")
    assert "m=0.1,..." in (grid.edge_warning("m", [1e-3, 1e-2], 1e-2) or "")


def _grid_run(
    grid: ModuleType, runs: Path, lr: float, method: str, seed: int, **result: Any
) -> None:
    folder = grid.run_dir(str(runs), "tiny", lr, method, seed)
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"final_loss": 1.0, **result}))
    rows = [
        {"round": r, "wall_s": 1.0, "bytes_up": 1, "bytes_down": 2, "clients": 2} for r in (0, 1)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _two_method_grid(tmp_path: Path) -> tuple[ModuleType, Path, Path, Path]:
    """lr_grid, a config of fedavg and fedprox over seeds 42 and 43, its runs root and out."""
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "name: tiny\nalgorithms: [fedavg, fedprox]\nseeds: [42, 43]\n"
        "data: {selection_fraction: 0.1}\n"
    )
    return _lr_grid(), config, tmp_path / "runs", tmp_path / "out"


def test_a_diverged_grid_point_is_null_in_table_json_and_said_in_table_md(tmp_path: Path) -> None:
    """table.json is strict JSON (it held NaN for a diverged point): null, and the point named
    with its reason under ``diverged_grid_seed<s>`` / ``diverged_by_seed``; table.md says
    ``diverged`` (it said ``nan``). A run its summary calls diverged never wins, even with a
    finite (blown-up) selection score, and its scores are not reported."""
    grid, config, runs, out = _two_method_grid(tmp_path)
    ok = {"final_accuracy": 0.5, "final_selection_accuracy": 0.5}
    blew = "the final test loss is 1e5 nats per example"
    gone = {"final_accuracy": None, "final_selection_accuracy": None, "final_loss": None}
    _grid_run(grid, runs, 1e-3, "fedavg", 42, **ok)
    _grid_run(grid, runs, 1e-3, "fedavg", 43, **gone)
    _grid_run(
        grid, runs, 1e-2, "fedavg", 42, **{**ok, "final_selection_accuracy": 0.9}, diverged=blew
    )
    _grid_run(grid, runs, 1e6, "fedavg", 42, **gone)
    for seed in (42, 43):  # every seed of fedprox diverged
        _grid_run(grid, runs, 1e-3, "fedprox", seed, **gone, diverged="non-finite loss")
    args = [str(config), "--grid", "fedavg=1e-3,1e-2,1e6", "--grid", "fedprox=1e-3"]
    assert grid.main([*args, "--table-only", "--runs", str(runs), "--out", str(out)]) == 0

    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    table = json.loads((out / "table.json").read_text(), parse_constant=refuse)
    assert table["chosen"] == {"fedavg": 1e-3, "fedprox": 1e-3}  # 1e-2 diverged: never chosen
    avg, prox = table["methods"]["fedavg"], table["methods"]["fedprox"]
    assert avg["selection_grid_seed42"] == {"0.001": 50.0, "0.01": None, "1e+06": None}
    assert avg["test_grid_seed42"] == {"0.001": 50.0, "0.01": None, "1e+06": None}
    assert avg["diverged_grid_seed42"] == {"0.01": blew, "1e+06": "no finite final score"}
    assert avg["final_accuracy"] == {"42": 50.0, "43": None} and avg["mean"] == 50.0
    assert avg["diverged_seeds"] == 1 and avg["diverged_by_seed"] == {"43": "no finite final score"}
    assert prox["mean"] is None and prox["std"] is None and prox["loss_mean"] is None
    assert prox["diverged_by_seed"] == {"42": "non-finite loss", "43": "non-finite loss"}
    md = (out / "table.md").read_text()
    assert "nan" not in md.lower()
    assert "| fedavg | 0.001 | 50.00 ± 0.00 (1 diverged) | 50.0, diverged |" in md
    assert "| 0.001: 50.0, 0.01: diverged, 1e+06: diverged |" in md
    assert "| fedprox | 0.001 | diverged | diverged, diverged | 0.001: diverged |" in md


def test_a_table_only_grid_keeps_a_published_table_it_would_lose_results_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--table-only`` with fewer methods or seeds (``--set algorithms=`` / ``seeds=``) wrote
    its smaller table over the published one, exit 0: the published files are now kept byte for
    byte, what would go is named, exit 1; the same table again, or ``--overwrite``, writes. A
    training grid of fewer methods or seeds says so before it trains anything."""
    grid, config, runs, out = _two_method_grid(tmp_path)
    for method in ("fedavg", "fedprox"):
        for seed in (42, 43):
            _grid_run(grid, runs, 1e-3, method, seed, final_accuracy=0.5,
                      final_selection_accuracy=0.5)  # fmt: skip
    args = [str(config), "--grid", "fedavg,fedprox=1e-3", "--table-only", "--runs", str(runs)]
    assert grid.main([*args, "--out", str(out)]) == 0
    published = {f: (out / f).read_bytes() for f in ("table.json", "table.md")}
    capsys.readouterr()
    for fewer, gone in (
        ("algorithms=[fedavg]", "fedprox (seeds 42, 43)"),
        ("seeds=[42]", "fedavg (seeds 43); fedprox (seeds 43)"),
    ):
        assert grid.main([*args, "--out", str(out), "--set", fewer]) == 1
        err = capsys.readouterr().err
        assert f"table.json holds results the new table lacks ({gone})" in err, err
        assert "Traceback" not in err and "--overwrite replaces them" in err
        assert {f: (out / f).read_bytes() for f in published} == published
    calls: list[list[str]] = []

    def fake_call(cmd: list[str], **_: Any) -> int:
        calls.append(cmd)
        return 0

    monkeypatch.setattr(grid.subprocess, "call", fake_call)
    training = [a for a in args if a != "--table-only"]
    assert grid.main([*training, "--out", str(out), "--set", "algorithms=[fedavg]"]) == 1
    assert calls == [] and "fedprox (seeds 42, 43)" in capsys.readouterr().err
    assert grid.main([*args, "--out", str(out)]) == 0  # the same table: no loss, written
    assert grid.main([*args, "--out", str(out), "--set", "seeds=[42]", "--overwrite"]) == 0
    assert set(
        json.loads((out / "table.json").read_text())["methods"]["fedavg"]["final_accuracy"]
    ) == {"42"}


def test_a_published_row_of_another_layout_is_still_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A published row without a per-seed record the guard knows (an older lr_grid's
    ``final_accuracy_pct``) made the whole published table count as unreadable, so a table
    lacking that method replaced it, exit 0: the method is named and the table kept."""
    grid, config, runs, out = _two_method_grid(tmp_path)
    for seed in (42, 43):
        _grid_run(grid, runs, 1e-3, "fedavg", seed, final_accuracy=0.5,
                  final_selection_accuracy=0.5)  # fmt: skip
    out.mkdir()
    old = {"fedavg": {"final_accuracy": {"42": 50.0, "43": 50.0}},
           "fedprox": {"final_accuracy_pct": {"42": 60.0}}}  # fmt: skip
    (out / "table.json").write_text(json.dumps({"methods": old}))
    args = [str(config), "--grid", "fedavg=1e-3", "--table-only", "--runs", str(runs)]
    assert grid.main([*args, "--out", str(out), "--set", "algorithms=[fedavg]"]) == 1
    assert "the new table lacks (fedprox)" in capsys.readouterr().err
    assert json.loads((out / "table.json").read_text())["methods"] == old


def test_a_published_table_of_another_measure_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guard compared methods and seeds only, so an accuracy table of the same methods and
    seeds replaced a published perplexity table, exit 0: the measure is compared too."""
    grid, config, runs, out = _two_method_grid(tmp_path)
    for seed in (42, 43):
        _grid_run(grid, runs, 1e-3, "fedavg", seed, final_accuracy=0.5,
                  final_selection_accuracy=0.5)  # fmt: skip
    out.mkdir()
    old = {"fedavg": {"final_perplexity": {"42": 30.0, "43": 31.0}}}
    (out / "table.json").write_text(json.dumps({"methods": old}))
    args = [str(config), "--grid", "fedavg=1e-3", "--table-only", "--runs", str(runs)]
    assert grid.main([*args, "--out", str(out), "--set", "algorithms=[fedavg]"]) == 1
    err = capsys.readouterr().err
    assert "lacks (fedavg (final_perplexity, where the new table has final_accuracy))" in err
    assert json.loads((out / "table.json").read_text())["methods"] == old
    assert grid.main([*args, "--out", str(out), "--set", "algorithms=[fedavg]", "--overwrite"]) == 0
    assert "final_accuracy" in json.loads((out / "table.json").read_text())["methods"]["fedavg"]


def test_a_set_of_the_grids_own_keys_chooses_what_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--set algorithms=...`` / ``seeds=...`` choose the grid's methods and seeds (read from
    the config with the --set, as sweep.py reads them); every run gets its own method, seed,
    rate and folder once: the --set text came after them and overrode them in each run (a
    grid's every run trained all the --set's methods and seeds). ``--set lr=`` is refused."""
    grid = _lr_grid()
    calls: list[list[str]] = []

    def fake_call(cmd: list[str], stdout: Any, **_: Any) -> int:
        calls.append(cmd)
        return 1  # failed: the grid stops after its first seed

    monkeypatch.setattr(grid.subprocess, "call", fake_call)
    config = tmp_path / "tiny.yaml"
    config.write_text("name: tiny\nalgorithms: [fedavg]\ndata: {selection_fraction: 0.1}\n")
    own = ["algorithms=[fedprox,fedavg]", "seeds=[7,8]", f"output_dir={tmp_path / 'r'}"]
    sets = [a for kv in [*own, "progress=true", "rank=3"] for a in ("--set", kv)]
    out = ["--out", str(tmp_path / "o"), "--jobs", "1"]
    assert grid.main([str(config), *sets, "--grid", "fedavg,fedprox=1e-3,1e-2", *out]) == 1
    assert len(calls) == 4  # both methods, both rates, the first seed (7) of the --set's
    for cmd in calls:
        for key in ("algorithms", "seeds", "lr", "output_dir", "progress"):
            assert sum(a.startswith(f"{key}=") for a in cmd) == 1, (key, cmd)
        assert "seeds=7" in cmd and "rank=3" in cmd and "progress=false" in cmd
        assert any(a.startswith(f"output_dir={tmp_path / 'r'}/lr-") for a in cmd)
    assert {a for c in calls for a in c if a.startswith("algorithms=")} == {
        "algorithms=fedavg", "algorithms=fedprox",
    }  # fmt: skip
    with pytest.raises(SystemExit, match=r"--set lr=\.\.\.: the grid sets each run's lr"):
        grid.main([str(config), "--set", "lr=0.1", "--grid", "fedavg=1e-3", *out])


def test_the_grids_rate_is_the_one_that_runs_over_a_methods_own_lr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config with ``method.fedavg.lr`` (as the how-to's chosen.yaml writes the chosen rates)
    outranks the run-wide ``lr=`` the grid set: every point of fedavg's grid trained at 0.05.
    Each run's overrides now build the method at the grid's rate (fedprox, without its own
    lr, as before), with a note; ``--set method.<m>.lr=`` is refused as ``--set lr=`` is."""
    from fedlore.config import load_config
    from fedlore.engine.run_record import resolved_hyper
    from fedlore.experiment_parts import make_algorithm

    grid = _lr_grid()
    calls: list[list[str]] = []

    def fake_call(cmd: list[str], stdout: Any, **_: Any) -> int:
        calls.append(cmd)
        return 1  # failed: the grid stops after its first seed

    monkeypatch.setattr(grid.subprocess, "call", fake_call)
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "name: tiny\nalgorithms: [fedavg, fedprox]\nlr: 0.2\ndata: {selection_fraction: 0.1}\n"
        "method: {fedavg: {lr: 0.05}}\n"
    )
    out = ["--out", str(tmp_path / "o"), "--jobs", "1", "--runs", str(tmp_path / "r")]
    assert grid.main([str(config), "--grid", "fedavg,fedprox=1e-3,1e-2", *out]) == 1
    assert len(calls) == 4
    for cmd in calls:
        overrides = cmd[cmd.index(str(config)) + 1 :]
        method = next(a for a in overrides if a.startswith("algorithms=")).partition("=")[2]
        rate = float(next(a for a in overrides if a.startswith("lr=")).partition("=")[2])
        built = make_algorithm(method, load_config(str(config), overrides))
        trained = resolved_hyper(built)["lr"]  # what its config.json records as hyper.lr
        assert trained == rate, (method, rate, trained)  # it was 0.05 for fedavg
    err = capsys.readouterr().err
    assert err.count("lr_grid: note: the config's method.fedavg.lr=0.05 is replaced by") == 1
    assert "fedprox" not in err.split("lr_grid: note:")[1].splitlines()[0]
    for key in ("method.fedavg.lr", "method.fedprox.lr"):
        with pytest.raises(SystemExit, match=rf"--set {key}=\.\.\.: the grid sets each run's lr"):
            grid.main([str(config), "--set", f"{key}=0.1", "--grid", "fedavg,fedprox=1e-3", *out])


def test_a_damaged_run_file_is_one_line_and_the_table_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torn ``summary.json`` or ``metrics.jsonl`` (a copy cut short, an edit) was a traceback
    (the summary's in a worker thread, then a KeyError); it is one line naming the file, exit 1,
    and the table already at ``--out`` is kept as it was."""
    grid = _lr_grid()
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "name: tiny\nalgorithms: [fedavg]\nseeds: [42, 43]\ndata: {selection_fraction: 0.1}\n"
    )
    runs, out = tmp_path / "runs", tmp_path / "out"
    for seed in (42, 43):
        folder = grid.run_dir(str(runs), "tiny", 1e-3, "fedavg", seed)
        folder.mkdir(parents=True)
        result = {"final_accuracy": 0.5, "final_selection_accuracy": 0.5, "final_loss": 1.0}
        (folder / "summary.json").write_text(json.dumps(result))
        row = {"round": 0, "wall_s": 1.0, "bytes_up": 100, "bytes_down": 200, "clients": 2}
        row["accuracy"] = 0.5
        (folder / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    args = [str(config), "--grid", "fedavg=1e-3", "--table-only", "--runs", str(runs)]
    assert grid.main([*args, "--out", str(out)]) == 0
    published = {f: (out / f).read_bytes() for f in ("table.json", "table.md")}
    for seed, file in ((42, "summary.json"), (43, "metrics.jsonl")):
        path = grid.run_dir(str(runs), "tiny", 1e-3, "fedavg", seed) / file
        good = path.read_bytes()
        path.write_bytes(good[:20])
        capsys.readouterr()
        assert grid.main([*args, "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert f"{path} cannot be read (JSONDecodeError" in err and "Traceback" not in err
        assert {f: (out / f).read_bytes() for f in published} == published
        path.write_bytes(good)


def _tiny_grid(tmp_path: Path) -> tuple[ModuleType, Path, Path, Path]:
    """lr_grid, a tiny config, its runs root and the empty folder of its (1e-3, fedavg, 42) run."""
    grid = _lr_grid()
    config = tmp_path / "tiny.yaml"
    config.write_text("name: tiny\nalgorithms: [fedavg]\ndata: {selection_fraction: 0.1}\n")
    runs = tmp_path / "runs"
    folder = grid.run_dir(str(runs), "tiny", 1e-3, "fedavg", 42)
    folder.mkdir(parents=True)
    return grid, config, runs, folder


def _one_round_run(folder: Path) -> None:
    """A finished one-round run's ``summary.json`` and ``metrics.jsonl`` in ``folder``."""
    result = {"final_accuracy": 0.5, "final_selection_accuracy": 0.5, "final_loss": 1.0}
    (folder / "summary.json").write_text(json.dumps(result))
    row = {"round": 0, "wall_s": 1.0, "bytes_up": 1, "bytes_down": 2, "clients": 2, "accuracy": 0.5}
    (folder / "metrics.jsonl").write_text(json.dumps(row) + "\n")


def test_a_table_only_grid_tabulates_no_run_of_another_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--table-only`` with another ``--set`` than the grid's runs were made with tabulated
    them as its own (exit 0): a training grid refuses them (fedlore's finished-run check), a
    table must too. Named, exit 1, no table; the grid's own settings still tabulate."""
    from fedlore.config import load_config
    from fedlore.engine.run_record import result_settings

    grid, config, runs, folder = _tiny_grid(tmp_path)
    made = load_config(str(config), ["rounds=2", "lr=1e-3", "algorithms=fedavg", "seeds=42"])
    (folder / "config.json").write_text(json.dumps(result_settings(made, "fedavg")))
    _one_round_run(folder)
    args = [str(config), "--grid", "fedavg=1e-3", "--table-only", "--runs", str(runs)]
    assert grid.main([*args, "--out", str(tmp_path / "a"), "--set", "rounds=5"]) == 1
    err = capsys.readouterr().err
    assert f"{folder} holds a run of another config (rounds: 2 -> 5)" in err
    assert not (tmp_path / "a" / "table.json").exists()
    assert grid.main([*args, "--out", str(tmp_path / "b"), "--set", "rounds=2"]) == 0
    assert (tmp_path / "b" / "table.json").exists()


def test_an_interrupt_while_the_table_is_made_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    grid, config, runs, folder = _tiny_grid(tmp_path)
    _one_round_run(folder)

    def ctrl_c(*_: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(grid, "plot", ctrl_c)  # after the table: its files are whole
    args = [str(config), "--grid", "fedavg=1e-3", "--table-only", "--runs", str(runs)]
    assert grid.main([*args, "--out", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip() == grid.INTERRUPTED
