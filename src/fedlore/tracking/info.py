"""What a tracker is told about one run (:class:`RunInfo`) and what every tracker does
(:class:`Tracker`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class RunInfo:
    """Where one run is and what it is called.

    Attributes:
        experiment: the experiment's name (the MLflow experiment, the W&B project).
        method: the method's name.
        seed: the run's seed.
        out: the folder the run writes now (a replacement writes beside its ``target``).
        target: the run's folder, ``<output_dir>/<name>/<method>/seed-<seed>``.
        exp_dir: the experiment's folder, ``<output_dir>/<name>``.
        mlflow_uri: the MLflow store (None: ``sqlite:///<exp_dir>/mlflow.db``).
    """

    experiment: str
    method: str
    seed: int
    out: Path
    target: Path
    exp_dir: Path
    mlflow_uri: str | None = None

    @property
    def name(self) -> str:
        """The tracked run's name: ``<method>/seed-<seed>``."""
        return f"{self.method}/seed-{self.seed}"


class Tracker(Protocol):
    """One tool's view of one run."""

    def log_params(self, params: dict[str, str]) -> None:
        """The run's settings (flat keys, text values)."""

    def log_round(self, rnd: int, scalars: dict[str, float]) -> None:
        """One round's numeric metrics."""

    def finish(self, summary: dict[str, float], files: Sequence[Path]) -> None:
        """The run finished: its summary's numbers and its files."""

    def abort(self) -> None:
        """The run stopped before its last round (killed, failed): close, marked unfinished."""
