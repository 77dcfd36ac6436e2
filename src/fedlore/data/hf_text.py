"""Text inputs of the ``hf`` source: one string column, or a sentence pair.

``data.input_column`` names one column, or a list of exactly two string columns, e.g.
``[sentence1, sentence2]`` (GLUE's MRPC, RTE; ``[question, sentence]`` for QNLI,
``[premise, hypothesis]`` for MNLI). One column is tokenized as the text sources do
(:func:`fedlore.data.text.tokenize`). A pair is encoded as Hugging Face's ``run_glue.py`` does,
with the tokenizer's pair call ``tokenizer(first, second, truncation=True,
max_length=data.max_length)``: ``[CLS] first [SEP] second [SEP]`` for BERT-style tokenizers,
the longer sentence cut first (``longest_first``), so both keep tokens; then padded with the pad
id to ``data.max_length`` as every text source is.

The examples stay one int64 tensor ``[N, L]`` of token ids. The model rebuilds what else the
tokenizer returns from the ids: the attention mask from the pad id and, for an encoder with
token types (BERT, MiniLM), the second sentence's type 1 from the separator
(:func:`fedlore.models.text.token_types`). The encoding checks that this rebuild gives the
tokenizer's own ``attention_mask`` and ``token_type_ids`` for every pair, so a first sentence
holding the separator token itself (``[SEP]`` typed into the text) is refused rather than
mis-typed, and a sentence holding the pad token (``[PAD]``) rather than masked out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fedlore.data.hf_columns import refuse_missing
from fedlore.data.text import mask_not_rebuilt, tokenize
from fedlore.models.text import token_types

TEXT_DTYPES = ("string", "large_string")
"""``datasets`` value dtypes of a text column."""

PAIR_HINT = (
    "data.input_column names one column, or the two string columns of a sentence pair, e.g. "
    "[sentence1, sentence2]"
)

Rows = list[tuple[str, ...]]
"""The texts of a split: one tuple per example, of one string (a text) or two (a pair)."""


def input_columns(input_column: str | Sequence[str]) -> tuple[str, ...]:
    """``data.input_column`` as a tuple of one column, or of the two columns of a pair.

    Raises:
        ValueError: for a list of other than two columns, a name that is not a non-empty
            string, or the same column twice.
    """
    if isinstance(input_column, str):
        return (input_column,)
    columns = list(input_column)
    if len(columns) != 2:
        raise ValueError(
            f"hf: data.input_column={columns!r} names {len(columns)} columns; {PAIR_HINT}"
        )
    bad = [c for c in columns if not isinstance(c, str) or not c]
    if bad:
        raise ValueError(f"hf: data.input_column={columns!r}: {bad[0]!r} is not a column name")
    if columns[0] == columns[1]:
        raise ValueError(
            f"hf: data.input_column={columns!r} names column {columns[0]!r} twice; a pair is "
            "two different columns"
        )
    return (columns[0], columns[1])


def is_text(feature: Any) -> bool:
    """Whether a ``datasets`` feature is a string column."""
    return getattr(feature, "dtype", None) in TEXT_DTYPES


def read_texts(ds: Any, columns: tuple[str, ...], features: list[Any], where: str) -> Rows:
    """The texts of a split's input ``columns`` (one, or a pair), row by row.

    Raises:
        ValueError: naming the split, the column and the row, for a pair column that does not
            hold strings, a row without a value (None: in a CSV file, an empty field; in every
            row: the split's files lack the column), or, in a
            pair, a sentence that is empty or only white space.
    """
    pair = len(columns) == 2
    for column, feature in zip(columns, features, strict=True):
        if not is_text(feature):
            raise ValueError(
                f"hf: {where}: column {column!r} of the sentence pair {list(columns)} holds "
                f"{feature}, not strings; {PAIR_HINT}"
            )
    read = ds.select_columns(list(columns))[:]
    values = [list(read[c]) for c in columns]
    for column, texts in zip(columns, values, strict=True):
        refuse_missing(texts, column, where)
        for row, text in enumerate(texts):
            if pair and not str(text).strip():
                raise ValueError(
                    f"hf: {where}: row {row} has an empty sentence in column {column!r}; every "
                    "example of a pair needs both sentences"
                )
    return [tuple(str(t) for t in row) for row in zip(*values, strict=True)]


def encode(tokenizer: Any, rows: Rows, max_length: int, where: str) -> torch.Tensor:
    """Token ids ``[N, L]`` of a split's texts (:func:`tokenize`) or pairs
    (:func:`tokenize_pairs`)."""
    if rows and len(rows[0]) == 2:
        return tokenize_pairs(
            tokenizer, [r[0] for r in rows], [r[1] for r in rows], max_length, where
        )
    return tokenize(tokenizer, [r[0] for r in rows], max_length, f"hf: {where}")


def tokenize_pairs(
    tokenizer: Any,
    firsts: Sequence[str],
    seconds: Sequence[str],
    max_length: int,
    where: str = "pairs",
) -> torch.Tensor:
    """Token ids of sentence pairs: ``tokenizer(first, second, truncation=True,
    max_length=max_length)`` (``longest_first``: the longer sentence is cut first), padded to
    ``max_length`` with ``tokenizer.pad_token_id``.

    Args:
        tokenizer: a Hugging Face tokenizer with a pad and a separator token.
        firsts: N first sentences.
        seconds: N second sentences.
        max_length: ``L``, tokens per pair including the special tokens.
        where: the data named in errors.

    Returns:
        int64 ``[N, L]``.

    Raises:
        ValueError: when the tokenizer has no separator token (its pair encoding would run the
            two sentences together), ``max_length`` leaves no room for a token of each
            sentence, or a pair's attention mask or token types cannot be rebuilt from its ids
            (naming the row: the pad token typed into a sentence, the separator into the
            first).
    """
    sep = tokenizer.sep_token_id
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    if sep is None or specials <= tokenizer.num_special_tokens_to_add(pair=False):
        raise ValueError(
            f"hf: {where}: the tokenizer ({type(tokenizer).__name__}, "
            f"{getattr(tokenizer, 'name_or_path', '')}) has no separator token between the "
            "sentences of a pair, so the model could not tell them apart; use a BERT-style "
            "tokenizer (data.tokenizer, e.g. all-MiniLM-L6-v2) or one text column"
        )
    if max_length < specials + 2:
        raise ValueError(
            f"hf: {where}: data.max_length={max_length} leaves no room for both sentences of a "
            f"pair: the tokenizer adds {specials} special tokens; use at least {specials + 2}"
        )
    if not firsts:
        return torch.zeros(0, max_length, dtype=torch.int64)
    enc = tokenizer(
        list(firsts),
        list(seconds),
        padding="max_length",
        truncation="longest_first",
        max_length=max_length,
        return_tensors="pt",
    )
    ids = enc["input_ids"].to(torch.int64)
    pad = int(tokenizer.pad_token_id)
    # what the model rebuilds from the ids: the attention mask from the pad id, the token types
    # from the first separator; a row where either differs from the tokenizer's own is refused
    wrong = mask_not_rebuilt(ids, enc, pad)
    if "token_type_ids" in enc:
        wrong |= (token_types(ids, sep, pad) != enc["token_type_ids"]).any(dim=1)
    if bool(wrong.any()):
        row = int(torch.nonzero(wrong)[0])
        raise ValueError(
            f"hf: {where}: row {row}: the model rebuilds a pair's attention mask and token types "
            f"from its ids, but {_rebuild_fails(tokenizer, firsts[row], seconds[row])}"
        )
    return ids


def _rebuild_fails(tokenizer: Any, first: str, second: str) -> str:
    """Why the ids of the pair ``(first, second)`` do not give back the tokenizer's attention
    mask or token types: a special token typed into the text, else the tokenizer's layout."""
    pad, sep = tokenizer.pad_token, tokenizer.sep_token
    for which, text in (("first", first), ("second", second)):
        if pad in text:  # its id would be masked out as padding
            return (
                f"its {which} sentence holds the pad token {pad!r} itself, which the model "
                "would mask out as padding; remove it from the text"
            )
    if sep in first:  # the second sentence's type would start at it
        return (
            f"its first sentence holds the separator token {sep!r} itself; remove it from the text"
        )
    return (
        "this tokenizer does not mark the second sentence as the tokens after the first "
        f"separator {sep!r}; pick another tokenizer (data.tokenizer)"
    )
