"""``docs/reference/outputs.md`` documents every key a run writes, and only keys the code writes.

The keys of ``metrics.jsonl`` come from many places (the round loop, the evaluation, each method's
server, the privacy layer, the diagnostics), so the page is written by hand and checked here: a
few tiny experiments (digits, 4 clients, 2 rounds; a few seconds in all) cover evaluation, the
selection split, G-local and P-local scores, diagnostics of shared and client bases, a Bayesian
method with a learning-rate search, the methods with server metrics of their own, DP with
adaptive clipping, client sampling and the canary audit, secure aggregation, regression and a
source without a test split. Every key their ``metrics.jsonl``, ``summary.json`` and
``config.json`` hold must be in that file's tables on the page, and every key the page lists
must be spelled in the source.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "outputs.md"
SRC = ROOT / "src" / "fedlore"

SECTIONS = {
    "metrics": "`metrics.jsonl`",
    "summary": "`summary.json`",
    "config": "`config.json`",
    "report": "Report files",
}
"""Page section -> the text of its ``## `` heading."""

SMALL = ["rounds=2", "num_clients=4", "local_steps=2", "progress=false", "eval.mc_samples=2"]

EXPERIMENTS: dict[str, list[str]] = {
    "features": [
        "algorithms=[fedlore,local_galore,meta_bayfl,fedbe,lora_fair,fedmask,flexlora,flora,fednova,qffl]",
        "eval.local=true",
        "eval.clients=true",
        "data.selection_fraction=0.1",
        "data.server_fraction=0.1",
        "diagnostics.every=1",
        "method.meta_bayfl.lr_search=per_round",
        "method.meta_bayfl.temp_steps=1",
        "method.meta_bayfl.candidate_lrs=[0.01,0.001]",
        "method.fedbe.server_epochs=1",
        "method.fedbe.num_samples=1",
        "method.lora_fair.fair_max_steps=20",
    ],
    "dp": [
        "algorithms=[fedfull]",
        "weighting=uniform",
        "participation=0.5",
        "dp.clip_norm=1.0",
        "dp.noise_multiplier=1.0",
        "dp.target_quantile=0.5",
        "dp.clipped_count_stddev=1.0",
        "dp.audit.canaries=4",
    ],
    "secure": ["algorithms=[fedfull]", "secure_aggregation=true", "data.name=npz"],
    "regression": [
        "algorithms=[fedfull]",
        "data.name=diabetes",
        "eval.local=true",
        "eval.clients=true",
        "data.selection_fraction=0.1",
        "clients.speed=lognormal",
    ],
}
"""Experiment name -> its overrides of ``experiments/quickstart.yaml`` (besides :data:`SMALL`)."""


def documented(section: str) -> set[str]:
    """The keys in the first column of the tables of one ``## `` section of the page."""
    text = PAGE.read_text(encoding="utf-8")
    parts = re.split(r"^## ", text, flags=re.M)
    heading = SECTIONS[section]
    [body] = [p for p in parts if p.startswith(heading)]
    keys: set[str] = set()
    for line in body.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            first = line.split("|")[1]
            keys.update(re.findall(r"`([^`]+)`", first))
    return keys


def npz_folder(root: Path) -> Path:
    """A labelled source with ``train.npz`` only (its test set is held out of it)."""
    rng = np.random.default_rng(0)
    folder = root / "npz"
    folder.mkdir()
    x = rng.normal(size=(240, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)
    np.savez(folder / "train.npz", x=x, y=y)
    return folder


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, set[str]]]:
    """File -> key -> the runs (``experiment/method``) whose file holds it."""
    from fedlore.config import load_config
    from fedlore.experiment import run_experiment
    from fedlore.experiment_privacy import AuditWarning

    tmp = tmp_path_factory.mktemp("outputs")
    out = tmp / "runs"
    data = npz_folder(tmp)
    seen: dict[str, dict[str, set[str]]] = {"metrics": {}, "summary": {}, "config": {}}

    def note(kind: str, keys: Any, run: str) -> None:
        for key in keys:
            seen[kind].setdefault(key, set()).add(run)

    for name, overrides in EXPERIMENTS.items():
        extra = [f"data.root={data}"] if "data.name=npz" in overrides else []
        cfg = load_config(
            ROOT / "experiments" / "quickstart.yaml",
            [*SMALL, f"name={name}", f"output_dir={out}", *overrides, *extra],
        )
        with warnings.catch_warnings():
            # the dp run's 4 canaries are too few to read ε̂ against ε; it only writes the keys
            warnings.simplefilter("ignore", AuditWarning)
            run_experiment(cfg)
        for folder in sorted((out / name).glob("*/seed-*")):
            run = f"{name}/{folder.parent.name}"
            for line in (folder / "metrics.jsonl").read_text().splitlines():
                note("metrics", json.loads(line), run)
            note("summary", json.loads((folder / "summary.json").read_text()), run)
            note("config", json.loads((folder / "config.json").read_text()), run)
    return seen


def test_every_key_a_run_writes_is_documented(written: dict[str, dict[str, set[str]]]) -> None:
    from fedlore.config import Config

    settings = set(Config.model_fields)  # config.json's settings: the configuration reference
    for kind, keys in written.items():
        known = documented(kind) | (settings if kind == "config" else set())
        missing = {k: sorted(runs) for k, runs in keys.items() if k not in known}
        assert not missing, (
            f"{kind}: keys written by these runs are not documented in {PAGE.name}: {missing}"
        )


def test_the_runs_cover_the_conditional_keys(written: dict[str, dict[str, set[str]]]) -> None:
    """The experiments reach the keys that are only written under some settings (so the test
    above checks them), e.g. DP's, secure aggregation's, the diagnostics', a method's own."""
    rows = written["metrics"]
    for key in (
        "accepted_clients",
        "selection_accuracy",
        "client_accuracy_mean",
        "local_accuracy",
        "local_rmse",
        "rmse",
        "diag.retained_energy",
        "diag.b_norm2",
        "diag.certificate2",
        "lr_chosen",
        "basis_overlap",
        "server_teachers",
        "fair_gap_after",
        "global_density",
        "flex_tail_share",
        "stack_rank",
        "dp_epsilon_sample_known",
        "dp_unclipped_fraction",
        "dp_clipped",
        "secagg_underflow",
        "secagg_bytes_down",
        "sim_round_s",
        "sim_time_s",
    ):
        assert key in rows, f"no run wrote {key} (the experiments no longer reach it)"
    for key in (
        "data_test_split",
        "dp_clip_norm_final",
        "final_client_rmse",
        "local_clients",
        "dp_audit_epsilon_all_iterates",
    ):
        assert key in written["summary"], f"no summary holds {key}"


def test_every_documented_key_is_spelled_in_the_code() -> None:
    """A key the page lists but no source file spells as a string is stale (renamed or gone);
    a key made from a name (``client_<name>``: an ``eval.metrics`` metric) is spelled as an
    f-string, ``f"client_{...}"``."""
    source = "\n".join(p.read_text(encoding="utf-8") for p in SRC.rglob("*.py"))

    def spelled(key: str) -> bool:
        if "<" not in key:
            return f'"{key}"' in source
        return f'f"{key.split("<")[0]}{{' in source

    for section in SECTIONS:
        stale = sorted(k for k in documented(section) if not spelled(k))
        assert not stale, f"{PAGE.name} ({section}) lists keys the code never writes: {stale}"


def test_the_report_columns_are_documented() -> None:
    from fedlore.results.tables import COLUMNS

    missing = [c for c in COLUMNS if c not in documented("report")]
    assert not missing, f"report.csv columns not documented in {PAGE.name}: {missing}"
