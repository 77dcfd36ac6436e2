"""``--overwrite --resume`` under a changed setting refuses, as a plain ``--resume`` does.

An ``--overwrite`` interrupted while it trained a run (a replacement in ``seed-<s>.overwrite``,
or an unfinished run in its own folder) is continued by the same command with ``--resume``.
Given with a setting changed (a typo, a forgotten override), that continuation used to start the
interrupted run over with a warning, discarding its rounds; it now stops with one line naming the
folder, the setting and the ways on, in the command and its dry run, and leaves every file as it
was (:func:`fedlore.engine.overwriting.check_continued`). The runs the ``--overwrite`` had not
reached are replaced as before, whatever config an unfinished run in their folder has.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from interrupting import Interrupt, folder_bytes

from fedlore.cli import main
from fedlore.config import Config, ConfigError, load_config
from fedlore.engine import overwriting
from fedlore.engine.rerun import staging_dir
from fedlore.engine.rundir import run_dir
from fedlore.engine.runstart import StartOverWarning
from fedlore.experiment import run_experiment

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def _args(out: Path, *extra: str) -> list[str]:
    return [
        str(QUICKSTART),
        "name=changed",
        "num_clients=3",
        "rounds=2",
        "local_steps=2",
        "batch_size=16",
        "model.kwargs={hidden: [16]}",
        "algorithms=[fedavg,fedfull]",
        "seeds=[0]",
        f"output_dir={out}",
        "progress=false",
        *extra,
    ]


def _cfg(out: Path, *extra: str) -> Config:
    path, *overrides = _args(out, *extra)
    return load_config(Path(path), overrides)


def _overwrite_stopped_in(out: Path, method: str, *extra: str) -> Config:
    """``--overwrite`` at lr 0.01 of both methods, stopped in ``method``'s round 0."""
    new = _cfg(out, "lr=0.01", *extra)
    stop = {method: [Interrupt(0)]}
    with pytest.raises(KeyboardInterrupt):
        run_experiment(new, overwrite=True, callbacks=lambda m, s: stop.get(m, []))
    return new


def _refused(out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> list[str]:
    """The error line of ``--overwrite --resume`` at lr 0.02, from the command and from its
    dry run (the same line, exit status 2 both)."""
    lines = []
    for dry in ([], ["--dry-run"]):
        capsys.readouterr()
        assert main(["run", *_args(out, "lr=0.02", *extra), "--overwrite", "--resume", *dry]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        lines.append(err[-1])
    assert lines[0] == lines[1], lines
    return lines


def test_a_changed_setting_refuses_to_continue_the_interrupted_replacement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *_args(tmp_path)]) == 0  # finished at the config's lr
    new = _overwrite_stopped_in(tmp_path, "fedfull")  # fedavg replaced, fedfull interrupted
    fedfull = run_dir(new, "fedfull", 0)
    staged = staging_dir(fedfull)
    before = {d: folder_bytes(d) for d in (staged, fedfull, run_dir(new, "fedavg", 0))}
    (line, _) = _refused(tmp_path, capsys)
    assert line.startswith(f"fedlore: error: --overwrite --resume: {staged}, the replacement")
    assert "was started with a different config (lr: 0.01 -> 0.02)" in line
    assert f"restore the config to continue it, or delete {staged}" in line
    assert {d: folder_bytes(d) for d in before} == before  # nothing trained, moved or deleted
    # the way on it names: the config it was started with continues it, not from round 0
    partial = (staged / "metrics.jsonl").read_text()
    assert main(["run", *_args(tmp_path, "lr=0.01"), "--overwrite", "--resume"]) == 0
    assert (fedfull / "metrics.jsonl").read_text().startswith(partial)
    assert json.loads((fedfull / "config.json").read_text())["lr"] == 0.01


def test_a_changed_setting_refuses_to_continue_an_interrupted_run_in_its_own_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No finished run to replace: the --overwrite trained fedavg in its own folder."""
    new = _overwrite_stopped_in(tmp_path, "fedavg")
    fedavg = run_dir(new, "fedavg", 0)
    before = folder_bytes(fedavg)
    (line, _) = _refused(tmp_path, capsys)
    assert f"--overwrite --resume: {fedavg}, the run the --overwrite was training" in line
    assert "(lr: 0.01 -> 0.02)" in line and f"or delete {fedavg} to train it afresh" in line
    assert folder_bytes(fedavg) == before
    # deleting the folder, as the line says, lets the changed config train it afresh
    shutil.rmtree(fedavg)
    assert main(["run", *_args(tmp_path, "lr=0.02"), "--overwrite", "--resume"]) == 0
    assert json.loads((fedavg / "config.json").read_text())["lr"] == 0.02


def test_other_data_refuses_at_the_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same config on data that changed since the run started (its recorded fingerprint
    differs): refused too, naming both fingerprints."""
    assert main(["run", *_args(tmp_path)]) == 0
    new = _overwrite_stopped_in(tmp_path, "fedavg")
    staged = staging_dir(run_dir(new, "fedavg", 0))
    record = json.loads((staged / "config.json").read_text())
    (staged / "config.json").write_text(json.dumps({**record, "data_fingerprint": "0" * 16}))
    with pytest.raises(ConfigError, match=rf"{staged}, the replacement .* on other data"):
        run_experiment(new, resume=True, overwrite=True)
    capsys.readouterr()
    assert main(["run", *_args(tmp_path, "lr=0.01"), "--overwrite", "--resume", "--dry-run"]) == 2
    assert f"fingerprint {'0' * 16} -> " in capsys.readouterr().out


def test_a_run_not_reached_is_replaced_whatever_its_unfinished_config(tmp_path: Path) -> None:
    """fedfull's folder holds an unfinished run of the old lr that the --overwrite never
    reached (it stopped in fedavg): the continuation replaces it, with the usual warning, rather
    than taking it for the interrupted run."""
    old = _cfg(tmp_path)
    stop = {"fedfull": [Interrupt(0)]}
    with pytest.raises(KeyboardInterrupt):
        run_experiment(old, callbacks=lambda m, s: stop.get(m, []))  # fedavg done, fedfull not
    new = _overwrite_stopped_in(tmp_path, "fedavg")
    fedfull = run_dir(new, "fedfull", 0)
    assert json.loads((fedfull / "config.json").read_text())["lr"] != 0.01
    with pytest.warns(StartOverWarning, match="fedfull seed 0: starting over"):
        run_experiment(new, resume=True, overwrite=True)
    for m in ("fedavg", "fedfull"):
        assert json.loads((run_dir(new, m, 0) / "config.json").read_text())["lr"] == 0.01
    assert not (tmp_path / "changed" / overwriting.RECORD).exists()


def test_a_record_without_started_runs_starts_the_run_over_as_before(tmp_path: Path) -> None:
    """A record written before the started runs were kept cannot tell the interrupted run from
    one not reached: its continuation starts it over, as it used to."""
    assert main(["run", *_args(tmp_path)]) == 0
    new = _overwrite_stopped_in(tmp_path, "fedavg")
    record = tmp_path / "changed" / overwriting.RECORD
    raw = json.loads(record.read_text())
    assert raw["started"] == ["fedavg/seed-0"]
    record.write_text(json.dumps({k: v for k, v in raw.items() if k != "started"}))
    other = _cfg(tmp_path, "lr=0.02")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run_experiment(other, resume=True, overwrite=True)
    assert any(issubclass(w.category, StartOverWarning) for w in said)
    assert json.loads((run_dir(new, "fedavg", 0) / "config.json").read_text())["lr"] == 0.02
