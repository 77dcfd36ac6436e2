"""C4-format JSONL files (one object per line with ``text`` and ``url``; the layout of the C4
shards ``c4-train.*.json.gz`` / ``c4-validation.*.json.gz``): reading and writing them, building
a :class:`~fedlore.data.corpus.Corpus` from documents, and the ``c4`` source (a local folder of
shards).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fedlore.atomic import replacing
from fedlore.data.corpus import Corpus, group_documents
from fedlore.data.corpus_tokenizer import DEFAULT_VOCAB_SIZE, load_lm_tokenizer, train_bpe_tokenizer
from fedlore.progress import say
from fedlore.registry import register_source

C4_HINT = (
    "data.root must be a folder holding C4-format JSONL files (one object per line with 'text' "
    "and 'url'): training files with 'train' in their name and validation files with "
    "'validation' in it, e.g. c4-train.00000-of-01024.json.gz and "
    "c4-validation.00000-of-00008.json.gz from allenai/c4 (en), fetched with your own tools. "
    "For a real corpus that is already on disk, convert Debian's fortunes "
    "(`apt-get install fortunes fortunes-min`) with `fedlore fortunes-c4 OUT_DIR`, or use "
    "data.name=fortunes_c4."
)

C4_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
JSONL_FORMAT = "one JSON object per line (JSONL), each with a string 'text' and a 'url'"


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
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(C4_SUFFIXES))
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
