"""Code of the user's own, named in a config's ``imports`` and imported wherever the config is
read: a method, model, data source or partitioner registered outside the package runs from the
command line, on Flower's simulation workers and in a deployment, like a built-in one.

An entry is a Python file (``my_methods.py``: made absolute when the config is validated, so
every process reading the config finds the same file) or an importable module name
(``mylab.fl_methods``, from the Python path). Each is imported once per process; a file is
imported under a name made from its stem and a hash of its path
(``fedlore_imports.my_methods_1a2b3c4d``), so two files of one name do not clash.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path

PACKAGE = "fedlore_imports"
"""The parent name of the modules imported from files."""


def resolve(entry: str) -> str:
    """A file entry (``*.py``) as an absolute path; a module name unchanged."""
    if entry.endswith(".py"):
        return str(Path(entry).expanduser().resolve())
    return entry


def module_name(path: str) -> str:
    """The name a file entry is imported under."""
    stem = re.sub(r"\W", "_", Path(path).stem)
    return f"{PACKAGE}.{stem}_{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def load(entries: Sequence[str]) -> None:
    """Import every entry not imported yet in this process.

    Raises:
        ValueError: naming the entry and why it could not be imported (a missing file, a module
            not found, the error the module raised).
    """
    for entry in entries:
        if entry.endswith(".py"):
            _load_file(entry)
            continue
        if entry in sys.modules:
            continue
        try:
            importlib.import_module(entry)
        except Exception as e:
            raise ValueError(
                f"cannot import {entry!r}: {type(e).__name__}: {e} (a module name must be "
                "importable from the Python path; a file is given by its path, ending in .py)"
            ) from None


def _load_file(entry: str) -> None:
    path = Path(entry)
    name = module_name(entry)
    if name in sys.modules:
        return
    if not path.is_file():
        raise ValueError(f"{entry}: no such file")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{entry}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"{entry} raised {type(e).__name__}: {e}") from None
