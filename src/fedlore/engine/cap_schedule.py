"""Whether a DP-FedBuff run capped by ``dp.max_contributions`` can finish, decided before any
training by replaying its schedule (:func:`check_cap`).

**Why a cap can starve a run that has the places.** Under DP-FedBuff
(:mod:`fedlore.privacy.buffer_dp`) a client is started only when it is not in flight, not
waiting in the step's buffer (once per step) and below the cap m. A step that holds b < K
updates with no client in flight can fill only if some client outside the buffer is below the
cap; so the run starves at step t exactly when every client outside the buffer has given m
steps: ``(N − b) · m ≤ t · K`` with ``b ≤ K − 1`` and ``t ≤ T − 1``. Hence

* ``(N − K + 1) · m > (T − 1) · K`` (and every client always available): **no** schedule
  starves, whatever the speeds and draws;
* ``N · m < T · K``: every schedule does (too few places; refused with the config,
  :mod:`fedlore.checks.asynchronous`);
* in between, including the exact fill ``N · m = T · K``, it depends on the schedule: at the
  exact fill every client must give exactly m steps, so one client that falls a step behind
  (slow, or drawn less often while others are in flight) leaves the last steps short of K
  distinct clients.

The schedule does not depend on what the clients learn: on the simulated clock it follows from
the run seed (the draws of :data:`~fedlore.seeding.ASYNC_SAMPLING`), each client's duration and
``clients.availability``, so :func:`replay` runs the buffered loop's rules
(:class:`~fedlore.engine.buffered.BufferedLoop`: top-up, arrival groups, ``max_staleness``,
once per step, the cap) without training, and finds the step that would starve, or none. An
upload rejected for a reason the schedule cannot foresee (a client whose training went
non-finite, a malformed reply) changes the schedule after it; such a run can still starve, and
stops with the one-line error of :func:`~fedlore.engine.async_clients.starved`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedlore.seeding import ASYNC_SAMPLING, derive_seed


@dataclass
class Schedule:
    """The part of :class:`~fedlore.engine.buffered.AsyncState` the schedule depends on, and
    the clients' step counts: ``flights`` as ``(client, start version, finish, seq, failed)``."""

    version: int = 0
    clock: float = 0.0
    seq: int = 0
    draws: int = 0
    flights: list[tuple[int, int, float, int, bool]] = field(default_factory=list)
    counts: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Rules:
    """What decides who starts and who fills a step: K, C, the cap, the run seed, each
    client's duration, the clients available at a version, ``asynchronous.max_staleness``."""

    buffer: int
    concurrency: int
    cap: int | None
    seed: int
    duration: Callable[[int], float]
    pool: Callable[[int], list[int]]
    max_staleness: int | None = None


def replay(
    s: Schedule, rules: Rules, end: int, steps: list[list[int]] | None = None
) -> tuple[int, int] | None:
    """Run the schedule from ``s`` (modified) until step ``end``; ``(step, held)`` of the step
    that starves holding ``held`` updates, or None when every step fills. ``steps``, when
    given, gets each step's clients in arrival order (a row's ``accepted_clients``)."""
    held: set[int] = set()

    def top_up() -> None:
        busy = {f[0] for f in s.flights}
        cap = rules.cap
        eligible = [
            c
            for c in rules.pool(s.version)
            if c not in busy and c not in held and (cap is None or s.counts.get(c, 0) < cap)
        ]
        take = min(rules.concurrency - len(s.flights), len(eligible))
        if take <= 0:
            return
        rng = np.random.default_rng(derive_seed(rules.seed, ASYNC_SAMPLING, s.draws))
        s.draws += 1
        for cid in sorted(eligible[int(i)] for i in rng.choice(len(eligible), take, replace=False)):
            s.flights.append((cid, s.version, s.clock + rules.duration(cid), s.seq, False))
            s.seq += 1

    while s.version < end:
        top_up()
        buffer: list[int] = []
        while len(buffer) < rules.buffer:
            if not s.flights:
                return s.version, len(buffer)
            s.clock = min(f[2] for f in s.flights)
            group = sorted((f for f in s.flights if f[2] == s.clock), key=lambda f: f[3])
            for f in group:
                s.flights.remove(f)
                stale = s.version - f[1]
                cap = rules.max_staleness
                if not f[4] and (cap is None or stale <= cap):
                    buffer.append(f[0])
                    held.add(f[0])
                if len(buffer) == rules.buffer:
                    break
            else:
                top_up()
        for c in buffer:
            s.counts[c] = s.counts.get(c, 0) + 1
        if steps is not None:
            steps.append(buffer)
        held = set()
        s.version += 1
    return None


