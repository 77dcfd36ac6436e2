"""The simulated clock of synchronous rounds: ``sim_round_s`` and ``sim_time_s`` in the rows of
an in-process run whose clients have simulated compute (:func:`simulates_time`).

Client i needs ``W_i · step_s / s_i`` simulated seconds for a round of K_i local steps at its
relative speed s_i (:func:`fedlore.engine.unreliable.client_speeds`), W_i the optimizer steps
the round runs: K_i, plus those the method runs besides (Meta-BayFL's trial steps, J candidates
x ``temp_steps`` per search; Ditto's personal steps), the method's ``round_work``
(:func:`fedlore.engine.unreliable.client_work`); forward-only passes are not counted. A
straggler under ``partial_work`` trains only the local steps whose work it finished by the
deadline, and its time counts that work.
A round lasts as long as its slowest answering client (a reply the server then rejects counts
too: the server waited for it), and, with ``round_deadline_s`` set, until the deadline when a
sampled client does not answer (a straggler dropped, or a client that dropped out: the server
cannot tell them apart before the deadline). Without a deadline a client that dropped out costs
nothing: the round lasts as long as the slowest client that answered (0 when none did), where a
real server would wait for a timeout. ``sim_time_s`` is the clock at the round's end, the sum of
the rounds' durations: the meaning of FedBuff's ``sim_time_s``
(:mod:`fedlore.engine.buffered`), which with C = K = N and equal speeds reads the same, bit for
bit. Setup exchanges (negative rounds) train no steps and carry neither key, nor do the rows
of a run under DP with secure noise, whose sample stays secret
(:attr:`fedlore.privacy.Privacy.hides_sample`): the slowest client's time would name it.

The clock is derived from the rows: a resumed run reads it from the row of its checkpoint's
round (:func:`sim_clock`), which JSON keeps exactly, so it continues bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedlore.config import Config, ConfigError
from fedlore.engine.unreliable import ClientDropped, client_plan, client_speeds, client_work
from fedlore.privacy import Privacy


def simulates_time(cfg: Config) -> bool:
    """Whether a synchronous run records the simulated clock: in process (``engine: local``),
    not FedBuff (whose rows carry their own), and with simulated compute: speeds other than
    ``equal`` (or a ``speed_trace``), a ``round_deadline_s`` or a ``dropout``."""
    c = cfg.clients
    simulated = (
        c.speed != "equal"
        or c.speed_trace is not None
        or c.round_deadline_s is not None
        or c.dropout > 0
    )
    return simulated and cfg.engine == "local" and not cfg.asynchronous.enabled


class SimClock:
    """Round, its sampled clients -> ``{"sim_round_s", "sim_time_s"}`` (module docstring),
    advancing the clock from ``start``."""

    def __init__(
        self,
        cfg: Config,
        algo: Any,
        client_data: Callable[[int], Any],
        seed: int,
        start: float = 0.0,
    ) -> None:
        self.cfg, self.algo, self.data, self.seed = cfg, algo, client_data, seed
        self.speeds = client_speeds(cfg, seed)
        self.time = start

    def round_s(self, rnd: int, ids: list[int]) -> float:
        """Round ``rnd``'s simulated duration with clients ``ids`` sampled."""
        c = self.cfg.clients
        times: list[float] = []
        missed = False
        for cid in ids:
            steps, work = client_work(self.algo, self.data(cid).num_examples)
            what = client_plan(self.cfg, self.speeds, self.seed, rnd, cid, steps, work)
            if isinstance(what, ClientDropped):
                missed = True
                continue
            done = steps if what is None else what
            times.append(work(done) * c.step_s / float(self.speeds[cid]))
        if missed and c.round_deadline_s is not None:
            times.append(float(c.round_deadline_s))  # the server waits until the deadline
        return max(times, default=0.0)

    def __call__(self, rnd: int, ids: list[int]) -> dict[str, float]:
        took = self.round_s(rnd, ids)
        self.time = self.time + took
        return {"sim_round_s": took, "sim_time_s": self.time}


def sim_clock(
    cfg: Config,
    algo: Any,
    client_data: Callable[[int], Any],
    seed: int,
    rows: Path,
    last: int | None,
    privacy: Privacy | None = None,
) -> SimClock | None:
    """The run's clock (None when it records none, :func:`simulates_time`, or when ``privacy``
    hides the sample), started at 0, or, resuming after round ``last``, at the ``sim_time_s``
    of its row in ``rows``.

    Raises:
        ConfigError: when that row lacks ``sim_time_s`` (written by an older fedlore).
    """
    if not simulates_time(cfg) or (privacy is not None and privacy.hides_sample):
        return None
    start = 0.0
    if last is not None and last >= 0:
        row: dict[str, Any] = {}
        for line in rows.read_text().splitlines():
            try:
                got = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line
            if isinstance(got, dict) and got.get("round") == last:
                row = got
        if "sim_time_s" not in row:
            raise ConfigError(
                f"--resume: the row of round {last} in {rows} has no sim_time_s (an older "
                "fedlore wrote it), so the simulated clock cannot continue; run without "
                "--resume to start over"
            )
        start = float(row["sim_time_s"])
    return SimClock(cfg, algo, client_data, seed, start)
