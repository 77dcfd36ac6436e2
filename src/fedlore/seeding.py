"""Every seed derivation in fedlore and the one registry of the purposes they name.

Randomness is always an argument: each random stream is a function of the run seed, an integer
*purpose* from the registry below and, where the stream is per round or per client, those
indices, so results do not depend on the order in which clients run, a resumed run draws exactly
what an uninterrupted one would, and changing one step (e.g. the noise level) leaves the streams
of the others (e.g. the partition) unchanged.

Two families of purposes, one derivation each (the formulas are fixed: every recorded result
depends on them):

* **Run purposes** (the model, the rounds, the transport): :func:`derive_seed` of
  ``(seed, PURPOSE, *indices)`` gives a 62-bit integer seed; :func:`generator` wraps it in a
  ``torch.Generator``.
* **Data purposes** (``DATA_*``: building the federation,
  :func:`fedlore.data.federation.build_federation` and its builders): :func:`data_rng` of
  ``(seed, PURPOSE, *indices)`` gives a numpy ``Generator`` that the step draws from directly (a
  partition, a split, label flips); :func:`data_seed` and :func:`data_generator` are its first
  draw where a step needs an integer seed or a ``torch.Generator`` (input noise, the clients'
  minibatch streams, a site's seed).

Purpose ids are never reused within a family; a new stream gets a new id here.
"""

from __future__ import annotations

import numpy as np
import torch

# Run purposes: derive_seed(seed, PURPOSE, ...).
MODEL_INIT = 1  # the model's initial weights
SERVER_INIT = 2  # the algorithm's initial server state
CLIENT = 3  # a client's update: generator(seed, CLIENT, round, client) (the transports)
SAMPLING = 4  # which clients take part in a round (fedlore.privacy.randomness)
BASIS = 5  # FedLore's seeded bases
DIAG = 6  # the diagnostics' samples (fedlore.diagnostics)
SKETCH = 7
"""FedLore-Sketch's test matrices Ω^t: ``derive_seed(base_seed, SKETCH, round)`` per round (the
seed that travels), then the matrix's position in the plan."""
SECAGG = 8  # in-process secure aggregation's pair masks
DP_NOISE = 9  # DP noise (fedlore.privacy)
ATTACK = 10  # which clients attack, and their noise (fedlore.engine.attack)
DROPOUT = 11  # which sampled clients fail to answer (fedlore.engine.unreliable)
SPEED = 12  # the clients' compute speeds (fedlore.engine.unreliable)
TUNE_SAMPLER = 13
"""``fedlore tune``'s sampler for trial ``n``: ``derive_seed(search_seed, TUNE_SAMPLER, n)``, from
the search seed (``tune.seed``), never a run's seed nor any privacy randomness."""
ASYNC_SAMPLING = 14
"""FedBuff's replacement clients (:mod:`fedlore.engine.buffered`): draw ``n`` of the run,
``derive_seed(seed, ASYNC_SAMPLING, n)``."""

# Data purposes: data_rng(seed, PURPOSE, ...), the steps of building a federation.
DATA_FRACTION = 0  # the kept share |D| of the training set
DATA_PARTITION = 1  # the partition over clients
DATA_SPLIT = 2  # per client: its local train/test split
DATA_NOISE_TRAIN = 3  # input noise on the training pool
DATA_NOISE_TEST = 4  # input noise on the central test set
DATA_FLIP = 5  # per client: its label flips
DATA_SAMPLING = 6  # per client: the seed of its minibatch stream
DATA_SERVER = 7  # the server's unlabeled set U
DATA_SELECTION = 8  # the selection split
DATA_SITE = 9  # per site of a site-local deployment: the seed of its one-client federation


def derive_seed(*parts: int) -> int:
    """A 62-bit seed from integer parts (numpy ``SeedSequence``; negative parts allowed)."""
    entropy = [int(p) % (2**32) for p in parts] + [len(parts)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]) >> 2


def generator(*parts: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``derive_seed(*parts)``."""
    return torch.Generator().manual_seed(derive_seed(*parts))


def data_rng(seed: int, purpose: int, *indices: int) -> np.random.Generator:
    """The numpy stream of one step of building a federation:
    ``np.random.default_rng([seed, purpose, *indices])`` (``indices``: the client, for
    per-client steps)."""
    return np.random.default_rng([seed, purpose, *indices])


def data_seed(seed: int, purpose: int, *indices: int, bound: int) -> int:
    """An integer seed in ``[0, bound)``: the first draw of ``data_rng(seed, purpose,
    *indices)``."""
    return int(data_rng(seed, purpose, *indices).integers(bound))


def data_generator(seed: int, purpose: int) -> torch.Generator:
    """A CPU ``torch.Generator`` for a data step that draws with torch (input noise), seeded
    with ``data_seed(seed, purpose, bound=2**63 - 1)``."""
    return torch.Generator().manual_seed(data_seed(seed, purpose, bound=2**63 - 1))


def client_stream_seeds(seed: int, num_clients: int) -> tuple[int, ...]:
    """The seeds of the clients' minibatch streams, ``data_seed(seed, DATA_SAMPLING, i,
    bound=2**62)`` for client ``i`` (see :func:`fedlore.data.client_data.stream_batches`)."""
    return tuple(data_seed(seed, DATA_SAMPLING, i, bound=2**62) for i in range(num_clients))
