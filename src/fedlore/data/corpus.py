"""C4-format corpora for federated language-model pre-training (seed 000, "C4 Partitioning
Protocol").

A corpus is a set of documents, each a JSON object with a ``text`` and a ``url`` field (the
layout of the C4 shards ``c4-train.*.json.gz`` / ``c4-validation.*.json.gz``). Pipeline:

1. **Source groups.** Each training document's group is the hostname of its URL, lower-cased,
   with one leading ``www.`` removed; subdomains stay separate groups; missing or invalid URLs
   form one group :data:`UNKNOWN_SOURCE` (:func:`source_group`). The group is partitioning
   metadata only: it never enters the text.
2. **Allocation** (done by :func:`fedlore.data.federation.build_federation` with the
   ``source_dirichlet`` partitioner of :mod:`fedlore.data.partition`): documents are assigned to
   clients *before* tokenization.
3. **Tokenization and packing** (:func:`pack_documents`): per client, documents are tokenized
   with one tokenizer, each followed by an end-of-sequence token, concatenated and cut into
   sequences of ``L`` tokens; the last incomplete sequence is padded. No sequence mixes clients.
   Targets are the next tokens, with :data:`IGNORE_INDEX` at padding and at each sequence's last
   position, so padding never counts in the loss or the perplexity.
4. **Validation.** A separate validation corpus (the ``validation`` files), packed the same way,
   identical for every method and seed.

Tokenizer: a local Hugging Face tokenizer folder (``data.tokenizer``), or, by default, a
byte-level BPE (Sennrich et al. 2016; GPT-2's byte-level variant) trained with the
``tokenizers`` library on the training documents, with special tokens ``<pad>`` (id 0) and
``<eos>`` (id 1). Training is deterministic: the same corpus gives the same vocabulary.

Sources: ``c4`` (a folder of C4 JSONL shards, plain or gzipped) and ``fortunes_c4`` (the Debian
fortunes corpus converted on the fly by :func:`fortunes_c4_records`, one source per category
file; ``fedlore fortunes-c4 OUT`` writes the same records as C4 JSONL files).
"""

from __future__ import annotations

import gzip
import hashlib
import ipaddress
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from fedlore.atomic import replacing
from fedlore.data.client_data import TensorSplit
from fedlore.progress import say
from fedlore.registry import register_source

UNKNOWN_SOURCE = "<unknown>"
"""Source group of documents whose URL is missing or has no valid hostname."""

IGNORE_INDEX = -100
"""Target id of positions that do not count in the loss (padding; torch's default
``ignore_index``)."""

DEFAULT_VOCAB_SIZE = 4096
"""Vocabulary size of the BPE tokenizer trained when ``data.tokenizer`` is not set."""

PAD_TOKEN, EOS_TOKEN = "<pad>", "<eos>"
"""Special tokens of the trained BPE tokenizer (ids 0 and 1)."""

FORTUNES_C4_HOST = "{category}.fortunes.example"
"""Host of a converted fortune: one subdomain per category file (``.example``: RFC 2606)."""

FORTUNES_C4_EXCLUDED = ("ethnic", "men-women")
"""fortunes categories left out of the converted corpus by default (stereotypes)."""

VALIDATION_FRACTION = 0.05
"""Share of each fortunes category held out as the converted validation corpus."""

VALIDATION_SEED = 0
"""Seed of that fixed held-out draw (the same for every run and experiment seed)."""

C4_HINT = (
    "data.root must be a folder holding C4-format JSONL files (one object per line with 'text' "
    "and 'url'): training files with 'train' in their name and validation files with "
    "'validation' in it, e.g. c4-train.00000-of-01024.json.gz and "
    "c4-validation.00000-of-00008.json.gz from allenai/c4 (en), fetched with your own tools. "
    "For a real corpus that is already on disk, convert Debian's fortunes "
    "(`apt-get install fortunes fortunes-min`) with `fedlore fortunes-c4 OUT_DIR`, or use "
    "data.name=fortunes_c4."
)

