"""The ``fedlore`` argument parser (:func:`build_parser`): its commands, options and help, the
text ``fedlore --help`` prints and the docs' CLI reference is generated from. What each command
does is :mod:`fedlore.cli`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_EPILOG = (
    "CONFIG is a YAML experiment file (default: experiments/quickstart.yaml); key=value "
    "arguments override its keys (dotted for sections, e.g. data.noise=0.1 "
    "method.fedlore.rank=4). Every key: the configuration reference of the docs "
    "(docs/reference/config)."
)


def _version() -> str:
    """``fedlore X (torch Y, flwr Z, Python V)``: what a bug report needs."""
    from importlib import metadata

    parts = []
    for dist in ("torch", "flwr"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    try:
        own = metadata.version("fedlore")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        from fedlore import __version__ as own
    python = ".".join(str(v) for v in sys.version_info[:3])
    return f"fedlore {own} ({', '.join(parts)}, Python {python})"


def build_parser() -> argparse.ArgumentParser:
    """The ``fedlore`` argument parser (its help is the CLI reference of the docs)."""
    parser = argparse.ArgumentParser(
        prog="fedlore",
        allow_abbrev=False,  # `--ov` must not mean --overwrite: only whole option names
        description="fedlore: federated learning experiments (FedLore, Meta-BayFL and their "
        "baselines) from a YAML config.",
        epilog=_EPILOG,
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO level (anywhere on the line)"
    )
    parser.add_argument(
        "--version", action="version", version=_version(), help="print the versions and exit"
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="what to do (one of these)"
    )
    p_run = sub.add_parser(
        "run",
        allow_abbrev=False,
        help="run every method x seed of an experiment and print its table",
        description="Run every method x seed of CONFIG (each in its own folder under "
        "output_dir/name), then write and print the report (mean ± std over seeds). A finished "
        "run is never trained again unless --overwrite is given; an unfinished one starts over "
        "unless --resume is given. Options may come anywhere on the line.",
        epilog=_EPILOG,
    )
    p_run.add_argument(
        "args",
        nargs="*",
        metavar="CONFIG|key=value",
        help="the experiment file, then overrides of its keys",
    )
    p_run.add_argument(
        "--resume",
        action="store_true",
        help="continue unfinished runs from their last checkpoint (to the same result)",
    )
    p_run.add_argument(
        "--overwrite",
        action="store_true",
        help="train finished runs again, also of another config left under the same name (each "
        "finished run stays in place until its replacement has finished); with --resume, "
        "continue an interrupted --overwrite",
    )
    p_run.add_argument(
        "--keep-going",
        action="store_true",
        help="when a run raises, record it as failed in its folder (failed.json: the error, "
        "its round and traceback) and go on with the other runs; at the end name each failed "
        "run and exit with status 1 (--resume retries them). Ctrl-C and SIGTERM still stop "
        "everything",
    )
    p_run.add_argument(
        "--dry-run",
        action="store_true",
        help="say what the command would do with each run (train, continue from its "
        "checkpoint, keep as finished, or refuse), with these flags, and exit: nothing is "
        "trained or written (exit status 2 when it would refuse)",
    )
    _add_tune(sub)
    p_rep = sub.add_parser(
        "report",
        allow_abbrev=False,
        help="summarize a run directory (report.md, report.csv, plots)",
        description="Write report.md, report.csv and the plots of an experiment folder "
        "(output_dir/name) from its finished runs, and print the table; unfinished runs are "
        "named in a warning.",
    )
    p_rep.add_argument("run_dir", type=Path, help="the experiment folder, e.g. runs/quickstart")
    p_rep.add_argument(
        "--baseline",
        metavar="METHOD",
        default=None,
        help="add a section comparing every method with METHOD seed by seed: the mean "
        "difference of the final scores on the same seeds, its 95%% t interval and the seeds "
        "each method was better on (in report.md, and as paired_* columns of report.csv)",
    )
    where = p_rep.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=None,
        help="write report.md, report.csv and the plots in DIR instead of the experiment "
        "folder (DIR/<experiment>/ for each experiment of an output folder): for results you "
        "cannot or would not write in, such as a colleague's read-only folder",
    )
    where.add_argument(
        "--print-only",
        action="store_true",
        help="print the table and write nothing",
    )
    p_track = sub.add_parser(
        "track",
        allow_abbrev=False,
        help="send finished runs and the report to the trackers again",
        description="Send every finished run of CONFIG (its metrics.jsonl rows, parameters, "
        "summary and files) and the experiment's report to the trackers its tracking section "
        "names, as the runs would have at their end: for a tracker that failed during a run, "
        "or one added since. MLflow replaces a run's earlier tracked run; TensorBoard and W&B "
        "rewrite their folders. Nothing is trained and no result file is changed.",
        epilog=_EPILOG,
    )
    p_track.add_argument(
        "args",
        nargs="*",
        metavar="CONFIG|key=value",
        help="the experiment file, then overrides of its keys (e.g. tracking=[mlflow])",
    )
    p_part = sub.add_parser(
        "partition",
        allow_abbrev=False,
        help="print per-client class histograms of an experiment's partition",
        description="Print each client's class histogram per seed (documents per source group "
        "for a pre-training corpus), without training; with --plot, also draw it.",
        epilog=_EPILOG,
    )
    p_part.add_argument(
        "args",
        nargs="*",
        metavar="CONFIG|key=value",
        help="the experiment file, then overrides of its keys",
    )
    p_part.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write each seed's label distribution per client (stacked bars, or a heat "
        "map past 20 classes) to FILE (format from its suffix, e.g. .png; with several seeds, "
        "FILE-seed<s>.png per seed)",
    )
    p_conv = sub.add_parser(
        "fortunes-c4",
        allow_abbrev=False,
        help="convert the fortunes corpus to C4 JSONL files",
        description="Convert Debian's fortunes corpus into C4-format c4-train.jsonl and "
        "c4-validation.jsonl (one source host per category file), the pre-training data of "
        "the fortunes_c4 source.",
    )
    p_conv.add_argument("out_dir", type=Path, help="folder the two JSONL files are written to")
    p_conv.add_argument(
        "--root", default=None, help="fortunes folder (default: Debian's /usr/share/games/fortunes)"
    )
    return parser


def _add_tune(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``fedlore tune``: its options set the config's ``tune`` section (the configuration
    reference lists every key)."""
    p = sub.add_parser(
        "tune",
        allow_abbrev=False,
        help="search one method's hyperparameters on the selection split (Optuna)",
        description="Search hyperparameters of CONFIG's one method (--method) for one seed, "
        "each trial a run under output_dir/name/tune/trial-<n>/, scored by its final "
        "selection-split metric (never a test set's); print the trials, write tune/best.json "
        "and the `fedlore run` command that runs every seed at the best settings. The study is "
        "tune/study.db: the same command continues an interrupted search (finished trials "
        "kept, a cut-off one resumed from its checkpoint). Each option sets the key of the "
        "config's tune section it names; needs the extra fedlore[tune].",
        epilog=_EPILOG,
    )
    p.add_argument(
        "args",
        nargs="*",
        metavar="CONFIG|key=value",
        help="the experiment file, then overrides of its keys",
    )
    p.add_argument(
        "--space",
        action="append",
        metavar="KEY=SPEC",
        help="a dimension of the search (repeat for more; added to tune.space): KEY a config "
        "key (lr, data.noise, method.fedlore.rank), SPEC log:LOW:HIGH (log-uniform float), "
        "float:LOW:HIGH, int:LOW:HIGH (both included) or cat:A,B,...",
    )
    p.add_argument(
        "--trials",
        type=int,
        metavar="N",
        help="trials in all, finished ones included (tune.trials; default 20)",
    )
    p.add_argument(
        "--metric",
        metavar="NAME",
        help="the selection-split score to optimize (tune.metric; default selection_accuracy)",
    )
    p.add_argument(
        "--mode",
        choices=("auto", "max", "min"),
        help="maximize or minimize the metric (tune.mode; default auto: known from its name)",
    )
    p.add_argument(
        "--sampler",
        choices=("tpe", "random", "grid"),
        help="Optuna's sampler (tune.sampler; default tpe)",
    )
    p.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help="the search seed: the sampler's proposals (tune.seed; default 0); not a run's seed",
    )
    p.add_argument("--method", metavar="NAME", help="the method to tune (tune.method)")
    p.add_argument(
        "--run-seed",
        type=int,
        metavar="S",
        help="the seed every trial trains with (tune.run_seed; default the config's first; one "
        "the config's seeds leave out is accepted, and best.json says so)",
    )
    p.add_argument(
        "--prune",
        choices=("none", "median"),
        help="median: stop a trial whose selection score falls below the median of earlier "
        "trials' at the same round (tune.prune; default none)",
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="W",
        help="train W trials at once, each in a process of its own, proposed together from the "
        "trials finished before them (tune.workers; default 1)",
    )
