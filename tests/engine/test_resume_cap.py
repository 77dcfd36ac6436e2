"""A DP-FedBuff run resumed with another ``dp.max_contributions`` or ``rounds``
(:mod:`fedlore.engine.resume_changes`): a run its cap starved is finished by a raised cap or
fewer rounds, the change is recorded (what, from which round), ε is over the whole run's
counts; a cap below a client's steps so far, fewer rounds than taken, a change while σ is
solved from ``dp.epsilon``, and a change of any other run, are refused."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from fedlore.config import Config, ConfigError, load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.privacy.buffer_dp import contribution_epsilon

# the exact fill of tests/engine/test_cap_schedule.py that starves at round 5 (cap 3, 6 rounds)
SMALL = ["num_clients=6", "local_steps=3", "batch_size=16", "progress=false", "lr=0.05",
         "model.kwargs={hidden: [16]}", "algorithms=[fedavg]", "weighting=uniform",
         "asynchronous.buffer=3", "asynchronous.concurrency=4", "clients.speed=lognormal",
         "dp.clip_norm=0.5", "dp.noise_multiplier=1.0", "eval.every=100", "rounds=6"]  # fmt: skip
SEED = 42


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(None, [*SMALL, f"output_dir={out}", *extra])


def _run(cfg: Config, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # δ against 1/N on 6 clients
        return run_one(cfg, "fedavg", SEED, **kw)


def _rows(cfg: Config) -> list[dict[str, Any]]:
    path = run_dir(cfg, "fedavg", SEED) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _record(cfg: Config) -> dict[str, Any]:
    return dict(json.loads((run_dir(cfg, "fedavg", SEED) / "config.json").read_text()))


def _counts(rows: list[dict[str, Any]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in rows:
        for c in r["accepted_clients"]:
            out[c] = out.get(c, 0) + 1
    return out


def _starved(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    """The run as a cap starves it (as before the replay refused it, or after an upload the
    replay could not foresee): 5 rows, the checkpoint at round 4."""
    cfg = _cfg(tmp, "dp.max_contributions=3")
    with monkeypatch.context() as m:
        m.setattr("fedlore.engine.cap_schedule.check_cap", lambda *a: None)
        with pytest.raises(ValueError, match=r"round 5 .* finish it with --resume and a raised"):
            _run(cfg)
    assert len(_rows(cfg)) == 5
    return cfg


def test_a_starved_run_resumed_with_a_raised_cap_finishes_with_epsilon_over_all_its_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cut = _starved(tmp_path, monkeypatch)
    before = _rows(cut)
    with pytest.raises(ValueError, match="starves at round 5"):  # the same cap: still starves
        _run(cut, resume=True)
    raised = _cfg(tmp_path, "dp.max_contributions=4")
    summary = _run(raised, resume=True)
    assert summary is not None and summary["dp_max_contributions"] == 4
    rows = _rows(raised)
    assert rows[:5] == before and len(rows) == 6
    counts = _counts(rows)
    assert max(counts.values()) == 4  # a client past the old cap
    assert summary["dp_epsilon"] == pytest.approx(contribution_epsilon(1.0, 1e-5, 4))
    assert rows[-1]["dp_epsilon"] == summary["dp_epsilon"]
    _, state, _ = Checkpointer.load(run_dir(raised, "fedavg", SEED) / "checkpoint.pt")
    kept = dict(pair.split(":") for pair in str(state.values["privacy.contributions"]).split(","))
    assert {int(c): int(n) for c, n in kept.items()} == counts
    record = _record(raised)
    assert record["resume_changes"] == [{"round": 5, "dp.max_contributions": [3, 4]}]
    assert record["dp"]["max_contributions"] == 4
    assert _run(raised, resume=True) == summary  # finished: reported, its record read
    assert _run(raised) == summary


def test_fewer_rounds_finish_a_starved_run_and_the_changes_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cut = _starved(tmp_path, monkeypatch)
    fewer = _cfg(tmp_path, "dp.max_contributions=3", "rounds=5")
    summary = _run(fewer, resume=True)
    assert summary is not None and len(_rows(fewer)) == 5
    assert _record(fewer)["resume_changes"] == [{"round": 5, "rounds": [6, 5]}]
    assert summary["dp_epsilon"] == pytest.approx(
        contribution_epsilon(1.0, 1e-5, max(_counts(_rows(cut)).values()))
    )


def test_an_earlier_change_stays_recorded_through_a_later_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed run resumed with a raised cap, killed again and resumed unchanged: the record
    keeps the first change."""
    cfg = _cfg(tmp_path, "dp.max_contributions=4")
    assert _run(cfg, stop_after=1) is None
    wider = _cfg(tmp_path, "dp.max_contributions=5")
    assert _run(wider, resume=True, stop_after=3) is None
    assert _run(wider, resume=True) is not None
    assert _record(wider)["resume_changes"] == [{"round": 2, "dp.max_contributions": [4, 5]}]


