"""In-process secure aggregation with the guarantees of Bonawitz et al., "Practical Secure
Aggregation for Privacy-Preserving Machine Learning" (CCS 2017), §4 and Figure 4, in their
honest-but-curious form (no signatures, no consistency check), on the mask graph of SecAgg+
(Bell et al., CCS 2020) when a degree is set.

Round ``rnd`` over the sampled clients ``S``, with mask partners ``N(u)`` (all of ``S`` but
``u``, or the SecAgg+ ring of :func:`~fedlore.privacy.topology.neighbours`), share holders
``H(u) = N(u) ∪ {u}``, the share threshold ``t`` and the survivor threshold ``m_min``:

0. *Advertise keys.* Each client ``u`` draws two X25519 key pairs (``cryptography``): ``c_u``
   to encrypt what it sends other clients, ``s_u`` to agree pair masks; it sends both public
   keys. ``U1``: who answered.
1. *Share keys.* ``u`` draws its self-mask seed ``b_u`` and the seed of ``s_u``'s private key
   (128 bits each, OS entropy) and splits each ``t``-out-of-``|H(u) ∩ U1|`` with Shamir's scheme
   (pycryptodome's, the one flwr's SecAgg+ uses); each holder's two shares travel encrypted
   (AES-GCM under the X25519 agreement of ``c_u`` and ``c_v``), through the server, which cannot
   read them. ``U2``: who answered.
2. *Masked input.* ``u`` trains, encodes its vector ``x_u`` in fixed point
   (:mod:`fedlore.privacy.fixedpoint`) and uploads
   ``y_u = x_u + PRG(b_u) + Σ_{v ∈ N(u) ∩ U2} ±PRG(KA(s_u, s_v))  (mod 2^64)``
   (``+`` when ``u < v``), the PRG being AES-256 in counter mode keyed by HKDF-SHA256 of the
   secret. ``U3``: the clients whose well-formed masked vector arrived.
3. *Unmasking.* The server sends ``U3`` and ``U2 \\ U3`` to the survivors; each survivor answers
   once, for each client ``u`` whose shares it holds, with ``u``'s self-mask share if ``u ∈ U3``
   or its mask-key share if ``u ∈ U2 \\ U3`` — never both. The server rebuilds ``b_u`` of every
   survivor and ``s_u`` of every dropped client and removes their masks from ``Σ_{U3} y_u``,
   leaving ``Σ_{u ∈ U3} x_u``.

The server so learns, for each client, either its self-mask or its pair secret, never both: a
masked vector that arrived but was rejected (its client then counts as dropped) stays hidden
behind ``PRG(b_u)``, and a survivor's vector behind its pair masks. The round is **aborted**
(:class:`Abort`; nothing is unmasked, the model does not move) when fewer than ``m_min``
clients remain at any stage, when a secret has fewer than ``t`` live holders, when the
survivors' mask graph falls apart (the sum of each part would be revealed: with degree 2 a
client whose two neighbours dropped would stand alone), or when a survivor keeps at most
``c`` surviving mask partners (``c`` = ``RoundParams.colluders``, ``t − 1`` in fedlore's
rounds). The last rule is what makes the bound on colluders hold: the server and ``c``
colluding clients can strip a survivor's self-mask, the pair masks of its dropped partners and
those of its colluding partners; with ``c + 1`` surviving partners at least one honest
partner's pair mask stays on it, so every part of the sum they can compute holds two or more
honest clients' uploads (on the complete graph with ``c = t − 1`` the rule asks for ``t + 1``
survivors). A client refuses (:class:`Refused`) an unmasking request that breaks any of these
rules, with overlapping or unknown client sets, a share that does not decrypt, or a second
request in the same round.

What is simulated: every party runs in this process. Each :class:`Client` keeps its secrets in
its own object; the :class:`Server` code sees only the messages (public keys, ciphertexts,
masked vectors, answers), all of which it records in :attr:`Server.received` — the server's
whole view, which the attack tests try to exploit. On a real federation fedlore runs flwr's
SecAgg+ instead (:mod:`fedlore.flower.secure`).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedlore.privacy.crypto import (
    SECRET_BYTES,
    agree,
    combine,
    mask_key,
    open_sealed,
    pair_info,
    prg,
    public_bytes,
    seal,
    split,
)
from fedlore.privacy.topology import connected

SELF, MASK = "self", "mask"
"""The two kinds of share a survivor may reveal for a client."""


class Abort(RuntimeError):
    """A secure round that cannot finish without revealing more than the survivors' sum.
    ``unnamed``: the message without the clients' ids (``reason`` when it names none), what
    the rows and logs say under DP, whose sample is secret."""

    def __init__(self, stage: str, reason: str, unnamed: str | None = None) -> None:
        super().__init__(f"secure aggregation aborted in the {stage} stage: {reason}")
        self.stage = stage
        self.reason = reason
        self.unnamed = f"secure aggregation aborted in the {stage} stage: {unnamed or reason}"


class Refused(RuntimeError):
    """A client's refusal of a request that would let the server unmask a single client."""


