"""FedMask's model: masked layers (straight-through scores over fixed weights) and the in-place
conversion of a model to them (:func:`maskify`).

A :class:`MaskedLinear` / :class:`MaskedConv2d` holds its ``weight`` and ``bias`` as fixed
buffers and, per masked tensor t, a score parameter ``t_score`` and a bool pruning buffer
``t_keep``; its forward pass uses ``W ⊙ keep ⊙ 1[s > 0]`` with the gradient of the sigmoid
(:func:`hard_mask`). :class:`~fedlore.algorithms.fedmask.FedMask` (the method) trains, prunes
and uploads these masks; its module docstring gives the choices and their sources.
"""

from __future__ import annotations

import math
from typing import Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

SCORE = "_score"
"""Suffix of a masked tensor's score parameter (``<layer>.weight_score``, ``.bias_score``)."""
KEEP = "_keep"
"""Suffix of a masked tensor's pruning buffer (``<layer>.weight_keep``, bool)."""


def hard_mask(score: torch.Tensor) -> torch.Tensor:
    """``1[sigmoid(s) > 0.5]`` with the straight-through gradient of the sigmoid.

    Computed as ``h + sigmoid(s) - sigmoid(s).detach()`` with ``h = 1[s > 0]`` (equal to
    ``1[sigmoid(s) > 0.5]`` in exact arithmetic and immune to sigmoid rounding to 0.5 for tiny
    s): the value is exactly ``h`` (0. or 1.), the gradient ``dL/ds = dL/dm · sigmoid'(s)``.

    Args:
        score: real-valued scores s, any shape.

    Returns:
        A float tensor of ``score``'s shape and dtype holding 0. and 1.
    """
    soft = torch.sigmoid(score)
    return (score > 0).to(score.dtype) + soft - soft.detach()


ModuleT = TypeVar("ModuleT", bound=nn.Module)


class MaskedLayer(nn.Module):
    """Common part of :class:`MaskedLinear` and :class:`MaskedConv2d`: fixed ``weight`` and
    ``bias`` buffers; per masked tensor t (``weight``, and ``bias`` when it is masked) a score
    parameter ``t_score`` and a bool pruning buffer ``t_keep`` of t's shape."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def _init_mask(
        self, weight: torch.Tensor, bias: torch.Tensor | None, score: float, mask_bias: bool
    ) -> None:
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.masked = ("weight", "bias") if bias is not None and mask_bias else ("weight",)
        for t in self.masked:
            fixed = getattr(self, t)
            setattr(self, t + SCORE, nn.Parameter(torch.full_like(fixed, score)))
            self.register_buffer(t + KEEP, torch.ones_like(fixed, dtype=torch.bool))

    def mask(self, t: str) -> torch.Tensor:
        """The effective mask of tensor ``t``: ``keep ⊙ 1[s > 0]`` (float, straight-through to
        the scores; the pruned positions get gradient 0)."""
        score: torch.Tensor = getattr(self, t + SCORE)
        keep: torch.Tensor = getattr(self, t + KEEP)
        return hard_mask(score) * keep.to(score.dtype)

    def effective(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(W ⊙ m_W, b ⊙ m_b)`` (b itself when it is not masked, None when absent)."""
        w = self.weight * self.mask("weight")
        b = self.bias
        if b is not None and "bias" in self.masked:
            b = b * self.mask("bias")
        return w, b

    def binary_masks(self) -> dict[str, torch.Tensor]:
        """Tensor name (``weight``, ``bias``) -> its mask ``keep ⊙ 1[s > 0]`` as a detached bool
        tensor, what the client uploads."""
        return {
            t: (getattr(self, t + SCORE).detach() > 0) & getattr(self, t + KEEP)
            for t in self.masked
        }


