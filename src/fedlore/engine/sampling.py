"""Seeded client sampling: full participation, or uniform without replacement at rate C.

A DP run samples from OS entropy instead (:meth:`fedlore.privacy.Privacy.sample`): privacy
amplification by subsampling assumes nobody can predict the sample.
"""

from __future__ import annotations

from fedlore.privacy.randomness import SeededSource


def sample_clients(num_clients: int, per_round: int, seed: int, rnd: int) -> list[int]:
    """The sorted client ids of round ``rnd``.

    ``per_round >= num_clients`` means full participation (all ids); otherwise ``per_round``
    ids drawn uniformly without replacement from a generator seeded by (seed, round), so the
    draw does not depend on anything that happened before the round.

    Raises:
        ValueError: if ``num_clients < 1`` or ``per_round < 1``.
    """
    return SeededSource(seed).sample(num_clients, per_round, rnd)
