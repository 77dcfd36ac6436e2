"""LLaMA decoder for pre-training from scratch, built with Hugging Face transformers from a config.

Architecture: Touvron et al. 2023 ("LLaMA"), i.e. pre-norm decoder blocks with RMSNorm, rotary
position embeddings, SwiGLU MLPs and no biases, built as ``transformers.LlamaModel(config)``
with random weights (normal, std ``initializer_range`` = 0.02, from torch's global generator:
seed it before building). Nothing is loaded from disk or the network.

Sizes (:data:`LLAMA_SIZES`): the four of seed 000 Table 5 (names follow the GaLore
implementation, whose ``configs/llama_*.json`` they match: 60M, 130M, 350M, 1B with a 32,000
token vocabulary) and two that train on a laptop CPU (``micro``, ``small``). The vocabulary size
is the data's (``num_classes`` = the tokenizer's size), so a model always fits its tokenizer.

The module maps int64 token ids ``[B, L]`` to next-token logits ``[B, L, V]``: ``backbone`` is the
``LlamaModel`` (token embeddings ``backbone.embed_tokens``, decoder layers, final norm) and
``head`` the untied output projection (``lm_head`` in transformers; the engine's classifier name,
so ``params.exclude: ["head."]`` keeps it dense as GaLore's pre-training script does). Attention
is causal without a padding mask: packed sequences are padded only at their end (see
:mod:`fedlore.data.corpus`), where no real token can attend to the padding, and padded targets
are ignored by the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedlore.models.common import check_num_classes, check_shape, quiet_transformers
from fedlore.registry import register_model


@dataclass(frozen=True)
class LlamaSize:
    """One LLaMA configuration (seed 000 Table 5 columns).

    Attributes:
        hidden: hidden size d_model.
        intermediate: SwiGLU MLP width.
        heads: attention heads.
        layers: decoder blocks.
    """

    hidden: int
    intermediate: int
    heads: int
    layers: int


LLAMA_SIZES: dict[str, LlamaSize] = {
    "micro": LlamaSize(64, 176, 4, 2),
    "small": LlamaSize(128, 352, 4, 4),
    "60m": LlamaSize(512, 1376, 8, 8),
    "130m": LlamaSize(768, 2048, 12, 12),
    "350m": LlamaSize(1024, 2736, 16, 24),
    "1b": LlamaSize(2048, 5461, 32, 24),
}
"""Named sizes. ``60m`` .. ``1b``: seed 000 Table 5 (GaLore's configs). ``micro`` / ``small``:
laptop sizes with the same shape rules (intermediate ≈ 8/3 · hidden rounded up to 16, head size
16 / 32)."""


class CausalLM(nn.Module):
    """A decoder-only language model: ``backbone`` (``LlamaModel``) then ``head`` (Linear).

    Args:
        backbone: a ``transformers`` decoder returning ``last_hidden_state`` ``[B, L, H]``.
        hidden: H.
        vocab_size: V.
    """

    def __init__(self, backbone: nn.Module, hidden: int, vocab_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids int64 ``[B, L]`` -> next-token logits ``[B, L, V]`` (position t predicts
        token t + 1)."""
        hidden = self.backbone(input_ids=x, use_cache=False).last_hidden_state
        out: torch.Tensor = self.head(hidden)
        return out


@register_model("llama")
def llama(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    size: str = "micro",
    hidden: int | None = None,
    intermediate: int | None = None,
    heads: int | None = None,
    layers: int | None = None,
    max_position_embeddings: int | None = None,
    rms_norm_eps: float = 1e-6,
    initializer_range: float = 0.02,
    rope_theta: float = 10000.0,
) -> nn.Module:
    """A randomly initialized LLaMA causal language model.

    Args:
        input_shape: ``(L,)``, tokens per sequence.
        num_classes: V, the vocabulary size (the tokenizer's size).
        size: a key of :data:`LLAMA_SIZES`; ``hidden``, ``intermediate``, ``heads`` and
            ``layers`` override its fields.
        hidden, intermediate, heads, layers: see :class:`LlamaSize`.
        max_position_embeddings: rotary table length (None: ``max(L, 1024)``, GaLore's value).
        rms_norm_eps: RMSNorm epsilon (GaLore's configs: 1e-6).
        initializer_range: std of the normal weight initialization.
        rope_theta: rotary base.

    Returns:
        A :class:`CausalLM` with parameters ``backbone.*`` and ``head.weight`` ``[V, H]``.

    Raises:
        ValueError: for an unknown size, a hidden size not divisible by the heads, an odd head
            size (rotary embeddings need pairs), a non-positive dimension, or ``L`` larger than
            ``max_position_embeddings``.
    """
    from transformers import LlamaConfig, LlamaModel

    (seq_len,) = check_shape("llama", input_shape)
    vocab = check_num_classes("llama", num_classes)
    if size not in LLAMA_SIZES:
        raise ValueError(f"model 'llama': unknown size {size!r}; sizes: {sorted(LLAMA_SIZES)}")
    base = LLAMA_SIZES[size]
    dims = {
        "hidden": base.hidden if hidden is None else hidden,
        "intermediate": base.intermediate if intermediate is None else intermediate,
        "heads": base.heads if heads is None else heads,
        "layers": base.layers if layers is None else layers,
    }
    bad = {k: v for k, v in dims.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"model 'llama': dimensions must be positive integers, got {bad}")
    if dims["hidden"] % dims["heads"]:
        raise ValueError(
            f"model 'llama': hidden={dims['hidden']} is not divisible by heads={dims['heads']}"
        )
    head_dim = dims["hidden"] // dims["heads"]
    if head_dim % 2:
        raise ValueError(
            f"model 'llama': head size hidden/heads = {dims['hidden']}/{dims['heads']} = "
            f"{head_dim} is odd; rotary position embeddings rotate pairs of dimensions, so choose "
            "an even head size"
        )
    positions = max(seq_len, 1024) if max_position_embeddings is None else max_position_embeddings
    if seq_len > positions:
        raise ValueError(
            f"model 'llama': sequences of {seq_len} tokens exceed max_position_embeddings="
            f"{positions}"
        )
    config: Any = LlamaConfig(
        vocab_size=vocab,
        hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["heads"],
        num_hidden_layers=dims["layers"],
        max_position_embeddings=positions,
        rms_norm_eps=rms_norm_eps,
        initializer_range=initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        hidden_act="silu",
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
    )
    with quiet_transformers():
        backbone = LlamaModel(config)
    model = CausalLM(backbone, dims["hidden"], vocab)
    nn.init.normal_(model.head.weight, mean=0.0, std=initializer_range)
    return model


llama.takes_token_ids = True  # type: ignore[attr-defined]
llama.causal_lm = True  # type: ignore[attr-defined]
