"""A :class:`~fedlore.engine.transport.Transport` over a Flower ``Grid``.

Each round's broadcasts become one ``Message`` per sampled client (``message_type="train"``,
addressed to the SuperNode that holds that client's partition), sent together with
:func:`send_and_receive` (Flower's ``Grid.send_and_receive`` with a shorter poll: see there).
Replies that arrive within ``round_timeout`` are decoded;
a client whose reply carries an error comes back as an exception; a client that does not answer
in time (a dead SuperNode) is simply absent, so the round loop aggregates the rest.

Before the first round the transport asks every connected node for its ``partition-id``
(``message_type="query"``) to map fedlore client ids to Flower node ids; nodes that join later
are picked up by :meth:`FlowerTransport.refresh_nodes`, which a round calls when one of its
clients has no node: it waits until each of the round's clients is mapped, not for every
unknown node (a dead node stays listed by the SuperLink for up to a minute and never answers).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedlore.engine import interrupt
from fedlore.flower.codec import broadcast_to_record, record_nbytes, record_to_reply
from fedlore.flower.node_files import Attempts
from fedlore.flower.secure import SecAggSettings, secure_round
from fedlore.privacy import SecureSum, client_name, clients_named, names_clients, spec_length
from fedlore.privacy.aggregation import DEFAULT_THRESHOLD
from fedlore.privacy.topology import threshold_count
from fedlore.tensors import to_device
from fedlore.types import Broadcast, Reply, Scalars

log = logging.getLogger(__name__)


TRAIN_ROUND = "fedlore.train_round"
"""Broadcast config key: the round whose generator the client trains with, when it is not the
broadcast's ``round`` (:meth:`FlowerTransport.outgoing`)."""

FIRST_POLL_S = 0.002
"""Seconds :func:`send_and_receive` waits before its second pull; the wait doubles each pull."""
LAST_POLL_S = 1.0
"""The longest wait between two pulls of :func:`send_and_receive` (a grid's own
``pull_interval`` when shorter: 0.1 s for the simulation's in-memory grid)."""


def send_and_receive(
    grid: Grid,
    messages: Iterable[Message],
    timeout: float | None = None,
    enough: Callable[[list[Message]], bool] | None = None,
) -> list[Message]:
    """Push ``messages`` and pull their replies until all are in or ``timeout`` seconds passed
    (None: wait for all), like Flower's ``Grid.send_and_receive``, but the waits between pulls
    start at :data:`FIRST_POLL_S` and double up to :data:`LAST_POLL_S` (or the grid's own
    ``pull_interval`` when shorter) instead of a fixed 0.1 s (simulation) or 3 s (deployment):
    a round whose clients answer in a few milliseconds is not rounded up to the next poll.
    A message the grid could not push (its id is None) has no reply to wait for. ``enough``
    (the replies so far -> bool), called after a pull that brought replies, stops the wait
    early when it returns True.

    Returns:
        The reply messages that arrived in time, in arrival order.

    Raises:
        fedlore.engine.interrupt.Interrupted: between two pulls after a SIGINT or SIGTERM (the
            round loop discards the round: replies lost to the interrupt are not failures).
    """
    pending = {m for m in grid.push_messages(messages) if m is not None}
    cap = min(LAST_POLL_S, float(getattr(grid, "pull_interval", LAST_POLL_S)))
    wait = min(FIRST_POLL_S, cap)
    end = None if timeout is None else time.monotonic() + timeout
    out: list[Message] = []
    while pending:
        interrupt.check()  # a signal: stop waiting (the round loop discards the round)
        got = list(grid.pull_messages(pending))
        out.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if not pending or (got and enough is not None and enough(out)):
            break
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            break
        time.sleep(wait if left is None else min(wait, left))
        wait = min(2 * wait, cap)
    return out


