"""Cheap insurance against known environment traps (a CUDA torchvision beside the CPU torch, flwr
imported by the core), and the package's metadata agreeing with itself."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch


def test_torch_is_the_pinned_cpu_build() -> None:
    assert torch.__version__.split("+")[0] == "2.13.0"


def test_torchvision_is_absent() -> None:
    # PyPI's torchvision is built against a CUDA torch and breaks torchmetrics/peft imports.
    assert importlib.util.find_spec("torchvision") is None


def test_core_does_not_import_flower() -> None:
    # a fresh interpreter: other tests in this process import flwr on purpose
    code = "import sys, fedlore.experiment, fedlore.cli; sys.exit('flwr' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_flower_tests_skip_with_a_reason_without_the_flower_extra() -> None:
    # issue 31: `pytest` in an environment without [flower] collects tests/flower and skips it,
    # saying why; flwr is made unimportable in a fresh interpreter
    code = (
        "import sys; sys.modules['flwr'] = None; import pytest; "
        "sys.exit(pytest.main(['--co', '-q', '-rs', '-p', 'no:cacheprovider', 'tests/flower']))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode in (0, 5), res.stdout + res.stderr  # 5: nothing left to collect
    assert "error" not in res.stdout.lower(), res.stdout
    skipped = [line for line in res.stdout.splitlines() if line.startswith("SKIPPED")]
    files = sorted(Path("tests/flower").glob("test_*.py"))
    assert len(skipped) == len(files) >= 5, res.stdout
    assert all("needs the [flower] extra" in s for s in skipped), res.stdout


def test_the_version_license_and_citation_agree() -> None:
    """pyproject.toml, ``fedlore.__version__``, CITATION.cff and LICENSE say the same thing."""
    import tomllib

    import yaml

    import fedlore

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    citation = yaml.safe_load((root / "CITATION.cff").read_text())
    assert project["version"] == fedlore.__version__ == citation["version"]
    assert project["license"] == citation["license"] == "Apache-2.0"
    license_text = (root / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0" in license_text
    assert citation["cff-version"] == "1.2.0" and citation["references"]
