"""FedPer, FedBN, FedRep and MOON in whole private runs (``run_one`` on digits); the mechanism
itself is attacked in ``tests/privacy/test_personal_methods.py``.

* ε is FedAvg's for the same schedule: central DP with sampling (``dp_epsilon`` and
  ``dp_epsilon_sample_known``), local DP (the worst-off client's);
* a secure run ends in the plain run's global model and its P-local scores (``eval.local``,
  measured in the last round and pooled), and the run warns that those scores are taken outside
  the mechanism; the rows hold the pooled scores only, never a client's;
* under every mode no training loss (MOON's contrastive term, FedRep's phases) and no state
  size reach the rows.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.config import load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.experiment_privacy import PrivacyWarning

SEED = 5
METHODS = ("fedper", "fedbn", "fedrep", "moon")
CENTRAL = ("weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1.5")
MODES = {
    "secagg": ("secure_aggregation=true",),
    "dp": (*CENTRAL, "participation=0.5"),
    "ldp": (*CENTRAL, "dp.mode=local"),
}


def _cfg(out: Path, method: str, *extra: str) -> Any:
    hidden = "{hidden: [16], norm: batch}" if method == "fedbn" else "{hidden: [16]}"
    return load_config(
        None,
        [
            "name=private_personal",
            "num_clients=4",
            "rounds=3",
            "local_steps=3",
            "batch_size=16",
            "lr=0.05",
            f"model.kwargs={hidden}",
            "partition.min_size=10",
            "progress=false",
            f"output_dir={out}",
            *extra,
        ],
    )


def _rows(cfg: Any, method: str) -> list[dict[str, Any]]:
    path = run_dir(cfg, method, SEED) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("mode", ["dp", "ldp"])
@pytest.mark.parametrize("method", METHODS)
def test_epsilon_is_fedavgs_for_the_same_schedule(tmp_path: Path, method: str, mode: str) -> None:
    """The same rounds, clients and σ: every row's ε (and under sampling the ε against whoever
    knows the sample) is FedAvg's, as the method adds no exchange and no release."""
    base = _cfg(tmp_path / "fedavg", method, *MODES[mode])
    own = _cfg(tmp_path / method, method, *MODES[mode])
    run_one(base, "fedavg", SEED)
    summary = run_one(own, method, SEED)
    assert summary is not None and summary["dp_mode"] == ("local" if mode == "ldp" else "central")
    keys = ("dp_epsilon", "dp_epsilon_sample_known")
    want = [{k: r[k] for k in keys if k in r} for r in _rows(base, "fedavg")]
    got = [{k: r[k] for k in keys if k in r} for r in _rows(own, method)]
    assert got == want and len(got) == 3
    assert all(r["dp_epsilon"] > 0 for r in got)
    assert ("dp_epsilon_sample_known" in got[0]) == (mode == "dp")


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warnings are said once per process: none said yet."""
    from fedlore import progress

    monkeypatch.setattr(progress, "_SAID", set())


@pytest.mark.parametrize("method", METHODS)
def test_a_secure_run_is_the_plain_run_with_its_p_local_scores(
    tmp_path: Path, method: str, fresh_warnings: None
) -> None:
    plain = _cfg(tmp_path / "plain", method, "eval.local=true")
    secure = _cfg(tmp_path / "secure", method, "eval.local=true", *MODES["secagg"])
    run_one(plain, method, SEED)
    with pytest.warns(PrivacyWarning, match="eval.local sends each client's P-local scores"):
        run_one(secure, method, SEED)
    a = Checkpointer.load(run_dir(plain, method, SEED) / "checkpoint.pt")[1].arrays
    b = Checkpointer.load(run_dir(secure, method, SEED) / "checkpoint.pt")[1].arrays
    for k, v in a.items():
        if k.startswith("model.") and v.is_floating_point():
            torch.testing.assert_close(b[k], v, rtol=0, atol=1e-5, msg=k)
    want, got = _rows(plain, method)[-1], _rows(secure, method)[-1]
    assert got["local_clients"] == want["local_clients"] == 4
    for key in ("local_accuracy", "local_loss", "local_ece"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key
    assert not any(k.startswith("local_") for k in _rows(secure, method)[0])  # last round only
    assert got["train_loss"] is None and want["train_loss"] is not None


@pytest.mark.parametrize("mode", ["dp", "ldp"])
def test_under_dp_the_p_local_scores_reach_the_rows_pooled_and_unnamed(
    tmp_path: Path, mode: str, fresh_warnings: None
) -> None:
    cfg = _cfg(tmp_path, "fedper", "eval.local=true", *MODES[mode])
    with pytest.warns(PrivacyWarning, match="neither secure aggregation nor ε covers"):
        run_one(cfg, "fedper", SEED)
    rows = _rows(cfg, "fedper")
    last = rows[-1]
    assert 0 <= last["local_accuracy"] <= 1 and last["local_clients"] == (2 if mode == "dp" else 4)
    assert not any("accepted_clients" in r for r in rows)  # the sample stays unnamed
    assert all(not isinstance(v, dict) for r in rows for v in r.values())  # nothing per client


def test_no_warning_without_eval_local(tmp_path: Path, fresh_warnings: None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyWarning)
        run_one(_cfg(tmp_path, "fedper", *MODES["secagg"], "rounds=1"), "fedper", SEED)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("method", METHODS)
def test_no_training_loss_or_state_size_reaches_the_rows(
    tmp_path: Path, method: str, mode: str
) -> None:
    """MOON's loss carries its contrastive term, FedRep's its two phases', and every one of them
    keeps a state whose size the plain run records: none of it in a private run's rows."""
    plain = _cfg(tmp_path / "plain", method, "rounds=1")
    private = _cfg(tmp_path / "private", method, "rounds=1", *MODES[mode])
    run_one(plain, method, SEED)
    summary = run_one(private, method, SEED)
    assert _rows(plain, method)[0]["train_loss"] is not None
    assert _rows(plain, method)[0]["client_state_bytes"] > 0
    for row in _rows(private, method):
        assert row["train_loss"] is None and "client_state_bytes" not in row
    assert summary is not None and "client_state_bytes" not in summary
