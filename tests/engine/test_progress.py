"""What a person following a run sees (issue: progress a person can follow anywhere).

* off a terminal, one line per round (round, method, seed, score, seconds) on standard error;
* on a terminal, a rich bar that stays on screen when the run ends;
* long startup steps are named (building the federation, partition redraws);
* ``fedlore run`` with ``-v`` anywhere on the line; ``progress=false`` prints no round lines.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedlore import progress
from fedlore.cli import main
from fedlore.config import load_config
from fedlore.data.partition import partition_dirichlet
from fedlore.engine.callbacks import ProgressBar
from fedlore.experiment import run_one
from fedlore.types import State

SMALL = [
    "num_clients=3",
    "rounds=2",
    "local_steps=2",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "algorithms=[fedavg]",
    "seeds=[0]",
]


@pytest.fixture(autouse=True)
def _progress_off_after() -> Iterator[None]:
    yield
    progress.enable(False)


def test_off_a_terminal_each_round_prints_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    progress.enable(True)  # what the command line does
    cfg = load_config(None, [*SMALL, "progress=true", f"output_dir={tmp_path}"])
    run_one(cfg, "fedavg", 0)
    err = capsys.readouterr().err
    assert "fedlore: building the federation: digits, 3 clients, dirichlet partition" in err
    lines = [line for line in err.splitlines() if " seed 0: " in line]
    assert len(lines) == 2
    for k, line in enumerate(lines, start=1):
        assert re.fullmatch(
            rf"fedlore: round {k}/2 fedavg seed 0: accuracy 0\.\d{{4}} \(\d+\.\d s\)", line
        ), line


def test_progress_false_prints_no_round_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    progress.enable(True)
    cfg = load_config(None, [*SMALL, "progress=false", f"output_dir={tmp_path}"])
    run_one(cfg, "fedavg", 0)
    assert "round 1/2" not in capsys.readouterr().err


def test_a_library_user_who_configures_nothing_sees_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(None, [*SMALL, "progress=true", f"output_dir={tmp_path}"])
    run_one(cfg, "fedavg", 0)
    assert capsys.readouterr().err == ""


def test_rounds_without_evaluation_show_the_training_loss(
    capsys: pytest.CaptureFixture[str],
) -> None:
    progress.enable(True)
    bar = ProgressBar("fedlore seed 3", 0, 5, rounds=5, tty=False)
    bar.on_round_end(0, {"train_loss": 1.5, "wall_s": 0.25}, State({}, {}))
    bar.on_round_end(-1, {"wall_s": 0.5}, State({}, {}))  # a setup exchange
    bar.on_round_end(1, {"perplexity": 123.456, "wall_s": 2.0}, State({}, {}))
    bar.close()
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "fedlore: round 1/5 fedlore seed 3: train loss 1.5000 (0.2 s)",
        "fedlore: setup round fedlore seed 3 (0.5 s)",
        "fedlore: round 2/5 fedlore seed 3: perplexity 123.46 (2.0 s)",
    ]


def test_on_a_terminal_the_bar_stays_when_the_run_ends() -> None:
    bar = ProgressBar("fedavg seed 0", 0, 2, tty=True)
    try:
        assert bar.progress is not None and bar.progress.live.transient is False
        bar.on_round_end(0, {"accuracy": 0.5}, State({}, {}))
        assert bar.progress.tasks[0].completed == 1
    finally:
        bar.close()


def test_a_partition_redraw_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    progress.enable(True)
    labels = np.repeat(np.arange(10), 20)
    # 40 clients with at least 5 examples each out of 200 at α=0.05: redraws are certain
    with pytest.raises(ValueError, match="no draw"):
        partition_dirichlet(labels, 40, np.random.default_rng(0), alpha=0.05, min_size=5)
    assert "redraw" in capsys.readouterr().err


def test_verbose_and_options_anywhere_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*SMALL, f"output_dir={tmp_path}", "name=cli"]
    assert main(["run", "--resume", *args, "-v"]) == 0
    captured = capsys.readouterr()
    assert "round 2/2 fedavg seed 0" in captured.err
    assert f"results in {tmp_path / 'cli'}/" in captured.out


def test_a_message_said_once_is_said_once_per_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within a command (:func:`fedlore.progress.command`, which ``run_experiment`` and
    ``fedlore report`` are in) a warning is given once for all its runs, and again by the next
    command; outside any command once per process. A command within one is part of it."""
    import warnings

    monkeypatch.setattr(progress, "_SAID", set())

    def said(*messages: str) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # Python's own once-per-place filter off
            for m in messages:
                progress.warn_once(m, UserWarning)
        return [str(w.message) for w in caught]

    for _ in range(2):  # each command: once
        with progress.command():
            assert progress.in_command()
            assert said("a", "a", "b") == ["a", "b"]
            with progress.command():  # nested: the outer command's
                assert said("a") == []
    assert not progress.in_command()
    assert said("a", "a") == ["a"] and said("a") == []  # outside: once per process
    seen: list[str] = []

    @progress.command()
    def command() -> None:
        seen.extend(said("c", "c"))

    command()
    command()
    assert seen == ["c", "c"]
