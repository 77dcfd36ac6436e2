"""``fedlore run | tune | report | partition | track | fortunes-c4``: the command line.

* ``fedlore run [CONFIG] [key=value ...] [--resume] [--overwrite] [--keep-going]`` runs every
  method x seed of the config (default: ``experiments/quickstart.yaml``), prints the mean ± std
  table and the folder the results are in; options may come anywhere on the line
  (:mod:`fedlore.cli_run`).
* ``fedlore report RUN_DIR`` writes ``report.md``, ``report.csv`` and plots and prints the table.
* ``fedlore partition CONFIG [key=value ...] [--plot FILE]`` prints each client's class
  histogram per seed (documents per source group for a pre-training corpus) and, with
  ``--plot``, draws it (:mod:`fedlore.data.label_plot`).
* ``fedlore tune CONFIG [key=value ...] --space KEY=SPEC ... [--trials N] ...`` searches one
  method's hyperparameters on the selection split (:mod:`fedlore.cli_tune`, on Optuna).
* ``fedlore track CONFIG [key=value ...]`` sends the config's finished runs and its report to
  the trackers of its ``tracking`` section again (a tracker that failed during the run, or one
  added since), from the runs' own files.
* ``fedlore fortunes-c4 OUT_DIR [--root FOLDER]`` converts Debian's fortunes corpus into C4-format
  ``c4-train.jsonl`` / ``c4-validation.jsonl`` (one source host per category file).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlore import progress
from fedlore.atomic import WriteError, explain
from fedlore.cli_parser import build_parser
from fedlore.config import Config, ConfigError, effective_overrides, load_config
from fedlore.engine import interrupt
from fedlore.engine.store import StoreError

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from fedlore.data.federation import Federation
    from fedlore.engine.loop import Callback
    from fedlore.experiment import Engine

DEFAULT_CONFIG = "experiments/quickstart.yaml"


def _in_process() -> Engine:
    from fedlore.experiment import IN_PROCESS

    return IN_PROCESS


def _flower_sim() -> Engine:
    from fedlore.experiment import Engine

    def simulate(
        cfg: Config,
        method: str,
        seed: int,
        *,
        fed: Federation,
        resume: bool,
        overwrite: bool,
        extra_callbacks: tuple[Callback, ...] = (),
    ) -> dict[str, Any] | None:
        from fedlore.flower.simulation import run_simulated  # when a run trains, not before

        return run_simulated(cfg, method, seed, resume, overwrite, extra_callbacks)

    def ray_session() -> AbstractContextManager[object]:
        from fedlore.flower.simulation import ray_session

        return ray_session()

    return Engine(simulate, session=ray_session)


ENGINES: dict[str, Callable[[], Engine]] = {"local": _in_process, "flower-sim": _flower_sim}
"""The config's ``engine`` -> the :class:`~fedlore.experiment_sweep.Engine` that carries out its
runs: ``local`` trains every run in this process (:func:`fedlore.experiment.run_one`);
``flower-sim`` on Flower's Simulation Engine (:func:`fedlore.flower.simulation.run_simulated`,
one Ray for the whole experiment). Flower is imported only once a simulated run trains, so
finished runs are reported without it. A ``flwr run`` deployment runs the ServerApp instead
(:mod:`fedlore.flower.app`)."""


def _default_config() -> Path:
    """``experiments/quickstart.yaml`` in the working directory, else in the source checkout."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        cand = base / DEFAULT_CONFIG
        if cand.is_file():
            return cand
    raise ConfigError(
        f"no config given and {DEFAULT_CONFIG} was not found in {Path.cwd()} or the source tree"
    )


def _split_args(items: list[str]) -> tuple[Path | None, list[str]]:
    config = None
    overrides = []
    for it in items:
        if "=" in it:
            overrides.append(it)
        elif config is None:
            config = Path(it)
        else:
            raise ConfigError(f"unexpected argument {it!r}: give one CONFIG, then key=value")
    return config, overrides


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    """fedlore's own warnings (an unfinished run in a report, ...) as one ``fedlore: warning:``
    line, not Python's file-and-line format; other libraries' warnings as Python shows them."""
    if category.__module__.startswith("fedlore"):
        print(f"fedlore: warning: {message}", file=sys.stderr)
    else:
        _PYTHON_SHOWWARNING(message, category, filename, lineno, None, line)


