"""What ``early_stopping`` refuses (:mod:`fedlore.checks.stopping`,
:class:`fedlore.config.EarlyStoppingConfig`): a metric the run does not record (the list agrees
with what the evaluator scores), a test set's metric without ``allow_test`` (which warns and
marks the summary), client data under DP, ``train_loss`` the clients do not release, and
settings that cannot hold; and a resume with another rule."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from fedlore.checks import TestSelectionWarning, check_early_stopping, recorded_metrics
from fedlore.config import Config, ConfigError, load_config
from fedlore.engine.rundir import run_dir
from fedlore.experiment import build, run_one
from fedlore.experiment_parts import evaluator, prepare_federation
from fedlore.registry import register_metric

TINY = [
    "num_clients=3",
    "rounds=3",
    "local_steps=2",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "partition.min_size=10",
    "progress=false",
    "algorithms=[fedavg]",
]


def _cfg(tmp: Path, *extra: str) -> Config:
    return load_config(None, [*TINY, f"output_dir={tmp}", *extra])


def _test_selection_warning(call: Any) -> str:
    """The one ``TestSelectionWarning`` that ``call()`` gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    (one,) = [str(w.message) for w in caught if issubclass(w.category, TestSelectionWarning)]
    return one


def _refusal(cfg: Config) -> str:
    with pytest.raises(ConfigError) as e:
        check_early_stopping(cfg, prepare_federation(cfg, 0))
    return str(e.value)


@pytest.mark.parametrize(
    "extra",
    [
        ("data.selection_fraction=0.2", "eval.clients=true", "eval.metrics=[f1_macro, brier]"),
        ("data.name=diabetes", "data.selection_fraction=0.2", "eval.clients=true"),
        (),
    ],
    ids=["classification", "regression", "bare"],
)
def test_recorded_metrics_are_what_the_evaluator_scores(tmp_path: Path, extra: tuple) -> None:
    cfg = _cfg(tmp_path, *extra)
    exp = build(cfg, "fedavg", 0)
    row = evaluator(cfg, exp.fed, exp.algorithm, exp.eval_model)(exp.state)
    assert set(row) == recorded_metrics(cfg, exp.fed) - {"train_loss"}


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["early_stopping.metric=selection_accuracy"], "holds out no selection split"),
        (["early_stopping.metric=client_loss", "early_stopping.allow_test=true"],
         "client_* scores need eval.clients=true"),
        (["early_stopping.metric=selection_rmse", "data.selection_fraction=0.2"],
         "not a score of this classification run"),
        (["early_stopping.metric=local_accuracy", "early_stopping.mode=max", "eval.local=true"],
         "recorded in the last round only"),
        (["early_stopping.metric=local_accuracy", "eval.local=true"],  # mode=auto: the same
         "recorded in the last round only"),
        (["early_stopping.metric=train_loss", "eval.every=2"], "eval.every=1"),
        (["early_stopping.metric=train_loss", "dp.clip_norm=1", "dp.noise_multiplier=1",
          "weighting=uniform"], "release no training loss"),
        (["early_stopping.metric=train_loss", "secure_aggregation=true", "weighting=uniform"],
         "release no training loss"),
    ],
)  # fmt: skip
def test_a_metric_the_run_does_not_record_is_refused(
    tmp_path: Path, extra: list[str], words: str
) -> None:
    text = _refusal(_cfg(tmp_path, *extra))
    assert words in text
    assert text.startswith(f"early_stopping.metric={extra[0].split('=')[1]}")


@pytest.mark.parametrize("metric", ["accuracy", "loss", "client_accuracy", "f1_macro"])
def test_a_test_sets_metric_is_refused_without_allow_test(tmp_path: Path, metric: str) -> None:
    cfg = _cfg(tmp_path, f"early_stopping.metric={metric}", "eval.clients=true",
               "eval.metrics=[f1_macro]")  # fmt: skip
    text = _refusal(cfg)
    assert "inflates the reported scores" in text
    assert f"early_stopping.metric=selection_{metric.removeprefix('client_')}" in text


