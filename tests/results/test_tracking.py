"""Experiment tracking (fedlore.tracking) read back with each tool's own reader: TensorBoard's
event accumulator, MLflow's client on the SQLite store, and W&B's record protobufs from the
offline run's transaction log. What the trackers hold must equal the run's own files, a killed
and resumed run must be tracked once per round, and a tracker that fails must not stop a run."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from fedlore.cli import main
from fedlore.config import Config, ConfigError, load_config
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_experiment, run_one
from fedlore.tracking.base import TrackingWarning

pytest.importorskip("mlflow", reason="the tracking extra: pip install 'fedlore[tracking]'")
pytest.importorskip("wandb", reason="the tracking extra: pip install 'fedlore[tracking]'")
pytest.importorskip("tensorboard", reason="the tracking extra: pip install 'fedlore[tracking]'")

SEED = 5
ROUNDS = 3
ALL = "tracking=[tensorboard,mlflow,wandb]"


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "name=tracked",
        "num_clients=3",
        f"rounds={ROUNDS}",
        "local_steps=2",
        "batch_size=16",
        "rank=4",
        "model.kwargs={hidden: [32]}",
        "partition.min_size=10",
        "progress=false",
        f"seeds=[{SEED}]",
        f"output_dir={out}",
        *extra,
    ]


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(None, _args(out, *extra))


def _rows(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["round"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


# -- the readers ---------------------------------------------------------------------------


def _tensorboard(folder: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


def _mlflow(exp_dir: Path) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{exp_dir / 'mlflow.db'}")


def _mlflow_runs(client: Any, name: str, deleted: bool = False) -> list[Any]:
    from mlflow.entities import ViewType

    exp = client.get_experiment_by_name(name)
    view = ViewType.DELETED_ONLY if deleted else ViewType.ACTIVE_ONLY
    return list(client.search_runs([exp.experiment_id], run_view_type=view))


def _wandb_records(folder: Path) -> list[Any]:
    """Every record of an offline W&B run's ``run-<id>.wandb`` under ``folder``: wandb's
    transaction log is LevelDB's log format (32 KiB blocks of chunks with a 7-byte header:
    crc32c, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte W&B header, each record one
    ``wandb_internal_pb2.Record``. wandb 0.31 reads it in its Go core only, so the chunks are
    joined here and parsed with wandb's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data = log.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's trailer
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            # wandb builds its protobuf classes at import (no stubs): mypy cannot see Record
            record = pb.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            records.append(record)
    return records


def _key(item: Any) -> str:
    """A record item's key (``key``, or the parts of ``nested_key`` joined by ``/``)."""
    return str(item.key or "/".join(item.nested_key))


def _items(records: list[Any], kind: str, field: str) -> list[dict[str, Any]]:
    """The ``field`` items of every ``kind`` record, one mapping per record."""
    return [
        {_key(item): json.loads(item.value_json) for item in getattr(getattr(r, kind), field)}
        for r in records
        if r.WhichOneof("record_type") == kind
    ]


def _wandb_history(records: list[Any]) -> list[dict[str, Any]]:
    return _items(records, "history", "item")


# -- one tracked experiment, read back ------------------------------------------------------


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tracked")
    assert main(["run", *_args(out, "algorithms=[fedlore,fedfull]", ALL)]) == 0
    return out / "tracked"