_PYTHON_SHOWWARNING = warnings.showwarning


def _again(argv: list[str], overwrite_began: bool | None = None) -> str:
    """The command that continues an interrupted one: ``fedlore run ... --resume``, or the same
    ``fedlore tune ...`` (a search always continues). An ``--overwrite`` stopped before it
    began (no ``overwriting.json`` yet: nothing was replaced, and ``--overwrite --resume`` would
    be refused) is continued by the same command; ``overwrite_began`` None looks on disk."""
    if argv[:1] == ["tune"]:
        return shlex.join(["fedlore", *argv])
    run = effective_overrides(argv)  # each key once, with the value it takes
    resume = "--resume" in argv
    if not resume and "--overwrite" in argv:
        resume = _overwrite_began(argv) if overwrite_began is None else overwrite_began
        if not resume:
            return shlex.join(["fedlore", *run])
    return shlex.join(["fedlore", *run, *([] if "--resume" in argv else ["--resume"])])


def _overwrite_began(argv: list[str]) -> bool:
    """Whether the experiment folder of the ``fedlore run --overwrite`` line ``argv`` holds the
    record of an ``--overwrite`` under way (True, too, when the line's config cannot be read)."""
    from fedlore.engine.overwriting import RECORD

    try:
        items = [a for a in argv[1 if argv[:1] == ["run"] else 0 :] if not a.startswith("-")]
        path, overrides = _split_args(items)
        cfg = load_config(path if path is not None else _default_config(), overrides)
    except Exception:  # a hint, never an error of its own
        return True
    return (Path(cfg.output_dir) / cfg.name / RECORD).is_file()


def _resume_hint(argv: list[str]) -> str:
    """What continues the interrupted command: the exact ``fedlore run ... --resume`` line, the
    same ``fedlore tune`` line, or words for the other commands."""
    if argv[:1] == ["tune"]:
        return (
            f"`{_again(argv)}` continues the search (finished trials are kept, a cut-off one "
            "resumes from its last checkpoint)"
        )
    if argv[:1] != ["run"] and not (argv and argv[0].endswith((".yaml", ".yml"))):
        return "nothing was left half-written"
    return f"`{_again(argv)}` continues unfinished runs from their last checkpoint"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fedlore`` command; returns the exit status.

    After a Ctrl-C (or SIGTERM) the command ends in one line however the interrupted code
    failed: an import cut short by ``KeyboardInterrupt`` can raise anything (a
    ``RecursionError`` inside numpy was seen), and that is reported as the interrupt it is."""
    command = argv is None  # the fedlore command itself (not a call from Python)
    args = list(sys.argv[1:] if argv is None else argv)
    # the command counts from its process's start: a library's import may have swallowed the
    # KeyboardInterrupt of a Ctrl-C while the command loaded (leaving a module half-imported)
    before = 0 if command else interrupt.signals()
    if command:  # a second Ctrl-C ends the process at once, with the same hint
        interrupt.say_on_force_exit(lambda: _resume_hint(args))
    try:
        if interrupt.signals() > before:  # that Ctrl-C: nothing runs
            raise KeyboardInterrupt
        return _main(args, command)
    except BaseException as e:
        if isinstance(e, SystemExit) or interrupt.signals() == before:
            raise
        print(f"fedlore: interrupted; {_resume_hint(args)}", file=sys.stderr)
        if command:
            interrupt.exit_now(130)
        return 130


def _report_written(path: Path, out: Path | None = None) -> str:
    """Where ``fedlore report PATH [--out OUT]`` wrote: the experiment's files, or each
    experiment's."""
    from fedlore.results.store import is_experiment_dir

    if is_experiment_dir(path):
        return f"report written to {out or path}/report.md (with report.csv and the plots)"
    where = (
        f"a folder per experiment under {out}" if out else (f"each experiment folder under {path}")
    )
    return f"reports written in {where} (report.md, report.csv and the plots in each)"


