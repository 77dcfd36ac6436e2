"""``fedlore tune`` before it trains (:mod:`fedlore.config_tune`, :mod:`fedlore.tune`,
:mod:`fedlore.cli_tune`): the space's grammar and every refusal (one line, before any folder is
made), the metric (a test set's is refused as early stopping refuses it), the method, the
sampler, the DP warning, overrides that read back exactly, and the command it prints."""

from __future__ import annotations

import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedlore import cli, progress
from fedlore.config import Config, ConfigError, apply_overrides, load_config, validate
from fedlore.config_tune import key_problem, parse_dim
from fedlore.engine.run_record import result_settings
from fedlore.experiment_privacy import PrivacyWarning
from fedlore.tune import Search, plan_search, run_command, scalar

TINY = [
    "name=tiny",
    "rounds=2",
    "num_clients=3",
    "local_steps=2",
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


def plan(tmp: Path, *extra: str, space: str = "{lr: 'log:1e-3:1e-1'}") -> Search:
    overrides = [*TINY, f"output_dir={tmp}", f"tune.space={space}", *extra]
    raw = apply_overrides({}, overrides)
    return plan_search(validate(raw), raw, "tiny.yaml", tuple(extra))


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """``tiny.yaml`` (TINY) with its output in ``tmp_path/runs``."""
    raw = apply_overrides({}, [*TINY, f"output_dir={tmp_path / 'runs'}"])
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def refusal(config: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one line ``fedlore tune tiny.yaml ARGS`` prints when it refuses (exit 2), having
    made no folder."""
    assert cli.main(["tune", str(config), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (config.parent / "runs").exists()  # refused before any folder is made
    return err.removeprefix("fedlore: error: ")


# the grammar ---------------------------------------------------------------------------------


def test_each_kind_of_dimension() -> None:
    log = parse_dim("lr", "log:1e-4:1e-1")
    assert (log.kind, log.low, log.high) == ("log", 1e-4, 0.1)
    assert parse_dim("data.noise", "float:0:0.5").extremes() == (0.0, 0.5)
    steps = parse_dim("local_steps", "int:1:4")
    assert (steps.low, steps.high, steps.grid()) == (1, 4, [1, 2, 3, 4])
    cat = parse_dim("optim.name", "cat:adam, sgd")
    assert cat.choices == ("adam", "sgd") and cat.grid() == ["adam", "sgd"]
    # numbers are numbers (1e-3 too, which YAML 1.1 reads as text); true, null are themselves
    assert parse_dim("x", "cat:4,8,16").choices == (4, 8, 16)
    assert parse_dim("x", "cat:1e-3,3.0e-3").choices == (1e-3, 3e-3)
    assert parse_dim("x", "cat:true,false,null").choices == (True, False, None)
    assert log.grid() is None


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("log:0:1", "LOW above 0"),
        ("log:-1e-3:1", "LOW above 0"),
        ("float:1:1", "LOW must be below HIGH"),
        ("int:4:1", "LOW must be below HIGH"),
        ("log:1e-1:1e-4", "LOW must be below HIGH"),
        ("int:1.5:3", "int bounds are integers"),
        ("log:a:1", "log bounds are numbers"),
        ("float:0:1e999", "finite"),
        ("log:1", "two bounds"),
        ("int:1:2:3", "two bounds"),
        ("cat:4", "at least two choices"),
        ("cat:4,8,4", "given twice"),
        ("cat:4,[8]", "a choice is a number"),
        ("uniform:0:1", "not a search range"),
        ("0.1", "not a search range"),
    ],
)
def test_a_malformed_range_is_refused(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_dim("lr", spec)


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("lr", None),
        ("data.noise", None),
        ("method.fedlore.rank", None),
        ("model.kwargs.hidden", None),  # a free mapping: the trial's model checks it
        ("lrr", "unknown key (did you mean 'lr'?)"),
        ("data.nois", "unknown key of data (did you mean 'noise'?)"),
        ("data", "data is a section: name one of its keys"),
        ("lr.x", "lr is not a section"),
        ("seeds", "not searched: the search runs one seed"),
        ("algorithms", "not searched"),
        ("output_dir", "not searched"),
        ("tune.trials", "not searched"),
        ("data.selection_fraction", "the objective is scored on that split"),
        ("method.fedlore", "method.<name>.<setting>"),
        ("method", "not searched"),
        # the privacy level is the user's decision: a search by accuracy picks the least
        ("dp.noise_multiplier", "a search scored by accuracy picks the least privacy"),
        ("dp.epsilon", "picks the least privacy"),
        ("dp.delta", "picks the least privacy"),
        ("dp.mode", "picks the weaker guarantee"),
        ("dp.audit.canaries", "the audit measures a run"),
        ("dp.clip_norm", None),  # a hyperparameter at a fixed privacy level
    ],
)
def test_the_keys_a_search_may_vary(key: str, words: str | None) -> None:
    problem = key_problem(Config, key)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and words in problem


def test_the_yaml_section_is_checked_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match=r"tune\.space: lrr: unknown key \(did you mean 'lr'"):
        load_config(None, ["tune.space={lrr: 'log:1e-4:1e-1'}"])
    with pytest.raises(ConfigError, match=r"tune\.space\.lr: .*LOW above 0"):
        load_config(None, ["tune.space={lr: 'log:0:1'}"])
    with pytest.raises(ConfigError, match=r"tune\.trails: unknown key \(did you mean 'trials'"):
        load_config(None, ["tune.trails=3"])
    with pytest.raises(ConfigError, match=r"tune\.prune_startup_trials is set but tune\.prune"):
        load_config(None, ["tune.prune_startup_trials=2"])
    with pytest.raises(ConfigError, match=r"tune\.metric=selection_mine is not a known score"):
        load_config(None, ["tune.metric=selection_mine"])
    assert load_config(None, ["tune.metric=selection_mine", "tune.mode=max"]).tune.direction() == (
        "max"
    )
    assert load_config(None, ["tune.metric=selection_loss"]).tune.direction() == "min"
    # a mode against a score's known direction would keep the worst trial (newcomer finding)
    for metric, mode, way in [
        ("selection_accuracy", "min", "max"),
        ("selection_loss", "max", "min"),
    ]:
        with pytest.raises(ConfigError, match=rf"tune\.mode={mode} contradicts .*\(or {way}\)"):
            load_config(None, [f"tune.metric={metric}", f"tune.mode={mode}"])
        agreed = load_config(None, [f"tune.metric={metric}", f"tune.mode={way}"])
        assert agreed.tune.direction() == way
    assert load_config(None, ["tune.metric=selection_accuracy"]).tune.direction() == "max"


def test_the_tune_section_decides_no_result_of_a_run() -> None:
    """``fedlore run`` ignores the section: a run's record (what a resume compares) lacks it."""
    cfg = load_config(None, ["tune.space={lr: 'log:1e-4:1e-1'}", "tune.trials=3"])
    assert "tune" not in result_settings(cfg, "fedlore")
    assert result_settings(cfg, "fedlore") == result_settings(load_config(None), "fedlore")


# refusals on the command line: one line each, no folder -----------------------------------------


LR = ["--space", "lr=log:1e-3:1"]
REFUSED = [
    (
        ["--space", "lrr=log:1e-4:1e-1"],
        "--space lrr=log:1e-4:1e-1: unknown key (did you mean 'lr'?)",
    ),
    (["--space", "lr=log:0:1"], "--space lr=log:0:1: a log range needs LOW above 0"),
    (["--space", "lr=float:0.1:0.01"], "LOW must be below HIGH"),
    (["--space", "lr"], "write KEY=SPEC"),
    (["--space", "seeds=int:1:3"], "not searched"),
    ([*LR, "--space", "lr=log:1e-2:1"], "--space lr is given twice"),
    # a value the config's own validation refuses
    (
        ["--space", "local_steps=int:0:4"],
        "local_steps=0 is refused: local_steps: Input should be greater than or equal to 1",
    ),
    (["--space", "participation=float:0.5:1.5"], "participation=1.5 is refused"),
    # a float range over an integer setting: the value inside the range is refused
    (["--space", "batch_size=float:8:64"], "an integer setting takes int:LOW:HIGH"),
    (["--space", "optim.name=cat:adam,lion"], "optim.name=lion is refused"),
    # the method's own settings: the searched method's, each one it has
    (["--space", "method.fedlore.rank=cat:4,8"], "the search tunes fedavg: write method.fedavg."),
    (["--space", "method.fedavg.rnk=int:1:3"], "FedAvg has no hyperparameter(s) ['rnk']"),
    # a key the searched method's own section overrides: every trial would train the same
    (
        ["--space", "rank=cat:4,8", "algorithms=[fedlore]", "method.fedlore.rank=8"],
        "search space rank=cat:4,8: method.fedlore.rank=8 in the config overrides rank for "
        "fedlore, so every trial would train with it: search method.fedlore.rank instead, or "
        "drop method.fedlore.rank from the config",
    ),
    (
        ["--space", "lr=log:1e-3:1e-1", "method.fedavg.lr=0.1"],
        "method.fedavg.lr=0.1 in the config overrides lr for fedavg",
    ),
    (  # a method's local_epochs replaces the run's local_steps
        ["--space", "local_steps=int:1:3", "method.fedavg.local_epochs=1"],
        "method.fedavg.local_epochs=1 in the config overrides local_steps for fedavg, so every "
        "trial would train with it: search method.fedavg.local_steps instead",
    ),
    (
        ["--space", "optim.eps=log:1e-8:1e-6", "method.fedavg.eps=1e-7"],
        "method.fedavg.eps=1e-7 in the config overrides optim.eps for fedavg",
    ),
    # the objective
    ([*LR, "--metric", "accuracy"], "tune.metric=accuracy is scored on the central test set"),
    ([*LR, "data.selection_fraction=0"], "set data.selection_fraction above 0"),
    ([*LR, "--metric", "train_loss"], "not a score of the selection split"),
    # a misspelt name is not a test-set score (was: "scored on the central test set")
    (
        [*LR, "--metric", "bogus", "--mode", "max"],
        "tune.metric=bogus: not a score of the selection split; the run records selection_",
    ),
    # one method, a sampler that fits the space
    ([*LR, "algorithms=[fedavg,fedfull]"], "name one with --method"),
    ([*LR, "--sampler", "grid"], "the grid sampler needs finite dimensions"),
    # a command-line setting of a method the search leaves out
    ([*LR, "method.fedfull.lr=0.1"], "method 'fedfull' is not in algorithms [fedavg]"),
    ([], "no search space: give --space KEY=SPEC"),
]


@pytest.mark.parametrize(("args", "words"), REFUSED)
def test_bad_input_is_refused_in_one_line_before_any_folder(
    config: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    assert words in refusal(config, capsys, *args)


def test_a_key_another_methods_section_overrides_is_searched(tmp_path: Path) -> None:
    """Only the searched method's section decides: fedfull's rank does not touch fedlore's."""
    extra = ["algorithms=[fedlore, fedfull]", "tune.method=fedlore", "method.fedfull.lr=0.1"]
    space = "tune.space={rank: 'cat:4,8', lr: 'log:1e-3:1e-1'}"
    raw = apply_overrides({}, [*TINY, f"output_dir={tmp_path}", space, *extra])
    search = plan_search(validate(raw), raw, "tiny.yaml")
    assert [d.key for d in search.dims] == ["rank", "lr"]


def test_an_option_out_of_range_is_refused_as_the_config_refuses_it(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["tune", str(config), "--space", "lr=log:1e-3:1", "--trials", "0"]) == 2
    err = capsys.readouterr().err
    assert "invalid config:\n  tune.trials: Input should be greater than or equal to 1" in err
    assert not (config.parent / "runs").exists()


@pytest.mark.parametrize(
    ("metric", "extra", "where"),
    [
        ("accuracy", [], "the central test set"),
        ("loss", [], "the central test set"),
        ("client_accuracy", ["eval.clients=true"], "the clients' test splits"),
        ("local_accuracy", ["eval.local=true"], "the clients' test splits"),
        ("client_loss", ["eval.clients=true"], "the clients' test splits"),
    ],
)
def test_a_test_sets_metric_is_refused_naming_its_selection_twin(
    tmp_path: Path, metric: str, extra: list[str], where: str
) -> None:
    """As early stopping refuses it: the test set named, the selection split's twin and
    data.selection_fraction said."""
    with pytest.raises(ConfigError) as e:
        plan(tmp_path, f"tune.metric={metric}", *extra)
    text = str(e.value)
    twin = "selection_loss" if metric.endswith("loss") else "selection_accuracy"
    assert f"tune.metric={metric} is scored on {where}, which the run reports" in text
    assert f"--metric {twin}, with data.selection_fraction above 0" in text
    assert not tmp_path.joinpath("tiny").exists()


@pytest.mark.parametrize("metric", ["Selection_Accuracy", "selection_acc", "SELECTION_ACCURACY"])
def test_a_capitalised_or_truncated_metric_is_refused_naming_the_score_it_means(
    tmp_path: Path, metric: str
) -> None:
    with pytest.raises(ConfigError) as e:
        plan(tmp_path, f"tune.metric={metric}")
    assert (
        f"tune.metric={metric} is not a known score of the selection split (did you mean "
        "selection_accuracy?)"
    ) in str(e.value)


def test_a_selection_score_the_run_does_not_record_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the run records selection_accuracy, selection_loss"):
        plan(tmp_path, "tune.metric=selection_f1_macro")
    search = plan(tmp_path, "tune.metric=selection_f1_macro", "eval.metrics=[f1_macro]")
    assert search.metric == "selection_f1_macro" and search.direction == "max"


def test_the_method_and_the_run_seed(tmp_path: Path) -> None:
    search = plan(tmp_path)
    assert (search.method, search.run_seed) == ("fedavg", 1)  # the config's first seed
    assert search.folder == tmp_path / "tiny" / "tune"
    assert search.base["algorithms"] == ["fedavg"] and search.base["seeds"] == [1]
    assert "tune" not in search.base
    other = plan(tmp_path, "algorithms=[fedavg, fedfull]", "tune.method=fedfull", "tune.run_seed=7")
    assert (other.method, other.run_seed) == ("fedfull", 7)
    with pytest.raises(ConfigError, match="algorithms: unknown algorithm 'fedal'"):
        plan(tmp_path, "tune.method=fedal")


def test_the_grid_has_every_combination_and_caps_the_trials(tmp_path: Path) -> None:
    search = plan(
        tmp_path,
        "tune.sampler=grid",
        "tune.trials=50",
        space="{local_steps: 'int:1:3', 'optim.name': 'cat:adam,sgd'}",
    )
    assert search.grid() == {"local_steps": [1, 2, 3], "optim.name": ["adam", "sgd"]}
    assert search.trials == 6
    assert plan(tmp_path, "tune.trials=4").trials == 4  # not a grid: as given


# privacy --------------------------------------------------------------------------------------

DP = ["dp.clip_norm=1.0", "dp.noise_multiplier=1.0", "weighting=uniform"]


def test_a_search_under_dp_warns_that_epsilon_covers_one_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "_SAID", set())  # warn_once: once per process
    with pytest.warns(PrivacyWarning, match="its ε is the composition of every DP exchange"):
        plan(tmp_path, *DP, "tune.trials=3")
    monkeypatch.setattr(progress, "_SAID", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyWarning)
        plan(tmp_path, *DP, "tune.search_privacy_accounted=true")  # told: no warning
        plan(tmp_path)  # no DP: no warning


# what it writes and prints ------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [1e-05, 0.001, 0.1, 3.0, 1e20, 2.5e-300, 7, -3, True, False, None, "adam", "yes",
              "a: b", "1e-3", "null", "", "x,y"]
)  # fmt: skip
def test_an_override_reads_back_as_the_same_value(value: Any) -> None:
    """What a trial's config and the printed command set is the value the sampler chose."""
    out = apply_overrides({}, [f"k={scalar(value)}"])["k"]
    assert out == value and type(out) is type(value)