class MaskedLinear(MaskedLayer):
    """``y = x (W ⊙ m_W)ᵀ + b ⊙ m_b`` with W, b fixed and the masks learned through their
    scores.

    Args:
        layer: the ``nn.Linear`` whose weight and bias become the fixed W and b.
        score: initial score of every masked entry (> 0: all active).
        mask_bias: mask the bias too (else it stays fixed and always on).
    """

    def __init__(self, layer: nn.Linear, score: float = 1.0, mask_bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self._init_mask(layer.weight, layer.bias, score, mask_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]``."""
        return F.linear(x, *self.effective())


class MaskedConv2d(MaskedLayer):
    """A 2-D convolution with the fixed kernel and bias under masks (stride, padding, dilation
    and groups of the original layer).

    Args:
        layer: the ``nn.Conv2d`` to convert.
        score: initial score of every masked entry.
        mask_bias: mask the bias too.

    Raises:
        ValueError: for a ``padding_mode`` other than ``"zeros"``.
    """

    def __init__(self, layer: nn.Conv2d, score: float = 1.0, mask_bias: bool = True) -> None:
        super().__init__()
        if layer.padding_mode != "zeros":
            raise ValueError(f"MaskedConv2d supports padding_mode='zeros' only, got {layer!r}")
        self.stride, self.padding = layer.stride, layer.padding
        self.dilation, self.groups = layer.dilation, layer.groups
        self._init_mask(layer.weight, layer.bias, score, mask_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C_in, H, W]`` -> ``[B, C_out, H', W']``."""
        w, b = self.effective()
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)


def masked_layers(model: nn.Module) -> dict[str, MaskedLayer]:
    """The masked layers of ``model`` by module name, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MaskedLayer)}


def maskify(
    model: ModuleT,
    last: int = 0,
    score: float = 1.0,
    mask_bias: bool = True,
    weights: Literal["init", "signed_constant"] = "init",
) -> ModuleT:
    """Convert ``model`` in place for FedMask: its Linear/Conv2d layers (all when ``last`` is 0,
    else the last ``last`` in module order) become masked layers over their current weights, and
    every parameter but the scores is frozen (``requires_grad = False``). Idempotent: a model
    that already holds masked layers is not converted again (only the freezing is reapplied).

    Args:
        model: any module whose Linear/Conv2d layers are children of other modules.
        last: how many of the last Linear/Conv2d layers to mask (0: all).
        score: initial score of every masked entry.
        mask_bias: mask the biases too (else they stay fixed and always on).
        weights: the fixed W of a masked layer: its current weights (``"init"``) or their signs
            times the Kaiming-He scale ``sqrt(2 / fan_in)`` (``"signed_constant"``, Zhou et al.
            2019 "Deconstructing Lottery Tickets", Ramanujan et al. 2020 "What's Hidden in a
            Randomly Weighted Neural Network?": the supermask initialization that learns best);
            applied once, at conversion. Biases keep their values.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: when ``model`` has no Linear/Conv2d layer, fewer than ``last``, or is itself
            one (it cannot be replaced in place).
    """
    if not masked_layers(model):
        if isinstance(model, nn.Linear | nn.Conv2d):
            raise ValueError("maskify: the model is a bare layer; wrap it in a container module")
        found = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]
        if not found or last > len(found):
            raise ValueError(
                f"maskify: cannot mask the last {last or 'all'} layer(s): the model has "
                f"{len(found)} Linear/Conv2d layer(s)"
            )
        for name in found[-last:] if last else found:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            layer = getattr(parent, child)
            new: MaskedLayer = (
                MaskedLinear(layer, score, mask_bias)
                if isinstance(layer, nn.Linear)
                else MaskedConv2d(layer, score, mask_bias)
            )
            if weights == "signed_constant":
                with torch.no_grad():
                    fan_in = new.weight[0].numel()
                    new.weight.copy_(torch.sign(new.weight) * math.sqrt(2.0 / fan_in))
            setattr(parent, child, new.to(layer.weight.device))
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(SCORE))
    return model
