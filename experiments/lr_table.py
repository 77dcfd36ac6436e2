"""How ``lr_grid.py`` tabulates a finished grid: the run folders it reads, the bytes and seconds
per round of a run, ``table.json``'s record and ``table.md``'s rows at the chosen rates, and the
guard that keeps a published table a new one would lose results of."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lr_select import NO_SCORE, cell, diverged, grid_edge, mean_cell, mean_std

Summary = Callable[[str, str, float, str, int], dict[str, Any]]
"""``summary(root, name, lr, method, seed)``: a finished run's ``summary.json`` (lr_grid's)."""


class Unfinished(RuntimeError):
    """A run the table needs has not finished (or cannot be read, or is another config's)."""


def run_dir(root: str, name: str, lr: float, method: str, seed: int) -> Path:
    """The folder of the grid's run of ``method`` and ``seed`` at ``lr`` under ``root``."""
    return Path(root) / f"lr-{lr:g}" / name / method / f"seed-{seed}"


def damaged(method: str, seed: int, lr: float, path: Path, e: Exception) -> str:
    """One line for a run's file that cannot be read."""
    return f"{method} seed {seed} lr {lr:g}: {path} cannot be read ({type(e).__name__}: {e})"


def per_round(root: str, name: str, lr: float, method: str, seed: int) -> dict[str, float]:
    """Bytes per training round (all sampled clients together) and per client contact, every
    byte of the run counted (setup rounds included), and the largest optimizer state one client
    held, from ``metrics.jsonl``."""
    path = run_dir(root, name, lr, method, seed) / "metrics.jsonl"
    try:
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError) as e:  # a torn or edited row, a missing file
        raise Unfinished(damaged(method, seed, lr, path, e)) from None
    train = [r for r in rows if r["round"] >= 0]
    clients = sum(r.get("clients", 0) or 0 for r in train) or 1
    up, down = sum(r["bytes_up"] for r in rows), sum(r["bytes_down"] for r in rows)
    return {
        "up_per_round": up / len(train),
        "down_per_round": down / len(train),
        "up_per_client": up / clients,
        "down_per_client": down / clients,
        "setup_bytes": sum(r["bytes_up"] + r["bytes_down"] for r in rows if r["round"] < 0),
        "optimizer_state_bytes": max(r.get("optimizer_state_bytes", 0) for r in rows),
        "wall_s_per_round": sum(r["wall_s"] for r in train) / len(train),
    }


def tabulate(
    summary: Summary,
    runs_root: str,
    name: str,
    methods: list[str],
    seeds: list[int],
    grid: dict[str, list[float]],
    chosen: dict[str, float],
    head: dict[str, Any],
) -> tuple[dict[str, Any], list[str]]:
    """``table.json``'s record (``head``, then a row per method, in the order of ``methods``) and
    ``table.md``'s lines: each method's test metric at its chosen rate over ``seeds``, the first
    seed's selection-split scores over the grid, bytes, optimizer state and seconds per round."""
    first = seeds[0]
    ordered = {m: chosen[m] for m in methods}  # the config's order, not the grid's finishing one
    table: dict[str, Any] = {**head, "grid": grid, "chosen": ordered, "methods": {}}
    probe = summary(runs_root, name, chosen[methods[0]], methods[0], first)
    lm = "final_perplexity" in probe
    if lm:
        key, sel_key, scale, label = (
            "final_perplexity", "final_selection_perplexity", 1.0, "val PPL",
        )  # fmt: skip
    elif "final_rmse" in probe:  # regression
        key, sel_key, scale, label = "final_rmse", "final_selection_rmse", 1.0, "test RMSE"
    else:
        key, sel_key, scale, label = (
            "final_accuracy", "final_selection_accuracy", 100.0, "final acc. %",
        )  # fmt: skip

    def number(result: dict[str, Any], k: str) -> float:
        """The run's ``k`` in the table's unit; NaN (null in table.json) when it diverged."""
        v = result.get(k)
        return float("nan") if v is None or diverged(result) else scale * float(v)

    for method in methods:
        lr = chosen[method]
        runs = [summary(runs_root, name, lr, method, s) for s in seeds]
        vals = [number(r, key) for r in runs]
        losses = [number(r, "final_loss") / scale for r in runs]
        mean, std = mean_std(vals)  # over the seeds that did not diverge
        loss_mean, loss_std = mean_std(losses)
        comm: dict[str, Any] = dict(per_round(runs_root, name, lr, method, first))
        # seconds per round: the median over the seeds (runs of one grid may have finished in
        # different sittings, on another machine or beside other work; bytes do not vary)
        walls = {s: per_round(runs_root, name, lr, method, s)["wall_s_per_round"] for s in seeds}
        comm["wall_s_per_round"] = statistics.median(walls.values())
        comm["wall_s_per_round_per_seed"] = {str(s): w for s, w in walls.items()}
        grid_runs = {g: summary(runs_root, name, g, method, first) for g in grid[method]}
        table["methods"][method] = {
            "lr": lr,
            key: dict(zip(map(str, seeds), vals, strict=True)),
            "mean": mean,
            "std": std,
            "diverged_seeds": sum(1 for v in vals if not math.isfinite(v)),
            # why each diverged run did (its summary's reason, or no finite final score)
            "diverged_by_seed": {
                str(s): diverged(r) or NO_SCORE
                for s, r, v in zip(seeds, runs, vals, strict=True)
                if not math.isfinite(v)
            },
            "loss_mean": loss_mean,
            "loss_std": loss_std,
            # what chose the rate: the selection split of the first seed
            f"selection_grid_seed{first}": {
                f"{g:g}": number(r, sel_key) for g, r in grid_runs.items()
            },
            # for the record only (never used to choose): the test metric over the grid
            f"test_grid_seed{first}": {f"{g:g}": number(r, key) for g, r in grid_runs.items()},
            # the grid's points that diverged (null in both grids above), and why
            f"diverged_grid_seed{first}": {
                f"{g:g}": diverged(r) or NO_SCORE
                for g, r in grid_runs.items()
                if not math.isfinite(number(r, sel_key))
            },
            "chosen_at_grid_edge": grid_edge(grid[method], lr),  # "top", "bottom" or None
            **comm,
        }
    lines = [
        f"| method | lr | {'val loss | ' if lm else ''}{label} (mean ± std) | per seed "
        f"| seed-{first} selection-split grid | MB up / client / round "
        "| MB down / client / round | optimizer state (MB / client) | s / round |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if lm else ""),
    ]
    for method, row in table["methods"].items():
        per_seed = ", ".join(cell(v, ".1f") for v in row[key].values())
        grid_s = ", ".join(
            f"{k}: {cell(v, '.1f')}" for k, v in row[f"selection_grid_seed{first}"].items()
        )
        loss = f"{mean_cell(row['loss_mean'], row['loss_std'], '.3f', 0)} | " if lm else ""
        score_s = mean_cell(row["mean"], row["std"], ".2f", row["diverged_seeds"])
        lines.append(
            f"| {method} | {row['lr']:g} | {loss}{score_s} | "
            f"{per_seed} | {grid_s} | {row['up_per_client'] / 1e6:.3f} | "
            f"{row['down_per_client'] / 1e6:.3f} | {row['optimizer_state_bytes'] / 1e6:.3f} | "
            f"{row['wall_s_per_round']:.1f} |"
        )
    return table, lines


