"""``fedlore tune`` searching (:mod:`fedlore.tune_study`) on digits, an MLP, 2-3 rounds and 2-4
trials: the objective is the trial's final selection score from its ``summary.json`` (the best
round's under ``restore_best``), the search seed reproduces the trials, the grid runs each
combination once, median pruning stops a trial cleanly and says so, failed and diverged trials
are recorded, a search continues only under its own settings, and the command line prints the
table and a ``fedlore run`` command that runs."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import optuna
import pytest

from fedlore import cli
from fedlore.config import ConfigError, apply_overrides, validate
from fedlore.tune import Search, plan_search, seeds_note
from fedlore.tune_study import Outcome, _Reporter, run_search
from fedlore.types import State

TINY = [
    "name=tiny",
    "rounds=2",
    "num_clients=3",
    "local_steps=5",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "partition.min_size=10",
    "progress=false",
    "algorithms=[fedavg]",
    "seeds=[1, 2]",
    "data.selection_fraction=0.2",
    "threads=1",
    "device=cpu",
]
SPACE = "{lr: 'log:1e-3:0.3', local_steps: 'int:1:6'}"


def plan(out: Path, *extra: str, space: str = SPACE) -> Search:
    raw = apply_overrides({}, [*TINY, f"output_dir={out}", f"tune.space={space}", *extra])
    return plan_search(validate(raw), raw, "tiny.yaml")


def search(out: Path, *extra: str, space: str = SPACE) -> Outcome:
    return run_search(plan(out, *extra, space=space))


def summary(out: Path, trial: int) -> dict[str, Any]:
    path = out / "tiny" / "tune" / f"trial-{trial}" / "fedavg" / "seed-1" / "summary.json"
    return dict(json.loads(path.read_text()))


def trials(outcome: Outcome) -> list[tuple[int, str, dict[str, Any], float | None]]:
    return [(r.number, r.state, r.params, r.value) for r in outcome.rows]


def test_the_objective_is_the_final_selection_score_of_each_trials_summary(tmp_path: Path) -> None:
    out = search(tmp_path, "tune.trials=2", "tune.sampler=random", "tune.metric=selection_loss")
    assert [r.state for r in out.rows] == ["complete", "complete"]
    for row in out.rows:
        assert row.value == summary(tmp_path, row.number)["final_selection_loss"]
        recorded = json.loads(
            (tmp_path / "tiny/tune" / f"trial-{row.number}/trial.json").read_text()
        )
        assert recorded["state"] == "complete" and recorded["value"] == row.value
        assert recorded["params"] == row.params
    assert out.best is not None  # selection_loss: the smallest
    assert out.best.value == min(r.value for r in out.rows if r.value is not None)
    best = json.loads((tmp_path / "tiny/tune/best.json").read_text())
    assert (best["metric"], best["direction"], best["trial"]) == (
        "selection_loss",
        "min",
        out.best.number,
    )
    assert best["value"] == out.best.value and best["params"] == out.best.params
    assert best["command"] == out.command and best["trials"] == {
        "complete": 2,
        "pruned": 0,
        "failed": 0,
    }
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path}/tiny/tune/study.db")
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    # each evaluation's score was reported by round, as the trial ran
    rows = [
        json.loads(x)
        for x in (tmp_path / "tiny/tune/trial-0/fedavg/seed-1/metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    assert study.trials[0].intermediate_values == {r["round"]: r["selection_loss"] for r in rows}


def test_under_restore_best_the_objective_is_the_best_rounds_score(tmp_path: Path) -> None:
    extra = ["rounds=4", "early_stopping.metric=selection_loss", "early_stopping.patience=1",
             "early_stopping.restore_best=true", "tune.trials=1", "tune.sampler=grid",
             "tune.metric=selection_loss"]  # fmt: skip
    out = search(tmp_path, *extra, space="{lr: 'cat:1.0,1.0000001'}")  # worse in round 3
    s = summary(tmp_path, 0)
    rows = [
        json.loads(x)
        for x in (tmp_path / "tiny/tune/trial-0/fedavg/seed-1/metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    assert s["restored_best"] and s["stopped_round"] == 3 and s["best_round"] == 2
    assert out.rows[0].value == s["final_selection_loss"]
    assert out.rows[0].value == rows[s["best_round"]]["selection_loss"]
    assert out.rows[0].value < rows[-1]["selection_loss"]  # not the last round's


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_the_search_seed_reproduces_the_trials(tmp_path: Path, sampler: str) -> None:
    a = search(tmp_path / "a", "tune.trials=3", "tune.seed=5", f"tune.sampler={sampler}")
    b = search(tmp_path / "b", "tune.trials=3", "tune.seed=5", f"tune.sampler={sampler}")
    c = search(tmp_path / "c", "tune.trials=3", "tune.seed=6", f"tune.sampler={sampler}")
    assert trials(a) == trials(b)
    assert len({r.params["lr"] for r in a.rows}) == 3  # each trial its own proposal
    assert [r.params for r in a.rows] != [r.params for r in c.rows]


def test_the_grid_runs_each_combination_once(tmp_path: Path) -> None:
    out = search(tmp_path, "tune.sampler=grid", "tune.trials=10",
                 space="{local_steps: 'int:1:2', lr: 'cat:0.01,0.1'}")  # fmt: skip
    combos = [(r.params["local_steps"], r.params["lr"]) for r in out.rows]
    assert sorted(combos) == [(1, 0.01), (1, 0.1), (2, 0.01), (2, 0.1)]


def test_a_methods_own_setting_is_searched_in_its_section(tmp_path: Path) -> None:
    """``method.fedlore.rank`` is what each trial trains (its config.json's hyper)."""
    out = search(tmp_path, "algorithms=[fedlore]", "rounds=1", "tune.sampler=grid",
                 space="{method.fedlore.rank: 'cat:4,8'}")  # fmt: skip
    ranks = {}
    for row in out.rows:
        path = tmp_path / "tiny/tune" / f"trial-{row.number}/fedlore/seed-1/config.json"
        ranks[row.params["method.fedlore.rank"]] = json.loads(path.read_text())["hyper"]["rank"]
    assert ranks == {4: 4, 8: 8}


PRUNED = ["rounds=3", "tune.sampler=grid", "tune.seed=1", "tune.trials=3"]
GOOD_THEN_BAD = "{lr: 'cat:0.3,1e-5,2e-5'}"  # seed 1 runs 0.3 first


def test_median_pruning_stops_a_worse_trial_cleanly_and_records_it(tmp_path: Path) -> None:
    base = search(tmp_path / "all", *PRUNED, space=GOOD_THEN_BAD)
    assert [r.state for r in base.rows] == ["complete"] * 3 and base.rows[0].params["lr"] == 0.3
    prune = ["tune.prune=median", "tune.prune_startup_trials=1"]
    out = search(tmp_path, *PRUNED, *prune, space=GOOD_THEN_BAD)
    assert [(r.state, r.note) for r in out.rows] == [
        ("complete", ""), ("pruned", "after round 0"), ("pruned", "after round 0")
    ]  # fmt: skip
    assert out.rows[0].value == base.rows[0].value
    trial = tmp_path / "tiny" / "tune" / "trial-1"
    recorded = json.loads((trial / "trial.json").read_text())
    assert (recorded["state"], recorded["note"]) == ("pruned", "after round 0")
    run = trial / "fedavg" / "seed-1"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0]  # stopped after its round 0, which is recorded
    assert (run / "checkpoint.pt").is_file() and not (run / "summary.json").exists()
    assert out.rows[1].value == rows[0]["selection_accuracy"]  # the last reported score
    best = json.loads((tmp_path / "tiny/tune/best.json").read_text())
    assert best["trials"] == {"complete": 1, "pruned": 2, "failed": 0} and best["trial"] == 0


