"""Cheap insurance against the environment traps of shared/ENVIRONMENT.md."""

import importlib.util
import subprocess
import sys

import torch


def test_torch_is_the_pinned_cpu_build() -> None:
    assert torch.__version__.split("+")[0] == "2.13.0"


def test_torchvision_is_absent() -> None:
    # PyPI's torchvision is built against a CUDA torch and breaks torchmetrics/peft imports.
    assert importlib.util.find_spec("torchvision") is None


def test_core_does_not_import_flower() -> None:
    # a fresh interpreter: other tests in this process import flwr on purpose
    code = "import sys, fedlore.run, fedlore.cli; sys.exit('flwr' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