def test_the_command_runs_every_seed_at_the_best_settings(tmp_path: Path) -> None:
    search = plan(tmp_path, "lr=0.5", "tune.trials=3")
    command = run_command(search, {"lr": 1e-05, "local_steps": 3})
    assert command == "fedlore run tiny.yaml lr=1.0e-05 local_steps=3"  # each key once
    steps = plan(tmp_path, "local_steps=4", "lr=0.5")
    assert run_command(steps, {"local_epochs": 2}) == "fedlore run tiny.yaml lr=0.5 local_epochs=2"
    several = plan(tmp_path, "algorithms=[fedavg, fedfull]", "tune.method=fedfull")
    argv = shlex.split(run_command(several, {"method.fedfull.lr": 0.01}))
    assert argv[-2:] == ["algorithms=fedfull", "method.fedfull.lr=0.01"]
    cfg = load_config(None, [*TINY, *argv[3:]])  # the command's overrides, as `fedlore run`
    assert cfg.algorithms == ["fedfull"] and cfg.method["fedfull"]["lr"] == 0.01
    assert cfg.seeds == [1, 2]  # every seed


def test_without_optuna_the_command_says_what_to_install(
    config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna -> ImportError
    line = refusal(config, capsys, "--space", "lr=log:1e-3:1e-1")
    assert line == "fedlore tune needs Optuna, the extra fedlore[tune]: pip install 'fedlore[tune]'"


def test_an_interrupted_search_names_the_same_command() -> None:
    argv = ["tune", "tiny.yaml", "--space", "lr=log:1e-3:1", "--trials", "3"]
    assert cli._again(argv) == "fedlore tune tiny.yaml --space lr=log:1e-3:1 --trials 3"
    assert "continues the search" in cli._resume_hint(argv)
    assert cli._again(["run", "a.yaml"]) == "fedlore run a.yaml --resume"
    repeated = ["run", "a.yaml", "lr=0.1", "rounds=3", "lr=0.2", "--overwrite"]
    assert cli._again(repeated) == "fedlore run a.yaml rounds=3 lr=0.2 --overwrite --resume"


def test_only_a_search_imports_optuna() -> None:
    """``fedlore run`` does not pay for Optuna: the command line, the experiment driver and the
    search's planning import none of it (:mod:`fedlore.tune_study` does, once a search runs)."""
    import subprocess

    code = (
        "import sys, fedlore.cli, fedlore.cli_tune, fedlore.experiment, fedlore.tune, "
        "fedlore.tune_study; assert 'optuna' not in sys.modules, 'optuna imported'"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": src}, check=True)


def test_an_optional_score_not_in_eval_metrics_names_the_exact_fix(tmp_path: Path) -> None:
    """As early stopping words it (checks.stopping._why_not, one rule)."""
    with pytest.raises(ConfigError, match=r"set eval\.metrics=\[balanced_accuracy\]; the run"):
        plan(tmp_path, "tune.metric=selection_balanced_accuracy")


@pytest.mark.parametrize(
    ("items", "kept"),
    [(["lr=0.1", "rounds=3", "lr=0.2"], ["rounds=3", "lr=0.2"]),
     (["model.kwargs={hidden: [8]}", "model={name: mlp}"], ["model={name: mlp}"]),
     (["model={name: mlp}", "model.kwargs={hidden: [8]}"],
      ["model={name: mlp}", "model.kwargs={hidden: [8]}"]),
     (["tracking={mlflow_uri: x}", "tracking=[mlflow]", "tracking=[wandb]"],
      ["tracking={mlflow_uri: x}", "tracking=[wandb]"]),
     (["local_steps=2", "local_epochs=3"], ["local_epochs=3"]),
     (["local_epochs=3", "local_steps=null"], ["local_epochs=3", "local_steps=null"]),
     (["a.yaml", "--resume", "x=1"], ["a.yaml", "--resume", "x=1"])],
)  # fmt: skip
def test_a_printed_command_names_each_key_once_with_the_value_it_takes(
    items: list[str], kept: list[str]
) -> None:
    """The repeated key of a command line (the last one wins) is printed once: what it sets is
    unchanged."""
    from fedlore.config import effective_overrides

    assert effective_overrides(items) == kept
    overrides = [i for i in items if "=" in i and not i.startswith("-")]
    kept = [i for i in kept if i in overrides]
    if not ("local_steps=2" in items and "local_epochs=3" in items):  # refused as given
        assert apply_overrides({}, overrides) == apply_overrides({}, kept)
