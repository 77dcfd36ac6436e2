"""Weights & Biases, offline only (``mode="offline"``: nothing leaves the machine; ``wandb sync
<run folder>/wandb/offline-run-*`` uploads a run later from a machine that may): one W&B run per
method and seed in the project ``tracking.experiment`` (default: the config's ``name``), grouped
by method, written to ``<run folder>/wandb/``.

Each round's numbers are logged with ``round`` as their step metric (rounds before the first
one, such as FedLore's setup round -1, are not valid W&B steps); the flattened ``config.json``
is the run's config; at the end the summary's numbers go to the run summary as
``summary.<key>`` and ``config.json``, ``metrics.jsonl``, ``summary.json`` to an artifact of
type ``run-files``. A run's W&B folder is written anew when it starts (a resumed run: from the
rows of ``metrics.jsonl`` that survive the resume), so no round is logged twice."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlore.tracking.info import RunInfo


def _init(info: RunInfo, folder: Path, name: str, job: str, config: dict[str, str]) -> Any:
    import wandb

    shutil.rmtree(folder / "wandb", ignore_errors=True)  # made again from fedlore's own record
    folder.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(
        mode="offline",
        silent=True,
        console="off",
        disable_git=True,
        save_code=False,
        x_disable_stats=True,
        x_disable_meta=True,
    )
    return wandb.init(
        project=info.experiment,
        name=name,
        group=info.method,
        job_type=job,
        dir=str(folder),
        config=config,
        settings=settings,
        reinit="create_new",
    )


def _artifact_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


class WandbTracker:
    """One method and seed as one offline W&B run (:class:`fedlore.tracking.base.Tracker`)."""

    def __init__(self, info: RunInfo) -> None:
        self.info = info
        self.run: Any = None

    def log_params(self, params: dict[str, str]) -> None:
        self.run = _init(self.info, self.info.out, self.info.name, "train", params)
        self.run.define_metric("round")
        self.run.define_metric("*", step_metric="round")

    def log_round(self, rnd: int, scalars: dict[str, float]) -> None:
        self.run.log({"round": rnd, **scalars})

    def finish(self, summary: dict[str, float], files: Sequence[Path]) -> None:
        import wandb

        self.run.summary.update({f"summary.{k}": v for k, v in summary.items()})
        name = _artifact_name(f"{self.info.method}-seed-{self.info.seed}")
        artifact = wandb.Artifact(name, type="run-files")
        for f in files:
            artifact.add_file(str(f))
        self.run.log_artifact(artifact)
        self.run.finish()

    def abort(self) -> None:
        self.run.finish(exit_code=1)


def log_report(info: RunInfo, files: Sequence[Path], plots: Sequence[Path]) -> None:
    """The report and plots as an offline run named ``report`` in ``<name>/wandb/``: the plots
    as images, report and plots as an artifact of type ``report``."""
    import wandb

    run = _init(info, info.exp_dir, "report", "report", {})
    run.log({f"plots/{p.stem}": wandb.Image(str(p)) for p in plots})
    artifact = wandb.Artifact(_artifact_name(f"{info.experiment}-report"), type="report")
    for f in [*files, *plots]:
        artifact.add_file(str(f))
    run.log_artifact(artifact)
    run.finish()
