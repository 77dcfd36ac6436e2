"""A finished run none of whose rounds aggregated an update says so in one line
(:func:`fedlore.experiment_loop.warn_no_update`): its scores alone would not tell that its
model is the initial one (newbie10: a round deadline no client meets ran to the end silently).
So does one with clients that were asked in several rounds and never accepted
(:func:`fedlore.experiment_loop.warn_never_accepted`: newbie14, a site-local deployment's site
whose class folders differ from the server's was rejected every round without a word)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from fedlore.config import load_config
from fedlore.experiment import run_one
from fedlore.experiment_loop import (
    NeverAcceptedWarning,
    NoUpdateWarning,
    warn_never_accepted,
    warn_no_update,
)

COMMON = ["num_clients=3", "rounds=2", "local_steps=2", "progress=false", "algorithms=[fedavg]"]
COMMON += ["model.kwargs={hidden: [8]}", "partition.min_size=10", "clients.speed=lognormal"]


def _said(tmp_path: Path, *extra: str, kind: type[Warning] = NoUpdateWarning) -> list[str]:
    cfg = load_config(None, [*COMMON, f"output_dir={tmp_path}", *extra])
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        run_one(cfg, "fedavg", 1)
    return [str(w.message) for w in got if w.category is kind]


def test_a_run_whose_every_reply_was_lost_says_its_model_is_the_initial_one(
    tmp_path: Path,
) -> None:
    said = _said(tmp_path / "lost", "clients.round_deadline_s=0.000001")
    assert len(said) == 1
    assert said[0].startswith(
        "fedavg seed 1: no round of 2 aggregated a client update: every reply was lost or "
        "rejected (the first: 0: ClientDropped: straggler: "
    )
    assert said[0].endswith("> clients.round_deadline_s 1e-06); the model is the initial one")
    assert _said(tmp_path / "fine") == []
    never = _said(
        tmp_path / "lost2", "clients.round_deadline_s=0.000001", kind=NeverAcceptedWarning
    )
    assert never == []  # every client: the warning above says it all


def test_a_client_rejected_in_every_round_it_was_asked_is_named(tmp_path: Path) -> None:
    """An attacker whose scaled upload the norm screen rejects in each of 3 rounds: its data
    never reached the model, which the run's scores do not say."""
    attack = ["attack.kind=scale", "attack.scale=1e6", "attack.fraction=0.34", "rounds=3"]
    said = _said(tmp_path / "attacked", *attack, kind=NeverAcceptedWarning)
    assert len(said) == 1, said
    assert said[0].startswith(
        "fedavg seed 1: 1 client(s) asked in several rounds were never accepted, so none of "
        "their data reached the model: client "
    )
    assert ", rejected in 3 rounds (the first: upload norm " in said[0]
    assert _said(tmp_path / "fine", kind=NeverAcceptedWarning) == []


def test_a_client_accepted_once_asked_once_or_not_named_is_not_warned_about() -> None:
    run: Any = _Named()
    no = {"round": 0, "accepted_clients": [0], "rejected_reasons": ["1: NaN", "2: NaN"]}
    yes = {"round": 1, "accepted_clients": [0, 1, 2]}
    hidden = {"round": 2, "rejected_reasons": ["NaN", "NaN"]}  # DP that hides the sample
    setup = {"round": -1, "accepted_clients": [], "rejected_reasons": ["1: NaN", "3: NaN"]}
    later = {"round": 3, "accepted_clients": [0], "rejected_reasons": ["3: NaN"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_never_accepted(run, [no, yes, hidden, setup, later])  # 1, 2 accepted; 3 asked once
    again = {"round": 1, "accepted_clients": [0, 1], "rejected_reasons": ["2: y"]}
    with pytest.warns(NeverAcceptedWarning) as got:
        warn_never_accepted(run, [no, again, {**later, "rejected_reasons": ["3: x", "2: z"]}])
    (message,) = [str(w.message) for w in got]
    assert "m seed 0: 1 client(s)" in message
    assert "client 2, rejected in 3 rounds (the first: NaN)" in message
    many = [
        {"round": r, "accepted_clients": [0], "rejected_reasons": [f"{c}: z" for c in range(1, 8)]}
        for r in range(2)
    ]
    with pytest.warns(NeverAcceptedWarning, match=r"7 client\(s\).*client 5, .*; and 2 more$"):
        warn_never_accepted(run, many)


class _Named:
    """What the warning reads of a run: its method and seed."""

    method, seed = "m", 0


def test_one_round_with_an_update_is_enough_to_say_nothing() -> None:
    run: Any = _Named()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails
        warn_no_update(run, [{"round": 0, "accepted": 0}, {"round": 1, "accepted": 1}])
        warn_no_update(run, [])
        warn_no_update(run, [{"round": 0}])  # a row without ``accepted``: not judged
        warn_no_update(run, [{"round": -1, "accepted": 0}])  # a setup row is not a round
    with pytest.warns(NoUpdateWarning, match="m seed 0: no round of 2 aggregated"):
        warn_no_update(run, [{"round": 0, "accepted": 0}, {"round": 1, "accepted": 0}])


def test_a_finished_run_reads_its_metrics_once_for_the_summary_the_warning_and_the_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary, this warning and the early-stopping rule's outcome each read the whole
    ``metrics.jsonl`` again at the end of a run (three reads of a file that grows with the
    rounds); they now share one read."""
    from fedlore import experiment_loop
    from fedlore.engine import early_stopping
    from fedlore.results import summary

    reads: list[Path] = []
    real = summary.read_metrics

    def counted(path: Path) -> list[dict[str, Any]]:
        reads.append(path)
        return real(path)

    for module in (summary, experiment_loop, early_stopping):
        monkeypatch.setattr(module, "read_metrics", counted)
    extra = ["early_stopping.metric=selection_accuracy", "data.selection_fraction=0.2"]
    cfg = load_config(None, [*COMMON, f"output_dir={tmp_path}", *extra])
    done = run_one(cfg, "fedavg", 1)
    assert done is not None and done["best_round"] is not None
    assert [p.name for p in reads].count("metrics.jsonl") == 1, reads
