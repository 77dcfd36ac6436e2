"""The columns of the ``hf`` source's splits: a named column checked to be there, its values,
and the class labels (``data.label_column``) of every split as class ids and names.

A ``ClassLabel`` gives the classes and their names; non-negative integers are classes
``0 .. largest``; strings are numbered in sorted order (numerically when every label is an
integer), over both splits. ``datasets`` is imported only when labels are read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedlore.data.text import label_order


def feature_of(ds: Any, column: str, key: str, where: str) -> Any:
    """The feature of ``column``, refused naming the split, the key and the columns there are."""
    if column not in ds.column_names:
        raise ValueError(
            f"hf: {where} has no column {column!r} (data.{key}); its columns: {ds.column_names}"
        )
    return ds.features[column]


def column_values(ds: Any, column: str) -> list[Any]:
    """One column's values as Python objects (images decoded), no other column read."""
    return list(ds.select_columns([column])[:][column])


def refuse_missing(values: list[Any], column: str, where: str) -> None:
    """Refuse a column with an empty (None) entry, naming its first row."""
    empty = next((k for k, v in enumerate(values) if v is None), None)
    if empty is not None:
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
    raw: dict[str, tuple[np.ndarray, list[str] | None]], column: str, root: str
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Class ids of every split and the class names (see the module docstring)."""
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
