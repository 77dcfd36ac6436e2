"""Buffered asynchronous aggregation, FedBuff (Nguyen et al., "Federated Learning with Buffered
Asynchronous Aggregation", AISTATS 2022, Algorithm 1), in simulated time (``asynchronous.*``).

The server keeps C clients (``concurrency``) training at once. A client started at simulated
time t from the global model of version v (the number of server steps taken so far) finishes at
``t + W_i · step_s / s_i`` (W_i the optimizer steps of its round: its local steps K_i, plus
those its method runs besides, e.g. Ditto's personal steps; ``clients.step_s`` and its relative
speed s_i from ``clients.speed``, as in :mod:`fedlore.engine.unreliable`). Its update Δ_i (its model
after local training minus the model it started from: the method's ``update.*``) then enters a
buffer with staleness ``s = v' - v``, v' the version when it arrives, weighted by w(s)
(:func:`staleness_weight`); ``max_staleness`` drops updates staler than that. When the buffer
holds K updates (``buffer``) the method's server steps from them: it receives each buffered
reply with ``update.*`` scaled by w(s_i), so FedAvg's server adds
``η_g · Σ p_i w(s_i) Δ_i / Σ p_i`` through the server optimizer (``server.*``, η_g its lr),
which with ``weighting: uniform`` (p_i = 1) is the paper's ``η_g · (1/K) Σ w(s_i) Δ_i``; the
version then increments and the buffer empties. One fedlore round is one server step, so rows,
evaluation, checkpoints and early stopping keep their meaning.

A round's row (``metrics.jsonl``) records the simulated clock at the step (``sim_time_s``),
the aggregated clients in arrival order (``accepted_clients``, a client may appear twice) with
their staleness (``staleness``, ``staleness_mean``, ``staleness_max``), the clients in flight
after it (``in_flight``), ``bytes_up`` of the replies that arrived during it and ``bytes_down``
of the broadcasts to the clients that started from its version (as a synchronous round's).

Each finished client is replaced at once by a client drawn uniformly from the available ones
(``clients.availability`` at the current version; all otherwise) that are not training, so C
stay in flight. Clients that finish at the same simulated time are taken in the order they
started, and their replacements start after all of them have arrived (or at the server step one
of them triggers), downloading the newest model. So with C = K, equal speeds and equal local
steps, every client of a version arrives together, the server steps, and K new clients start
from the new model: synchronous FedAvg on the same clients. The replacements of a step's
clients are started (and trained) when the next step begins, at the simulated time of the step
and from its model, which is the same as starting them at the step; a run that ends, at its last
round or by early stopping, so never trains clients whose updates no step would use.

A client trains, in simulation, when it starts (from the broadcast of its start version, its
generator ``generator(seed, CLIENT, v, i)`` as a synchronous round's); its reply waits until its
finish time. A client that starts a second time from the version it last started from (it
finished before the server stepped) draws from ``generator(seed, CLIENT, 2**31 + n, i)``, n its
start's sequence number, so its update is not a copy of its first. Replacements are drawn from
``derive_seed(seed, ASYNC_SAMPLING, d)`` for the run's d-th draw.

Resuming: the checkpoint (written after each round, i.e. right after a server step, when the
buffer is empty and the step's replacements have not started) holds the version, the simulated
clock, the counters of starts and draws, the clients that started from the current version, and
every client in flight with its start version, start and finish times and its reply; with the
client states and the server state this is everything the rest of the run depends on, so a
resumed run is bit-identical.

Under central DP (``dp.clip_norm``; ``privacy``: :class:`~fedlore.privacy.buffer_dp.BufferDP`)
the broadcasts carry the clip, an upload above it is rejected, a client whose update waits in
the buffer is not started again before the step (one contribution per client and step) nor one
at ``dp.max_contributions``, and the step's staleness-weighted uploads are summed, noised and
divided by K there (no norm screen, as in a synchronous DP round).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedlore.algorithm import Algorithm
from fedlore.config import AsynchronousConfig, Config
from fedlore.engine import interrupt
from fedlore.engine.async_clients import durations, pools, starved, unusable
from fedlore.engine.cap_schedule import check_loop
from fedlore.engine.loop import Callback, Row, add_scores, client_reports, drive
from fedlore.engine.staleness import staleness_weight, weighted
from fedlore.engine.transport import Transport
from fedlore.engine.validate import method_problem, validate_reply
from fedlore.privacy.buffer_dp import BufferDP
from fedlore.robust import norm_screen
from fedlore.seeding import ASYNC_SAMPLING, derive_seed
from fedlore.tensors import nbytes
from fedlore.types import Broadcast, Reply, State

REPEAT = 2**31
"""The client generator's round of a repeated start: ``REPEAT + sequence number``."""
REJECTED_IN_A_ROW = 10
"""A step that rejects this many uploads per client in flight, none accepted between, ends the
run with its reason (every upload broken: a step would never fill)."""


