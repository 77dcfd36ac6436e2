"""A method of the user's own, in a file named by the config's ``imports``, runs from the command
line and on Flower's simulation workers like a built-in one (before, a registration outside the
package lived only in the Python process that made it). A missing file, a module that fails and
a module that is not importable are one-line config errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedlore import plugins, registry
from fedlore.cli import main
from fedlore.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
NAME = "plugin_fedavg_half"
PLUGIN = f'''
from dataclasses import dataclass
from typing import ClassVar

from fedlore.algorithms.fedavg import FedAvg
from fedlore.registry import register_algorithm


@register_algorithm("{NAME}")
@dataclass(frozen=True)
class FedAvgHalf(FedAvg):
    """FedAvg whose server takes half the mean client delta."""

    name: ClassVar[str] = "{NAME}"
    server_lr: float = 0.5

    def mean_update(self, model, updates, weights):
        step = super().mean_update(model, updates, weights)
        return {{k: self.server_lr * v for k, v in step.items()}}
'''
TINY = [
    "num_clients=3",
    "rounds=2",
    "local_steps=2",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "progress=false",
]


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[Path]:
    """The plugin file; its registration and module are removed afterwards (other tests list
    the registered methods)."""
    path = tmp_path / "my_methods.py"
    path.write_text(PLUGIN)
    yield path
    registry._TABLES["algorithm"].pop(NAME, None)
    sys.modules.pop(plugins.module_name(str(path.resolve())), None)


def test_a_method_from_a_file_runs_from_the_command_line(
    plugin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative path, as a user writes it
    out = tmp_path / "runs"
    args = ["run", str(QUICKSTART), *TINY, "imports=[my_methods.py]", f"output_dir={out}"]
    assert main([*args, f"algorithms=[{NAME},fedavg]"]) == 0
    folder = out / "quickstart" / NAME / "seed-42"
    record = json.loads((folder / "config.json").read_text())
    assert record["imports"] == [str(plugin.resolve())]  # absolute: any process reads it
    assert record["hyper"]["server_lr"] == 0.5
    half = json.loads((folder / "summary.json").read_text())
    full = json.loads((out / "quickstart" / "fedavg" / "seed-42" / "summary.json").read_text())
    assert half["final_loss"] != full["final_loss"]  # the server step is really halved
    assert main([*args, f"algorithms=[{NAME}]", "--resume"]) == 0  # finished: kept


def test_bad_imports_are_one_line_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"imports: .*nowhere\.py: no such file"):
        load_config(None, [f"imports=[{tmp_path / 'nowhere.py'}]"])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match=r"broken\.py raised RuntimeError: boom"):
        load_config(None, [f"imports=[{broken}]"])
    assert plugins.module_name(str(broken)) not in sys.modules  # a later fix is imported again
    with pytest.raises(ConfigError, match=r"cannot import 'no_such_module_here'"):
        load_config(None, ["imports=[no_such_module_here]"])


def test_a_class_that_is_no_method_is_refused_when_registered(tmp_path: Path) -> None:
    """A class without the Algorithm parts (no Hyper base, or Hyper without the four methods)
    is a one-line error at registration, not a traceback when the first run starts."""
    half = tmp_path / "half.py"
    half.write_text(
        "from dataclasses import dataclass\n"
        "from fedlore.algorithms.base import Hyper\n"
        "from fedlore.registry import register_algorithm\n"
        "@register_algorithm('plugin_no_parts')\n"
        "@dataclass(frozen=True)\n"
        "class NoParts(Hyper):\n"
        "    pass\n"
    )
    try:
        with pytest.raises(ConfigError, match=r"'plugin_no_parts': 'NoParts' lacks \['init_se"):
            load_config(None, [f"imports=[{half}]"])
        assert "plugin_no_parts" not in registry._TABLES["algorithm"]
        for part in registry.ALGORITHM_PARTS:  # each part is asked for
            bare = type("Bare", (), {p: None for p in registry.ALGORITHM_PARTS if p != part})
            with pytest.raises(TypeError, match=rf"lacks \['{part}'\]"):
                registry.register_algorithm("plugin_bare")(bare)
    finally:
        registry._TABLES["algorithm"].pop("plugin_no_parts", None)
        registry._TABLES["algorithm"].pop("plugin_bare", None)
        sys.modules.pop(plugins.module_name(str(half.resolve())), None)


@pytest.mark.flower
def test_a_method_from_a_file_runs_on_the_simulation_workers(
    plugin: Path, tmp_path: Path, digits_npz: list[str]
) -> None:
    """Ray's workers are other processes: they import the file when they read the config."""
    pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
    args = [*TINY, *digits_npz, "rounds=1", "flower.num_cpus=2", "flower.client_cpus=2"]
    args += [f"imports=[{plugin}]", f"algorithms=[{NAME}]", "engine=flower-sim"]
    assert main(["run", str(QUICKSTART), *args, f"output_dir={tmp_path / 'sim'}"]) == 0
    assert (tmp_path / "sim" / "quickstart" / NAME / "seed-42" / "summary.json").is_file()


