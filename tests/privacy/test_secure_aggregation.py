"""In-process secure aggregation (fedlore.privacy.secagg), tried as a curious server would.

The protocol sums exactly, with and without clients that drop out after sharing their keys, on
the complete mask graph and on a SecAgg+ ring. Then the attacks of issue 28, each run against
the server's whole view (every message it received) and each expected to fail:

* (a) a masked vector that arrived and was then rejected: the server gets that client's pair
  secret, but never its self-mask, so stripping every mask it can still leaves noise;
* (b) one survivor of three: the round aborts and the survivor refuses to help unmask;
* (c) a ring of degree 2 whose client loses both neighbours: the round aborts, and even a
  server that skipped the check could not rebuild the lone client's self-mask;
* a server that asks for both kinds of share, or asks twice, is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from fedlore.privacy import crypto, secagg, topology
from fedlore.privacy.aggregation import Privacy
from fedlore.privacy.fixedpoint import FixedPoint
from fedlore.privacy.parties import LocalParties, secure_sum
from fedlore.privacy.secagg import (
    MASK,
    SELF,
    Abort,
    Client,
    Refused,
    RoundParams,
    Server,
    Share,
)

LENGTH = 256
SEED = 7
FIXED = FixedPoint.for_sum(30.0, 16)  # entries 3 N(0, 1): never clipped


def _params(clients: int, degree: int = 0, t: int | None = None, m_min: int | None = None):
    graph = topology.neighbours(list(range(clients)), degree, seed=3)
    g = {c: tuple(v) for c, v in graph.items()}
    holders = min(len(v) + 1 for v in g.values())
    t = t if t is not None else min(holders, max(2, -(-2 * holders // 3)))
    m_min = m_min if m_min is not None else max(2, -(-2 * clients // 3))
    return RoundParams(7, g, t, m_min)


def _data(clients: int, seed: int = 0) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {c: 3 * torch.randn(LENGTH, generator=g, dtype=torch.float64) for c in range(clients)}


def _inputs(data: dict[int, torch.Tensor], fail: tuple[int, ...] = ()) -> Any:
    def inputs(c: int) -> np.ndarray:
        if c in fail:
            raise RuntimeError("lost connection after sharing its keys")
        return FIXED.encode(data[c])[0]

    return inputs


def _bound(plain: torch.Tensor, clients: int) -> float:
    """The decoded sum's error: each encoding rounds by half a step, and the decode rounds the
    ring integer to float64 (53 bits), like the plain float64 sum it is compared with."""
    return clients * FIXED.resolution + 2 * plain.abs().max().item() * 2.0**-52


def _still_masked(guess: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``guess`` tells nothing of ``x``: a uniform ring element decodes to a value
    uniform on ±2^(63−F) (±1024 here), so the attack's error has a median near 512 and almost
    no entry lands within 1 of the data (expected 0.25 of 256), while an unmasked vector would
    match to 1e-15. Both must hold."""
    err = (guess - x).abs()
    return err.median().item() > 50 and int((err < 1).sum()) <= 8


def _strip_what_the_server_can(server: Server, u: int) -> torch.Tensor:
    """The best a curious server can do for client ``u`` from its view: take u's masked vector
    and remove every mask it can compute: the pair masks of u (when the survivors revealed
    shares of u's mask key) and u's self-mask (when they revealed shares of its seed)."""
    masked = next(y for stage, c, y in server.received if stage == "masked" and c == u)
    shares = [s for stage, _, ans in server.received if stage == "answers" for s in ans]
    y = masked.copy()
    t = server.params.threshold
    mine = {s.index: s.value for s in shares if s.owner == u and s.kind == MASK}
    selfs = {s.index: s.value for s in shares if s.owner == u and s.kind == SELF}
    with np.errstate(over="ignore"):
        if len(mine) >= t:
            key = crypto.mask_key(crypto.combine(sorted(mine.items())[:t]))
            for v in server.params.graph[u]:
                if v not in server.u2:
                    continue
                pair = crypto.agree(key, server.keys[v].mask, crypto.pair_info(7, u, v))
                m = crypto.prg(pair, y.size)
                y = y - m if u < v else y + m
        if len(selfs) >= t:
            y = y - crypto.prg(crypto.combine(sorted(selfs.items())[:t]), y.size)
    return FIXED.decode(y)


