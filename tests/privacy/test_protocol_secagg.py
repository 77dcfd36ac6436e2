"""The in-process secure aggregation protocol (fedlore.privacy.secagg) message by message.

test_secure_aggregation.py tries the attacks of issue 28; this file pins what users and the
engine read off a round: the exact sum of uniform ring elements (also in a setup exchange, whose
round number is negative), which stage aborts and why (the engine logs ``Abort``'s message and
``LocalParties.failures``; ``Server.rejected`` becomes the reply's reason), the bytes each way
(reported as ``bytes_up`` / ``bytes_down``), the server's recorded view, and how clients and the
server cope with lost messages and with a curious server's requests.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import numpy as np
import pytest

from fedlore.privacy import crypto, topology
from fedlore.privacy.parties import LocalParties, secure_sum
from fedlore.privacy.secagg import (
    SELF,
    Abort,
    PublicKeys,
    Refused,
    RoundParams,
    Server,
)

LENGTH = 16
PUBLIC_KEYS = 2 * 32
"""A client's stage-0 message: two raw X25519 public keys."""
CIPHERTEXT = 12 + (8 + 8 + 8 + 4) + 2 * crypto.SECRET_BYTES + 16
"""One encrypted pair of shares: nonce, header (round, sender, recipient, index), the two
16-byte shares, AES-GCM tag."""
ANSWER = 8 + crypto.SECRET_BYTES
"""One revealed share: an 8-byte id and the 16-byte share."""

LOST = "lost connection after sharing its keys"


def _params(clients: int, degree: int = 0, t: int = 2, m_min: int = 2, rnd: int = 7) -> RoundParams:
    graph = topology.neighbours(list(range(clients)), degree, seed=3)
    return RoundParams(rnd, {c: tuple(v) for c, v in graph.items()}, t, m_min)


def _kite(t: int) -> RoundParams:
    """Five clients: 1-4 all mask with each other, client 0 only with 1 and 2 (so its secrets
    have three holders, the others' five)."""
    graph = {0: (1, 2), 1: (0, 2, 3, 4), 2: (0, 1, 3, 4), 3: (1, 2, 4), 4: (1, 2, 3)}
    return RoundParams(7, graph, t, 2)


def _vectors(clients: list[int], seed: int = 0) -> dict[int, np.ndarray]:
    """Uniform ring elements: a wrong mask anywhere shows in every entry of the sum."""
    rng = np.random.default_rng(seed)
    return {c: rng.integers(0, 2**64, size=LENGTH, dtype=np.uint64) for c in clients}


def _ring_sum(vectors: dict[int, np.ndarray], who: list[int]) -> np.ndarray:
    total = np.zeros(LENGTH, dtype=np.uint64)
    for c in who:
        total += vectors[c]  # uint64 arrays wrap around silently: the sum mod 2^64
    return total


class _Network(LocalParties):
    """The clients of a round behind a lossy network: the public keys of ``lost_keys``, the
    shares of ``lost_shares`` and the answers of ``silent`` never reach the server; the clients
    in ``fail`` raise before masking, those in ``empty`` have no input."""

    def __init__(
        self,
        params: RoundParams,
        vectors: dict[int, np.ndarray],
        fail: tuple[int, ...] = (),
        empty: tuple[int, ...] = (),
        lost_keys: tuple[int, ...] = (),
        lost_shares: tuple[int, ...] = (),
        silent: tuple[int, ...] = (),
    ) -> None:
        def inputs(c: int) -> np.ndarray | None:
            if c in fail:
                raise RuntimeError(LOST)
            return None if c in empty else vectors[c]

        super().__init__(params, inputs)
        self.lost_keys, self.lost_shares, self.silent = lost_keys, lost_shares, silent

    def advertise(self) -> dict[int, PublicKeys]:
        return {c: k for c, k in super().advertise().items() if c not in self.lost_keys}

    def share_keys(self, keys: dict[int, PublicKeys]) -> dict[int, dict[int, bytes]]:
        sent = super().share_keys(keys)
        return {c: cts for c, cts in sent.items() if c not in self.lost_shares}

    def unmask(self, survivors: list[int], dropped: list[int]) -> dict[int, list[Any]]:
        answers = super().unmask(survivors, dropped)
        return {c: a for c, a in answers.items() if c not in self.silent}


