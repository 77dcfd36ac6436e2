"""FedBuff on the wall clock (``asynchronous.clock: wall``): the buffer fills in the real arrival
order of Flower's replies, on ``engine: flower-sim`` or a ``flwr run`` deployment.

:class:`WallClockLoop` is :class:`~fedlore.engine.buffered.BufferedLoop` with its clients
really in flight: the server keeps C = ``asynchronous.concurrency`` clients training by pushing
one ``train`` message each (``Grid.push_messages``) and pulls the replies as they arrive
(``Grid.pull_messages``, polled as :func:`~fedlore.flower.transport.send_and_receive` polls:
2 ms, doubling up to 1 s or the grid's own interval). Each arrival enters the buffer with
staleness (server version now) - (version its client started from), weighted by w(s) as under
the simulated clock, and a replacement drawn as there (``derive_seed(seed, ASYNC_SAMPLING, d)``)
starts at once from the current version; when the buffer holds K updates the server steps, and
the replacement of the client that filled it starts from the new version. Replies that arrived
together are taken in the order the pull returned them; those left once the buffer is full are
the next step's first arrivals (staleness counted then).

A client whose reply has not come ``asynchronous.flight_timeout_s`` seconds after it started
(a SuperNode that died, or a very slow one) is dropped: its slot goes to a replacement, the row
lists it among ``rejected_reasons``, its client is unmapped (its node may be gone) and a late
reply is ignored. As under the simulated clock, a step that rejects (or times out)
``REJECTED_IN_A_ROW`` uploads per client in flight in a row, none accepted between, ends the
run in one line naming the last reason, the earlier rounds kept.

While a client of the available ones has no known node, each server step
(and a moment when no client is in flight) asks the nodes the server does not know yet (a
SuperNode that joined or came back) for their ``partition-id``, without waiting: the replies are
pulled with the clients' (a node unanswered for ``flight_timeout_s`` is asked again later), and
a client whose node answered starts at the next arrival or step. With no client in flight the
server waits for such an answer.

Rows are those of the simulated clock but for the clock: ``elapsed_s``, the real seconds since
the run began (continued by a resumed run) at the server step, instead of ``sim_time_s``. The
order of arrivals depends on the machines, their load and the network, so a run is not
bit-reproducible (two runs of one config differ), unlike the simulated clock's. A resumed run
starts its C clients afresh from the checkpoint's version: the clients in flight when it
stopped belonged to the earlier process (on ``flower-sim`` a resumed run starts over from round
0 anyway, :mod:`fedlore.flower.simulation`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fedlore.engine import interrupt
from fedlore.engine.async_clients import unusable
from fedlore.engine.buffered import REJECTED_IN_A_ROW, Buffered, BufferedLoop, Flight
from fedlore.engine.loop import Row
from fedlore.flower.transport import FIRST_POLL_S, LAST_POLL_S, FlowerTransport, query_message
from fedlore.types import Broadcast, Reply, State

log = logging.getLogger(__name__)


@dataclass
class WallClockLoop(BufferedLoop):
    """FedBuff's server on the wall clock (module docstring); ``transport`` is a
    :class:`~fedlore.flower.transport.FlowerTransport`."""

    _pending: dict[str, Flight] = field(default_factory=dict)  # message id -> its flight
    _landed: list[Flight] = field(default_factory=list)  # arrived, not yet taken
    _queries: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> node, deadline
    _t0: float = 0.0

    @property
    def link(self) -> FlowerTransport:
        """The Flower transport the clients are reached through."""
        assert isinstance(self.transport, FlowerTransport)
        return self.transport

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def run(self, state: State, start: int, rounds: int) -> State:
        p = self.progress
        p.flights = []  # an earlier process's clients (a resumed run) cannot answer this one
        self._t0 = time.monotonic() - p.clock  # the clock continues from the checkpoint's
        return super().run(state, start, rounds)

    def _startable(self) -> list[int]:
        """The clients that may start: as under the simulated clock, and held by a known node."""
        return [c for c in super()._startable() if c in self.link.node_of]

    def _launch(self, starts: list[tuple[int, int, Broadcast]]) -> None:
        """Push each client's ``train`` message, in order (:meth:`_push`): nothing waits."""
        p = self.progress
        for key, cid, msg in starts:
            p.flights.append(self._push(key, cid, msg))
            p.seq += 1

    def _push(self, key: int, cid: int, msg: Broadcast) -> Flight:
        """Push client ``cid``'s ``train`` message; its flight ends with its reply or at its
        deadline (``finish`` until then: start + ``flight_timeout_s``)."""
        p = self.progress
        now = self._now()
        flight = Flight(cid, p.version, now, now + self.settings.flight_timeout_s, p.seq, None)
        message = self.link.train_message(key, cid, msg)
        ids = [] if isinstance(message, LookupError) else self.link.grid.push_messages([message])
        pushed = [i for i in ids if i]
        if not pushed:  # arrives at once, as a failure
            flight.error = str(message) if isinstance(message, LookupError) else "not delivered"
            flight.finish = now
            self._landed.append(flight)
        else:
            self._pending[pushed[0]] = flight
        return flight

    def _wait(self) -> list[Flight]:
        """Pull until a reply arrives, a flight's deadline passes or a node says which client it
        holds; returns the flights that ended (replies in the order pulled, then the timed
        out; none when only a node answered)."""
        grid = self.link.grid
        cap = min(LAST_POLL_S, float(getattr(grid, "pull_interval", LAST_POLL_S)))
        wait = min(FIRST_POLL_S, cap)
        limit = self.settings.flight_timeout_s
        while self._pending or self._queries:
            interrupt.check()
            got = list(grid.pull_messages([*self._pending, *self._queries]))
            now = self._now()
            out = []
            mapped = False
            for m in got:
                mid = m.metadata.reply_to_message_id
                if self._queries.pop(mid, None) is not None:
                    mapped = self.link.map_node(m) or mapped
                    continue
                f = self._pending.pop(mid, None)
                if f is None:
                    continue  # a reply after its flight's deadline
                res = self.link.decode(f.cid, m)
                f.reply, f.error = (res, "") if isinstance(res, Reply) else (None, str(res))
                f.finish = now
                out.append(f)
            for mid, (_, deadline) in list(self._queries.items()):
                if deadline <= now:
                    del self._queries[mid]  # asked again at a later step
            for mid, f in list(self._pending.items()):
                if f.finish <= now:
                    del self._pending[mid]
                    f.error = f"no reply within asynchronous.flight_timeout_s={limit:g}"
                    f.finish = now
                    self.link.node_of.pop(f.cid, None)  # its node may be gone
                    log.warning("client %d: %s; its slot goes to another client", f.cid, f.error)
                    out.append(f)
            if out or mapped:
                return out
            ends = [f.finish for f in self._pending.values()]
            ends += [d for _, d in self._queries.values()]
            time.sleep(max(0.0, min(wait, min(ends, default=now) - now)))
            wait = min(2 * wait, cap)
        return []

    def _collect(
        self, state: State, rnd: int
    ) -> tuple[list[Buffered], list[str], list[tuple[int, Reply | None]], int]:
        """Clients arrive in real time until the buffer holds K updates (as
        :meth:`BufferedLoop._collect`); each arrival's replacement starts at once."""
        p = self.progress
        buffer: list[Buffered] = []
        rejected: list[str] = []
        accepted: list[tuple[int, Reply | None]] = []
        bytes_up, streak, k = 0, 0, int(self.settings.buffer or 0)
        while len(buffer) < k:
            if not self._landed:
                if not p.flights and not self._queries:
                    self._remap()  # no client in flight: ask the nodes not known who they hold
                if not p.flights and not self._queries:
                    raise RuntimeError(
                        f"version {p.version}: no client is in flight and none is available "
                        "to start (clients.availability, or no connected SuperNode holds one)"
                    )
                self._landed = self._wait()
                if not self._landed:  # a node said which client it holds: it may start
                    self._top_up(state)
                    continue
            while self._landed and len(buffer) < k:
                f = self._landed.pop(0)
                p.flights = [x for x in p.flights if x is not f]
                p.clock = max(p.clock, f.finish)
                held = len(buffer)
                bytes_up += self._take(f, state, rnd, buffer, rejected, accepted)
                streak = 0 if len(buffer) > held else streak + 1
                if streak >= REJECTED_IN_A_ROW * self.concurrency:  # as the simulated clock
                    raise ValueError(unusable(k, rnd, streak, rejected[-1]))
                if len(buffer) < k:
                    self._top_up(state)  # its replacement starts from this version
        return buffer, rejected, accepted, bytes_up

    def run_round(self, state: State, rnd: int, last_round: int) -> tuple[State, Row]:
        """Ask the nodes not known who they hold, then as :meth:`BufferedLoop.run_round`."""
        self._remap()
        return super().run_round(state, rnd, last_round)

    def _remap(self) -> None:
        """Ask the nodes not known and not asked already which client they hold, when a client
        that may start has no known node (the replies come with :meth:`_wait`'s pulls)."""
        link = self.link
        if all(c in link.node_of for c in self.pool(self.progress.version)):
            return
        known = set(link.node_of.values()) | {n for n, _ in self._queries.values()}
        fresh = [n for n in link.grid.get_node_ids() if n not in known]
        if not fresh:
            return
        deadline = self._now() + self.settings.flight_timeout_s
        ids = link.grid.push_messages([query_message(n) for n in fresh])
        for node, mid in zip(fresh, ids, strict=False):
            if mid:
                self._queries[mid] = (node, deadline)

    def _row(self, *args: Any) -> Row:
        row = super()._row(*args)
        row["elapsed_s"] = row.pop("sim_time_s")  # real seconds, not the simulated clock
        return row


class WallClockTransport(FlowerTransport):
    """The Flower transport of a run under ``asynchronous.clock: wall``: its buffered loop is a
    :class:`WallClockLoop` (:func:`fedlore.experiment_loop.make_loop`)."""

    def wall_clock_loop(self, loop: BufferedLoop) -> WallClockLoop:
        """``loop`` (the run's buffered loop over this transport) on the wall clock."""
        kept = {f.name: getattr(loop, f.name) for f in dataclasses.fields(loop) if f.init}
        return WallClockLoop(**kept)