@pytest.mark.parametrize("degree", [0, 4])
@pytest.mark.parametrize("fail", [(), (1, 3)])
def test_the_survivors_sum_is_exact(degree: int, fail: tuple[int, ...]) -> None:
    """9 clients on the complete graph (SecAgg) and a degree-4 ring (SecAgg+), with and without
    two clients failing after they shared their keys: the unmasked ring element is exactly the
    sum of the survivors' encodings. (On the ring, t = 3 of a client's 5 share holders: with
    the default two thirds, 4, a client whose two neighbours both fail aborts the round.)"""
    params = _params(9, degree, t=3 if degree else None)
    data = _data(9)
    res = secure_sum(params, LocalParties(params, _inputs(data, fail)), LENGTH)
    assert res.survivors == [c for c in range(9) if c not in fail] and res.dropped == list(fail)
    exact = sum(FIXED.encode(data[c])[0].view(np.int64) for c in res.survivors)
    assert np.array_equal(res.total.view(np.int64), exact)
    plain = sum((data[c] for c in res.survivors), torch.zeros_like(data[0]))
    assert (FIXED.decode(res.total) - plain).abs().max() <= _bound(plain, 9)
    # what the server received carries no plain vector: a masked vector is not its encoding
    for stage, c, y in res.server.received:
        if stage == "masked":
            assert not np.array_equal(y, FIXED.encode(data[c])[0])


def test_a_masked_upload_is_uniform_whatever_the_data() -> None:
    """Client 0's masked first entry over 400 rounds (fresh keys and seeds each): its top byte
    is uniform on 0..255 for all-zero data and for large data alike."""
    tops: dict[str, list[int]] = {"zeros": [], "big": []}
    params = _params(3, t=2, m_min=2)
    for name, value in (("zeros", 0.0), ("big", 9.0)):
        enc = FIXED.encode(torch.full((4,), value, dtype=torch.float64))[0]
        for _ in range(400):
            clients = {c: Client(c, params) for c in range(3)}
            keys = {c: cl.advertise() for c, cl in clients.items()}
            for cl in clients.values():
                cl.share_keys(keys)
                cl.receive({}, [0, 1, 2])
            tops[name].append(int(clients[0].masked_input(enc)[0] >> np.uint64(56)))
    for name, top in tops.items():
        counts = np.bincount(top, minlength=256)
        assert stats.chisquare(counts).pvalue > 1e-4, name
    assert stats.ks_2samp(tops["zeros"], tops["big"]).pvalue > 1e-4


def test_nothing_depends_on_a_seed_anyone_knows() -> None:
    """The same round twice gives other keys, seeds and masked vectors (no run seed enters the
    protocol), and every secret is at least 128 bits."""
    params = _params(3, t=2, m_min=2)
    a, b = Client(0, params), Client(0, params)
    assert a.advertise() != b.advertise()
    assert len(a.advertise().enc) == len(a.advertise().mask) == 32
    assert len(a._self_seed) == len(a._mask_seed) == 16  # 128-bit Shamir-shared secrets


class _Rejecting(LocalParties):
    """Parties whose client ``victim`` uploads a vector the server rejects after it arrived
    (one entry short)."""

    victim = 1

    def masked_inputs(self, inbox: dict[int, dict[int, bytes]], u2: list[int]) -> dict[int, Any]:
        out = super().masked_inputs(inbox, u2)
        out[self.victim] = out[self.victim][:-1]  # arrived, malformed
        return out


