"""The Simulation Engine's message threads as fedlore runs them (:mod:`fedlore.flower.sim_threads`),
without a running Flower: every stored message is delivered and every reply stored, as by
Flower's threads, and each thread (and a worker's wait on its queue) returns promptly once the
simulation stops, where Flower's waited up to a second."""

from __future__ import annotations

import threading
import time
from queue import Empty, Queue
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")

from fedlore.flower.sim_threads import (
    deliver_when_stored,
    prompt_threads,
    stop_aware_get,
    store_replies,
)

LONG = 30.0
"""A wait no test lasts: a thread still in it when the simulation stops would fail the test."""
PROMPT = 0.5
"""How long a thread may take to return once the simulation stops: far above the 0.02 s slice
(a loaded machine delays a wake-up by milliseconds, not by tenths of a second), below the
second that Flower's threads waited."""


def _join_after_stop(th: threading.Thread, stop: threading.Event) -> float:
    """Set ``stop`` and return the seconds ``th`` took to end (fails if it is still running)."""
    t0 = time.monotonic()
    stop.set()
    th.join(timeout=LONG)
    assert not th.is_alive()
    return time.monotonic() - t0


class _State:
    """The two methods of Flower's in-memory link state that the delivery thread uses."""

    def __init__(self) -> None:
        self.stored: dict[int, list[str]] = {}
        self.lock = threading.Lock()

    def store_message_ins(self, message: tuple[int, str]) -> str:
        with self.lock:
            self.stored.setdefault(message[0], []).append(message[1])
        return message[1]

    def get_message_ins(self, node_id: int, limit: int | None) -> list[str]:
        with self.lock:
            got = self.stored.get(node_id, [])
            out, self.stored[node_id] = got[:limit], got[limit:]
        return out


def test_delivery_thread_delivers_every_stored_message_and_stops() -> None:
    state, queue, stop = _State(), Queue[str](), threading.Event()
    own = state.store_message_ins
    th = threading.Thread(target=deliver_when_stored, args=(state, queue, {7: 0, 8: 1}, stop))
    th.start()
    for i in range(3):  # two for one node: each call hands over one message per node
        state.store_message_ins((7, f"a{i}"))
    state.store_message_ins((8, "b"))
    got = sorted(queue.get(timeout=10) for _ in range(4))
    stop.set()
    th.join(timeout=10)
    assert got == ["a0", "a1", "a2", "b"] and not th.is_alive()
    assert state.store_message_ins == own  # the wrapper is gone with the thread


def test_prompt_threads_swap_flowers_delivery_and_reply_threads_and_restore_them() -> None:
    from flwr.server.superlink.fleet.vce import vce_api

    own = vce_api.add_messages_to_queue, vce_api.put_message_into_state
    with prompt_threads():
        assert vce_api.add_messages_to_queue is deliver_when_stored
        assert vce_api.put_message_into_state is store_replies
    assert (vce_api.add_messages_to_queue, vce_api.put_message_into_state) == own


def test_a_flower_whose_thread_function_looks_different_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flwr.server.superlink.fleet.vce import vce_api

    def other(state: Any, queue: Any, f_stop: Any, extra: Any) -> None:  # another signature
        raise AssertionError

    monkeypatch.setattr(vce_api, "put_message_into_state", other)
    with prompt_threads():
        assert vce_api.put_message_into_state is other
        assert vce_api.add_messages_to_queue is deliver_when_stored
    assert vce_api.put_message_into_state is other


def test_a_workers_wait_ends_when_the_simulation_stops_not_at_its_timeout() -> None:
    """A worker blocked in ``get(timeout=LONG)`` on an empty queue returns (Empty) once the
    simulation stops, where the queue's own get would wait out the whole timeout."""
    queue, stop = Queue[str](), threading.Event()
    stop_aware_get(queue, stop)
    outcome: list[str] = []

    def worker() -> None:
        try:
            outcome.append(queue.get(timeout=LONG))
        except Empty:
            outcome.append("empty")

    th = threading.Thread(target=worker)
    th.start()
    time.sleep(0.1)  # the worker is waiting
    assert th.is_alive()
    assert _join_after_stop(th, stop) < PROMPT
    assert outcome == ["empty"]


def test_a_stop_aware_get_returns_an_item_at_once_and_keeps_its_timeout() -> None:
    queue, stop = Queue[str](), threading.Event()
    stop_aware_get(queue, stop)
    threading.Timer(0.2, queue.put, args=("m",)).start()
    t0 = time.monotonic()
    assert queue.get(timeout=LONG) == "m"  # the item, not the end of the timeout
    assert time.monotonic() - t0 < PROMPT
    t0 = time.monotonic()
    with pytest.raises(Empty):
        queue.get(timeout=0.3)  # not stopped: the whole timeout, then Empty
    assert time.monotonic() - t0 >= 0.3
    queue.put("n")
    assert queue.get(block=False) == "n"  # a get that does not block is the queue's own
    with pytest.raises(Empty):
        queue.get(block=False)


class _Replies:
    """The one method of Flower's link state that the reply thread uses."""

    def __init__(self) -> None:
        self.stored: list[str] = []

    def store_message_res(self, message: str) -> None:
        self.stored.append(message)


def test_the_reply_thread_stores_every_reply_and_ends_when_the_simulation_stops() -> None:
    state, queue, stop = _Replies(), Queue[str](), threading.Event()
    th = threading.Thread(target=store_replies, args=(state, queue, stop))
    th.start()
    for i in range(3):
        queue.put(f"r{i}")
    deadline = time.monotonic() + LONG
    while len(state.stored) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state.stored == ["r0", "r1", "r2"]  # in order, each once
    assert _join_after_stop(th, stop) < PROMPT


def test_the_delivery_thread_and_the_workers_waiting_on_its_queue_end_when_it_stops() -> None:
    """The delivery thread makes the workers' queue stop-aware: a worker waiting there for a
    message returns with the delivery thread once the simulation stops."""
    state, queue, stop = _State(), Queue[str](), threading.Event()
    th = threading.Thread(target=deliver_when_stored, args=(state, queue, {7: 0}, stop))
    th.start()
    time.sleep(0.1)  # the delivery thread has started

    def worker() -> None:
        with pytest.raises(Empty):
            queue.get(timeout=LONG)

    waiting = threading.Thread(target=worker)
    waiting.start()
    time.sleep(0.1)
    assert _join_after_stop(th, stop) < PROMPT
    waiting.join(timeout=PROMPT)
    assert not waiting.is_alive()
