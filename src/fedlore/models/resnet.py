"""CIFAR-style ResNets (He et al. 2016, "Deep Residual Learning for Image Recognition",
section 4.2): a 3x3 stem conv, then 3 stages of ``n`` basic blocks with ``w, 2w, 4w`` channels
(``w = 16`` in the paper) at strides 1, 2, 2, global average pooling and the ``head`` Linear:
``6n + 2`` weight layers (ResNet-20/32/44/56 for n = 3/5/7/9).

Shortcuts are **option A** of the paper (the one it uses on CIFAR): identity, and where the
shape changes, stride-2 subsampling plus zero-padded extra channels. Option A has no
parameters, so every ``Conv2d`` lies on the main path (``6n + 1`` of them) and every weight is
a plain conv kernel that a low-rank optimizer can reshape to ``(out, in*3*3)``.

Normalization: ``norm="batch"`` (the paper) or ``norm="group"`` (GroupNorm with ``groups``
groups, default 2). Group norm is common in FL (Hsieh et al. 2020, "The Non-IID Data Quagmire
of Decentralized Machine Learning") because BatchNorm's running statistics are client-specific
under non-IID data, and averaging them across clients does not give the statistics of the
global data; GroupNorm has no running statistics, only affine weights that average like any
other parameter.

Legend: ``B`` batch size, ``C, H, W`` input channels / height / width, ``K`` classes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedlore.models.common import check_image_shape, check_num_classes
from fedlore.registry import register_model

Norm = Literal["batch", "group"]
NormFactory = Callable[[int], nn.Module]


class BasicBlock(nn.Module):
    """Two 3x3 convs with norm and ReLU, plus an option-A shortcut.

    Args:
        in_ch: input channels.
        out_ch: output channels (``in_ch`` or ``2 * in_ch``).
        stride: 1, or 2 to halve height and width (ceil).
        make_norm: channels -> normalization module.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int, make_norm: NormFactory) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.norm1 = make_norm(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.norm2 = make_norm(out_ch)
        self.stride = stride
        self.extra_ch = out_ch - in_ch
        self.route: tuple[torch.Tensor, torch.Tensor] | None = None
        """Set on a width slice of the block (HeteroFL): (input, output) channel positions the
        shortcut connects, the others of the ``conv2.out_channels`` outputs zero."""

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """Option A: subsample ``[B, c, H, W]`` by the stride and zero-pad the new channels
        (``route`` set: the routed channels)."""
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.route is not None:
            src, dst = self.route
            out = x.new_zeros(x.shape[0], self.conv2.out_channels, *x.shape[2:])
            out[:, dst.to(x.device)] = x[:, src.to(x.device)]
            return out
        if self.extra_ch:
            lo = self.extra_ch // 2
            x = F.pad(x, (0, 0, 0, 0, lo, self.extra_ch - lo))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, in_ch, H, W]`` -> ``[B, out_ch, ceil(H/stride), ceil(W/stride)]``."""
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for small images.

    Args:
        in_channels: ``C``.
        num_classes: ``K``.
        n: basic blocks per stage.
        width: channels of the first stage ``w`` (stages have ``w, 2w, 4w``).
        make_norm: channels -> normalization module.
    """

    def __init__(
        self, in_channels: int, num_classes: int, n: int, width: int, make_norm: NormFactory
    ) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.stem_norm = make_norm(width)
        blocks: list[nn.Module] = []
        in_ch = width
        for stage, out_ch in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(in_ch, out_ch, stride, make_norm))
                in_ch = out_ch
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d | nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``[B, C, H, W]`` to logits ``[B, K]``."""
        z = torch.relu(self.stem_norm(self.stem(x)))
        z = self.blocks(z)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(z, 1), 1))


def _norm_factory(model: str, norm: str, groups: int, width: int) -> NormFactory:
    if norm == "batch":
        return nn.BatchNorm2d
    if norm == "group":
        if groups <= 0 or width % groups:
            raise ValueError(
                f"model {model!r}: groups={groups!r} must be positive and divide width={width}"
            )
        return lambda ch: nn.GroupNorm(groups, ch)
    raise ValueError(f"model {model!r}: norm must be 'batch' or 'group', got {norm!r}")


def _make(
    depth: int, input_shape: tuple[int, ...], num_classes: int, norm: str, width: int, groups: int
) -> CifarResNet:
    model = f"resnet{depth}"
    c, _, _ = check_image_shape(model, input_shape, min_hw=8)
    check_num_classes(model, num_classes)
    if isinstance(width, bool) or not isinstance(width, int) or width <= 0:
        raise ValueError(f"model {model!r}: width must be a positive int, got {width!r}")
    make_norm = _norm_factory(model, norm, groups, width)
    return CifarResNet(c, num_classes, (depth - 2) // 6, width, make_norm)


@register_model("resnet20")
def resnet20(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    norm: Norm = "batch",
    width: int = 16,
    groups: int = 2,
) -> CifarResNet:
    """ResNet-20 (n = 3, 0.27 M parameters at width 16, K = 10).

    Args:
        input_shape: ``(C, H, W)`` with ``H, W >= 8``.
        num_classes: ``K``.
        norm: ``"batch"`` or ``"group"`` (see the module docstring).
        width: first-stage channels ``w``.
        groups: GroupNorm groups (must divide ``w``); ignored for batch norm.

    Raises:
        ValueError: on a bad shape, class count, norm, width or groups.
    """
    return _make(20, input_shape, num_classes, norm, width, groups)


@register_model("resnet32")
def resnet32(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    norm: Norm = "batch",
    width: int = 16,
    groups: int = 2,
) -> CifarResNet:
    """ResNet-32 (n = 5); arguments as :func:`resnet20`."""
    return _make(32, input_shape, num_classes, norm, width, groups)


@register_model("resnet44")
def resnet44(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    norm: Norm = "batch",
    width: int = 16,
    groups: int = 2,
) -> CifarResNet:
    """ResNet-44 (n = 7); arguments as :func:`resnet20`."""
    return _make(44, input_shape, num_classes, norm, width, groups)


@register_model("resnet56")
def resnet56(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    norm: Norm = "batch",
    width: int = 16,
    groups: int = 2,
) -> CifarResNet:
    """ResNet-56 (n = 9, 0.85 M parameters at width 16, K = 10); arguments as :func:`resnet20`."""
    return _make(56, input_shape, num_classes, norm, width, groups)
