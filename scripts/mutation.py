"""Mutation testing of the math that guards fedlore's users (``make mutation``, issue 28 item 6).

    python scripts/mutation.py [GROUP_OR_PATH ...] [--jobs N] [--list]

The module groups live in pyproject.toml, ``[tool.fedlore.mutation.<name>]``: ``paths`` (the
files or folders mutated), ``tests`` (the fast tests that judge them) and, optionally,
``functions`` (only these functions' mutants run: mutmut mutates whole files). An argument is a
group's name or a path: it selects every group whose paths contain it or lie under it
(``src/fedlore/robust.py``, ``src/fedlore/optim/``, ``src/fedlore`` for all). No argument: every
group.

Each group runs mutmut (``[tool.mutmut]`` settings) in its own folder ``.mutation/<name>/``
(ignored by git): a ``pyproject.toml`` made from the repository's with the group's paths as
``only_mutate`` and its tests as the test selection, and links to ``src`` and ``tests``. mutmut
copies ``src`` to ``.mutation/<name>/mutants/``, runs the group's tests once to learn which
tests call which function, then runs, for each mutant, only the tests that call its function,
``--jobs`` mutants at a time (default 1). Results are kept: a later run tries again only the
mutants that were not killed and those of functions that changed, against the current tests
(the test-to-function map is rebuilt each run, so edited tests count).

Prints per group, file and function the mutants tried, killed, survived and otherwise (timeout,
no tests, ...), and every survivor's name; ``cd .mutation/<name> && ../../.venv/bin/mutmut
show NAME`` prints its diff. docs/development/mutation.md lists the survivors that are
equivalent and why.

Exit status: 0 when every chosen group ran (survivors are reported, not failed); 1 on a bad
argument; mutmut's own status when it fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutation"


def load_config() -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """(``[tool.mutmut]``, the groups, ``[tool.pytest.ini_options]``) of pyproject.toml."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["tool"]
    return tool["mutmut"], tool["fedlore"]["mutation"], tool["pytest"]["ini_options"]


def _norm(path: str) -> str:
    return path.rstrip("/")


def choose(groups: dict[str, dict[str, Any]], wanted: list[str]) -> list[str]:
    """The groups named by ``wanted`` (names or paths, see the module docstring), in
    pyproject order; all groups when ``wanted`` is empty.

    Raises:
        SystemExit: for an argument that selects no group.
    """
    if not wanted:
        return list(groups)
    chosen: set[str] = set()
    for arg in wanted:
        if arg in groups:
            chosen.add(arg)
            continue
        want = _norm(arg)
        hits = {
            name
            for name, group in groups.items()
            for path in map(_norm, group["paths"])
            if want == path or want.startswith(path + "/") or path.startswith(want + "/")
        }
        if not hits:
            raise SystemExit(
                f"mutation: {arg!r} is no group and lies in none; groups: "
                + ", ".join(f"{n} ({' '.join(g['paths'])})" for n, g in groups.items())
            )
        chosen |= hits
    return [name for name in groups if name in chosen]


def toml_value(value: Any) -> str:
    """``value`` (a string, bool, number or list of them) in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


BESIDE = ("benchmarks", "scripts", "experiments", "docs")
"""Folders of the repository the tests read, linked into each group's ``mutants/``."""


