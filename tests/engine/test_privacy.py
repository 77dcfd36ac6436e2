"""Secure aggregation, central and local DP in runs (fedlore.privacy through the loop and run_one;
the round itself: tests/privacy/test_round.py).

* A secure FedFull run gives the plain run's model; a client failing mid-round leaves the
  round complete; too few survivors abort the round and leave the model where it was; a DP run
  resumes after a kill (bit for bit only with ``dp.reproducible_noise``, which marks the run
  "no privacy"); methods that need individual uploads and settings that break the bound are
  refused with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.atomic import write_json
from fedlore.config import load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_experiment, run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.experiment_privacy import (
    NO_PRIVACY,
    PrivacyWarning,
    make_privacy,
    warn_over_target,
    warn_uncounted,
)
from fedlore.privacy import flatten, local_epsilon
from fedlore.privacy.dp import epsilon_spent
from fedlore.privacy.local_dp import UPLOADS_KEY
from fedlore.results.report import report
from fedlore.seeding import DP_NOISE, generator
from fedlore.types import Broadcast, Reply, State

SEED = 5


def _cfg(out: Path, *extra: str) -> Any:
    return load_config(
        None,
        [
            "name=privacy",
            "num_clients=4",
            "rounds=3",
            "local_steps=2",
            "batch_size=16",
            "lr=1e-2",
            "model.kwargs={hidden: [16]}",
            "partition.min_size=10",
            "progress=false",
            f"output_dir={out}",
            *extra,
        ],
    )


def _final_model(cfg: Any, method: str) -> dict[str, torch.Tensor]:
    _, state, _ = Checkpointer.load(run_dir(cfg, method, SEED) / "checkpoint.pt")
    return {k: v for k, v in state.arrays.items() if k.startswith("model.")}


def _rows(cfg: Any, method: str) -> list[dict[str, Any]]:
    path = run_dir(cfg, method, SEED) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_secure_fedfull_run_gives_the_plain_model(tmp_path: Path) -> None:
    plain = _cfg(tmp_path / "plain")
    secure = _cfg(tmp_path / "secure", "secure_aggregation=true")
    run_one(plain, "fedfull", SEED)
    summary = run_one(secure, "fedfull", SEED)
    assert summary is not None and "diverged" not in summary  # no train loss is released
    a, b = _final_model(plain, "fedfull"), _final_model(secure, "fedfull")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
    rows = _rows(secure, "fedfull")
    assert all(r["secagg_dropped"] == 0 and r["accepted"] == 4 for r in rows)
    assert all(
        r["bytes_up"] > p["bytes_up"] for r, p in zip(rows, _rows(plain, "fedfull"), strict=True)
    )


def _client_2_fails_in_round_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Client 2's training raises in round 1, after it shared its keys."""
    real = LocalTransport._train

    def flaky(self: LocalTransport, rnd: int, cid: int, msg: Broadcast) -> Any:
        if rnd == 1 and cid == 2:
            raise RuntimeError("lost connection after sharing its keys")
        return real(self, rnd, cid, msg)

    monkeypatch.setattr(LocalTransport, "_train", flaky)


