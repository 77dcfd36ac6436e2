"""Transports move one round's broadcasts to clients and bring their replies back.

:class:`LocalTransport` is the embedded default: clients run in this process one after another,
each materialized (data split, RNG, optimizer) only while it runs, on one shared scratch model;
their state lives in a :class:`~fedlore.engine.store.ClientStore` (compact, spilling to disk
past its memory limit), so memory grows with the clients of a round, not of the federation.
Messages and states stay on the run's device: the transport passes the tensors themselves, no
copy, and on a CUDA device reports each client's peak device memory (``peak_memory_bytes``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from fedlore.algorithm import Algorithm
from fedlore.atomic import WriteError
from fedlore.data.client_data import ClientData
from fedlore.device import PeakMemory
from fedlore.engine import interrupt
from fedlore.engine.store import ClientStore, StoreError
from fedlore.engine.validate import validate_reply
from fedlore.privacy import (
    Privacy,
    SecureSum,
    client_contribution,
    client_name,
    client_noise,
    privatize,
)
from fedlore.privacy.parties import LocalParties, secure_sum
from fedlore.privacy.secagg import Abort
from fedlore.seeding import CLIENT, generator
from fedlore.tensors import state_bytes
from fedlore.types import Broadcast, Reply, Scalars

log = logging.getLogger(__name__)


class Transport(Protocol):
    """Sends one message per sampled client; returns each client's reply or the error it raised.

    Optional: ``send_secure`` (rounds under secure aggregation, see :class:`LocalTransport`),
    ``summary_fields() -> dict`` (what the transport measured, added to the run's
    ``summary.json`` as it is written; the Flower transport's wire bytes), and
    ``checkpoint_entry() -> dict`` with ``restore_checkpoint(raw)`` (what of it the checkpoint
    keeps, so that a resumed run's measurements go on from the checkpoint's: the wire bytes)."""

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        """Deliver ``messages`` (client id -> Broadcast) for round ``rnd``."""
        ...


class LocalTransport:
    """In-process transport.

    Args:
        algorithm: the method whose ``client_update`` runs.
        client_data: client id -> :class:`ClientData` (called only for sampled clients).
        model_factory: builds the scratch model once.
        seed: run seed; client ``c`` at round ``t`` draws from ``generator(seed, CLIENT, t, c)``.
        store: where client states live between rounds.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        client_data: Callable[[int], ClientData],
        model_factory: Callable[[], nn.Module],
        seed: int,
        store: ClientStore,
    ) -> None:
        self.algorithm = algorithm
        self.client_data = client_data
        self.model = model_factory()
        self.seed = seed
        self.store = store

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out: dict[int, Reply | BaseException] = {}
        for cid in sorted(messages):
            interrupt.check()  # a signal stops the round here (the round loop discards it)
            out[cid] = self._run_client(rnd, cid, messages[cid])
        return out

    def _train(self, rnd: int, cid: int, msg: Broadcast) -> Reply:
        """One client's local training: its reply, with ``client_state_bytes`` (the state it
        keeps) and, on a CUDA device, ``peak_memory_bytes``; its new state goes to the store.
        Raises what the client raised."""
        data = self.client_data(cid)
        first = next(self.model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        with PeakMemory(device) as peak:
            reply, state = self.algorithm.client_update(
                msg,
                self.store.get(cid),
                self.model,
                data,
                generator(self.seed, CLIENT, rnd, cid),
            )
        self.store.put(cid, state)
        measured = {"client_state_bytes": state_bytes(state)}
        if peak.bytes is not None:  # a CUDA device: the client's peak, reset per client
            measured["peak_memory_bytes"] = peak.bytes
        return Reply(reply.arrays, {**reply.metrics, **measured})

    def _run_client(self, rnd: int, cid: int, msg: Broadcast) -> Reply | BaseException:
        """One client's turn. Its data, optimizer and the state it started from are locals of
        this call, so nothing of the client outlives its turn except its reply and the state put
        in the store (a failure's traceback, which would pin them, is dropped after logging)."""
        try:
            reply = self._train(rnd, cid, msg)
            # DP alone: clipped (local DP: and noised here, with the client's own noise)
            return privatize(reply, msg.config, client_noise(msg.config, self.seed), rnd, cid)
        except (StoreError, WriteError):
            raise  # the server's own storage failed: stop rather than drop clients silently
        except Exception as e:  # a failing client must not stop the round
            who = client_name(msg.config, cid)  # under DP the logs do not name the sample
            log.warning("%s failed in round %d: %s: %s", who, rnd, type(e).__name__, e)
            log.debug("%s traceback", who, exc_info=e)
            return e.with_traceback(None)

    def send_secure(
        self,
        rnd: int,
        messages: dict[int, Broadcast],
        spec: dict[str, tuple[tuple[int, ...], torch.dtype]],
        privacy: Privacy,
    ) -> SecureSum | BaseException:
        """One round under in-process secure aggregation (:mod:`fedlore.privacy.secagg`):
        the clients advertise keys and share their secrets, then each trains, checks its own
        reply against ``spec`` (a reply the server would reject never gets masked: the client
        drops out instead), adds its noise share, encodes and masks; the server unmasks only
        the survivors' sum.

        Returns:
            The :class:`~fedlore.privacy.SecureSum`, or the :class:`~fedlore.privacy.secagg.
            Abort` that stopped the round (nothing was unmasked).
        """
        ids = sorted(messages)
        plan = privacy.plan(rnd, ids, spec)
        clear: dict[int, Scalars] = {}

        def upload(cid: int) -> object:
            interrupt.check()  # not an Exception: it stops the round, not this client
            msg = messages[cid]
            reply = self._train(rnd, cid, msg)
            why = validate_reply(reply, spec)
            if why is not None:
                raise ValueError(f"its reply fails the server's checks, so it is not sent: {why}")
            c = client_contribution(
                reply, msg.config, cid, rnd, client_noise(msg.config, self.seed)
            )
            ring = plan.encode(c)
            clear[cid] = c.metrics
            return ring

        clients = LocalParties(plan.params, upload, fatal=(StoreError, WriteError))

        def say_who_left() -> None:
            for cid, why in clients.failures.items():
                who = client_name(messages[cid].config, cid)  # under DP the logs hide the sample
                log.warning("round %d: %s left the secure round: %s", rnd, who, why)

        try:
            res = secure_sum(plan.params, clients, plan.length)
        except Abort as e:
            say_who_left()
            return e
        say_who_left()
        sum_wx, sum_w, counts = plan.decode(res.total)
        reasons = dict(clients.failures)
        reasons.update(
            {c: f"its masked vector was rejected: {w}" for c, w in res.server.rejected.items()}
        )
        return SecureSum(
            mean=sum_wx / sum_w,
            clients=list(res.survivors),
            metrics={c: clear[c] for c in res.survivors},
            bytes_up=res.server.bytes_up,
            bytes_down=res.server.bytes_down,
            counts=counts,
            reasons=reasons,
        )