# ------------------------------------------------------------------------------ the round


@dataclass(frozen=True)
class RoundParams:
    """The public parameters of one secure round.

    Attributes:
        rnd: the round.
        graph: client -> its mask partners (symmetric; every sampled client is a key).
        threshold: t, shares that rebuild a secret (at least 2, at most every holder set).
        min_survivors: m_min, the fewest clients with which any stage may go on (at least 2).
        colluders: c, the colluding clients the round withstands (at most t − 1): every survivor
            must keep at least c + 1 surviving mask partners. fedlore's rounds use c = t − 1
            (:meth:`fedlore.privacy.aggregation.Privacy.round_params`); 0 only asks that no
            survivor is left without a surviving partner.
    """

    rnd: int
    graph: Mapping[int, tuple[int, ...]]
    threshold: int
    min_survivors: int
    colluders: int = 0

    def __post_init__(self) -> None:
        for u, partners in self.graph.items():
            if u in partners or any(u not in self.graph.get(v, ()) for v in partners):
                raise ValueError(f"the mask graph is not symmetric at client {u}")
        if self.threshold < 2:
            raise ValueError(f"the share threshold must be at least 2, got {self.threshold}")
        if self.min_survivors < 2:
            raise ValueError(f"at least 2 survivors are needed, got {self.min_survivors}")
        if not 0 <= self.colluders < self.threshold:
            raise ValueError(
                f"colluders must be in [0, t − 1 = {self.threshold - 1}], got {self.colluders}"
            )
        smallest = min((len(self.holders(u)) for u in self.graph), default=0)
        if self.graph and self.threshold > smallest:
            raise ValueError(
                f"share threshold {self.threshold} exceeds the smallest holder set ({smallest})"
            )

    @property
    def clients(self) -> list[int]:
        return sorted(self.graph)

    def holders(self, u: int) -> tuple[int, ...]:
        """H(u): the clients that hold shares of ``u``'s secrets (its partners and itself)."""
        return tuple(sorted({u, *self.graph[u]}))

    def exposed(self, survivors: Iterable[int]) -> list[int]:
        """The survivors with at most ``colluders`` surviving mask partners: that many
        colluders among those partners, with the server, could strip every mask from such a
        client's vector."""
        alive = set(survivors)
        return sorted(u for u in alive if len(alive.intersection(self.graph[u])) <= self.colluders)


@dataclass(frozen=True)
class PublicKeys:
    """A client's stage-0 message: its two X25519 public keys (raw, 32 bytes each)."""

    enc: bytes
    mask: bytes


@dataclass(frozen=True)
class Share:
    """One answer of a survivor about client ``owner``: ``kind`` is :data:`SELF` (a share of its
    self-mask seed) or :data:`MASK` (a share of its mask-key seed)."""

    owner: int
    kind: str
    index: int
    value: bytes