def test_a_client_failing_mid_round_leaves_the_secure_round_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client 2 fails in round 1 after it shared its keys (its peers masked with it): the
    survivors' shares of its mask key unmask the sum and the round completes without it. With
    threshold 0.5 (t = 2 of 4 holders) each survivor keeps 2 > t − 1 surviving partners; at the
    default 2/3 (t = 3) the round would abort instead (next test)."""
    _client_2_fails_in_round_1(monkeypatch)
    extra = ("secure_aggregation=true", "weighting=uniform", "dp.clip_norm=5")
    cfg = _cfg(tmp_path, *extra, "dp.noise_multiplier=0.3", "secure_aggregation_threshold=0.5")
    summary = run_one(cfg, "fedfull", SEED)
    assert summary is not None and math.isfinite(summary["final_loss"])
    rows = _rows(cfg, "fedfull")
    assert rows[1]["accepted"] == 3 and rows[1]["secagg_dropped"] == 1
    # under DP the rows never name a client (the sample is secret): the reason, without its id
    assert rows[1]["rejected_reasons"] == ["RuntimeError: lost connection after sharing its keys"]
    assert not any("accepted_clients" in r for r in rows)
    assert rows[0]["accepted"] == rows[2]["accepted"] == 4
    assert all(r["secagg_aborted"] == 0 for r in rows)
    eps = [r["dp_epsilon"] for r in rows]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    assert summary["dp_noise_multiplier"] == 0.3 and summary["dp_epsilon"] == eps[-1]
    assert summary["dp_noise_source"] == "os" and "privacy" not in summary


def test_dp_rows_hide_the_sample_and_report_epsilon_against_who_knows_it(tmp_path: Path) -> None:
    """Two of four clients per round under DP: the rows never name the clients (amplification
    by subsampling assumes the sample is secret), and besides the amplified ``dp_epsilon`` they
    report ``dp_epsilon_sample_known``, the ε of every round as a full Gaussian release (against
    the server, which knows whom it sent the model): dp-accounting's values for both."""
    extra = ("weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1.5", "participation=0.5")
    cfg = _cfg(tmp_path, *extra)
    summary = run_one(cfg, "fedfull", SEED)
    assert summary is not None
    rows = _rows(cfg, "fedfull")
    assert rows and not any("accepted_clients" in r for r in rows)
    for t, r in enumerate(rows, start=1):
        assert r["dp_epsilon"] == pytest.approx(epsilon_spent(1.5, 1e-5, t, 4, 2), rel=1e-9)
        known = epsilon_spent(1.5, 1e-5, t, 4, 4)
        assert r["dp_epsilon_sample_known"] == pytest.approx(known, rel=1e-9)
        assert r["dp_epsilon_sample_known"] > r["dp_epsilon"]
    assert summary["dp_epsilon_sample_known"] == rows[-1]["dp_epsilon_sample_known"]


def test_a_dropout_that_leaves_a_survivor_exposed_to_t_minus_1_colluders_aborts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same failure at the default threshold (2/3 of 4: t = 3, so the round withstands 2
    colluders): each survivor keeps only 2 surviving partners, which 2 colluders could be, so
    the round aborts (model unchanged, counted) and the next one goes on."""
    _client_2_fails_in_round_1(monkeypatch)
    cfg = _cfg(tmp_path, "secure_aggregation=true", "weighting=uniform", "dp.clip_norm=5",
               "dp.noise_multiplier=0.3")  # fmt: skip
    summary = run_one(cfg, "fedfull", SEED)
    assert summary is not None
    rows = _rows(cfg, "fedfull")
    assert [r["secagg_aborted"] for r in rows[:3]] == [0, 1, 0]
    assert any("surviving mask partners" in why for why in rows[1]["rejected_reasons"])


class _Models:
    """A callback keeping the global model after every round."""

    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        self.after[rnd] = {k: v.clone() for k, v in state.arrays.items() if k.startswith("model.")}


def test_too_few_survivors_abort_the_round_and_the_model_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two of four clients fail in round 1 (secure_aggregation_threshold 2/3: 3 must survive):
    the round is aborted, nothing is unmasked, the model after round 1 is the model after round
    0, and the row says why; the next round runs as usual."""
    real = LocalTransport._train

    def flaky(self: LocalTransport, rnd: int, cid: int, msg: Broadcast) -> Any:
        if rnd == 1 and cid in (1, 3):
            raise RuntimeError("gone")
        return real(self, rnd, cid, msg)

    monkeypatch.setattr(LocalTransport, "_train", flaky)
    cfg = _cfg(tmp_path, "secure_aggregation=true")
    models = _Models()
    run_one(cfg, "fedfull", SEED, extra_callbacks=(models,))
    rows = _rows(cfg, "fedfull")
    assert rows[1]["secagg_aborted"] == 1 and rows[1]["accepted"] == 0
    assert rows[1]["secagg_dropped"] == 4
    assert all("aborted" in why and "2 of 4 clients remain, 3 needed" in why
               for why in rows[1]["rejected_reasons"])  # fmt: skip
    assert all(torch.equal(models.after[0][k], models.after[1][k]) for k in models.after[0])
    assert rows[2]["secagg_aborted"] == 0 and rows[2]["accepted"] == 4
    assert not all(torch.equal(models.after[1][k], models.after[2][k]) for k in models.after[1])