def test_attack_a_a_rejected_upload_that_arrived_stays_hidden() -> None:
    """Issue 28 (a): the server rejects client 1's masked vector after it arrived, so the
    survivors reveal client 1's mask-key shares. The server can strip all of client 1's pair
    masks, but never gets its self-mask seed, so what remains is uniform noise, nowhere near
    client 1's data."""
    params = _params(5)
    data = _data(5)
    res = secure_sum(params, _Rejecting(params, _inputs(data)), LENGTH)
    assert 1 in res.dropped and 1 in res.server.rejected
    shares = [s for stage, _, ans in res.server.received if stage == "answers" for s in ans]
    assert any(s.owner == 1 and s.kind == MASK for s in shares)
    assert not any(s.owner == 1 and s.kind == SELF for s in shares)
    # the malformed vector padded back: the attack has the whole of what arrived
    res.server.received = [
        (st, c, np.concatenate([y, np.zeros(1, np.uint64)]) if st == "masked" and c == 1 else y)
        for st, c, y in res.server.received
    ]
    assert _still_masked(_strip_what_the_server_can(res.server, 1), data[1])
    # the sum itself is right: the other four clients
    plain = sum((data[c] for c in res.survivors), torch.zeros_like(data[0]))
    assert (FIXED.decode(res.total) - plain).abs().max() <= _bound(plain, 5)


def test_attack_a_even_a_survivors_vector_stays_hidden() -> None:
    """A survivor's self-mask seed is revealed, its pair secrets are not: stripping what the
    server can from a survivor's vector leaves its pair masks on it."""
    params = _params(4)
    data = _data(4)
    res = secure_sum(params, LocalParties(params, _inputs(data)), LENGTH)
    for u in res.survivors:
        assert _still_masked(_strip_what_the_server_can(res.server, u), data[u])


def test_attack_b_one_survivor_of_three_aborts_and_is_refused() -> None:
    """Issue 28 (b): two of three clients fail before masking; the round aborts (its "sum"
    would be the survivor's upload), and the survivor refuses an unmasking request naming it
    alone even from a server that skipped the check."""
    params = _params(3, t=2, m_min=2)
    parties = LocalParties(params, _inputs(_data(3), fail=(0, 2)))
    with pytest.raises(Abort, match="1 of 3 clients remain, 2 needed"):
        secure_sum(params, parties, LENGTH)
    with pytest.raises(Refused, match="1 survivors, 2 needed"):
        parties.clients[1].unmask([1], [0, 2])


def test_attack_c_a_ring_client_without_live_neighbours_is_never_unmasked() -> None:
    """Issue 28 (c): degree 2, both ring neighbours of client u fail after sharing keys. The
    round aborts (u would stand alone in the survivors' mask graph); a server that skipped that
    check still cannot rebuild u's self-mask (only u itself holds a share of it), so u's
    vector stays masked."""
    params = _params(8, degree=2, t=2, m_min=2)
    u = 0
    left, right = params.graph[u]
    data = _data(8)
    with pytest.raises(Abort, match="not connected"):
        secure_sum(params, LocalParties(params, _inputs(data, fail=(left, right))), LENGTH)

    class Careless(Server):
        """Skips the connectivity check that would stop it."""

        def collect_masked(self, masked: Any) -> tuple[list[int], list[int]]:
            saved, exposed = secagg.connected, secagg.RoundParams.exposed
            secagg.connected = lambda nodes, graph: True
            secagg.RoundParams.exposed = lambda self, survivors: []  # type: ignore[method-assign]
            try:
                return super().collect_masked(masked)
            finally:
                secagg.connected = saved
                secagg.RoundParams.exposed = exposed  # type: ignore[method-assign]

    def through_collect() -> tuple[Careless, LocalParties, dict[int, Any], list[int], list[int]]:
        server = Careless(params, LENGTH)
        parties = LocalParties(params, _inputs(data, fail=(left, right)))
        keys = server.collect_keys(parties.advertise())
        inbox = server.route_shares(parties.share_keys(keys))
        masked = parties.masked_inputs(inbox, list(server.u2))
        return server, parties, masked, *server.collect_masked(masked)

    # the clients see u without a surviving partner in the public lists and refuse to answer
    server, parties, masked, survivors, dropped = through_collect()
    answers = parties.unmask(survivors, dropped)
    assert answers == {} and parties.failures[u].endswith("surviving mask partners")
    with pytest.raises(Abort, match="0 of 8 clients remain"):
        server.unmask({c: masked[c] for c in survivors}, answers)
    # clients that answered anyway would still not give up u's self-mask: only u holds a share
    server, parties, masked, survivors, dropped = through_collect()
    saved = secagg.RoundParams.exposed
    secagg.RoundParams.exposed = lambda self, survivors: []  # type: ignore[method-assign]
    try:
        answers = parties.unmask(survivors, dropped)
    finally:
        secagg.RoundParams.exposed = saved  # type: ignore[method-assign]
    with pytest.raises(Abort, match=f"client {u}'s self-mask seed has 1 shares"):
        server.unmask({c: masked[c] for c in survivors}, answers)
    assert _still_masked(_strip_what_the_server_can(server, u), data[u])


