"""A run that failed, recorded in its own folder: ``fedlore run --keep-going``.

With ``keep_going`` (:func:`fedlore.experiment.run_experiment`) a run whose code raises (a
method's own ``ValueError``, a library's error, a Flower simulation that wrote no summary) does
not stop the experiment: :func:`record` writes :data:`FAILED` in the folder the run was writing
(atomically: :func:`fedlore.atomic.write_json`) with the error's type, message, the round it
was raised in and its traceback, and the next run goes on. A folder that holds a finished run
is never written: a failed ``--overwrite`` replacement records its failure in its sibling folder
(:func:`~fedlore.engine.rerun.staging_dir`), and the finished run stays as it was.

A failed run is unfinished (it has no ``summary.json``): ``--resume`` continues it from its last
checkpoint, a plain rerun starts it over, and either removes the record when the run starts
training again (:func:`clear`). ``fedlore report`` names it and leaves it out of the table
(:mod:`fedlore.results.failed_runs`). :data:`FAILED` holds ``{"method", "seed", "error",
"message", "round", "traceback", "failed_at"}``.
"""

from __future__ import annotations

import datetime
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlore.atomic import write_json
from fedlore.results.failed_runs import FAILED

__all__ = ["FAILED", "Failure", "clear", "record"]


@dataclass(frozen=True)
class Failure:
    """One run that raised under ``keep_going``.

    Attributes:
        method: the run's method.
        seed: its seed.
        error: the exception's type name (``ValueError``).
        message: the exception's message.
        round: the round it was raised in (None: before the first round, e.g. while the run was
            built).
        record: the :data:`FAILED` file written (None: it could not be written; ``message``
            then says why after the error's own).
    """

    method: str
    seed: int
    error: str
    message: str
    round: int | None
    record: Path | None

    def line(self) -> str:
        """One line for the end of the command: the run, the round, the error, the record."""
        at = "" if self.round is None else f", round {self.round}"
        where = f" (traceback in {self.record})" if self.record is not None else ""
        return f"{self.method} seed {self.seed}{at}: {self.error}: {self.message}{where}"


def record(method: str, seed: int, folder: Path, e: BaseException) -> Failure:
    """Write :data:`FAILED` for the run of ``method`` and ``seed`` that raised ``e`` into
    ``folder`` (created when the run failed before making it), unless ``folder`` holds a
    finished run (``summary.json``): that is never touched. A record that cannot be written
    (a full disk) is said in the returned failure's message, not raised: the command goes on
    to the next run as it would have."""
    rnd = getattr(e, "fedlore_round", None)
    failure = Failure(method, seed, type(e).__name__, str(e), rnd, None)
    if (folder / "summary.json").exists():  # a finished run's results are never replaced
        return failure
    raw: dict[str, Any] = {
        "method": method,
        "seed": seed,
        "error": failure.error,
        "message": failure.message,
        "round": rnd,
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
        "failed_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / FAILED, raw)
    except OSError as err:
        why = f"{failure.message} [its record was not written: {err}]"
        return Failure(method, seed, failure.error, why, rnd, None)
    return Failure(method, seed, failure.error, failure.message, rnd, folder / FAILED)


def clear(folder: Path) -> None:
    """A run starts training again in ``folder``: its earlier failure is no longer its state."""
    (folder / FAILED).unlink(missing_ok=True)