@dataclass
class Flight:
    """A client in flight: who, from which version, when it started and finishes, its reply
    (computed at the start; None when the client failed, with ``error``)."""

    cid: int
    version: int
    start: float
    finish: float
    seq: int
    reply: Reply | None
    error: str = ""


@dataclass
class AsyncState:
    """What the buffered loop carries between rounds (its checkpoint entry)."""

    version: int = 0
    clock: float = 0.0
    seq: int = 0
    draws: int = 0
    started: set[int] = field(default_factory=set)  # clients started from ``version``
    flights: list[Flight] = field(default_factory=list)
    down: int = 0  # broadcast bytes of clients started after the last step (older checkpoints)

    def checkpoint_entry(self) -> dict[str, Any]:
        """The state as plain values and CPU tensors (loadable with ``weights_only``)."""
        return {
            "asynchronous": {
                "version": self.version,
                "clock": self.clock,
                "seq": self.seq,
                "draws": self.draws,
                "started": sorted(self.started),
                "down": self.down,
                "flights": [
                    {
                        "cid": f.cid,
                        "version": f.version,
                        "start": f.start,
                        "finish": f.finish,
                        "seq": f.seq,
                        "error": f.error,
                        "arrays": None
                        if f.reply is None
                        else {k: v.detach().cpu() for k, v in f.reply.arrays.items()},
                        "metrics": None if f.reply is None else dict(f.reply.metrics),
                    }
                    for f in self.flights
                ],
            }
        }

    def restore(self, raw: dict[str, Any]) -> None:
        """Load what :meth:`checkpoint_entry` wrote (tensors already on the run's device).

        Raises:
            KeyError: when the checkpoint has no ``asynchronous`` entry.
        """
        a = raw["asynchronous"]
        self.version, self.clock = int(a["version"]), float(a["clock"])
        self.seq, self.draws = int(a["seq"]), int(a["draws"])
        self.started = {int(c) for c in a["started"]}
        self.down = int(a["down"])
        self.flights = [
            Flight(
                int(f["cid"]),
                int(f["version"]),
                float(f["start"]),
                float(f["finish"]),
                int(f["seq"]),
                None if f["arrays"] is None else Reply(dict(f["arrays"]), dict(f["metrics"])),
                str(f["error"]),
            )
            for f in a["flights"]
        ]


@dataclass
class Buffered:
    """An update in the buffer: the client, its reply, its staleness and weight."""

    cid: int
    reply: Reply
    staleness: int
    weight: float


