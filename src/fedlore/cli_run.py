"""``fedlore run``: run every method x seed of an experiment, then print its table.

:func:`run_command` is the command's work once its config is loaded (:func:`fedlore.cli.main`
parses the line, handles the errors it ends with and knows the engines). With
``--keep-going`` a run that raises is recorded as failed and the others go on
(:mod:`fedlore.experiment_sweep`); the command then prints the table of the finished runs, one
line per failed run and ``N of M runs failed``, and exits with status 1.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fedlore.config import Config
from fedlore.engine import interrupt

if TYPE_CHECKING:
    from fedlore.experiment import Engine

FAILED_STATUS = 1
"""The exit status of ``fedlore run --keep-going`` when a run failed."""


def run_command(
    ns: argparse.Namespace,
    cfg: Config,
    overrides: list[str],
    engine: Engine | None,
    again: str,
    command: bool,
) -> int:
    """Run the experiment of ``cfg`` with the flags of ``ns`` on ``engine`` (an
    :class:`~fedlore.experiment_sweep.Engine`; None only for ``--dry-run``) and print its table;
    returns the exit status.

    Args:
        again: the ``fedlore run ... --resume`` line that continues this command.
        command: the ``fedlore`` command itself (not a call from Python): an interrupt ends
            the process at once.
    """
    from fedlore.checks import check_overrides
    from fedlore.experiment import RunsFailed, run_experiment

    check_overrides(cfg, overrides)  # a setting of a method the run leaves out
    if ns.dry_run:
        from fedlore.dry_run import describe, plan_runs

        planned = plan_runs(cfg, ns.resume, ns.overwrite)
        print(describe(cfg, planned))
        return 2 if any(p.action == "refuse" for p in planned) else 0
    failures = None
    with interrupt.handling():  # SIGINT / SIGTERM stop between rounds, exit 130 / 143
        try:
            summaries = run_experiment(
                cfg, ns.resume, ns.overwrite, engine, keep_going=ns.keep_going
            )
        except RunsFailed as e:  # --keep-going: every other run was tried
            summaries, failures = e.summaries, e
    folder = Path(cfg.output_dir) / cfg.name
    status = _report(cfg, folder, finished=any(summaries.values()), command=command)
    if status is not None:
        return status
    for method, runs in summaries.items():
        for summary in runs:
            if summary.get("diverged"):
                print(
                    f"fedlore: warning: {method} seed {summary['seed']} diverged "
                    f"({summary['diverged']})",
                    file=sys.stderr,
                )
    if any(summaries.values()):
        print(
            f"results in {folder}/ (report.md, report.csv, plots; one folder per method and seed)"
        )
    if failures is None:
        return 0
    for failure in failures.failures:
        print(f"fedlore: error: {failure.line()}", file=sys.stderr)
    print(
        f"fedlore: error: {len(failures.failures)} of {failures.total} runs failed; after a fix, "
        f"`{again}` retries them (the finished ones are kept)",
        file=sys.stderr,
    )
    return FAILED_STATUS


def _report(cfg: Config, folder: Path, finished: bool, command: bool) -> int | None:
    """Write and print the report of ``folder`` and send it to the trackers; the exit status
    when interrupted, else None. Nothing when no run has finished (every run failed under
    ``--keep-going``: there is no table to make)."""
    from fedlore.results.report import report

    if not finished:
        return None
    try:
        print(report(folder), flush=True)  # the table before any warning about it
        if cfg.tracking.backends:
            from fedlore.tracking import track_report

            track_report(cfg, folder)  # the table and plots to each tracker (tracking: [...])
    except KeyboardInterrupt:  # every run has ended: only the report is left to write
        again = shlex.join(["fedlore", "report", str(folder)])
        print(
            f"fedlore: interrupted while writing the report; every run had finished (in "
            f"{folder}/), and `{again}` writes the report",
            file=sys.stderr,
        )
        if command:
            interrupt.exit_now(130)
        return 130
    return None
