"""The pre-training corpus (seed 000, "C4 Partitioning Protocol"): the :class:`Corpus` of
documents, their source groups, and their tokenization and packing into sequences.

A corpus is a set of documents, each a JSON object with a ``text`` and a ``url`` field (the
layout of the C4 shards ``c4-train.*.json.gz`` / ``c4-validation.*.json.gz``). Pipeline:

1. **Source groups.** Each training document's group is the hostname of its URL, lower-cased,
   with one leading ``www.`` removed; subdomains stay separate groups; missing or invalid URLs
   form one group :data:`UNKNOWN_SOURCE` (:func:`source_group`). The group is partitioning
   metadata only: it never enters the text.
2. **Allocation** (done by :func:`fedlore.data.corpus_federation.corpus_federation` with the
   ``source_dirichlet`` partitioner of :mod:`fedlore.data.partition`): documents are assigned to
   clients *before* tokenization.
3. **Tokenization and packing** (:func:`pack_documents`): per client, documents are tokenized
   with one tokenizer, each followed by an end-of-sequence token, concatenated and cut into
   sequences of ``L`` tokens; the last incomplete sequence is padded. No sequence mixes clients.
   Targets are the next tokens, with :data:`IGNORE_INDEX` at padding and at each sequence's last
   position, so padding never counts in the loss or the perplexity.
4. **Validation.** A separate validation corpus (the ``validation`` files), packed the same way,
   identical for every method and seed.

This module holds the :class:`Corpus` and steps 1 and 3. The tokenizer (a local Hugging Face
folder, ``data.tokenizer``, or a byte-level BPE trained on the training documents) comes from
:mod:`fedlore.data.corpus_tokenizer`; the sources that read documents are ``c4``
(:mod:`fedlore.data.c4`, a folder of C4 JSONL shards) and ``fortunes_c4``
(:mod:`fedlore.data.fortunes_c4`, the Debian fortunes corpus converted on the fly).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from fedlore.data.client_data import TensorSplit

UNKNOWN_SOURCE = "<unknown>"
"""Source group of documents whose URL is missing or has no valid hostname."""

IGNORE_INDEX = -100
"""Target id of positions that do not count in the loss (padding; torch's default
``ignore_index``)."""

_SCHEME_ONLY = re.compile(r"^[A-Za-z][A-Za-z0-9+-]*:(?!\d+(/|$))")
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")


def source_group(url: Any) -> str:
    """The source group of a document: its URL's normalized hostname.

    Seed 000, "Domain-based grouping": the hostname, lower-cased, with a leading ``www.``
    removed; subdomains are kept apart (``blog.example.com`` and ``example.com`` are two groups).
    A URL without a scheme (``example.com/page``) is read as ``//example.com/page``, the way a
    browser would, provided its host has a dot; a scheme without ``//`` (``mailto:x@y.org``,
    ``https:/y.org``) has no hostname. Ports, user info and a trailing dot are not part of the
    hostname;
    internationalized names are compared in their IDNA (punycode) form; IP addresses are their
    own groups. A port that is not a number (``mailto:someone``) makes the URL invalid.

    Args:
        url: the document's ``url`` field (any JSON value).

    Returns:
        The normalized hostname, or :data:`UNKNOWN_SOURCE` when ``url`` is not a string or has
        no valid hostname (empty, garbage, invalid characters, labels longer than 63 bytes).
    """
    if not isinstance(url, str):
        return UNKNOWN_SOURCE
    text = url.strip()
    if not text or any(c.isspace() for c in text):
        return UNKNOWN_SOURCE
    schemeless = "://" not in text
    if schemeless:
        if _SCHEME_ONLY.match(text):  # 'mailto:x', 'https:/x.org', 'skype:123': no authority
            return UNKNOWN_SOURCE
        if not text.startswith("//"):
            text = "//" + text
    try:
        parts = urlsplit(text)
        host, _ = parts.hostname, parts.port  # .port raises on a port that is not a number
    except ValueError:  # an unbalanced '[' (IPv6), a port that is no number ('mailto:x')
        return UNKNOWN_SOURCE
    if not host:
        return UNKNOWN_SOURCE
    host = host.lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if schemeless and "." not in host:  # 'http//x.org', 'foo/bar': a word, not a hostname
        return UNKNOWN_SOURCE
    try:
        host = host.encode("idna").decode("ascii")
    except UnicodeError:
        return UNKNOWN_SOURCE
    if host.startswith("www."):
        host = host[4:]
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        return UNKNOWN_SOURCE
    return host


@dataclass(frozen=True)
class Corpus:
    """Documents for language-model pre-training, before allocation and tokenization.

    Attributes:
        name: registry name of the source.
        train_texts: the M training documents, in corpus order.
        train_groups: int64 ``[M]``, each document's source group (index into ``group_names``).
        group_names: C normalized hostnames (sorted; :data:`UNKNOWN_SOURCE` among them if used).
        validation_texts: the validation documents (identical for every method and seed).
        tokenizer: a Hugging Face tokenizer with ``eos_token_id`` (and a pad id, possibly EOS).
        max_length: ``L``, tokens per packed sequence.
    """

    name: str
    train_texts: list[str]
    train_groups: np.ndarray
    group_names: list[str]
    validation_texts: list[str]
    tokenizer: Any
    max_length: int

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (``len(tokenizer)``)."""
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        """The padding id: the tokenizer's pad token, else its EOS token."""
        pad = self.tokenizer.pad_token_id
        return int(self.tokenizer.eos_token_id if pad is None else pad)

    def pack(self, texts: Sequence[str]) -> TensorSplit:
        """Tokenize ``texts`` and pack them into sequences (see :func:`pack_documents`)."""
        ids = tokenize_documents(self.tokenizer, texts)
        return pack_documents(ids, int(self.tokenizer.eos_token_id), self.pad_id, self.max_length)


