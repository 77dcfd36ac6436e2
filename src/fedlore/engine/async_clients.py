"""The clients of FedBuff's simulated schedule (:mod:`fedlore.engine.buffered`): how long each
takes per participation, and which may start at a server version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedlore.config import Config
from fedlore.engine.unreliable import availability_trace, client_speeds


def durations(cfg: Config, algo: Any, client_data: Callable[[int], Any], seed: int) -> Any:
    """Client id -> its simulated seconds per participation, ``K_i · step_s / s_i`` (cached)."""
    speeds = client_speeds(cfg, seed)
    cache: dict[int, float] = {}

    def duration(cid: int) -> float:
        if cid not in cache:
            steps = algo.local_steps(client_data(cid).num_examples)
            cache[cid] = steps * cfg.clients.step_s / float(speeds[cid])
        return cache[cid]

    return duration


def pools(cfg: Config) -> Callable[[int], list[int]]:
    """Version -> the clients that may start then (``clients.availability``, else all)."""
    trace = availability_trace(cfg)
    everyone = list(range(cfg.num_clients))
    if trace is None:
        return lambda v: everyone
    return lambda v: trace[v % len(trace)]
