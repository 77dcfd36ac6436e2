"""MLflow (its :class:`mlflow.tracking.MlflowClient`, no global active run): one MLflow run per
method and seed in the experiment ``tracking.experiment`` (default: the config's ``name``),
tagged ``fedlore.folder`` with the run's folder.

The store is ``tracking.mlflow_uri``, by default ``sqlite:///<output_dir>/<name>/mlflow.db``
(the full ``mlflow`` package; ``mlflow-skinny`` reads and writes only a ``file:`` store), and an
experiment fedlore creates keeps its artifacts in ``<output_dir>/<name>/mlartifacts/``, not in
the working directory. ``mlflow ui --backend-store-uri sqlite:///runs/<name>/mlflow.db`` shows it.

Each round's numbers are metrics with the round as step; the flattened ``config.json`` is the
run's parameters; at the end the summary's numbers are metrics ``summary.<key>`` and
``config.json``, ``metrics.jsonl`` and ``summary.json`` are artifacts. A run started for a folder
first deletes (MLflow's soft delete, undone by ``mlflow runs restore``) that folder's runs a kill
left unfinished, since the new run logs again every round they held; when it finishes it deletes
the finished run of the same folder it replaces: one live MLflow run per method and seed."""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlore.tracking.info import RunInfo

FOLDER_TAG = "fedlore.folder"
"""The tag naming a tracked run's folder (the run's identity across resumes)."""

KIND_TAG = "fedlore.kind"
"""``run`` for a method and seed, ``report`` for the experiment's report."""

BATCH = 100
"""Entries per ``log_batch`` call (MLflow takes at most 100 parameters per call)."""


def _key(name: str) -> str:
    """A metric or parameter name MLflow accepts (letters, digits and ``_-. /:``)."""
    return "".join(c if c.isalnum() or c in "_-. /:" else "_" for c in name)


def store_uri(info: RunInfo) -> str:
    """``tracking.mlflow_uri``, or the SQLite store in the experiment folder."""
    if info.mlflow_uri:
        return info.mlflow_uri
    info.exp_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{info.exp_dir / 'mlflow.db'}"


def _client_and_experiment(info: RunInfo) -> tuple[Any, str]:
    """The client and the experiment's id. A SQLite store is created and migrated under an OS
    lock on ``<db>.lock``: two runs of one experiment starting at once (a sweep with
    ``--jobs 2``) would otherwise race MLflow's table creation and one would lose its
    tracking."""
    uri = store_uri(info)
    if not uri.startswith("sqlite:///"):
        return _open(uri, info)
    with open(uri[len("sqlite:///") :] + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        return _open(uri, info)


HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
"""MLflow's HTTP settings for a tracking server, where the user has not set them: MLflow's own
(7 retries, backoff factor 2, 120 s timeout) keep a run waiting about four minutes for a server
that is down before the tracker is switched off; these give up after seconds (a refused
connection) or about two minutes (a server that never answers)."""


def _open(uri: str, info: RunInfo) -> tuple[Any, str]:
    if uri.startswith(("http://", "https://")):
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        # each retry's "Retrying (...)" line: the one warning that the tracker is off suffices
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    from mlflow.tracking import MlflowClient

    # MLflow says at INFO level when it creates a SQLite store's tables: not fedlore's news
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(info.experiment)  # creates the store's tables
    if found is not None:
        return client, str(found.experiment_id)
    where = (info.exp_dir / "mlartifacts").as_uri()
    return client, str(client.create_experiment(info.experiment, artifact_location=where))


def _runs_of(client: Any, experiment: str, folder: Path, kind: str) -> list[Any]:
    quoted = str(folder).replace("'", "\\'")
    flt = f"tags.`{FOLDER_TAG}` = '{quoted}' and tags.`{KIND_TAG}` = '{kind}'"
    return list(client.search_runs([experiment], filter_string=flt, max_results=1000))


class MLflowTracker:
    """One method and seed as one MLflow run (:class:`fedlore.tracking.base.Tracker`)."""

    def __init__(self, info: RunInfo) -> None:
        self.client, self.experiment = _client_and_experiment(info)
        self.folder = info.target
        for run in _runs_of(self.client, self.experiment, self.folder, "run"):
            if run.info.status != "FINISHED":  # a killed run's record: logged again now
                self.client.delete_run(run.info.run_id)
        tags = {
            FOLDER_TAG: str(self.folder),
            KIND_TAG: "run",
            "fedlore.method": info.method,
            "fedlore.seed": str(info.seed),
        }
        run = self.client.create_run(self.experiment, run_name=info.name, tags=tags)
        self.run_id = str(run.info.run_id)

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(_key(k), v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + BATCH])

    def _metrics(self, values: dict[str, float], step: int, prefix: str = "") -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(_key(prefix + k), v, now, step) for k, v in values.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + BATCH])

    def log_round(self, rnd: int, scalars: dict[str, float]) -> None:
        self._metrics(scalars, rnd)

    def finish(self, summary: dict[str, float], files: Sequence[Path]) -> None:
        self._metrics(summary, int(summary.get("rounds", 0)), "summary.")
        for f in files:
            self.client.log_artifact(self.run_id, str(f))
        self.client.set_terminated(self.run_id, "FINISHED")
        for run in _runs_of(self.client, self.experiment, self.folder, "run"):
            if run.info.run_id != self.run_id:  # the run this one replaces
                self.client.delete_run(run.info.run_id)

    def abort(self) -> None:
        self.client.set_terminated(self.run_id, "KILLED")


def log_report(info: RunInfo, files: Sequence[Path], plots: Sequence[Path]) -> None:
    """The report and plots as the artifacts of a run named ``report`` (the experiment's earlier
    report run deleted, MLflow's soft delete)."""
    client, experiment = _client_and_experiment(info)
    earlier = _runs_of(client, experiment, info.exp_dir, "report")
    tags = {FOLDER_TAG: str(info.exp_dir), KIND_TAG: "report"}
    run_id = str(client.create_run(experiment, run_name="report", tags=tags).info.run_id)
    for f in files:
        client.log_artifact(run_id, str(f))
    for p in plots:
        client.log_artifact(run_id, str(p), artifact_path="plots")
    client.set_terminated(run_id, "FINISHED")
    for run in earlier:
        client.delete_run(run.info.run_id)
