"""Where the privacy layer's randomness comes from: the operating system, never the run seed.

Every draw that protects privacy (the DP noise the server adds, the clients' noise shares, the
client sample of a DP run, the keys and self-mask seeds of secure aggregation) comes from
:class:`SecureSource`: each call keys a fresh AES-256 counter-mode stream (the ``cryptography``
package, OpenSSL underneath) with 32 bytes of OS entropy (:func:`os.urandom`, the kernel's
CSPRNG), so no seed, file or log of the run determines it and two draws are independent.

Gaussian noise is built from that stream in float64 by the Box-Muller transform, and, as
Opacus's ``secure_mode`` does, as the sum of four such draws divided by two (std unchanged):
Holohan & Braghin, "Secure Random Sampling in Differential Privacy" (ESORICS 2021), show that a
single floating-point Gaussian sample leaks through the gaps of its output grid, and that
combining several draws closes them (their Section 5; Opacus ``_generate_noise``).

:class:`SeededSource` (``dp.reproducible_noise: true``) draws the same quantities from
``(run seed, purpose, round, client)`` instead, so a run can be replayed bit for bit while
debugging. Anyone who knows the seed (it names the run folder) can then regenerate the noise and
subtract it: such a run has **no privacy**, and says so at start, in its summary and its report
row.
"""

from __future__ import annotations

import math
import os
import secrets
from typing import Protocol

import numpy as np
import torch

from fedlore.seeding import DP_NOISE, SAMPLING, derive_seed, generator

GAUSSIAN_DRAWS = 4
"""Draws of N(0, std²) summed per noise entry; the sum is divided by sqrt(4) = 2 (Opacus)."""
SERVER, SERVER_COUNT = -1, -2
"""The ``client`` argument of the server's draws: the noise on the sum, the noise on adaptive
clipping's count (only :class:`SeededSource` reads it: it names the stream)."""


def count_stream(client: int) -> int:
    """The ``client`` argument of a client's noise share on adaptive clipping's count (a stream
    apart from its share on the upload and from the server's)."""
    return -3 - client


class NoiseSource(Protocol):
    """The privacy layer's random draws (secure by default; see the module docstring)."""

    secure: bool
    """False for a seeded (reproducible, not private) source."""

    def gaussian(self, n: int, std: float, rnd: int, client: int) -> torch.Tensor:
        """``n`` entries of N(0, std²), float64 on the CPU, for ``client`` (-1: the server)
        in round ``rnd``."""
        ...

    def sample(self, num_clients: int, per_round: int, rnd: int) -> list[int]:
        """The sorted ids of ``per_round`` of ``num_clients`` clients drawn uniformly without
        replacement (all of them when ``per_round >= num_clients``)."""
        ...


