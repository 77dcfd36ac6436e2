"""What fedlore computes is what it computed before the issue-31 redesign (issue 31, item 7).

``scripts/behaviour_digests.py --record`` stored the ``metrics.jsonl`` rows (timings removed) of
a fixed set of runs in ``tests/fixtures/behaviour_digests.json`` before the first move; its
``--check`` compares bit-exact digests on the machine that recorded them. Here the cheap runs of
that set are repeated on any machine and compared row by row: every key, every integer (bytes,
counts, rounds) and string exactly, every float within a relative 1e-4 (float sums may differ in
their last bits between CPUs and torch builds, a changed formula does not stay within 1e-4),
except the subspace diagnostics of :data:`LOOSER` (an SVD's rank-r cut).

Re-recorded once since, on purpose (2026-12, an AVX-512 CPU): issue 33 draws Meta-BayFL's meta
split d anew every round and logs every search's pick (``lr_picks``), so ``bayes_personalized``'s
Meta-BayFL row changed; with ``method.meta_bayfl.meta_resample=fixed`` (d fixed per client, the
earlier reading) the code of that day computed the recorded rows within the tolerance, as it did
for every other run of the set, before the fixture was written again. A re-recording needs such
a check: it is the only way this test can be made to pass after a change it should catch.
The same day ``bayes_personalized`` was written again for three new keys of ``eval.clients``
(``client_accuracy_std``, ``_min``, ``_p10``): every other difference was none.
``fmnist_partial_fedlore`` was written again (``--record --only``, which keeps the other runs'
records) for one new key, ``diag.eps_eig`` (Proposition 2's ε_eig, summed over matrices, in its
certificate rounds): the comparison before found that key and no other difference.
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

LOOSER = {"basis_overlap": 1e-3}
"""Relative tolerance of the metrics that compare subspaces cut at rank r from an SVD. By
Davis-Kahan a perturbation E of the matrix moves the cut subspace by up to ||E|| / gap, gap
being the distance between the r-th and (r+1)-th singular values: with a near-tie at the cut,
float sums that differ in the 7th digit move ``||P_new^T P_old||^2 / r`` in the 4th (quickstart
FedLore, round 5, 0.90101 -> 0.90150 on another CPU, while every loss there agrees to 6e-6). A
wrong formula (no square, 1/m for 1/r, the old basis twice) moves it by far more than 1e-3."""

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
        rel = LOOSER.get(where.rpartition(".")[2], 1e-4)
        return [] if math.isclose(a, b, rel_tol=rel, abs_tol=1e-9) else [f"{where}: {a} -> {b}"]
    return [] if want == got else [f"{where}: {want!r} -> {got!r}"]


def test_tolerance_sees_a_changed_value_and_a_lost_key() -> None:
    rows = {"m/seed-42": [{"round": 0, "accuracy": 0.5, "bytes_up": 10}]}
    assert differences(rows, json.loads(json.dumps(rows))) == []
    assert differences(rows, {"m/seed-42": [{"round": 0, "accuracy": 0.5001, "bytes_up": 10}]})
    assert differences(rows, {"m/seed-42": [{"round": 0, "accuracy": 0.5, "bytes_up": 11}]})
    assert differences(rows, {"m/seed-42": [{"round": 0, "accuracy": 0.5}]})
    overlap = {"m/seed-42": [{"round": 5, "basis_overlap": 0.90101}]}
    assert not differences(overlap, {"m/seed-42": [{"round": 5, "basis_overlap": 0.90150}]})
    assert differences(overlap, {"m/seed-42": [{"round": 5, "basis_overlap": 0.9030}]})
    assert differences(rows, {"m/seed-42": [{"round": 0, "accuracy": 0.5006, "bytes_up": 10}]})


def test_recording_some_runs_keeps_the_other_runs_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--record --only a`` writes run a's record again and keeps b's (it once wrote a
    fixture of a alone, dropping every other run's record)."""
    module = _digests()
    fixture = tmp_path / "digests.json"
    old = {"digest": "0", "rows": {}}
    fixture.write_text(json.dumps({"platform": {}, "runs": {"a": old, "b": old}}))
    new = {"digest": "1", "rows": {"m/seed-42": []}}
    monkeypatch.setattr(module, "FIXTURE", fixture)
    monkeypatch.setattr(module, "run_all", lambda out, names: {n: new for n in names})
    monkeypatch.setattr(sys, "argv", ["behaviour_digests.py", "--record", "--only", "a"])
    assert module.main() == 0
    assert json.loads(fixture.read_text())["runs"] == {"a": new, "b": old}
    monkeypatch.setattr(sys, "argv", ["behaviour_digests.py", "--record"])
    monkeypatch.setattr(module, "run_all", lambda out, names: {"a": new})
    assert module.main() == 0  # the whole set recorded: the fixture is that set
    assert json.loads(fixture.read_text())["runs"] == {"a": new}


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