@pytest.mark.parametrize(
    ("metric", "twin"),
    [("client_accuracy_min", "selection_accuracy"), ("client_accuracy_std", "selection_accuracy"),
     ("client_ece", "selection_loss"), ("ece", "selection_loss")],
)  # fmt: skip
def test_a_score_the_selection_split_lacks_points_to_one_it_has(
    tmp_path: Path, metric: str, twin: str
) -> None:
    """The clients' spread and ECE have no selection twin: the refusal, the DP refusal and the
    allow_test warning name a score the run records instead."""
    split = ("data.selection_fraction=0.2", "eval.clients=true")
    fed = prepare_federation(_cfg(tmp_path, *split), 0)
    sel = (*split, f"early_stopping.metric={metric}")
    cfg = _cfg(tmp_path, *sel)
    assert twin in recorded_metrics(cfg, fed)

    def refusal(cfg: Config) -> str:
        with pytest.raises(ConfigError) as e:
            check_early_stopping(cfg, fed)
        return str(e.value)

    assert f"early_stopping.metric={twin}," in refusal(cfg)
    with pytest.warns(TestSelectionWarning, match=f"; {twin} on the selection split"):
        check_early_stopping(_cfg(tmp_path, *sel, "early_stopping.allow_test=true"), fed)
    if metric.startswith("client_"):
        dp = ("weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1")
        assert f"early_stopping.metric={twin})" in refusal(_cfg(tmp_path, *sel, *dp))


def test_selection_metrics_and_train_loss_pass(tmp_path: Path) -> None:
    for metric in ("selection_accuracy", "selection_loss", "train_loss"):
        cfg = _cfg(tmp_path, f"early_stopping.metric={metric}", "data.selection_fraction=0.2")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning either
            check_early_stopping(cfg, prepare_federation(cfg, 0))


def test_allow_test_warns_and_the_summary_says_so(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "early_stopping.metric=accuracy", "early_stopping.allow_test=true")
    with pytest.warns(TestSelectionWarning, match="optimistic"):
        summary = run_one(cfg, "fedavg", 0)
    assert summary is not None
    assert summary["early_stopping_on_test"] is True
    assert summary["early_stopping_metric"] == "accuracy"
    sel = _cfg(tmp_path / "sel", "early_stopping.metric=selection_loss",
               "data.selection_fraction=0.2")  # fmt: skip
    summary = run_one(sel, "fedavg", 0)
    assert summary is not None and summary["early_stopping_on_test"] is False


