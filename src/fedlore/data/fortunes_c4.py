"""The Debian fortunes corpus through the C4 protocol: each fortune a C4-format record whose
host names its category file (so the source groups are the categories), a fixed held-out
validation share, the ``fortunes_c4`` source (converted in memory) and ``fedlore fortunes-c4
OUT`` (:func:`convert_fortunes`, the same records as C4 JSONL files).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedlore.data.c4 import C4_SUFFIXES, build_corpus, write_c4_jsonl
from fedlore.data.corpus import Corpus
from fedlore.data.corpus_tokenizer import DEFAULT_VOCAB_SIZE
from fedlore.registry import register_source

FORTUNES_C4_HOST = "{category}.fortunes.example"
"""Host of a converted fortune: one subdomain per category file (``.example``: RFC 2606)."""

FORTUNES_C4_EXCLUDED = ("ethnic", "men-women")
"""fortunes categories left out of the converted corpus by default (stereotypes)."""

VALIDATION_FRACTION = 0.05
"""Share of each fortunes category held out as the converted validation corpus."""

VALIDATION_SEED = 0
"""Seed of that fixed held-out draw (the same for every run and experiment seed)."""


def fortunes_c4_records(
    root: str | Path | None = None,
    categories: Sequence[str] | None = None,
    option: str = "data.root=...",
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
        option: the setting an error tells the user to point at another folder.

    Returns:
        ``(train, validation)`` lists of ``{"text", "url"}`` dicts.

    Raises:
        FileNotFoundError: when the folder or a named category is missing (with the apt hint).
        ValueError: when no category has entries.
    """
    from fedlore.data.text import (
        CATEGORIES_HINT,
        FORTUNES_ROOT,
        fortune_categories,
        fortunes_hint,
        read_fortune_file,
    )

    folder = Path(root) if root is not None else Path(FORTUNES_ROOT)
    present = fortune_categories(folder, option)
    jsonl = [c for c in present if c.endswith(C4_SUFFIXES)]
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
                f"fortunes: no category file {missing} in {folder}; present: {present}; "
                f"{CATEGORIES_HINT}. {fortunes_hint(option)}"
            )
    if not names:
        raise FileNotFoundError(f"fortunes: no category file in {folder}. {fortunes_hint(option)}")
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
    if not validation:  # files without a % line: not a fortunes folder
        raise ValueError(
            f"fortunes: no category of {folder} holds two entries (lines of % between them), so "
            f"none is held out for validation; is it a fortunes folder? {fortunes_hint(option)}"
        )
    return train, validation


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
        if p.name.endswith(C4_SUFFIXES) and p not in paths
    )
    if others:
        raise ValueError(
            f"fortunes-c4: {out} already holds other JSON files {others[:5]}, which data.name=c4 "
            "would read together with the converted corpus; choose an empty folder"
        )
    train, validation = fortunes_c4_records(root, option="--root FOLDER")
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