def test_a_round_written_before_a_cut_is_reported_and_may_prune(tmp_path: Path) -> None:
    """A trial cut off after a round's row but before its report: the resumed trial reports
    it from ``metrics.jsonl`` and asks the pruner, as the cut-off attempt would have."""
    study = optuna.create_study(
        direction="maximize", pruner=optuna.pruners.MedianPruner(n_startup_trials=1)
    )
    study.add_trial(optuna.trial.create_trial(value=0.9, intermediate_values={0: 0.8, 1: 0.9}))
    rows = tmp_path / "metrics.jsonl"
    lines = [
        {"round": -1, "selection_accuracy": 0.1},  # a setup exchange: no round of the trial
        {"round": 0, "selection_accuracy": 0.5},
        {"round": 1},  # no evaluation (eval.every)
    ]
    rows.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"round": 2, "sel')
    trial = study.ask()
    reporter = _Reporter(trial, "selection_accuracy", prune=True)
    reporter.backfill(rows)
    assert study.trials[-1].intermediate_values == {0: 0.5}
    assert reporter.pruned_at == 0  # 0.5 < the median 0.8 at round 0
    quiet = _Reporter(study.ask(), "selection_accuracy", prune=False)
    quiet.backfill(rows)
    assert quiet.pruned_at is None
    quiet.backfill(tmp_path / "none.jsonl")  # a trial cut off before its first row
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna warns of a round reported twice
        quiet.backfill(rows)
        quiet.on_round_end(0, {"round": 0, "selection_accuracy": 0.5}, State({}, {}))
    assert study.trials[-1].intermediate_values == {0: 0.5}


