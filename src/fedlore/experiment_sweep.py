"""How an experiment's runs are carried out, one after another: the :class:`Engine` that trains
each, the order (seed by seed, every method of a seed on its one federation), and what happens
when a run raises.

Without ``keep_going`` the first run that raises stops the experiment (the error propagates,
naming the run: :func:`fedlore.experiment.run`). With it (``fedlore run --keep-going``) the run
is recorded as failed in its own folder (:mod:`fedlore.engine.failed`), said in one line, and
the next run goes on; once every run has been tried, :class:`RunsFailed` names the failures.
What never counts as a run's failure, and still stops everything: an interrupt (Ctrl-C,
SIGTERM: :class:`~fedlore.engine.interrupt.Interrupted` is no ``Exception``), a refusal of the
command (:class:`~fedlore.config.ConfigError`: another config's finished run in the way, a
changed config under ``--resume``) and a file that cannot be written
(:class:`~fedlore.atomic.WriteError`: a full disk fails every run after it the same way).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fedlore.atomic import WriteError
from fedlore.config import Config, ConfigError
from fedlore.data.federation import Federation, build_federation
from fedlore.engine import failed, overwriting
from fedlore.engine.failed import Failure
from fedlore.engine.loop import Callback
from fedlore.engine.rerun import SUMMARY, staging_dir
from fedlore.engine.rundir import run_dir
from fedlore.experiment_parts import make_algorithm
from fedlore.progress import tell


class RunOne(Protocol):
    """Trains one method for one seed and returns its summary
    (:func:`fedlore.experiment.run_one`'s keywords)."""

    def __call__(
        self,
        cfg: Config,
        method: str,
        seed: int,
        *,
        fed: Federation,
        resume: bool,
        overwrite: bool,
        extra_callbacks: tuple[Callback, ...] = (),
    ) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class Engine:
    """How :func:`fedlore.experiment.run_experiment` carries out each run that trains.

    Attributes:
        run: trains one method for one seed.
        session: when given, entered once before the first run that trains and left when the
            experiment ends, fails or is interrupted (the Simulation Engine's one Ray).
    """

    run: RunOne
    session: Callable[[], AbstractContextManager[object]] | None = None


class RunsFailed(RuntimeError):
    """Runs of a ``keep_going`` experiment that raised; every other run was tried.

    Attributes:
        failures: the failed runs, in the order they ran.
        summaries: method -> the summaries of the runs that finished (as
            :func:`fedlore.experiment.run_experiment` returns them).
        total: how many runs the experiment has.
    """

    def __init__(
        self, failures: list[Failure], summaries: dict[str, list[dict[str, Any]]], total: int
    ) -> None:
        super().__init__(f"{len(failures)} of {total} runs failed")
        self.failures = failures
        self.summaries = summaries
        self.total = total


def with_callbacks(
    run: RunOne,
    callbacks: Callable[[str, int], Sequence[Callback]],
    cfg: Config,
    method: str,
    seed: int,
    *,
    fed: Federation,
    resume: bool,
    overwrite: bool,
    extra_callbacks: tuple[Callback, ...] = (),
) -> dict[str, Any] | None:
    """The engine's ``run`` with the user's callbacks for this method and seed."""
    extra = (*extra_callbacks, *callbacks(method, seed))
    return run(
        cfg, method, seed, fed=fed, resume=resume, overwrite=overwrite, extra_callbacks=extra
    )


def run_all(
    cfg: Config,
    first: Federation,
    resume: bool,
    overwrite: bool,
    engine: Engine,
    out: dict[str, list[dict[str, Any]]],
    keep_going: bool = False,
) -> list[Failure]:
    """Every method x seed of ``cfg``, each summary appended to ``out[method]``; returns the runs
    that failed (only under ``keep_going``: without it the first error propagates)."""
    failures: list[Failure] = []
    # the engine's session (flower-sim: one Ray for every run) is entered by the first run that
    # trains and left when the last ends, fails or is interrupted
    in_session = False
    with contextlib.ExitStack() as session:
        for seed in cfg.seeds:
            fed = first if seed == cfg.seeds[0] else build_federation(cfg, seed)
            # finished runs are reported after the checks of a rerun, under --resume too (a run
            # folder copied from another machine is held to the same rules)
            done, flags = overwriting.plan(cfg, seed, fed, resume, overwrite, make_algorithm)
            for method in cfg.algorithms:
                summary: dict[str, Any] | None = done.get(method)  # finished: said, kept
                if summary is None:
                    if engine.session is not None and not in_session:
                        session.enter_context(engine.session())
                        in_session = True
                    again, over = flags[method]
                    run = functools.partial(engine.run, fed=fed, resume=again, overwrite=over)
                    try:
                        summary = overwriting.run_recorded(cfg, method, seed, overwrite, run)
                    except (ConfigError, WriteError):  # the command's refusal, a full disk
                        raise
                    except Exception as e:
                        if not keep_going:
                            raise
                        failures.append(_failed(cfg, method, seed, e))
                if summary is not None:
                    out[method].append(summary)
    return failures


def _failed(cfg: Config, method: str, seed: int, e: Exception) -> Failure:
    """Record the run of ``method`` and ``seed`` that raised ``e`` as failed, in the folder it
    was writing (a replacement's sibling folder when its run folder holds a finished run), and
    say so in one line."""
    named = getattr(e, "fedlore_run", None)
    target = run_dir(cfg, method, seed)
    folder: Path = named[1] if named is not None else target
    if (folder / SUMMARY).exists():  # never beside a finished run's results
        folder = staging_dir(target)
    failure = failed.record(method, seed, folder, e)
    tell("%s; going on with the other runs (--keep-going)", failure.line())
    return failure
