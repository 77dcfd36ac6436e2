"""The cryptographic primitives of in-process secure aggregation, all from maintained libraries:
X25519 key agreement, HKDF-SHA256, AES-256 in counter mode (the mask PRG) and AES-GCM
(``cryptography``, OpenSSL underneath), and Shamir's secret sharing over GF(2^128)
(pycryptodome's, the scheme flwr's SecAgg+ uses). fedlore's core does not import flwr, so it
calls the libraries flwr's ``flwr.common.secure_aggregation`` wraps directly; unlike flwr 1.42's
``pseudo_rand_gen``, the mask PRG is keyed by the whole 256-bit secret.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

KEY_BYTES = 32
SECRET_BYTES = 16
"""Self-mask seeds and mask-key seeds: 128 bits (pycryptodome's Shamir splits 16-byte
secrets)."""


def hkdf(secret: bytes, info: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def prg(key: bytes, length: int) -> np.ndarray:
    """``length`` uniform ring elements (uint64): the AES-256-CTR keystream of ``HKDF(key)``."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    if length <= 0:
        return np.zeros(0, dtype=np.uint64)
    k = hkdf(key, b"fedlore secagg prg")
    stream = Cipher(algorithms.AES(k), modes.CTR(bytes(16))).encryptor().update(bytes(8 * length))
    return np.frombuffer(stream, dtype=np.uint64).copy()


def private_key(raw: bytes) -> Any:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    return X25519PrivateKey.from_private_bytes(raw)


def public_bytes(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(
        key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


def agree(private: Any, public: bytes, info: bytes) -> bytes:
    """The 32-byte key two parties share: HKDF-SHA256 of their X25519 agreement."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    shared = private.exchange(X25519PublicKey.from_public_bytes(public))
    return hkdf(shared, info)


def mask_key(seed: bytes) -> Any:
    """The X25519 private key of a mask-key seed (rebuilt from it when the client drops)."""
    return private_key(hkdf(seed, b"fedlore secagg mask key"))


def pair_info(rnd: int, u: int, v: int) -> bytes:
    """The HKDF context of the pair mask of ``u`` and ``v`` in round ``rnd``."""
    return b"fedlore secagg pair" + struct.pack(">qqq", rnd, min(u, v), max(u, v))


def split(secret: bytes, threshold: int, holders: int) -> list[tuple[int, bytes]]:
    """Shamir's ``threshold``-out-of-``holders`` shares (index 1..holders, 16 bytes each) of a
    16-byte secret (pycryptodome, GF(2^128))."""
    from Crypto.Protocol.SecretSharing import Shamir

    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a shared secret has {SECRET_BYTES} bytes, got {len(secret)}")
    return [(int(i), bytes(s)) for i, s in Shamir.split(threshold, holders, secret, ssss=False)]


def combine(shares: list[tuple[int, bytes]]) -> bytes:
    """The secret of ``threshold`` distinct shares (pycryptodome's Lagrange interpolation)."""
    from Crypto.Protocol.SecretSharing import Shamir

    return bytes(Shamir.combine(shares, ssss=False))


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = os.urandom(12)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key).decrypt(sealed[:12], sealed[12:], aad)