def test_failed_and_diverged_trials_are_recorded_and_the_search_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fedlore.tune_study as study_module

    real = study_module.trial_config

    def refuse_trial_1(search: Search, number: int, params: dict[str, Any]) -> Any:
        if number == 1:
            raise ConfigError("invalid config:\n  refused for the test")
        return real(search, number, params)

    monkeypatch.setattr(study_module, "trial_config", refuse_trial_1)
    extra = ["method.fedavg.local_optimizer=sgd", "tune.sampler=grid", "tune.trials=3"]
    out = search(tmp_path, *extra, "tune.seed=1", space="{lr: 'cat:0.01,1e30,0.02'}")
    assert [(r.state, r.params["lr"], r.note) for r in out.rows] == [
        ("complete", 0.01, ""),
        ("failed", 0.02, "invalid config:   refused for the test"),
        ("failed", 1e30, "diverged"),  # trained, no final score: no value
    ]
    assert out.best is not None and out.best.number == 0
    trial = tmp_path / "tiny/tune/trial-1"  # refused before its run: its record only
    assert [p.name for p in trial.iterdir()] == ["trial.json"]
    assert json.loads((trial / "trial.json").read_text())["state"] == "failed"
    assert out.best is not None and out.best.state == "complete"


def test_a_search_continues_only_under_its_own_settings(tmp_path: Path) -> None:
    first = search(tmp_path, "tune.trials=2", "tune.sampler=random")
    folder = tmp_path / "tiny" / "tune"
    kept = {p: p.read_bytes() for p in sorted((folder / "trial-0").rglob("*")) if p.is_file()}
    more = search(tmp_path, "tune.trials=3", "tune.sampler=random")  # more trials: one more
    assert trials(more)[:2] == trials(first) and len(more.rows) == 3
    assert {p: p.read_bytes() for p in kept} == kept  # a finished trial is never trained again
    for extra, words in [
        (["tune.sampler=tpe"], "sampler: 'random' -> 'tpe'"),
        (["tune.sampler=random", "rounds=3"], "settings.rounds: 2 -> 3"),
        (["tune.sampler=random", "tune.metric=selection_loss"], "metric: 'selection_accuracy' ->"),
    ]:
        with pytest.raises(ConfigError, match="holds a search with other settings") as e:
            search(tmp_path, *extra, "tune.trials=3")
        assert words in str(e.value)
    with pytest.raises(ConfigError, match=r"space\.lr: 'log:1e-3:0\.3' -> 'log:1e-3:0\.1'"):
        search(
            tmp_path, "tune.sampler=random", space="{lr: 'log:1e-3:0.1', local_steps: 'int:1:6'}"
        )
    # a searched setting's own value in the file is no difference: the trials set it
    assert len(search(tmp_path, "tune.sampler=random", "tune.trials=3", "lr=0.5").rows) == 3


