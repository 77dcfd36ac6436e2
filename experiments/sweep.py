"""Run a config over a grid of settings, every method x seed, and tabulate the final metrics.

Protocol (issue 7, the Meta-BayFL tables): every combination of the ``--vary`` settings (their
cartesian product) runs every method of ``--methods`` (default: the config's) for every seed of
the config. Reported per (setting, method): mean ± sample std over seeds of the global model's
final central-test accuracy, NLL and ECE, the global model's accuracy on the clients' test
splits (G-local, ``eval.clients``), the clients' personal or last local model's accuracy and NLL
on their own test splits (P-local) when ``eval.local`` is on, the mean local-training seconds
per client per round, the learning rates the clients chose (Meta methods), with ``--bytes``
each run's total bytes up and down, and with ``--fairness`` the spread of the global model's
accuracy over the clients (mean, worst, 10th percentile, std of the per-client accuracies).

Usage::

    python experiments/sweep.py experiments/bayes_table2.yaml \\
        --vary data.fraction=1.0,0.5,0.25,0.1 --vary data.noise=0,1e-4,1e-3,1e-2,1e-1 \\
        --jobs 2 --runs runs --out experiments/results/bayes_table2

Each run is ``fedlore run CONFIG name=<name>-<setting> algorithms=<m> seeds=<s> <k=v ...>
output_dir=<runs> [--set overrides] --resume`` in its own process, so a killed sweep resumes
where it stopped. A ``--set`` of a key the sweep sets itself (``algorithms``, ``seeds``,
``name``, ``output_dir``) chooses what the sweep runs, as in ``lr_grid.py``: the methods (else
``--methods``, not both), the seeds, the runs' names and the default ``--runs`` root.
Writes ``<out>/table.md`` and ``<out>/table.json`` (per row each column's
values over the finished seeds, ``by_seed``: each seed's, to compare methods seed by seed, and
for a method with per-client metrics of its own, such as APFL's ``alpha``, ``final_per_client``:
their last-round values per seed).
Run names hold only the
``--vary`` settings: a finished run under the same name whose ``config.json`` differs (another
sweep's ``--set`` values in the same runs root) is neither reused nor tabulated, and the sweep
says so (give each sweep its own ``--runs`` root). A run whose ``summary.json``,
``config.json`` or ``metrics.jsonl`` cannot be read (a torn or edited file) is named in one line
and left out of the table (the sweep exits 1).

The table never loses results unasked: where ``<out>/table.json`` already holds a row or a seed
the new table lacks (``--table-only`` over another ``--runs`` root, a fresh clone without the
runs, fewer ``--vary`` values), both files are kept as they are, the sweep names what would go
and exits 1; ``--overwrite`` replaces them all the same. Each file is written atomically.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fedlore.algorithms  # noqa: F401  (registers the methods)
from fedlore import registry
from fedlore.atomic import write_text
from fedlore.config import ConfigError, load_config
from fedlore.engine.run_record import config_diff
from fedlore.experiment_parts import make_algorithm
from fedlore.settings import LocalTraining, config_paths

COLUMNS = (
    ("final_accuracy", "acc. (%)", 100.0),
    ("final_loss", "NLL", 1.0),
    ("final_ece", "ECE", 1.0),
    ("final_client_accuracy", "G-local acc. (%)", 100.0),
    ("local_accuracy", "P-local acc. (%)", 100.0),
    ("local_loss", "P-local NLL", 1.0),
    ("client_train_s_per_round", "client s / round", 1.0),
)
BYTES = (("bytes_up_total", "MB up", 1e-6), ("bytes_down_total", "MB down", 1e-6))
"""``--bytes``: the run's total bytes up and down (setup exchange included), in 10^6 bytes."""
FAIRNESS = (
    ("final_client_accuracy_mean", "client mean (%)", 100.0),
    ("final_client_accuracy_min", "worst client (%)", 100.0),
    ("final_client_accuracy_p10", "client p10 (%)", 100.0),
    ("final_client_accuracy_std", "client std (pts)", 100.0),
)
"""``--fairness``: the spread of the global model's accuracy over the clients' own test splits
(``eval.clients``): each client's accuracy counted once, their mean, the worst, the 10th
percentile and the sample std, in percent (points for the std)."""


