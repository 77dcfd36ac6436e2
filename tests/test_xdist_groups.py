"""``make test``'s ``--dist loadgroup`` runs every test of one ``xdist_group`` on one worker.

The suite relies on it: the loopback deployments (``xdist_group("deployment")``) must not run
beside each other, and a simulation module holds one Ray only when one worker runs all of it
(docs/development/tests.md). pytest-xdist marks a test's group by renaming the test, and pytest
9.2 stopped reading the renamed attribute, so every group was silently ignored while every test
still passed; pyproject.toml pins pytest below 9.2. This runs a small suite on two workers the
way ``make test`` does and reads which worker ran each test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SUITE = """
import os
import time

import pytest

OUT = os.environ["GROUP_PROBE_OUT"]


def _record(name):
    with open(os.path.join(OUT, name), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])
    time.sleep(0.05)


@pytest.mark.xdist_group("probe")
@pytest.mark.parametrize("i", range(8))
def test_grouped(i):
    _record(f"grouped-{i}")


@pytest.mark.parametrize("i", range(8))
def test_free(i):
    _record(f"free-{i}")
"""


def test_a_group_runs_on_one_worker_under_loadgroup(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    out = tmp_path / "out"
    suite.mkdir()
    out.mkdir()
    (suite / "test_probe.py").write_text(SUITE)
    args = ["-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-o", "addopts="]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--rootdir", str(suite), str(suite)],
        cwd=suite,
        env={**os.environ, "GROUP_PROBE_OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ran = {p.name: p.read_text() for p in out.iterdir()}
    assert len(ran) == 16, sorted(ran)
    grouped = {w for name, w in ran.items() if name.startswith("grouped-")}
    assert len(grouped) == 1, f"the group ran on workers {sorted(grouped)}"
    # both workers took part: the suite was spread, only the group kept together
    assert set(ran.values()) == {"gw0", "gw1"}


def test_every_long_first_prefix_names_tests_of_the_suite() -> None:
    """``LONG_FIRST`` (tests/conftest.py) moves the longest modules to the front by path: a
    renamed or moved module would silently drop back to its place in the collection."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("suite_conftest", root / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    long_first = conftest.LONG_FIRST
    files = [p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")]
    assert all(any(f.startswith(prefix) for f in files) for prefix in long_first), [
        p for p in long_first if not any(f.startswith(p) for f in files)
    ]