def test_a_disconnected_survivor_graph_aborts() -> None:
    """A ring of 8 (degree 2) loses two opposite clients: the survivors form two arcs whose sums
    the server would learn separately, so the round aborts."""
    params = _params(8, degree=2, t=2, m_min=2)
    order = _ring_order(params)
    fail = (order[0], order[4])
    with pytest.raises(Abort, match="not connected"):
        secure_sum(params, LocalParties(params, _inputs(_data(8), fail=fail)), LENGTH)


def _ring_order(params: RoundParams) -> list[int]:
    start = params.clients[0]
    order, prev = [start], None
    while len(order) < len(params.clients):
        nxt = next(v for v in params.graph[order[-1]] if v != prev and v not in order)
        prev = order[-1]
        order.append(nxt)
    return order


def test_a_client_never_reveals_both_secrets_or_answers_twice() -> None:
    """A curious server that lists a client as both survivor and dropped, names clients that
    never shared keys, or asks a second time, is refused; an honest request gets one share
    per client whose shares the client holds, of one kind each."""
    params = _params(4, t=2, m_min=2)
    parties = LocalParties(params, _inputs(_data(4)))
    server = Server(params, LENGTH)
    keys = server.collect_keys(parties.advertise())
    inbox = server.route_shares(parties.share_keys(keys))
    parties.masked_inputs(inbox, list(server.u2))
    client = parties.clients[0]
    with pytest.raises(Refused, match="listed as both"):
        client.unmask([0, 1, 2], [2, 3])
    fresh = LocalParties(params, _inputs(_data(4)))
    server = Server(params, LENGTH)
    keys = server.collect_keys(fresh.advertise())
    inbox = server.route_shares(fresh.share_keys(keys))
    fresh.masked_inputs(inbox, list(server.u2))
    with pytest.raises(Refused, match="do not match"):
        fresh.clients[0].unmask([0, 1, 2], [9])
    fresh = LocalParties(params, _inputs(_data(4)))
    server = Server(params, LENGTH)
    keys = server.collect_keys(fresh.advertise())
    inbox = server.route_shares(fresh.share_keys(keys))
    fresh.masked_inputs(inbox, list(server.u2))
    first = fresh.clients[0].unmask([0, 1, 2], [3])
    assert sorted((s.owner, s.kind) for s in first) == [(0, SELF), (1, SELF), (2, SELF), (3, MASK)]
    with pytest.raises(Refused, match="already answered"):
        fresh.clients[0].unmask([0, 1, 2, 3], [])


def test_fewer_than_t_shares_rebuild_nothing() -> None:
    """Shamir: any t shares give the secret; t − 1 give another value (here: with t = 3 of 5,
    every pair of shares combines to something else)."""
    secret = bytes(range(16))
    shares = crypto.split(secret, 3, 5)
    assert crypto.combine(shares[:3]) == secret and crypto.combine(shares[2:]) == secret
    assert all(crypto.combine([a, b]) != secret for a in shares for b in shares if a < b)