def parse_vary(items: list[str]) -> list[tuple[str, list[str]]]:
    """``"key=v1,v2"`` items -> [(key, [v1, v2])]."""
    out = []
    for item in items:
        key, _, values = item.partition("=")
        if not values:
            raise SystemExit(f"--vary {item!r}: expected KEY=V1,V2,...")
        out.append((key.strip(), [v.strip() for v in values.split(",")]))
    return out


OWN_KEYS = ("name", "algorithms", "seeds", "output_dir", "progress")
"""Keys the sweep sets in every run itself. A ``--set`` of one is read as ``lr_grid.py`` reads
it: the config with every ``--set`` gives the sweep its methods (``algorithms``, unless
``--methods``), seeds, run names (``name``) and default ``--runs`` root (``output_dir``), and
each run gets its own value, never the ``--set`` text (:func:`passed_on`)."""


def passed_on(sets: list[str]) -> list[str]:
    """The ``--set`` overrides given to every run: all but those of :data:`OWN_KEYS`, which
    the sweep has read from the config and sets in each run itself."""
    return [kv for kv in sets if kv.partition("=")[0].strip() not in OWN_KEYS]


def refuse_clashes(
    vary: list[tuple[str, list[str]]], sets: list[str], methods: list[str], by_option: bool = False
) -> None:
    """Refuse a sweep whose table would be labelled with values its runs do not have: a
    ``--set`` of a ``--vary`` key (also as a method's own ``method.<name>.<key>``), methods
    given both by ``--methods`` (``by_option``) and ``--set algorithms=...``, or a value or
    method named twice.

    Raises:
        ConfigError: naming the keys.
    """
    set_keys = [kv.partition("=")[0].strip() for kv in sets]
    if by_option and "algorithms" in set_keys:
        raise ConfigError(
            "--methods and --set algorithms=...: give the methods once (either selects them)"
        )
    varied = {k for k, _ in vary}
    leaves = {k.rsplit(".", 1)[-1] for k in varied}
    both = sorted(
        k for k in set_keys
        if k in varied or (k.startswith("method.") and k.rsplit(".", 1)[-1] in leaves)
    )  # fmt: skip
    if both:
        raise ConfigError(
            f"--set {both} would override the --vary values of the same key(s) in every "
            "run (the table would be labelled with values the runs do not have)"
        )
    for what, values in [*((f"--vary {k}", vs) for k, vs in vary), ("--methods", methods)]:
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise ConfigError(f"{what}: {twice} named twice")


def refuse_outranked(vary: list[tuple[str, list[str]]], own: dict[str, Any], method: str) -> None:
    """Refuse a ``--vary`` of a config path that the method's own section of the config
    (``own``: ``method.<name>``) sets for ``method``: ``method.fedlore.lr`` outranks ``lr``, so
    every run of fedlore trained at one rate under the ``--vary lr`` values' labels.

    Raises:
        ConfigError: naming the varied path and the method's setting.
    """
    cls = registry.get("algorithm", method)
    paths = {**config_paths(LocalTraining), **config_paths(cls)}
    varied = {k for k, _ in vary}
    for key in own:
        if (path := paths.get(key)) in varied:
            raise ConfigError(
                f"--vary {path}: the config sets method.{method}.{key}, which outranks {path} in "
                f"{method}'s runs (each would run at its one value under the --vary labels); "
                f"remove it from the config, or --vary method.{method}.{key}"
            )


def label(setting: tuple[tuple[str, str], ...]) -> str:
    """A run-folder-safe name of one setting, e.g. ``fraction-0.5_noise-0.01``."""
    return "_".join(f"{k.rsplit('.', 1)[-1]}-{v}" for k, v in setting) or "base"


def stat(values: list[float], scale: float) -> str:
    xs = [v * scale for v in values]
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.3g}" if scale == 1.0 else f"{xs[0]:.2f}"
    m, s = statistics.mean(xs), statistics.stdev(xs)
    return f"{m:.3g} ± {s:.2g}" if scale == 1.0 else f"{m:.2f} ± {s:.2f}"