def _main(argv: list[str], command: bool) -> int:
    """:func:`main`'s work, on the arguments ``argv``."""
    warnings.showwarning = _show_warning
    parser = build_parser()
    verbose = any(a in ("-v", "--verbose") for a in argv)  # -v anywhere on the line
    argv = [a for a in argv if a not in ("-v", "--verbose")]
    ns, extra = parser.parse_known_args(argv)
    ns.verbose = verbose
    # options may come anywhere: `run CONFIG --resume name=x` leaves name=x over, still ours
    if (
        extra
        and getattr(ns, "args", None) is not None
        and not any(e.startswith("-") for e in extra)
    ):
        ns.args = [*ns.args, *extra]
    elif extra:  # the usage of whichever took it: fedlore's (before the command) or the command's
        before = argv[: argv.index(ns.command)] if ns.command in argv else []
        if any(e in before for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[ns.command].error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if ns.command == "report":
            from fedlore.results.report import report

            progress.enable(False)  # what happened to the files (progress.tell) is still said
            if ns.print_only:
                print(report(ns.run_dir, write=False, baseline=ns.baseline))
                return 0
            try:
                print(report(ns.run_dir, baseline=ns.baseline, out=ns.out))
            except WriteError as e:  # a folder it cannot write: the table all the same, then why
                print(report(ns.run_dir, write=False, baseline=ns.baseline), flush=True)
                if ns.out is None:  # the runs' own folder: say how to report without writing it
                    hint = "; or give --out DIR to write the report elsewhere (--print-only: none)"
                    print(f"fedlore: error: {explain(e)}{hint}", file=sys.stderr)
                    return 2
                raise
            print(_report_written(ns.run_dir, ns.out))
            return 0
        if ns.command == "fortunes-c4":
            from fedlore.data.fortunes_c4 import convert_fortunes

            for written in convert_fortunes(ns.out_dir, ns.root):
                with written.open(encoding="utf-8") as f:
                    lines = sum(1 for _ in f)
                print(f"wrote {written} ({lines} documents)")
            return 0
        path, overrides = _split_args(ns.args)
        if ns.command == "tune":
            from fedlore.cli_tune import tune_command

            return tune_command(ns, path if path is not None else _default_config(), overrides,
                                ENGINES)  # fmt: skip
        cfg = load_config(path if path is not None else _default_config(), overrides)
        progress.enable(cfg.progress)
        if ns.command == "partition":
            from fedlore.data.federation import build_federation

            if cfg.flower.site_data:  # each site's folder is its data: nothing is partitioned
                raise ConfigError(
                    "flower.site_data=true: each SuperNode reads its own data-root, so there is "
                    "no partition to show; check a site's folder with "
                    "fedlore.flower.sites.site_federation (docs: how-to/site-local-data)"
                )
            if ns.plot is not None:
                _check_plot_path(ns.plot)
            for seed in cfg.seeds:
                fed = build_federation(cfg, seed)
                print(f"# {cfg.name}: {cfg.data.name}, {cfg.partition.name} partition, seed {seed}")
                print(fed.format_histogram())
                if ns.plot is not None:
                    from fedlore.data.label_plot import save_label_plot

                    plot = ns.plot
                    if len(cfg.seeds) > 1:
                        plot = plot.with_name(f"{plot.stem}-seed{seed}{plot.suffix}")
                    print(f"label distribution written to {save_label_plot(fed, plot)}")
            return 0
        if ns.command == "track":
            from fedlore.cli_track import track_command

            return track_command(cfg)
        from fedlore.cli_run import run_command

        engine = ENGINES[cfg.engine]() if not ns.dry_run else None
        return run_command(ns, cfg, overrides, engine, _again(argv, True), command)
    except (ConfigError, FileNotFoundError, KeyError, ValueError, StoreError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        lead, tail = _failed_in(e, argv, ns.verbose)
        print(f"fedlore: error: {lead}{msg}{tail}", file=sys.stderr)
        if ns.verbose and getattr(e, "fedlore_run", None) is not None:
            traceback.print_exc()
        return 2
    except WriteError as e:  # a full disk, a quota, no permission: one line and what to do
        print(f"fedlore: error: {explain(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError as e:  # `fedlore ... | head`: the reader has gone, nothing to tell it
        if not _stdout_closed():  # another pipe (a worker, a socket): an error like any other
            print(f"fedlore: error: {e.strerror or e}", file=sys.stderr)
            return 2
        _quiet_stdout()
        return 141  # as a tool the pipe's SIGPIPE ends (128 + 13)
    except OSError as e:  # a folder that cannot be created or written (output_dir, a data root)
        where = f": {e.filename}" if e.filename else ""
        print(f"fedlore: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except Exception as e:  # unforeseen: while a run trained, its traceback and where it was
        if getattr(e, "fedlore_run", None) is None:
            raise
        traceback.print_exc()
        lead, tail = _failed_in(e, argv, verbose=True, always=True)
        print(f"fedlore: error: {lead}{e}{tail}", file=sys.stderr)
        return 1
    except interrupt.Interrupted as e:  # before KeyboardInterrupt, which it is
        print(f"fedlore: {e.describe(f'`{_again(argv)}`')}", file=sys.stderr)
        if command:  # every file is closed: skip Python's shutdown (seconds once torch is in)
            interrupt.exit_now(e.status)
        return e.status
    except KeyboardInterrupt:
        print(f"fedlore: interrupted; {_resume_hint(argv)}", file=sys.stderr)
        if command:  # Python's shutdown after a Ctrl-C could end the process by SIGINT (-2)
            interrupt.exit_now(130)
        return 130


def _failed_in(
    e: BaseException, argv: list[str], verbose: bool, always: bool = False
) -> tuple[str, str]:
    """For an error raised while a run trained, what goes before and after its message: the
    run and the round; what is kept and how to go on (a method's own ``ValueError`` or
    ``KeyError`` read "fedlore: error: 'model.x'" and nothing else). Empty for an error before
    any run trained, and for a refusal fedlore raised itself unless ``always``."""
    run = getattr(e, "fedlore_run", None)
    if run is None or (_raised_by_fedlore(e) and not always):
        return "", ""  # fedlore's own refusals mid-run name what they need
    name, folder = run
    rnd = getattr(e, "fedlore_round", None)
    at = "" if rnd is None else f", round {rnd}"
    kind = "" if isinstance(e, (ConfigError, StoreError)) else f"{type(e).__name__}: "
    kept = f"{folder} keeps the rounds before it" if rnd else f"{folder} holds no round of it"
    trace = "" if verbose else "; -v shows the traceback"
    return f"{name}{at}: {kind}", f" ({kept}; after a fix, `{_again(argv)}` resumes{trace})"


def _raised_by_fedlore(e: BaseException) -> bool:
    """Whether the innermost frame of ``e`` is fedlore's own code (a refusal it words itself),
    not a method's of the user's, a library's or Python's."""
    frames = traceback.extract_tb(e.__traceback__)
    package = Path(__file__).resolve().parent
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(package)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (``poll`` reports an error on it)."""
    import select

    try:
        fd = sys.stdout.fileno()
        watch = select.poll()
        watch.register(fd, select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in watch.poll(0))
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return False


def _quiet_stdout() -> None:
    """Point stdout at the null device, so that Python's flush at exit does not fail again on
    the closed pipe (Python's documented way: the signal module's notes on SIGPIPE)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def _check_plot_path(plot: Path) -> None:
    """``fedlore partition --plot FILE``: refuse, before any data is read, a FILE that is empty
    or a folder, or whose folder does not exist.

    Raises:
        ValueError: naming the problem and an example.
    """
    if str(plot) in ("", ".") or plot.is_dir():
        raise ValueError(f"--plot {str(plot)!r}: give an image file name, e.g. --plot labels.png")
    if not plot.parent.is_dir():
        raise ValueError(
            f"--plot {plot}: the folder {plot.parent} does not exist; create it or write the "
            "plot elsewhere"
        )


if __name__ == "__main__":
    raise SystemExit(main())