_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
_SCHEME_ONLY = re.compile(r"^[A-Za-z][A-Za-z0-9+-]*:(?!\d+(/|$))")
JSONL_FORMAT = "one JSON object per line (JSONL), each with a string 'text' and a 'url'"
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


def _open_binary(path: Path) -> Any:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def read_c4_file(path: str | Path) -> list[tuple[str, Any]]:
    """The documents of one C4-format JSONL file (plain or ``.gz``).

    Args:
        path: the file; one JSON object per line with a string ``text`` and an optional ``url``
            (other fields, e.g. C4's ``timestamp``, are ignored); blank lines are skipped.

    Returns:
        ``(text, url)`` pairs in file order (``url`` None when the field is absent).

    Raises:
        ValueError: naming the file and line of invalid JSON, a non-object, or a missing or
            non-string ``text``.
    """
    path = Path(path)
    docs: list[tuple[str, Any]] = []
    try:
        with _open_binary(path) as f:
            for i, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8-sig" if i == 1 else "utf-8")  # BOM allowed
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{i}: not UTF-8 text ({e})") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}:{i}: not valid JSON ({e}); C4 files hold {JSONL_FORMAT}"
                    ) from None
                if not isinstance(obj, dict):
                    raise ValueError(
                        f"{path}:{i}: expected a JSON object, got {type(obj).__name__}; C4 files "
                        f"hold {JSONL_FORMAT}"
                    )
                if "text" not in obj:
                    raise ValueError(f"{path}:{i}: no field 'text' (fields: {sorted(obj)})")
                text = obj["text"]
                if not isinstance(text, str):
                    raise ValueError(
                        f"{path}:{i}: field 'text' must be a string, got {type(text).__name__}"
                    )
                docs.append((text, obj.get("url")))
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: cannot read ({e})") from e
    return docs


def find_c4_files(root: str | Path | None) -> tuple[list[Path], list[Path]]:
    """The training and validation files of a C4-format folder.

    Files end in ``.json``, ``.jsonl``, ``.json.gz`` or ``.jsonl.gz``; a name containing
    ``validation`` marks a validation file, one containing ``train`` a training file.

    Returns:
        ``(train_files, validation_files)``, each sorted by name.

    Raises:
        FileNotFoundError: when ``root`` is None, not a folder, or lacks either kind of file
            (naming the folder, the files it holds and how to get data).
    """
    if root is None:
        raise FileNotFoundError(f"c4: no data.root given. {C4_HINT}")
    folder = Path(root)
    if not folder.is_dir():
        raise FileNotFoundError(f"c4: folder {folder} does not exist. {C4_HINT}")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_SUFFIXES))
    validation = [p for p in files if "validation" in p.name]
    train = [p for p in files if "train" in p.name and p not in validation]
    if not train or not validation:
        raise FileNotFoundError(
            f"c4: {folder} holds {len(train)} training and {len(validation)} validation files "
            f"(JSONL files there: {[p.name for p in files][:10]}). {C4_HINT}"
        )
    return train, validation


def _read_documents(files: Sequence[Path], limit: int | None) -> list[tuple[str, Any]]:
    docs: list[tuple[str, Any]] = []
    for path in files:
        docs.extend(read_c4_file(path))
        if limit is not None and len(docs) >= limit:
            return docs[:limit]
    return docs


