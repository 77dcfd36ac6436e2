"""The tokenizer of a pre-training corpus: a local Hugging Face tokenizer folder
(``data.tokenizer``), or, by default, a byte-level BPE (Sennrich et al. 2016; GPT-2's byte-level
variant) trained with the ``tokenizers`` library on the training documents, with special tokens
``<pad>`` (id 0) and ``<eos>`` (id 1). Training is deterministic: the same corpus gives the same
vocabulary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_VOCAB_SIZE = 4096
"""Vocabulary size of the BPE tokenizer trained when ``data.tokenizer`` is not set."""

PAD_TOKEN, EOS_TOKEN = "<pad>", "<eos>"
"""Special tokens of the trained BPE tokenizer (ids 0 and 1)."""


_TOKENIZERS: dict[tuple[str, int], Any] = {}
"""Trained tokenizers by (digest of the texts, vocabulary size): each seed of an experiment
and each Flower client process trains once (training is deterministic)."""


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` with the ``tokenizers`` library.

    Byte-level pre-tokenization (GPT-2, Radford et al. 2019) covers every input without an
    unknown token; ``<pad>`` gets id 0 and ``<eos>`` id 1. Deterministic for the same texts.

    Args:
        texts: the training documents.
        vocab_size: target vocabulary size (≥ 258: the 256 byte symbols plus the two special
            tokens); a small corpus may yield fewer merges.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with ``pad_token="<pad>"`` and
        ``eos_token="<eos>"``.

    Raises:
        ValueError: when ``vocab_size < 258`` or there are no texts.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (256 bytes + <pad> + <eos>), got {vocab_size}")
    if not texts:
        raise ValueError("cannot train a tokenizer on an empty corpus")
    digest = hashlib.sha1("\x00".join(texts).encode("utf-8", "surrogatepass")).hexdigest()
    if (digest, vocab_size) in _TOKENIZERS:
        return _TOKENIZERS[digest, vocab_size]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN)
    if len(_TOKENIZERS) >= 4:
        _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
    _TOKENIZERS[digest, vocab_size] = fast
    return fast


def load_lm_tokenizer(folder: str | Path) -> Any:
    """A tokenizer for packing from a local Hugging Face folder.

    Raises:
        FileNotFoundError: when the folder does not exist.
        ValueError: when it holds no loadable tokenizer or the tokenizer has no EOS token.
    """
    from transformers import AutoTokenizer

    from fedlore.models.common import quiet_transformers

    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(
            f"data.tokenizer folder {path} does not exist; leave data.tokenizer unset to train a "
            "BPE tokenizer on the training documents"
        )
    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"no usable tokenizer in {path} ({e})") from e
    if tok.eos_token_id is None:
        raise ValueError(
            f"the tokenizer in {path} has no EOS token, which packing puts after every "
            "document: point data.tokenizer at a folder whose tokenizer defines eos_token, or "
            "leave it unset to train a BPE tokenizer on the training documents"
        )
    return tok
