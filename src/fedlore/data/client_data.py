"""Per-client data: what ``Algorithm.client_update`` receives, and the federation that makes it.

A :class:`Federation` holds the full source tensors once plus one index array per client; a
client's :class:`ClientData` is materialized only when that client is sampled.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TensorSplit:
    """Inputs and labels of one split.

    Attributes:
        x: float tensor ``[B, ...]`` (images ``[B, C, H, W]`` in [0, 1]; token ids ``[B, L]``).
        y: long tensor ``[B]`` of class indices (or ``[B, L]`` targets for language models).
    """

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def subset(self, idx: np.ndarray | torch.Tensor) -> TensorSplit:
        """The rows at ``idx`` (a copy)."""
        t = torch.as_tensor(np.asarray(idx), dtype=torch.long)
        return TensorSplit(self.x[t], self.y[t])


@dataclass(frozen=True)
class ClientData:
    """One client's local data.

    Attributes:
        client_id: the client's index in the federation (0-based).
        train: local training split (its size is the aggregation weight ``num_examples``).
        test: local test split (never read by training).
    """

    client_id: int
    train: TensorSplit
    test: TensorSplit

    @property
    def num_examples(self) -> int:
        """Number of local training examples."""
        return len(self.train)


def minibatches(
    split: TensorSplit, batch_size: int, num_batches: int, rng: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``num_batches`` minibatches drawn epoch by epoch from seeded permutations.

    Each epoch is a fresh permutation from ``rng``; a batch never crosses an epoch boundary, so
    the last batch of an epoch may be smaller. ``batch_size`` is capped at ``len(split)``.

    Raises:
        ValueError: when the split is empty or ``batch_size`` < 1.
    """
    n = len(split)
    if n == 0:
        raise ValueError("cannot draw minibatches from an empty split")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    bs = min(batch_size, n)
    drawn = 0
    while drawn < num_batches:
        perm = torch.randperm(n, generator=rng)
        for start in range(0, n, bs):
            if drawn >= num_batches:
                return
            idx = perm[start : start + bs]
            yield split.x[idx], split.y[idx]
            drawn += 1
