"""The command a Ctrl-C prints for an ``--overwrite`` stopped before it began (while the data
or the model were being built: nothing replaced, no ``overwriting.json``) is the same command,
which runs: ``--overwrite --resume`` there is refused (exit status 2), as there is no
interrupted ``--overwrite`` to continue. Once the replacement began, the hint adds
``--resume``."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from fedlore import cli
from fedlore import experiment as experiment_module

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
TINY = [
    "name=hint",
    "num_clients=3",
    "rounds=1",
    "local_steps=2",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "algorithms=[fedfull]",
    "seeds=[42]",
    "progress=false",
]


def test_ctrl_c_before_an_overwrite_began_hints_a_command_that_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["run", str(QUICKSTART), *TINY, f"output_dir={tmp_path}"]
    assert cli.main(base) == 0  # a finished run
    again = [*base, "lr=1e-2", "--overwrite"]

    def cut(*_: Any, **__: Any) -> Any:  # a Ctrl-C while the federation is built
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(experiment_module, "build_federation", cut)
        assert cli._main(again, command=False) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    hinted = err.split("`")[1]
    assert hinted.startswith("fedlore run ") and "--overwrite" in hinted
    assert "--resume" not in hinted, err  # nothing to continue: --resume would be refused
    assert cli.main(shlex.split(hinted)[1:]) == 0  # the hinted command runs
    folder = tmp_path / "hint"
    (folder / "overwriting.json").write_text("{}")  # an --overwrite under way
    assert cli._again(again).endswith("--overwrite --resume")