class Client:
    """One client's side of one secure round; its secrets never leave this object except as
    encrypted shares and, in the unmasking stage, the one share per client the rule allows."""

    def __init__(self, cid: int, params: RoundParams) -> None:
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        self.cid = cid
        self.params = params
        self._enc = X25519PrivateKey.generate()
        self._mask_seed = os.urandom(SECRET_BYTES)
        self._mask = mask_key(self._mask_seed)
        self._self_seed = os.urandom(SECRET_BYTES)
        self._keys: dict[int, PublicKeys] = {}
        self._held: dict[int, tuple[int, bytes, bytes]] = {}  # owner -> (index, mask, self)
        self._inbox: dict[int, bytes] = {}
        self._u2: set[int] | None = None
        self._answered = False

    def advertise(self) -> PublicKeys:
        """Stage 0: the client's two public keys."""
        return PublicKeys(public_bytes(self._enc), public_bytes(self._mask))

    def share_keys(self, keys: Mapping[int, PublicKeys]) -> dict[int, bytes]:
        """Stage 1: for each other live holder ``v`` of this client's secrets, its shares of
        the self-mask and mask-key seeds, encrypted for ``v``; the client keeps its own.

        Raises:
            Refused: with fewer than ``t`` live holders (the secrets could not be rebuilt).
        """
        self._keys = dict(keys)
        live = [v for v in self.params.holders(self.cid) if v in keys]
        t = self.params.threshold
        if self.cid not in live:
            raise Refused(f"client {self.cid}: its own keys are not among the round's keys")
        if len(live) < t:
            raise Refused(f"client {self.cid}: {len(live)} live share holders, {t} needed")
        mask_shares = split(self._mask_seed, t, len(live))
        self_shares = split(self._self_seed, t, len(live))
        out = {}
        for v, (i, ms), (j, ss) in zip(live, mask_shares, self_shares, strict=True):
            assert i == j
            if v == self.cid:
                self._held[self.cid] = (i, ms, ss)
                continue
            key = agree(self._enc, keys[v].enc, self._channel(self.cid, v))
            body = struct.pack(">qqqi", self.params.rnd, self.cid, v, i) + ms + ss
            out[v] = seal(key, body, self._channel(self.cid, v))
        return out

    def _channel(self, sender: int, recipient: int) -> bytes:
        return b"fedlore secagg shares" + struct.pack(">qqq", self.params.rnd, sender, recipient)

    def receive(self, inbox: Mapping[int, bytes], u2: list[int]) -> None:
        """Stage 2's input: the ciphertexts addressed to this client (sender -> ciphertext)
        and ``U2``, the clients that shared their keys."""
        self._inbox = dict(inbox)
        self._u2 = set(u2)

    def masked_input(self, encoded: np.ndarray) -> np.ndarray:
        """Stage 2: ``y_u`` of the client's encoded vector (uint64; see the module docstring).

        Raises:
            Refused: before :meth:`receive`, when this client is not in ``U2``, or when ``U2``
                names a partner whose keys it never received.
        """
        if self._u2 is None or self.cid not in self._u2:
            raise Refused(f"client {self.cid} is not among the clients that shared their keys")
        unknown = sorted(
            v for v in self.params.graph[self.cid] if v in self._u2 and v not in self._keys
        )
        if unknown:
            raise Refused(f"client {self.cid}: U2 names partners {unknown} without keys")
        y = encoded.astype(np.uint64, copy=True)
        with np.errstate(over="ignore"):
            y += prg(self._self_seed, y.size)
            for v in self.params.graph[self.cid]:
                if v not in self._u2:
                    continue
                key = agree(self._mask, self._keys[v].mask, pair_info(self.params.rnd, self.cid, v))
                m = prg(key, y.size)
                y = y + m if self.cid < v else y - m
        return y

    def unmask(self, survivors: list[int], dropped: list[int]) -> list[Share]:
        """Stage 3: for each client whose shares this client holds, its self-mask share if it
        survived, its mask-key share if it dropped out; never both, and only once per round.

        Raises:
            Refused: for a second request, fewer than ``m_min`` survivors, overlapping lists,
                clients outside ``U2``, or when this client is not a survivor.
        """
        from cryptography.exceptions import InvalidTag

        if self._answered:
            raise Refused(f"client {self.cid} already answered this round's unmasking request")
        self._answered = True
        alive, gone = set(survivors), set(dropped)
        if len(alive) < self.params.min_survivors:
            raise Refused(
                f"client {self.cid}: {len(alive)} survivors, {self.params.min_survivors} needed"
            )
        if alive & gone:
            raise Refused(f"client {self.cid}: clients {sorted(alive & gone)} listed as both")
        if self._u2 is None or not (alive | gone) <= self._u2 or self.cid not in alive:
            raise Refused(f"client {self.cid}: the lists do not match the round's clients")
        exposed = self.params.exposed(alive)
        if exposed:
            raise Refused(
                f"client {self.cid}: survivors {exposed} keep at most "
                f"{self.params.colluders} surviving mask partners"
            )
        for u, sealed in self._inbox.items():
            key = agree(self._enc, self._keys[u].enc, self._channel(u, self.cid))
            try:
                body = open_sealed(key, sealed, self._channel(u, self.cid))
            except InvalidTag:
                raise Refused(f"client {self.cid}: the shares from {u} do not decrypt") from None
            if len(body) != 28 + 2 * SECRET_BYTES:
                raise Refused(f"client {self.cid}: the shares from {u} have the wrong length")
            rnd, sender, recipient, i = struct.unpack(">qqqi", body[:28])
            if (rnd, sender, recipient) != (self.params.rnd, u, self.cid):
                raise Refused(f"client {self.cid}: a share from {u} names another round or pair")
            ms, ss = body[28 : 28 + SECRET_BYTES], body[28 + SECRET_BYTES :]
            self._held[u] = (i, ms, ss)
        out = []
        for u, (i, ms, ss) in sorted(self._held.items()):
            if u in alive:
                out.append(Share(u, SELF, i, ss))
            elif u in gone:
                out.append(Share(u, MASK, i, ms))
        return out