def prepare(
    name: str, group: dict[str, Any], mutmut: dict[str, Any], pytest: dict[str, Any]
) -> Path:
    """The group's working folder: links to src/ and tests/ (and, in mutants/, to
    :data:`BESIDE`) and its pyproject.toml."""
    work = WORK / name
    work.mkdir(parents=True, exist_ok=True)
    for link in ("src", "tests"):
        target = work / link
        if not target.is_symlink():
            target.symlink_to(Path("..") / ".." / link)
    # mutmut runs the tests from its copy in mutants/, so a test's repository root is mutants/:
    # the folders tests read beside src/ (benchmarks/leakage.py, scripts/, experiments/*.yaml)
    # are linked there (copying experiments/ would copy its committed runs)
    (work / "mutants").mkdir(exist_ok=True)
    for link in BESIDE:
        target = work / "mutants" / link
        if not target.is_symlink():
            target.symlink_to(Path("..") / ".." / ".." / link)
    settings = {
        **mutmut,
        "only_mutate": [
            _norm(p) + "/*" if (ROOT / p).is_dir() else _norm(p) for p in group["paths"]
        ],
        "pytest_add_cli_args_test_selection": list(group["tests"]),
    }
    lines = ["# made by scripts/mutation.py from ../../pyproject.toml; do not edit", ""]
    for table, values in (("tool.pytest.ini_options", pytest), ("tool.mutmut", settings)):
        lines.append(f"[{table}]")
        lines += [f"{key} = {toml_value(v)}" for key, v in values.items()]
        lines.append("")
    text = "\n".join(lines)
    pyproject = work / "pyproject.toml"
    if not pyproject.exists() or pyproject.read_text("utf-8") != text:
        pyproject.write_text(text, "utf-8")
    # mutmut copies every source file to mutants/ and later mutates only those it thinks
    # changed: a file added to the group (one split out of a grouped module, say) would stay a
    # plain copy with no mutants. Such a copy (no .meta beside it) is removed to be mutated.
    for path in group["paths"]:
        files = (ROOT / path).rglob("*.py") if (ROOT / path).is_dir() else [ROOT / path]
        for source in files:
            copy = work / "mutants" / source.relative_to(ROOT)
            if copy.exists() and not copy.with_name(copy.name + ".meta").exists():
                copy.unlink()
    return work


def module_of(path: str) -> str:
    """``src/fedlore/robust.py`` -> ``fedlore.robust`` (mutmut's prefix of mutant names)."""
    parts = Path(path).with_suffix("").parts
    parts = parts[1:] if parts[0] == "src" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def mutant_filters(group: dict[str, Any]) -> list[str]:
    """mutmut name patterns of the group's ``functions`` (empty: every mutant). A function is
    ``name`` or ``Class.method``, looked up in every file of the group."""
    functions = group.get("functions", [])
    files = [p for p in group["paths"] if p.endswith(".py")]
    if functions and len(files) != len(group["paths"]):
        raise SystemExit("mutation: `functions` needs a group of files, not folders")
    out = []
    for path in files:
        for func in functions:
            cls, _, meth = func.rpartition(".")
            mangled = f"x\u01c1{cls}\u01c1{meth}" if cls else f"x_{func}"
            out.append(f"{module_of(path)}.{mangled}__mutmut_*")
    return out


def function_of(key: str) -> str:
    """``fedlore.robust.x_combine_updates__mutmut_3`` -> ``combine_updates``;
    ``...xǁMetaBayFLǁselect_lr__mutmut_2`` -> ``MetaBayFL.select_lr``."""
    name = key.rsplit("__mutmut_", 1)[0]
    if "\u01c1" in name:
        _, cls, meth = name.rsplit(".", 1)[-1].split("\u01c1")
        return f"{cls}.{meth}"
    return name.rsplit(".", 1)[-1].removeprefix("x_")


def results(group: dict[str, Any], work: Path) -> dict[Path, dict[str, int | None]]:
    """mutmut's exit code of every mutant of the group's files (None: not tried), by .meta
    file; only the group's ``functions`` when it names some."""
    out: dict[Path, dict[str, int | None]] = {}
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        source = meta.relative_to(work / "mutants").as_posix().removesuffix(".meta")
        if not any(source == _norm(p) or source.startswith(_norm(p) + "/") for p in group["paths"]):
            continue
        codes = json.loads(meta.read_text("utf-8"))["exit_code_by_key"]
        functions = group.get("functions")
        out[meta] = {k: c for k, c in codes.items() if not functions or function_of(k) in functions}
    return out


def forget_not_killed(group: dict[str, Any], work: Path) -> list[str]:
    """Mark every mutant that was not killed (survived, timed out, had no test) as not tried,
    so that this run judges it with the current tests (mutmut itself only retries the mutants
    of changed functions). Returns their names."""
    from mutmut.stats import status_by_exit_code

    names = []
    for meta, codes in results(group, work).items():
        stale = [
            k for k, c in codes.items() if c is not None and status_by_exit_code[c] != "killed"
        ]
        if not stale:
            continue
        data = json.loads(meta.read_text("utf-8"))
        for key in stale:
            data["exit_code_by_key"][key] = None
        meta.write_text(json.dumps(data, indent=4), "utf-8")
        names += stale
    return names


