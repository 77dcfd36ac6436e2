"""The client-cache sync protocol, one for every method that keeps a global-model cache on its
clients (FedLore and its variants, the federated LoRA methods): the server's increment log, the
cheaper-of rule, the client's replay and the receiving side of a 16-bit transport.

Seed (the FedLore paper): Algorithm 1 lines 6-10, a client holding the
cache ``W~ = W^{t-1}`` rebuilds ``W^t`` from the round's increment, ``W~ <- W~ + eta alpha
P^{t-1} Δ^{t-1}``; Proposition 8, with a common decay ``a`` the update is ``W <- a W + P Z``,
which "a client holding the synchronized cache W reconstructs ... from a without receiving a
dense matrix"; and the paragraph after it: "under intermittent participation, a returning client
additionally needs the missed increments and their bases, or a fresh model". This module is that
rule, for any increment a method logs (FedLore: ``Δ^s`` per projected matrix and the unprojected
tensors' increments; FLoRA / FRLoRA: the round's merge payload):

* server (:class:`SyncState`): :meth:`~SyncState.record` keeps round s's increment as sent
  (arrays ``log.<s>.<name>``, and the scalars a client needs to apply it);
  :meth:`~SyncState.acknowledge` notes the round whose broadcast a client acted on with an
  accepted reply (``version.<cid>``: its cache holds that round's model, and a replay starts
  there); :meth:`~SyncState.forget` drops a client whose reply was lost or rejected
  (its cache may or may not have moved: the dense model at its next contact);
  :meth:`~SyncState.trim` keeps the latest ``log_rounds`` rounds; for a client at version v,
  :func:`cheaper` sends the cheaper in bytes of the replay of the log from v
  (:meth:`~SyncState.replay`) and the dense model.
* client: :func:`replay_steps` checks its cache against the replay and lists the increments to
  apply, oldest first; the method applies each with the server's own function (FedLore:
  :func:`~fedlore.algorithms.lowrank.apply_increment`, LoRA: its merge), identical operations in
  identical order, so the cache stays bit-identical to the server's model.
* both: :func:`upcast`, the exact upcast of what arrives over a 16-bit transport.

Exactness under a 16-bit transport: the server rounds every increment (payload, basis) it logs
to the wire dtype *before* it applies or merges it, so the values it applies are those the
clients receive, and a replayed cache equals the server's model bit for bit. The dense model is a
value and travels at the model's dtype.

The state is typed here and spelled in the flat checkpoint dicts (``State.arrays`` /
``State.values``) exactly as before this module existed: one codec, :meth:`SyncState.decode` and
:meth:`SyncState.encode`, parameterized by the method's :class:`LogFormat` (:data:`FEDLORE_LOG`,
:data:`LORA_LOG`). Lists that travel as one scalar (LoRA's adapted modules, its replayed rounds)
go through :func:`join_names` / :func:`split_names`.

The dense server (:class:`~fedlore.algorithms.dense.DenseServer`) keeps no log: every round it
sends the whole model (its only record, ``seen.<cid>``, says that a client holds the frozen
tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

import torch

from fedlore.tensors import from_wire, select, with_prefix
from fedlore.types import Arrays, Broadcast, Scalar, Scalars, State


@dataclass(frozen=True)
class LogFormat:
    """How a method spells its sync state in the flat checkpoint dicts (fixed: old checkpoints
    resume). Every format has a value ``version.<cid>`` (an int) per known client and arrays
    ``log.<s>.<name>`` per logged round s; a round's scalars are values ``log.<s>.<key>``.

    Attributes:
        held: also a value ``held.<cid>`` per client (FedLore: the id of the basis the client's
            cache holds, -1 for none).
        marker: a logged round is marked by a value ``<marker>.<s> = 1`` (LoRA: ``merged``).
        floor: the value that holds the oldest round a client may replay from (LoRA:
            ``log_from``: the log is sparse, a round without an entry changed no cache). None:
            the log has an entry for every round (FedLore), and it covers a client's version when
            every round since has one.
    """

    held: bool = False
    marker: str | None = None
    floor: str | None = None


FEDLORE_LOG = LogFormat(held=True)
"""FedLore's: ``version.<cid>``, ``held.<cid>``, ``log.<s>.<name>`` arrays and the values
``log.<s>.decay`` / ``log.<s>.basis_id`` of each round."""

LORA_LOG = LogFormat(marker="merged", floor="log_from")
"""The LoRA methods': ``version.<cid>``, the merge payloads ``log.<s>.<mod>.*`` with
``merged.<s> = 1``, and ``log_from``."""


@dataclass
class ClientCache:
    """The server's record of one client's cache.

    Attributes:
        version: the round whose broadcast the client last acted on with an accepted reply
            (the log replays to it from there); None: unknown, the client gets the dense model.
        held: (:attr:`LogFormat.held`) the basis id the client holds; None: not recorded.
    """

    version: int | None = None
    held: int | None = None


@dataclass
class Increment:
    """One logged round.

    Attributes:
        arrays: the increment as sent (``log.<s>.<name>`` without the prefix), in logged order.
        meta: the scalars a client needs to apply it (``log.<s>.<key>``; FedLore: ``decay``, the
            round's common decay a, and ``basis_id``, the basis P^s it is expressed in).
    """

    arrays: Arrays
    meta: Scalars = field(default_factory=dict)


@dataclass
class SyncState:
    """The server's sync state: its clients' caches and its increment log.

    Attributes:
        fmt: how it is spelled on disk.
        clients: client id -> its cache record, in the order the flat state lists them.
        log: round -> increment, the rounds a returning client can be replayed.
        floor: (:attr:`LogFormat.floor`) the oldest round a client may replay from.
    """

    fmt: LogFormat
    clients: dict[int, ClientCache] = field(default_factory=dict)
    log: dict[int, Increment] = field(default_factory=dict)
    floor: int | None = None

    # ------------------------------------------------------------------ codec
    @classmethod
    def decode(cls, state: State, fmt: LogFormat) -> SyncState:
        """The sync state held in ``state``'s flat dicts (keys of other roles are ignored)."""
        out = cls(fmt)
        for key, v in state.values.items():
            head, _, rest = key.partition(".")
            if head == "version" and rest:
                out.clients.setdefault(int(rest), ClientCache()).version = int(v)
            elif head == "held" and rest and fmt.held:
                out.clients.setdefault(int(rest), ClientCache()).held = int(v)
            elif head == "log" and rest:
                s, _, name = rest.partition(".")
                out._entry(int(s)).meta[name] = v
            elif fmt.marker is not None and head == fmt.marker and rest:
                out._entry(int(rest))
            elif key == fmt.floor:
                out.floor = int(v)
        for key, t in state.arrays.items():
            if key.startswith("log."):
                s, _, name = key[4:].partition(".")
                out._entry(int(s)).arrays[name] = t
        out.log = dict(sorted(out.log.items()))
        return out

    def _entry(self, s: int) -> Increment:
        return self.log.setdefault(s, Increment({}))

    def _owns(self, key: str) -> bool:
        head, _, rest = key.partition(".")
        heads = {"version", "log"} | ({"held"} if self.fmt.held else set())
        if self.fmt.marker is not None:
            heads.add(self.fmt.marker)
        return (head in heads and bool(rest)) or key == self.fmt.floor

    def flat(self) -> tuple[Arrays, Scalars]:
        """(arrays, values) as the flat checkpoint spells this state: the log's rounds oldest
        first (each round's arrays, its scalars, its marker), then each client's ``version``
        and ``held``, then the floor."""
        arrays: Arrays = {}
        values: Scalars = {}
        for s, inc in self.log.items():
            arrays.update(with_prefix(inc.arrays, f"log.{s}."))
            values.update({f"log.{s}.{k}": v for k, v in inc.meta.items()})
            if self.fmt.marker is not None:
                values[f"{self.fmt.marker}.{s}"] = 1
        for c, cache in self.clients.items():
            if cache.version is not None:
                values[f"version.{c}"] = cache.version
            if cache.held is not None and self.fmt.held:
                values[f"held.{c}"] = cache.held
        if self.fmt.floor is not None and self.floor is not None:
            values[self.fmt.floor] = self.floor
        return arrays, values

    def encode(self, arrays: Arrays, values: Scalars) -> None:
        """Write this state into flat dicts, in place: the keys of its roles that it no longer
        holds are deleted, those it still holds keep their place (dicts are ordered: the
        checkpoint file, and FedLore's plan order, follow that order) and new ones are appended
        in :meth:`flat`'s order (a new round before new clients, ``version`` before ``held``:
        the order the methods always wrote them)."""
        flat_arrays, flat_values = self.flat()
        for key in [k for k in arrays if k.startswith("log.") and k not in flat_arrays]:
            del arrays[key]
        for key in [k for k in values if self._owns(k) and k not in flat_values]:
            del values[key]
        arrays.update(flat_arrays)
        values.update(flat_values)

    # ------------------------------------------------------------------ server
    def client(self, cid: int) -> ClientCache:
        """The record of client ``cid`` (an empty one, not stored, when it has none)."""
        return self.clients.get(cid, ClientCache())

    def acknowledge(self, cid: int, version: int, held: int | None = None) -> None:
        """Client ``cid``'s cache is at ``version`` (it acted on that round's broadcast with an
        accepted reply) and, where recorded, holds basis ``held``."""
        cache = self.clients.setdefault(cid, ClientCache())
        cache.version = version
        if held is not None:
            cache.held = held

    def forget(self, cid: int) -> None:
        """Drop client ``cid``'s record: its reply was lost or rejected, so its cache may or may
        not have moved; it gets the dense model at its next contact."""
        self.clients.pop(cid, None)

    def record(self, rnd: int, arrays: Arrays, **meta: Scalar) -> None:
        """Log round ``rnd``'s increment ``arrays`` (as sent) with the scalars ``meta`` a client
        needs to apply it."""
        self.log[rnd] = Increment(dict(arrays), dict(meta))

    def trim(self, oldest: int) -> None:
        """Keep the rounds from ``oldest`` on (``oldest = t + 1 - log_rounds`` after round t);
        a floored log moves its floor there (never below round 0)."""
        for s in [s for s in self.log if s < oldest]:
            del self.log[s]
        if self.fmt.floor is not None:
            self.floor = max(0, oldest)

    def covers(self, version: int, rnd: int) -> bool:
        """Whether the log can bring a cache at ``version`` to round ``rnd``: ``version`` is at
        or after the floor (a sparse log), else every round in ``[version, rnd)`` is logged."""
        if self.fmt.floor is not None:
            return version >= (self.floor if self.floor is not None else 0)
        return all(s in self.log for s in range(version, rnd))

    def rounds(self, version: int, rnd: int) -> list[int]:
        """The logged rounds in ``[version, rnd)``, oldest first: what a replay applies."""
        return [s for s in range(version, rnd) if s in self.log]

    def payload(self, s: int) -> Arrays:
        """Round ``s``'s increment under its wire names ``log.<s>.<name>``."""
        return with_prefix(self.log[s].arrays, f"log.{s}.")

    def replay(
        self, version: int, rnd: int, frames: Frames | None = None
    ) -> tuple[Arrays, Scalars]:
        """What brings a cache at ``version`` to round ``rnd`` (when the log :meth:`covers` it):
        the arrays, each logged round's :meth:`payload` oldest first, preceded by the frame a
        client lacks (``frames``), and the config entries ``<key>.<s>`` of each round's scalars
        (FedLore: ``decay.<s>``, ``basis_id.<s>``)."""
        arrays: Arrays = {}
        config: Scalars = {}
        held = frames.held if frames is not None else None
        for s in self.rounds(version, rnd):
            meta = self.log[s].meta
            config.update({f"{k}.{s}": v for k, v in meta.items()})
            if frames is not None and int(meta[frames.key]) != held:
                held = int(meta[frames.key])
                arrays.update(frames.message(held))
            arrays.update(self.payload(s))
        if frames is not None and held != frames.current:
            arrays.update(frames.message(frames.current))
        return arrays, config


@dataclass(frozen=True)
class Frames:
    """The frames a log's increments are expressed in (FedLore: the basis P^s of round s's Δ^s,
    named by its scalar ``basis_id``; seed: "the missed increments and their bases"). A replay
    sends a frame before the first increment that needs it when the client lacks it, and the
    current frame at its end.

    Attributes:
        key: the round scalar that names a round's frame.
        held: the frame the client holds.
        current: the frame of the round being broadcast.
        message: frame id -> the arrays that send it (FedLore-Random: none, the id is a seed).
    """

    key: str
    held: int
    current: int
    message: Callable[[int], Arrays]


@dataclass(frozen=True)
class Offer:
    """One way to bring a client's cache to the current round.

    Attributes:
        arrays: what is sent.
        config: the broadcast config entries that say how to apply it (``mode`` and the rest).
        cost: its bytes as they cross the wire.
    """

    arrays: Arrays
    config: Scalars
    cost: int


def cheaper(replay: Offer | None, dense: Offer, slack: int = 0) -> Offer:
    """The cheaper of the log replay and the dense model: the replay when there is one (the log
    covers the client's version) and it costs at most ``dense.cost + slack`` bytes, else the
    dense model. ``slack``: FedLore lets a replay one byte dearer win (its rule since its first
    version, kept so that no broadcast changes); the LoRA methods none."""
    if replay is not None and replay.cost <= dense.cost + slack:
        return replay
    return dense


# ---------------------------------------------------------------------- client
def clients_restarted(state: State, fmt: LogFormat | None = None) -> State:
    """``state`` with no client holding anything: every ``seen.<cid>`` record (a client that
    holds the tensors sent at first contact) dropped and, with the method's log format ``fmt``,
    every client's cache record (:meth:`SyncState.forget`), so each client gets the dense model
    at its next contact. For a server resumed over clients that start without their states (a
    new ``flwr run`` of a deployment)."""
    values = {k: v for k, v in state.values.items() if not k.startswith("seen.")}
    arrays = dict(state.arrays)
    if fmt is not None:
        sync = SyncState.decode(state, fmt)
        for cid in list(sync.clients):
            sync.forget(cid)
        sync.encode(arrays, values)
    return State(arrays=arrays, values=values)


def replay_steps(
    msg: Broadcast, state: State | None, rnd: int, listed: Container[int] | None = None
) -> tuple[Arrays, list[tuple[int, Arrays]]]:
    """The client's side of a replay: its cached model ``cache.*`` (plain names) and the
    increments to apply to it, oldest first: ``(s, round s's log.<s>.* as received, prefix
    stripped)`` for each round s from its cache's ``version`` up to ``rnd`` (those in ``listed``
    only: a sparse log's rounds).

    Raises:
        RuntimeError: when the client holds no cache, or one older than the replay's start
            ``from_round`` (the server's record and the client disagree).
    """
    if state is None:
        raise RuntimeError("client has no cached model but the server sent a log replay")
    own, start = int(state.values["version"]), int(msg.config["from_round"])
    if own < start:
        raise RuntimeError(f"client cache is at round {own}; the replay starts at {start}")
    rounds = [s for s in range(own, rnd) if listed is None or s in listed]
    return select(state.arrays, "cache."), [(s, select(msg.arrays, f"log.{s}.")) for s in rounds]


# ---------------------------------------------------------------------- both sides
def upcast(
    arrays: Arrays,
    model: Arrays,
    fp32: tuple[str, ...] = (),
    roles: tuple[str, ...] | None = None,
) -> Arrays:
    """Received ``arrays`` as the receiver holds them (the receiving side of a 16-bit transport:
    exact, and no copy where the dtypes already match): keys under a prefix in ``fp32`` in
    float32 (LoRA's factors and merge payloads), every other ``<role>.<name>`` (role in
    ``roles``, or any) whose ``name`` is a tensor of ``model`` in that tensor's dtype, the rest
    unchanged."""
    dtypes: dict[str, torch.dtype] = {}
    for key in arrays:
        if key.startswith(fp32):
            dtypes[key] = torch.float32
        elif roles is None or key.startswith(roles):
            name = key.split(".", 1)[-1]
            if name in model:
                dtypes[key] = model[name].dtype
    return from_wire(arrays, dtypes)


def join_names(items: Iterable[object]) -> str:
    """A list as one scalar value (comma-joined: how the flat state and configs spell lists)."""
    return ",".join(map(str, items))


def split_names(value: Scalar) -> list[str]:
    """The list :func:`join_names` spelled (empty items dropped)."""
    return [x for x in str(value).split(",") if x]
