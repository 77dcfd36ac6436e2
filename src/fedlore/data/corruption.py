"""Data corruption for the "small and noisy data" protocols of Meta-BayFL (seed 001, Table I).

* data fraction ``|D|``: keep a stratified share of the training set before partitioning (the
  authors' ``DFL/fed_bnn_noniid_small.py`` draws a uniform subset; stratifying keeps every class);
* noise level eps: ``x <- clip(x + eps * N(0, 1), 0, 1)`` per pixel of images in [0, 1], on
  training and test images alike (``DFL/fed_cnn_noniid_c.py``);
* label flips: a share of training labels replaced by a uniformly drawn other class.

Randomness always comes from the generator argument.
"""

from __future__ import annotations

import numpy as np
import torch


def subsample_stratified(
    labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> np.ndarray:
    """Indices of a stratified random subset keeping ``fraction`` of every class.

    Each class present with n_c examples keeps ``max(1, round(fraction · n_c))`` of them, drawn
    without replacement.

    Args:
        labels: int array ``[n]`` of class labels.
        fraction: share ``|D|`` to keep, in (0, 1]; 1 keeps everything.
        rng: source of the draw.

    Returns:
        Sorted int64 indices into ``labels``.

    Raises:
        ValueError: when ``fraction`` is outside (0, 1] or ``labels`` is not 1-D.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if fraction == 1.0:
        return np.arange(len(labels), dtype=np.int64)
    kept = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        k = max(1, round(fraction * len(idx)))
        kept.append(rng.choice(idx, size=k, replace=False))
    return np.sort(np.concatenate(kept)).astype(np.int64)


def add_gaussian_noise(x: torch.Tensor, eps: float, generator: torch.Generator) -> torch.Tensor:
    """Additive Gaussian pixel noise at level eps, clipped back to [0, 1].

    Args:
        x: float tensor ``[B, ...]`` with values in [0, 1] (left unchanged).
        eps: noise standard deviation in pixel units (≥ 0); 0 returns an unchanged copy.
        generator: torch generator on ``x``'s device, the only source of the noise.

    Returns:
        ``clip(x + eps · N(0, 1), 0, 1)``, a new tensor of the same shape and dtype.

    Raises:
        ValueError: when ``eps`` < 0.
    """
    if eps < 0:
        raise ValueError(f"noise eps must be >= 0, got {eps}")
    if eps == 0:
        return x.clone()
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    return (x + eps * noise).clamp_(0.0, 1.0)


def flip_labels(
    y: np.ndarray, share: float, num_classes: int, rng: np.random.Generator
) -> np.ndarray:
    """Replace ``round(share · n)`` labels, chosen without replacement, by another class.

    The new label is uniform over the ``num_classes - 1`` classes other than the true one.

    Args:
        y: int array ``[n]`` of labels in ``[0, num_classes)`` (left unchanged).
        share: share of labels to flip, in [0, 1].
        num_classes: number of classes C (≥ 2 when anything is flipped).
        rng: source of the positions and the new labels.

    Returns:
        A new int64 array ``[n]``.

    Raises:
        ValueError: on ``share`` outside [0, 1], labels outside [0, C), or C < 2 with flips.
    """
    y = np.asarray(y, dtype=np.int64)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"label flip share must be in [0, 1], got {share}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]")
    out = y.copy()
    k = round(share * len(y))
    if k == 0:
        return out
    if num_classes < 2:
        raise ValueError(f"cannot flip labels with num_classes={num_classes}")
    pos = rng.choice(len(y), size=k, replace=False)
    out[pos] = (y[pos] + rng.integers(1, num_classes, size=k)) % num_classes
    return out
