"""The classic FL CNN of McMahan et al. (2017), "Communication-Efficient Learning of Deep
Networks from Decentralized Data", section 3 (the "CNN" used for MNIST):

    conv 5x5 (C -> 32), ReLU, max-pool 2x2 -> conv 5x5 (32 -> 64), ReLU, max-pool 2x2
    -> flatten -> Linear 512, ReLU -> ``head`` Linear K.

Convolutions use ``padding=2`` ("same"), so each pool halves the map (floor): a 28x28 input
gives a 7x7x64 map and 1,663,370 parameters for K = 10, the count McMahan et al. report
(TensorFlow Federated's ``create_original_fedavg_cnn_model`` has the same count). The flattened
size is computed from the input shape, so 8x8 (sklearn digits, 2x2 map), 28x28 and 32x32 (8x8 map)
inputs all work; the smallest input is 4x4.

Legend: ``B`` batch size, ``C, H, W`` input channels / height / width, ``K`` classes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedlore.models.common import check_image_shape, check_num_classes
from fedlore.registry import register_model


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` that, on CPU and without autograd (evaluation, the MC predictive,
    Meta-BayFL's trial scoring), pools in channels-last layout and hands the result back
    contiguous (or channels-last when it came so: Meta-BayFL scores its trial copies in that
    layout, :func:`~fedlore.algorithms.meta_lr.scoring_layout`): the same values, bit for bit,
    in about 40 % less time for a whole evaluation pass. PyTorch's CPU max-pool kernel for
    the default NCHW layout is about as slow as the 5x5 convolution before it; its
    channels-last kernel pools ``[512, 8, 28, 28]`` in 6 ms with the two layout copies, against
    17 ms (one thread). With autograd on, the channels-last route
    gave the same gradients but no faster steps, so training pools as ``nn.MaxPool2d``, as do
    other devices. Measured side by side in ``benchmarks/pool_layout.py``. No parameters or
    buffers: state dicts are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pool ``x`` (``[B, C, H, W]`` or ``[C, H, W]``)."""
        backward = torch.is_grad_enabled() and x.requires_grad
        if backward or x.device.type != "cpu" or x.dim() != 4 or self.return_indices:
            return super().forward(x)
        kept = x.is_contiguous(memory_format=torch.channels_last)  # a model in that layout
        pooled = F.max_pool2d(
            x.contiguous(memory_format=torch.channels_last),
            self.kernel_size,
            self.stride,
            self.padding,
            self.dilation,
            ceil_mode=self.ceil_mode,
        )
        return pooled if kept else pooled.contiguous()


class CNN(nn.Module):
    """Two conv/pool stages, one hidden Linear, then the ``head`` Linear.

    Args:
        input_shape: ``(C, H, W)`` with ``H, W >= 4``.
        num_classes: ``K``.
        channels: output channels of the two conv layers.
        hidden: width of the hidden Linear layer.
        dropout: dropout probability before ``head`` (0 disables it).
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        num_classes: int,
        channels: tuple[int, int],
        hidden: int,
        dropout: float,
    ) -> None:
        super().__init__()
        c, h, w = input_shape
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(c, c1, kernel_size=5, padding=2),
            nn.ReLU(),
            MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2),
            nn.ReLU(),
            MaxPool2d(2),
        )
        # padding=2 keeps the size through each 5x5 conv; each 2x2 pool floors it by half.
        flat = c2 * (h // 4) * (w // 4)
        self.fc = nn.Linear(flat, hidden)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``[B, C, H, W]`` to logits ``[B, K]``."""
        z = torch.flatten(self.features(x), 1)
        return self.head(self.drop(torch.relu(self.fc(z))))


@register_model("cnn")
def cnn(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    channels: Sequence[int] = (32, 64),
    hidden: int = 512,
    dropout: float = 0.0,
) -> CNN:
    """Build the McMahan et al. (2017) CNN for ``(C, H, W)`` inputs with ``H, W >= 4``.

    Args:
        input_shape: ``(C, H, W)``, e.g. ``(1, 28, 28)``.
        num_classes: ``K``.
        channels: two conv widths (default ``(32, 64)``).
        hidden: hidden Linear width (default 512).
        dropout: dropout probability in ``[0, 1)`` before the head.

    Raises:
        ValueError: on a bad shape (not 3-D, or smaller than 4x4), class count, channels,
            hidden width or dropout.
    """
    shape = check_image_shape("cnn", input_shape, min_hw=4)
    check_num_classes("cnn", num_classes)
    if isinstance(channels, str | bytes) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in channels
    ):
        raise ValueError(f"model 'cnn': channels must be two positive ints, got {channels!r}")
    chans = tuple(int(c) for c in channels)
    if len(chans) != 2 or min(chans) <= 0:
        raise ValueError(f"model 'cnn': channels must be two positive ints, got {channels!r}")
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0:
        raise ValueError(f"model 'cnn': hidden must be positive, got {hidden!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model 'cnn': dropout must be in [0, 1), got {dropout!r}")
    return CNN(shape, num_classes, (chans[0], chans[1]), hidden, dropout)
