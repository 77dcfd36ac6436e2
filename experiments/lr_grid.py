"""Run a table experiment with a learning rate per method chosen from a grid.

Protocol (seed 000, "Learning Rate Selection"; issue 16): every method runs the config's first
seed at every learning rate of its grid; the rate with the best final score on the *selection
split* (``data.selection_fraction``: training data held out of every client, never the reported
test set) wins: the highest selection accuracy, or for a language model the lowest selection
perplexity (seed 000's Table 8 selects by validation perplexity); a diverged run never wins;
ties go to the smaller rate. The chosen rate then runs on the remaining seeds. Reported: mean ±
std over all seeds of the test metrics at the chosen rate (central test set; a corpus's
validation documents), and the first seed's selection scores over the grid, so the choice is
visible. A config without a selection split is refused.

Usage::

    python experiments/lr_grid.py experiments/vision_table1.yaml \\
        --grid fedfull,local_galore,fedlore,fedit=1e-4,3e-4,5e-4,8e-4,1e-3,3e-3,5e-3 \\
        --grid ffa_lora,...=5e-4,1e-3,3e-3,5e-3 --jobs 2 --runs experiments/runs/vision \\
        --out experiments/results/vision_table1

Each run is ``fedlore run CONFIG algorithms=<m> seeds=<s> output_dir=<runs>/lr-<lr>
[--set overrides] lr=<lr> --resume`` in its own process (a killed driver resumes where it
stopped; ``<runs>`` defaults to the config's ``output_dir``; a ``--set`` of ``algorithms``,
``seeds``, ``name`` or ``output_dir`` chooses the methods, seeds, runs' name and that default, as
in ``sweep.py``, and ``--set lr=...`` or ``--set method.<m>.lr=...`` is refused). A config whose
``method.<m>`` section sets ``lr`` (which outranks ``lr``: every rate of the grid trained at it)
gets ``method.<m>.lr=<lr>`` in each run too, with a note on standard error. A run's output goes
to ``<out>/logs/<method>-<seed>-lr<lr>.log``, appended to on a rerun, so resuming a finished grid
keeps every run's training log. Writes ``<out>/table.md``, ``<out>/table.json`` and the curves
of the chosen runs (``<out>/*_vs_round.png``, ``*_vs_bytes.png``). Bytes per client per round
count every byte of the run, FedLore's setup exchange (round -1) included, divided by the client
contacts of the training rounds. Only the grid's own runs are tabulated: one whose ``config.json``
differs from the grid's settings (``--table-only`` with another ``--set``), or whose files cannot
be read, is named, and no table is written (exit 1). A published ``<out>/table.json`` holding
a method or a seed the new table lacks (``--table-only`` with fewer ``algorithms`` or
``seeds``) is kept as it is and what would go is named (exit 1), by a training grid before it
trains anything; ``--overwrite`` replaces it.

The seed tables' grids outlast one sitting (Table 2's 92 runs take about four hours on two
cores), so their commands pass ``--runs experiments/runs/<table>``: a finished run's
``config.json``, ``summary.json`` and ``metrics.jsonl`` (a few kB) are committed there, while
its checkpoint and spilled client states are not (``experiments/runs/.gitignore``). A finished
run needs nothing else: rerun with ``--resume`` on any machine, it is reported, not trained
again, so the grid continues from the runs that finished anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fedlore.atomic import write_text
from fedlore.config import load_config
from fedlore.engine.run_record import config_diff
from fedlore.experiment_parts import make_algorithm
from fedlore.results.plots import plot
from fedlore.results.store import load_runs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lr_select, lr_table beside it

from lr_select import (  # lr_grid.score and the rest, as before the split
    NO_SELECTION,
    edge_warning,
    score,
    strict,
)
from lr_table import (
    Unfinished,
    damaged,
    lost_results,
    run_dir,
    table_measures,
    table_seeds,
    tabulate,
)

TABLE_ONLY = False
EXTRA: list[str] = []  # --set overrides passed to every run
NAME: list[str] = [""]  # the config's name (its runs' folder under <runs>/lr-<lr>/)
CONFIG: list[str] = [""]  # the config file of every run
CHECKED: dict[Path, str] = {}  # run folder -> why it is another config's run ('' if not)


def parse_grid(items: list[str]) -> dict[str, list[float]]:
    """``"a,b=1e-3,3e-3"`` items -> method -> learning rates (sorted)."""
    out: dict[str, list[float]] = {}
    for item in items:
        methods, _, rates = item.partition("=")
        if not rates:
            raise SystemExit(f"--grid {item!r}: expected METHODS=RATES")
        for m in methods.split(","):
            out[m.strip()] = sorted(float(r) for r in rates.split(","))
    return out


OWN_KEYS = ("algorithms", "seeds", "lr", "output_dir", "progress")
"""Keys the grid sets in every run itself. A ``--set`` of ``algorithms``, ``seeds`` or
``output_dir`` chooses the methods, the seeds and the default ``--runs`` root (read from the
config with every ``--set``, as ``sweep.py`` reads them); ``lr`` is refused."""


def passed_on(sets: list[str]) -> list[str]:
    """The ``--set`` overrides given to every run: all but those of :data:`OWN_KEYS` (each run
    gets its own method, seed, rate and folder, never a ``--set``'s)."""
    return [kv for kv in sets if kv.partition("=")[0].strip() not in OWN_KEYS]


OWN_RATE: set[str] = set()
"""Methods whose ``method.<name>`` section in the config sets ``lr``: that rate takes precedence
over the run-wide ``lr`` the grid sets (every point of the grid trained at it), so each of their
runs gets ``method.<name>.lr=<rate>`` too."""


def own_rate(cfg: Any, methods: list[str]) -> list[str]:
    """The methods of ``methods`` whose ``method.<name>`` section of ``cfg`` sets ``lr``."""
    return [m for m in methods if "lr" in (cfg.method.get(m) or {})]


def rate_overrides(method: str, lr: float) -> list[str]:
    """The overrides that make ``lr`` the rate a run of ``method`` trains at."""
    own = [f"method.{method}.lr={lr:g}"] if method in OWN_RATE else []
    return [f"lr={lr:g}", *own]


STOP = threading.Event()
"""Set by an interrupt (Ctrl-C, or a run that exited 130 / 143): no run starts after it."""


def launch(config: str, root: str, method: str, seed: int, lr: float, log_dir: Path) -> None:
    if TABLE_ONLY:
        return
    if STOP.is_set():
        raise RuntimeError(f"{method} seed {seed} lr {lr:g}: not started (interrupted)")
    cmd = [sys.executable, "-m", "fedlore.cli", "run", "--resume", config]
    cmd += run_overrides(root, method, seed, lr)
    log = log_dir / f"{method}-{seed}-lr{lr:g}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    folder = run_dir(root, NAME[0], lr, method, seed)
    found = "finished" if (folder / "summary.json").is_file() else "unfinished"
    if found == "unfinished" and not (folder / "checkpoint.pt").is_file():
        found = "new"
    shown = " ".join(["python", *cmd[1:]])  # the interpreter's path is this machine's
    with log.open("a") as fh:  # append: a rerun (resume) keeps the earlier log
        fh.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {shown}\n")
        fh.write(f"=== {folder}: {FOUND[found]}\n")
        fh.flush()
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if rc in (130, 143):  # the run was stopped by SIGINT / SIGTERM: so is the grid
        STOP.set()
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(f"{method} seed {seed} lr {lr:g} failed ({rc}): {' '.join(tail)}")


def run_overrides(root: str, method: str, seed: int, lr: float) -> list[str]:
    """The overrides of the config that make a run of the grid."""
    return [
        f"algorithms={method}", f"seeds={seed}", f"output_dir={root}/lr-{lr:g}", "progress=false",
        *passed_on(EXTRA), *rate_overrides(method, lr),  # the grid's rate, the method's own lr too
    ]  # fmt: skip


def other_config(root: str, name: str, lr: float, method: str, seed: int) -> str:
    """Why the run in the folder of (``lr``, ``method``, ``seed``) is not this grid's ('' when
    it is, or has no ``config.json``): its ``config.json`` differs from the grid's settings
    (another grid's ``--set`` under the same folders) or cannot be read."""
    folder = run_dir(root, name, lr, method, seed)
    if folder not in CHECKED:
        record = folder / "config.json"
        why = ""
        if record.is_file():
            try:
                recorded = json.loads(record.read_text())
                if not isinstance(recorded, dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as e:
                why = f"{record} cannot be read ({type(e).__name__}: {e})"
            else:
                cfg = load_config(CONFIG[0], run_overrides(root, method, seed, lr))
                diff = config_diff(cfg, method, recorded, make_algorithm)
                why = f"{folder} holds a run of another config ({diff})" if diff else ""
        CHECKED[folder] = why
    return CHECKED[folder]


FOUND = {
    "finished": "a finished run: reported after fedlore's rerun checks, not trained again",
    "unfinished": "an unfinished run with its checkpoint: continued from it",
    "new": "no finished run and no checkpoint: trained from its first round",
}
"""What a run's log says its folder held when the grid reached it."""


def summary(root: str, name: str, lr: float, method: str, seed: int) -> dict[str, Any]:
    """The ``summary.json`` of a finished run.

    Raises:
        Unfinished: when the run has not finished (``--table-only`` before the grid has), is
            another config's (:func:`other_config`), or its ``summary.json`` cannot be read (a
            torn or edited file).
    """
    path = run_dir(root, name, lr, method, seed) / "summary.json"
    if not path.is_file():
        raise Unfinished(f"{method} seed {seed} lr {lr:g}: not finished ({path.parent})")
    if why := other_config(root, name, lr, method, seed):
        raise Unfinished(f"{method} seed {seed} lr {lr:g}: {why}")
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise Unfinished(damaged(method, seed, lr, path, e)) from None
    return data


SEED_GRID = (1e-4, 3e-4, 5e-4, 8e-4, 1e-3, 3e-3, 5e-3)
"""Seed 000's learning-rate grid (Section 5 "Hyperparameter Settings", Appendices A and B)."""


INTERRUPTED = (
    "lr_grid: interrupted; no run starts after it, and finished runs are kept: the same command "
    "resumes the grid"
)


def main(argv: list[str] | None = None) -> int:
    """The grid (:func:`grid_main`); a run's file found unreadable is one line, exit 1."""
    try:
        return grid_main(argv)
    except Unfinished as e:
        print(f"lr_grid: {e}; no table written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # making the table: each file is whole (written atomically)
        print(INTERRUPTED, file=sys.stderr)
        return 130


def keeps_published(
    out: Path,
    now: dict[str, set[str]],
    args: argparse.Namespace,
    measures: dict[str, str | None] | None = None,
) -> bool:
    """Whether ``<out>/table.json`` holds results a table of ``now`` (method -> seeds; scored
    by ``measures``, when known) would lose, said on standard error (never under
    ``--overwrite``)."""
    lost = [] if args.overwrite else lost_results(out / "table.json", now, measures)
    if lost:
        print(
            f"lr_grid: {out}/table.json holds results the new table lacks ({'; '.join(lost)}): "
            f"kept {out}/table.* as they are (are the runs under --runs {args.runs}? "
            "--overwrite replaces them)",
            file=sys.stderr,
        )
    return bool(lost)


def grid_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--grid", action="append", required=True, help="METHODS=RATES")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--runs", default=None, help="runs root (default: the config's output_dir)")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--table-only", action="store_true", help="launch nothing; tabulate the finished runs"
    )
    ap.add_argument(
        "--set", action="append", default=[], help="KEY=VALUE config override for every run"
    )
    ap.add_argument(
        "--overwrite", action="store_true", help="replace a table.json the new one lacks rows of"
    )
    args = ap.parse_args(argv)
    global TABLE_ONLY
    TABLE_ONLY = args.table_only
    EXTRA[:] = args.set
    for key in [kv.partition("=")[0].strip() for kv in args.set]:
        if key == "lr" or (key.startswith("method.") and key.endswith(".lr")):
            raise SystemExit(
                f"lr_grid: --set {key}=...: the grid sets each run's lr; give rates in --grid"
            )
    cfg = load_config(args.config, list(args.set))  # methods, seeds, name: --set's if given
    if cfg.data.selection_fraction == 0:
        raise SystemExit(NO_SELECTION)
    name, methods, seeds = cfg.name, list(cfg.algorithms), list(cfg.seeds)
    NAME[0] = name
    CONFIG[0] = args.config
    CHECKED.clear()
    args.runs = args.runs or cfg.output_dir
    grid = parse_grid(args.grid)
    missing = [m for m in methods if m not in grid]
    if missing:
        raise SystemExit(f"no --grid for {missing}")
    OWN_RATE.clear()
    OWN_RATE.update(own_rate(cfg, methods))
    for m in sorted(OWN_RATE):  # it outranks lr: each run overrides it with its grid's rate
        print(
            f"lr_grid: note: the config's method.{m}.lr={cfg.method[m]['lr']} is replaced by "
            "each rate of the grid in every run",
            file=sys.stderr,
        )
    out = Path(args.out)
    # before hours of training: a grid of fewer methods or seeds would end refusing its table
    if keeps_published(out, {m: {str(s) for s in seeds} for m in methods}, args):
        return 1
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    first, rest = seeds[0], seeds[1:]
    chosen: dict[str, float] = {}
    lock = threading.Lock()
    pool = ThreadPoolExecutor(args.jobs)
    pending: list[Future[None]] = []
    failed: list[str] = []

    def after_grid(method: str, futures: list[Future[None]]) -> None:
        errors = []
        for f in futures:  # every failed run of the grid is listed, not only the first
            try:
                f.result()
            except RuntimeError as e:
                errors.append(str(e))
            except CancelledError:  # dropped by an interrupt
                errors.append("cancelled")
        if errors:
            with lock:
                failed.extend(errors)
            return
        try:
            scores = {lr: score(summary(args.runs, name, lr, method, first)) for lr in grid[method]}
        except (SystemExit, Unfinished) as e:
            with lock:
                failed.append(str(e))
            return
        best = max(grid[method], key=lambda lr: (scores[lr], -lr))
        with lock:
            chosen[method] = best
        print(f"{method}: seed {first} scores {scores} -> lr {best:g}", flush=True)
        edge = edge_warning(method, grid[method], best)
        if edge is not None:
            print(edge, file=sys.stderr, flush=True)
        if STOP.is_set():
            return
        for s in rest:
            pending.append(pool.submit(launch, args.config, args.runs, method, s, best, logs))

    waiters = []
    for method in methods:
        futs = [
            pool.submit(launch, args.config, args.runs, method, first, lr, logs)
            for lr in grid[method]
        ]
        waiters.append(threading.Thread(target=after_grid, args=(method, futs)))
    try:
        for w in waiters:
            w.start()
        for w in waiters:
            w.join()
        while pending:
            try:
                pending.pop().result()
            except RuntimeError as e:
                failed.append(str(e))
    except KeyboardInterrupt:  # the queued runs are dropped, the running ones end
        STOP.set()
    pool.shutdown(wait=True, cancel_futures=STOP.is_set())
    if STOP.is_set():
        print(INTERRUPTED, file=sys.stderr)
        return 130
    for method in chosen if not failed else ():  # every seed of the chosen rates
        for s in rest:
            try:
                summary(args.runs, name, chosen[method], method, s)
            except Unfinished as e:
                failed.append(str(e))
    if failed:
        why = (
            "runs the table needs have not finished, cannot be read or are another config's "
            "(the same command without --table-only trains the unfinished)"
            if TABLE_ONLY
            else f"failed runs (each run's log is in {logs}/; a finished run that fedlore "
            "refuses is rerun with `fedlore run ... --overwrite` on its own, or its folder "
            "removed)"
        )
        print(f"{why}:\n" + "\n".join(failed), file=sys.stderr)
        return 1

    head = {"config": args.config, "overrides": args.set}
    table, lines = tabulate(summary, args.runs, name, methods, seeds, grid, chosen, head)
    if keeps_published(out, table_seeds(table), args, table_measures(table)):
        return 1
    write_text(out / "table.json", json.dumps(strict(table), indent=2, allow_nan=False))
    write_text(out / "table.md", "\n".join(lines) + "\n")
    print(f"results in {out}/ (table.md, table.json; runs under {args.runs})")
    # curves of the chosen runs, one line per method (accuracy or perplexity vs round and bytes)
    chosen_runs = {m: load_runs(Path(args.runs) / f"lr-{chosen[m]:g}" / name)[m] for m in methods}
    plot(chosen_runs, out)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
