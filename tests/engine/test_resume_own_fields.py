"""A field added to (or removed from) a user's own method between a run and its ``--resume`` is
refused like a changed value, while a field fedlore adds to a built-in method is not.

A run's ``config.json`` records the method's fields (``hyper``); a field the record lacks used
to count as its default, so that a run folder of an older fedlore, whose built-in methods lacked
a field that now has a default, resumes (the behaviour it was made with). That tolerance let a
user's method gain a hyperparameter between the interrupted run and the resume unnoticed: the
run went on with a method it was not started with. Now it holds for the fields fedlore declares
only (:func:`fedlore.engine.run_record.users_fields`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest

from fedlore import registry
from fedlore.algorithms.fedavg import FedAvg
from fedlore.config import Config, ConfigError, load_config
from fedlore.engine.run_record import users_fields
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.settings import LocalTraining

NAME = "own_fields_fedavg"


@dataclass(frozen=True)
class Before(FedAvg):
    """The user's method as the run was started: FedAvg with a server step size."""

    name: ClassVar[str] = NAME
    server_scale: float = 1.0


@dataclass(frozen=True)
class After(Before):
    """The same method, which gained a field since (at a default that changes nothing)."""

    damping: float = 0.0


@dataclass(frozen=True)
class Fewer(FedAvg):
    """The same method, which lost its field since."""

    name: ClassVar[str] = NAME


def _use(cls: type) -> None:
    registry._TABLES["algorithm"][NAME] = cls


@pytest.fixture
def method() -> Iterator[None]:
    _use(Before)
    yield
    registry._TABLES["algorithm"].pop(NAME, None)


def _cfg(out: Path) -> Config:
    return load_config(
        None,
        [
            "num_clients=3",
            "rounds=3",
            "local_steps=2",
            "batch_size=16",
            "model.kwargs={hidden: [16]}",
            "progress=false",
            f"output_dir={out}",
            f"algorithms=[{NAME}]",
        ],
    )


def test_a_field_the_users_method_gained_is_refused_on_resume(tmp_path: Path, method: None) -> None:
    cfg = _cfg(tmp_path)
    assert run_one(cfg, NAME, 42, stop_after=0) is None
    _use(After)
    with pytest.raises(ConfigError) as e:
        run_one(cfg, NAME, 42, resume=True)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"--resume: {run_dir(cfg, NAME, 42)} was started with a different")
    assert f"{NAME}'s field damping: not in the run -> 0.0 (added since)" in text
    assert text.endswith("run without --resume to start over, or restore the config")
    _use(Before)  # restored: it resumes
    assert run_one(cfg, NAME, 42, resume=True) is not None


def test_a_field_the_users_method_lost_is_refused_on_resume(tmp_path: Path, method: None) -> None:
    cfg = _cfg(tmp_path)
    assert run_one(cfg, NAME, 42, stop_after=0) is None
    _use(Fewer)
    with pytest.raises(ConfigError, match=rf"{NAME}'s field server_scale: 1\.0 -> no such field"):
        run_one(cfg, NAME, 42, resume=True)


def test_a_finished_run_of_the_method_before_the_field_is_not_reported_as_this_one(
    tmp_path: Path, method: None
) -> None:
    cfg = _cfg(tmp_path)
    assert run_one(cfg, NAME, 42) is not None
    _use(After)
    with pytest.raises(ConfigError, match=rf"another config \({NAME}'s field damping"):
        run_one(cfg, NAME, 42)


def test_a_field_fedlore_added_to_a_built_in_method_still_resumes(
    tmp_path: Path, method: None
) -> None:
    """The upgrade path: a record of an older fedlore lacks a field of FedAvg's (and of the
    local-training settings) that now has a default; the user's subclass's own field is there.
    It resumes, as before; without the user's field in the record it is refused."""
    cfg = _cfg(tmp_path)
    assert run_one(cfg, NAME, 42, stop_after=0) is None
    path = run_dir(cfg, NAME, 42) / "config.json"
    made = json.loads(path.read_text())
    old = json.loads(json.dumps(made))
    del old["hyper"]["momentum"]  # a field of FedAvg's, fedlore's
    del old["hyper"]["weighting"]  # of its local-training settings, fedlore's
    path.write_text(json.dumps(old))
    assert run_one(cfg, NAME, 42, resume=True) is not None
    (run_dir(cfg, NAME, 42) / "summary.json").unlink()
    del old["hyper"]["server_scale"]  # the user's own
    path.write_text(json.dumps(old))
    with pytest.raises(ConfigError, match=f"{NAME}'s field server_scale: not in the run"):
        run_one(cfg, NAME, 42, resume=True)


def test_users_fields_are_those_declared_outside_fedlore() -> None:
    assert users_fields(Before) == {"hyper.server_scale"}
    assert users_fields(After) == {"hyper.server_scale", "hyper.damping"}
    assert users_fields(FedAvg) == set()

    @dataclass(frozen=True)
    class OwnTraining(FedAvg):  # a settings sub-model the user declares: its fields
        extra: LocalTraining = field(default_factory=LocalTraining)

    assert "hyper.lr" in users_fields(OwnTraining)

    @dataclass(frozen=True)
    class FromFile(FedAvg):
        tempo: float = 1.0

    FromFile.__module__ = "fedlore_imports.my_methods_1a2b3c4d"  # imports: [my_methods.py]
    assert users_fields(FromFile) == {"hyper.tempo"}
    assert users_fields(int) == set()