def test_allow_test_is_said_once_for_all_the_runs_of_a_command(tmp_path: Path) -> None:
    """A sweep (two methods, two seeds) warns once, naming how many runs it concerns, not once
    per run; the next command warns again."""
    from fedlore.experiment import run_experiment

    sweep = ("early_stopping.metric=accuracy", "early_stopping.allow_test=true", "rounds=1",
             "algorithms=[fedavg, fedfull]", "seeds=[0, 1]")  # fmt: skip
    for name in ("first", "second"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # Python's own once-per-place filter off
            summaries = run_experiment(_cfg(tmp_path, *sweep, f"name={name}"))
        assert sum(len(s) for s in summaries.values()) == 4
        said = [str(w.message) for w in caught if issubclass(w.category, TestSelectionWarning)]
        assert len(said) == 1, said
        assert "each of the command's 4 runs stops and selects on the central test set" in said[0]
    cfg = _cfg(tmp_path, *sweep)  # outside a command (a run of its own): said every time
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fed = prepare_federation(cfg, 0)
        check_early_stopping(cfg, fed)
    said = [str(w.message) for w in caught if issubclass(w.category, TestSelectionWarning)]
    assert len(said) == 2 and all("(allow_test): the run stops" in m for m in said)


DP = ["dp.clip_norm=1", "dp.noise_multiplier=1", "weighting=uniform"]


def test_under_dp_client_data_is_refused_and_the_selection_split_is_not(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, *DP, "eval.clients=true", "early_stopping.metric=client_accuracy",
               "early_stopping.allow_test=true")  # fmt: skip
    text = _refusal(cfg)
    assert "under DP" in text and "outside the mechanism" in text
    ok = _cfg(tmp_path, *DP, "data.selection_fraction=0.2",
              "early_stopping.metric=selection_accuracy")  # fmt: skip
    check_early_stopping(ok, prepare_federation(ok, 0))


def test_refused_by_a_run_before_its_folder_is_made(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "early_stopping.metric=accuracy")
    with pytest.raises(ConfigError, match="inflates the reported scores"):
        run_one(cfg, "fedavg", 0)
    assert not run_dir(cfg, "fedavg", 0).exists()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["early_stopping.patience=5"], "early_stopping.metric is not"),
        (["early_stopping.restore_best=true"], "early_stopping.metric is not"),
        (["early_stopping.metric=selection_loss", "early_stopping.patience=0"], "patience"),
        (["early_stopping.metric=selection_loss", "early_stopping.min_delta=-0.1"], "min_delta"),
        (["early_stopping.metric=selection_loss", "early_stopping.mode=up"], "mode"),
        (["early_stopping.metric=selection_acuracy"], r"\(did you mean selection_accuracy\?\)"),
        (["early_stopping.metric=client_los"], r"\(did you mean client_loss\?\)"),
        # the wrong case stays an error, on the split its prefix names, with the right name
        (
            ["early_stopping.metric=Selection_Accuracy"],
            r"Selection_Accuracy is not a known score of the selection split "
            r"\(did you mean selection_accuracy\?\)",
        ),
        (["early_stopping.metric=CLIENT_ECE"], r"clients' test splits \(did you mean client_ece\?"),
        # a truncated name: the shortest it begins
        (["early_stopping.metric=Client_Acc"], r"\(did you mean client_accuracy\?\)"),
        (["early_stopping.metric=selection_acc"], r"\(did you mean selection_accuracy\?\)"),
        (["early_stopping.metric=Selection_Bal"], r"\(did you mean selection_balanced_accuracy\?"),
        # too short to tell: the list
        (["early_stopping.metric=lo"], r"central test set; fedlore's are accuracy, "),
    ],
)
def test_settings_that_cannot_hold_are_refused(extra: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(None, extra)


@pytest.mark.parametrize(
    ("metric", "mode", "fix"),
    [("selection_loss", "max", "min"), ("client_ece", "max", "min"),
     ("selection_accuracy", "min", "max")],
)  # fmt: skip
def test_a_mode_against_a_known_direction_is_refused_before_any_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], metric: str, mode: str, fix: str
) -> None:
    """``selection_loss`` with ``mode=max`` would keep the worst round: `fedlore run` refuses
    it in one line naming the metric, its direction and the fix, and makes no folder."""
    from fedlore.cli import main

    capsys.readouterr()
    args = [*TINY, f"output_dir={tmp_path / 'runs'}", "data.selection_fraction=0.2",
            f"early_stopping.metric={metric}", f"early_stopping.mode={mode}"]  # fmt: skip
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "contradicts" in ln]
    how = "minimized (smaller is better)" if fix == "min" else "maximized (larger is better)"
    assert f"early_stopping.mode={mode} contradicts early_stopping.metric={metric}" in line
    assert f"which is {how}: set early_stopping.mode=auto (or {fix})" in line
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


