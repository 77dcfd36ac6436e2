"""FedMask's binary masks as tensors: packed one bit per entry for the upload
(:func:`pack_mask`, :func:`unpack_mask`) and combined by the server's overlap rule
(:func:`overlap_mean`). No model, no state: :class:`~fedlore.algorithms.fedmask.FedMask` calls
them.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A binary mask packed one bit per element: ``numpy.packbits`` (big-endian bit order) of the
    flattened mask.

    Args:
        mask: bool (or 0/1) tensor, any shape, n elements.

    Returns:
        uint8 tensor ``[ceil(n / 8)]`` (the last byte zero-padded) on ``mask``'s device;
        ``ceil(n / 8)`` bytes.
    """
    bits = mask.detach().to("cpu", torch.bool).flatten().numpy()
    return torch.from_numpy(np.packbits(bits)).contiguous().to(mask.device)


def unpack_mask(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: a bool tensor of ``shape`` (padding bits ignored).

    Raises:
        ValueError: when ``packed`` is not uint8 ``[ceil(prod(shape) / 8)]``.
    """
    n = math.prod(shape)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (math.ceil(n / 8),):
        raise ValueError(
            f"a packed mask of {n} bits is uint8 [{math.ceil(n / 8)}], got "
            f"{packed.dtype} {tuple(packed.shape)}"
        )
    bits = np.unpackbits(packed.cpu().numpy(), count=n)
    return torch.from_numpy(bits.astype(bool)).reshape(shape).to(packed.device)


def overlap_mean(
    masks: list[torch.Tensor], weights: list[float], min_overlap: int = 2
) -> torch.Tensor:
    """FedMask's server rule (reference notes Part 12 item 2.5): per position the weighted mean
    ``Σ p_i m_i / Σ p_i`` of the clients' binary masks where at least ``min_overlap`` clients
    hold a 1, else 0. With equal weights an entry is ``count / N`` or 0.

    Args:
        masks: N bool tensors of one shape.
        weights: N non-negative p_i with a positive sum.
        min_overlap: the fewest clients holding a 1 for a position to survive (>= 1).

    Returns:
        float32 tensor of the masks' shape, values in [0, 1] (computed in float64).

    Raises:
        ValueError: on no masks, mismatched lengths or shapes, or a non-positive total weight.
    """
    if not masks or len(masks) != len(weights):
        raise ValueError(f"overlap_mean: {len(masks)} masks and {len(weights)} weights")
    if any(m.shape != masks[0].shape for m in masks):
        raise ValueError("overlap_mean: masks of different shapes")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"overlap_mean: weights must have a positive sum, got {weights}")
    stack = torch.stack([m.to(torch.float64) for m in masks])
    w = torch.tensor(weights, dtype=torch.float64, device=masks[0].device)
    w = w.view(-1, *([1] * masks[0].dim()))
    mean = (w * stack).sum(0) / total
    count = stack.sum(0)
    return torch.where(count >= min_overlap, mean, torch.zeros_like(mean)).to(torch.float32)
