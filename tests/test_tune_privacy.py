"""The ε of a whole ``fedlore tune`` search under DP (:mod:`fedlore.tune_privacy`,
:mod:`fedlore.privacy.composition`): trials that share (σ, N, m) compose to one run of their
total exchanges (checked against :func:`~fedlore.privacy.dp.epsilon_spent`), the search spends
more than its largest trial, a pruned trial counts the rounds it ran, a resumed trial its
repeated releases, local DP its busiest client over every trial, a damaged folder is
over-counted and named, and both ε's (sample hidden, sample known) and both accountants."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore import cli, progress
from fedlore.config import Config, apply_overrides, validate
from fedlore.engine.rundir import run_dir
from fedlore.experiment_privacy import NO_PRIVACY, PrivacyWarning, dp_noise_multiplier
from fedlore.privacy.composition import Exchanges, composed_epsilon
from fedlore.privacy.dp import epsilon_spent, update_noise_multiplier
from fedlore.privacy.local_dp import UPLOADS_KEY, local_epsilon
from fedlore.tune import plan_search, trial_config
from fedlore.tune_outcome import TrialRow
from fedlore.tune_outcome import search_privacy_of as study_privacy
from fedlore.tune_privacy import (
    RTOL,
    SearchPrivacy,
    TrialSpend,
    planned,
    search_privacy,
    trial_spend,
)
from fedlore.tune_study import run_search

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


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize(
    ("sigma", "per_round", "count"),
    [(0.8, 3, 4), (1.0, 10, 2), (50.0, 10, 3), (50.0, 4, 12)],  # σ <= 1; ε below 0.1 and 1
)
def test_one_part_is_the_epsilon_of_one_run(
    accountant: str, sigma: float, per_round: int, count: int
) -> None:
    one = epsilon_spent(sigma, DELTA, count, 10, per_round, accountant=accountant)
    parts = [Exchanges(sigma, 10, per_round, count)]
    assert composed_epsilon(parts, DELTA, accountant=accountant) == pytest.approx(one, rel=1e-12)
    assert math.isfinite(one) and (one < 1) == (sigma == 50.0)


def test_a_count_of_exchanges_is_not_negative() -> None:
    with pytest.raises(ValueError, match=r"^a count of exchanges is >= 0, got -1$"):
        Exchanges(SIGMA, 10, 3, -1)


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


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_a_lost_local_ledger_is_counted_at_the_busiest_clients_recorded_epsilon(
    tmp_path: Path, accountant: str
) -> None:
    local = ["dp.mode=local", "participation=0.34", f"dp.accountant={accountant}"]  # 1 of 3
    cfg = config(tmp_path, "rounds=3", *local)
    sigma = spend(cfg).sigma  # sampling does not amplify local DP: ε of 12 uploads, not rounds
    rows(cfg, [0, 1, 2], eps=local_epsilon(sigma, DELTA, 12, accountant=accountant))
    s = spend(cfg)
    assert s.exchanges == 12 and s.overcounted  # (under pld: the RDP ε of 11 reaches it)


@pytest.mark.parametrize(("sigma", "accountant"), [(1.5, "pld"), (50.0, "rdp")])
def test_the_count_a_recorded_epsilon_proves(tmp_path: Path, sigma: float, accountant: str) -> None:
    """The fewest exchanges whose ε (the trial's own accountant) reaches the ε it recorded,
    an ε below 1 too (12 exchanges: under pld, the RDP ε of 11 already reaches it); at the
    tolerance's edge, the count it reaches."""
    cfg = config(
        tmp_path, "rounds=7", f"dp.noise_multiplier={sigma}", f"dp.accountant={accountant}"
    )

    def eps(n: int) -> float:
        return epsilon_spent(sigma, DELTA, n, 3, 3, accountant=accountant)

    assert (eps(12) < 1) == (sigma == 50.0)
    rows(cfg, list(range(7)), eps=eps(12))  # no summary: a complete trial's folder is damaged
    s = spend(cfg)
    assert s.exchanges == 12 and type(s.exchanges) is int and s.overcounted
    edge = eps(12) / (1 - RTOL)  # the largest ε that 12 exchanges reach within RTOL
    while edge * (1 - RTOL) > eps(12):
        edge = math.nextafter(edge, 0.0)
    while edge * (1 - RTOL) < eps(12):
        edge = math.nextafter(edge, math.inf)
    assert edge * (1 - RTOL) == eps(12)
    rows(cfg, list(range(7)), eps=edge)
    assert spend(cfg).exchanges == 12


def test_what_no_recorded_epsilon_proves(tmp_path: Path) -> None:
    """A damaged folder is counted at its configured exchanges when its records prove no more:
    no ε recorded (not even below 1), an infinite one (σ > 0 never spends it); a single
    exchange proven; a finite ε no count reaches, at the most searched (2**20)."""
    quiet = config(tmp_path / "quiet", "rounds=4", "dp.noise_multiplier=20.0")
    assert epsilon_spent(20.0, DELTA, 4, 3, 3) < 1
    assert spend(quiet, "failed").exchanges == 4  # no run folder: nothing recorded
    cfg = config(tmp_path, "rounds=4")
    rows(cfg, [0, 1], eps=math.inf)
    s = spend(cfg, "failed")
    assert s.exchanges == 4 and "it recorded ε = inf" in s.overcounted
    one = config(tmp_path / "one", "rounds=1")
    rows(one, [0], eps=epsilon_spent(SIGMA, DELTA, 1, 3, 3))
    single = spend(one)
    assert (single.exchanges, single.overcounted) == (1, "a complete trial without summary.json")
    rows(cfg, [0, 1], eps=1e9)
    assert spend(cfg, "failed").exchanges == 2**20


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


def checkpoint(run: Path, last: int, uploads: str | None) -> None:
    """A checkpoint after round ``last`` with local DP's counts ``uploads`` (None: without
    them) and a tensor (the file is read onto the CPU)."""
    values = {} if uploads is None else {UPLOADS_KEY: uploads}
    server = {"arrays": {"w": torch.zeros(2)}, "values": values}
    torch.save({"round": last, "server": server, "clients": {}}, run / "checkpoint.pt")


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


def test_a_client_missing_from_a_checkpoint_counts_the_rounds_after_it(tmp_path: Path) -> None:
    """Local DP's counts name only the clients that took part before the checkpoint: one that
    did not may have taken part in every round released after it (and in every repeat)."""
    local = ["dp.mode=local", "participation=0.34", "rounds=3"]  # 1 client of 3 a round
    a, b = config(tmp_path / "a", *local), config(tmp_path / "b", *local)
    checkpoint(rows(a, [0, 1, 2]), 0, "0:1")  # rounds 1 and 2 came after: any client's
    checkpoint(rows(b, [0, 1, 2]), 2, "1:3")
    sa, sb = spend(a, "failed"), spend(b, "failed")
    assert sa.clients == {0: 3, 1: 2, 2: 2} and sb.clients == {0: 0, 1: 3, 2: 0}
    # client 1: 2 exchanges of a (rounds 1, 2) and 3 of b
    assert search_privacy(a, [sa, sb]).epsilon == pytest.approx(local_epsilon(SIGMA, DELTA, 5))


def test_a_local_checkpoint_without_counts_is_read_as_none(tmp_path: Path) -> None:
    """Every local DP checkpoint holds the counts: one without them is not read as "no client
    took part" (every client is counted in every exchange, as without a checkpoint)."""
    cfg = config(tmp_path, "dp.mode=local", "participation=0.34", "rounds=3")
    checkpoint(rows(cfg, [0, 1, 2], eps=local_epsilon(SIGMA, DELTA, 3)), 2, None)
    s = spend(cfg, "failed")
    assert (s.exchanges, s.clients, s.overcounted) == (3, None, "")


def test_local_dp_trials_of_other_clients_count_each_trials_busiest_client(
    tmp_path: Path,
) -> None:
    """Trials that share their clients compose client by client (a trial without exchanges
    takes no part, whatever its clients); trials of other clients count each trial's busiest
    one: its largest count, every exchange when the counts are unknown, none when no client
    took part. Under either accountant."""
    for accountant in ("rdp", "pld"):
        cfg = config(tmp_path, "dp.mode=local", f"dp.accountant={accountant}")

        def local(n: int, acc: str = accountant) -> float:
            return local_epsilon(SIGMA, DELTA, n, accountant=acc)

        def trial(exchanges: int, clients: dict[int, int] | None, identity: str) -> TrialSpend:
            return TrialSpend(0, SIGMA, 3, 1, exchanges, clients, identity)

        # a client a trial's counts leave out took no part in it
        shared = [trial(2, {0: 2}, "x"), trial(2, {1: 2}, "x"), trial(0, None, "y")]
        assert search_privacy(cfg, shared).epsilon == pytest.approx(local(2))
        other = [trial(5, {0: 2}, "x"), trial(3, None, "y"), trial(4, {}, "z")]
        assert search_privacy(cfg, other).epsilon == pytest.approx(local(5))
    assert local(5, "pld") < local(5, "rdp")


def test_the_planned_epsilon_is_every_trial_at_its_configured_exchanges(tmp_path: Path) -> None:
    """``dp.epsilon`` solved for a run of the method's setup and rounds: one planned trial
    spends it, three spend their composition."""
    solved = ["dp.clip_norm=1.0", "dp.epsilon=4.0", "weighting=uniform"]
    cfg = validate(apply_overrides({}, [*TINY, *solved, f"output_dir={tmp_path}"]))
    one = planned(cfg, "fedlore_sketch", 1)
    assert (one.exchanges, one.trials) == (3, 1)  # its setup exchange and 2 rounds
    assert one.epsilon == pytest.approx(4.0, rel=1e-3)
    three = planned(cfg, "fedlore_sketch", 3)
    sigma = three.spends[0].sigma
    assert three.epsilon == pytest.approx(epsilon_spent(sigma, DELTA, 9, 3, 3))


def test_the_searchs_line_and_record_say_everything() -> None:
    lost, torn = "no run folder trial-2/ for a failed trial", "summary.json cannot be read"
    spends = (
        TrialSpend(0, SIGMA, 20, 2, 3),
        TrialSpend(1, SIGMA, 20, 2, 0),  # made no exchange: not a trial of the count
        TrialSpend(2, SIGMA, 20, 2, 4, overcounted=lost),
        TrialSpend(3, SIGMA, 20, 2, 1, overcounted=torn),
    )
    s = SearchPrivacy(1.23456, 2.5, 1e-5, False, spends)
    assert s.line() == (
        "ε of the search = 1.235 at δ = 1e-05 (against a party that knows each round's sample:"
        " 2.5): 8 DP exchanges of 3 trial(s) composed; 2 damaged trial folder(s) counted at"
        f" their configured exchanges: trial-2: {lost}; trial-3: {torn}"
    )
    record = s.record()
    assert list(record) == [
        "dp_epsilon_of_search",
        "dp_epsilon_of_search_sample_known",
        "dp_delta",
        "dp_search_trials",
        "dp_search_exchanges",
        "dp_search_overcounted",
    ]
    assert record == {
        "dp_epsilon_of_search": 1.23456,
        "dp_epsilon_of_search_sample_known": 2.5,
        "dp_delta": 1e-5,
        "dp_search_trials": 3,
        "dp_search_exchanges": 8,
        "dp_search_overcounted": [f"trial-2: {lost}", f"trial-3: {torn}"],
    }
    local = SearchPrivacy(math.inf, None, 1e-6, True, spends[:2])
    assert local.line() == (
        "ε of the search = inf for the busiest client (local DP) at δ = 1e-06:"
        " 3 DP exchanges of 1 trial(s) composed"
    )
    assert local.record() == {
        "dp_epsilon_of_search": "inf",
        "dp_delta": 1e-6,
        "dp_search_trials": 1,
        "dp_search_exchanges": 3,
        "dp_search_overcounted": [],
    }
    unbounded = SearchPrivacy(0.5, math.inf, 1e-5, False, spends[:1]).record()
    assert unbounded["dp_epsilon_of_search_sample_known"] == "inf"


def test_every_note_on_a_damaged_folder_is_whole(tmp_path: Path) -> None:
    cfg = config(tmp_path, "rounds=4")
    run = run_dir(cfg, "fedavg", 1)

    def notes(state: str = "failed", note: str = "", c: Config = cfg) -> str:
        return trial_spend(0, state, note, c, "fedavg", 1).overcounted

    assert notes() == f"no run folder {run.name}/ for a failed trial"
    assert notes("pruned") == f"no run folder {run.name}/ for a pruned trial"
    rows(cfg, [0, 1], tail="garbage\n" + json.dumps({"round": 2, "dp_epsilon": 0.1}) + "\n")
    (run / "dp_ledger.json").write_text("{")
    (run / "summary.json").write_text("[]")  # JSON, but no summary
    assert notes("complete") == (
        "dp_ledger.json cannot be read (its repeated releases are not counted); "
        "metrics.jsonl has unreadable lines before its last; summary.json cannot be read"
    )
    assert spend(cfg).exchanges == 4  # its configured rounds: no repeat is known
    (run / "dp_ledger.json").unlink()
    rows(cfg, [0, 1])
    (run / "summary.json").write_bytes(b"\xff{}")  # not UTF-8
    assert notes() == "summary.json cannot be read"
    (run / "summary.json").unlink()
    assert notes("complete") == "a complete trial without summary.json"
    assert notes("pruned", "after round 3") == "pruned after round 3, but its rows end before"
    assert notes("pruned", "after round x") == notes("pruned", "stopped") == ""
    assert notes("failed", "after round 3") == ""  # only a pruned trial's note says a round
    rows(cfg, [0, 1], eps=123.4567)
    assert notes() == "it recorded ε = 123.457, more than its rows account for"
    (run / "metrics.jsonl").write_text(json.dumps({"round": 0, "accuracy": 0.5}) + "\n")  # no DP
    assert notes() == ""  # failed before its first DP row
    assert notes("complete") == "a complete trial without summary.json; no DP rows in metrics.jsonl"
    assert notes("pruned", "after round 0") == (
        "no DP rows in metrics.jsonl; pruned after round 0, but its rows end before"
    )
    (run / "summary.json").write_text("{}")
    assert notes() == "no DP rows in metrics.jsonl"
    local = config(tmp_path / "local", "rounds=4", "dp.mode=local")
    checkpoint(rows(local, [0]), 2, "0:3,1:3,2:3")
    assert notes(c=local) == "its checkpoint is ahead of its rows"


def test_a_damaged_folder_counts_its_setup_and_repeats_beside_its_configured_rounds(
    tmp_path: Path,
) -> None:
    sketch = config(tmp_path / "sketch", "algorithms=[fedlore_sketch]", "rounds=2")
    run = run_dir(sketch, "fedlore_sketch", 1)
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"round": 0, "dp_epsilon": 0.1}) + "\n")
    s = trial_spend(0, "complete", "", sketch, "fedlore_sketch", 1)  # no summary
    assert (s.exchanges, s.overcounted) == (3, "a complete trial without summary.json")
    cfg = config(tmp_path, "rounds=4")
    run = rows(cfg, [0, 1])
    (run / "dp_ledger.json").write_text('{"repeated_exchanges": 2}')
    assert spend(cfg).exchanges == 6  # its configured 4 rounds and the 2 repeats
    local = config(tmp_path / "local", "rounds=4", "dp.mode=local")
    checkpoint(rows(local, [0, 1]), 1, "0:2,1:2,2:2")
    assert spend(local).clients is None  # damaged: every client in every exchange