BUGGY = "plugin_buggy"
BUG = f'''
from dataclasses import dataclass
from typing import ClassVar

from fedlore.algorithms.fedavg import FedAvg
from fedlore.registry import register_algorithm


@register_algorithm("{BUGGY}")
@dataclass(frozen=True)
class Buggy(FedAvg):
    """FedAvg whose server fails in round 1, as a user's own code may."""

    name: ClassVar[str] = "{BUGGY}"

    def aggregate(self, state, replies, rnd):
        if rnd == 1:
            raise {{EXC}}("model.nope")
        return super().aggregate(state, replies, rnd)
'''


@pytest.fixture(params=["KeyError", "ValueError", "RuntimeError", "TypeError"])
def buggy(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    path = tmp_path / "buggy.py"
    bug = BUG.replace("{EXC}", request.param)
    if request.param == "TypeError":  # raised inside fedlore's code, by a wrong call of the method
        bug = bug.replace('raise TypeError("model.nope")', "weighted_mean(5, 5)")
        bug = bug.replace(
            "from fedlore.registry",
            "from fedlore.tensors import weighted_mean\nfrom fedlore.registry",
        )
    path.write_text(bug)
    yield path
    registry._TABLES["algorithm"].pop(BUGGY, None)
    sys.modules.pop(plugins.module_name(str(path.resolve())), None)


def test_an_error_in_a_method_names_the_run_the_round_and_what_is_kept(
    buggy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyError or ValueError of a method's own code was printed as a refusal of the
    config: "fedlore: error: 'model.nope'", naming no run, no round, no file, with no way to
    see the traceback. It is one line naming the run, the round, the error's type, the folder
    that keeps the rounds before it and the command that resumes; -v adds the traceback. Any
    other error (a RuntimeError) prints its traceback, then that line, and exits 1.
    (fedlore's own refusals mid-run, which word what they need, stay as they are:
    tests/engine/test_buffered_dp.py.)"""
    text = buggy.read_text()
    kind = next((k for k in ("KeyError", "ValueError", "RuntimeError") if k in text), "TypeError")
    said = "object of type 'int' has no len()" if kind == "TypeError" else "model.nope"
    out = tmp_path / "runs"
    args = ["run", str(QUICKSTART), *TINY, "rounds=3", f"imports=[{buggy}]",
            f"algorithms=[{BUGGY}]", f"output_dir={out}"]  # fmt: skip
    unforeseen = kind in ("RuntimeError", "TypeError")
    assert main(args) == (1 if unforeseen else 2)
    err = capsys.readouterr().err.strip().splitlines()
    folder = out / "quickstart" / BUGGY / "seed-42"
    assert (len(err) > 1) == unforeseen
    assert err[-1].startswith(
        f"fedlore: error: {BUGGY} seed 42, round 1: {kind}: {said} ({folder} keeps the "
        "rounds before it; after a fix, `fedlore run "
    )
    traced = " --resume` resumes)" if unforeseen else " --resume` resumes; -v shows the traceback)"
    assert err[-1].endswith(traced)
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0] and (folder / "checkpoint.pt").exists()
    assert main([*args, "--resume", "-v"]) == (1 if unforeseen else 2)
    verbose = capsys.readouterr().err
    assert "Traceback (most recent call last)" in verbose and f"{kind}: {said}" in verbose
    assert "-v shows the traceback" not in verbose
    assert main([*args, "algorithms=[nope]"]) == 2  # before any run trained: as it was
    early = capsys.readouterr().err
    assert early.startswith("fedlore: error: invalid config:") and "round" not in early
