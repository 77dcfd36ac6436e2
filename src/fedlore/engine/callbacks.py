"""Round callbacks: metrics JSONL, atomic checkpoints, a progress bar."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedlore.atomic import append_text, write_text
from fedlore.engine.checkpoint_io import (
    DamagedCheckpoint,
    atomic_save,
    damage_reason,
    load_tensors,
)
from fedlore.engine.store import ClientStore
from fedlore.tensors import to_cpu
from fedlore.types import State


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v


class MetricsWriter:
    """Appends one JSON object per round to ``metrics.jsonl`` (written every round; a failed
    append is cut back to the row before, :func:`fedlore.atomic.append_text`). Each row is on
    disk before the round's checkpoint is written, so a checkpoint never outlives the rows of
    the rounds it has passed (a resume checks that they are all there)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        row_text = json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n"
        append_text(self.path, row_text, sync=True)

    def truncate_after(self, rnd: int) -> None:
        """Drop rows of rounds > ``rnd`` (rows a killed run wrote after its last checkpoint)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["round"] <= rnd:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a half-written last line
        write_text(self.path, "".join(line + "\n" for line in keep))


class Checkpointer:
    """Saves the server state and every client state after each round.

    The checkpoint is a plain dict of tensors and scalars (loadable with ``weights_only=True``):
    ``{"round": t, "server": {"arrays", "values"}, "clients": ClientStore.to_dict()}``. Client
    states the store spilled to disk are named, not copied: their files are fsynced before the
    checkpoint is committed, and only after the commit does the store delete the spill files the
    new checkpoint no longer names (:meth:`ClientStore.collect_garbage`), so a kill at any moment
    leaves the last committed checkpoint and every file it names.
    """

    def __init__(
        self,
        path: Path,
        store: ClientStore,
        extra: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.path = path
        self.store = store
        self.extra = extra  # more entries (early stopping's, engine/early_stopping.py)

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        clients = {  # CPU tensors: the checkpoint resumes on any device
            c: {**entry, "arrays": to_cpu(entry["arrays"])} if "arrays" in entry else entry
            for c, entry in self.store.to_dict().items()
        }
        self.store.sync()
        atomic_save(
            {
                "round": rnd,
                "server": {"arrays": to_cpu(state.arrays), "values": state.values},
                "clients": clients,
                **(self.extra() if self.extra is not None else {}),
            },
            self.path,
        )
        self.store.collect_garbage()

    @staticmethod
    def load(
        path: Path,
        max_memory_bytes: int | None = None,
        spill_dir: Path | None = None,
        device: torch.device | str = "cpu",
        extra: Callable[[dict[str, Any]], None] | None = None,
    ) -> tuple[int, State, ClientStore]:
        """(last completed round, server state, client store) of a checkpoint, its tensors on
        ``device`` (the file holds CPU tensors; a run resumes on any device).

        Args:
            path: the checkpoint file.
            max_memory_bytes: the restored store's memory limit in bytes (None: no limit).
            spill_dir: where the run spilled client states (needed when the checkpoint names
                spilled states, and with a limit); spilled states stay there until read.
            device: the run's device (server and client states are moved there).
            extra: called with the whole checkpoint (its tensors on ``device``), to restore
                what an ``extra`` of the writer added.

        Raises:
            FileNotFoundError: when ``path`` does not exist.
            ValueError: when the checkpoint names spilled states but ``spill_dir`` is None.
            DamagedCheckpoint: when the checkpoint cannot be read, naming it and the ways out.
            StoreError: when a spilled client state it names is missing or damaged.
        """
        try:
            raw = load_tensors(path, torch.device(device))
            server = State(dict(raw["server"]["arrays"]), dict(raw["server"]["values"]))
            last = int(raw["round"])
            clients = raw["clients"]
            if extra is not None:
                extra(raw)
        except FileNotFoundError:
            raise
        except Exception as e:  # a torn, truncated or foreign file: say which and what to do
            raise _damaged(path, e) from None
        store = ClientStore.from_dict(clients, max_memory_bytes, spill_dir, device)
        store.verify_spilled()  # a damaged spilled state is found now, not rounds later
        return last, server, store


def _damaged(path: Path, e: BaseException) -> DamagedCheckpoint:
    why = damage_reason(e, path)
    return DamagedCheckpoint(
        f"the checkpoint {path} is damaged and cannot be read ({why}). Run without --resume to "
        f"start this run over, or remove {path} (the run then restarts from round 0)"
    )


def checkpoint_round(path: Path) -> int:
    """The last completed round of the checkpoint ``path``, read as :meth:`Checkpointer.load`
    reads it but without building its states (``fedlore run --dry-run``).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        DamagedCheckpoint: when :meth:`Checkpointer.load` could not read it either.
    """
    try:
        raw = load_tensors(path, torch.device("cpu"))
        _ = dict(raw["server"]["arrays"]), dict(raw["server"]["values"]), raw["clients"]  # load's
        return int(raw["round"])
    except FileNotFoundError:
        raise
    except Exception as e:
        raise _damaged(path, e) from None


class ProgressBar:
    """Progress over rounds a person can follow anywhere.

    On a terminal (standard error is a tty) a rich progress bar that stays on screen when the
    run ends (its last state is the run's record). Off a terminal (a log file, CI) one line per
    round through :func:`fedlore.progress.say`: ``round 3/30 fedlore seed 0: accuracy 0.9120
    (1.2 s)`` (perplexity for a language model, RMSE for a regression task, the mean training
    loss on rounds without an evaluation).

    Args:
        description: ``"<method> seed <seed>"``.
        start: rounds already done (a resumed run).
        total: rounds of the run.
        rounds: the run's ``rounds`` shown in the lines (default ``total``).
        tty: force the bar (True) or the lines (False); None asks standard error.
    """

    def __init__(
        self,
        description: str,
        start: int,
        total: int,
        rounds: int | None = None,
        tty: bool | None = None,
    ) -> None:
        import sys

        self.description = description
        self.total = total if rounds is None else rounds
        self.done = start
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.progress: Any = None
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
            )
            self.task = self.progress.add_task(description, total=total, completed=start, info="")
            self.progress.start()

    @staticmethod
    def score(row: dict[str, Any]) -> str:
        """The row's headline score: accuracy, perplexity or RMSE, else the training loss."""
        for key, fmt in (("accuracy", ".4f"), ("perplexity", ".2f"), ("rmse", ".4f")):
            if isinstance(row.get(key), float):
                return f"{key} {row[key]:{fmt}}"
        loss = row.get("train_loss")
        return f"train loss {loss:.4f}" if isinstance(loss, float) else ""

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        from fedlore.progress import say

        self.done += 1
        info = self.score(row)
        if self.progress is not None:
            self.progress.update(self.task, advance=1, info=info)
            return
        secs = row.get("wall_s")
        took = f" ({secs:.1f} s)" if isinstance(secs, float) else ""
        sep = ": " if info else ""
        where = f"round {rnd + 1}/{self.total}" if rnd >= 0 else "setup round"
        say("%s %s%s%s%s", where, self.description, sep, info, took)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
