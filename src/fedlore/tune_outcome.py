"""What a search ended with: its trials as table rows, the best one, ``best.json`` and, under
DP, the ε of the whole search (:mod:`fedlore.tune_privacy`). Read from the study that
:mod:`fedlore.tune_study` ran.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlore.atomic import write_json
from fedlore.config import ConfigError
from fedlore.engine.rundir import run_dir
from fedlore.tune import Search, override, run_command, seeds_note, trial_config
from fedlore.tune_privacy import SearchPrivacy, search_privacy, trial_spend

BEST = "best.json"


@dataclass(frozen=True)
class TrialRow:
    """One trial of a search, for the table: its number, state (``complete``, ``pruned``,
    ``failed``, ``running``), parameters, objective value (a pruned trial's last reported
    score) and a note (the round it was pruned after, why it failed)."""

    number: int
    state: str
    params: dict[str, Any]
    value: float | None
    note: str = ""


@dataclass(frozen=True)
class Outcome:
    """A search's trials and, when one completed, the best (``best`` is its row and ``command``
    runs every seed at its parameters); under DP the ε of the whole search (``privacy``)."""

    rows: list[TrialRow]
    best: TrialRow | None = None
    command: str | None = None
    best_file: Path | None = None
    counts: dict[str, int] = field(default_factory=dict)
    privacy: SearchPrivacy | None = None


def outcome(study: Any, search: Search) -> Outcome:
    """The table's rows, the best trial and ``best.json`` (written when a trial completed) of the
    Optuna ``study`` that ran ``search``."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        state = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}.get(
            t.state.name, t.state.name.lower()
        )
        # a pruned trial's value: Optuna's, its last reported score
        rows.append(
            TrialRow(t.number, state, dict(t.params), t.value, t.user_attrs.get("note", ""))
        )
    counts = {s: sum(1 for r in rows if r.state == s) for s in ("complete", "pruned", "failed")}
    privacy = search_privacy_of(search, rows) if search.cfg.dp.enabled else None
    done = [r for r in rows if r.state == "complete"]
    if not done:
        return Outcome(rows, counts=counts, privacy=privacy)
    best = next(r for r in rows if r.number == study.best_trial.number)
    command = run_command(search, best.params)
    path = search.folder / BEST
    write_json(path, best_record(search, best, command, counts, privacy))
    return Outcome(rows, best, command, path, counts, privacy)


def search_privacy_of(search: Search, rows: Sequence[TrialRow]) -> SearchPrivacy:
    """The ε of the whole search: every trial of the study, from its run folder
    (:mod:`fedlore.tune_privacy`)."""
    spends = []
    for r in rows:
        try:
            cfg = trial_config(search, r.number, r.params)
        except ConfigError:  # refused before it ran (recorded as failed)
            cfg = None
        spends.append(trial_spend(r.number, r.state, r.note, cfg, search.method, search.run_seed))
    return search_privacy(search.cfg, spends)


def best_record(
    search: Search,
    best: TrialRow,
    command: str,
    counts: dict[str, int],
    privacy: SearchPrivacy | None = None,
) -> dict[str, Any]:
    """``best.json``: the best trial and what to run next; under DP the ε of the search."""
    record: dict[str, Any] = {
        "metric": search.metric,
        "direction": search.direction,
        "value": best.value,
        "trial": best.number,
        "trial_folder": f"trial-{best.number}",
        "params": best.params,
        "overrides": [override(k, v) for k, v in best.params.items()],
        "command": command,
        "method": search.method,
        "run_seed": search.run_seed,
        "seeds": list(search.cfg.seeds),  # what the command runs
        "run_seed_in_seeds": search.run_seed in search.cfg.seeds,
        "seeds_note": seeds_note(search),
        "search_seed": search.cfg.tune.seed,
        "sampler": search.cfg.tune.sampler,
        "trials": counts,
    }
    if search.cfg.dp.enabled:
        summary = run_dir(trial_config(search, best.number, best.params), search.method,
                          search.run_seed) / "summary.json"  # fmt: skip
        eps = json.loads(summary.read_text()).get("dp_epsilon") if summary.is_file() else None
        record["dp_epsilon_of_one_trial"] = eps
        record["search_privacy_accounted"] = search.cfg.tune.search_privacy_accounted
        if privacy is not None:
            record.update(privacy.record())
    return record
