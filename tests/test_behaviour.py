"""What fedlore computes is what it computed before the issue-31 redesign (issue 31, item 7).

``scripts/behaviour_digests.py --record`` stored the ``metrics.jsonl`` rows (timings removed) of
a fixed set of runs in ``tests/fixtures/behaviour_digests.json`` before the first move; its
``--check`` compares bit-exact digests on the machine that recorded them. Here the cheap runs of
that set are repeated on any machine and compared row by row: every key, every integer (bytes,
counts, rounds) and string exactly, every float within a relative 1e-4 (float sums may differ in
their last bits between CPUs and torch builds, a changed formula does not stay within 1e-4).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "behaviour_digests.json"

CHEAP = ["fedavg_secagg_dp", "fedlore_sketch"]
"""Runs of the set that take a few seconds (the rest: ``--check`` and the slow test below)."""


def _digests() -> Any:
    spec = importlib.util.spec_from_file_location(
        "behaviour_digests", ROOT / "scripts" / "behaviour_digests.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["behaviour_digests"] = module
    spec.loader.exec_module(module)
    return module


def differences(want: Any, got: Any, where: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` beyond the tolerance (empty: the same)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{where}.{k}: missing" for k in want.keys() - got.keys()]
        out += [f"{where}.{k}: new" for k in got.keys() - want.keys()]
        for k in want.keys() & got.keys():
            out += differences(want[k], got[k], f"{where}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(want)} rows recorded, {len(got)} now"]
        return [
            d
            for i, (a, b) in enumerate(zip(want, got, strict=True))
            for d in differences(a, b, f"{where}[{i}]")
        ]
    if isinstance(want, float) or isinstance(got, float):
        if isinstance(want, bool) or isinstance(got, bool) or want is None or got is None:
            return [] if want == got else [f"{where}: {want!r} -> {got!r}"]
        a, b = float(want), float(got)
        if math.isnan(a) and math.isnan(b):
            return []
        return [] if math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-9) else [f"{where}: {a} -> {b}"]
    return [] if want == got else [f"{where}: {want!r} -> {got!r}"]


def test_tolerance_sees_a_changed_value_and_a_lost_key() -> None:
    rows = {"m/seed-42": [{"round": 0, "accuracy": 0.5, "bytes_up": 10}]}
    assert differences(rows, json.loads(json.dumps(rows))) == []
    assert differences(rows, {"m/seed-42": [{"round": 0, "accuracy": 0.5001, "bytes_up": 10}]})
    assert differences(rows, {"m/seed-42": [{"round": 0, "accuracy": 0.5, "bytes_up": 11}]})
    assert differences(rows, {"m/seed-42": [{"round": 0, "accuracy": 0.5}]})


def _check(names: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the runs name their configs relative to the repository
    recorded = json.loads(FIXTURE.read_text())["runs"]
    got = _digests().run_all(tmp_path, names)
    for name in names:
        diff = differences(recorded[name]["rows"], got[name]["rows"], name)
        assert not diff, "\n".join(diff[:20])


def test_cheap_runs_compute_what_they_computed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _check(CHEAP, tmp_path, monkeypatch)


@pytest.mark.slow
def test_every_run_of_the_set_computes_what_it_computed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = list(json.loads(FIXTURE.read_text())["runs"])
    _check(names, tmp_path, monkeypatch)
