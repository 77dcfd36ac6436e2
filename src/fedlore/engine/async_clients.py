"""The clients of FedBuff's simulated schedule (:mod:`fedlore.engine.buffered`): how long each
takes per participation, which may start at a server version, and the one-line errors of a
step no client can fill.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedlore.config import Config
from fedlore.engine.unreliable import availability_trace, client_speeds, client_work


def durations(cfg: Config, algo: Any, client_data: Callable[[int], Any], seed: int) -> Any:
    """Client id -> its simulated seconds per participation, ``W_i · step_s / s_i`` (cached;
    W_i the optimizer steps of its round, :func:`~fedlore.engine.unreliable.client_work`)."""
    speeds = client_speeds(cfg, seed)
    cache: dict[int, float] = {}

    def duration(cid: int) -> float:
        if cid not in cache:
            steps, work = client_work(algo, client_data(cid).num_examples)
            cache[cid] = work(steps) * cfg.clients.step_s / float(speeds[cid])
        return cache[cid]

    return duration


def pools(cfg: Config) -> Callable[[int], list[int]]:
    """Version -> the clients that may start then (``clients.availability``, else all)."""
    trace = availability_trace(cfg)
    everyone = list(range(cfg.num_clients))
    if trace is None:
        return lambda v: everyone
    return lambda v: trace[v % len(trace)]


def starved(k: int, rnd: int, held: int, cap: int | None) -> str:
    """Round ``rnd`` holds ``held`` of its ``k`` updates and no client is in flight or can start
    (``cap``: ``dp.max_contributions``, or None)."""
    why = (
        f"every other client is in the buffer or at dp.max_contributions={cap}; finish it "
        "with --resume and a raised dp.max_contributions or fewer rounds"
        if cap is not None
        else "clients.availability leaves none; make more clients available"
    )
    return (
        f"asynchronous.buffer={k}: round {rnd} (counting from 0) holds {held} update(s) and no "
        f"client is in flight or can start: {why} (the rounds before it are saved)"
    )


def unusable(k: int, rnd: int, streak: int, last: str) -> str:
    """Round ``rnd`` rejected ``streak`` uploads in a row, the ``last`` one for its reason."""
    return (
        f"asynchronous.buffer={k}: round {rnd} (counting from 0) rejected {streak} uploads in a "
        f"row without filling its buffer (the last, {last}): the clients' uploads cannot be "
        "used (the rounds before it are saved)"
    )