def build_corpus(
    name: str,
    train: Sequence[tuple[str, Any]],
    validation: Sequence[tuple[str, Any]],
    tokenizer: str | None,
    max_length: int,
    vocab_size: int,
) -> Corpus:
    """A :class:`Corpus` from ``(text, url)`` documents.

    Args:
        name: source name.
        train: training documents.
        validation: validation documents.
        tokenizer: local Hugging Face tokenizer folder, or None to train a BPE tokenizer of
            ``vocab_size`` on the training texts.
        max_length: ``L``.
        vocab_size: vocabulary size of the trained tokenizer (ignored with a folder).

    Raises:
        ValueError: when either corpus is empty, or from the tokenizer.
    """
    if tokenizer is not None and vocab_size != DEFAULT_VOCAB_SIZE:
        raise ValueError(
            f"data.vocab_size={vocab_size} has no effect with data.tokenizer={tokenizer!r} (the "
            "folder's tokenizer fixes the vocabulary); unset one of them"
        )
    if not train:
        raise ValueError(f"{name}: the training corpus holds no documents")
    if not validation:
        raise ValueError(f"{name}: the validation corpus holds no documents")
    texts = [t for t, _ in train]
    groups, names = group_documents([u for _, u in train])
    if tokenizer is None:
        say(
            "training a byte-level BPE tokenizer (%d tokens) on %d documents",
            vocab_size,
            len(texts),
        )
    tok = (
        train_bpe_tokenizer(texts, vocab_size)
        if tokenizer is None
        else load_lm_tokenizer(tokenizer)
    )
    return Corpus(
        name=name,
        train_texts=texts,
        train_groups=groups,
        group_names=names,
        validation_texts=[t for t, _ in validation],
        tokenizer=tok,
        max_length=max_length,
    )


@register_source("c4")
def load_c4(
    root: str | None = None,
    *,
    tokenizer: str | None = None,
    max_length: int = 64,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_documents: int | None = None,
    validation_documents: int | None = None,
) -> Corpus:
    """A C4-format corpus from a local folder (see :func:`find_c4_files`).

    Args:
        root: the folder of JSONL shards (required; nothing is downloaded).
        tokenizer: local Hugging Face tokenizer folder (None: train BPE on the training texts).
        max_length: ``L``, tokens per packed sequence.
        vocab_size: size of the trained BPE vocabulary.
        max_documents: keep the first this many training documents in file order (the
            "selected C4 training corpus"; None: all).
        validation_documents: keep the first this many validation documents (None: all).

    Returns:
        A :class:`Corpus`.

    Raises:
        FileNotFoundError: when the folder or its files are missing (with how to get them).
        ValueError: naming the file and line of a malformed document, or an empty corpus.
    """
    train_files, validation_files = find_c4_files(root)
    return build_corpus(
        "c4",
        _read_documents(train_files, max_documents),
        _read_documents(validation_files, validation_documents),
        tokenizer,
        max_length,
        vocab_size,
    )


