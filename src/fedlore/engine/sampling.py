"""Seeded client sampling: full participation, or uniform without replacement at rate C."""

from __future__ import annotations

import numpy as np

from fedlore.seeding import SAMPLING, derive_seed


def sample_clients(num_clients: int, per_round: int, seed: int, rnd: int) -> list[int]:
    """The sorted client ids of round ``rnd``.

    ``per_round >= num_clients`` means full participation (all ids); otherwise ``per_round``
    ids drawn uniformly without replacement from a generator seeded by (seed, round), so the
    draw does not depend on anything that happened before the round.

    Raises:
        ValueError: if ``num_clients < 1`` or ``per_round < 1``.
    """
    if num_clients < 1 or per_round < 1:
        raise ValueError(f"need num_clients, per_round >= 1, got {num_clients}, {per_round}")
    if per_round >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(derive_seed(seed, SAMPLING, rnd))
    return sorted(int(i) for i in rng.choice(num_clients, size=per_round, replace=False))
