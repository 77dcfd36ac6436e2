"""The columns of the ``hf`` source's splits: a named column checked to be there, its values,
and the class labels (``data.label_column``) of every split as class ids and names.

A ``ClassLabel`` gives the classes and their names; non-negative integers are classes
``0 .. largest``; strings are numbered in sorted order (numerically when every label is an
integer), over both splits; a split none of whose labels the training split has is refused
(:func:`refuse_unseen`). ``datasets`` is imported only when labels are read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedlore.data.checks import DataWarning
from fedlore.data.text import label_order
from fedlore.progress import warn_once


def feature_of(ds: Any, column: str, key: str, where: str) -> Any:
    """The feature of ``column``, refused naming the split, the key and the columns there are."""
    if column not in ds.column_names:
        parts = [c.strip() for c in column.split(",")]
        pair = (
            f"; a sentence pair is a list: data.input_column=[{','.join(parts)}]"
            if key == "input_column" and len(parts) > 1 and set(parts) <= set(ds.column_names)
            else ""
        )
        raise ValueError(
            f"hf: {where} has no column {column!r} (data.{key}); its columns: "
            f"{ds.column_names}{pair}"
        )
    return ds.features[column]


def column_values(ds: Any, column: str) -> list[Any]:
    """One column's values as Python objects (images decoded), no other column read."""
    return list(ds.select_columns([column])[:][column])


def refuse_missing(values: list[Any], column: str, where: str) -> None:
    """Refuse a column with an empty (None) entry, naming its first row, or saying the split
    has no value in it at all (its files lack the column: ``datasets`` gives a column one split
    lacks None in every row of that split)."""
    empty = next((k for k, v in enumerate(values) if v is None), None)
    if empty is None:
        return
    if all(v is None for v in values):
        raise ValueError(
            f"hf: {where} has no value in column {column!r} in any of its {len(values)} rows "
            "(its files lack the column, which another split has)"
        )
    raise ValueError(f"hf: {where}: row {empty} has no value in column {column!r}")


def raw_labels(ds: Any, column: str, where: str) -> tuple[np.ndarray, list[str] | None]:
    """A label column as ``(values, ClassLabel names or None)``: ints, or strings (object)."""
    import datasets

    feature = feature_of(ds, column, "label_column", where)
    values = column_values(ds, column)
    refuse_missing(values, column, where)
    if isinstance(feature, datasets.ClassLabel):
        return np.asarray(values, dtype=np.int64), list(feature.names)
    if getattr(feature, "dtype", None) in ("string", "large_string"):
        return np.asarray([str(v) for v in values], dtype=object), None
    y = np.asarray(values)
    if y.dtype.kind not in "iu":
        raise ValueError(
            f"hf: {where}: label column {column!r} holds {feature}; the hf source reads class "
            "labels (a ClassLabel, integers or strings)"
        )
    return y.astype(np.int64), None


def class_ids(
    raw: dict[str, tuple[np.ndarray, list[str] | None]],
    column: str,
    root: str,
    train_split: str = "train",
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Class ids of every split and the class names (see the module docstring).

    Raises:
        ValueError: for labels of different kinds in the splits, a negative label or one past
            the ClassLabel names, and (integers or strings) a split none of whose labels
            ``train_split`` has (:func:`refuse_unseen`, which warns of some).
    """
    refuse_unseen(raw, column, root, train_split)
    kinds = {
        s: "strings" if v.dtype == object else "ClassLabel" if n is not None else "integers"
        for s, (v, n) in raw.items()
    }
    names = [n for _, n in raw.values()]
    if len(set(kinds.values())) > 1 or any(n != names[0] for n in names):
        raise ValueError(
            f"hf: {root}: label column {column!r} differs between the splits: {kinds}"
            + ("" if len(set(kinds.values())) > 1 else " with other ClassLabel names")
        )
    if next(iter(kinds.values())) == "strings":
        order = label_order([str(c) for v, _ in raw.values() for c in v.tolist()])
        index = {c: k for k, c in enumerate(order)}
        ids = {s: np.asarray([index[c] for c in v], dtype=np.int64) for s, (v, _) in raw.items()}
        return ids, order
    known = names[0]
    for s, (v, _) in raw.items():
        bad = np.flatnonzero((v < 0) | (v >= len(known) if known is not None else False))
        if len(bad):
            limit = f"outside its {len(known)} ClassLabel names" if known else "labels are >= 0"
            raise ValueError(
                f"hf: {root} (split {s!r}): row {int(bad[0])} has label {int(v[bad[0]])} in "
                f"column {column!r} ({limit})"
            )
    labels = {s: v for s, (v, _) in raw.items()}
    if known is not None:
        return labels, list(known)
    top = max((int(v.max()) + 1 for v in labels.values() if len(v)), default=1)
    return labels, [str(c) for c in range(top)]


def refuse_unseen(
    raw: dict[str, tuple[np.ndarray, list[str] | None]], column: str, root: str, train_split: str
) -> None:
    """Refuse a split none of whose integer or string labels the training split has, and warn
    of one with some such labels.

    A label no training example has cannot be learned: its test rows all count as errors. A
    split with no label in common with the training split is a mistake in the files: labels
    written as words in one split and as numbers in the other (``datasets`` casts the numbers
    to strings, ``"0"`` beside ``"yes"``), or another column. A ``ClassLabel`` names its
    classes itself (a class may have no example) and is not checked; nor is a test split alone
    (a site-local server's, no training split).
    """
    if train_split not in raw or raw[train_split][1] is not None:
        return
    known = {str(v) for v in raw[train_split][0].tolist()}
    for split, (values, _) in raw.items():
        unseen = [k for k, v in enumerate(values.tolist()) if str(v) not in known]
        if not unseen:  # (never in the training split itself)
            continue
        labels, first = sorted({str(values[k]) for k in unseen}), str(values[unseen[0]])
        said = (
            f"hf: {root} (split {split!r}): label {first!r} in column {column!r} (row "
            f"{unseen[0]}; {len(unseen)} of its {len(values)} rows, labels {labels}) is no label "
            f"of the training split {train_split!r} (its labels: {sorted(known)})"
        )
        if len(unseen) == len(values):
            raise ValueError(
                f"{said}, nor is any other of its labels; write the labels alike in every "
                "split (words or numbers), or give the column a ClassLabel naming every class"
            )
        warn_once(f"{said}: the model cannot learn it, so those rows count as errors", DataWarning)
