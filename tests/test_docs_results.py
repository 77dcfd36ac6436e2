"""The Results pages' tables and quoted numbers are what their result files give.

``docs/results/`` never retypes a measured number: it includes Markdown tables and quotes single
numbers (the ``{result}`` role) from files of the tree. The tables and numbers that no experiment
or benchmark script wrote in that form are generated from the result files by
``scripts/results_tables.py`` (which runs ``experiments/bayes_tables.py --write`` too) and
committed beside them. Regenerating each from its data must give exactly the committed file, so
a table cannot drift from its data; and every file a page includes or quotes must exist, with
the key it quotes. (Sphinx checks the same when it builds; these run without it.)
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))
RESULT_ROLE = re.compile(r"(?<!`)\{result\}`([^`]+)`")
INCLUDE = re.compile(r"^```\{include\}\s+(\S+)", re.M)


def load_script() -> ModuleType:
    path = ROOT / "scripts" / "results_tables.py"
    spec = importlib.util.spec_from_file_location("results_tables", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OUTPUTS = load_script().outputs()


@pytest.mark.parametrize("path", sorted(OUTPUTS))
def test_generated_file_is_what_its_result_files_give(path: str) -> None:
    file = ROOT / path
    assert file.is_file(), f"{path} is missing: run python scripts/results_tables.py"
    assert file.read_text(encoding="utf-8") == OUTPUTS[path], (
        f"{path} differs from what its result files give: run python scripts/results_tables.py"
    )


def test_the_generated_files_cover_the_meta_bayfl_and_benchmark_tables() -> None:
    assert "experiments/results/bayes_table2/summary.md" in OUTPUTS
    assert "experiments/results/bayes_table6/summary_digits.md" in OUTPUTS
    assert "benchmarks/results/round_time.md" in OUTPUTS
    assert all(text.strip() for text in OUTPUTS.values())


def quoted(spec: str) -> Any:
    """The value ``{result}`path.json#a.b.0|fmt``` shows, read as the extension reads it."""
    spec = spec.replace("\\|", "|")  # a role inside a Markdown table escapes its pipe
    spec, _, fmt = spec.partition("|")
    path, _, keys = spec.partition("#")
    value: Any = json.loads((ROOT / path).read_text(encoding="utf-8"))
    for key in keys.split(".") if keys else []:
        value = value[int(key)] if isinstance(value, list) else value[key]
    return format(value, fmt) if fmt else str(value)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_number_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for spec in RESULT_ROLE.findall(text):
        assert quoted(spec) not in ("", "None", "nan"), f"{page.name}: {spec} gives no number"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_included_table_exists(page: Path) -> None:
    for target in INCLUDE.findall(page.read_text(encoding="utf-8")):
        assert (page.parent / target).resolve().is_file(), f"{page.name}: {target} is missing"


def test_pages_do_not_retype_numbers_in_the_generated_tables() -> None:
    """A generated table is included, never pasted: no line of one appears in a page."""
    rows = {
        line
        for path, text in OUTPUTS.items()
        if path.endswith(".md")
        for line in text.splitlines()
        if line.startswith("| ") and any(ch.isdigit() for ch in line)
    }
    for page in PAGES:
        pasted = rows & set(page.read_text(encoding="utf-8").splitlines())
        assert not pasted, f"{page.name} retypes rows of a generated table: {sorted(pasted)[:2]}"