def test_a_share_for_another_round_or_pair_is_refused() -> None:
    """Ciphertexts are bound to the round and the pair: a share replayed to another recipient
    does not decrypt (AES-GCM authenticates the pair), and the recipient refuses the request,
    naming the sender, instead of crashing the round."""
    params = _params(3, t=2, m_min=2)
    parties = LocalParties(params, _inputs(_data(3)))
    server = Server(params, LENGTH)
    keys = server.collect_keys(parties.advertise())
    sent = parties.share_keys(keys)
    inbox = server.route_shares(sent)
    inbox[2][0] = sent[0][1]  # client 0's ciphertext for client 1, redirected to client 2
    parties.masked_inputs(inbox, list(server.u2))
    with pytest.raises(Refused, match=r"^client 2: the shares from 0 do not decrypt$"):
        parties.clients[2].unmask([0, 1, 2], [])
    # a ciphertext that authenticates but holds the wrong number of bytes is refused too
    parties = LocalParties(params, _inputs(_data(3)))
    server = Server(params, LENGTH)
    keys = server.collect_keys(parties.advertise())
    inbox = server.route_shares(parties.share_keys(keys))
    channel = parties.clients[2]._channel(0, 2)
    key = crypto.agree(parties.clients[0]._enc, keys[2].enc, channel)
    inbox[2][0] = crypto.seal(key, b"too short", channel)
    parties.masked_inputs(inbox, list(server.u2))
    with pytest.raises(Refused, match=r"^client 2: the shares from 0 have the wrong length$"):
        parties.clients[2].unmask([0, 1, 2], [])


def test_thresholds_are_checked() -> None:
    g = {0: (1,), 1: (0,)}
    with pytest.raises(ValueError, match="at least 2"):
        RoundParams(0, g, 1, 2)
    with pytest.raises(ValueError, match="exceeds the smallest holder set"):
        RoundParams(0, g, 3, 2)
    with pytest.raises(ValueError, match="not symmetric"):
        RoundParams(0, {0: (1,), 1: ()}, 2, 2)
    assert topology.threshold_count(2 / 3, 9) == 6 and topology.threshold_count(5, 9) == 5
    assert topology.threshold_count(0.1, 3) == 2


def test_a_share_answer_carries_one_kind() -> None:
    assert Share(0, SELF, 1, b"x" * 16).kind != Share(0, MASK, 1, b"x" * 16).kind


def _collusion_attack(params: RoundParams, u: int, colluders: list[int], dropped: list[int]) -> Any:
    """The server's view of a round in which ``dropped`` fail after sharing their keys, plus
    what ``colluders`` hand it (their own pair secrets with ``u``): u's vector with every mask
    removed that this coalition can remove (None if the round aborts first)."""
    rng = np.random.default_rng(1)
    xs = {c: rng.integers(0, 2**40, LENGTH, dtype=np.uint64) for c in params.clients}
    parties = LocalParties(params, lambda c: None if c in dropped else xs[c])
    res = secure_sum(params, parties, LENGTH)
    server = res.server

    def rebuild(owner: int, kind: str) -> bytes:
        got = {
            s.index: s.value
            for stage, _, msg in server.received
            if stage == "answers"
            for s in msg
            if s.owner == owner and s.kind == kind
        }
        return crypto.combine(sorted(got.items())[: params.threshold])

    y = next(m for stage, c, m in server.received if stage == "masked" and c == u).copy()
    with np.errstate(over="ignore"):
        y -= crypto.prg(rebuild(u, SELF), LENGTH)
        for v in dropped:  # rebuilt from the survivors' answers
            key = crypto.agree(
                crypto.mask_key(rebuild(v, MASK)), server.keys[u].mask, crypto.pair_info(0, u, v)
            )
            y = y - crypto.prg(key, LENGTH) if u < v else y + crypto.prg(key, LENGTH)
        for v in colluders:  # handed over by the colluding partner
            mine = parties.clients[v]
            key = crypto.agree(mine._mask, mine._keys[u].mask, crypto.pair_info(0, u, v))
            y = y - crypto.prg(key, LENGTH) if u < v else y + crypto.prg(key, LENGTH)
    return np.array_equal(y, xs[u])


