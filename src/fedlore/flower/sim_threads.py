"""The Simulation Engine's message threads, made prompt while
:func:`~fedlore.flower.simulation.run_simulated` runs (:func:`prompt_threads`): what fedlore
replaces in Flower's ``vce_api`` and why.

Flower moves a simulation's messages with three kinds of thread, each of which waits on a timer:

- the **delivery** thread (``add_messages_to_queue``) looks for messages the server stored for
  the virtual SuperNodes every 0.1 s. :func:`deliver_when_stored` is woken as soon as one is
  stored instead, so a round of fast clients is not rounded up to the poll.
- the **workers** (``worker``, one per actor) wait for a message up to 1 s at a time before they
  look whether the simulation has ended; the **reply** thread (``put_message_into_state``) does
  the same for the clients' replies. Once the ServerApp has finished, Flower joins them all, so
  every simulation ended up to 1 s after its last round (measured: 0.9 to 1.0 s, idle). Here the
  workers' waits are cut into slices of :data:`STOP_POLL_S` that end once the simulation has
  stopped (:func:`stop_aware_get`, on the workers' queue, which the delivery thread is given),
  and :func:`store_replies` is the reply thread with the same slices.

Messages are delivered and replies stored exactly as Flower's threads do; only the waits differ.
A Flower version whose functions have other signatures keeps its own threads (slower, the same
results).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator
from queue import Empty, Queue
from typing import Any

log = logging.getLogger(__name__)

DELIVERY_POLL_S = 0.1
"""Seconds the delivery thread of :func:`deliver_when_stored` waits for a wake-up before it looks
for new messages anyway (Flower's own polling period)."""

STOP_POLL_S = 0.02
"""Seconds an idle worker or the reply thread waits at a time before it looks whether the
simulation has stopped (Flower: 1 s)."""

_patch_lock = threading.Lock()


def stop_aware_get(queue: Queue[Any], f_stop: threading.Event) -> None:
    """Make ``queue.get(timeout=t)`` (this queue object only, for the rest of its life) wait in
    slices of :data:`STOP_POLL_S` and raise ``Empty`` once ``f_stop`` is set, rather than after
    the whole ``t``; an item that arrives is returned as at once as before. A get without a
    timeout, or that does not block, is the queue's own."""
    own = queue.get

    def get(block: bool = True, timeout: float | None = None) -> Any:
        if not block or timeout is None:
            return own(block, timeout)
        end = time.monotonic() + timeout
        while True:
            try:
                return own(True, max(0.0, min(STOP_POLL_S, end - time.monotonic())))
            except Empty:
                if f_stop.is_set() or time.monotonic() >= end:
                    raise

    queue.get = get  # type: ignore[method-assign]


def deliver_when_stored(
    state: Any, queue: Queue[Any], nodes_mapping: dict[int, int], f_stop: threading.Event
) -> None:
    """Flower's ``vce_api.add_messages_to_queue`` (the thread that moves the messages stored for
    the virtual SuperNodes to the workers' queue), woken as soon as the server stores a message
    rather than every 0.1 s: ``state.store_message_ins`` of this simulation's link state is
    wrapped to set an event. Looks again at once after delivering something (a node's second
    message), and every :data:`DELIVERY_POLL_S` seconds in any case; returns once ``f_stop`` is
    set (the simulation ends). The workers' ``queue`` gets :func:`stop_aware_get` first."""
    stop_aware_get(queue, f_stop)
    stored = threading.Event()
    store = state.store_message_ins

    def store_and_wake(message: Any) -> Any:
        msg_id = store(message)
        stored.set()
        return msg_id

    state.store_message_ins = store_and_wake  # this state object only, not its class
    try:
        while not f_stop.is_set():
            stored.clear()  # a message stored from here on wakes the wait below
            found = False
            for node_id in list(nodes_mapping.keys()):
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
                    found = True
            if not found:
                stored.wait(DELIVERY_POLL_S)
    finally:
        state.store_message_ins = store


def store_replies(state: Any, queue: Queue[Any], f_stop: threading.Event) -> None:
    """Flower's ``vce_api.put_message_into_state`` (the thread that stores the workers' replies
    in the link state, where the server pulls them), waiting :data:`STOP_POLL_S` at a time for
    a reply instead of 1 s, so that it returns promptly once ``f_stop`` is set."""
    while not f_stop.is_set():
        try:
            reply = queue.get(timeout=STOP_POLL_S)
        except Empty:
            continue
        state.store_message_res(reply)


def _swap(module: Any, name: str, ours: Callable[..., None]) -> Callable[..., None] | None:
    """Put ``ours`` in place of ``module.name`` when that has ``ours``'s parameters; Flower's
    function (to put back) or None (left as it is)."""
    own = getattr(module, name, None)
    if own is None or list(inspect.signature(own).parameters) != list(
        inspect.signature(ours).parameters
    ):
        log.debug("Flower's %s is not the one known; keeping it", name)
        return None
    setattr(module, name, ours)
    return own


@contextlib.contextmanager
def prompt_threads() -> Iterator[None]:
    """Use :func:`deliver_when_stored` and :func:`store_replies` as the Simulation Engine's
    delivery and reply threads while inside (the module docstring); Flower's own are put back
    on leaving."""
    from flwr.server.superlink.fleet.vce import vce_api

    with _patch_lock:
        swapped = {
            name: own
            for name, ours in (
                ("add_messages_to_queue", deliver_when_stored),
                ("put_message_into_state", store_replies),
            )
            if (own := _swap(vce_api, name, ours)) is not None
        }
    try:
        yield
    finally:
        with _patch_lock:
            for name, own in swapped.items():
                setattr(vce_api, name, own)
