"""The design's import rules hold, and each would catch its own breach (issue 31).

``make lint`` runs ``lint-imports`` on the contracts of ``[tool.importlinter]`` in
``pyproject.toml``. Here the same contracts are checked on the tree, then on copies of the
package with one forbidden import written into one module each: every contract must report its
own breach by name (a contract that a forbidden import passes is a missing contract).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter (the [dev] extra)")


def lint(src: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the project's contracts on the package under ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_tree_keeps_every_contract() -> None:
    res = lint(ROOT / "src")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


BREACHES = {
    "algorithms never import": ("algorithms/base.py", "import fedlore.engine.loop"),
    "the engine never imports an algorithm": ("engine/sampling.py", "import fedlore.algorithms"),
    "the experiment driver never imports Flower": ("experiment.py", "import fedlore.flower"),
    "only fedlore.flower imports flwr": ("data/partition.py", "import flwr"),
    "only the hf source and flwr: partitioners import datasets": (
        "data/partition.py",
        "import flwr_datasets",
    ),
    "only fedlore.tracking imports the trackers": ("results/plots.py", "import mlflow"),
    "only fedlore.tune_study imports optuna": ("tune.py", "import optuna"),
    "no import cycles": ("atomic.py", "import fedlore.results.store"),
}


@pytest.mark.parametrize("contract", list(BREACHES))
def test_each_contract_reports_its_breach(contract: str, tmp_path: Path) -> None:
    shutil.copytree(ROOT / "src" / "fedlore", tmp_path / "fedlore")
    module, line = BREACHES[contract]
    path = tmp_path / "fedlore" / module
    path.write_text(path.read_text() + f"\n{line}  # the breach under test\n")
    res = lint(tmp_path)
    assert res.returncode != 0, res.stdout
    broken = [row for row in res.stdout.splitlines() if row.endswith("BROKEN")]
    assert any(row.startswith(contract) for row in broken), res.stdout


def test_the_project_points_at_no_file_outside_itself() -> None:
    """Docstrings, docs and scripts cite papers and the project's own files, never the
    workspace around a checkout (a sibling folder of notes and papers): a reader of a clone
    does not have it."""
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "src", "docs", "tests", "scripts", "benchmarks",
         "experiments/*.py", "experiments/*.yaml", "experiments/*.sh", "README.md", "Makefile"],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    if not files:
        pytest.skip("not a git checkout: no file list to read")
    outside = (
        "../" + "shared/",
        "shared/" + "seeds/",
        "shared/" + "ENVIRONMENT",
        "shared/" + "DESIGN",
    )
    found = [
        f"{name}:{i}"
        for name in files
        if (ROOT / name).suffix in (".py", ".md", ".rst", ".yaml", ".sh", ".toml", "")
        and (ROOT / name).is_file()
        for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if any(o in line for o in outside)
    ]
    assert not found, f"points outside the project: {found[:10]}"
