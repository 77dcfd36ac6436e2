"""Seeds derived from (seed, purpose, round, client): randomness is always an argument.

Every random stream in fedlore comes from :func:`derive_seed` of the run seed plus integers
that name its purpose, so results do not depend on the order in which clients run, and a
resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import numpy as np
import torch

# Purpose tags (any distinct integers).
MODEL_INIT, SERVER_INIT, CLIENT, SAMPLING, BASIS, DIAG = 1, 2, 3, 4, 5, 6
SECAGG, DP_NOISE = 8, 9  # in-process secure aggregation's pair masks; DP noise (fedlore.privacy)


def derive_seed(*parts: int) -> int:
    """A 62-bit seed from integer parts (numpy ``SeedSequence``; negative parts allowed)."""
    entropy = [int(p) % (2**32) for p in parts] + [len(parts)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]) >> 2


def generator(*parts: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``derive_seed(*parts)``."""
    return torch.Generator().manual_seed(derive_seed(*parts))


SKETCH = 7
"""Purpose tag of FedLore-Sketch's test matrices Ω^t: ``derive_seed(base_seed, SKETCH, round)``
per round (the seed that travels), then the matrix's position in the plan."""