def chosen_lrs(path: Path) -> dict[str, int]:
    """How often each learning rate was chosen over the run's clients and rounds: every search
    (``lr_picks``, one per local epoch), or for runs recorded before ``lr_picks`` existed each
    client's most frequent choice per round (``lr_chosen``)."""
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError as e:  # a torn or edited row
            raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
        picks = row.get("lr_picks") or {}
        if picks:
            chosen = [float(x) for text in picks.values() for x in str(text).split(",") if x]
        else:
            chosen = [float(lr) for lr in (row.get("lr_chosen") or {}).values()]
        for lr in chosen:
            counts[f"{lr:g}"] = counts.get(f"{lr:g}", 0) + 1
    return counts


SEARCH_METRICS = ("lr_chosen", "lr_picks")
"""Per-client metrics :func:`chosen_lrs` already counts (Meta-BayFL's learning-rate search)."""


def final_per_client(method: str, runs: list[Path]) -> dict[str, dict[str, Any]]:
    """The last round's per-client metrics of each finished run (``seed -> {metric: {client:
    value}}``) for a method that declares others than the learning-rate search's (APFL's mixing
    weight ``alpha``); {} for the others."""
    names = [
        k for k in registry.get("algorithm", method).per_client_metrics if k not in SEARCH_METRICS
    ]
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        rows = (run / "metrics.jsonl").read_text().splitlines() if names else []
        if rows and (run / "summary.json").exists():
            last = json.loads(rows[-1])
            out[run.name.removeprefix("seed-")] = {k: last.get(k) for k in names}
    return out


def read_json(path: Path) -> Any:
    """``path``'s JSON.

    Raises:
        ValueError: naming ``path`` when it cannot be read or parsed (a torn or edited file).
    """
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e})") from None


def lost_rows(table: Path, records: list[dict[str, Any]]) -> list[str]:
    """The rows of the table at ``table`` (a ``table.json``) that ``records`` lack, or hold
    fewer seeds of, as ``setting method (seeds ...)``, or hold without a column of
    :data:`BYTES` or :data:`FAIRNESS` the published row has values of (a table made without
    ``--bytes`` or ``--fairness``), as ``setting method (columns: pass --flag)``, or with fewer
    values in such a column (its runs' summaries lack the key now), as ``setting method
    (columns: fewer values in the runs now)``; [] when there is none or it cannot be read
    (nothing usable to keep)."""
    try:
        old = json.loads(table.read_text())
        before = {(json.dumps(r["setting"], sort_keys=True), r["method"]): r for r in old}
    except (OSError, ValueError, TypeError, KeyError):
        return []
    now = {(json.dumps(r["setting"], sort_keys=True), r["method"]): r for r in records}
    lost = []
    for key, row in before.items():
        new = now.get(key, {"seeds": 0, "by_seed": {}})
        gone = sorted(set(row.get("by_seed", {})) - set(new.get("by_seed", {})))
        where = label(tuple((k, str(v)) for k, v in row["setting"].items()))
        if gone or new.get("seeds", 0) < row.get("seeds", 0):
            lost.append(f"{where} {row['method']} (seeds {', '.join(gone) or row['seeds']})")
            continue
        # a column of --bytes or --fairness the new table is made without, or holds fewer
        # values of (its flag passed, but the runs' summaries lack the key now)
        for flag, cols in (("--bytes", BYTES), ("--fairness", FAIRNESS)):
            had = [k for k, _, _ in cols if row.get(k)]
            dropped = [k for k in had if k not in new]
            if dropped:
                lost.append(f"{where} {row['method']} ({', '.join(dropped)}: pass {flag})")
            fewer = [k for k in had if k in new and len(new[k] or ()) < len(row[k])]
            if fewer:
                lost.append(
                    f"{where} {row['method']} ({', '.join(fewer)}: fewer values in the runs now)"
                )
    return lost


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--vary", action="append", default=[], help="KEY=V1,V2,...")
    ap.add_argument("--methods", default=None, help="comma-separated (default: the config's)")
    ap.add_argument("--jobs", type=positive, default=2)
    ap.add_argument("--runs", default=None, help="runs root (default: the config's output_dir)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    ap.add_argument("--table-only", action="store_true", help="tabulate finished runs only")
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace <out>/table.* even where it holds rows or seeds the new table lacks",
    )
    ap.add_argument("--bytes", action="store_true", help="add each run's MB up and down")
    ap.add_argument(
        "--fairness",
        action="store_true",
        help="add the clients' accuracy mean, worst, p10 and std (needs eval.clients)",
    )
    args = ap.parse_args(argv)
    try:
        return sweep(args)
    except KeyboardInterrupt:
        print("sweep: interrupted; finished runs are kept: rerun the same command to resume")
        return 130
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2