def fortunes_c4_records(
    root: str | Path | None = None, categories: Sequence[str] | None = None
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The Debian fortunes corpus as C4-format records, one source per category file.

    Entry ``k`` of category ``cat`` becomes ``{"text": entry, "url":
    "https://<cat>.fortunes.example/<k>"}`` (:data:`FORTUNES_C4_HOST`), so the source-group
    protocol groups fortunes by their category file. A fixed :data:`VALIDATION_FRACTION` of
    each category (at least one entry when it has two or more; drawn with
    :data:`VALIDATION_SEED`) is the validation corpus; the rest, in file order, is training.

    Args:
        root: fortunes folder (None: ``/usr/share/games/fortunes``).
        categories: category files to convert (None: every category except
            :data:`FORTUNES_C4_EXCLUDED`).

    Returns:
        ``(train, validation)`` lists of ``{"text", "url"}`` dicts.

    Raises:
        FileNotFoundError: when the folder or a named category is missing (with the apt hint).
        ValueError: when no category has entries.
    """
    from fedlore.data.text import (
        FORTUNES_HINT,
        FORTUNES_ROOT,
        fortune_categories,
        read_fortune_file,
    )

    folder = Path(root) if root is not None else Path(FORTUNES_ROOT)
    present = fortune_categories(folder)
    jsonl = [c for c in present if c.endswith(_SUFFIXES)]
    if jsonl:
        raise ValueError(
            f"fortunes_c4: {folder} holds JSON files ({jsonl[:3]}), not fortune files; for a "
            "folder of C4-format JSONL use data.name=c4"
        )
    if categories is None:
        names = [c for c in present if c not in FORTUNES_C4_EXCLUDED]
    else:
        names = sorted(categories)
        missing = [c for c in names if c not in present]
        if missing:
            raise FileNotFoundError(
                f"fortunes: no category file {missing} in {folder}; present: {present}. "
                f"{FORTUNES_HINT}"
            )
    rng = np.random.default_rng(VALIDATION_SEED)
    train: list[dict[str, str]] = []
    validation: list[dict[str, str]] = []
    for cat in names:
        host = FORTUNES_C4_HOST.format(category=cat.lower())
        entries = read_fortune_file(folder / cat)
        n = len(entries)
        n_val = min(max(1, round(VALIDATION_FRACTION * n)), n - 1) if n > 1 else 0
        held = set(rng.permutation(n)[:n_val].tolist())
        for k, text in enumerate(entries):
            rec = {"text": text, "url": f"https://{host}/{k}"}
            (validation if k in held else train).append(rec)
    if not train:
        raise ValueError(f"fortunes: no entries in the categories {names} of {folder}")
    return train, validation


def write_c4_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Write records as C4-format JSONL (one object per line; gzipped if ``path`` ends in
    ``.gz``). Returns the number of records written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0  # written to <path>.tmp, renamed when complete
    with replacing(path, "wt", encoding="utf-8", compress=path.name.endswith(".gz")) as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


def convert_fortunes(out_dir: str | Path, root: str | Path | None = None) -> tuple[Path, Path]:
    """Write the fortunes corpus as ``c4-train.jsonl`` and ``c4-validation.jsonl`` in
    ``out_dir`` (see :func:`fortunes_c4_records`); returns the two paths. Rerunning overwrites
    them.

    Raises:
        ValueError: when ``out_dir`` is a file, or holds other JSON files that ``data.name=c4``
            would mix with the converted ones.
        FileNotFoundError: when the fortunes folder is missing.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"fortunes-c4: {out} exists and is not a folder")
    paths = (out / "c4-train.jsonl", out / "c4-validation.jsonl")
    others = sorted(
        p.name
        for p in (out.iterdir() if out.is_dir() else ())
        if p.name.endswith(_SUFFIXES) and p not in paths
    )
    if others:
        raise ValueError(
            f"fortunes-c4: {out} already holds other JSON files {others[:5]}, which data.name=c4 "
            "would read together with the converted corpus; choose an empty folder"
        )
    train, validation = fortunes_c4_records(root)
    write_c4_jsonl(train, paths[0])
    write_c4_jsonl(validation, paths[1])
    return paths


@register_source("fortunes_c4")
def load_fortunes_c4(
    root: str | None = None,
    *,
    tokenizer: str | None = None,
    max_length: int = 64,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    categories: Sequence[str] | None = None,
) -> Corpus:
    """The fortunes corpus through the C4 protocol, converted in memory (no files written).

    Args:
        root: fortunes folder (None: the Debian package's).
        tokenizer: local tokenizer folder (None: train BPE on the training entries).
        max_length: ``L``.
        vocab_size: size of the trained BPE vocabulary.
        categories: category files (None: all but :data:`FORTUNES_C4_EXCLUDED`).

    Returns:
        A :class:`Corpus` whose source groups are the category hosts.

    Raises:
        FileNotFoundError / ValueError: see :func:`fortunes_c4_records` and :func:`build_corpus`.
    """
    train, validation = fortunes_c4_records(root, categories)
    return build_corpus(
        "fortunes_c4",
        [(r["text"], r["url"]) for r in train],
        [(r["text"], r["url"]) for r in validation],
        tokenizer,
        max_length,
        vocab_size,
    )