def test_an_epsilon_above_the_rows_count_within_the_tolerance_is_no_damage(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "rounds=4")
    mine = epsilon_spent(SIGMA, DELTA, 2, 3, 3)
    rows(cfg, [0, 1], eps=mine * (1 + RTOL))
    assert spend(cfg, "failed").overcounted == ""
    rows(cfg, [0, 1], eps=math.nextafter(mine * (1 + RTOL), math.inf))
    assert spend(cfg, "failed").exchanges == 4


def test_rows_count_at_least_as_many_exchanges_as_there_are_rows(tmp_path: Path) -> None:
    cfg = config(tmp_path, "rounds=4")
    rows(cfg, [-3, -2, -1])  # rounds no run writes: each row is still a release
    assert spend(cfg, "failed").exchanges == 3


def test_what_a_row_holds_besides_its_round(tmp_path: Path) -> None:
    """Every DP row is a release whatever its ε holds (a number or not); a row without
    ``dp_epsilon`` is no DP row; a line that is not UTF-8 is an unreadable line, and the rows
    after it still count, their ε too."""
    cfg = config(tmp_path, "rounds=4")
    run = rows(cfg, [])
    lines = [
        {"round": 0, "dp_epsilon": None},
        {"round": 1, "dp_epsilon": "0.5"},
        {"round": 2, "dp_epsilon": True},
        {"round": 3, "selection_accuracy": 0.5},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = spend(cfg, "failed")
    assert (s.exchanges, s.overcounted) == (3, "")
    (run / "summary.json").write_text(json.dumps({"dp_epsilon": True}))
    assert (spend(cfg).exchanges, spend(cfg).overcounted) == (3, "")  # True is no ε
    (run / "summary.json").unlink()
    six = epsilon_spent(SIGMA, DELTA, 6, 3, 3)
    after = json.dumps({"round": 1, "dp_epsilon": six}).encode()
    first = json.dumps({"round": 0, "dp_epsilon": 0.1}).encode()
    (run / "metrics.jsonl").write_bytes(first + b"\n\xff\xfe\n" + after + b"\n")
    torn = spend(cfg, "failed")
    assert (torn.exchanges, torn.overcounted) == (
        6,
        f"metrics.jsonl has unreadable lines before its last; it recorded ε = {six:.6g}, "
        "more than its rows account for",
    )


def test_a_trial_that_never_ran_spent_nothing(tmp_path: Path) -> None:
    assert trial_spend(7, "failed", "", None, "fedavg", 1) == TrialSpend(7, 0.0, 1, 1, 0)
    unreachable = config(tmp_path, "dp.noise_multiplier=null", "dp.epsilon=1e-9")
    with pytest.raises(ValueError):  # no σ reaches it: the run refuses it too
        dp_noise_multiplier(unreachable, 0)
    assert trial_spend(5, "failed", "", unreachable, "fedavg", 1) == TrialSpend(5, 0.0, 1, 1, 0)
    cfg = config(tmp_path, "rounds=4")
    rows(cfg, [0, 1])
    assert trial_spend(9, "failed", "", cfg, "fedavg", 1).number == 9


@pytest.mark.parametrize("mode", ["central", "local"])
def test_the_rows_epsilon_is_checked_with_the_trials_accountant(tmp_path: Path, mode: str) -> None:
    """A pld trial whose rows record the RDP ε of their count recorded more than its rows
    account for (its own accountant's ε is smaller)."""
    cfg = config(tmp_path, "rounds=4", "dp.accountant=pld", f"dp.mode={mode}")
    rdp = epsilon_spent(SIGMA, DELTA, 2, 3, 3)
    rows(cfg, [0, 1], eps=epsilon_spent(SIGMA, DELTA, 2, 3, 3, accountant="pld"))
    assert spend(cfg, "failed").overcounted == ""
    rows(cfg, [0, 1], eps=rdp)
    assert "more than its rows account for" in spend(cfg, "failed").overcounted


def test_a_sampled_trials_rows_are_checked_with_its_sampling(tmp_path: Path) -> None:
    cfg = config(tmp_path, "rounds=4", "participation=0.67")  # 2 of 3
    sampled = epsilon_spent(SIGMA, DELTA, 2, 3, 2)
    rows(cfg, [0, 1], eps=sampled)
    assert spend(cfg, "failed").overcounted == ""
    unsampled = epsilon_spent(SIGMA, DELTA, 2, 3, 3)
    assert unsampled > sampled * 1.01
    rows(cfg, [0, 1], eps=unsampled)  # the ε of 2 rounds of every client: not this trial's
    assert "more than its rows account for" in spend(cfg, "failed").overcounted


def test_the_search_takes_the_accountant_it_is_given(tmp_path: Path) -> None:
    cfg = config(tmp_path, "participation=0.67")
    spends = [TrialSpend(0, SIGMA, 3, 3, 4)]
    s = search_privacy(cfg, spends, accountant="pld")
    assert s.epsilon == pytest.approx(epsilon_spent(SIGMA, DELTA, 4, 3, 3, accountant="pld"))
    assert s.epsilon < search_privacy(cfg, spends).epsilon
    assert (s.local, s.delta, s.spends) == (False, DELTA, tuple(spends))
    local = search_privacy(config(tmp_path, "dp.mode=local"), spends)
    assert (local.local, local.delta, local.spends, local.sample_known) == (
        True,
        DELTA,
        tuple(spends),
        None,
    )


def test_rows_recording_more_than_the_busiest_clients_count_are_damage(tmp_path: Path) -> None:
    """Under local DP the rows' ε is checked against the busiest client's count (one upload
    each here), not the trial's exchanges."""
    cfg = config(tmp_path, "dp.mode=local", "participation=0.34", "rounds=3")
    run = rows(cfg, [0, 1, 2], eps=local_epsilon(SIGMA, DELTA, 1))
    checkpoint(run, 2, "0:1,1:1,2:1")
    assert spend(cfg, "failed").clients == {0: 1, 1: 1, 2: 1}
    rows(cfg, [0, 1, 2], eps=local_epsilon(SIGMA, DELTA, 2))
    s = spend(cfg, "failed")
    assert "more than its rows account for" in s.overcounted and s.clients is None


def test_a_damaged_folder_is_never_counted_at_fewer_exchanges_than_its_rows(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "rounds=2")
    rows(cfg, [0, 1, 2, 3, 4])  # more rows than its configured rounds; no summary
    assert spend(cfg).exchanges == 5


def test_a_search_whose_trials_drew_seeded_noise_says_it_has_no_privacy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dp.reproducible_noise`` trials draw noise anyone with the seed removes: best.json and
    the search's line say "no privacy" beside the ε the accountant gives the exchanges, as a
    run's summary does; a search of secret noise says nothing of the kind."""
    seeded = config(tmp_path, "dp.reproducible_noise=true")
    rows(seeded, [0, 1])
    assert spend(seeded).reproducible and not spend(config(tmp_path)).reproducible
    honest = search_privacy(config(tmp_path), [spend(config(tmp_path))])
    assert "privacy" not in honest.record() and NO_PRIVACY not in honest.line()
    mixed = search_privacy(config(tmp_path), [spend(config(tmp_path)), spend(seeded)])
    assert mixed.record()["privacy"] == NO_PRIVACY and NO_PRIVACY in mixed.line()

    def plan() -> Any:
        space = "tune.space={lr: 'cat:0.1,0.01'}"
        extra = [*DP, "dp.reproducible_noise=true", "tune.trials=1", "name=seeded", space]
        raw = apply_overrides({}, [*TINY, f"output_dir={tmp_path}", *extra])
        return plan_search(validate(raw), raw, "tiny.yaml")

    monkeypatch.setattr(progress, "_SAID", set())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        out = run_search(plan())
    best = json.loads((tmp_path / "seeded/tune/best.json").read_text())
    assert best["privacy"] == NO_PRIVACY and best["dp_epsilon_of_search"] > 0
    assert out.privacy is not None and out.privacy.line().endswith(NO_PRIVACY)
