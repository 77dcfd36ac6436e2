"""The plain-text table of a federation's per-client counts (``fedlore partition``): training
examples per client and class, target decile (regression) or source group (a pre-training
corpus)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from fedlore.data.holdout import TARGET_STRATA


class Counted(Protocol):
    """What the table reads of a :class:`~fedlore.data.container.Federation`."""

    @property
    def source(self) -> str: ...
    @property
    def num_clients(self) -> int: ...
    @property
    def num_classes(self) -> int: ...
    @property
    def class_names(self) -> list[str]: ...
    @property
    def group_names(self) -> tuple[str, ...]: ...
    @property
    def group_histogram(self) -> np.ndarray | None: ...
    @property
    def strata(self) -> np.ndarray | None: ...

    def histogram(self) -> np.ndarray: ...


def format_histogram(fed: Counted, max_columns: int = 40) -> str:
    """A plain-text table: one row per client with its count per class and its total.

    With more than ``max_columns`` classes or source groups (a web corpus has thousands of
    hosts) each row summarizes instead: total, groups present, and the largest group with
    its share. The title names the classes (fortunes categories, Fashion-MNIST garments)
    or source groups by column number where the data has names.
    """
    hist = fed.histogram()
    if hist.shape[1] > max_columns:
        names = list(fed.group_names) or [str(c) for c in range(hist.shape[1])]
        kind = "source groups" if fed.group_names else "classes"
        out = [
            f"{fed.source}: {fed.num_clients} clients, {hist.shape[1]} {kind} "
            f"(more than {max_columns}: one summary line per client)",
            "client | total | groups present | largest group (share)",
        ]
        for i, h in enumerate(hist):
            top = int(h.argmax())
            share = h[top] / max(int(h.sum()), 1)
            out.append(
                f"{i:6d} | {int(h.sum()):5d} | {int((h > 0).sum()):14d} | "
                f"{names[top]} ({100 * share:.1f} %)"
            )
        return "\n".join(out)
    rows = [[str(i), *map(str, h), str(h.sum())] for i, h in enumerate(hist)]
    rows.append(["all", *map(str, hist.sum(axis=0)), str(hist.sum())])
    header = ["client", *map(str, range(hist.shape[1])), "total"]
    widths = [max(len(r[j]) for r in [header, *rows]) for j in range(len(header))]

    def fmt(r: list[str]) -> str:
        cells = [c.rjust(w) for c, w in zip(r, widths, strict=True)]
        return " ".join([cells[0], "|", *cells[1:-1], "|", cells[-1]])

    if fed.group_histogram is not None:
        title = (
            f"{fed.source}: {fed.num_clients} clients, {len(fed.group_names)} source "
            "groups, documents per client and group (groups: "
            + ", ".join(f"{j}={g}" for j, g in enumerate(fed.group_names))
            + ")"
        )
    elif fed.strata is not None:
        title = (
            f"{fed.source}: {fed.num_clients} clients, regression, training examples per "
            f"client and target decile (0 = lowest {100 // TARGET_STRATA} % of the targets)"
        )
    else:
        title = (
            f"{fed.source}: {fed.num_clients} clients, {fed.num_classes} classes, "
            "training examples per client and class"
        )
        named = [str(n) for n in fed.class_names]
        if named and named != [str(c) for c in range(len(named))]:  # digits name themselves
            title += " (classes: " + ", ".join(f"{j}={n}" for j, n in enumerate(named)) + ")"
    lines = [
        title,
        fmt(header),
        "-" * len(fmt(header)),
        *(fmt(r) for r in rows[:-1]),
        "-" * len(fmt(header)),
        fmt(rows[-1]),
    ]
    return "\n".join(lines)
