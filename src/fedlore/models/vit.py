"""Vision Transformer classifier (Dosovitskiy et al., ICLR 2021, "An Image is Worth 16x16 Words")
sized for small images, on transformers' ``ViTModel``.

    patches (Conv2d, kernel = stride = p) + [CLS] + learned positions
    -> num_layers pre-norm blocks (attention q/k/v/o_proj, MLP fc1 -> GELU -> fc2)
    -> LayerNorm -> ``head`` Linear on the [CLS] token.

Defaults for ``1 x 28 x 28`` (Fashion-MNIST): patch 4 (7 x 7 = 49 patches + [CLS] = 50 tokens),
hidden 64, 4 layers, 4 heads, MLP 256: 204,416 backbone parameters plus the head. The backbone
has no pooler (it is unused by a [CLS]-token head), so ``state_dict`` holds only what is trained.
Dropout is 0 by default: it would draw from torch's global generator during training.

Low-rank methods (FedLore, Local GaLore, FedLore-Random) project every attention and MLP Linear
(``backbone.layers.*.attention.{q,k,v,o}_proj``, ``backbone.layers.*.mlp.fc{1,2}``) and the patch
Conv2d (seen as ``hidden x C*p*p``) when ``r < min(m, n)``; the [CLS] token, position
embeddings, LayerNorms, biases and ``head`` are trained densely.

Random initialization draws from torch's global generator (``ViTModel``'s truncated-normal init
with std ``initializer_range`` = 0.02, then ``nn.Linear``'s default for the head). With
``pretrained=<folder>`` the backbone (architecture and weights) comes from a local Hugging Face
folder instead, e.g. one written by ``model.backbone.save_pretrained(folder)``.

Legend: ``B`` batch size, ``C, H, W`` input channels / height / width, ``K`` classes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedlore.models.common import (
    check_image_shape,
    check_num_classes,
    local_hf_folder,
    quiet_transformers,
)
from fedlore.registry import register_model

VIT_DEFAULTS = {
    "patch_size": 4,
    "hidden_size": 64,
    "num_layers": 4,
    "num_heads": 4,
}
"""Architecture used when the corresponding keyword is not given (intermediate = 4 x hidden)."""

_PRETRAINED_HINT = (
    "Pass pretrained=<folder> with a local Hugging Face ViT folder (config.json + "
    "model.safetensors, e.g. written by model.backbone.save_pretrained(folder)); nothing is "
    "downloaded."
)


class ViTClassifier(nn.Module):
    """A ``ViTModel`` backbone and a ``head`` Linear on its final [CLS] state.

    Args:
        backbone: a transformers ``ViTModel`` without pooler.
        num_classes: ``K``.
    """

    def __init__(self, backbone: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.backbone = backbone
        config: Any = backbone.config
        self.head = nn.Linear(int(config.hidden_size), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``[B, C, H, W]`` (float) to logits ``[B, K]``."""
        tokens = self.backbone(pixel_values=x).last_hidden_state  # [B, 1 + patches, hidden]
        return self.head(tokens[:, 0])


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model 'vit': {name} must be a positive int, got {value!r}")
    return value


def _load_pretrained(folder: str, shape: tuple[int, int, int], dropout: float) -> nn.Module:
    from transformers import ViTConfig, ViTModel

    path = local_hf_folder("vit", folder, _PRETRAINED_HINT)
    with quiet_transformers():
        config = ViTConfig.from_pretrained(str(path), local_files_only=True)
    if config.model_type != "vit":
        raise ValueError(f"model 'vit': {path} holds a {config.model_type!r} model, not a ViT")
    c, h, w = shape
    size = config.image_size
    hw = tuple(size) if isinstance(size, list | tuple) else (size, size)
    if config.num_channels != c or hw != (h, w):
        raise ValueError(
            f"model 'vit': {path} was built for {config.num_channels}x{hw[0]}x{hw[1]} images, "
            f"but the data are {c}x{h}x{w}"
        )
    config.hidden_dropout_prob = dropout
    config.attention_probs_dropout_prob = dropout
    with quiet_transformers():
        backbone = ViTModel.from_pretrained(
            str(path),
            config=config,
            local_files_only=True,
            dtype=torch.float32,
            add_pooling_layer=False,
        )
    return backbone


@register_model("vit")
def vit(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    patch_size: int | None = None,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    intermediate_size: int | None = None,
    dropout: float = 0.0,
    pretrained: str | None = None,
) -> ViTClassifier:
    """Build a small ViT classifier for ``(C, H, W)`` images.

    Args:
        input_shape: ``(C, H, W)``; ``H`` and ``W`` must be multiples of ``patch_size``.
        num_classes: ``K``.
        patch_size: ``p``, side of a square patch in pixels (default 4; use 2 for 8x8 digits).
        hidden_size: token width (default 64); a multiple of ``num_heads``.
        num_layers: transformer blocks (default 4).
        num_heads: attention heads (default 4).
        intermediate_size: MLP width (default ``4 * hidden_size``).
        dropout: hidden and attention dropout probability in ``[0, 1)`` (default 0).
        pretrained: local Hugging Face ViT folder to load the backbone from; its config fixes
            the architecture, so the size keywords above must then be left unset.

    Returns:
        A :class:`ViTClassifier` mapping ``[B, C, H, W]`` to ``[B, K]``.

    Raises:
        ValueError: on a bad shape, class count, size keyword or dropout; on size keywords
            together with ``pretrained``; on a pretrained folder built for another image size.
        FileNotFoundError: when ``pretrained`` is not a local Hugging Face folder (names it).
    """
    c, h, w = check_image_shape("vit", input_shape, min_hw=1)
    check_num_classes("vit", num_classes)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model 'vit': dropout must be in [0, 1), got {dropout!r}")
    sizes = {
        "patch_size": patch_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
    }
    if pretrained is not None:
        given = sorted(k for k, v in sizes.items() if v is not None)
        if given:
            raise ValueError(
                f"model 'vit': {given} cannot be set together with pretrained={pretrained!r} "
                "(the folder's config.json fixes the architecture)"
            )
        return ViTClassifier(_load_pretrained(pretrained, (c, h, w), dropout), num_classes)

    p = _positive_int(
        "patch_size", VIT_DEFAULTS["patch_size"] if patch_size is None else patch_size
    )
    d = _positive_int(
        "hidden_size", VIT_DEFAULTS["hidden_size"] if hidden_size is None else hidden_size
    )
    layers = _positive_int(
        "num_layers", VIT_DEFAULTS["num_layers"] if num_layers is None else num_layers
    )
    heads = _positive_int(
        "num_heads", VIT_DEFAULTS["num_heads"] if num_heads is None else num_heads
    )
    mlp = _positive_int(
        "intermediate_size", 4 * d if intermediate_size is None else intermediate_size
    )
    if h % p or w % p:
        raise ValueError(
            f"model 'vit': image {h}x{w} is not a whole number of {p}x{p} patches; choose a "
            "patch_size that divides H and W"
        )
    if d % heads:
        raise ValueError(f"model 'vit': hidden_size={d} is not a multiple of num_heads={heads}")

    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        image_size=h if h == w else (h, w),
        patch_size=p,
        num_channels=c,
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=mlp,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    with quiet_transformers():
        backbone = ViTModel(config, add_pooling_layer=False)
    return ViTClassifier(backbone, num_classes)