def positive(text: str) -> int:
    """``--jobs``: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def sweep(args: argparse.Namespace) -> int:
    """The sweep of :func:`main`'s arguments: 0 when every run finished, 1 otherwise.

    Raises:
        ConfigError, FileNotFoundError: before any run, for the config, a ``--set`` that the
            sweep sets itself or that overrides a ``--vary`` key (:func:`refuse_clashes`), a
            ``--vary`` key a method's own section of the config outranks
            (:func:`refuse_outranked`), a value or method named twice, a method that is not
            registered or whose settings some run would refuse, or an ``--out`` that is a file.
    """
    cfg = load_config(args.config, list(args.set))  # methods, seeds, name: --set's if given
    methods = args.methods.split(",") if args.methods else list(cfg.algorithms)
    root = args.runs or cfg.output_dir
    vary = parse_vary(args.vary)
    refuse_clashes(vary, args.set, methods, by_option=bool(args.methods))
    known = registry.names("algorithm")
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ConfigError(f"--methods: {unknown} not registered; the methods: {known}")
    for method in methods:
        refuse_outranked(vary, cfg.method.get(method) or {}, method)
    settings = [
        tuple(zip([k for k, _ in vary], combo, strict=True))
        for combo in itertools.product(*[vs for _, vs in vary])
    ]
    for setting in settings:  # every run's config and method settings, before any run
        for method in methods:
            given = [*args.set, *[f"{k}={v}" for k, v in setting], f"algorithms=[{method}]"]
            try:
                make_algorithm(method, load_config(args.config, given))
            except (KeyError, ValueError) as e:
                where = f" ({label(setting)})" if setting else ""
                raise ConfigError(f"{method}{where}: {e.args[0] if e.args else e}") from e
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a file; name a folder for the table")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def overrides(setting: tuple[tuple[str, str], ...], method: str, seed: int) -> list[str]:
        name = f"{cfg.name}-{label(setting)}"
        return [
            f"name={name}", f"algorithms={method}", f"seeds={seed}", f"output_dir={root}",
            "progress=false", *[f"{k}={v}" for k, v in setting], *passed_on(args.set),
        ]  # fmt: skip

    def other_config(setting: tuple[tuple[str, str], ...], method: str, seed: int) -> str:
        """Why the finished run in this setting's folder is not this sweep's ('' if it is):
        run names hold only the ``--vary`` settings, so a sweep whose ``--set`` differs finds
        another sweep's runs under the same names."""
        folder = Path(root) / f"{cfg.name}-{label(setting)}" / method / f"seed-{seed}"
        record = folder / "config.json"
        if not record.exists():
            return ""
        try:
            recorded = read_json(record)
        except ValueError as e:
            return str(e)
        run_cfg = load_config(args.config, overrides(setting, method, seed))
        diff = config_diff(run_cfg, method, recorded, make_algorithm)
        return f"{folder} holds a run of another config ({diff})" if diff else ""

    stop = threading.Event()  # an interrupt: no run starts after it

    def run(setting: tuple[tuple[str, str], ...], method: str, seed: int) -> None:
        if stop.is_set():
            return
        name = f"{cfg.name}-{label(setting)}"
        if (Path(root) / name / method / f"seed-{seed}" / "summary.json").exists():  # done
            why = other_config(setting, method, seed)
            if why:
                print(f"{label(setting)} {method} seed {seed}: skipped: {why}; give this "
                      "sweep its own --runs root", flush=True)  # fmt: skip
                failed.append(f"{label(setting)} {method} seed {seed} (another config's run)")
            return
        cmd = [
            sys.executable, "-m", "fedlore.cli", "run", args.config,
            *overrides(setting, method, seed), "--resume",
        ]  # fmt: skip
        log = logs / f"{label(setting)}-{method}-{seed}.log"
        with log.open("a") as fh:  # append: a rerun (resume) keeps the earlier log
            shown = " ".join(["python", *cmd[1:]])  # the interpreter's path is this machine's
            fh.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {shown}\n")
            fh.flush()
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
        print(f"{label(setting)} {method} seed {seed}: rc={rc}", flush=True)
        if rc in (130, 143):  # the run was stopped by SIGINT / SIGTERM: so is the sweep
            stop.set()
        if rc != 0:
            failed.append(f"{label(setting)} {method} seed {seed} (rc={rc}, log {log})")

    failed: list[str] = []
    if not args.table_only:
        jobs = [(s, m, seed) for s in settings for m in methods for seed in cfg.seeds]
        pool = ThreadPoolExecutor(args.jobs)
        try:
            list(pool.map(lambda j: run(*j), jobs))
        except KeyboardInterrupt:  # the queued runs are dropped, the running ones end
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown()
        if stop.is_set():
            raise KeyboardInterrupt

    records: list[dict[str, Any]] = []
    columns = COLUMNS + (BYTES if args.bytes else ()) + (FAIRNESS if args.fairness else ())
    lines = [
        "| setting | method | seeds | " + " | ".join(h for _, h, _ in columns) + " | lr chosen |",
        "|---|---|---|" + "---|" * len(columns) + "---|",
    ]
    for setting in settings:
        for method in methods:
            folder = Path(root) / f"{cfg.name}-{label(setting)}" / method
            runs: list[Path] = []
            done: list[dict[str, Any]] = []
            lrs: dict[str, int] = {}
            for s in cfg.seeds:
                r = folder / f"seed-{s}"
                if other_config(setting, method, s):
                    continue
                try:  # a torn or edited file: the run is named and left out
                    summ = read_json(r / "summary.json") if (r / "summary.json").exists() else None
                    if summ is not None and not isinstance(summ, dict):
                        raise ValueError(f"{r / 'summary.json'} cannot be read (not an object)")
                    counts = chosen_lrs(r / "metrics.jsonl")
                except FileNotFoundError:
                    counts = {}
                except (OSError, ValueError) as e:
                    print(f"{label(setting)} {method} seed {s}: left out: {e}", flush=True)
                    failed.append(f"{label(setting)} {method} seed {s} (a damaged file)")
                    continue
                runs.append(r)
                done += [summ] if summ is not None else []
                for k, v in counts.items():
                    lrs[k] = lrs.get(k, 0) + v
            if not done:
                continue
            rec: dict[str, Any] = {"setting": dict(setting), "method": method, "seeds": len(done)}
            cells = []
            for key, _, scale in columns:
                vals = [float(d[key]) for d in done if d.get(key) is not None]
                rec[key] = vals
                cells.append(stat(vals, scale))
            rec["lr_chosen"] = lrs
            # each seed's values, to pair methods seed by seed (fedlore.results.paired)
            rec["by_seed"] = {
                str(d.get("seed")): {
                    **{key: d.get(key) for key, _, _ in columns},
                    "diverged": d.get("diverged"),
                }
                for d in done
            }
            kept = final_per_client(method, runs)
            if kept:
                rec["final_per_client"] = kept
            records.append(rec)
            lr_cell = ", ".join(f"{k}: {v}" for k, v in sorted(lrs.items())) or "–"
            head = f"| {label(setting)} | {method} | {len(done)} | "
            lines.append(head + " | ".join(cells) + f" | {lr_cell} |")
    lost = [] if args.overwrite else lost_rows(out / "table.json", records)
    if lost:
        print(
            f"sweep: {out}/table.json holds results the new table lacks ({len(lost)} row(s): "
            f"{'; '.join(lost[:3])}{'; ...' if len(lost) > 3 else ''}): kept {out}/table.* as "
            f"they are (are the runs under --runs {root}? --overwrite replaces them)",
            file=sys.stderr,
        )
        return 1
    write_text(out / "table.json", json.dumps(records, indent=2))
    write_text(out / "table.md", "\n".join(lines) + "\n")
    print(f"results in {out}/ (table.md, table.json; runs under {root})")
    print("\n".join(lines))
    if failed:
        print(f"sweep: {len(failed)} run(s) failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