def _abort(stage: str, reason: str) -> str:
    return "^" + re.escape(f"secure aggregation aborted in the {stage} stage: {reason}") + "$"


def _exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


# ------------------------------------------------------------------------------ exact sums


@pytest.mark.parametrize("rnd", [7, -1])
def test_the_sum_is_exact_in_a_setup_exchange_too(rnd: int) -> None:
    """Uniform ring elements of 5 clients, one failing after it shared its keys: the result is
    their sum mod 2^64 in every entry, in round 7 and in a setup exchange (round -1: FedLore's
    setup rounds are numbered below 0, and their shares' headers carry the round signed)."""
    params = _params(5, rnd=rnd, t=3, m_min=3)
    x = _vectors(params.clients)
    parties = _Network(params, x, fail=(3,))
    res = secure_sum(params, parties, LENGTH)
    assert (res.survivors, res.dropped) == ([0, 1, 2, 4], [3])
    assert res.total.dtype == np.uint64
    assert np.array_equal(res.total, _ring_sum(x, [0, 1, 2, 4]))
    assert parties.failures == {3: f"RuntimeError: {LOST}"}


@pytest.mark.parametrize("lost", [0, 2])
def test_a_client_whose_keys_were_lost_is_left_out_and_the_others_sum(lost: int) -> None:
    """Client ``lost``'s public keys never reach the server (the first client, or one in the
    middle of the others' partner lists): it is not in U2 (neither survivor nor dropped), no one
    masks with it, and the other three still share, mask with each other and sum exactly."""
    params = _params(4)
    x = _vectors(params.clients)
    others = [c for c in params.clients if c != lost]
    res = secure_sum(params, _Network(params, x, lost_keys=(lost,)), LENGTH)
    assert res.server.u2 == others
    assert (res.survivors, res.dropped) == (others, [])
    assert np.array_equal(res.total, _ring_sum(x, others))


def test_a_threshold_of_every_holder_completes_when_no_one_drops() -> None:
    """t = 4 of 4 holders: each client has exactly t live holders, shares its secrets, and the
    round sums exactly (every share is needed, none is missing)."""
    params = _params(4, t=4, m_min=4)
    x = _vectors(params.clients)
    parties = _Network(params, x)
    res = secure_sum(params, parties, LENGTH)
    assert parties.failures == {}
    assert np.array_equal(res.total, _ring_sum(x, [0, 1, 2, 3]))


def test_a_client_without_input_is_recorded_and_the_others_sum() -> None:
    """Client 0 (the first asked) has nothing to upload: it counts as dropped with the reason
    "no input", and the clients after it still upload; the sum is theirs."""
    params = _params(4)
    x = _vectors(params.clients)
    parties = _Network(params, x, empty=(0,))
    res = secure_sum(params, parties, LENGTH)
    assert (res.survivors, res.dropped) == ([1, 2, 3], [0])
    assert parties.failures == {0: "no input"}
    assert np.array_equal(res.total, _ring_sum(x, [1, 2, 3]))


# ------------------------------------------------------------------------------ aborts


def test_a_round_without_clients_aborts_at_once() -> None:
    """An empty mask graph is a valid (if useless) round: it aborts in the first stage, with the
    reason, before any client is asked anything."""
    params = RoundParams(7, {}, 2, 2)
    with pytest.raises(Abort, match=_abort("advertise keys", "0 of 0 clients remain, 2 needed")):
        secure_sum(params, _Network(params, {}), LENGTH)


