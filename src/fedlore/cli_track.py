"""``fedlore track``: send the finished runs of a config, and its report, to its trackers again
(a tracker that failed or was not configured while the runs trained)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedlore.config import Config, ConfigError


def track_command(cfg: Config) -> int:
    """Every finished run of ``cfg`` and its report to its trackers; the exit status: 1 when
    nothing was sent (no finished run of this config under its name, or every tracker failed),
    else 0. A run of another config under the same name is named and not sent.

    Raises:
        ConfigError: when the config names no tracker or a tracker's package is missing.
    """
    from fedlore.engine.rundir import run_dir
    from fedlore.tracking import track_finished, track_report, tracking_problems

    if not cfg.tracking.backends:
        raise ConfigError(
            "fedlore track sends runs to the trackers of the tracking section, and this config "
            "names none; add e.g. tracking=[mlflow]"
        )
    problems = tracking_problems(cfg)
    if problems:
        raise ConfigError("\n".join(problems))
    runs, refused = [], []
    for m in cfg.algorithms:
        for s in cfg.seeds:
            folder = run_dir(cfg, m, s)
            differs = recorded_differs(cfg, m, folder)
            if differs:  # another config's run under this name: not this config's to send
                refused.append(f"{m} seed {s}: not sent: {folder} holds a run of {differs}")
            else:
                runs.append((m, s, folder))
    lines = [*refused, *track_finished(cfg, runs)]
    for line in lines:
        print(line, flush=True)
    folder = Path(cfg.output_dir) / cfg.name
    if not any(" sent to " in line and "no tracker" not in line for line in lines):
        finished = any((f / "summary.json").is_file() for _, _, f in runs)
        why = "every tracker failed" if finished else "no finished run of this config"
        print(f"fedlore: nothing sent: {why} under {folder}", file=sys.stderr)
        return 1
    took = track_report(cfg, folder)
    if took:
        print(f"report of {folder} sent to {', '.join(took)}")
    return 0


def recorded_differs(cfg: Config, method: str, folder: Path) -> str:
    """``"another config (key: before -> now, ...)"`` when ``folder`` holds a finished run made
    with settings ``cfg`` does not have, ``"an unreadable config.json"`` when its record cannot
    be read; empty otherwise (the same config, or no finished run)."""
    from fedlore.engine.run_record import config_diff
    from fedlore.experiment_parts import make_algorithm

    if not (folder / "summary.json").is_file():
        return ""
    try:
        recorded = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        recorded = None
    if not isinstance(recorded, dict):
        return "an unreadable config.json"
    details = config_diff(cfg, method, recorded, make_algorithm)
    return f"another config ({details})" if details else ""