def test_tensorboard_holds_every_round_the_config_and_the_report(tracked: Path) -> None:
    from tensorboard.plugins.hparams import plugin_data_pb2

    for method in ("fedlore", "fedfull"):
        folder = tracked / method / f"seed-{SEED}"
        acc = _tensorboard(folder / "tensorboard")
        rows = _rows(folder)
        for key in ("accuracy", "train_loss", "bytes_up"):
            got = [(e.step, e.value) for e in acc.Scalars(key)]
            want = _series(rows, key)
            assert [s for s, _ in got] == [s for s, _ in want]
            assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
        content = acc.PluginTagToContent("hparams")
        session = plugin_data_pb2.HParamsPluginData.FromString(
            content["_hparams_/session_start_info"]
        ).session_start_info
        record = json.loads((folder / "config.json").read_text())
        assert session.hparams["method"].string_value == method
        assert session.hparams["optim.name"].string_value == record["optim"]["name"]
        assert session.hparams["hyper.lr"].string_value == json.dumps(record["hyper"]["lr"])
        assert "config/text_summary" in acc.Tags()["tensors"]
        assert "summary/text_summary" in acc.Tags()["tensors"]
    report = _tensorboard(tracked / "tensorboard-report")
    assert "report/text_summary" in report.Tags()["tensors"]
    assert {"plots/accuracy_vs_round", "plots/accuracy_vs_bytes"} <= set(report.Tags()["images"])


def test_mlflow_holds_one_run_per_method_and_seed_with_its_files(
    tracked: Path, tmp_path: Path
) -> None:
    client = _mlflow(tracked)
    runs = {r.info.run_name: r for r in _mlflow_runs(client, "tracked")}
    assert set(runs) == {f"fedlore/seed-{SEED}", f"fedfull/seed-{SEED}", "report"}
    for method in ("fedlore", "fedfull"):
        run = runs[f"{method}/seed-{SEED}"]
        folder = tracked / method / f"seed-{SEED}"
        assert run.info.status == "FINISHED"
        assert run.data.tags["fedlore.folder"] == str(folder.resolve())
        history = client.get_metric_history(run.info.run_id, "accuracy")
        got = sorted((m.step, m.value) for m in history)
        want = _series(_rows(folder), "accuracy")
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want])
        record = json.loads((folder / "config.json").read_text())
        assert run.data.params["seed"] == str(SEED)
        assert run.data.params["hyper.lr"] == json.dumps(record["hyper"]["lr"])
        summary = json.loads((folder / "summary.json").read_text())
        assert run.data.metrics["summary.final_accuracy"] == pytest.approx(
            summary["final_accuracy"]
        )
        files = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert files == {"config.json", "metrics.jsonl", "summary.json"}
        local = Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path)))
        assert json.loads(local.read_text()) == summary
    report = runs["report"]
    names = {a.path for a in client.list_artifacts(report.info.run_id)}
    assert {"report.md", "report.csv", "plots"} <= names
    plots = {a.path for a in client.list_artifacts(report.info.run_id, "plots")}
    assert "plots/accuracy_vs_round.png" in plots
    assert (tracked / "mlartifacts").is_dir()  # not in the working directory


def test_wandb_offline_run_holds_every_round_the_config_and_the_summary(tracked: Path) -> None:
    folder = tracked / "fedlore" / f"seed-{SEED}"
    records = _wandb_records(folder)
    history = _wandb_history(records)
    want = _series(_rows(folder), "accuracy")
    assert [h["round"] for h in history if "accuracy" in h] == [s for s, _ in want]
    got = [h["accuracy"] for h in history if "accuracy" in h]
    assert got == pytest.approx([v for _, v in want])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {_key(item): json.loads(item.value_json) for item in run.config.update}
    assert config["method"] == "fedlore"
    assert config["seed"] == str(SEED)
    summary = {k: v for part in _items(records, "summary", "update") for k, v in part.items()}
    want = json.loads((folder / "summary.json").read_text())
    assert summary["summary.final_accuracy"] == pytest.approx(want["final_accuracy"])
    assert run.project == "tracked"
    assert run.display_name == f"fedlore/seed-{SEED}"
    assert (tracked / "wandb").is_dir()  # the report's run


# -- kill, resume, failure ------------------------------------------------------------------


