"""The primitives under in-process secure aggregation: key derivation, the mask PRG and Shamir
(fedlore.privacy.crypto), the mask graph and threshold counts (fedlore.privacy.topology).

The key derivation is checked against RFC 5869's definition written out with the standard
library's HMAC, so a context that stops reaching the key (every pair or channel would share one
key) fails; the PRG against its own longer streams and its edge lengths; the SecAgg+ ring
against the degree it promises; thresholds against the documented floor of 2.
"""

from __future__ import annotations

import hashlib
import hmac
import math

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedlore.privacy import crypto, topology
from fedlore.privacy.secagg import Client, RoundParams


def _rfc5869_sha256(ikm: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 with no salt (RFC 5869 §2.2: a string of HashLen zeros), by the book."""
    prk = hmac.new(bytes(32), ikm, hashlib.sha256).digest()
    okm, block, i = b"", b"", 1
    while len(okm) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        okm, i = okm + block, i + 1
    return okm[:length]


def test_hkdf_is_rfc5869_sha256_with_its_context() -> None:
    """``hkdf`` gives RFC 5869's HKDF-SHA256 (no salt, 32 bytes) of the secret and the context,
    so two contexts give unrelated keys."""
    secret = bytes(range(32))
    for info in (b"fedlore secagg pair", b"another context"):
        assert crypto.hkdf(secret, info) == _rfc5869_sha256(secret, info)
    assert crypto.hkdf(secret, b"a") != crypto.hkdf(secret, b"b")


def test_agreed_keys_are_symmetric_and_bound_to_the_pair_and_round() -> None:
    """Both ends of an X25519 agreement derive the same 32-byte key; another context (round,
    pair) gives another key; ``pair_info`` names the pair in either order and a setup round's
    negative number too."""
    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    info = crypto.pair_info(3, 5, 2)
    assert info == crypto.pair_info(3, 2, 5)
    key = crypto.agree(a, crypto.public_bytes(b), info)
    assert len(key) == 32 and key == crypto.agree(b, crypto.public_bytes(a), info)
    assert key != crypto.agree(a, crypto.public_bytes(b), crypto.pair_info(4, 2, 5))
    assert key != crypto.agree(a, crypto.public_bytes(b), crypto.pair_info(3, 2, 6))
    assert crypto.pair_info(-1, 2, 5) != crypto.pair_info(1, 2, 5)
    shared = a.exchange(b.public_key())
    assert key == _rfc5869_sha256(shared, info)


@pytest.mark.parametrize("length", [0, 1, 2, 7])
def test_the_prg_gives_length_uint64_entries_each_a_prefix_of_longer_streams(length: int) -> None:
    """``prg(key, n)`` is n uint64 ring elements, the first n of the same key's longer stream
    (AES-CTR), for every n down to 1 and 0 (an empty uint64 array)."""
    key = bytes(range(32))
    out = crypto.prg(key, length)
    assert out.dtype == np.uint64 and out.shape == (length,)
    assert np.array_equal(out, crypto.prg(key, 9)[:length])
    assert not np.array_equal(crypto.prg(key, 9), crypto.prg(bytes(32), 9))


def test_the_derivations_are_the_documented_ones() -> None:
    """Keys and streams are fixed functions that another implementation of a client can
    rebuild (it must derive the same masks): the PRG is AES-256-CTR (zero counter block) under
    HKDF-SHA256(key, "fedlore secagg prg"); a mask key is the X25519 key whose private bytes
    are HKDF-SHA256(seed, "fedlore secagg mask key"); a pair's context is "fedlore secagg
    pair" followed by (round, smaller id, larger id), a share channel's "fedlore secagg shares"
    followed by (round, sender, recipient), each as big-endian int64."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = bytes(range(32))
    aes = _rfc5869_sha256(key, b"fedlore secagg prg")
    stream = Cipher(algorithms.AES(aes), modes.CTR(bytes(16))).encryptor().update(bytes(40))
    assert np.array_equal(crypto.prg(key, 5), np.frombuffer(stream, dtype=np.uint64))
    seed = bytes(range(16))
    raw = _rfc5869_sha256(seed, b"fedlore secagg mask key")
    want = X25519PrivateKey.from_private_bytes(raw)
    assert crypto.public_bytes(crypto.mask_key(seed)) == crypto.public_bytes(want)
    pair = b"fedlore secagg pair" + (3).to_bytes(8, "big") + (2).to_bytes(8, "big")
    assert crypto.pair_info(3, 5, 2) == pair + (5).to_bytes(8, "big")
    params = RoundParams(4, {0: (1,), 1: (0,)}, 2, 2)
    channel = b"fedlore secagg shares" + b"".join(i.to_bytes(8, "big") for i in (4, 0, 1))
    assert Client(0, params)._channel(0, 1) == channel


def test_shamir_takes_16_byte_secrets_only() -> None:
    """pycryptodome's Shamir works on 128-bit secrets: any other length is refused by name."""
    with pytest.raises(ValueError, match=r"^a shared secret has 16 bytes, got 15$"):
        crypto.split(bytes(15), 2, 3)
    shares = crypto.split(bytes(range(16)), 2, 3)
    assert [i for i, _ in shares] == [1, 2, 3] and all(len(s) == 16 for _, s in shares)


# ------------------------------------------------------------------------------ topology


def _degrees(graph: dict[int, list[int]]) -> set[int]:
    return {len(v) for v in graph.values()}


def test_the_ring_has_the_promised_degree() -> None:
    """8 clients: degree 1 rounds up to the degree-2 ring; 6 gives 6 partners each (not yet the
    complete graph); 7 (= m − 1) and 0 give the complete graph; the relation is symmetric and
    has no self-loops."""
    clients = list(range(8))
    for degree, want in ((1, 2), (2, 2), (4, 4), (6, 6), (7, 7), (9, 7), (0, 7)):
        graph = topology.neighbours(clients, degree, seed=11)
        assert _degrees(graph) == {want}, degree
        assert all(c not in v and all(c in graph[j] for j in v) for c, v in graph.items())
    assert topology.neighbours(clients, 1, seed=11) == topology.neighbours(clients, 2, seed=11)


def test_a_lone_client_has_no_partner_whatever_the_degree() -> None:
    """One sampled client masks with no one (never with itself), on either graph."""
    for degree in (0, 1, 2, 4):
        assert topology.neighbours([5], degree, seed=1) == {5: []}


def test_the_ring_order_is_a_function_of_the_public_seed() -> None:
    """The same seed gives the same ring (every party and a resumed run rebuild it); other
    seeds give other rings."""
    clients = list(range(10))
    ring = topology.neighbours(clients, 2, seed=4)
    assert ring == topology.neighbours(clients, 2, seed=4)
    assert any(topology.neighbours(clients, 2, seed=s) != ring for s in (5, 6, 7))


def test_threshold_counts_floor_at_two_and_read_floats_as_fractions() -> None:
    """An int is a count, never below 2 (a 1-of-n secret would be any holder's); a float up to
    1.0 is a fraction of the holders, rounded up, 1.0 meaning all of them."""
    assert topology.threshold_count(1, 9) == 2 and topology.threshold_count(0, 9) == 2
    assert topology.threshold_count(2, 9) == 2 and topology.threshold_count(9, 9) == 9
    assert topology.threshold_count(1.0, 9) == 9 and topology.threshold_count(0.5, 9) == 5
    for bad in (0.0, -0.5, 1.5, 2.0, math.nan, math.inf):
        refused = rf"^a threshold fraction must be in \(0, 1\], got {bad!r}$"
        with pytest.raises(ValueError, match=refused):
            topology.threshold_count(bad, 9)


def test_connectivity_of_no_one_one_and_two_groups() -> None:
    """No clients are no group (False); one client, or a path, is one group; two groups with
    no edge between them are not."""
    graph = {0: (1,), 1: (0, 2), 2: (1,), 3: (4,), 4: (3,)}
    assert not topology.connected(set(), graph)
    assert topology.connected({3}, graph) and topology.connected({0, 1, 2}, graph)
    assert not topology.connected({0, 2}, graph) and not topology.connected({1, 3, 4}, graph)
