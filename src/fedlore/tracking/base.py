"""What every tracker does with a run, whatever the tool: the metrics row of each round as scalars,
the run's ``config.json`` as flat parameters, the summary and the run's files at its end; and the
experiment's report (table and plots) once every run is done."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlore.progress import say
from fedlore.tracking.info import RunInfo, Tracker

if TYPE_CHECKING:
    from fedlore.config import Config
    from fedlore.types import State

BACKENDS = ("tensorboard", "mlflow", "wandb")
"""The trackers ``tracking`` may name."""

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json")
"""A finished run's files that a tracker keeps as artifacts."""


def flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as dotted keys with text values (``{"optim": {"lr": 0.1}}`` ->
    ``{"optim.lr": "0.1"}``); lists and empty mappings are JSON text."""
    out: dict[str, str] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        elif isinstance(v, str):
            out[key] = v
        else:
            out[key] = json.dumps(v)
    return out


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row or summary (``round``, lists, text and missing values
    left out; booleans as 0/1)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k == "round" or isinstance(v, str) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


def _rows(path: Path) -> list[dict[str, Any]]:
    """The whole rows of ``metrics.jsonl`` (a half-written last line is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "round" in row:
            rows.append(row)
    return rows


class TrackingWarning(UserWarning):
    """A tracker failed and is off for the rest of the run (the command line shows it as one
    ``fedlore: warning:`` line)."""


def _attempt(name: str, call: Callable[[], object]) -> bool:
    """Run ``call``; on an error warn once, naming tracker ``name`` and the error's first line
    (at most 200 characters), and return False."""
    try:
        call()
    except Exception as e:  # a view of the record failed, not the record
        why = (str(e).strip().splitlines() or [""])[0][:200]
        warnings.warn(
            f"tracking: {name} failed and is off for the rest of this run "
            f"({type(e).__name__}: {why}); the run's own files are complete",
            TrackingWarning,
            stacklevel=3,
        )
        return False
    return True


class Tracking:
    """The run's trackers as one round callback (:class:`fedlore.engine.loop.Callback`), with
    :meth:`finish` and :meth:`abort` for the run's end. Without trackers it does nothing.

    A tracker that fails (a store that went away, a full disk) is dropped with one warning
    naming it and the error: training goes on, and the run's own files stay complete."""

    def __init__(self, trackers: Iterable[tuple[str, Tracker]] = ()) -> None:
        self.trackers = dict(trackers)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, call: Callable[[Tracker], object]) -> None:
        for name, tracker in list(self.trackers.items()):
            if not _attempt(name, functools.partial(call, tracker)):
                del self.trackers[name]

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        values = scalars(row)
        self._each(lambda t: t.log_round(rnd, values))

    def finish(self, summary: dict[str, Any], out: Path) -> list[str]:
        """Log ``summary``'s numbers and the run's files in ``out``; close every tracker.

        Returns:
            The trackers that took them (a failing one is warned about and left out)."""
        files = [out / f for f in RUN_FILES if (out / f).exists()]
        values = scalars(summary)
        self._each(lambda t: t.finish(values, files))
        done = list(self.trackers)
        self.trackers.clear()
        return done

    def abort(self) -> None:
        """Close every tracker with the run unfinished."""
        self._each(lambda t: t.abort())
        self.trackers.clear()


def _start(backend: str, info: RunInfo) -> Tracker:
    if backend == "tensorboard":
        from fedlore.tracking.tensorboard import TensorBoardTracker

        return TensorBoardTracker(info)
    if backend == "mlflow":
        from fedlore.tracking.mlflow_store import MLflowTracker

        return MLflowTracker(info)
    if backend == "wandb":
        from fedlore.tracking.wandb_offline import WandbTracker

        return WandbTracker(info)
    raise ValueError(f"unknown tracker {backend!r}; one of {', '.join(BACKENDS)}")


def run_info(cfg: Config, method: str, seed: int, out: Path, target: Path) -> RunInfo:
    """The :class:`RunInfo` of one run of ``cfg``."""
    exp_dir = Path(cfg.output_dir) / cfg.name
    return RunInfo(
        cfg.tracking.experiment or cfg.name,
        method,
        seed,
        out.resolve(),
        target.resolve(),
        exp_dir.resolve(),
        cfg.tracking.mlflow_uri,
    )


