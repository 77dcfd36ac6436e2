"""HeteroFL's width plans: which hidden units a sub-model of rate r holds, and the index
arithmetic that cuts a sub-model out of the global one and scatters its update back
(:mod:`fedlore.algorithms.heterofl`).

A :class:`WidthPlan` names the model's hidden *groups* (the units of one hidden layer: an MLP
Linear's outputs, a CNN convolution's channels, the CNN's hidden Linear's outputs) with their
widths ``n_g``, and for each tensor of the ``state_dict`` the group each dimension runs over
(:data:`FULL`: every index, the model's input and output dimensions) and the block of entries
one unit spans along it (the CNN's flattened conv output: ``H/4 · W/4`` columns of the hidden
Linear per channel). A sub-model of rate r holds ``m_g = ceil(r · n_g)`` units of every group
(:func:`sub_width`); which ones is :func:`unit_index` (the first ``m_g``: HeteroFL; a window
that rolls with the round: FedRolex). Every tensor's entries are then the product of its
dimensions' index sets (:func:`flat_index`), so one rule serves the cut (:func:`extract`) and the
server's scatter-add (``index_add_`` on the flattened tensor).

Plans exist for the ``mlp`` (with or without BatchNorm), the ``cnn`` and the CIFAR ResNets
with BatchNorm (:func:`resnet_plan`); :func:`width_plan` refuses every other model with a
one-line :class:`~fedlore.config.ConfigError` naming why.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedlore.config import ConfigError
from fedlore.models.cnn import CNN
from fedlore.models.mlp import MLP
from fedlore.models.resnet import BasicBlock, CifarResNet

_BatchNorm = nn.modules.batchnorm._BatchNorm

FULL = -1
"""The group of a dimension that every sub-model holds whole (inputs, classes, kernels)."""

Dim = tuple[int, int]
"""One tensor dimension: (hidden group or :data:`FULL`, entries per unit along it)."""


@dataclass(frozen=True)
class WidthPlan:
    """The hidden groups of a model and how its tensors run over them.

    Attributes:
        widths: ``n_g``, the units of each hidden group.
        dims: per ``state_dict`` name, one :data:`Dim` per dimension.
        scaled: the modules whose output HeteroFL's scaler divides by r in training (every
            layer that produces a hidden group; never the head).
        norms: the BatchNorm modules (static batch norm, :mod:`~fedlore.algorithms.heterofl_bn`:
            their running statistics are never trained, sent or uploaded, only queried).
        routes: per parameter-free option-A shortcut that pads channels (a ResNet's stage
            change): (block, input group, output group, offset): global input channel i feeds
            output channel ``offset + i``.
    """

    widths: tuple[int, ...]
    dims: dict[str, tuple[Dim, ...]]
    scaled: tuple[str, ...]
    norms: tuple[str, ...] = ()
    routes: tuple[tuple[str, int, int, int], ...] = ()

    def to_json(self) -> str:
        """The plan as JSON (a server state value; ``norms``/``routes`` only when present)."""
        raw: dict[str, object] = {"widths": self.widths, "dims": self.dims, "scaled": self.scaled}
        if self.norms:
            raw |= {"norms": self.norms, "routes": self.routes}
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WidthPlan:
        raw = json.loads(text)
        dims = {k: tuple((int(g), int(b)) for g, b in v) for k, v in raw["dims"].items()}
        routes = tuple((str(b), int(i), int(o), int(s)) for b, i, o, s in raw.get("routes", ()))
        norms = tuple(raw.get("norms", ()))
        return cls(tuple(raw["widths"]), dims, tuple(raw["scaled"]), norms, routes)

    def buffers(self) -> set[str]:
        """The ``state_dict`` names of the BatchNorm buffers (running statistics, count)."""
        kinds = ("running_mean", "running_var", "num_batches_tracked")
        return {f"{n}.{k}" for n in self.norms for k in kinds}


def _linear(name: str, out: int, inp: Dim) -> dict[str, tuple[Dim, ...]]:
    return {f"{name}.weight": ((out, 1), inp), f"{name}.bias": ((out, 1),)}


def norm_dims(name: str, group: int) -> dict[str, tuple[Dim, ...]]:
    """A BatchNorm's tensors: affine weight and bias and running statistics over ``group``,
    the batch counter whole."""
    per_unit = ("weight", "bias", "running_mean", "running_var")
    return {f"{name}.{k}": ((group, 1),) for k in per_unit} | {f"{name}.num_batches_tracked": ()}


def _conv(out: int, inp: int) -> tuple[Dim, ...]:
    return ((out, 1), (inp, 1), (FULL, 1), (FULL, 1))


def resnet_plan(model: CifarResNet) -> WidthPlan:
    """A CIFAR ResNet's plan: one group per stage's residual stream (the stem's and every
    block's output channels: the identity shortcuts add them), one per block's inner channels
    (``conv1``/``norm1``); every conv and BatchNorm sliced along them, the image channels and
    the head's classes whole; the shortcuts of the stage changes are routes (option A has no
    parameters: a sub-model keeps the global model's channel offsets).

    Raises:
        ConfigError: on GroupNorm (its groups would not be sub-groups of the global model's).
    """
    if not isinstance(model.stem_norm, _BatchNorm):
        raise ConfigError(
            "heterofl: resnet with norm=group is not supported: a width slice of a GroupNorm "
            "layer regroups its channels; use model.kwargs.norm=batch (static batch norm)"
        )
    widths = [model.stem.out_channels]
    dims = {"stem.weight": _conv(0, FULL), **norm_dims("stem_norm", 0)}
    scaled, norms, routes = ["stem"], ["stem_norm"], []
    stream = 0
    for b, block in enumerate(model.blocks):
        assert isinstance(block, BasicBlock)
        name = f"blocks.{b}"
        inner = len(widths)
        widths.append(block.conv1.out_channels)
        out = stream
        if block.conv2.out_channels != widths[stream]:  # a stage change: a new stream
            out = len(widths)
            widths.append(block.conv2.out_channels)
            routes.append((name, stream, out, block.extra_ch // 2))
        dims |= {f"{name}.conv1.weight": _conv(inner, stream), **norm_dims(f"{name}.norm1", inner)}
        dims |= {f"{name}.conv2.weight": _conv(out, inner), **norm_dims(f"{name}.norm2", out)}
        scaled += [f"{name}.conv1", f"{name}.conv2"]
        norms += [f"{name}.norm1", f"{name}.norm2"]
        stream = out
    dims |= _linear("head", FULL, (stream, 1))
    return WidthPlan(tuple(widths), dims, tuple(scaled), tuple(norms), tuple(routes))


def width_plan(model: nn.Module) -> WidthPlan:
    """The :class:`WidthPlan` of ``model``.

    Raises:
        ConfigError: one line naming the model and why it has no plan (not an ``mlp`` or a
            ``cnn``; an ``mlp`` with BatchNorm).
    """
    if isinstance(model, MLP):
        hidden = [(i, m) for i, m in enumerate(model.body) if isinstance(m, nn.Linear)]
        dims: dict[str, tuple[Dim, ...]] = {}
        prev: Dim = (FULL, 1)
        norms = [f"body.{i}" for i, m in enumerate(model.body) if isinstance(m, _BatchNorm)]
        for g, (i, _) in enumerate(hidden):
            dims |= _linear(f"body.{i}", g, prev)
            if f"body.{i + 1}" in norms:  # the mlp's BatchNorm1d right after its Linear
                dims |= norm_dims(f"body.{i + 1}", g)
            prev = (g, 1)
        dims |= _linear("head", FULL, prev)
        plan = WidthPlan(
            tuple(m.out_features for _, m in hidden),
            dims,
            tuple(f"body.{i}" for i, _ in hidden),
            tuple(norms),
        )
    elif isinstance(model, CifarResNet):
        plan = resnet_plan(model)
    elif isinstance(model, CNN):
        c1, c2 = model.features[0], model.features[3]
        assert isinstance(c1, nn.Conv2d) and isinstance(c2, nn.Conv2d)
        block = model.fc.in_features // c2.out_channels
        dims = {
            "features.0.weight": ((0, 1), (FULL, 1), (FULL, 1), (FULL, 1)),
            "features.0.bias": ((0, 1),),
            "features.3.weight": ((1, 1), (0, 1), (FULL, 1), (FULL, 1)),
            "features.3.bias": ((1, 1),),
            **_linear("fc", 2, (1, block)),
            **_linear("head", FULL, (2, 1)),
        }
        widths = (c1.out_channels, c2.out_channels, model.fc.out_features)
        plan = WidthPlan(widths, dims, ("features.0", "features.3", "fc"))
    else:
        raise ConfigError(
            f"heterofl: model {type(model).__name__} is not supported: HeteroFL's width slicing "
            "and scaler are implemented for the mlp and cnn models and the resnets only (vit, "
            "text_encoder and llama have no width plan for attention heads, embeddings and "
            "residual streams)"
        )
    names = set(model.state_dict())
    if names != set(plan.dims):  # a subclass with tensors of its own: nothing to guess
        raise ConfigError(
            f"heterofl: model {type(model).__name__} has tensors outside its width plan: "
            f"{sorted(names ^ set(plan.dims))[:3]}"
        )
    return plan


def sub_width(n: int, rate: float) -> int:
    """``m = ceil(r · n)`` (at least 1), the units a sub-model of rate r keeps of n; the
    product is rounded to 9 digits first, so 0.1 · 30 keeps 3, not 4."""
    return max(1, math.ceil(round(rate * n, 9)))


def unit_index(n: int, rate: float, rnd: int, extraction: str, roll_by: str) -> torch.Tensor:
    """The global units (int64, in the sub-model's order) that the sub-model of ``rate`` holds
    of a group of ``n`` in round ``rnd``: the first ``m`` (``static``), or under ``rolling``
    the window ``(s + j) mod n``, ``j < m``, starting at ``s = rnd · step mod n`` with step 1
    (``roll_by: unit``, FedRolex) or ``m`` (``roll_by: window``). A sub-model holding the whole
    group takes it in order whatever the extraction."""
    m = sub_width(n, rate)
    if extraction == "static" or m >= n:
        return torch.arange(min(m, n))
    step = 1 if roll_by == "unit" else m
    start = (rnd * step) % n
    return (start + torch.arange(m)) % n


def flat_index(
    shape: Sequence[int], dims: Sequence[Dim], units: Sequence[torch.Tensor]
) -> torch.Tensor | None:
    """The flat (row-major) positions in a tensor of ``shape`` of the sub-tensor's entries,
    shaped as the sub-tensor; None when the sub-tensor is the whole tensor in order.

    Args:
        shape: the global tensor's shape.
        dims: its :data:`Dim` per dimension.
        units: per group, the global units the sub-model holds (:func:`unit_index`).
    """
    per_dim = []
    for size, (group, block) in zip(shape, dims, strict=True):
        if group == FULL:
            per_dim.append(torch.arange(size))
            continue
        ix = units[group]
        per_dim.append((ix[:, None] * block + torch.arange(block)).reshape(-1))
    if all(
        len(ix) == s and bool((ix == torch.arange(s)).all())
        for ix, s in zip(per_dim, shape, strict=True)
    ):
        return None
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    lin = torch.zeros([len(ix) for ix in per_dim], dtype=torch.int64)
    for d, ix in enumerate(per_dim):
        view = [1] * len(shape)
        view[d] = -1
        lin = lin + ix.view(view) * strides[d]
    return lin


def extract(tensor: torch.Tensor, lin: torch.Tensor | None) -> torch.Tensor:
    """The sub-tensor at flat positions ``lin`` (a new contiguous tensor; ``tensor`` itself
    when ``lin`` is None)."""
    if lin is None:
        return tensor
    return tensor.reshape(-1)[lin.to(tensor.device)]


def sub_model(model: nn.Module, shapes: dict[str, torch.Size]) -> nn.Module:
    """A copy of ``model`` whose parameters have the given shapes (empty, to be loaded), built
    without copying ``model``'s tensors: only the sub-model's memory is allocated."""
    memo: dict[int, object] = {
        id(t): torch.empty(0, dtype=t.dtype, device=t.device)
        for t in [*model.parameters(), *model.buffers()]
    }
    sub = copy.deepcopy(model, memo)
    for name, shape in shapes.items():
        owner, _, leaf = name.rpartition(".")
        module = sub.get_submodule(owner)
        old = getattr(model.get_submodule(owner), leaf)
        fresh = torch.empty(shape, dtype=old.dtype, device=old.device)
        setattr(module, leaf, nn.Parameter(fresh, requires_grad=old.requires_grad))
        if isinstance(module, nn.Linear) and leaf == "weight":
            module.out_features, module.in_features = shape[0], shape[1]
        if isinstance(module, nn.Conv2d) and leaf == "weight":
            module.out_channels, module.in_channels = shape[0], shape[1]
        if isinstance(module, _BatchNorm) and leaf == "weight":
            module.num_features = shape[0]
    return sub


def add_scaler(model: nn.Module, plan: WidthPlan, rate: float) -> None:
    """HeteroFL's scaler: each module of ``plan.scaled`` divides its output by ``rate`` while
    the module trains (evaluation is unscaled), so a sub-model's hidden activations keep the
    full model's scale."""

    def scale(module: nn.Module, _inputs: object, out: torch.Tensor) -> torch.Tensor:
        return out / rate if module.training else out

    for name in plan.scaled:
        model.get_submodule(name).register_forward_hook(scale)
