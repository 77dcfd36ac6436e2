"""Helpers shared by the generators of ``scripts/results_tables.py``: where the result files
are, how a generated file is written, and the number formats the pages use."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments" / "results"
BENCH = ROOT / "benchmarks" / "results"
LORA = ("fedit", "ffa_lora", "flexlora", "lora_fair", "rolora", "flora", "frlora")


# ---------------------------------------------------------------- helpers
def read(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def dump_json(data: Any) -> str:
    """The committed form of a generated JSON file (sorted keys, floats as Python writes them)."""
    return json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


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


def bayes_tables() -> ModuleType:
    path = ROOT / "experiments" / "bayes_tables.py"
    spec = importlib.util.spec_from_file_location("bayes_tables", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