def bound_superlink_wait(grid: Grid, seconds: float | None) -> None:
    """Make ``grid`` give up on a SuperLink that does not answer for ``seconds`` (None: leave
    it as it is). flwr 1.42's deployed grid retries every call with no limit (its retry
    invoker's ``max_tries`` and ``max_time`` are None), so a ServerApp whose SuperLink was
    killed runs on for ever, holding its run folder against ``resume=true``; with a bound the
    call raises the last transport error once ``seconds`` have passed. Grids without a retry
    invoker (the simulation's in-memory grid) are left alone, and so is a bound already set."""
    invoker = getattr(grid, "_retry_invoker", None)
    if invoker is not None and getattr(invoker, "max_time", 0) is None:  # None stays None
        invoker.max_time = seconds


def query_message(node: int) -> Message:
    """The ``query`` asking SuperNode ``node`` for its ``partition-id`` (its fedlore client)."""
    return Message(RecordDict({"q": ConfigRecord({"ask": "partition-id"})}), node, "query")


class MessageTooLarge(ValueError):
    """A broadcast exceeds the configured size limit (raised before anything is sent)."""


def check_size(client_id: int, msg: Broadcast, limit_bytes: int | None) -> None:
    """Fail before sending when ``msg``'s arrays exceed ``limit_bytes``, naming the largest.

    Raises:
        MessageTooLarge: listing the five largest arrays and what to change.
    """
    if limit_bytes is None:
        return
    sizes = sorted(((t.numel() * t.element_size(), k) for k, t in msg.arrays.items()), reverse=True)
    total = sum(s for s, _ in sizes)
    if total > limit_bytes:
        top = ", ".join(f"{k} ({s / 1e6:.2f} MB)" for s, k in sizes[:5])
        raise MessageTooLarge(
            f"broadcast to client {client_id} is {total / 1e6:.2f} MB, over the limit of "
            f"{limit_bytes / 1e6:.2f} MB (flower.max_message_mb); largest arrays: {top}. "
            "Raise the limit, lower the rank, or use a method that sends low-rank payloads."
        )