def open_tracking(cfg: Config, method: str, seed: int, out: Path, target: Path) -> Tracking:
    """The trackers of ``cfg.tracking`` started for one run, each given the run's parameters
    (``out/config.json`` flattened, with ``method`` and ``seed``) and the rows ``metrics.jsonl``
    already holds (a resumed run: the rounds before its checkpoint; a fresh run: none)."""
    if not cfg.tracking.backends:
        return Tracking()
    info = run_info(cfg, method, seed, out, target)
    record = json.loads((out / "config.json").read_text())
    # the method's own overrides are in ``hyper.*`` (resolved); ``method`` names the method
    params = {**flat_params(record), "method": method, "seed": str(seed)}
    replay = _rows(out / "metrics.jsonl")
    tracking = Tracking()
    for backend in cfg.tracking.backends:

        def begin(backend: str = backend) -> None:
            tracker = _start(backend, info)
            tracker.log_params(params)
            for row in replay:
                tracker.log_round(int(row["round"]), scalars(row))
            tracking.trackers[backend] = tracker

        _attempt(backend, begin)  # a tracker that cannot start: warned, off for this run
    if replay and tracking:
        say("%s seed %d: its %d recorded rounds sent to the trackers", method, seed, len(replay))
    return tracking


def track_finished(cfg: Config, runs: Iterable[tuple[str, int, Path]]) -> list[str]:
    """Send finished runs to the trackers of ``cfg.tracking`` again (``fedlore track``): for
    each ``(method, seed, folder)`` holding a ``summary.json``, every ``metrics.jsonl`` row,
    the parameters, the summary and the files, as the run itself would have at its end (a
    tracker that failed or was not configured during the run; MLflow replaces the folder's
    earlier tracked run, TensorBoard and W&B rewrite their folders). Runs without a summary
    are left out and named.

    Returns:
        One line per run: what was sent, or why not.
    """
    lines = []
    working: list[str] = list(cfg.tracking.backends)  # a tracker that failed: not tried again
    for method, seed, folder in runs:
        summary = folder / "summary.json"
        if not folder.is_dir():  # never run under this name (a typo in name=, another output_dir)
            lines.append(f"{method} seed {seed}: no run ({folder} does not exist)")
            continue
        if not summary.exists():
            lines.append(f"{method} seed {seed}: not finished ({folder} has no summary.json)")
            continue
        if not working:
            lines.append(f"{method} seed {seed}: not sent (every tracker failed)")
            continue
        tracking = open_tracking(with_backends(cfg, working), method, seed, folder, folder)
        done = tracking.finish(json.loads(summary.read_text()), folder)
        working = [b for b in working if b in done]
        rows = _rows(folder / "metrics.jsonl")
        setup = sum(1 for r in rows if isinstance(r.get("round"), int) and r["round"] < 0)
        what = f"{len(rows) - setup} rounds"
        what += f" (plus {setup} setup round{'s' * (setup > 1)})" if setup else ""
        to = ", ".join(done) or "no tracker (its failure is warned about above)"
        lines.append(f"{method} seed {seed}: {what} and the summary sent to {to}")
    return lines


def with_backends(cfg: Config, backends: Sequence[str]) -> Config:
    """``cfg`` with ``tracking.backends`` replaced."""
    return cfg.model_copy(
        update={"tracking": cfg.tracking.model_copy(update={"backends": backends})}
    )


MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""The package each tracker needs (the extra ``fedlore[tracking]`` installs all three)."""


def tracking_problems(cfg: Config) -> list[str]:
    """What stops ``cfg.tracking`` before any run starts: a tracker whose package is not
    installed."""
    return [
        f"tracking: {b} needs the {MODULES[b]} package: pip install 'fedlore[tracking]'"
        for b in cfg.tracking.backends
        if importlib.util.find_spec(MODULES[b]) is None
    ]


def report_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(report.md and report.csv, the plots) an experiment folder holds."""
    files = [folder / f for f in ("report.md", "report.csv") if (folder / f).exists()]
    return files, sorted(folder.glob("*.png"))


def track_report(cfg: Config, folder: Path) -> list[str]:
    """Send the experiment's report (``report.md``, ``report.csv``) and plots in ``folder`` to
    each tracker of ``cfg.tracking``: TensorBoard's ``<folder>/tensorboard-report/`` (the table
    as text, the plots as images), an MLflow run named ``report``, an offline W&B run named
    ``report``.

    Returns:
        The trackers that took the report (a failing one is warned about and left out)."""
    files, plots = report_files(folder)
    if not files and not plots:
        return []
    info = RunInfo(
        cfg.tracking.experiment or cfg.name,
        "report",
        0,
        folder.resolve(),
        folder.resolve(),
        folder.resolve(),
        cfg.tracking.mlflow_uri,
    )
    took: list[str] = []
    for backend in cfg.tracking.backends:
        if backend == "tensorboard":
            from fedlore.tracking.tensorboard import log_report
        elif backend == "mlflow":
            from fedlore.tracking.mlflow_store import log_report
        else:
            from fedlore.tracking.wandb_offline import log_report
        if _attempt(backend, functools.partial(log_report, info, files, plots)):
            took.append(backend)
    return took
