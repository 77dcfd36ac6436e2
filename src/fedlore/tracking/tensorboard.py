"""TensorBoard (through :class:`torch.utils.tensorboard.SummaryWriter`): event files in
``<run folder>/tensorboard/``, so that ``tensorboard --logdir <output_dir>/<name>`` shows each
method and seed as one run, and the events live and go with their run folder.

A tracked run's events are written anew when it starts: a resumed run's from the rows of
``metrics.jsonl`` that survive the resume (:func:`fedlore.tracking.base.open_tracking`), so no
round is logged twice. What is logged: each round's numbers as scalars (the round as step); the
flattened ``config.json`` as hyperparameters (the HParams tab) and as a text table; the summary
as text. TensorBoard keeps no files: the run's files are beside its events."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlore.tracking.info import RunInfo

FLUSH_S = 5
"""Seconds between flushes of the event file (TensorBoard's own default is 120)."""


def _writer(folder: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    shutil.rmtree(folder, ignore_errors=True)  # made again from fedlore's own record
    return SummaryWriter(log_dir=str(folder), flush_secs=FLUSH_S)


def _table(values: dict[str, str]) -> str:
    lines = ["| key | value |", "|---|---|"]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in values.items()]
    return "\n".join(lines)


class TensorBoardTracker:
    """One run's event file (:class:`fedlore.tracking.base.Tracker`)."""

    def __init__(self, info: RunInfo) -> None:
        self.writer = _writer(info.out / "tensorboard")

    def log_params(self, params: dict[str, str]) -> None:
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(params, {}):  # the HParams plugin's experiment and session
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", _table(params))

    def log_round(self, rnd: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=rnd)

    def finish(self, summary: dict[str, float], files: Sequence[Path]) -> None:
        self.writer.add_text("summary", _table({k: json.dumps(v) for k, v in summary.items()}))
        self.writer.close()

    def abort(self) -> None:
        self.writer.close()


def log_report(info: RunInfo, files: Sequence[Path], plots: Sequence[Path]) -> None:
    """The experiment's ``report.md`` as text and its plots as images, in
    ``<name>/tensorboard-report/`` (written anew each time)."""
    from matplotlib.image import imread

    writer = _writer(info.exp_dir / "tensorboard-report")
    for f in files:
        if f.suffix == ".md":
            writer.add_text("report", f.read_text())
    for p in plots:
        image = imread(p)  # H x W x 4 floats in [0, 1]
        writer.add_image(f"plots/{p.stem}", image[..., :3], dataformats="HWC")
    writer.close()
