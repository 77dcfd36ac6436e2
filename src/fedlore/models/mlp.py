"""Multilayer perceptron: flatten -> (Linear, [BatchNorm1d], ReLU, [Dropout]) x len(hidden) ->
``head``.

Legend: ``B`` batch size, ``D = prod(input_shape)`` input features, ``K`` classes.

``norm="batch"`` puts a BatchNorm1d after each hidden Linear, before its ReLU (the model FedBN
keeps partly local, :mod:`fedlore.algorithms.partial`); the default ``"none"`` builds the plain
MLP, with the same tensor names as before the option existed. A client whose training-set size
is ``1 mod batch_size`` ends each pass over its data on a batch of one example, which torch's
BatchNorm refuses in training mode (the batch has no variance): :class:`BatchNorm1d` normalizes
such a batch by its running statistics, as in evaluation, and leaves them unchanged; without
running statistics (HeteroFL's static batch norm, :mod:`fedlore.algorithms.heterofl_bn`) by the
batch's own, as every other batch: each value minus itself, so the layer outputs its bias.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedlore.models.common import check_num_classes, check_shape
from fedlore.registry import register_model


class BatchNorm1d(nn.BatchNorm1d):
    """``nn.BatchNorm1d`` that also takes a training batch of one example: torch refuses it (one
    value per channel has no batch variance); here it is normalized by the running statistics,
    as in evaluation, without updating them (the affine weight and bias still get gradients).
    Without running statistics (static batch norm, which normalizes every batch by its own
    statistics, in training and evaluation) a batch of one is too, as torch would if it allowed
    it: the output is the bias. Every other batch is torch's
    BatchNorm1d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.running_mean is None:  # static: training or not
            two = x.expand(2, *x.shape[1:])  # the same mean, variance 0
            return F.batch_norm(two, None, None, self.weight, self.bias, True, 0.0, self.eps)[:1]
        if self.training and x.shape[0] == 1:
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        return super().forward(x)


class MLP(nn.Module):
    """Fully connected classifier on flattened inputs.

    Args:
        in_features: ``D``, number of input features after flattening.
        num_classes: ``K``, width of the ``head`` Linear.
        hidden: widths of the hidden layers (may be empty: then a linear model).
        dropout: dropout probability after each hidden ReLU (0 disables it).
        norm: ``"batch"``: a :class:`BatchNorm1d` after each hidden Linear, before its ReLU;
            ``"none"``.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden: Sequence[int],
        dropout: float,
        norm: Literal["none", "batch"] = "none",
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers.append(nn.Linear(width, h))
            if norm == "batch":
                layers.append(BatchNorm1d(h))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``x`` ``[B, *input_shape]`` to logits ``[B, K]``."""
        return self.head(self.body(torch.flatten(x, 1)))


@register_model("mlp")
def mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    hidden: Sequence[int] = (128, 128),
    dropout: float = 0.0,
    norm: str = "none",
) -> MLP:
    """Build an :class:`MLP` for inputs of any shape (they are flattened).

    Args:
        input_shape: per-example shape, e.g. ``(1, 8, 8)``; ``D = prod(input_shape)``.
        num_classes: number of classes ``K``.
        hidden: hidden-layer widths (default ``[128, 128]``).
        dropout: dropout probability in ``[0, 1)``.
        norm: ``"none"`` (default) or ``"batch"``: a BatchNorm1d after each hidden Linear,
            before its ReLU (FedBN's local layers).

    Raises:
        ValueError: on a bad shape, class count, hidden width, dropout or norm.
    """
    shape = check_shape("mlp", input_shape)
    check_num_classes("mlp", num_classes)
    if isinstance(hidden, str | bytes) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hidden
    ):
        raise ValueError(f"model 'mlp': hidden must be a list of integers, got {hidden!r}")
    widths = [int(h) for h in hidden]
    if any(h <= 0 for h in widths):
        raise ValueError(f"model 'mlp': hidden widths must be positive, got {list(hidden)!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model 'mlp': dropout must be in [0, 1), got {dropout!r}")
    if norm not in ("none", "batch"):
        raise ValueError(f"model 'mlp': norm must be 'none' or 'batch', got {norm!r}")
    kind: Literal["none", "batch"] = "batch" if norm == "batch" else "none"
    return MLP(math.prod(shape), num_classes, widths, dropout, kind)
