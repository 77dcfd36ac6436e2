"""``fedlore tune CONFIG [key=value ...] [--space KEY=SPEC ...] [--trials N] ...``: the command
line of the hyperparameter search (:mod:`fedlore.tune`, :mod:`fedlore.tune_study`). Each option
sets the key of the config's ``tune`` section it names, over the file's; ``--space`` adds to
(or replaces a key of) ``tune.space``."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlore.config import Config, ConfigError, apply_overrides, read_yaml, validate
from fedlore.config_tune import key_problem, parse_dim
from fedlore.engine import interrupt

if TYPE_CHECKING:
    from fedlore.experiment import Engine
    from fedlore.tune_outcome import Outcome

FLAGS = ("trials", "metric", "mode", "sampler", "seed", "method", "run_seed", "prune", "workers")
"""The options that set the ``tune`` key of their name."""


def space_item(item: str) -> tuple[str, str]:
    """``KEY=SPEC`` of ``--space``, checked.

    Raises:
        ConfigError: one line naming the item: no ``=``, a malformed spec or bad bounds, a key
            the config does not have (with the nearest one) or that no search may vary.
    """
    key, sep, spec = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--space {item!r}: write KEY=SPEC, e.g. --space lr=log:1e-4:1e-1")
    try:
        parse_dim(key, spec)
    except ValueError as e:
        raise ConfigError(f"--space {item}: {e}") from None
    problem = key_problem(Config, key)
    if problem is not None:
        raise ConfigError(f"--space {item}: {problem}")
    return key, spec


def tune_config(ns: argparse.Namespace, path: Path | None, overrides: list[str]) -> tuple[
    Config, dict[str, Any]
]:  # fmt: skip
    """The validated config of ``fedlore tune`` and its raw form: the file, the overrides, then
    the options in the ``tune`` section."""
    space = [space_item(item) for item in ns.space or []]  # before the file is read
    keys = [k for k, _ in space]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"--space {twice[0]} is given twice: give each key one range")
    raw = apply_overrides(read_yaml(path) if path is not None else {}, overrides)
    section = raw.get("tune")
    section = {} if section is None else section
    if isinstance(section, dict):  # else validation names the problem
        section = {**section, **{k: getattr(ns, k) for k in FLAGS if getattr(ns, k) is not None}}
        kept = section.get("space") or {}
        if space:
            section["space"] = {**kept, **dict(space)} if isinstance(kept, dict) else kept
        raw["tune"] = section
    return validate(raw), raw


def table(outcome: Outcome, metric: str) -> str:
    """The trials as a Markdown table: number, state, parameters, the metric (a pruned trial's
    last reported value), a note; the best trial's row marked."""
    keys = list(dict.fromkeys(k for r in outcome.rows for k in r.params))
    head = ["trial", "state", *keys, metric, "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best = outcome.best.number if outcome.best is not None else None
    for r in outcome.rows:
        cells = [f"{r.number}{' (best)' if r.number == best else ''}", r.state]
        cells += [_cell(r.params.get(k)) for k in keys]
        cells += [_cell(r.value), r.note.replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def tune_command(
    ns: argparse.Namespace,
    path: Path | None,
    overrides: list[str],
    engines: dict[str, Callable[[], Engine]],
) -> int:
    """Run ``fedlore tune``; returns the exit status (1 when no trial completed)."""
    from fedlore import progress
    from fedlore.tune import plan_search, seeds_note
    from fedlore.tune_study import import_optuna, run_search

    import_optuna()  # the missing extra is the first thing to say
    cfg, raw = tune_config(ns, path, overrides)
    progress.enable(cfg.progress)
    search = plan_search(cfg, raw, None if path is None else str(path), tuple(overrides))
    engine = engines[cfg.engine]()
    # one Ray for every trial of a search on flower-sim (each trial's experiment would start
    # and stop its own); SIGINT / SIGTERM stop between rounds; the search resumes
    session = engine.session() if engine.session is not None else contextlib.nullcontext()
    with interrupt.handling(), session:
        outcome = run_search(search, engine)
    print(table(outcome, search.metric), flush=True)
    print()
    if outcome.privacy is not None:  # every trial's exchanges, composed (fedlore.tune_privacy)
        print(outcome.privacy.line())
    if outcome.best is None:
        print(
            f"no trial completed ({outcome.counts.get('pruned', 0)} pruned, "
            f"{outcome.counts.get('failed', 0)} failed): no best.json; see the notes above"
        )
        return 1
    best = outcome.best
    print(f"best: trial {best.number}, {search.metric} {best.value:.4g}")
    print(f"every seed at its settings: {outcome.command}")
    print(f"({seeds_note(search)})")
    print(f"search in {search.folder}/ (study.db, best.json; one folder per trial)")
    return 0