class FlowerTransport:
    """Sends fedlore broadcasts through a Flower ``Grid``.

    Args:
        grid: the ServerApp's grid.
        round_timeout: seconds to wait for replies each round (None: wait for all).
        max_message_bytes: refuse to send a broadcast larger than this (None: no limit).
        wait_for_nodes: seconds to wait for the first nodes to connect.
        expected_nodes: how many nodes to wait for (at most ``wait_for_nodes``).
        device: where decoded replies go (the server's device).
        extra_config: scalars added to every broadcast's config (e.g. the data shape every
            site of a site-local deployment must match); not counted as payload bytes.
        secagg: the SecAgg+ parameters of :meth:`send_secure` (None: the defaults with
            ``max_weight`` 1 and ``round_timeout`` per stage).
        keeps_client_states: :attr:`keeps_client_states`.
        node_files: :attr:`node_files`.
    """

    keeps_client_states = False
    """Whether the clients of a resumed run hold their states as of its checkpoint. False for a
    deployment: a resumed run's ``flwr run`` is a new Flower run, its nodes start without the
    clients' states (:meth:`fedlore.algorithms.base.Hyper.clients_restarted`). True for a
    simulation whose clients keep their states in the run folder
    (:mod:`fedlore.engine.node_states`). The checkpoint records it
    (:mod:`fedlore.engine.client_holder`), so that a resume on another engine knows."""

    node_files = False
    """Whether a deployment's nodes keep their clients' states on their own disks
    (``flower.node_states``, :mod:`fedlore.flower.node_files`): every broadcast carries the
    run's attempts (:attr:`attempts`), which the checkpoint keeps, and a resume of such a
    checkpoint with it keeps the clients' states."""

    def __init__(
        self,
        grid: Grid,
        round_timeout: float | None = None,
        max_message_bytes: int | None = None,
        wait_for_nodes: float = 60.0,
        expected_nodes: int = 1,
        device: torch.device | str = "cpu",
        extra_config: dict[str, int | float | str | bool] | None = None,
        secagg: SecAggSettings | None = None,
        keeps_client_states: bool = False,
        node_files: bool = False,
    ) -> None:
        self.grid = grid
        self.keeps_client_states = keeps_client_states
        self.node_files = node_files
        self.attempts = Attempts()
        self.secagg = secagg if secagg is not None else SecAggSettings(timeout=round_timeout)
        self.extra_config = dict(extra_config or {})
        self.device = torch.device(device)  # where decoded replies go: the server's device
        self.round_timeout = round_timeout
        self.max_message_bytes = max_message_bytes
        self.node_of: dict[int, int] = {}
        self.wire_bytes_down = 0
        self.wire_bytes_up = 0
        self.num_examples: dict[int, int] = {}  # client -> num_examples of its latest reply
        deadline = time.monotonic() + wait_for_nodes
        while len(list(grid.get_node_ids())) < expected_nodes and time.monotonic() < deadline:
            interrupt.check()
            time.sleep(0.5)
        self.refresh_nodes()

    def summary_fields(self) -> dict[str, Any]:
        """What this transport measured, for the run's ``summary.json`` (the engine adds these
        as it writes it, :func:`fedlore.experiment.run`): the bytes of the serialized arrays
        Flower's messages carried up and down, and each client's ``num_examples`` as its
        latest reply gave it (with site-local data, each site's own count)."""
        return {
            "wire_bytes_up_total": self.wire_bytes_up,
            "wire_bytes_down_total": self.wire_bytes_down,
            "client_num_examples": {str(c): n for c, n in sorted(self.num_examples.items())},
        }

    def checkpoint_entry(self) -> dict[str, Any]:
        """What the checkpoint keeps of this transport (:meth:`restore_checkpoint`): the wire
        bytes so far and each client's ``num_examples``, so that a resumed run's
        :meth:`summary_fields` count the whole run, not only the rounds after the resume."""
        own = {
            "wire_bytes_up": self.wire_bytes_up,
            "wire_bytes_down": self.wire_bytes_down,
            "num_examples": {str(c): n for c, n in self.num_examples.items()},
        }
        if self.node_files:  # the run's attempts (fedlore.flower.node_files)
            own["node_files"] = self.attempts.entry()
        return {"transport": own}

    def restore_checkpoint(self, raw: dict[str, Any]) -> None:
        """Go on from the checkpoint's entry of :meth:`checkpoint_entry` (none in a checkpoint
        written before it was kept: the counts start at 0, as they did)."""
        own = raw.get("transport")
        # the run's attempts; none kept (a checkpoint of another holder): the clients restart
        self.attempts.restore(None if own is None else own.get("node_files"))
        if own is None:
            return
        self.wire_bytes_up = int(own["wire_bytes_up"])
        self.wire_bytes_down = int(own["wire_bytes_down"])
        self.num_examples = {int(c): int(n) for c, n in own["num_examples"].items()}

    def refresh_nodes(
        self, node_ids: Iterable[int] | None = None, need: Iterable[int] = ()
    ) -> None:
        """Ask the nodes not mapped yet (all listed ones, or ``node_ids``) for their
        ``partition-id`` and update the client -> node map, waiting for every answer (at most
        ``round_timeout``) or, with ``need`` (client ids), until each of those clients is
        mapped: a round does not wait for the other nodes (one that died stays listed for a
        while and never answers; one that answers later is asked again when a round needs
        it)."""
        known = set(self.node_of.values())
        ids = [n for n in (node_ids or self.grid.get_node_ids()) if n not in known]
        if not ids:
            return
        msgs = [query_message(n) for n in ids]
        wanted = set(need)

        def map_replies(replies: list[Message]) -> bool:
            for reply in replies:
                self.map_node(reply)
            return bool(wanted) and wanted <= self.node_of.keys()

        map_replies(send_and_receive(self.grid, msgs, self.round_timeout, map_replies))
        log.info("flower transport: %d clients mapped to nodes", len(self.node_of))

    def map_node(self, reply: Message) -> bool:
        """Map the client a node's reply to :func:`query_message` names to that node; whether
        it named one."""
        if reply.has_error():
            return False
        pid = reply.content.config_records["identity"]["partition-id"]
        if not isinstance(pid, int):
            return False
        self.node_of[pid] = reply.metadata.src_node_id
        return True

    def send_secure(
        self,
        rnd: int,
        messages: dict[int, Broadcast],
        spec: dict[str, tuple[tuple[int, ...], torch.dtype]],
        privacy: Any = None,
    ) -> SecureSum | BaseException:
        """One round whose uploads are summed by flwr's SecAgg+ protocol
        (:func:`fedlore.flower.secure.secure_round`): every client of ``messages`` gets its
        broadcast in the collect-masked-vectors stage, trains, and uploads its contribution
        vector (the ``spec_length(spec)`` entries of its upload) masked; the server unmasks
        only the weighted mean over the clients whose vectors arrived. Clients that drop out
        after sharing their keys are left out of the sum (their masks are removed from the
        survivors' shares) as long as every client keeps t live neighbours and at least
        m_min = ``privacy.min_survivors(len(messages))`` vectors arrived; with fewer the round
        stops before the unmask stage. ``privacy`` (the run's
        :class:`~fedlore.privacy.Privacy`; None: the default ``secure_aggregation_threshold``
        of 2/3) sets m_min and, unless ``SecAggSettings.reconstruction_threshold`` is set, t;
        it adds adaptive clipping's noised bit to the vector and, when
        ``flower.secagg_clipping_range`` is unset under DP, sets the clipping range from the
        round's clip norm; flwr's workflow has its own protocol parameters
        (:class:`~fedlore.flower.secure.SecAggSettings`).

        Returns:
            The :class:`SecureSum` (fedlore client ids, sorted), or the exception that stopped
            the round (a broadcast over the size limit raises :class:`MessageTooLarge`
            before anything is sent, as in :meth:`send`; fewer than two mapped clients, too few
            live clients for t or m_min, a vector of another length: a RuntimeError).
        """
        settings = self.secagg
        length = spec_length(spec)
        sampled = len(messages)
        if privacy is None:
            threshold: int | float = DEFAULT_THRESHOLD
            need = min(sampled, threshold_count(threshold, sampled))
        else:
            threshold, need = privacy.threshold, privacy.min_survivors(sampled)
        if privacy is not None and privacy.dp is not None:
            length += 1 if privacy.adaptive else 0  # the noised bit of adaptive clipping
            if settings.follow_privacy:  # entries within C_t plus the shares' noise tail
                bound = max(1.0, privacy.entry_bound_of(len(messages)))
                settings = dataclasses.replace(settings, clipping_range=bound)
        if any(c not in self.node_of for c in messages):
            self.refresh_nodes(need=messages)
        contents: dict[int, RecordDict] = {}
        client_of: dict[int, int] = {}
        missing = []
        for cid, msg in messages.items():
            check_size(cid, msg, self.max_message_bytes)
            node = self.node_of.get(cid)
            if node is None:
                missing.append(cid)
                continue
            msg = self.outgoing(int(msg.config.get("round", rnd)), msg, cid)
            content = broadcast_to_record(msg)
            self.wire_bytes_down += record_nbytes(content.array_records["arrays"])
            contents[node] = content
            client_of[node] = cid
        if missing:
            said = clients_named(messages[missing[0]].config, missing)  # under DP: a count
            log.warning("round %d: no connected SuperNode holds %s", rnd, said)
        named = names_clients(next(iter(messages.values())).config) if messages else True
        got = secure_round(
            self.grid, rnd, contents, length, settings, send_and_receive, need, threshold, named
        )
        if isinstance(got, BaseException):
            return got
        mean, metrics, nodes = got
        up = 8 * (length + 1) * len(nodes)  # the int64 masked vectors, weight factor first
        self.wire_bytes_up += up
        for node in set(client_of) - nodes:  # a node that dropped out may be gone
            self.node_of.pop(client_of[node], None)
        clients = sorted(client_of[n] for n in nodes)
        self.attempts.held.update(clients)  # they trained and kept their states
        return SecureSum(
            mean=torch.from_numpy(mean),
            clients=clients,
            metrics={client_of[n]: m for n, m in metrics.items()},
            bytes_up=up,
        )

    def outgoing(self, rnd: int, msg: Broadcast, cid: int | None = None) -> Broadcast:
        """``msg`` as sent for round ``rnd`` to client ``cid``: with :attr:`extra_config`,
        with :data:`TRAIN_ROUND` when ``rnd`` is not its ``round`` (FedBuff's repeated start of
        a client from one version, :data:`fedlore.engine.buffered.REPEAT`: the client draws
        from ``generator(seed, CLIENT, rnd, cid)``, as in process), and with the run's attempts
        under :attr:`node_files`."""
        extra = dict(self.extra_config)
        if msg.config.get("round") != rnd:
            extra[TRAIN_ROUND] = rnd
        if self.node_files and cid is not None:
            extra.update(self.attempts.config(cid, msg.config))
        return Broadcast(msg.arrays, {**msg.config, **extra}) if extra else msg

    def train_message(self, rnd: int, cid: int, msg: Broadcast) -> Message | LookupError:
        """The ``train`` message of ``msg`` to client ``cid``'s SuperNode for round ``rnd``
        (its arrays counted in :attr:`wire_bytes_down`), or the LookupError of a client no
        known node holds.

        Raises:
            MessageTooLarge: when ``msg`` is over the size limit (:func:`check_size`).
        """
        check_size(cid, msg, self.max_message_bytes)
        node = self.node_of.get(cid)
        if node is None:
            return LookupError(f"no connected SuperNode holds {client_name(msg.config, cid)}")
        content = broadcast_to_record(self.outgoing(rnd, msg, cid))
        self.wire_bytes_down += record_nbytes(content.array_records["arrays"])
        return Message(content, node, "train", group_id=str(rnd))

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        """Deliver one round's broadcasts; see the module docstring for failures."""
        if any(c not in self.node_of for c in messages):
            self.refresh_nodes(need=messages)
        out: dict[int, Reply | BaseException] = {}
        outgoing: list[Message] = []
        client_of: dict[int, int] = {}
        for cid, msg in messages.items():
            message = self.train_message(rnd, cid, msg)
            if isinstance(message, LookupError):
                out[cid] = message
                continue
            outgoing.append(message)
            client_of[message.metadata.dst_node_id] = cid
        for reply in send_and_receive(self.grid, outgoing, self.round_timeout):
            sender = client_of.get(reply.metadata.src_node_id)
            if sender is not None:
                out[sender] = self.decode(sender, reply, messages[sender].config)
        missing = sorted(set(client_of.values()) - set(out))
        if missing:
            said = clients_named(messages[missing[0]].config, missing)  # under DP: a count
            log.warning("round %d: no reply in time from %s", rnd, said)
            # a node that does not answer may be gone: ask again who is there next round
            for cid in missing:
                self.node_of.pop(cid, None)
        return out

    def decode(
        self, cid: int, reply: Message, config: Scalars | None = None
    ) -> Reply | BaseException:
        """Client ``cid``'s reply message as a :class:`Reply` on the server's device (its
        arrays counted in :attr:`wire_bytes_up`, its ``num_examples`` kept), or the error it
        carries."""
        if reply.has_error():
            return RuntimeError(f"{client_name(config or {}, cid)}: {reply.error.reason}")
        self.wire_bytes_up += record_nbytes(reply.content.array_records["arrays"])
        got = record_to_reply(reply.content)
        n = got.metrics.get("num_examples")
        if isinstance(n, int | float) and not isinstance(n, bool):
            self.num_examples[cid] = int(n)
        self.attempts.held.add(cid)  # it trained and kept its state
        return Reply(to_device(got.arrays, self.device), got.metrics)