def test_dp_runs_are_private_not_reproducible_and_resume(tmp_path: Path) -> None:
    """A DP run (secure aggregation, σ solved for ε = 20) killed after round 0 resumes from its
    checkpoint to the end with the same ε per round; two runs of the same seed end in different
    models (their noise comes from OS entropy)."""
    extra = ("secure_aggregation=true", "weighting=uniform", "dp.clip_norm=1", "dp.epsilon=20")
    whole = _cfg(tmp_path / "whole", *extra)
    again = _cfg(tmp_path / "again", *extra)
    parts = _cfg(tmp_path / "parts", *extra)
    run_one(whole, "fedfull", SEED)
    run_one(again, "fedfull", SEED)
    assert run_one(parts, "fedfull", SEED, stop_after=0) is None
    summary = run_one(parts, "fedfull", SEED, resume=True)
    assert summary is not None and summary["rounds"] == 3
    a, b = _final_model(whole, "fedfull"), _final_model(again, "fedfull")
    assert not all(torch.equal(a[k], b[k]) for k in a)
    eps = [r["dp_epsilon"] for r in _rows(whole, "fedfull")]
    assert eps == [r["dp_epsilon"] for r in _rows(parts, "fedfull")]
    assert eps[-1] == pytest.approx(20.0, rel=1e-3)


def test_reproducible_noise_replays_and_says_no_privacy(tmp_path: Path) -> None:
    """``dp.reproducible_noise: true``: a kill-and-resume gives the uninterrupted run's model bit
    for bit, and the summary and the report row say the run has no privacy."""
    extra = ("weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1",
             "dp.reproducible_noise=true", "participation=0.5")  # fmt: skip
    whole = _cfg(tmp_path / "whole", *extra)
    parts = _cfg(tmp_path / "parts", *extra)
    summary = run_one(whole, "fedfull", SEED)
    assert summary is not None and summary["privacy"] == NO_PRIVACY
    assert summary["dp_noise_source"] == "seed"
    assert run_one(parts, "fedfull", SEED, stop_after=0) is None
    run_one(parts, "fedfull", SEED, resume=True)
    a, b = _final_model(whole, "fedfull"), _final_model(parts, "fedfull")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["accepted_clients"] for r in _rows(whole, "fedfull")] == [
        r["accepted_clients"] for r in _rows(parts, "fedfull")
    ]
    assert "no privacy (1 run with seeded noise)" in report(tmp_path / "whole" / "privacy")