def starves(s: Schedule, rules: Rules, end: int) -> tuple[int, int] | None:
    """:func:`replay` on a copy of ``s`` (``s`` is left as it is)."""
    copy = Schedule(s.version, s.clock, s.seq, s.draws, list(s.flights), dict(s.counts))
    return replay(copy, rules, end)


def check_cap(s: Schedule, rules: Rules, end: int) -> None:
    """Refuse, before the step ``s.version`` is trained, a capped run whose schedule starves
    before step ``end``, naming the step, the smallest cap that finishes (searched up to
    ``end``) and the most rounds this cap finishes.

    Raises:
        ValueError: one line (the command's error).
    """
    if rules.cap is None:
        return
    stop = starves(s, rules, end)
    if stop is None:
        return
    step, held = stop
    enough = None
    for cap in range(rules.cap + 1, end + 1):
        wider = Rules(**{**rules.__dict__, "cap": cap})
        if starves(s, wider, end) is None:
            enough = cap
            break
    raise_cap = (
        f"dp.max_contributions={enough} is the smallest cap that finishes them"
        if enough is not None
        else "no cap finishes them (clients.availability leaves too few)"
    )
    raise ValueError(
        f"dp.max_contributions={rules.cap}: this run's schedule (seed {rules.seed}; "
        f"asynchronous.buffer={rules.buffer}, {rules.concurrency} in flight, the clients' "
        f"speeds) starves at round {step} (counting from 0), which would hold {held} of "
        f"{rules.buffer} updates with every other client at the cap or in the buffer, so "
        f"rounds={end} cannot finish; {raise_cap}, or rounds={step} finishes with this cap "
        "(refused before training)"
    )


def check_loop(loop: Any, end: int) -> None:
    """:func:`check_cap` of a :class:`~fedlore.engine.buffered.BufferedLoop` under DP-FedBuff
    with a cap, from where it stands (a resumed run: its checkpoint's flights and counts), after
    refusing what a resume may not change (:mod:`fedlore.engine.resume_changes`): fewer
    ``rounds`` than the steps taken, a cap below a client's steps so far.

    Raises:
        ValueError: one line (the command's error).
    """
    dp, p = loop.privacy, loop.progress
    if dp is None:
        return
    if p.version > end:
        raise ValueError(
            f"rounds={end}: this run has taken {p.version} steps already; resume it with "
            f"rounds of at least {p.version}"
        )
    cap, counts = dp.max_contributions, dp.counts.counts
    if cap is None:
        return
    most = max(counts.values(), default=0)
    if most > cap:
        who = sorted(c for c, n in counts.items() if n == most)
        raise ValueError(
            f"dp.max_contributions={cap}: client(s) {who} have been in {most} steps of this run "
            f"already, more than the cap, which could no longer bound their ε; resume with "
            f"dp.max_contributions of at least {most}"
        )
    flights = [(f.cid, f.version, f.finish, f.seq, f.reply is None) for f in p.flights]
    s = Schedule(p.version, p.clock, p.seq, p.draws, flights, dict(dp.counts.counts))
    settings = loop.settings
    rules = Rules(int(settings.buffer or 0), loop.concurrency, dp.max_contributions, loop.seed,
                  loop.duration, loop.pool, settings.max_staleness)  # fmt: skip
    check_cap(s, rules, end)
