"""Helpers shared by the generators of ``scripts/results_tables.py``: where the result files
are, how a generated file is written, and the number formats the pages use."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments" / "results"
BENCH = ROOT / "benchmarks" / "results"
LORA = ("fedit", "ffa_lora", "flexlora", "lora_fair", "rolora", "flora", "frlora")


# ---------------------------------------------------------------- helpers
def read(path: Path) -> Any:
    """``path``'s JSON.

    Raises:
        ValueError: naming ``path`` when it is no JSON (a torn or edited file).
    """
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def read_grid(path: Path) -> dict[str, Any]:
    """An ``experiments/lr_grid.py`` ``table.json`` in either of its forms: a diverged point's
    score (and a mean over no finite seed) is ``null`` since the table became strict JSON, and
    was ``NaN`` before; both read as NaN here, so a generator treats old and new tables alike.
    Its other nulls (``chosen_at_grid_edge``: not at an edge) stay as they are."""
    table: dict[str, Any] = read(path)
    for row in table["methods"].values():
        for key, value in row.items():
            if key in ("mean", "std", "loss_mean", "loss_std") and value is None:
                row[key] = math.nan
            elif isinstance(value, dict):  # scores by seed or rate (``diverged_*``: reasons)
                row[key] = {k: math.nan if v is None else v for k, v in value.items()}
    return table


def dump_json(data: Any) -> str:
    """The committed form of a generated JSON file (sorted keys, floats as Python writes them,
    strict JSON: a non-finite number, a diverged run's, is ``null``)."""
    return (
        json.dumps(
            experiment_module("lr_select").strict(data),
            indent=1,
            sort_keys=True,
            ensure_ascii=False,
            allow_nan=False,
        )
        + "\n"
    )


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def span(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values)}


def rate(lr: float) -> str:
    """``0.003`` -> ``3e-3``, ``1.0`` -> ``1``: a learning rate as the pages write it (and a key
    without a dot)."""
    if lr >= 1 and float(lr).is_integer():
        return str(int(lr))
    return f"{lr:.0e}".replace("e-0", "e-")


def mb(x: float) -> float:
    return x / 1e6


@functools.cache
def experiment_module(name: str) -> ModuleType:
    """``experiments/<name>.py`` as a module (the experiments folder is not a package), loaded
    once per process: :func:`dump_json` loaded ``lr_select`` again for every file it wrote."""
    path = ROOT / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bayes_tables() -> ModuleType:
    return experiment_module("bayes_tables")