def group_documents(urls: Sequence[Any]) -> tuple[np.ndarray, list[str]]:
    """Source groups of documents.

    Args:
        urls: M ``url`` values (None for a missing field).

    Returns:
        ``(groups, names)``: int64 ``[M]`` indices into ``names``, the sorted distinct
        normalized hostnames (see :func:`source_group`).
    """
    hosts = [source_group(u) for u in urls]
    names = sorted(set(hosts))
    index = {h: i for i, h in enumerate(names)}
    return np.asarray([index[h] for h in hosts], dtype=np.int64), names


def tokenize_documents(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each document, without special tokens; text that spells a special token
    (``"<eos>"`` in a document) is tokenized as ordinary text, so it can neither end a document
    nor pose as padding."""
    from fedlore.models.common import quiet_transformers

    if not texts:
        return []
    with quiet_transformers():  # "longer than model_max_length": packing cuts documents anyway
        enc = tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True)
    return [list(ids) for ids in enc["input_ids"]]


def pack_documents(
    token_ids: Iterable[Sequence[int]], eos_id: int, pad_id: int, max_length: int
) -> TensorSplit:
    """Pack documents into next-token-prediction sequences of ``L`` tokens.

    Seed 000, "Tokenization and sequence construction": each document is followed by ``eos_id``,
    the documents are concatenated in the given order and cut into consecutive blocks of ``L``;
    the final incomplete block is padded with ``pad_id``. The target of position ``t`` is the
    token at ``t + 1`` of the same block; a block's last position and positions whose next token
    is padding get :data:`IGNORE_INDEX` (the standard causal-LM shift inside each block, as
    Hugging Face's ``labels`` do), so each full block yields ``L - 1`` predicted tokens.

    Args:
        token_ids: documents as lists of token ids (no special tokens).
        eos_id: the end-of-sequence id appended to every document.
        pad_id: the id filling the last block (never a target).
        max_length: ``L`` (≥ 2).

    Returns:
        A :class:`TensorSplit` with inputs int64 ``[n, L]`` and targets int64 ``[n, L]``;
        ``n = ceil(T / L)`` for ``T`` tokens in all (0 when there are no documents).

    Raises:
        ValueError: when ``max_length < 2``.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    stream: list[int] = []
    for doc in token_ids:
        stream.extend(int(t) for t in doc)
        stream.append(int(eos_id))
    total = len(stream)
    n = -(-total // max_length)
    flat = torch.full((n * max_length,), int(pad_id), dtype=torch.int64)
    flat[:total] = torch.tensor(stream, dtype=torch.int64)
    x = flat.view(n, max_length)
    real = (torch.arange(n * max_length) < total).view(n, max_length)
    y = torch.full_like(x, IGNORE_INDEX)
    y[:, :-1] = torch.where(real[:, 1:], x[:, 1:], IGNORE_INDEX)
    return TensorSplit(x, y)