def random_bytes(n: int) -> bytes:
    """``n`` bytes of an AES-256-CTR keystream keyed by 32 bytes of OS entropy (a fresh key and
    counter block per call)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    if n <= 0:
        return b""
    cipher = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16)))
    return cipher.encryptor().update(bytes(n))


def uniform_open(words: np.ndarray) -> np.ndarray:
    """Uniform float64 values in the open interval (0, 1) from uint64 words: the top 52 bits
    ``k`` of each word give ``(k + 1/2) / 2^52``, the midpoints of 2^52 equal cells, all exact
    in float64 (53 bits would round the last midpoint to 1). Never 0, so ``log`` is finite."""
    k = (words >> np.uint64(12)).astype(np.float64)
    return (k + 0.5) * 2.0**-52


def box_muller(u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    """Two independent standard normal values from each pair of uniform (0, 1) values:
    ``sqrt(-2 ln u1) · cos(2π u2)`` and ``sqrt(-2 ln u1) · sin(2π u2)`` (Box & Muller 1958),
    the cosines first, then the sines."""
    r = np.sqrt(-2.0 * np.log(u1))
    theta = 2.0 * math.pi * u2
    return np.concatenate([r * np.cos(theta), r * np.sin(theta)])


def gaussian_from_words(words: np.ndarray, n: int, std: float) -> torch.Tensor:
    """``n`` entries of N(0, std²) from ``GAUSSIAN_DRAWS · n`` uint64 words (n even; one word
    more for odd n): ``GAUSSIAN_DRAWS · n`` standard normals from Box-Muller, in
    ``GAUSSIAN_DRAWS`` rows of n, summed per entry and divided by ``sqrt(GAUSSIAN_DRAWS)`` (by 2
    for four draws: Holohan & Braghin 2021; Opacus ``secure_mode``)."""
    pairs = (GAUSSIAN_DRAWS * n + 1) // 2
    if words.size != 2 * pairs:
        raise ValueError(
            f"need {2 * pairs} random words for {n} Gaussian entries, got {words.size}"
        )
    u = uniform_open(words)
    z = box_muller(u[:pairs], u[pairs:])[: GAUSSIAN_DRAWS * n].reshape(GAUSSIAN_DRAWS, n)
    return torch.from_numpy(z.sum(axis=0) / math.sqrt(GAUSSIAN_DRAWS) * float(std))


def gaussian_words(n: int) -> int:
    """How many uint64 words :func:`gaussian_from_words` needs for ``n`` entries."""
    return 2 * ((GAUSSIAN_DRAWS * n + 1) // 2)


class SecureSource:
    """Draws from OS entropy (see the module docstring): nothing a party of the run knows
    determines them, so no one can regenerate the noise or predict the sample."""

    secure = True

    def gaussian(self, n: int, std: float, rnd: int, client: int) -> torch.Tensor:
        if n <= 0 or std == 0:
            return torch.zeros(max(n, 0), dtype=torch.float64, device="cpu")
        words = np.frombuffer(random_bytes(8 * gaussian_words(n)), dtype=np.uint64)
        return gaussian_from_words(words, n, std)

    def sample(self, num_clients: int, per_round: int, rnd: int) -> list[int]:
        if num_clients < 1 or per_round < 1:
            raise ValueError(f"need num_clients, per_round >= 1, got {num_clients}, {per_round}")
        if per_round >= num_clients:
            return list(range(num_clients))
        return sorted(secrets.SystemRandom().sample(range(num_clients), per_round))


class SeededSource:
    """``dp.reproducible_noise: true``: the same draws from the run seed, for debugging only.

    The noise is ``generator(seed, DP_NOISE, round, client)``'s, the sample
    :func:`fedlore.engine.sampling.sample_clients`'s rule from ``(seed, SAMPLING, round)``: a
    run with this source can be replayed, and its noise regenerated by anyone who knows the seed
    (**no privacy**).
    """

    secure = False

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def gaussian(self, n: int, std: float, rnd: int, client: int) -> torch.Tensor:
        if n <= 0 or std == 0:
            return torch.zeros(max(n, 0), dtype=torch.float64, device="cpu")
        g = generator(self.seed, DP_NOISE, rnd, client)
        return float(std) * torch.randn(n, generator=g, dtype=torch.float64, device="cpu")

    def sample(self, num_clients: int, per_round: int, rnd: int) -> list[int]:
        if num_clients < 1 or per_round < 1:
            raise ValueError(f"need num_clients, per_round >= 1, got {num_clients}, {per_round}")
        if per_round >= num_clients:
            return list(range(num_clients))
        rng = np.random.default_rng(derive_seed(self.seed, SAMPLING, rnd))
        return sorted(int(i) for i in rng.choice(num_clients, size=per_round, replace=False))


def noise_source(reproducible: bool, seed: int) -> NoiseSource:
    """:class:`SeededSource` of ``seed`` when ``reproducible`` (``dp.reproducible_noise``),
    else :class:`SecureSource`."""
    return SeededSource(seed) if reproducible else SecureSource()
