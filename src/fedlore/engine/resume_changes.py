"""The settings a ``--resume`` of a DP-FedBuff run may change: ``dp.max_contributions`` and
``rounds`` (:data:`RESUMABLE`).

Neither changes a step already taken: the schedule so far did not depend on how many steps
would follow, and the cap only decides which clients may start from now on. What they change
of the privacy is counted, not assumed: ε is each client's over the steps it was in
(:class:`~fedlore.privacy.buffer_dp.BufferDP`, whose counts come back from the checkpoint),
so a raised cap gives ε over the whole run's counts. A run whose cap starved it
(:func:`~fedlore.engine.async_clients.starved`) is finished by resuming it with a raised cap
or fewer rounds. The run's ``config.json`` records each change (:data:`CHANGES`: the round it
applies from and ``[before, now]`` per setting), kept across later resumes.

Refused: a change with σ solved from ``dp.epsilon`` (it was solved for the old cap or rounds,
so σ would change mid-run: set ``dp.noise_multiplier``), a cap below a client's steps so far and
fewer rounds than the run has taken (:func:`fedlore.engine.cap_schedule.check_loop`, which
knows the checkpoint), and any other setting, as for every run
(:func:`fedlore.engine.run_record.check_same_config`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedlore.atomic import write_json
from fedlore.config import Config, ConfigError

RESUMABLE = (("dp", "max_contributions"), ("rounds",))
"""The settings (config paths as key tuples) a resume of a DP-FedBuff run may change."""
CHANGES = "resume_changes"
"""``config.json``'s list of the changes resumes made: ``{"round": r, "<path>": [before,
now], ...}``, r the first round run under the new values."""


def _get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path[:-1]:
        tree = tree.get(key) or {}
    return tree.get(path[-1])


def _dp_fedbuff(tree: dict[str, Any]) -> bool:
    return (
        _get(tree, ("asynchronous", "buffer")) is not None
        and _get(tree, ("dp", "clip_norm")) is not None
    )


def resumable_changes(cfg: Config, recorded: dict[str, Any]) -> dict[str, list[Any]]:
    """``{path: [before, now]}`` of the :data:`RESUMABLE` settings ``cfg`` changes from a run's
    recorded ``config.json``, when both are DP-FedBuff (empty otherwise: then a change is
    refused as any other).

    Raises:
        ConfigError: for a change while σ is solved from ``dp.epsilon``.
    """
    now = cfg.model_dump(mode="json")
    if not (_dp_fedbuff(recorded) and _dp_fedbuff(now)):
        return {}
    changes = {
        ".".join(p): [_get(recorded, p), _get(now, p)]
        for p in RESUMABLE
        if _get(recorded, p) != _get(now, p)
    }
    hyper = recorded.get("hyper") or {}
    schedule = hyper.get("schedule", cfg.optim.schedule)
    if "rounds" in changes and (schedule != "constant" or hyper.get("local_eval")):
        raise ConfigError(
            f"--resume of a DP-FedBuff run with rounds: {changes['rounds'][0]!r} -> "
            f"{changes['rounds'][1]!r}: the run's learning-rate schedule ({schedule}) or its "
            "local_eval spans its rounds, so other rounds would change the steps to come; "
            "only a run with optim.schedule: constant may change them"
        )
    if changes and cfg.dp.noise_multiplier is None:
        named = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
        raise ConfigError(
            f"--resume of a DP-FedBuff run with {named}: σ was solved from dp.epsilon for the "
            "settings the run started with, so it would change mid-run; resume with "
            "dp.noise_multiplier set to the run's (config.json: dp_noise_multiplier) instead "
            "of dp.epsilon"
        )
    return changes


def tolerated(cfg: Config, recorded: dict[str, Any]) -> dict[str, Any]:
    """``recorded`` with the :data:`RESUMABLE` settings ``cfg`` may change set to ``cfg``'s
    (so that comparing the two names every other difference) and without :data:`CHANGES`."""
    out = {k: v for k, v in recorded.items() if k != CHANGES}
    changes = resumable_changes(cfg, recorded)
    for p in RESUMABLE:
        if ".".join(p) in changes:
            tree = out
            for key in p[:-1]:
                tree[key] = tree = dict(tree.get(key) or {})
            tree[p[-1]] = _get(cfg.model_dump(mode="json"), p)
    if "rounds" in changes and isinstance(out.get("hyper"), dict):  # the method's copy
        out["hyper"] = {**out["hyper"], "rounds": cfg.rounds}
    return out


def resumed_record(out: Path) -> dict[str, Any] | None:
    """The ``config.json`` in ``out`` before a resume rewrites it (None when it has none or it
    cannot be read: the resume's config check has refused an unreadable one already)."""
    try:
        raw = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def record_changes(path: Path, prior: dict[str, Any] | None, cfg: Config, start: int) -> None:
    """Add to the ``config.json`` at ``path`` (just written for ``cfg``) the changes of the
    runs before (``prior``: the record it replaced, or None) and this resume's, from round
    ``start``."""
    if prior is None:
        return
    earlier = list(prior.get(CHANGES) or [])
    changes = resumable_changes(cfg, prior)
    if not (earlier or changes):
        return
    if changes:
        earlier.append({"round": start, **changes})
    record = json.loads(path.read_text())
    write_json(path, {**record, CHANGES: earlier})
