"""Curves over seeds: mean with a ±std band (sample std, ddof=1), one line per method.

Figures are drawn on a bare :class:`matplotlib.figure.Figure` with the Agg canvas, so nothing
touches pyplot's global figure registry or the process-wide backend setting. A method has the
same colour in every figure (:func:`method_colors`); runs of one method made with different
configs share its colour and differ by line style. The log-scale bytes axis is labelled at
1, 2 and 5 of every decade in plain numbers.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from fedlore.atomic import save_figure
from fedlore.results.store import IncompleteRunWarning, RunRecord, value

BYTES_PER_MB = 1e6
"""MB here is the SI megabyte, 10^6 bytes."""

PerRound = dict[int, float]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1) of ``values``; the std is 0 for fewer than two values."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return float("nan"), float("nan")
    return float(arr.mean()), (float(arr.std(ddof=1)) if arr.size >= 2 else 0.0)


def by_round(rows: list[dict[str, Any]], key: str) -> PerRound:
    """round -> ``row[key]`` for the rows where it is a finite number."""
    out: PerRound = {}
    for r in rows:
        v = value(r, key)
        if v is not None:
            out[int(r["round"])] = v
    return out


def cumulative_mb(rows: list[dict[str, Any]]) -> PerRound:
    """round -> bytes up + down of rounds ``0..round`` (inclusive), in MB."""
    out: PerRound = {}
    total = 0.0
    for r in rows:
        total += (value(r, "bytes_up") or 0.0) + (value(r, "bytes_down") or 0.0)
        out[int(r["round"])] = total / BYTES_PER_MB
    return out


def aggregate(per_seed: list[PerRound]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and std over seeds at each round where at least one seed has a value.

    Returns:
        ``(rounds [T], mean [T], std [T])``.
    """
    rounds = sorted(set().union(*per_seed)) if per_seed else []
    stats = [mean_std([s[t] for s in per_seed if t in s]) for t in rounds]
    return (
        np.asarray(rounds, dtype=int),
        np.asarray([m for m, _ in stats], dtype=float),
        np.asarray([s for _, s in stats], dtype=float),
    )


PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#393b79",
    "#ad494a",
    "#637939",
    "#8c6d31",
    "#7b4173",
    "#3182bd",
    "#e6550d",
    "#31a354",
    "#756bb1",
    "#636363",
)  # tab10, then darker tab20b/c shades: 20 methods before a colour repeats
LINESTYLES = ("-", "--", ":", "-.")


def base_method(label: str) -> str:
    """The method of a curve label: ``"fedlore [lr=0.01]"`` -> ``"fedlore"``."""
    return label.split(" [", 1)[0]


COLOR_ORDER = (
    "fedlore", "fedfull", "local_galore", "fedit", "fedlore_random", "fedlore_fixed",
    "ffa_lora", "flexlora", "lora_fair", "rolora", "flora", "frlora",
    "fedavg", "meta_bayfl", "bayfl", "fedprox", "meta_fl", "meta_bayfl_mcd", "fedavg_mcd",
    "pfedbayes",
)  # fmt: skip
"""Methods with a fixed colour (``PALETTE[i]``), the same in every report; other methods take
the next free colour."""


def method_colors(labels: Sequence[str]) -> dict[str, tuple[str, str]]:
    """label -> (colour, line style): one colour per method, the same method in the same colour
    in every report (:data:`COLOR_ORDER`; a method outside it, or one whose colour another
    method of this report already has, takes the first free one), a line style per config
    variant of a method."""
    methods = list(dict.fromkeys(base_method(label) for label in labels))
    colours: dict[str, str] = {}
    for method in methods:  # the fixed colours first
        if method in COLOR_ORDER:
            colours[method] = PALETTE[COLOR_ORDER.index(method) % len(PALETTE)]
    used = set(colours.values())
    free = [c for c in PALETTE if c not in used]
    for i, method in enumerate(m for m in methods if m not in colours):
        colours[method] = free[i % len(free)] if free else PALETTE[i % len(PALETTE)]
    seen: dict[str, int] = {}
    out: dict[str, tuple[str, str]] = {}
    for label in labels:
        method = base_method(label)
        k = seen.get(method, 0)
        seen[method] = k + 1
        out[label] = (colours[method], LINESTYLES[k % len(LINESTYLES)])
    return out


def _plain(v: float, _: int) -> str:
    return f"{v:g}"


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    save_figure(fig, path, shared=True, dpi=120)  # a temporary file of its own, then renamed
    return path