def test_a_killed_and_resumed_run_is_tracked_once_per_round(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "rounds=4", ALL)
    assert run_one(cfg, "fedfull", SEED, stop_after=1) is None  # killed after round 1
    folder = run_dir(cfg, "fedfull", SEED)
    client = _mlflow(folder.parent.parent)
    (killed,) = _mlflow_runs(client, "tracked")
    assert killed.info.status == "KILLED"
    assert run_one(cfg, "fedfull", SEED, resume=True) is not None
    rows = _rows(folder)
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    (live,) = _mlflow_runs(client, "tracked")
    assert live.info.status == "FINISHED"
    assert [r.info.run_id for r in _mlflow_runs(client, "tracked", deleted=True)] == [
        killed.info.run_id
    ]
    steps = [m.step for m in client.get_metric_history(live.info.run_id, "train_loss")]
    assert sorted(steps) == [0, 1, 2, 3]
    assert [e.step for e in _tensorboard(folder / "tensorboard").Scalars("train_loss")] == [
        0,
        1,
        2,
        3,
    ]
    history = _wandb_history(_wandb_records(folder))
    assert [h["round"] for h in history if "train_loss" in h] == [0, 1, 2, 3]
    got = [h["train_loss"] for h in history if "train_loss" in h]
    assert got == pytest.approx([r["train_loss"] for r in rows])


def test_a_replacement_run_leaves_one_live_mlflow_run(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "tracking=[mlflow]", "algorithms=[fedavg]")
    run_experiment(cfg)
    run_experiment(cfg, overwrite=True)
    client = _mlflow(tmp_path / "tracked")
    assert len(_mlflow_runs(client, "tracked")) == 1
    assert len(_mlflow_runs(client, "tracked", deleted=True)) == 1


def test_a_failing_tracker_warns_and_the_run_finishes(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "tracking={backends: [mlflow], mlflow_uri: 'bogus://nowhere'}")
    with pytest.warns(TrackingWarning, match="tracking: mlflow failed"):
        summary = run_one(cfg, "fedavg", SEED)
    assert summary is not None
    assert (run_dir(cfg, "fedavg", SEED) / "summary.json").exists()


def test_track_sends_finished_runs_to_a_tracker_they_did_not_have(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    """``fedlore track``: a run made without tracking (or whose tracker failed) is sent
    afterwards, every round and the summary; an unfinished run is named, not sent; the results
    stay as they were."""
    args = _args(tmp_path, "algorithms=[fedavg]", "seeds=[5,6,7]")
    assert main(["run", *args]) == 0
    (run_dir(_cfg(tmp_path, "algorithms=[fedavg]"), "fedavg", 6) / "summary.json").unlink()
    folder = tmp_path / "tracked" / "fedavg" / f"seed-{SEED}"
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["track", *args]) == 2  # no tracker named
    assert "names none; add e.g. tracking=[mlflow]" in capsys.readouterr().err
    assert main(["track", *args, "tracking=[tensorboard]"]) == 0
    out = capsys.readouterr().out
    assert f"fedavg seed {SEED}: {ROUNDS} rounds and the summary sent to tensorboard" in out
    assert "fedavg seed 6: not finished" in out and "report of" in out
    acc = _tensorboard(folder / "tensorboard")
    rows = _rows(folder)
    assert [e.step for e in acc.Scalars("accuracy")] == [s for s, _ in _series(rows, "accuracy")]
    assert "summary/text_summary" in acc.Tags()["tensors"]
    assert not (tmp_path / "tracked" / "fedavg" / "seed-6" / "tensorboard").exists()
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    # a tracker that cannot be reached: tried once, no claim that anything was sent
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    down = ["tracking=[mlflow]", f"tracking.mlflow_uri=http://127.0.0.1:{port}"]
    assert main(["track", *args, *down]) == 1  # nothing sent
    out, err = capsys.readouterr()
    assert err.count("tracking: mlflow failed") == 1 and "Retrying" not in err
    assert "fedlore: nothing sent: every tracker failed under" in err
    assert f"fedavg seed {SEED}: {ROUNDS} rounds and the summary sent to no tracker" in out
    assert "fedavg seed 7: not sent (every tracker failed)" in out and "report of" not in out


