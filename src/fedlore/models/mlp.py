"""Multilayer perceptron: flatten -> (Linear, ReLU, Dropout) x len(hidden) -> ``head``.

Legend: ``B`` batch size, ``D = prod(input_shape)`` input features, ``K`` classes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from fedlore.models.common import check_num_classes, check_shape
from fedlore.registry import register_model


class MLP(nn.Module):
    """Fully connected classifier on flattened inputs.

    Args:
        in_features: ``D``, number of input features after flattening.
        num_classes: ``K``, width of the ``head`` Linear.
        hidden: widths of the hidden layers (may be empty: then a linear model).
        dropout: dropout probability after each hidden ReLU (0 disables it).
    """

    def __init__(
        self, in_features: int, num_classes: int, hidden: Sequence[int], dropout: float
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
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
) -> MLP:
    """Build an :class:`MLP` for inputs of any shape (they are flattened).

    Args:
        input_shape: per-example shape, e.g. ``(1, 8, 8)``; ``D = prod(input_shape)``.
        num_classes: number of classes ``K``.
        hidden: hidden-layer widths (default ``[128, 128]``).
        dropout: dropout probability in ``[0, 1)``.

    Raises:
        ValueError: on a bad shape, class count, hidden width or dropout.
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
    return MLP(math.prod(shape), num_classes, widths, dropout)