def test_round_parameters_are_checked_with_the_reason() -> None:
    """A partner missing from the graph, a self-loop, a one-sided edge, fewer than 2 survivors:
    each is refused with what is wrong."""
    asym = _exactly("the mask graph is not symmetric at client 0")
    with pytest.raises(ValueError, match=asym):
        RoundParams(0, {0: (1,)}, 2, 2)  # client 1 is no client of the round
    with pytest.raises(ValueError, match=asym):
        RoundParams(0, {0: (0, 1), 1: (0,)}, 2, 2)
    with pytest.raises(ValueError, match=_exactly("the mask graph is not symmetric at client 1")):
        RoundParams(0, {0: (), 1: (0,)}, 2, 2)
    with pytest.raises(ValueError, match=_exactly("at least 2 survivors are needed, got 1")):
        RoundParams(0, {0: (1,), 1: (0,)}, 2, 1)
    with pytest.raises(ValueError, match=_exactly("the share threshold must be at least 2, got 1")):
        RoundParams(0, {0: (1,), 1: (0,)}, 1, 2)


def test_too_few_public_keys_abort_the_advertise_stage() -> None:
    """Two of three clients' keys are lost: 1 client left, 2 needed."""
    params = _params(3)
    with pytest.raises(Abort, match=_abort("advertise keys", "1 of 3 clients remain, 2 needed")):
        secure_sum(params, _Network(params, _vectors([0, 1, 2]), lost_keys=(0, 1)), LENGTH)


def test_clients_refuse_to_share_with_too_few_holders_and_the_round_aborts() -> None:
    """t = 3 of 3 and client 2's keys are lost: clients 0 and 1 each have 2 live share holders,
    refuse to share (their secrets could not be rebuilt), and say so; with no one left the round
    aborts in the share-keys stage, and the exception names its stage and reason."""
    params = _params(3, t=3)
    parties = _Network(params, _vectors([0, 1, 2]), lost_keys=(2,))
    with pytest.raises(Abort, match=_abort("share keys", "0 of 3 clients remain, 2 needed")) as e:
        secure_sum(params, parties, LENGTH)
    assert (e.value.stage, e.value.reason) == ("share keys", "0 of 3 clients remain, 2 needed")
    assert parties.failures == {
        0: "client 0: 2 live share holders, 3 needed",
        1: "client 1: 2 live share holders, 3 needed",
    }


def test_one_survivor_aborts_the_collect_stage_with_the_failures_recorded() -> None:
    """Clients 0 and 2 of 3 fail before masking: 1 survivor, 2 needed; each failure keeps the
    exception's type and message (the engine logs them)."""
    params = _params(3)
    parties = _Network(params, _vectors([0, 1, 2]), fail=(0, 2))
    stage, reason = "collect masked vectors", "1 of 3 clients remain, 2 needed"
    with pytest.raises(Abort, match=_abort(stage, reason)) as e:
        secure_sum(params, parties, LENGTH)
    assert (e.value.stage, e.value.reason) == (stage, reason)
    assert parties.failures == {0: f"RuntimeError: {LOST}", 2: f"RuntimeError: {LOST}"}


def test_a_client_cut_off_while_sharing_aborts_as_disconnected() -> None:
    """Degree-2 ring: both neighbours of client u lose their shares on the way, so u receives
    no ciphertext at all (an empty inbox), still uploads, and stands alone among the survivors:
    the round aborts with the reason, before anything is unmasked."""
    params = _params(8, degree=2)
    u = 0
    left, right = params.graph[u]
    parties = _Network(params, _vectors(params.clients), lost_shares=(left, right))
    reason = (
        "the survivors' mask graph is not connected, so unmasking would reveal the sums of its "
        "parts (a client with no surviving mask partner stands alone)"
    )
    with pytest.raises(Abort, match=_abort("collect masked vectors", reason)) as e:
        secure_sum(params, parties, LENGTH)
    assert (e.value.stage, e.value.reason) == ("collect masked vectors", reason)


def test_survivors_going_silent_abort_the_unmask_stage() -> None:
    """m_min = 3 of 4; two survivors never answer the unmasking request: 2 answers, 3 needed."""
    params = _params(4, t=2, m_min=3)
    parties = _Network(params, _vectors(params.clients), silent=(0, 1))
    with pytest.raises(Abort, match=_abort("unmask", "2 of 4 clients remain, 3 needed")) as e:
        secure_sum(params, parties, LENGTH)
    assert (e.value.stage, e.value.reason) == ("unmask", "2 of 4 clients remain, 3 needed")