def test_fewer_rounds_than_taken_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _starved(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="rounds=4: this run has taken 5 steps already"):
        _run(_cfg(tmp_path, "dp.max_contributions=3", "rounds=4"), resume=True)
    assert len(_rows(_cfg(tmp_path))) == 5  # nothing trained


def test_a_cap_below_a_clients_steps_so_far_is_refused(tmp_path: Path) -> None:
    """An uncapped run killed after 5 steps, in which a client was in 4 or 5 of them, resumed
    with a cap of 3 (the fewest places 6 rounds need): refused, naming the client."""
    free = _cfg(tmp_path)
    assert _run(free, stop_after=4) is None
    most = max(_counts(_rows(free)).values())
    assert most > 3
    why = rf"dp.max_contributions=3: client\(s\) \[\d.*\] have been in {most} steps of this run"
    with pytest.raises(ValueError, match=why + " already, more than the cap"):
        _run(_cfg(tmp_path, "dp.max_contributions=3"), resume=True)
    assert len(_rows(free)) == 5  # nothing trained


def test_other_rounds_under_a_cosine_schedule_are_refused(tmp_path: Path) -> None:
    cosine = ["optim.schedule=cosine", "dp.max_contributions=4"]
    assert _run(_cfg(tmp_path, *cosine), stop_after=1) is None
    with pytest.raises(ConfigError, match=r"learning-rate schedule \(cosine\)"):
        _run(_cfg(tmp_path, *cosine, "rounds=7"), resume=True)


def test_a_change_while_sigma_is_solved_from_epsilon_is_refused(tmp_path: Path) -> None:
    start = ["dp.noise_multiplier=null", "dp.epsilon=20"]
    assert _run(_cfg(tmp_path, *start, "dp.max_contributions=4"), stop_after=1) is None
    with pytest.raises(ConfigError, match=r"σ was solved from dp.epsilon .* would change"):
        _run(_cfg(tmp_path, *start, "dp.max_contributions=5"), resume=True)


@pytest.mark.parametrize(
    "extra",
    [["dp.clip_norm=null", "dp.noise_multiplier=null", "dp.max_contributions=null"],
     ["lr=0.1"]],  # another setting of a DP-FedBuff run
)  # fmt: skip
def test_other_changes_stay_refused(tmp_path: Path, extra: list[str]) -> None:
    assert _run(_cfg(tmp_path, "dp.max_contributions=4", *extra), stop_after=1) is None
    changed = _cfg(tmp_path, "dp.max_contributions=4", *extra, "rounds=7")  # FedBuff, no DP
    if "lr=0.1" in extra:
        changed = _cfg(tmp_path, "dp.max_contributions=5", "lr=0.2")
    with pytest.raises(ConfigError, match="was started with a different config"):
        _run(changed, resume=True)


def test_a_resume_from_the_first_round_records_the_change_from_round_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As Flower's simulation resumes (its clients' states are gone: from round 0 again, the
    DP ledger counting the rows released before): the raised cap applies from round 0, and ε
    counts the 5 repeated steps for every client."""
    _starved(tmp_path, monkeypatch)
    raised = _cfg(tmp_path, "dp.max_contributions=4")
    summary = _run(raised, resume=True, from_start=True)
    assert summary is not None and summary["dp_repeated_exchanges"] == 5
    assert _record(raised)["resume_changes"] == [{"round": 0, "dp.max_contributions": [3, 4]}]
    most = max(_counts(_rows(raised)).values())
    assert summary["dp_epsilon"] == pytest.approx(contribution_epsilon(1.0, 1e-5, most + 5))
