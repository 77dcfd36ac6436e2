"""Helpers of the reliability tests: a callback that interrupts a run like Ctrl-C, and a folder's
files as bytes (to show a command left it unchanged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedlore.types import State


class Interrupt:
    """A round callback that stops the run like Ctrl-C after round ``at`` has been written."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        if rnd == self.at:
            raise KeyboardInterrupt


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (but the run lock) -> its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }
