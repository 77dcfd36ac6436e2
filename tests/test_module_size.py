"""No module of the project passes 500 lines (its code, experiments, scripts, benchmarks and
the docs' extension): a longer one does more than one job and is split. The tests are exempt,
as a test file grows with the cases of one subject."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500


def test_no_module_passes_500_lines() -> None:
    folders = ("src", "experiments", "scripts", "benchmarks", "docs/_ext")
    long = {
        str(path.relative_to(ROOT)): n
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > LIMIT
    }
    assert not long, f"split these modules (lines): {long}"