def test_mode_auto_refuses_a_plugins_metric() -> None:
    register_metric("es_test_score")(lambda log_probs, y: 0.0)
    try:
        with pytest.raises(ConfigError, match=r"set early_stopping\.mode to max or min"):
            load_config(None, ["early_stopping.metric=selection_es_test_score"])
        for mode in ("max", "min"):  # a direction fedlore does not know: the mode given
            cfg = load_config(None, ["early_stopping.metric=selection_es_test_score",
                                     f"early_stopping.mode={mode}"])  # fmt: skip
            assert cfg.early_stopping.direction() == mode
    finally:
        from fedlore import registry

        registry._TABLES["metric"].pop("es_test_score", None)


def test_a_resume_with_another_rule_is_refused(tmp_path: Path) -> None:
    es = ["early_stopping.metric=selection_loss", "data.selection_fraction=0.2"]
    cfg = _cfg(tmp_path, *es, "rounds=4")
    assert run_one(cfg, "fedavg", 0, stop_after=0) is None
    other = _cfg(tmp_path, *es, "rounds=4", "early_stopping.patience=5")
    with pytest.raises(ConfigError, match=r"early_stopping\.patience: 3 -> 5"):
        run_one(other, "fedavg", 0, resume=True)


def test_an_empty_section_on_the_command_line_switches_off_a_files_early_stopping(
    tmp_path: Path,
) -> None:
    """The how-to's way to run a config that sets early stopping without it."""
    file = tmp_path / "es.yaml"
    file.write_text("early_stopping:\n  metric: selection_accuracy\n  patience: 2\n")
    assert load_config(file, []).early_stopping.metric == "selection_accuracy"
    off = load_config(file, ["early_stopping={}"]).early_stopping
    assert off.metric is None and off.patience == 3 and not off.enabled


