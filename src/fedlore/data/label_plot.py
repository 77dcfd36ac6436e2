"""The label-distribution plot of a federation: how many training examples of each class every
client holds (``fedlore partition CONFIG --plot FILE.png``).

:func:`label_counts` gives the matrix the plot is drawn from (the federation's
:meth:`~fedlore.data.container.Federation.histogram`: true classes before label flips; target
deciles for a regression source; source groups for a pre-training corpus) with a name for every
column; :func:`label_figure` draws it, as stacked bars per client for up to
:data:`MAX_STACKED` columns, else as a heat map (clients x classes); :func:`save_label_plot`
writes it atomically (:func:`fedlore.atomic.save_figure`). Figures are bare
:class:`matplotlib.figure.Figure` objects on the Agg canvas, as in :mod:`fedlore.results.plots`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fedlore.atomic import save_figure
from fedlore.data.histogram import Counted
from fedlore.data.holdout import TARGET_STRATA

MAX_STACKED = 20
"""Most classes drawn as stacked bars (``kind="auto"``); more are drawn as a heat map."""


def label_counts(fed: Counted) -> tuple[np.ndarray, list[str]]:
    """Training examples per client and class, int64 ``[N, K]``, and the K column names (class
    names; ``decile d`` of a regression source's targets; a corpus's source groups)."""
    counts = np.asarray(fed.histogram(), dtype=np.int64)
    if fed.group_histogram is not None:
        names = [str(g) for g in fed.group_names]
    elif fed.strata is not None:
        names = [f"decile {d}" for d in range(TARGET_STRATA)]
    else:
        names = [str(c) for c in fed.class_names]
    if len(names) != counts.shape[1]:
        names = [str(c) for c in range(counts.shape[1])]
    return counts, names


def label_figure(fed: Counted, kind: Literal["auto", "bars", "heatmap"] = "auto") -> Figure:
    """The per-client label distribution of ``fed`` (see the module docstring).

    Args:
        fed: the federation (anything with its histogram, e.g. a
            :class:`~fedlore.data.container.Federation`).
        kind: ``bars`` (stacked bars, one per client, one colour per class), ``heatmap``
            (clients x classes, colour = count), or ``auto`` (bars up to :data:`MAX_STACKED`
            classes).

    Returns:
        The figure; its axes hold the counts of :func:`label_counts` (bar heights, or the
        heat map's image array).
    """
    counts, names = label_counts(fed)
    clients = np.arange(counts.shape[0])
    if kind == "auto":
        kind = "bars" if counts.shape[1] <= MAX_STACKED else "heatmap"
    fig = Figure(figsize=(min(4.0 + 0.3 * len(clients), 16.0), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    what = "documents" if fed.group_histogram is not None else "training examples"
    ax.set_title(f"{fed.source}: {what} per client and class ({len(clients)} clients)")
    if kind == "bars":
        colors = _colors(len(names))
        bottom = np.zeros(len(clients), dtype=np.int64)
        for k, name in enumerate(names):
            ax.bar(clients, counts[:, k], bottom=bottom, color=colors[k], label=name, width=0.8)
            bottom += counts[:, k]
        ax.set_ylabel(what)
        ax.legend(title="class", loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    else:
        image = ax.imshow(counts.T, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(image, ax=ax, label=what)
        ax.set_ylabel("class")
        if len(names) <= 40:
            ax.set_yticks(np.arange(len(names)), labels=names, fontsize="small")
    ax.set_xlabel("client")
    if len(clients) <= 40:
        ax.set_xticks(clients)
    return fig


def _colors(n: int) -> list[tuple[float, float, float, float]]:
    """``n`` distinct colours: matplotlib's tab10 up to 10, tab20 up to 20."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(k % cmap.N) for k in range(n)]


def save_label_plot(
    fed: Counted, path: str | Path, kind: Literal["auto", "bars", "heatmap"] = "auto"
) -> Path:
    """Write :func:`label_figure` to ``path`` (format from its suffix; atomically).

    Returns:
        The path written.

    Raises:
        WriteError: when the file cannot be written.
    """
    path = Path(path)
    save_figure(label_figure(fed, kind), path, dpi=120)
    return path