def test_the_command_line_prints_the_trials_and_a_command_that_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    config = tmp_path / "tiny.yaml"
    raw = apply_overrides({}, [*TINY, f"output_dir={tmp_path / 'runs'}"])
    config.write_text(yaml.safe_dump(raw))
    args = ["tune", str(config), "--space", "lr=log:1e-3:0.3", "--trials", "2", "--seed", "3"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "| trial | state | lr | selection_accuracy | note |" in out
    assert out.count("| complete |") == 2  # --trials 2
    assert "(best) | complete |" in out
    command = next(line for line in out.splitlines() if line.startswith("every seed at"))
    argv = shlex.split(command.partition(": ")[2])
    assert argv[:3] == ["fedlore", "run", str(config)] and argv[3].startswith("lr=")
    assert "(the trials trained seed 1, one of the config's seeds (1, 2): its run is" in out
    assert cli.main(argv[1:]) == 0  # every seed of the config at the best lr
    capsys.readouterr()
    for seed in (1, 2):
        run = json.loads((tmp_path / "runs/tiny/fedavg" / f"seed-{seed}/config.json").read_text())
        assert run["lr"] == float(argv[3].removeprefix("lr="))
    again = cli.main(args)  # a finished search: nothing more to train, the same table
    assert again == 0 and capsys.readouterr().out.startswith(out.partition("\n\n")[0])


def test_errors_in_a_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``ValueError`` fails the trial and the search goes on, as does a score that is not a
    number; an ``OSError`` (a full disk) leaves it running, to resume; any other error fails it
    and stops the search."""
    import fedlore.tune_study as study_module

    real = study_module.run_experiment
    raised: dict[int, BaseException] = {0: ValueError("bad\nsettings"), 2: OSError(28, "full")}

    def failing(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        number = int(cfg.name.removeprefix("trial-"))
        if number in raised:
            raise raised[number]
        if number == 1:  # a score that is not a number
            return {"fedavg": [{"final_selection_accuracy": float("nan")}]}
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(study_module, "run_experiment", failing)
    with pytest.raises(OSError, match="full"):
        search(tmp_path, "tune.trials=3", "tune.sampler=random")
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path}/tiny/tune/study.db")
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL", "RUNNING"]
    assert study.trials[0].user_attrs["note"] == "bad settings"
    assert study.trials[1].user_attrs["note"] == "no final selection_accuracy"
    raised[2] = RuntimeError("a bug")
    with pytest.raises(RuntimeError, match="a bug"):
        search(tmp_path, "tune.trials=3", "tune.sampler=random")
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path}/tiny/tune/study.db")
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL", "FAIL"]
    assert study.trials[2].user_attrs["note"] == "RuntimeError: a bug"


def test_a_search_under_dp_records_the_epsilon_of_one_trial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import yaml

    from fedlore import progress

    monkeypatch.setattr(progress, "_SAID", set())
    dp = ["dp.clip_norm=1.0", "dp.noise_multiplier=1.0", "weighting=uniform"]
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(apply_overrides({}, [*TINY, *dp, f"output_dir={tmp_path}"])))
    assert cli.main(["tune", str(config), "--space", "lr=log:1e-3:0.3", "--trials", "1"]) == 0
    err = capsys.readouterr().err
    assert "fedlore: warning: dp is on: the search's trials train on the same clients" in err
    best = json.loads((tmp_path / "tiny/tune/best.json").read_text())
    assert best["dp_epsilon_of_one_trial"] == summary(tmp_path, 0)["dp_epsilon"] > 0
    assert best["search_privacy_accounted"] is False


def test_a_search_another_process_runs_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "tiny" / "tune"
    folder.mkdir(parents=True)
    src = Path(__file__).resolve().parents[1] / "src"
    code = (
        "import sys; from fedlore.engine.lock import RunLock\n"
        f"with RunLock({str(folder)!r}):\n    print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(src)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match="in use by another fedlore run"):
            search(tmp_path, "tune.trials=1")
    finally:
        holder.communicate("")
    assert not (folder / "study.db").exists()


def test_no_completed_trial_exits_1_without_best_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    config = tmp_path / "tiny.yaml"
    raw = apply_overrides(
        {}, [*TINY, "method.fedavg.local_optimizer=sgd", f"output_dir={tmp_path}"]
    )
    config.write_text(yaml.safe_dump(raw))
    args = ["--space", "lr=cat:1e30,1e31", "--trials", "2", "--sampler", "grid"]
    assert cli.main(["tune", str(config), *args]) == 1
    assert "no trial completed (0 pruned, 2 failed): no best.json" in capsys.readouterr().out
    assert not (tmp_path / "tiny/tune/best.json").exists()


def test_options_and_the_files_tune_section(tmp_path: Path) -> None:
    import argparse

    import yaml

    from fedlore.cli_tune import tune_config

    config = tmp_path / "tiny.yaml"
    tune = {"space": {"lr": "log:1e-3:0.3", "local_steps": "int:1:4"}, "trials": 5, "seed": 2}
    config.write_text(yaml.safe_dump({**apply_overrides({}, TINY), "tune": tune}))
    ns = argparse.Namespace(
        space=["lr=log:1e-4:1e-2", "method.fedavg.lr=log:1e-3:1e-2"],
        trials=3, metric=None, mode=None, sampler="random", seed=None, method=None,
        run_seed=None, prune=None, workers=2,
    )  # fmt: skip
    cfg, _ = tune_config(ns, config, ["tune.seed=4"])
    assert cfg.tune.workers == 2  # --workers
    assert cfg.tune.space == {
        "lr": "log:1e-4:1e-2",  # --space replaces the file's range
        "local_steps": "int:1:4",  # and keeps its other ones
        "method.fedavg.lr": "log:1e-3:1e-2",
    }
    assert (cfg.tune.trials, cfg.tune.sampler, cfg.tune.seed) == (3, "random", 4)


def test_a_run_seed_the_config_does_not_list_is_recorded_and_kept_out_of_its_report(
    tmp_path: Path,
) -> None:
    """--run-seed 7 with seeds [1, 2]: accepted (the search's seed need not be a reported one)
    and said in best.json and the printed lines; the trials' seed-7 folders are the search's,
    under tune/, and a report of the experiment holds only its own runs' seeds."""
    from fedlore.results.store import load_runs

    out = search(tmp_path, "tune.trials=1", "tune.run_seed=7")
    assert out.best is not None
    best = json.loads((tmp_path / "tiny/tune/best.json").read_text())
    assert (best["run_seed"], best["seeds"], best["run_seed_in_seeds"]) == (7, [1, 2], False)
    assert best["seeds_note"].startswith(
        "the trials trained seed 7, which the config's seeds (1, 2) leave out: the command's "
        "runs are of seeds the choice never saw, and the trials stay in "
    )
    assert (tmp_path / f"tiny/tune/trial-{out.best.number}/fedavg/seed-7/summary.json").is_file()
    run = tmp_path / "tiny" / "fedavg" / "seed-1"  # a run of the experiment itself
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"round": 0, "accuracy": 0.5}) + "\n")
    with pytest.warns(UserWarning):  # no summary: derived
        runs = load_runs(tmp_path / "tiny")
    assert list(runs) == ["fedavg"] and [r.seed for r in runs["fedavg"]] == [1]
    listed = plan(tmp_path / "b", "tune.run_seed=2")
    note = json.loads(json.dumps(seeds_note(listed)))
    assert note == (
        "the trials trained seed 2, one of the config's seeds (1, 2): its run is of the seed the "
        "settings were chosen on"
    )
