"""How ``lr_grid.py`` chooses and reports a rate: the selection score of a finished run, which
runs diverged, the edge-of-grid warning, and the cells of ``table.md`` and the values of
``table.json`` (strict JSON: a diverged point is null there and named under ``diverged_*``)."""

from __future__ import annotations

import math
import statistics
from typing import Any


def score(result: dict[str, Any]) -> float:
    """The selection score of a finished run (higher is better): the final accuracy on the
    selection split, minus the final selection perplexity for a language model, minus the final
    selection RMSE for regression; ``-inf`` for a run that diverged (its summary says so, or its
    final selection score is missing or not finite).

    Raises:
        SystemExit: when the run has no selection-split score (``data.selection_fraction`` 0):
            the reported test set must not choose the rate.
    """
    if "final_perplexity" in result:
        if "final_selection_perplexity" not in result:
            raise SystemExit(NO_SELECTION)
        value, sign = result["final_selection_perplexity"], -1.0
    elif "final_rmse" in result:  # regression: the lowest selection RMSE
        if "final_selection_rmse" not in result:
            raise SystemExit(NO_SELECTION)
        value, sign = result["final_selection_rmse"], -1.0
    else:
        if "final_selection_accuracy" not in result and result.get("final_accuracy") is not None:
            raise SystemExit(NO_SELECTION)
        value, sign = result.get("final_selection_accuracy"), 1.0
    if diverged(result) or value is None or not math.isfinite(float(value)):
        return -float("inf")
    return sign * float(value)


def diverged(result: dict[str, Any]) -> str | None:
    """Why a finished run counts as diverged (its summary's ``diverged``: a training loss gone
    non-finite, or test predictions not finite or blown up), or None."""
    why = result.get("diverged")
    return str(why) if why else None


def strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None: ``table.json`` is strict JSON
    (``NaN`` is not JSON); the diverged points are named in their own keys."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


def cell(value: float | None, spec: str) -> str:
    """A number of ``table.md``, or ``diverged`` for a point with no finite score."""
    if value is None or not math.isfinite(value):
        return "diverged"
    return format(value, spec)


NO_SELECTION = (
    "lr_grid: the runs have no selection-split score; set data.selection_fraction (e.g. 0.1) "
    "so that the rate is chosen on held-out training data, not on the reported test set"
)


def grid_edge(rates: list[float], best: float) -> str | None:
    """``"top"`` or ``"bottom"`` when ``best`` is the largest or smallest of a grid of at least
    two rates (the best rate may lie beyond it), else None."""
    if len(rates) < 2:
        return None
    return "top" if best == max(rates) else "bottom" if best == min(rates) else None


MAX_STEP = 10.0
"""The largest step between neighbouring rates (a factor) that :func:`edge_warning` extends a
grid by; a coarser grid is filled in a decade at a time instead."""


def edge_warning(method: str, rates: list[float], best: float) -> str | None:
    """The line that says a chosen rate sits at an edge of its grid, and how to widen it: one
    more step of the grid's own ratio beyond the edge, or, when that step is coarser than
    :data:`MAX_STEP` (``1e-2,1e6``: extrapolating it would suggest ``1e-10``), rates a decade
    either side of the chosen one, between it and its neighbour too."""
    edge = grid_edge(rates, best)
    if edge is None:
        return None
    ordered = sorted(rates)
    inner = ordered[-2] if edge == "top" else ordered[1]  # the chosen rate's one neighbour
    step = best / inner  # > 1 at the top, < 1 at the bottom
    head = (
        f"warning: {method} chose lr {best:g}, the {edge} of its grid "
        f"{','.join(f'{r:g}' for r in ordered)}: a better rate may lie beyond it; "
    )
    if max(step, 1 / step) <= MAX_STEP:
        return (
            f"{head}widen the grid (e.g. --grid {method}={best * step:.2g},...) before trusting "
            "the choice"
        )
    around = f"{best / MAX_STEP:.2g},{best:g},{best * MAX_STEP:.2g}"
    return (
        f"{head}the grid is too coarse to extend by its own step ({best:g} to {inner:g}, a "
        f"factor of {max(step, 1 / step):.0e}): fill it in a decade at a time around the chosen "
        f"rate (e.g. --grid {method}={around}) before trusting the choice"
    )


def mean_cell(mean: float, std: float, spec: str, diverged_seeds: int) -> str:
    """``mean ± std`` in ``table.md``, ``(k diverged)`` after it when seeds are left out, and
    ``diverged`` when every seed did."""
    if not math.isfinite(mean):
        return "diverged"
    note = f" ({diverged_seeds} diverged)" if diverged_seeds else ""
    return f"{format(mean, spec)} ± {format(std, spec)}{note}"


NO_SCORE = "no finite final score"
"""The reason ``table.json`` gives for a diverged point whose summary names none."""


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std of the finite values (NaN, NaN when none; std 0 with one)."""
    xs = [v for v in values if math.isfinite(v)]
    if not xs:
        return float("nan"), float("nan")
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0
