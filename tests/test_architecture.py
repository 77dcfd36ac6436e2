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