@pytest.mark.parametrize(("clients", "degree"), [(3, 0), (9, 2), (12, 4), (16, 6)])
def test_attack_t_minus_1_colluding_partners_and_dropouts_never_unmask_a_client(
    clients: int, degree: int
) -> None:
    """The threat model's coalition: the server and t − 1 of client u's mask partners, while
    u's other partners drop out after sharing their keys. The server rebuilds u's self-mask (u
    survived) and the dropped partners' mask keys; the colluders give it their pair secrets
    with u: every mask on u's vector comes off. fedlore's rounds (t − 1 colluders withstood)
    abort instead: u keeps only t − 1 surviving partners. With that rule switched off on every
    party, the same attack recovers u's upload exactly, so it is the rule that stops it."""
    privacy = Privacy(True, None, True, clients, clients, 0, SEED, mask_degree=degree)
    params = privacy.round_params(0, list(range(clients)))
    t, u = params.threshold, 0
    assert params.colluders == t - 1
    partners = list(params.graph[u])
    colluders, dropped = partners[: t - 1], partners[t - 1 :]
    assert dropped and len(params.clients) - len(dropped) >= params.min_survivors
    with pytest.raises(Abort) as aborted:
        _collusion_attack(params, u, colluders, dropped)
    exposed = aborted.value.reason.split("]")[0].removeprefix("survivors [").split(", ")
    assert str(u) in exposed
    assert str(aborted.value) == (
        f"secure aggregation aborted in the collect masked vectors stage: survivors "
        f"[{', '.join(exposed)}] keep at most {t - 1} surviving mask partners, so {t - 1} "
        "colluding clients (the most the round withstands) could unmask them alone"
    )
    saved = secagg.RoundParams.exposed
    secagg.RoundParams.exposed = lambda self, survivors: []  # type: ignore[method-assign]
    try:
        assert _collusion_attack(params, u, colluders, dropped)
    finally:
        secagg.RoundParams.exposed = saved  # type: ignore[method-assign]


def test_a_round_needs_two_mask_partners_per_client_and_caps_t_at_them() -> None:
    """Two clients per round (one partner each) are refused: that partner alone could unmask
    the other. A threshold of every holder is capped at the partners (t ≤ k), so t − 1
    colluders never make up all of a client's partners."""
    with pytest.raises(
        ValueError,
        match=r"^a client of this round has 1 mask partner\(s\): secure aggregation needs at "
        r"least 2 \(3 or more clients per round, secure_aggregation_degree 0 or at least 2\), "
        r"or its one partner alone could unmask it$",
    ):
        Privacy(True, None, True, 2, 2, 0, SEED).round_params(0, [0, 1])
    # the default 2/3 of a client's holders (partners and itself): 10 clients, t = ceil(20/3)
    ten = Privacy(True, None, True, 10, 10, 0, SEED).round_params(0, list(range(10)))
    assert (ten.threshold, ten.colluders, ten.min_survivors) == (7, 6, 7)
    every = Privacy(True, None, True, 6, 6, 0, SEED, threshold=1.0).round_params(0, list(range(6)))
    assert every.threshold == 5 and every.colluders == 4
    ring = Privacy(True, None, True, 9, 9, 0, SEED, mask_degree=4, threshold=1.0)
    assert ring.round_params(0, list(range(9))).threshold == 4
    with pytest.raises(ValueError, match=r"colluders must be in \[0, t − 1 = 1\], got 2"):
        RoundParams(0, {0: (1, 2), 1: (0, 2), 2: (0, 1)}, 2, 2, colluders=2)
