"""Running a secure round: the stages between a :class:`~fedlore.privacy.secagg.Server` and the
clients as the server reaches them (:class:`Parties`: a transport, or a test's faulty stand-in),
and the clients of a round in this process (:class:`LocalParties`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fedlore.privacy.secagg import Client, PublicKeys, Refused, RoundParams, Server, Share


class Parties(Protocol):
    """The clients of a secure round, as the server reaches them (a transport, or a test's
    faulty stand-in). Each stage returns the answers of the clients that answered."""

    def advertise(self) -> dict[int, PublicKeys]: ...

    def share_keys(self, keys: dict[int, PublicKeys]) -> dict[int, dict[int, bytes]]: ...

    def masked_inputs(self, inbox: dict[int, dict[int, bytes]], u2: list[int]) -> dict[int, Any]:
        """Each client of ``u2`` gets its inbox, trains and uploads its masked vector."""
        ...

    def unmask(self, survivors: list[int], dropped: list[int]) -> dict[int, list[Share]]: ...


@dataclass
class SumResult:
    """A completed secure round: the survivors' sum (uint64 ring elements) and the server."""

    total: np.ndarray
    survivors: list[int]
    dropped: list[int]
    server: Server


def secure_sum(params: RoundParams, parties: Parties, length: int) -> SumResult:
    """Run the four stages (module docstring) between a :class:`Server` and ``parties``.

    Raises:
        Abort: when the round cannot finish within the rules (nothing is unmasked).
    """
    server = Server(params, length)
    keys = server.collect_keys(parties.advertise())
    inbox = server.route_shares(parties.share_keys(keys))
    masked = parties.masked_inputs(inbox, list(server.u2))
    survivors, dropped = server.collect_masked(masked)
    answers = parties.unmask(survivors, dropped)
    total = server.unmask({u: masked[u] for u in survivors}, answers)
    return SumResult(total, survivors, dropped, server)


class LocalParties:
    """The clients of a round in this process: a :class:`Client` each, and ``inputs(cid)``,
    the encoded vector a client uploads (None or an exception: it drops out before masking).
    A client that refuses or fails a stage drops out of it; exceptions of the ``fatal`` types
    (the server's own failures) stop the round instead."""

    def __init__(
        self,
        params: RoundParams,
        inputs: Callable[[int], Any],
        fatal: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.params = params
        self.inputs = inputs
        self.fatal = fatal
        self.clients = {c: Client(c, params) for c in params.clients}
        self.failures: dict[int, str] = {}

    def _alive(self) -> list[int]:
        return [c for c in self.clients if c not in self.failures]

    def advertise(self) -> dict[int, PublicKeys]:
        return {c: self.clients[c].advertise() for c in self._alive()}

    def share_keys(self, keys: dict[int, PublicKeys]) -> dict[int, dict[int, bytes]]:
        out = {}
        for c in self._alive():
            if c not in keys:
                continue
            try:
                out[c] = self.clients[c].share_keys(keys)
            except Refused as e:
                self.failures[c] = str(e)
        return out

    def masked_inputs(self, inbox: dict[int, dict[int, bytes]], u2: list[int]) -> dict[int, Any]:
        out = {}
        for c in u2:
            if c in self.failures:
                continue
            client = self.clients[c]
            client.receive(inbox.get(c, {}), u2)
            try:
                x = self.inputs(c)
            except self.fatal:
                raise
            except Exception as e:  # a client failing before masking drops out
                self.failures[c] = f"{type(e).__name__}: {e}"
                continue
            if x is None:
                self.failures.setdefault(c, "no input")
                continue
            try:
                out[c] = client.masked_input(x)
            except Refused as e:
                self.failures[c] = str(e)
        return out

    def unmask(self, survivors: list[int], dropped: list[int]) -> dict[int, list[Share]]:
        out = {}
        for c in survivors:
            if c in self.failures:
                continue
            try:
                out[c] = self.clients[c].unmask(survivors, dropped)
            except Refused as e:
                self.failures[c] = str(e)
        return out
