"""The tables and quoted numbers of the documentation's Results pages, from the result files.

The pages under ``docs/results/`` never retype a measured number: they include Markdown tables
and quote single numbers (``{result}`` role) from JSON files of the tree. Where the experiment or
benchmark scripts leave no table in the form a page shows (they printed it to the terminal, or a
page combines several result files), or where a page's prose quotes a derived number (a ratio, a
difference, a span), this script writes it from the result files, beside them:

* ``experiments/results/<experiment>/summary.md`` / ``summary.json``: combined tables and the
  numbers the prose quotes (FedLore tables, partial participation, sketch vs projector, DP,
  local against central DP (FedAvg; FedPer), the canary audit of DP, upload compression, the
  classic baselines);
* ``benchmarks/results/<benchmark>.md`` and ``benchmarks/results/summary.json``: the benchmark
  tables and their derived numbers;
* the Meta-BayFL tables, through ``experiments/bayes_tables.py --write``.

    python scripts/results_tables.py           # (re)write every generated file
    python scripts/results_tables.py --check   # exit 1, naming each file that differs

It only reformats what the result files hold; it never reruns an experiment or a benchmark.
Every file is made before any is written, and each is written atomically: a result file that is
missing or cannot be read is one line naming it (exit 2) and nothing is written.
``tests/test_docs_results.py`` checks that every committed file is what this writes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the generators beside this script

from results_baselines import baselines
from results_benchmarks import benchmarks
from results_common import EXP, ROOT, bayes_tables
from results_experiments import (
    compression,
    dp,
    dp_audit,
    fmnist_dir01,
    fmnist_partial,
    ldp,
    ldp_personal,
    sketch_vs_projector,
)
from results_pfl import pfl_baselines
from results_rivals import bayes_fedlore, grid_table_facts, pretrain, subspace_rivals

from fedlore.atomic import write_text

GENERATORS: tuple[Callable[[], dict[str, str]], ...] = (
    fmnist_dir01,
    fmnist_partial,
    sketch_vs_projector,
    dp,
    ldp,
    ldp_personal,
    dp_audit,
    compression,
    baselines,
    pfl_baselines,
    lambda: grid_table_facts("vision_table1"),
    lambda: grid_table_facts("text_table2"),
    pretrain,
    subspace_rivals,
    bayes_fedlore,
    benchmarks,
)


def outputs() -> dict[str, str]:
    """``{path relative to the repository: text}`` of every generated file."""
    out = {
        f"experiments/results/{path}": text for path, text in bayes_tables().outputs(EXP).items()
    }
    for gen in GENERATORS:
        out.update(gen())
    return out


INTERRUPTED = (
    "results_tables: interrupted; each file written is whole (the rest as they were): the same "
    "command rewrites them all"
)


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check``, compare) every generated file; an interrupt is one line."""
    try:
        return write_all(argv)
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130


def write_all(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    stale = []
    try:
        made = outputs()
    except (OSError, ValueError, KeyError, TypeError) as e:  # a result file missing or torn
        print(
            f"results_tables: a result file cannot be read ({type(e).__name__}: {e}); nothing "
            "was written",
            file=sys.stderr,
        )
        return 2
    for path, text in made.items():
        file = ROOT / path
        if check:
            if not file.is_file() or file.read_text(encoding="utf-8") != text:
                stale.append(path)
        else:
            try:
                write_text(file, text)
            except OSError as e:  # each file written is whole, the one that failed as it was
                print(f"results_tables: {e}; fix it and run again", file=sys.stderr)
                return 2
            print(f"wrote {path}")
    for path in stale:
        print(f"differs from its result files: {path}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