def test_a_self_mask_with_too_few_shares_aborts() -> None:
    """t = 4 of 5; three survivors go silent: client 0's self-mask seed has only the 2 shares of
    the answering clients."""
    params = _params(5, t=4)
    parties = _Network(params, _vectors(params.clients), silent=(0, 1, 2))
    reason = "client 0's self-mask seed has 2 shares from live holders, 4 needed"
    with pytest.raises(Abort, match=_abort("unmask", reason)):
        secure_sum(params, parties, LENGTH)


@pytest.mark.parametrize(("t", "silent", "got"), [(3, (), 2), (2, (1, 2), 0)])
def test_a_dropped_clients_mask_key_with_too_few_shares_aborts(
    t: int, silent: tuple[int, ...], got: int
) -> None:
    """Client 0 masks only with 1 and 2 and fails before masking; the survivors' self-masks can
    all be rebuilt, but 0's mask-key seed cannot: with t = 3 its two partners' shares are too
    few, and when both partners go silent there is no share of it at all (the server says so
    rather than failing)."""
    params = _kite(t)
    parties = _Network(params, _vectors(params.clients), fail=(0,), silent=silent)
    reason = f"client 0's mask-key seed has {got} shares from live holders, {t} needed"
    with pytest.raises(Abort, match=_abort("unmask", reason)):
        secure_sum(params, parties, LENGTH)


# ------------------------------------------------------------------------------ the server


def test_bytes_each_way_are_counted_exactly() -> None:
    """4 clients on the complete graph; client 3 fails after sharing its keys, client 2's
    masked vector arrives one entry short (counted, then rejected). Up: 4 key pairs, 4 × 3
    ciphertexts, the three vectors that arrived, and from each of the 2 survivors one share for
    each of the 4 clients. Down: everyone's keys with 8-byte ids to each of the 4, the 12
    ciphertexts, U2 to each of its 4 clients, both lists (4 ids) to each of the 2 survivors."""

    class Short(_Network):
        def masked_inputs(self, inbox: Any, u2: list[int]) -> dict[int, Any]:
            out = super().masked_inputs(inbox, u2)
            out[2] = out[2][:-1]
            return out

    params = _params(4)
    x = _vectors(params.clients)
    res = secure_sum(params, Short(params, x, fail=(3,)), LENGTH)
    assert (res.survivors, res.dropped) == ([0, 1], [2, 3])
    assert np.array_equal(res.total, _ring_sum(x, [0, 1]))
    up = 4 * PUBLIC_KEYS + 4 * 3 * CIPHERTEXT + (2 * LENGTH + LENGTH - 1) * 8 + 2 * 4 * ANSWER
    down = 4 * 4 * (PUBLIC_KEYS + 8) + 4 * 3 * CIPHERTEXT + 8 * 4 * 4 + 8 * 4 * 2
    assert (res.server.bytes_up, res.server.bytes_down) == (up, down) == (1880, 2400)


def test_the_server_view_records_every_message_by_stage() -> None:
    """:attr:`Server.received` holds, in order, each client's keys, shares, masked vector and
    answer, tagged with the stage: the whole view the attack tests search."""
    params = _params(3)
    res = secure_sum(params, _Network(params, _vectors(params.clients)), LENGTH)
    view = [(stage, c) for stage, c, _ in res.server.received]
    stages = ("keys", "shares", "masked", "answers")
    assert view == [(stage, c) for stage in stages for c in (0, 1, 2)]
    kinds: dict[str, set[str]] = {stage: set() for stage in stages}
    for stage, _, message in res.server.received:
        kinds[stage].add(type(message).__name__)
    assert kinds == {
        "keys": {"PublicKeys"},
        "shares": {"dict"},
        "masked": {"ndarray"},
        "answers": {"list"},
    }