def test_track_sends_nothing_of_another_config_and_says_when_nothing_was_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name with no runs, or with runs of other settings, sends nothing and exits 1: it said
    `not finished` of a folder that did not exist, and sent a 2-round run as this config's."""
    args = _args(tmp_path, "algorithms=[fedavg]")
    assert main(["track", *args, "tracking=[tensorboard]"]) == 1
    out, err = capsys.readouterr()
    assert "nothing sent: no finished run of this config" in err
    assert "not finished" not in out and f"fedavg seed {SEED}: no run (" in out
    assert main(["run", *args]) == 0
    longer = [*args, f"rounds={ROUNDS + 1}", "tracking=[tensorboard]"]
    capsys.readouterr()
    assert main(["track", *longer]) == 1
    out, err = capsys.readouterr()
    assert f"not sent: {tmp_path}" in out and f"another config (rounds: {ROUNDS} -> " in out
    assert "nothing sent" in err
    folder = tmp_path / "tracked" / "fedavg" / f"seed-{SEED}"
    assert not (folder / "tensorboard").exists()
    # a method with a setup round: its rows are counted apart from the rounds
    lore = _args(tmp_path, "algorithms=[fedlore]")
    assert main(["run", *lore]) == 0
    capsys.readouterr()
    assert main(["track", *lore, "tracking=[tensorboard]"]) == 0
    out = capsys.readouterr().out
    assert f"fedlore seed {SEED}: {ROUNDS} rounds (plus 1 setup round) and the summary" in out


def test_a_tracking_server_that_is_down_is_given_up_in_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's own HTTP retries would hold the run for about four minutes."""
    import os
    import socket
    import time

    from fedlore.tracking.mlflow_store import HTTP_DEFAULTS

    for key in HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    with socket.socket() as s:  # a free port: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = _cfg(tmp_path, f"tracking={{backends: [mlflow], mlflow_uri: 'http://127.0.0.1:{port}'}}")
    start = time.monotonic()
    with pytest.warns(TrackingWarning, match="tracking: mlflow failed"):
        summary = run_one(cfg, "fedavg", SEED)
    assert summary is not None and time.monotonic() - start < 60
    assert {k: os.environ[k] for k in HTTP_DEFAULTS} == HTTP_DEFAULTS


def test_a_tracker_without_its_package_is_refused_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"wandb needs the wandb package.*fedlore\[tracking\]"):
        run_experiment(_cfg(tmp_path, "tracking=[wandb]"))
    assert not (tmp_path / "tracked").exists()


def test_tracking_settings_are_checked_and_do_not_change_a_run(tmp_path: Path) -> None:
    assert _cfg(tmp_path, "tracking=tensorboard").tracking.backends == ["tensorboard"]
    assert _cfg(tmp_path, "tracking=[mlflow,wandb]").tracking.backends == ["mlflow", "wandb"]
    uri = "tracking.mlflow_uri=http://127.0.0.1:9"
    for order in (["tracking=[mlflow]", uri], [uri, "tracking=[mlflow]"]):  # either order
        both = _cfg(tmp_path, *order).tracking
        assert (both.backends, both.mlflow_uri) == (["mlflow"], "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="tracker named twice: mlflow"):
        _cfg(tmp_path, "tracking=[mlflow,mlflow]")
    with pytest.raises(ConfigError, match="tensorbored"):
        _cfg(tmp_path, "tracking=[tensorbored]")
    first = run_experiment(_cfg(tmp_path, "algorithms=[fedavg]"))
    again = run_experiment(_cfg(tmp_path, "algorithms=[fedavg]", "tracking=[tensorboard]"))
    assert again == first  # the finished run is kept, not trained again
