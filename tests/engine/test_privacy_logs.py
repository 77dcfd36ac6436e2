"""Under DP the logs and rows never name a client (the sample is secret: amplification by
subsampling assumes it), whatever path a client leaves the round by: its training raises (the
transport's warning), it leaves a secure round, or the secure round aborts for a reason that
names survivors. Without DP, or under ``dp.reproducible_noise`` (no privacy), the ids stay."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from fedlore.config import load_config
from fedlore.engine.rundir import run_dir
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_one
from fedlore.privacy import client_name
from fedlore.types import Broadcast, Scalars

SEED = 5
NAMED = re.compile(r"client \d|survivors \[|client \d+'s")


def _cfg(out: Path, *extra: str) -> Any:
    return load_config(
        None,
        [
            "name=privacy_logs",
            "num_clients=4",
            "rounds=2",
            "local_steps=1",
            "batch_size=16",
            "lr=1e-2",
            "model.kwargs={hidden: [16]}",
            "progress=false",
            f"output_dir={out}",
            "weighting=uniform",
            *extra,
        ],
    )


def _fail(monkeypatch: pytest.MonkeyPatch, clients: set[int]) -> None:
    """The clients in ``clients`` raise in round 1 (after sharing their keys, under secure
    aggregation)."""
    real = LocalTransport._train

    def flaky(self: LocalTransport, rnd: int, cid: int, msg: Broadcast) -> Any:
        if rnd == 1 and cid in clients:
            raise RuntimeError("lost connection")
        return real(self, rnd, cid, msg)

    monkeypatch.setattr(LocalTransport, "_train", flaky)


def _said(cfg: Any, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every warning of the run and every rejection reason of its rows."""
    folder = run_dir(cfg, "fedfull", SEED)
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    reasons = [why for r in rows for why in r.get("rejected_reasons", [])]
    return [r.getMessage() for r in caplog.records] + reasons


def test_a_failing_client_of_a_sampled_dp_round_is_not_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """2 of 4 clients sampled from OS entropy: whichever were sampled in round 1 fail there,
    and neither the transport's warning nor the loop's names them."""
    _fail(monkeypatch, {0, 1, 2, 3})
    cfg = _cfg(tmp_path, "dp.clip_norm=1", "dp.noise_multiplier=1", "participation=0.5")
    with caplog.at_level(logging.WARNING):
        assert run_one(cfg, "fedfull", SEED) is not None
    said = _said(cfg, caplog)
    assert any("a client failed in round 1" in s for s in said)
    assert not [s for s in said if NAMED.search(s)]


def test_an_aborted_secure_dp_round_does_not_name_its_survivors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Client 2 leaves round 1 and the survivors keep too few mask partners (threshold 2/3 of
    4), so the round aborts: under DP neither the log of the client that left nor the abort's
    reason (rows and log) names a client; under secure aggregation alone they do."""
    _fail(monkeypatch, {2})
    secure = ("secure_aggregation=true", "name=secure")
    cfg = _cfg(tmp_path, *secure, "dp.clip_norm=5", "dp.noise_multiplier=0.3")
    with caplog.at_level(logging.WARNING):
        assert run_one(cfg, "fedfull", SEED) is not None
    said = _said(cfg, caplog)
    assert any("3 survivor(s) keep at most 2 surviving mask partners" in s for s in said)
    assert any("a client left the secure round" in s for s in said)
    assert not [s for s in said if NAMED.search(s)]
    caplog.clear()
    plain = _cfg(tmp_path, *secure, "name=plain")
    with caplog.at_level(logging.WARNING):
        assert run_one(plain, "fedfull", SEED) is not None
    said = _said(plain, caplog)
    assert any("survivors [0, 1, 3] keep at most" in s for s in said)
    assert any("client 2 left the secure round" in s for s in said)


def test_client_name_hides_only_under_dp_with_secret_noise() -> None:
    dp: Scalars = {"privacy.secure": False, "privacy.clip_norm": 1.0, "privacy.reproducible": False}
    assert client_name(dp, 3) == "a client"
    assert client_name({**dp, "privacy.reproducible": True}, 3) == "client 3"  # no privacy
    assert client_name({**dp, "privacy.clip_norm": 0.0}, 3) == "client 3"  # secure agg. alone
    assert client_name({}, 3) == "client 3"  # neither mode