def test_malformed_uploads_are_rejected_with_the_reason() -> None:
    """Six clients on the complete graph; one whose keys were lost uploads anyway, and three
    upload a vector of the wrong dtype (float64, right shape), the wrong shape, or no array at
    all: each is rejected with its reason (the reply's reason in the engine's report), the
    three from U2 count as dropped, and the other two sum exactly."""
    bad = {2: np.zeros(LENGTH, dtype=np.float64), 3: np.zeros(LENGTH - 1, np.uint64), 4: [0] * 16}

    class Malformed(_Network):
        def masked_inputs(self, inbox: Any, u2: list[int]) -> dict[int, Any]:
            out = super().masked_inputs(inbox, u2)
            out.update(bad)
            out[5] = np.zeros(LENGTH, np.uint64)  # client 5's keys were lost
            return out

    params = _params(6)
    x = _vectors(params.clients)
    res = secure_sum(params, Malformed(params, x, lost_keys=(5,)), LENGTH)
    assert res.server.rejected == {
        2: "a masked vector must be uint64 (16,), got (16,)",
        3: "a masked vector must be uint64 (16,), got (15,)",
        4: "a masked vector must be uint64 (16,), got None",
        5: "it did not share its keys",
    }
    assert (res.survivors, res.dropped) == ([0, 1], [2, 3, 4])
    assert np.array_equal(res.total, _ring_sum(x, [0, 1]))


# ------------------------------------------------------------------------------ the clients


def _through_masking(params: RoundParams, parties: LocalParties) -> Server:
    server = Server(params, LENGTH)
    keys = server.collect_keys(parties.advertise())
    inbox = server.route_shares(parties.share_keys(keys))
    parties.masked_inputs(inbox, list(server.u2))
    return server


def test_a_client_masks_only_when_listed_in_u2_and_asked_in_order() -> None:
    """A client asked to mask before it learnt U2, or named outside U2, refuses; one asked to
    unmask before it learnt U2 refuses too; and a client the server's key list leaves out
    refuses to share its secrets."""
    params = _params(3)
    parties = _Network(params, _vectors(params.clients))
    client = parties.clients[0]
    enc = np.zeros(LENGTH, np.uint64)
    refusal = _exactly("client 0 is not among the clients that shared their keys")
    with pytest.raises(Refused, match=refusal):
        client.masked_input(enc)
    lists = _exactly("client 0: the lists do not match the round's clients")
    with pytest.raises(Refused, match=lists):
        client.unmask([0, 1, 2], [])
    keys = {c: cl.advertise() for c, cl in parties.clients.items()}
    client.share_keys(keys)
    client.receive({}, [1, 2])
    with pytest.raises(Refused, match=refusal):
        client.masked_input(enc)
    own = _exactly("client 1: its own keys are not among the round's keys")
    with pytest.raises(Refused, match=own):  # its own keys are not in the list it was sent
        parties.clients[1].share_keys({0: keys[0], 2: keys[2]})


def test_a_client_refuses_to_mask_when_u2_names_a_partner_it_has_no_keys_for() -> None:
    """A server that sends client 0 the keys of 0 and 1 only, then lists 2 in U2: client 0
    cannot agree on a pair mask with 2 (masking without it would leave a mask the server
    cannot remove) and refuses, naming the partner, instead of crashing the round."""
    params = _params(3)
    parties = _Network(params, _vectors(params.clients))
    keys = {c: cl.advertise() for c, cl in parties.clients.items()}
    client = parties.clients[0]
    client.share_keys({0: keys[0], 1: keys[1]})
    client.receive({}, [0, 1, 2])
    with pytest.raises(Refused, match=_exactly("client 0: U2 names partners [2] without keys")):
        client.masked_input(np.zeros(LENGTH, np.uint64))
    # the in-process parties record each such refusal as the client's reason for dropping out
    # (clients 1 and 2 never received keys at all) and upload nothing for it
    assert parties.params is params and parties.masked_inputs({}, [0, 1, 2]) == {}
    assert parties.failures == {
        c: f"client {c}: U2 names partners {unknown} without keys"
        for c, unknown in ((0, [2]), (1, [0, 2]), (2, [0, 1]))
    }


def test_masking_returns_a_new_uint64_vector_and_leaves_the_input_alone() -> None:
    """The masked vector is a fresh uint64 array of the input's length; the client's encoded
    vector (uint64 already, or int64 as a signed encoding) is not modified in place."""
    params = _params(3)
    parties = _Network(params, _vectors(params.clients))
    _through_masking(params, parties)
    for enc in (np.arange(LENGTH, dtype=np.uint64), np.arange(-8, 8, dtype=np.int64)):
        before = enc.copy()
        y = parties.clients[0].masked_input(enc)
        assert y.dtype == np.uint64 and y.shape == (LENGTH,)
        assert np.array_equal(enc, before) and enc.dtype == before.dtype