METRICS = ("final_accuracy", "final_perplexity", "final_rmse")
"""The per-seed keys a method's row of ``table.json`` may hold (the one its task reports)."""


def table_seeds(table: dict[str, Any]) -> dict[str, set[str]]:
    """Method -> the seeds a table's rows hold a score of (:func:`lost_results`' ``now``)."""
    return {m: _seeds(row) for m, row in table["methods"].items()}


def _seeds(row: Any) -> set[str]:
    """The seeds a method's row of ``table.json`` holds a score of (as ``table.json``'s keys);
    none when it holds no per-seed record of :data:`METRICS`."""
    measure = _measure(row)
    per_seed: object = row[measure] if measure is not None else {}
    return set(per_seed) if isinstance(per_seed, dict) else set()


def lost_results(
    path: Path, now: dict[str, set[str]], measures: dict[str, str | None] | None = None
) -> list[str]:
    """The methods of the published ``table.json`` at ``path`` that a table of ``now``
    (method -> its seeds, as ``table.json``'s keys: :func:`table_seeds` of a new table, or the
    methods and seeds a grid will run) lacks, or holds fewer seeds of, as ``method (seeds ...)``
    (``method`` alone when its row names no seed), or (given the new table's ``measures``,
    :func:`table_measures`) scores by another measure (an accuracy table over a perplexity
    one); [] when there is none or it cannot be read (nothing usable to keep)."""
    try:
        old = json.loads(path.read_text())["methods"]
        before = {m: _seeds(row) for m, row in old.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []
    lost = []
    for method, seeds in before.items():
        gone = sorted(seeds - now.get(method, set()))
        if gone:
            lost.append(f"{method} (seeds {', '.join(gone)})")
        elif method not in now:  # a row of another layout (an older lr_grid's): still a result
            lost.append(method)
        elif measures is not None and method in measures:
            was = _measure(old[method])
            if was is not None and measures[method] is not None and was != measures[method]:
                lost.append(f"{method} ({was}, where the new table has {measures[method]})")
    return lost


def table_measures(table: dict[str, Any]) -> dict[str, str | None]:
    """Method -> the measure (one of :data:`METRICS`) a table's rows score it by
    (:func:`lost_results`' ``measures``)."""
    return {m: _measure(row) for m, row in table["methods"].items()}


def _measure(row: Any) -> str | None:
    """The first of :data:`METRICS` a method's row of ``table.json`` holds; None when it
    holds none (or is not a row)."""
    return next((k for k in METRICS if k in row), None) if isinstance(row, dict) else None