@dataclass
class BufferedLoop:
    """FedBuff's server (module docstring); :meth:`run` as :class:`~fedlore.engine.loop.
    RoundLoop`'s, one round per server step.

    Attributes:
        settings: the ``asynchronous`` section.
        concurrency: C.
        duration: client id -> its simulated seconds of local training.
        pool: version -> the clients that may start (sorted).
        seed: the run seed.
        progress: the state carried between rounds (restored from a checkpoint on resume).
    """

    algorithm: Algorithm
    transport: Transport
    settings: AsynchronousConfig
    concurrency: int
    duration: Callable[[int], float]
    pool: Callable[[int], list[int]]
    seed: int
    progress: AsyncState
    evaluate: Callable[[State], dict[str, float]] | None = None
    eval_every: int = 1
    callbacks: Sequence[Callback] = ()
    norm_screen: float | None = None
    stop: Callable[[], bool] | None = None
    privacy: BufferDP | None = None
    _down: int = 0
    _buffered: set[int] = field(default_factory=set)  # clients whose update waits in the buffer

    def _startable(self) -> list[int]:
        """The clients that may start now: available at the current version, not in flight
        (under DP: nor waiting in the buffer, nor at ``dp.max_contributions``)."""
        p = self.progress
        busy = {f.cid for f in p.flights}
        dp, held = self.privacy, self._buffered
        return [
            c
            for c in self.pool(p.version)
            if c not in busy and (dp is None or dp.startable(c, held))
        ]

    def _top_up(self, state: State) -> None:
        """Start clients until C are in flight: drawn uniformly from the available clients not
        in flight, trained from the current version's broadcast."""
        p = self.progress
        eligible = self._startable()
        take = min(self.concurrency - len(p.flights), len(eligible))
        if take <= 0:
            return
        rng = np.random.default_rng(derive_seed(self.seed, ASYNC_SAMPLING, p.draws))
        p.draws += 1
        chosen = sorted(eligible[int(i)] for i in rng.choice(len(eligible), take, replace=False))
        starts = []
        for i, cid in enumerate(chosen):
            msg = self.algorithm.broadcast(state, p.version, cid)
            if self.privacy is not None:  # the clip the client applies
                msg = self.privacy.configure(p.version, {cid: msg})[cid]
            self._down += nbytes(msg.arrays)
            starts.append((p.version if cid not in p.started else REPEAT + p.seq + i, cid, msg))
            p.started.add(cid)
        self._launch(starts)

    def _launch(self, starts: list[tuple[int, int, Broadcast]]) -> None:
        """Clients ``(key, cid, msg)`` start, in this order, each from ``msg`` (its generator's
        round ``key``): in simulation they train now, those of one key in one exchange (at
        once, where the transport runs clients in parallel: Flower's engines), and each reply
        waits until its client's finish time."""
        p = self.progress
        got: dict[int, Reply | BaseException] = {}
        for key in dict.fromkeys(k for k, _, _ in starts):  # first starts share the version
            got.update(self.transport.send(key, {c: m for k, c, m in starts if k == key}))
        for _, cid, _ in starts:
            res = got.get(cid)
            reply = res if isinstance(res, Reply) else None
            error = "" if reply is not None else ("no reply" if res is None else f"{res}")
            finish = p.clock + self.duration(cid)
            p.flights.append(Flight(cid, p.version, p.clock, finish, p.seq, reply, error))
            p.seq += 1

    def _arrive(self, f: Flight, state: State, rnd: int) -> tuple[Buffered | None, str, int]:
        """A finished client: its buffered update (None when rejected), the reason it was
        rejected, and its reply's bytes."""
        p = self.progress
        if f.reply is None:
            return None, f.error, 0
        sent = nbytes({k: v for k, v in f.reply.arrays.items() if isinstance(v, torch.Tensor)})
        why = validate_reply(f.reply, self.algorithm.expected_reply(state, rnd, f.cid))
        if why is None:
            why = method_problem(self.algorithm, state, rnd, f.cid, f.reply)
        if why is None and self.privacy is not None:
            why = self.privacy.screen(f.reply)
        s = p.version - f.version
        cap = self.settings.max_staleness
        if why is None and cap is not None and s > cap:
            why = f"stale: {s} server steps > asynchronous.max_staleness {cap}"
        if why is not None:
            return None, why, sent
        w = staleness_weight(s, self.settings.staleness, self.settings.staleness_exponent)
        return Buffered(f.cid, f.reply, s, w), "", sent

    def _take(
        self,
        f: Flight,
        state: State,
        rnd: int,
        buffer: list[Buffered],
        rejected: list[str],
        accepted: list[tuple[int, Reply | None]],
    ) -> int:
        """Client ``f`` arrives: its update joins ``buffer``, or it is rejected (its reason in
        ``rejected``, ``(cid, None)`` in ``accepted``); returns its reply's bytes."""
        item, why, sent = self._arrive(f, state, rnd)
        if item is None:
            rejected.append(f"{f.cid}: {why}")
            accepted.append((f.cid, None))
        else:
            buffer.append(item)
            self._buffered.add(item.cid)  # under DP: not started again before the step
        return sent

    def _collect(
        self, state: State, rnd: int
    ) -> tuple[list[Buffered], list[str], list[tuple[int, Reply | None]], int]:
        """Clients arrive, in the order of their finish times, until the buffer holds K
        updates: (the buffer, the rejections, the rejected clients as ``(cid, None)``, the
        arrivals' upload bytes)."""
        p = self.progress
        buffer: list[Buffered] = []
        rejected: list[str] = []
        accepted: list[tuple[int, Reply | None]] = []
        bytes_up, streak, k = 0, 0, int(self.settings.buffer or 0)
        while len(buffer) < k:
            if not p.flights:  # settings the run cannot meet: the command's one-line error
                cap = None if self.privacy is None else self.privacy.max_contributions
                raise ValueError(starved(k, rnd, len(buffer), cap))
            p.clock = min(f.finish for f in p.flights)
            group = sorted((f for f in p.flights if f.finish == p.clock), key=lambda f: f.seq)
            for f in group:
                interrupt.check()
                p.flights.remove(f)
                held = len(buffer)
                bytes_up += self._take(f, state, rnd, buffer, rejected, accepted)
                streak = 0 if len(buffer) > held else streak + 1
                if streak >= REJECTED_IN_A_ROW * self.concurrency:  # every upload broken
                    raise ValueError(unusable(k, rnd, streak, rejected[-1]))
                if len(buffer) == k:
                    break
            else:
                self._top_up(state)  # the group has arrived: its replacements start
        return buffer, rejected, accepted, bytes_up

    def run_round(self, state: State, rnd: int, last_round: int) -> tuple[State, Row]:
        """Clients arrive until the buffer holds K updates; the server steps; returns
        (state, row)."""
        t0 = time.perf_counter()
        p = self.progress
        if rnd != p.version:
            raise RuntimeError(f"round {rnd} is not the server's version {p.version}")
        self._down, p.down = p.down, 0  # a row counts the broadcasts of its version's starts
        # the last step's replacements start now (its clock, this version's model): a run that
        # ends after the step never trains clients whose updates no step would use
        self._top_up(state)
        buffer, rejected, accepted, bytes_up = self._collect(state, rnd)
        self._buffered = set()  # the step is taken: its clients may start again
        screen = None if self.privacy is not None else self.norm_screen  # as a DP round's
        screened = norm_screen(dict(enumerate(b.reply for b in buffer)), screen)
        kept = [b for i, b in enumerate(buffer) if i not in screened]
        for i, why in sorted(screened.items()):
            rejected.append(f"{buffer[i].cid}: {why}")
            accepted.append((buffer[i].cid, None))
        dtypes = {k: v.dtype for k, v in self.algorithm.global_arrays(state).items()}
        private: dict[str, Any] = {}
        if self.privacy is None:
            accepted.extend((b.cid, weighted(b.reply, b.weight, dtypes)) for b in kept)
        elif kept:  # the weights scale the clipped uploads in the sum that is noised
            spec = self.algorithm.expected_reply(state, rnd, kept[0].cid)
            device = next(iter(self.algorithm.global_arrays(state).values())).device
            step = [(b.cid, b.reply, b.weight) for b in kept]
            noised, private = self.privacy.combine(rnd, spec, step, device)
            accepted.extend(noised)
        state, agg = self.algorithm.aggregate(state, accepted, rnd)
        if self.privacy is not None:  # the clients' counts (and the audit's record)
            state = self.privacy.record(state)
        agg = {**agg, **private}
        p.version += 1
        p.started = set()
        row = self._row(rnd, kept, accepted, rejected, bytes_up, agg)
        row["wall_s"] = time.perf_counter() - t0
        if self.evaluate is not None and ((rnd + 1) % self.eval_every == 0 or rnd == last_round):
            add_scores(row, self.evaluate, state)
        return state, row

    def _row(
        self,
        rnd: int,
        kept: list[Buffered],
        accepted: list[tuple[int, Reply | None]],
        rejected: list[str],
        bytes_up: int,
        agg: dict[str, Any],
    ) -> Row:
        ok = [b.reply for b in kept]
        losses = [
            float(v)
            for r in ok
            if isinstance(v := r.metrics.get("train_loss"), int | float) and math.isfinite(v)
        ]
        stale = [b.staleness for b in kept]
        row: Row = {
            "round": rnd,
            "clients": len(accepted),
            "accepted": len(kept),
            "rejected": len(rejected),
            "accepted_clients": [b.cid for b in kept],
            "staleness": stale,
            "bytes_up": bytes_up,
            "bytes_down": self._down,
            "train_loss": sum(losses) / len(losses) if losses else None,
            "optimizer_state_bytes": max(
                (int(r.metrics.get("optimizer_state_bytes", 0)) for r in ok), default=0
            ),
            "skipped_steps": sum(int(r.metrics.get("skipped_steps", 0)) for r in ok),
            "sim_time_s": self.progress.clock,
            "staleness_mean": sum(stale) / len(stale) if stale else None,
            "staleness_max": max(stale) if stale else None,
            # the clients in flight once the next step's replacements start (at its beginning)
            "in_flight": len(self.progress.flights)
            + min(self.concurrency - len(self.progress.flights), len(self._startable())),
        }
        for key in ("peak_memory_bytes", "client_state_bytes"):
            values = [int(r.metrics[key]) for r in ok if key in r.metrics]
            if values:
                row[key] = max(values)
        row.update(client_reports([(b.cid, b.reply) for b in kept], ()))
        if rejected:
            row["rejected_reasons"] = rejected
        clash = sorted(agg.keys() & row.keys())
        if clash:
            raise ValueError(
                f"{type(self.algorithm).__name__}.aggregate returned the metric(s) {clash}, "
                "which the buffered loop records itself; give them another name"
            )
        row.update(agg)
        return row

    def run(self, state: State, start: int, rounds: int) -> State:
        """Server steps ``start .. rounds-1``; a signal stops it as
        :meth:`fedlore.engine.loop.RoundLoop.run` does (the interrupted step is not recorded)."""
        if self.privacy is not None:  # DP-FedBuff's counts, from a resumed run's state
            self.privacy.restore(state)
            check_loop(self, rounds)  # a cap whose schedule starves: refused before training
        return drive(self.run_round, self.callbacks, self.stop, state, start, rounds)


def buffered_loop(
    cfg: Config,
    algo: Algorithm,
    transport: Transport,
    client_data: Callable[[int], Any],
    seed: int,
    progress: AsyncState,
    **loop: Any,
) -> BufferedLoop:
    """The run's :class:`BufferedLoop` (``loop``: evaluate, eval_every, callbacks,
    norm_screen, stop)."""
    return BufferedLoop(
        algo,
        transport,
        cfg.asynchronous,
        cfg.async_concurrency(),
        durations(cfg, algo, client_data, seed),
        pools(cfg),
        seed,
        progress,
        **loop,
    )


def hooks(
    progress: AsyncState | None, stopper: Any
) -> tuple[Callable[[], dict[str, Any]] | None, Callable[[dict[str, Any]], None] | None]:
    """The checkpoint's extra entries and their restore, of early stopping's rule (``stopper``,
    or None) and of the buffered loop's ``progress`` (or None)."""
    parts = [x for x in (stopper, progress) if x is not None]
    if not parts:
        return None, None

    def entries() -> dict[str, Any]:
        return {k: v for x in parts for k, v in x.checkpoint_entry().items()}

    def restore(raw: dict[str, Any]) -> None:
        for x in parts:
            x.restore(raw)

    return entries, restore