@dataclass
class Server:
    """The server's side of one secure round. It sees only what :attr:`received` records."""

    params: RoundParams
    length: int
    received: list[tuple[str, int, Any]] = field(default_factory=list)
    """Every message a client sent the server: (stage, client, message)."""
    keys: dict[int, PublicKeys] = field(default_factory=dict)
    u2: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    bytes_up: int = 0
    """Bytes of every message the clients sent (keys, ciphertexts, masked vectors, answers)."""
    bytes_down: int = 0
    """Bytes of the protocol's messages to the clients (everyone's public keys, each inbox of
    ciphertexts, the survivor and dropout lists as 8-byte ids), the broadcasts not included."""

    def _enough(self, stage: str, clients: list[int] | set[int]) -> None:
        if len(clients) < self.params.min_survivors:
            raise Abort(
                stage,
                f"{len(clients)} of {len(self.params.graph)} clients remain, "
                f"{self.params.min_survivors} needed",
            )

    def collect_keys(self, keys: Mapping[int, PublicKeys]) -> dict[int, PublicKeys]:
        """Stage 0: ``U1`` and their public keys (sent on to every client)."""
        for c, k in keys.items():
            self.received.append(("keys", c, k))
            self.bytes_up += len(k.enc) + len(k.mask)
        self.keys = {c: k for c, k in keys.items() if c in self.params.graph}
        self._enough("advertise keys", list(self.keys))
        self.bytes_down += len(self.keys) * sum(len(k.enc) + len(k.mask) + 8
                                                for k in self.keys.values())  # fmt: skip
        return dict(self.keys)

    def route_shares(self, sent: Mapping[int, Mapping[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """Stage 1: ``U2`` (the senders) and each client's inbox (recipient -> sender ->
        ciphertext)."""
        inbox: dict[int, dict[int, bytes]] = {}
        for u, cts in sent.items():
            self.received.append(("shares", u, dict(cts)))
            self.bytes_up += sum(len(c) for c in cts.values())
            for v, ct in cts.items():
                inbox.setdefault(v, {})[u] = ct
        self.u2 = sorted(u for u in sent if u in self.keys)
        self._enough("share keys", self.u2)
        u2 = set(self.u2)
        routed = {v: {u: ct for u, ct in box.items() if u in u2} for v, box in inbox.items()}
        self.bytes_down += sum(len(ct) for box in routed.values() for ct in box.values())
        self.bytes_down += 8 * len(self.u2) * len(self.u2)  # U2 to each of its clients
        return routed

    def collect_masked(self, masked: Mapping[int, Any]) -> tuple[list[int], list[int]]:
        """Stage 2: the survivors ``U3`` (well-formed masked vectors from ``U2``) and the
        dropped ``U2 \\ U3``. A malformed vector is rejected here and its client counts as
        dropped: only its pair masks can then be removed, its self-mask keeps it hidden.

        Raises:
            Abort: when the survivors are too few or their mask graph is not connected.
        """
        ok = []
        for u, y in masked.items():
            self.received.append(("masked", u, y))
            if isinstance(y, np.ndarray):
                self.bytes_up += int(y.nbytes)
            why = self._malformed(u, y)
            if why is None:
                ok.append(u)
            else:
                self.rejected[u] = why
        self.survivors = sorted(ok)
        self.dropped = sorted(set(self.u2) - set(ok))
        self.bytes_down += 8 * len(self.u2) * len(self.survivors)  # both lists to each survivor
        self._enough("collect masked vectors", self.survivors)
        if not connected(set(self.survivors), self.params.graph):
            raise Abort(
                "collect masked vectors",
                "the survivors' mask graph is not connected, so unmasking would reveal the "
                "sums of its parts (a client with no surviving mask partner stands alone)",
            )
        exposed = self.params.exposed(self.survivors)
        if exposed:
            why = (
                f"keep at most {self.params.colluders} surviving mask partners, so "
                f"{self.params.colluders} colluding clients (the most the round withstands) "
                "could unmask them alone"
            )
            raise Abort(
                "collect masked vectors",
                f"survivors {exposed} {why}",
                f"{len(exposed)} survivor(s) {why}",
            )
        return list(self.survivors), list(self.dropped)

    def _malformed(self, u: int, y: Any) -> str | None:
        if u not in self.u2:
            return "it did not share its keys"
        if not isinstance(y, np.ndarray) or y.dtype != np.uint64 or y.shape != (self.length,):
            shape = getattr(y, "shape", None)
            return f"a masked vector must be uint64 ({self.length},), got {shape}"
        return None

    def unmask(
        self, masked: Mapping[int, np.ndarray], answers: Mapping[int, list[Share]]
    ) -> np.ndarray:
        """Stage 3: ``Σ_{u ∈ U3} x_u`` (uint64) from the survivors' masked vectors and their
        answers (survivor -> shares).

        Raises:
            Abort: with fewer than ``m_min`` answering survivors, or a secret with fewer than
                ``t`` shares.
        """
        alive = set(self.survivors)
        for v, shares in answers.items():
            self.received.append(("answers", v, list(shares)))
            self.bytes_up += sum(8 + len(s.value) for s in shares)
        answered = [v for v in answers if v in alive]
        self._enough("unmask", answered)
        by_owner: dict[tuple[int, str], dict[int, bytes]] = {}
        for v in answered:
            for s in answers[v]:
                by_owner.setdefault((s.owner, s.kind), {})[s.index] = s.value
        t = self.params.threshold
        total = np.zeros(self.length, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for u in self.survivors:
                total += masked[u]
            for u in self.survivors:
                total -= prg(self._rebuild(by_owner, u, SELF, t), self.length)
            for u in self.dropped:
                key = mask_key(self._rebuild(by_owner, u, MASK, t))
                for v in self.params.graph[u]:
                    if v not in alive:
                        continue
                    pair = agree(key, self.keys[v].mask, pair_info(self.params.rnd, u, v))
                    m = prg(pair, self.length)
                    total = total - m if v < u else total + m  # v added +m when v < u
        return total

    def _rebuild(
        self, by_owner: Mapping[tuple[int, str], dict[int, bytes]], u: int, kind: str, t: int
    ) -> bytes:
        got = by_owner.get((u, kind), {})
        if len(got) < t:
            seed = f"{'self-mask' if kind == SELF else 'mask-key'} seed has {len(got)} shares"
            raise Abort(
                "unmask",
                f"client {u}'s {seed} from live holders, {t} needed",
                f"a client's {seed} from live holders, {t} needed",
            )
        return combine(sorted(got.items())[:t])