def _curve_figure(
    runs: dict[str, list[RunRecord]],
    xy: Callable[[RunRecord], tuple[PerRound, PerRound]],
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    title: str | None = None,
    styles: dict[str, tuple[str, str]] | None = None,
) -> Figure:
    """One line per method: y mean ± std against x mean, both averaged over seeds per round."""
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot()
    styles = styles if styles is not None else method_colors(list(runs))
    for method, records in runs.items():
        pairs = [xy(r) for r in records]
        ys = [{t: v for t, v in y.items() if t in x} for x, y in pairs]
        rounds, y_mean, y_std = aggregate(ys)
        if rounds.size == 0:
            continue
        # x is averaged over the same seeds as y at each round.
        xs = [{t: x[t] for t in y} for (x, _), y in zip(pairs, ys, strict=True)]
        x_mean = np.asarray([np.mean([x[t] for x in xs if t in x]) for t in rounds])
        keep = x_mean > 0 if logx else np.ones_like(x_mean, dtype=bool)
        colour, style = styles.get(method, (None, "-"))
        (line,) = ax.plot(
            x_mean[keep],
            y_mean[keep],
            label=f"{method} (n={len(records)})",
            marker="o" if int(keep.sum()) <= 12 else None,  # a single point must be visible
            markersize=3,
            color=colour,
            linestyle=style,
        )
        ax.fill_between(
            x_mean[keep],
            (y_mean - y_std)[keep],
            (y_mean + y_std)[keep],
            color=line.get_color(),
            alpha=0.2,
            linewidth=0,
        )
    if logx:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(_plain))  # 0.5, 1, 2, 5, 10: no 10^x
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on short ranges
    if logy:
        ax.set_yscale("log")  # perplexity: often within one decade, so label 2, 3, 5, 7 too
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(_plain))
        ax.yaxis.set_minor_formatter(NullFormatter())
    if title:
        ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_lines():
        ax.legend()
    return fig


def _file_stem(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def plot(
    runs: dict[str, list[RunRecord]],
    out_dir: Path,
    keys: Sequence[str] | None = None,
    title: str | None = None,
) -> list[Path]:
    """Write ``accuracy_vs_round.png``, ``accuracy_vs_bytes.png`` (for language models
    ``perplexity_vs_round.png`` and ``perplexity_vs_bytes.png``, log scale; for regression
    ``rmse_vs_round.png`` and ``rmse_vs_bytes.png``) and one
    ``<key>_vs_round.png`` per extra key.

    Args:
        runs: method -> runs over seeds, as from :func:`fedlore.results.store.load_runs`.
        out_dir: directory for the PNGs (created if missing).
        keys: extra numeric row keys (e.g. diagnostics) to plot against the round.
        title: the figures' title (``fedlore report`` gives the experiment name and setting).

    Returns:
        The paths of the plots: written, or, when no run has a per-round score to draw, the
        score's two plots already there (kept as they were, with a warning); the extra keys'
        are drawn either way.

    Raises:
        ValueError: if an extra key has no finite numeric value in any row of any run.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def round_axis(key: str) -> Callable[[RunRecord], tuple[PerRound, PerRound]]:
        def xy(r: RunRecord) -> tuple[PerRound, PerRound]:
            y = by_round(r.rows, key)
            return {t: float(t) for t in y}, y

        return xy

    lm = any(by_round(r.rows, "perplexity") for records in runs.values() for r in records)
    regression = not lm and any(by_round(r.rows, "rmse") for rs in runs.values() for r in rs)
    metric = "perplexity" if lm else "rmse" if regression else "accuracy"

    def metric_vs_bytes(r: RunRecord) -> tuple[PerRound, PerRound]:
        return cumulative_mb(r.rows), by_round(r.rows, metric)

    styles = method_colors(list(runs))  # the same colour for a method in every figure
    names = [f"{metric}_vs_round.png", f"{metric}_vs_bytes.png"]
    if not any(by_round(r.rows, metric) for records in runs.values() for r in records):
        # an empty figure must not replace a drawn one: those there are kept, and linked
        written = [out_dir / n for n in names if (out_dir / n).is_file()]
        warnings.warn(
            f"{out_dir}: no run has a per-round {metric}: {' and '.join(names)} not redrawn"
            + (" (the ones there are kept)" if written else ""),
            IncompleteRunWarning,
            stacklevel=2,
        )
    else:
        written = [
            _save(
                _curve_figure(
                    runs, round_axis(metric), "round", metric, logy=lm, title=title, styles=styles
                ),
                out_dir / names[0],
            ),
            _save(
                _curve_figure(
                    runs,
                    metric_vs_bytes,
                    "cumulative MB (up + down), log scale",
                    metric,
                    logx=True,
                    logy=lm,
                    title=title,
                    styles=styles,
                ),
                out_dir / names[1],
            ),
        ]
    for key in keys or []:
        if not any(by_round(r.rows, key) for records in runs.values() for r in records):
            raise ValueError(f"plot: key {key!r} has no numeric value in any metrics row")
        fig = _curve_figure(runs, round_axis(key), "round", key, title=title, styles=styles)
        written.append(_save(fig, out_dir / f"{_file_stem(key)}_vs_round.png"))
    return written
