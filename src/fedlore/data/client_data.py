"""Per-client data: what ``Algorithm.client_update`` receives, and its minibatches.

A :class:`~fedlore.data.container.Federation` holds the full source tensors once plus one index
array per client; a client's :class:`ClientData` is materialized only when that client is
sampled, and draws its minibatches per round (:func:`minibatches`) or from its own endless
stream (:func:`stream_batches`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fedlore.seeding import generator


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

    @staticmethod
    def concat(splits: list[TensorSplit]) -> TensorSplit:
        """The splits' rows one after another (a copy).

        Raises:
            ValueError: for an empty list.
        """
        if not splits:
            raise ValueError("TensorSplit.concat needs at least one split")
        return TensorSplit(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]))

    def subset(self, idx: np.ndarray | torch.Tensor) -> TensorSplit:
        """The rows at ``idx`` (a copy)."""
        t = torch.as_tensor(np.asarray(idx) if isinstance(idx, np.ndarray) else idx)
        t = t.to(device=self.x.device, dtype=torch.long)
        return TensorSplit(self.x[t], self.y[t])


def numpy_split(images: np.ndarray, labels: np.ndarray) -> TensorSplit:
    """uint8 or float inputs ``[B, ...]`` and integer labels ``[B]`` -> a float32 / int64
    split (uint8 images scaled to [0, 1])."""
    x = images.astype(np.float32)
    if images.dtype == np.uint8:
        x /= 255.0
    return TensorSplit(torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64)))


@dataclass(frozen=True)
class ClientData:
    """One client's local data.

    Attributes:
        client_id: the client's index in the federation (0-based).
        train: local training split (its size is the aggregation weight ``num_examples``).
        test: local test split (never read by training).
        stream_seed: None: every round draws its minibatches from fresh permutations seeded by
            (seed, round, client) (:func:`minibatches`). An int: the client reads one shuffled
            stream over the whole run, reshuffled and restarted when exhausted; round ``t``
            reads batches ``t·K .. t·K + K - 1`` of it, so under full participation it continues
            where round ``t - 1`` ended and a round the client sits out skips its part
            (:func:`stream_batches`; seed 000's pre-training protocol).
    """

    client_id: int
    train: TensorSplit
    test: TensorSplit
    stream_seed: int | None = None

    @property
    def num_examples(self) -> int:
        """Number of local training examples."""
        return len(self.train)

    def batches(
        self, batch_size: int, num_batches: int, rng: torch.Generator, rnd: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The ``num_batches`` training minibatches of round ``rnd`` (see :attr:`stream_seed`).

        Args:
            batch_size: B (capped at the split size).
            num_batches: K, the round's local steps.
            rng: the round's client generator (used by per-round sampling only).
            rnd: the round (a stream starts round ``t`` at batch ``t·K``; rounds < 0 read the
                stream's start).

        Raises:
            ValueError: when the split is empty or ``batch_size`` < 1.
        """
        if self.stream_seed is None:
            return minibatches(self.train, batch_size, num_batches, rng)
        start = max(int(rnd), 0) * num_batches
        return stream_batches(self.train, batch_size, num_batches, self.stream_seed, start)


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
            idx = perm[start : start + bs].to(split.x.device)  # CPU draws, on every device
            yield split.x[idx], split.y[idx]
            drawn += 1


def stream_batches(
    split: TensorSplit, batch_size: int, num_batches: int, seed: int, start: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches ``start .. start + num_batches - 1`` of a client's endless shuffled stream.

    The stream is the concatenation of permutations of the split, permutation ``e`` seeded by
    ``derive_seed(seed, e)``: the client reads every example once before any is repeated, then
    reshuffles and restarts (seed 000, "Client sizes and local sampling"). Batch ``j`` holds
    stream items ``[j·b, (j+1)·b)`` with ``b = min(batch_size, len(split))``, so every batch has
    ``b`` examples and may straddle two permutations. Only the permutations that the requested
    batches touch are drawn, so any window of the stream costs the same.

    Args:
        split: the client's training split (n examples).
        batch_size: B.
        num_batches: number of batches to yield.
        seed: the client's stream seed.
        start: index of the first batch.

    Raises:
        ValueError: when the split is empty, ``batch_size`` < 1 or ``start`` < 0.
    """
    n = len(split)
    if n == 0:
        raise ValueError("cannot draw minibatches from an empty split")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    b = min(batch_size, n)
    perms: dict[int, torch.Tensor] = {}

    def perm(e: int) -> torch.Tensor:
        if e not in perms:
            perms.clear()  # a batch touches at most two consecutive permutations
            perms[e] = torch.randperm(n, generator=generator(seed, e))
        return perms[e]

    for j in range(start, start + num_batches):
        first, last = j * b, (j + 1) * b - 1
        e0, e1 = first // n, last // n
        if e0 == e1:
            idx = perm(e0)[first % n : last % n + 1]
        else:
            head = perm(e0)[first % n :]
            idx = torch.cat([head, perm(e1)[: last % n + 1]])
        idx = idx.to(split.x.device)  # CPU draws, on every device
        yield split.x[idx], split.y[idx]