def untried(group: dict[str, Any], work: Path) -> list[str]:
    """The group's mutants that have no result yet."""
    return [k for codes in results(group, work).values() for k, c in codes.items() if c is None]


def run_mutmut(group: dict[str, Any], work: Path, jobs: int) -> int:
    """Run mutmut on the group: every mutant not killed before (see :func:`forget_not_killed`)
    and every new one. With ``functions``, only theirs, by name: mutmut retries every mutant
    it is given by name, killed or not, so the killed ones are left out (all of them run when
    a source file changed since its mutants were made, or on the first run)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)]
    forget_not_killed(group, work)
    # mutmut maps tests to the functions they call once, and later only adds new tests: an
    # edited test would keep its old map (and a mutant it now kills would not be run with
    # it). One run of the group's tests rebuilds the map; the results are kept.
    (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    filters = mutant_filters(group)
    if filters and (work / "mutants").exists():
        changed = any(
            not (work / "mutants" / p).exists()
            or (work / "mutants" / p).stat().st_mtime <= (ROOT / p).stat().st_mtime
            for p in group["paths"]
        )
        filters = untried(group, work) or (filters if changed else [])
        if not filters:
            print(f"\n== {work.name}: every mutant was killed and no source changed")
            return 0
    for attempt in range(2):
        what = f"{len(filters)} names or patterns" if filters else "every mutant"
        print(f"\n== {work.name}: mutmut run ({what}) in {work}", flush=True)
        done = subprocess.run([*cmd, *filters], cwd=work, env=env)
        if done.returncode != 0:
            return done.returncode
        # a changed function may have got mutants that were not named above: try them too
        left = untried(group, work) if filters else []
        if not left or attempt:
            break
        filters = left
    return 0


def report(name: str, group: dict[str, Any], work: Path) -> None:
    """Print the group's results (read from mutmut's .meta files) and its survivors."""
    from mutmut.stats import status_by_exit_code

    rows: dict[tuple[str, str], Counter[str]] = {}
    survivors = []
    for meta, codes in results(group, work).items():
        source = meta.relative_to(work / "mutants").as_posix().removesuffix(".meta")
        for key, code in codes.items():
            func = function_of(key)
            status = status_by_exit_code[code]
            rows.setdefault((source, func), Counter())[status] += 1
            if status != "killed":
                survivors.append(f"{key}: {status}")
    total: Counter[str] = Counter()
    print(f"\n== {name}: {' '.join(group['paths'])} (tests: {' '.join(group['tests'])})")
    print(f"{'file / function':60} {'mutants':>7} {'killed':>6} {'survived':>8} {'other':>5}")
    for (source, func), c in sorted(rows.items()):
        total += c
        other = sum(c.values()) - c["killed"] - c["survived"]
        print(f"{source + ' ' + func:60} {c.total():7} {c['killed']:6} {c['survived']:8} {other:5}")
    other = total.total() - total["killed"] - total["survived"]
    score = total["killed"] / total.total() if total.total() else float("nan")
    print(
        f"{'total':60} {total.total():7} {total['killed']:6} {total['survived']:8} {other:5}"
        f"   killed {score:.1%} (before removing equivalent mutants: docs/development/mutation.md)"
    )
    for line in survivors:
        print(f"  not killed: {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="group names or paths (default: all groups)")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MUTATION_JOBS", "1")))
    parser.add_argument("--list", action="store_true", help="print the groups and exit")
    parser.add_argument(
        "--report", action="store_true", help="print the last results without running"
    )
    args = parser.parse_args(argv)
    mutmut, groups, pytest = load_config()
    # a Makefile variable arrives as one word per module; allow "a b" and "a,b" too
    wanted = [w for arg in args.modules for w in arg.replace(",", " ").split()]
    names = choose(groups, wanted)
    if args.list:
        for n in names:
            g = groups[n]
            print(f"{n}: {' '.join(g['paths'])} <- {' '.join(g['tests'])}")
        return 0
    for n in names:
        group = groups[n]
        work = prepare(n, group, mutmut, pytest)
        if not args.report:
            code = run_mutmut(group, work, args.jobs)
            if code != 0:
                print(f"mutation: mutmut failed for {n} (exit {code})", file=sys.stderr)
                return code
        report(n, group, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