def test_refusals_name_the_overlap_and_are_recorded() -> None:
    """A curious server lists client 2 as survivor and dropped: each client refuses, naming only
    the overlap, and the parties record the refusal; asked again, every client refuses as
    already answered."""
    params = _params(4)
    parties = _Network(params, _vectors(params.clients))
    _through_masking(params, parties)
    with pytest.raises(Refused, match=_exactly("client 0: clients [2] listed as both")):
        parties.clients[0].unmask([0, 1, 2], [2, 3])
    assert parties.unmask([1, 2, 3], [2]) == {}
    assert parties.failures == {
        1: "client 1: clients [2] listed as both",
        2: "client 2: clients [2] listed as both",
        3: "client 3: clients [2] listed as both",
    }


def test_a_second_request_is_refused_and_recorded() -> None:
    """After an honest unmasking request, a second one gets no answer from anyone, and each
    client's refusal is recorded with its reason."""
    params = _params(3)
    parties = _Network(params, _vectors(params.clients))
    _through_masking(params, parties)
    first = parties.unmask([0, 1, 2], [])
    assert {c: sorted((s.owner, s.kind) for s in a) for c, a in first.items()} == {
        c: [(0, SELF), (1, SELF), (2, SELF)] for c in (0, 1, 2)
    }
    assert parties.unmask([0, 1, 2], []) == {}
    assert parties.failures == {
        c: f"client {c} already answered this round's unmasking request" for c in (0, 1, 2)
    }


def test_a_client_that_failed_stays_silent_when_a_server_asks_it_anyway() -> None:
    """Client 0 failed before masking; a curious server names it a survivor all the same. It
    does not answer, and the clients after it answer as usual (0's self-mask share each)."""
    params = _params(4)
    parties = _Network(params, _vectors(params.clients), fail=(0,))
    _through_masking(params, parties)
    answers = parties.unmask([0, 1, 2, 3], [])
    assert sorted(answers) == [1, 2, 3]
    assert all((0, SELF) in {(s.owner, s.kind) for s in a} for a in answers.values())


def test_a_client_that_refused_to_share_stays_silent_when_listed_in_u2() -> None:
    """Client 0 (partners 1 and 2, t = 3) loses client 1's keys and refuses to share; a curious
    server lists it in U2 anyway. It uploads nothing, and the clients after it upload."""
    params = _kite(3)
    parties = _Network(params, _vectors(params.clients), lost_keys=(1,))
    server = Server(params, LENGTH)
    keys = server.collect_keys(parties.advertise())
    inbox = server.route_shares(parties.share_keys(keys))
    assert server.u2 == [2, 3, 4]
    assert parties.failures == {0: "client 0: 2 live share holders, 3 needed"}
    uploads = parties.masked_inputs(inbox, [0, 2, 3, 4])
    assert sorted(uploads) == [2, 3, 4]


def test_a_share_whose_header_names_another_round_is_refused() -> None:
    """A faulty client 0 seals, under the right key and channel, a share whose header names
    round 8: client 2 refuses to answer, naming the sender."""
    params = _params(3)
    parties = _Network(params, _vectors(params.clients))
    server = Server(params, LENGTH)
    keys = server.collect_keys(parties.advertise())
    sent = parties.share_keys(keys)
    sender = parties.clients[0]
    channel = sender._channel(0, 2)
    key = crypto.agree(sender._enc, keys[2].enc, channel)
    _, ms, ss = sender._held[0]
    body = struct.pack(">qqqi", 8, 0, 2, 3) + ms + ss
    sent[0] = {**sent[0], 2: crypto.seal(key, body, channel)}
    inbox = server.route_shares(sent)
    parties.masked_inputs(inbox, list(server.u2))
    refusal = "client 2: a share from 0 names another round or pair"
    with pytest.raises(Refused, match=_exactly(refusal)):
        parties.clients[2].unmask([0, 1, 2], [])
