"""Round callbacks: metrics JSONL, atomic checkpoints, a progress bar."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

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
    """Appends one JSON object per round to ``metrics.jsonl`` (flushed every round)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")

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
        self.path.write_text("".join(line + "\n" for line in keep))


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then ``os.replace``: a kill
    at any moment leaves either the old or the new checkpoint, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Checkpointer:
    """Saves the server state and every client state after each round.

    The checkpoint is a plain dict of tensors and scalars (loadable with ``weights_only=True``):
    ``{"round": t, "server": {"arrays", "values"}, "clients": ClientStore.to_dict()}``. Client
    states the store spilled to disk are named, not copied: their files are fsynced before the
    checkpoint is committed, and only after the commit does the store delete the spill files the
    new checkpoint no longer names (:meth:`ClientStore.collect_garbage`), so a kill at any moment
    leaves the last committed checkpoint and every file it names.
    """

    def __init__(self, path: Path, store: ClientStore) -> None:
        self.path = path
        self.store = store

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
    ) -> tuple[int, State, ClientStore]:
        """(last completed round, server state, client store) of a checkpoint, its tensors on
        ``device`` (the file holds CPU tensors; a run resumes on any device).

        Args:
            path: the checkpoint file.
            max_memory_bytes: the restored store's memory limit in bytes (None: no limit).
            spill_dir: where the run spilled client states (needed when the checkpoint names
                spilled states, and with a limit); spilled states stay there until read.
            device: the run's device (server and client states are moved there).

        Raises:
            FileNotFoundError: when ``path`` does not exist.
            ValueError: when the checkpoint names spilled states but ``spill_dir`` is None.
        """
        raw = torch.load(path, weights_only=True, map_location=torch.device(device))
        server = State(dict(raw["server"]["arrays"]), dict(raw["server"]["values"]))
        store = ClientStore.from_dict(raw["clients"], max_memory_bytes, spill_dir, device)
        return int(raw["round"]), server, store


class ProgressBar:
    """A rich progress bar over rounds showing the last accuracy (perplexity for a language
    model)."""

    def __init__(self, description: str, start: int, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            transient=True,
        )
        self.task = self.progress.add_task(description, total=total, completed=start, info="")
        self.progress.start()

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        acc, ppl = row.get("accuracy"), row.get("perplexity")
        info = f"acc {acc:.3f}" if isinstance(acc, float) else ""
        if isinstance(ppl, float):
            info = f"ppl {ppl:.2f}"
        self.progress.update(self.task, advance=1, info=info)

    def close(self) -> None:
        self.progress.stop()