@pytest.mark.parametrize(
    ("method", "extra", "match"),
    [
        ("fedlore", ["secure_aggregation=true"], "candidate"),
        ("fedfull", ["dp.clip_norm=1", "dp.noise_multiplier=1"], "weighting=uniform"),
        ("fedfull", ["secure_aggregation=true", "robust.aggregate=median"], "robust.aggregate"),
        ("fedfull", ["secure_aggregation=true", "transport_dtype=bf16"], "transport_dtype"),
        ("fedfull", ["secure_aggregation=true", "participation=0.25"], "at least 2 clients"),
        ("fedfull", ["secure_aggregation_degree=3"], "secure_aggregation is off"),
        ("fedlore_fixed", ["secure_aggregation=true"], "secure_aggregation .*init_basis"),
        ("fedlore_sketch", ["weighting=uniform", "dp.clip_norm=1", "dp.epsilon=1e-6"], "raise dp"),
        ("fedfull", ["secure_aggregation=true", "secure_aggregation_threshold=5"], "exceeds the 4"),
        ("fedfull", ["secure_aggregation=true", "secure_aggregation_threshold=1"], "at least 2"),
        ("fedfull", ["secure_aggregation=true", "secure_aggregation_threshold=1.5"], "fraction"),
        ("fedfull", ["secure_aggregation=true", "secure_aggregation_range=1e15"], "fraction bits"),
        ("fedfull", ["secure_aggregation=true", "secure_aggregation_range=0.01"], "equal to 1"),
        ("fedfull", ["secure_aggregation=true", "participation=0.5"], r"1 mask partner\(s\)"),
        ("fedfull", ["secure_aggregation=true", "flower.site_data=true"], "secagg_max_weight"),
        (
            "fedfull",
            [
                "secure_aggregation=true",
                "weighting=uniform",
                "dp.clip_norm=1",
                "dp.noise_multiplier=1",
                "dp.colluding_clients=3",
            ],
            "no honest survivor",
        ),
    ],
)
def test_settings_that_cannot_hold_are_refused_with_the_reason(
    tmp_path: Path, method: str, extra: list[str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):  # ConfigError, or the accountant's refusal
        cfg = _cfg(tmp_path, *extra)
        make_privacy(cfg, make_algorithm(method, cfg), SEED)


def test_adaptive_clipping_resumes_from_the_clip_norm_it_reached(tmp_path: Path) -> None:
    """A run with adaptive clipping killed after round 1 resumes with the clip norm the
    checkpoint holds (not dp.clip_norm again), and the rows report each round's C."""
    extra = ("weighting=uniform", "dp.clip_norm=50", "dp.noise_multiplier=0.3",
             "dp.target_quantile=0.5", "dp.clip_lr=0.5")  # fmt: skip
    cfg = _cfg(tmp_path, *extra)
    assert run_one(cfg, "fedfull", SEED, stop_after=1) is None
    _, state, _ = Checkpointer.load(run_dir(cfg, "fedfull", SEED) / "checkpoint.pt")
    reached = state.values["privacy.clip_norm"]
    rows = _rows(cfg, "fedfull")
    assert rows[0]["dp_clip_norm"] == 50.0 and rows[1]["dp_clip_norm"] < 50.0  # all unclipped
    assert reached < rows[1]["dp_clip_norm"]
    run_one(cfg, "fedfull", SEED, resume=True)
    rows = _rows(cfg, "fedfull")
    assert rows[2]["dp_clip_norm"] == pytest.approx(reached)
    assert all(0.0 <= r["dp_unclipped_fraction"] + 1.5 <= 3.0 for r in rows)


def test_adaptive_clipping_needs_enough_count_noise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        _cfg(tmp_path, "weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=2",
             "dp.target_quantile=0.5", "dp.clipped_count_stddev=0.5")  # fmt: skip
    cfg = _cfg(
        tmp_path,
        "weighting=uniform",
        "dp.clip_norm=1",
        "dp.noise_multiplier=8",
        "dp.target_quantile=0.5",
    )  # fmt: skip (default σ_b = m / 20 = 0.2 < 8 / 2)
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        make_privacy(cfg, make_algorithm("fedfull", cfg), SEED)


def _eps(t: int) -> float:
    return epsilon_spent(1.5, 1e-5, t, 4, 4)


def test_rounds_run_again_after_a_resume_are_counted_in_epsilon(tmp_path: Path) -> None:
    """A DP round whose row was written (a release) but whose checkpoint was not — here the
    round-1 checkpoint put back after round 2 — runs again on resume with fresh noise: both
    releases count. The ledger records 1 repeated exchange and every later row's ε counts it;
    a fresh run in the same folder starts without it."""
    extra = ("weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1.5", "rounds=4")
    cfg = _cfg(tmp_path, *extra)
    out = run_dir(cfg, "fedfull", SEED)
    assert run_one(cfg, "fedfull", SEED, stop_after=1) is None
    round1 = (out / "checkpoint.pt").read_bytes()
    assert run_one(cfg, "fedfull", SEED, resume=True, stop_after=2) is None
    assert [r["dp_epsilon"] for r in _rows(cfg, "fedfull")] == pytest.approx(
        [_eps(1), _eps(2), _eps(3)]
    )
    (out / "checkpoint.pt").write_bytes(round1)  # killed between round 2's row and checkpoint
    summary = run_one(cfg, "fedfull", SEED, resume=True)
    assert summary is not None
    assert json.loads((out / "dp_ledger.json").read_text()) == {"repeated_exchanges": 1}
    eps = [r["dp_epsilon"] for r in _rows(cfg, "fedfull")]
    assert eps == pytest.approx([_eps(1), _eps(2), _eps(4), _eps(5)])  # round 2 twice
    assert summary["dp_epsilon"] == pytest.approx(_eps(5))
    run_one(cfg, "fedfull", SEED, overwrite=True)
    assert not (out / "dp_ledger.json").exists()
    assert _rows(cfg, "fedfull")[-1]["dp_epsilon"] == pytest.approx(_eps(4))


def test_a_resume_whose_repeats_pass_the_epsilon_target_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """σ solved for ``dp.epsilon`` over 4 rounds; a kill between round 2's row and its
    checkpoint makes the resume release round 2 twice, so the run must end above its target:
    it says so (a PrivacyWarning naming the ε it will reach) before training on, and its
    summary records the repeats; the ledger's count is not said a second time (one line, not a
    log line besides the warning). A resume that repeats nothing stays within the target and
    does not warn; a repeat without a target (``dp.noise_multiplier``) says the ledger's count
    in one log line."""
    extra = ("weighting=uniform", "dp.clip_norm=1", "dp.epsilon=8", "rounds=4")
    cfg = _cfg(tmp_path, *extra)
    out = run_dir(cfg, "fedfull", SEED)
    assert run_one(cfg, "fedfull", SEED, stop_after=1) is None
    round1 = (out / "checkpoint.pt").read_bytes()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert run_one(cfg, "fedfull", SEED, resume=True, stop_after=2) is None
    assert not [w for w in seen if issubclass(w.category, PrivacyWarning)]
    (out / "checkpoint.pt").write_bytes(round1)
    ledger_said = "ε counts them too"
    with (
        caplog.at_level(logging.WARNING),
        pytest.warns(PrivacyWarning, match=r"end at ε = [\d.]+, above its target") as caught,
    ):
        summary = run_one(cfg, "fedfull", SEED, resume=True)
    assert len([w for w in caught if issubclass(w.category, PrivacyWarning)]) == 1
    assert not [r for r in caplog.records if ledger_said in r.getMessage()]
    assert summary is not None and summary["dp_repeated_exchanges"] == 1
    said = float(re.search(r"ε = ([\d.]+)", str(caught[0].message)).group(1))  # type: ignore[union-attr]
    assert 8 < summary["dp_epsilon"] == pytest.approx(said, rel=1e-3)
    free = _cfg(tmp_path / "free", "weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1")
    free_out = run_dir(free, "fedfull", SEED)
    assert run_one(free, "fedfull", SEED, stop_after=0) is None
    round0 = (free_out / "checkpoint.pt").read_bytes()
    assert run_one(free, "fedfull", SEED, resume=True, stop_after=1) is None
    (free_out / "checkpoint.pt").write_bytes(round0)  # round 1 is released again
    caplog.clear()
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_one(free, "fedfull", SEED, resume=True, stop_after=1)
    lines = [r.getMessage() for r in caplog.records if ledger_said in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("1 DP exchange(s)"), lines
    assert not [w for w in seen if issubclass(w.category, PrivacyWarning)]


def test_starting_a_dp_run_over_an_unfinished_one_warns_of_its_uncounted_releases(
    tmp_path: Path,
) -> None:
    """A fresh run (no --resume) over an unfinished DP run discards its released rows and
    starts ε from zero: it warns, naming how many releases go uncounted (rows plus the ledger's
    repeats). Replacing a finished run (--overwrite) is the user's own choice and does not."""
    extra = ("weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1.5")
    cfg = _cfg(tmp_path, *extra)
    assert run_one(cfg, "fedfull", SEED, stop_after=1) is None  # rounds 0 and 1 released
    write_json(run_dir(cfg, "fedfull", SEED) / "dp_ledger.json", {"repeated_exchanges": 1})
    with pytest.warns(PrivacyWarning, match="discards the 3 release"):
        summary = run_one(cfg, "fedfull", SEED)
    assert summary is not None and summary["dp_epsilon"] == pytest.approx(_eps(3))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_one(cfg, "fedfull", SEED, overwrite=True)
    assert not [w for w in seen if issubclass(w.category, PrivacyWarning)]


def test_the_ledger_warnings_name_what_they_count_and_need_dp(tmp_path: Path) -> None:
    """``warn_uncounted`` names the releases (rows plus the ledger's repeats) that starting over
    leaves uncounted and ``warn_over_target`` the ε a resume with repeats reaches, strictly
    above ``dp.epsilon`` (ending exactly at it is within the target); neither warns without
    DP (no privacy, or secure aggregation alone) or, for the target, without repeats."""
    out = tmp_path / "unfinished"
    out.mkdir()
    rows = [{"round": r, "dp_epsilon": _eps(r + 1)} for r in range(2)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_json(out / "dp_ledger.json", {"repeated_exchanges": 1})
    cfg = _cfg(tmp_path, "weighting=uniform", "dp.clip_norm=1", "dp.epsilon=6", "rounds=4")
    secure_cfg = _cfg(tmp_path, "secure_aggregation=true")
    secure = make_privacy(secure_cfg, make_algorithm("fedfull", secure_cfg), SEED)
    dp = make_privacy(cfg, make_algorithm("fedfull", cfg), SEED)
    assert secure is not None and secure.dp is None and dp is not None and dp.dp is not None
    repeats = dataclasses.replace(dp, repeated=1)
    final = repeats.epsilon(cfg.rounds - 1)
    assert final > 6 >= dp.epsilon(cfg.rounds - 1)

    def at(target: float) -> Any:
        return cfg.model_copy(update={"dp": cfg.dp.model_copy(update={"epsilon": target})})

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for privacy in (None, secure):
            warn_uncounted(privacy, out)
            warn_over_target(cfg, privacy)
        warn_over_target(cfg, dp)  # no repeats
        warn_over_target(at(final), repeats)  # exactly at the target
    assert not [w for w in seen if issubclass(w.category, PrivacyWarning)]
    uncounted = (
        f"DP: starting over discards the 3 release(s) the unfinished run in {out} made, and this "
        "run's ε does not count them; if anyone may have seen them (its metrics.jsonl, a "
        "tracker), continue that run with --resume, whose ε does"
    )
    with pytest.warns(PrivacyWarning, match=f"^{re.escape(uncounted)}$"):
        warn_uncounted(dp, out)
    below = math.nextafter(final, 0.0)
    over = (
        f"DP: 1 exchange(s) released before this resume run again with fresh noise, so the run "
        f"will end at ε = {final:.4g}, above its target dp.epsilon = {below:g} (σ was solved "
        "for the exchanges without repeats)"
    )
    with pytest.warns(PrivacyWarning, match=f"^{re.escape(over)}$"):
        warn_over_target(at(below), repeats)


def test_a_resume_without_a_checkpoint_counts_every_earlier_release(tmp_path: Path) -> None:
    """``checkpoint: false``: a resume starts from the first round, so every round the killed
    attempt released is released again; ε continues from their count instead of restarting."""
    extra = ("weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1.5", "checkpoint=false")
    cfg = _cfg(tmp_path, *extra)
    assert run_one(cfg, "fedfull", SEED, stop_after=1) is None
    summary = run_one(cfg, "fedfull", SEED, resume=True)
    assert summary is not None
    eps = [r["dp_epsilon"] for r in _rows(cfg, "fedfull")]
    assert eps == pytest.approx([_eps(3), _eps(4), _eps(5)])


def test_a_resume_from_the_first_round_counts_every_earlier_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A simulated run whose clients keep no states to resume from (FedBuff on the wall clock)
    runs again from round 0 on --resume (``from_start``) even with a checkpoint there: every
    round the killed attempt released is released again, and ε counts them (it restarted from
    0 before: a resumed simulation under-reported ε). The simulation asks for exactly this."""
    extra = ("weighting=uniform", "dp.clip_norm=1", "dp.noise_multiplier=1.5")
    cfg = _cfg(tmp_path, *extra)
    out = run_dir(cfg, "fedfull", SEED)
    assert run_one(cfg, "fedfull", SEED, stop_after=1) is None  # rounds 0 and 1 released
    assert (out / "checkpoint.pt").exists()
    summary = run_one(cfg, "fedfull", SEED, resume=True, from_start=True)
    assert summary is not None
    rows = _rows(cfg, "fedfull")
    assert [r["round"] for r in rows] == [0, 1, 2]  # from round 0 again, not after round 1
    assert json.loads((out / "dp_ledger.json").read_text()) == {"repeated_exchanges": 2}
    assert [r["dp_epsilon"] for r in rows] == pytest.approx([_eps(3), _eps(4), _eps(5)])

    from fedlore.flower import simulation

    asked: dict[str, Any] = {}

    def capture(*args: Any, **kwargs: Any) -> Any:
        asked.update(kwargs)
        raise RuntimeError("captured")

    monkeypatch.setattr(simulation, "make_apps", capture)
    fresh = _cfg(tmp_path / "sim", *extra)
    for resume in (True, False):
        with pytest.raises(RuntimeError, match="captured"):
            simulation.run_simulated(fresh, "fedfull", SEED, resume=resume)
        assert asked["restart"] is resume


def test_a_secure_round_that_cannot_hold_is_refused_before_any_run_folder(tmp_path: Path) -> None:
    """Two clients per round under in-process secure aggregation: refused by the preflight,
    once, with the reason, and no run folder (not even a lock) is left behind."""
    cfg = _cfg(tmp_path, "algorithms=[fedfull]", "secure_aggregation=true", "participation=0.5")
    with pytest.raises(
        ValueError, match=r"^method 'fedfull': secure_aggregation: a client of this"
    ):
        run_experiment(cfg)
    assert not (tmp_path / "privacy").exists()


def test_settings_that_remove_privacy_warn_even_with_progress_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`progress: false` silences progress messages; it used to silence these warnings too
    (they went through the progress log), so a run with no privacy said nothing at start."""
    from fedlore import progress
    from fedlore.cli import main

    monkeypatch.setattr(progress, "_SAID", set())  # said once per process: not yet here
    args = [
        f"output_dir={tmp_path}",
        "name=silent",
        "algorithms=[fedfull]",
        "rounds=1",
        "num_clients=4",
        "progress=false",
        "weighting=uniform",
        "dp.clip_norm=1",
        "dp.noise_multiplier=0",
        "dp.delta=0.5",
        "dp.reproducible_noise=true",
    ]
    assert main(["run", *args]) == 0
    err = capsys.readouterr().err
    assert "fedlore: warning: DP: dp.reproducible_noise=true" in err and "NO PRIVACY" in err
    assert "fedlore: warning: DP: dp.noise_multiplier = 0 adds no noise" in err
    assert "fedlore: warning: DP: dp.delta = 0.5 is not below 1/num_clients = 0.25" in err


# ------------------------------------------------------------------ local DP (dp.mode: local)

LOCAL = ("weighting=uniform", "dp.clip_norm=1", "dp.mode=local")


def _uploads(cfg: Any) -> dict[int, int]:
    """Each client's count of exchanges, as the run's last checkpoint holds it."""
    _, state, _ = Checkpointer.load(run_dir(cfg, "fedfull", SEED) / "checkpoint.pt")
    text = str(state.values[UPLOADS_KEY])
    return {int(c): int(n) for c, n in (item.split(":") for item in text.split(","))}


def test_a_local_dp_run_reports_the_worst_off_clients_epsilon_and_resumes(tmp_path: Path) -> None:
    """Two of four clients per round under local DP, killed after round 1 and resumed: the
    checkpoint's counts of exchanges go on from where they were (two clients a round, four
    rounds: 8 in all), each row's ``dp_epsilon`` is the ε of the client with the most
    exchanges, without amplification (more than the sampled accountant gives for as many),
    the rows name no client and carry no clip count, and the summary says the mode."""
    cfg = _cfg(tmp_path, *LOCAL, "dp.noise_multiplier=1.5", "participation=0.5", "rounds=4")
    assert run_one(cfg, "fedfull", SEED, stop_after=1) is None
    assert sum(_uploads(cfg).values()) == 4
    summary = run_one(cfg, "fedfull", SEED, resume=True)
    assert summary is not None and summary["dp_mode"] == "local"
    counts = _uploads(cfg)
    assert sum(counts.values()) == 8 and max(counts.values()) >= 2
    rows = _rows(cfg, "fedfull")
    eps = [r["dp_epsilon"] for r in rows]
    assert eps == sorted(eps)
    most = max(counts.values())
    assert summary["dp_epsilon"] == eps[-1] == local_epsilon(1.5, 1e-5, most)
    assert eps[-1] > 1.1 * epsilon_spent(1.5, 1e-5, most, 4, 2)  # amplified: less
    for r in rows:
        assert not {"accepted_clients", "dp_clipped", "dp_epsilon_sample_known"} & r.keys()
    assert "dp_epsilon_sample_known" not in summary and "dp_clipped_total" not in summary
    # the report's privacy cell says whose ε it is: a local run's, not a central one's
    shown = report(tmp_path / cfg.name)
    assert f"local DP: {summary['dp_epsilon']:.3g} (1e-05) / 1.5 / 1 / " in shown


class _Received:
    """What the server receives in round 0: each client's reply arrays, flattened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.uploads: dict[int, torch.Tensor] = {}
        real = LocalTransport.send

        def send(transport: LocalTransport, rnd: int, messages: Any) -> Any:
            out = real(transport, rnd, messages)
            if rnd == 0:
                uploads = {}
                for c, r in out.items():
                    assert isinstance(r, Reply), r  # every client of round 0 replies
                    uploads[c] = flatten(r.arrays)
                self.uploads = uploads
            return out

        monkeypatch.setattr(LocalTransport, "send", send)

    def vector(self) -> torch.Tensor:
        return torch.cat([self.uploads[c] for c in sorted(self.uploads)])


def test_a_server_that_reruns_the_clients_with_the_seed_cannot_remove_local_noise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The honest-but-curious server records the uploads it receives and reruns every client
    with the run's seed (round 0: the same model, the same training generator, so the same
    clipped update, here a run with σ = 0). Subtracting it from the recorded uploads leaves noise
    of std σC on each of the 4 · 1210 coordinates, and a second run of the same seed receives
    other uploads. Under ``dp.reproducible_noise`` the same server also regenerates the noise
    (the seeded stream of each client) and recovers the clipped updates exactly."""
    received = _Received(monkeypatch)
    sigma = 0.8
    uploads = []
    for name in ("one", "two"):
        run_one(_cfg(tmp_path / name, *LOCAL, f"dp.noise_multiplier={sigma}", "rounds=1"),
                "fedfull", SEED)  # fmt: skip
        uploads.append(received.vector())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)  # σ = 0: no noise, the attacker's rerun
        run_one(_cfg(tmp_path / "rerun", *LOCAL, "dp.noise_multiplier=0", "rounds=1"),
                "fedfull", SEED)  # fmt: skip
    clipped = received.vector()
    assert clipped.numel() == 4 * 1210 and float(clipped.abs().max()) > 0
    residual = uploads[0] - clipped
    n = residual.numel()
    assert abs(float(residual.std()) / sigma - 1) < 6 / math.sqrt(2 * n)
    assert abs(float(residual.mean())) < 6 * sigma / math.sqrt(n)
    assert not torch.equal(uploads[0], uploads[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        run_one(_cfg(tmp_path / "seeded", *LOCAL, f"dp.noise_multiplier={sigma}", "rounds=1",
                     "dp.reproducible_noise=true"), "fedfull", SEED)  # fmt: skip
    for c, got in received.uploads.items():
        g = generator(SEED, DP_NOISE, 0, c)
        noise = sigma * torch.randn(got.numel(), generator=g, dtype=torch.float64)
        truth = clipped[c * 1210 : (c + 1) * 1210]
        assert (got - noise - truth).abs().max().item() < 1e-5


def test_local_dp_with_secure_aggregation_reaches_its_target_epsilon(tmp_path: Path) -> None:
    """Local DP composes with in-process secure aggregation: σ solved for ε = 20 over the run's
    3 exchanges (a client in every one, as full participation makes every client), each client
    masks its whole noise, and the run ends at ε = 20."""
    cfg = _cfg(tmp_path, *LOCAL, "dp.epsilon=20", "secure_aggregation=true")
    summary = run_one(cfg, "fedfull", SEED)
    assert summary is not None and summary["dp_mode"] == "local"
    rows = _rows(cfg, "fedfull")
    assert all(r["secagg_aborted"] == 0 and r["accepted"] == 4 for r in rows)
    sigma = summary["dp_noise_multiplier"]
    assert [r["dp_epsilon"] for r in rows] == [local_epsilon(sigma, 1e-5, t) for t in (1, 2, 3)]
    assert rows[-1]["dp_epsilon"] == pytest.approx(20.0, rel=1e-3) and rows[-1]["dp_epsilon"] <= 20
    assert _uploads(cfg) == {0: 3, 1: 3, 2: 3, 3: 3}