@pytest.mark.parametrize(
    ("metric", "split", "listed"),
    [("selection_xyzzy", "the selection split", "selection_accuracy, selection_auroc_macro"),
     ("client_zz", "the clients' test splits", "client_accuracy, client_accuracy_mean"),
     ("wibble", "the central test set", "accuracy, auroc_macro, balanced_accuracy")],
)  # fmt: skip
def test_mode_auto_calls_a_far_typo_a_typo_first(metric: str, split: str, listed: str) -> None:
    """A name far from every known score is most likely a typo: the refusal names it, says it is
    not a known score of its split, lists the split's scores, and mentions a plugin's metric only
    as the other possibility, in the words fedlore tune uses (stopping_rule.unknown_score)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"early_stopping.metric={metric}"])
    text = str(e.value)
    assert f"early_stopping.metric={metric} is not a known score of {split}; fedlore's are " in text
    assert listed in text
    assert "; if it is a plugin's metric, set early_stopping.mode to max or min" in text
    with pytest.raises(ConfigError) as t:
        load_config(None, [f"tune.metric={metric}"])
    said = str(t.value)
    assert f"tune.metric={metric} is not a known score of {split}; fedlore's are " in said
    assert "; if it is a plugin's metric, set tune.mode (--mode) to max or min" in said


@pytest.mark.parametrize(
    ("extra", "fix"),
    [([], "eval.metrics=[balanced_accuracy]"),
     (["eval.metrics=[f1_macro]"], "eval.metrics=[f1_macro, balanced_accuracy]"),
     (["early_stopping.restore_best=true"], "eval.metrics=[balanced_accuracy]")],
)  # fmt: skip
def test_an_optional_score_not_in_eval_metrics_names_the_exact_fix(
    tmp_path: Path, extra: list[str], fix: str
) -> None:
    cfg = _cfg(tmp_path, "data.selection_fraction=0.2",
               "early_stopping.metric=selection_balanced_accuracy", *extra)  # fmt: skip
    text = _refusal(cfg)
    assert (
        "early_stopping.metric=selection_balanced_accuracy: balanced_accuracy is recorded only "
        f"when eval.metrics lists it: set {fix}; the run records"
    ) in text
    listed = _cfg(tmp_path, "data.selection_fraction=0.2", "eval.metrics=[balanced_accuracy]",
                  "early_stopping.metric=selection_balanced_accuracy")  # fmt: skip
    check_early_stopping(listed, prepare_federation(listed, 0))  # listed: accepted
    regression = _cfg(tmp_path, "data.name=diabetes", "data.selection_fraction=0.2",
                      "early_stopping.metric=selection_brier")  # fmt: skip
    assert "not a score of this regression run" in _refusal(regression)  # no fix to name


def test_a_plugins_metric_not_in_eval_metrics_names_the_fix_too(tmp_path: Path) -> None:
    register_metric("es_listed_score")(lambda log_probs, y: 0.0)
    try:
        cfg = _cfg(tmp_path, "data.selection_fraction=0.2", "early_stopping.mode=max",
                   "early_stopping.metric=selection_es_listed_score")  # fmt: skip
        assert "set eval.metrics=[es_listed_score]" in _refusal(cfg)
    finally:
        from fedlore import registry

        registry._TABLES["metric"].pop("es_listed_score", None)


def test_the_allow_test_warning_counts_what_the_command_does(tmp_path: Path) -> None:
    """Runs it trains against finished runs it keeps, the same in a dry run as in the command:
    a dry run of four runs said "the run", a rerun of four finished ones "4 runs"."""
    from fedlore.dry_run import plan_runs
    from fedlore.experiment import run_experiment

    cfg = _cfg(tmp_path, "early_stopping.metric=accuracy", "early_stopping.allow_test=true",
               "rounds=1", "algorithms=[fedavg, fedfull]", "seeds=[0, 1]")  # fmt: skip

    def said(call: Any) -> str:
        return _test_selection_warning(call)

    four = "each of the command's 4 runs stops and selects on the central test set it reports"
    assert four in said(lambda: plan_runs(cfg))
    assert four in said(lambda: run_experiment(cfg))
    kept = "the 4 finished runs the command keeps (it trains none) stopped and selected on"
    assert kept in said(lambda: plan_runs(cfg)) and kept in said(lambda: run_experiment(cfg))
    assert "so their scores there are optimistic" in said(lambda: plan_runs(cfg))
    (run_dir(cfg, "fedfull", 1) / "summary.json").unlink()  # unfinished: trained again
    one = "the one run the command trains (as the 3 finished runs it keeps did) stops and "
    assert one in said(lambda: plan_runs(cfg)) and one in said(lambda: run_experiment(cfg))
    again = "each of the command's 4 runs"  # --overwrite trains every one
    assert again in said(lambda: plan_runs(cfg, overwrite=True))
    assert again in said(lambda: run_experiment(cfg, overwrite=True))


def test_the_allow_test_warning_counts_an_interrupted_overwrites_replaced_runs(
    tmp_path: Path,
) -> None:
    """``--overwrite --resume`` keeps the runs the interrupted --overwrite replaced already and
    trains the others; a new --overwrite trains every run whatever an old record says."""
    import json

    from fedlore.dry_run import plan_runs
    from fedlore.engine.overwriting import RECORD
    from fedlore.experiment import run_experiment

    cfg = _cfg(tmp_path, "early_stopping.metric=accuracy", "early_stopping.allow_test=true",
               "rounds=1", "algorithms=[fedavg, fedfull]", "seeds=[0, 1]")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TestSelectionWarning)
        run_experiment(cfg)
    names = ["fedavg/seed-0", "fedfull/seed-0", "fedavg/seed-1", "fedfull/seed-1"]
    record = Path(cfg.output_dir) / cfg.name / RECORD

    def said(call: Any) -> str:
        record.write_text(json.dumps({"finished": names[:2], "targets": names, "started": names}))
        return _test_selection_warning(call)

    half = "each of the 2 runs the command trains (as the 2 finished runs it keeps did)"
    assert half in said(lambda: plan_runs(cfg, resume=True, overwrite=True))
    assert half in said(lambda: run_experiment(cfg, resume=True, overwrite=True))
    assert "each of the command's 4 runs" in said(lambda: run_experiment(cfg, overwrite=True))
