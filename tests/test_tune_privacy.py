"""The ε of a whole ``fedlore tune`` search under DP (:mod:`fedlore.tune_privacy`,
:mod:`fedlore.privacy.composition`): trials that share (σ, N, m) compose to one run of their
total exchanges (checked against :func:`~fedlore.privacy.dp.epsilon_spent`), the search spends
more than its largest trial, a pruned trial counts the rounds it ran, a resumed trial its
repeated releases, local DP its busiest client over every trial, a damaged folder is
over-counted and named, and both ε's (sample hidden, sample known) and both accountants."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore import cli, progress
from fedlore.config import Config, apply_overrides, validate
from fedlore.engine.rundir import run_dir
from fedlore.experiment_privacy import PrivacyWarning
from fedlore.privacy.composition import Exchanges, composed_epsilon
from fedlore.privacy.dp import epsilon_spent, update_noise_multiplier
from fedlore.privacy.local_dp import UPLOADS_KEY, local_epsilon
from fedlore.tune import plan_search, trial_config
from fedlore.tune_privacy import TrialSpend, search_privacy, trial_spend
from fedlore.tune_study import TrialRow, run_search
from fedlore.tune_study import _privacy as study_privacy

TINY = [
    "name=tiny",
    "rounds=2",
    "num_clients=3",
    "local_steps=2",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    "partition.min_size=10",
    "progress=false",
    "algorithms=[fedavg]",
    "seeds=[1]",
    "data.selection_fraction=0.2",
    "threads=1",
    "device=cpu",
]
DP = ["dp.clip_norm=1.0", "dp.noise_multiplier=1.5", "weighting=uniform"]
DELTA = 1e-5  # dp.delta's default
SIGMA = 1.5


def config(tmp: Path, *extra: str) -> Config:
    return validate(apply_overrides({}, [*TINY, *DP, f"output_dir={tmp}", *extra]))


# composition ------------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("per_round", [10, 6, 3])  # 6: the PLD wins
def test_trials_that_share_the_mechanism_compose_to_one_run_of_their_total(
    accountant: str, per_round: int
) -> None:
    counts = [7, 3, 12]
    parts = [Exchanges(SIGMA, 10, per_round, n) for n in counts]
    eps = composed_epsilon(parts, DELTA, accountant=accountant)
    one = epsilon_spent(SIGMA, DELTA, sum(counts), 10, per_round, accountant=accountant)
    assert eps == pytest.approx(one, rel=1e-9)
    largest = epsilon_spent(SIGMA, DELTA, max(counts), 10, per_round, accountant=accountant)
    assert eps > largest * 1.2  # the search spends more than its largest trial
    known = composed_epsilon([p.known() for p in parts], DELTA, accountant=accountant)
    assert known == pytest.approx(epsilon_spent(SIGMA, DELTA, 22, 10, 10, accountant=accountant))


def test_trials_of_other_settings_add_their_renyi_curves() -> None:
    a, b = Exchanges(SIGMA, 10, 3, 5), Exchanges(2 * SIGMA, 10, 10, 8)
    both = composed_epsilon([a, b], DELTA)
    assert both > max(composed_epsilon([a], DELTA), composed_epsilon([b], DELTA))
    assert both < composed_epsilon([a], DELTA) + composed_epsilon([b], DELTA)  # not ε summed
    assert composed_epsilon([b, a], DELTA) == pytest.approx(both, rel=1e-12)
    assert composed_epsilon([Exchanges(0.0, 10, 3, 1), a], DELTA) == float("inf")
    assert composed_epsilon([Exchanges(0.0, 10, 3, 0)], DELTA) == 0.0
    pld = composed_epsilon([a, b], DELTA, accountant="pld")
    assert pld <= both  # the smaller of the two valid bounds
    assert composed_epsilon([a.known(), b], DELTA, accountant="pld") < composed_epsilon(
        [a.known(), b], DELTA
    )  # unsampled: the PLD is the tighter one
    with pytest.raises(ValueError, match=r"dp\.accountant"):
        composed_epsilon([a], DELTA, accountant="moments")


# one trial's folder -------------------------------------------------------------------------


def rows(cfg: Config, rounds: list[int], eps: float = 0.1, tail: str = "") -> Path:
    run = run_dir(cfg, "fedavg", 1)
    run.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"round": r, "dp_epsilon": eps, "selection_accuracy": 0.5}) for r in rounds]
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in lines) + tail)
    return run


def spend(cfg: Config, state: str = "complete", note: str = "") -> TrialSpend:
    return trial_spend(0, state, note, cfg, "fedavg", 1)


def test_a_pruned_trial_counts_the_rounds_it_ran(tmp_path: Path) -> None:
    cfg = config(tmp_path, "rounds=5")
    rows(cfg, [0, 1], tail='{"round": 2, "dp_ep')  # a torn last line: no row
    s = spend(cfg, "pruned", "after round 1")
    assert (s.exchanges, s.overcounted, s.sigma) == (2, "", SIGMA)
    rows(cfg, [0])  # its rows end before the round it was pruned after: rows are missing
    assert spend(cfg, "pruned", "after round 1").exchanges == 5


def test_a_resumed_trials_repeated_releases_are_counted(tmp_path: Path) -> None:
    cfg = config(tmp_path, "rounds=3")
    run = rows(cfg, [0, 1, 2])
    (run / "summary.json").write_text("{}")
    assert spend(cfg).exchanges == 3
    (run / "dp_ledger.json").write_text(json.dumps({"repeated_exchanges": 2}))
    assert (spend(cfg).exchanges, spend(cfg).overcounted) == (5, "")
    (run / "dp_ledger.json").write_text("{")  # damaged: said; the summary's count is kept
    (run / "summary.json").write_text(json.dumps({"dp_repeated_exchanges": 2}))
    s = spend(cfg)
    assert s.exchanges == 5 and "dp_ledger.json cannot be read" in s.overcounted


@pytest.mark.parametrize("lost", ["summary", "summary_count"])
def test_a_lost_ledger_is_counted_at_the_epsilon_the_trial_recorded(
    tmp_path: Path, lost: str
) -> None:
    """A resumed trial (4 releases run again) whose ledger is lost: its own recorded ε proves
    it made 7 + 4 exchanges, so it is never counted at its configured 7."""
    cfg = config(tmp_path, "rounds=7")
    true = 11
    recorded = epsilon_spent(SIGMA, DELTA, true, 3, 3)
    run = rows(cfg, list(range(7)), eps=recorded)
    if lost == "summary_count":  # summary kept, but its count of repeats zeroed
        (run / "summary.json").write_text(
            json.dumps({"dp_epsilon": recorded, "dp_repeated_exchanges": 0})
        )
    s = spend(cfg)
    assert s.exchanges == true and s.overcounted
    assert epsilon_spent(SIGMA, DELTA, s.exchanges, 3, 3) >= recorded
    above = recorded * (1 + 1e-12)  # float noise above the true count's ε: not one more
    rows(cfg, list(range(7)), eps=above)
    assert spend(cfg).exchanges == true


def test_a_lost_local_ledger_is_counted_at_the_busiest_clients_recorded_epsilon(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "rounds=3", "dp.mode=local", "participation=0.34")  # 1 of 3
    sigma = spend(cfg).sigma  # sampling does not amplify local DP: ε of 6 uploads, not rounds
    rows(cfg, [0, 1, 2], eps=local_epsilon(sigma, DELTA, 6))
    s = spend(cfg)
    assert s.exchanges == 6 and s.overcounted


def test_a_damaged_folder_is_over_counted_and_named(tmp_path: Path) -> None:
    cfg = config(tmp_path, "rounds=4")
    missing = spend(cfg, "failed")  # no run folder: it may have run before it was lost
    assert missing.exchanges == 4 and "no run folder" in missing.overcounted
    run = rows(cfg, [0, 1])
    assert spend(cfg, "failed").exchanges == 2  # a failed trial: what it released
    assert spend(cfg, "complete").exchanges == 4  # complete, but no summary
    (run / "summary.json").write_text(json.dumps({"dp_epsilon": 0.1}))
    assert (spend(cfg).exchanges, spend(cfg).overcounted) == (2, "")  # early stopping
    ahead = epsilon_spent(SIGMA, DELTA, 3, 3, 3)  # rows of its last round went missing
    (run / "summary.json").write_text(json.dumps({"dp_epsilon": ahead}))
    assert spend(cfg).exchanges == 4 and "more than its rows account for" in spend(cfg).overcounted
    (run / "summary.json").write_text("{")
    assert "summary.json cannot be read" in spend(cfg).overcounted
    (run / "summary.json").unlink()
    rows(cfg, [0, 1], tail="garbage\n" + json.dumps({"round": 2, "dp_epsilon": 0.1}) + "\n")
    torn = spend(cfg, "failed")  # a line lost before the last
    assert torn.exchanges == 4 and "unreadable lines" in torn.overcounted
    (run / "metrics.jsonl").unlink()
    assert spend(cfg, "failed").exchanges == 0  # failed before its first release
    (run / "checkpoint.pt").write_bytes(b"")
    assert spend(cfg, "failed").exchanges == 4  # a checkpoint, but no rows
    assert trial_spend(0, "failed", "", None, "fedavg", 1).exchanges == 0  # config refused


def test_a_methods_setup_exchanges_are_counted(tmp_path: Path) -> None:
    cfg = config(tmp_path, "algorithms=[fedlore_sketch]")
    run = run_dir(cfg, "fedlore_sketch", 1)
    run.mkdir(parents=True)
    rows_ = [json.dumps({"round": r, "dp_epsilon": 0.1}) for r in (0, 1)]  # setup row lost
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in rows_))
    assert trial_spend(0, "failed", "", cfg, "fedlore_sketch", 1).exchanges == 3


def test_the_search_counts_every_trial_of_the_study(tmp_path: Path) -> None:
    raw = apply_overrides({}, [*TINY, *DP, "rounds=3", f"output_dir={tmp_path}",
                               "tune.space={lr: 'log:1e-3:1e-1'}"])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        search = plan_search(validate(raw), raw, "tiny.yaml")
    states = [("complete", "", [0, 1, 2]), ("pruned", "after round 0", [0]), ("failed", "", [0])]
    for n, (_, _, done) in enumerate(states):
        rows(trial_config(search, n, {"lr": 0.01}), done)
    (run_dir(trial_config(search, 0, {"lr": 0.01}), "fedavg", 1) / "summary.json").write_text("{}")
    table = [
        TrialRow(n, state, {"lr": 0.01}, 0.5, note) for n, (state, note, _) in enumerate(states)
    ]
    s = study_privacy(search, table)
    assert (s.trials, s.exchanges) == (3, 5)
    assert s.epsilon == pytest.approx(epsilon_spent(SIGMA, DELTA, 5, 3, 3))


def test_adaptive_clipping_is_accounted_at_the_total_multiplier(tmp_path: Path) -> None:
    cfg = config(tmp_path, "dp.target_quantile=0.5", "dp.clipped_count_stddev=2.0")
    rows(cfg, [0, 1])
    assert update_noise_multiplier(SIGMA, 2.0) > SIGMA
    assert spend(cfg, "failed").sigma == SIGMA  # as the run's accountant is fed


def test_dp_epsilon_solves_the_trials_sigma_as_the_run_does(tmp_path: Path) -> None:
    solved = ["dp.clip_norm=1.0", "dp.epsilon=4.0", "weighting=uniform"]
    cfg = validate(apply_overrides({}, [*TINY, *solved, f"output_dir={tmp_path}"]))
    rows(cfg, [0, 1])
    s = spend(cfg, "failed")
    assert epsilon_spent(s.sigma, DELTA, 2, 3, 3) == pytest.approx(4.0, rel=1e-3)


def checkpoint(run: Path, last: int, uploads: str) -> None:
    values = {UPLOADS_KEY: uploads}
    torch.save({"round": last, "server": {"arrays": {}, "values": values}, "clients": {}},
               run / "checkpoint.pt")  # fmt: skip


def test_local_dp_takes_the_busiest_client_over_every_trial(tmp_path: Path) -> None:
    local = ["dp.mode=local", "participation=0.67", "rounds=3"]
    a, b = config(tmp_path / "a", *local), config(tmp_path / "b", *local)
    checkpoint(rows(a, [0, 1, 2]), 2, "0:3,1:2,2:1")
    checkpoint(rows(b, [0, 1]), 1, "0:1,1:2,2:1")  # its round 2 row came after the checkpoint
    rows(b, [0, 1, 2])
    (run_dir(b, "fedavg", 1) / "dp_ledger.json").write_text('{"repeated_exchanges": 1}')
    sa, sb = spend(a, "failed"), spend(b, "failed")  # b: 1 repeat, for every client
    assert sa.clients == {0: 3, 1: 2, 2: 1} and sb.clients == {0: 3, 1: 4, 2: 3}
    search = search_privacy(a, [sa, sb])
    assert search.local and search.sample_known is None
    assert search.epsilon == pytest.approx(local_epsilon(SIGMA, DELTA, 6))  # clients 0 and 1
    # other clients (num_clients differs): every trial's busiest client may be the same one
    c = config(tmp_path / "c", *local, "num_clients=4")
    checkpoint(rows(c, [0]), 0, "0:1,3:1")
    wide = search_privacy(a, [sa, sb, spend(c, "failed")])
    assert wide.epsilon == pytest.approx(local_epsilon(SIGMA, DELTA, 8))
    (run_dir(a, "fedavg", 1) / "checkpoint.pt").write_bytes(b"torn")  # unknown: every client
    assert spend(a, "failed").clients is None
    assert search_privacy(a, [spend(a, "failed"), sb]).epsilon == pytest.approx(
        local_epsilon(SIGMA, DELTA, 7)
    )


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_the_searchs_epsilons_with_sampling(tmp_path: Path, accountant: str) -> None:
    cfg = config(tmp_path, "participation=0.67", f"dp.accountant={accountant}")
    spends = [TrialSpend(i, SIGMA, 20, 2, n) for i, n in enumerate([2, 1, 0])]
    s = search_privacy(cfg, spends)
    assert (s.trials, s.exchanges) == (2, 3)
    assert s.epsilon == pytest.approx(epsilon_spent(SIGMA, DELTA, 3, 20, 2, accountant=accountant))
    assert s.sample_known == pytest.approx(
        epsilon_spent(SIGMA, DELTA, 3, 20, 20, accountant=accountant)
    )
    assert s.sample_known is not None and s.sample_known > s.epsilon
    full = search_privacy(cfg, [TrialSpend(0, SIGMA, 3, 3, 3)])
    assert full.sample_known is None and "dp_epsilon_of_search_sample_known" not in full.record()


# a real search --------------------------------------------------------------------------------


def test_a_search_reports_the_epsilon_of_every_trial_composed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def plan(trials: int) -> Any:
        extra = [*DP, "participation=0.67", "tune.sampler=grid", f"tune.trials={trials}"]
        raw = apply_overrides(
            {}, [*TINY, f"output_dir={tmp_path}", "tune.space={lr: 'cat:0.1,0.01,0.001'}", *extra]
        )
        return plan_search(validate(raw), raw, "tiny.yaml")

    monkeypatch.setattr(progress, "_SAID", set())
    planned = epsilon_spent(SIGMA, DELTA, 3 * 2, 3, 2)
    with pytest.warns(PrivacyWarning, match=f"spend ε = {planned:.4g} at δ = 1e-05"):
        plan(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        first = run_search(plan(1))
        assert first.privacy is not None and first.privacy.exchanges == 2
        out = run_search(plan(2))  # continued: the first trial, from before, counts too
    best = json.loads((tmp_path / "tiny/tune/best.json").read_text())
    assert (best["dp_search_trials"], best["dp_search_exchanges"]) == (2, 4)
    assert best["dp_delta"] == DELTA and best["dp_search_overcounted"] == []
    assert best["dp_epsilon_of_search"] == pytest.approx(epsilon_spent(SIGMA, DELTA, 4, 3, 2))
    assert best["dp_epsilon_of_search_sample_known"] == pytest.approx(
        epsilon_spent(SIGMA, DELTA, 4, 3, 3)
    )
    assert best["dp_epsilon_of_search"] > best["dp_epsilon_of_one_trial"] > 0
    assert out.privacy is not None and "ε of the search = " in out.privacy.line()


def test_the_command_prints_the_searchs_epsilon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import yaml

    monkeypatch.setattr(progress, "_SAID", set())
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(apply_overrides({}, [*TINY, *DP, f"output_dir={tmp_path}"])))
    args = ["tune", str(path), "--space", "lr=log:1e-3:0.3", "--trials", "1"]
    assert cli.main([*args, "tune.search_privacy_accounted=true"]) == 0
    out = capsys.readouterr()
    assert "PrivacyWarning" not in out.err and "warning: dp is on" not in out.err
    eps = epsilon_spent(SIGMA, DELTA, 2, 3, 3)
    assert f"ε of the search = {eps:.4g} at δ = 1e-05: 2 DP exchanges of 1 trial(s)" in out.out
