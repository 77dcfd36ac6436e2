"""A report or plot write cut short by a kill (SIGKILL while ``fedlore run`` or ``fedlore
report`` writes the experiment's files) leaves ``<name>.<pid>.<thread>.tmp`` beside the report;
the next report of the folder deletes it, and leaves a live writer's and any other file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedlore.atomic import SHARED_TEMP_GRACE_S
from fedlore.cli import main


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_report_removes_what_a_killed_report_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exp = tmp_path / "runs" / "quick"
    run = exp / "fedavg" / "seed-1"
    run.mkdir(parents=True)
    rows = [
        {"round": t, "accuracy": 0.5 + 0.1 * t, "bytes_up": 10, "bytes_down": 10} for t in range(3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(
        json.dumps({"method": "fedavg", "seed": 1, "final_accuracy": 0.7, "rounds": 3})
    )
    dead = dead_pid()
    killed = [f"accuracy_vs_round.png.{dead}.140211719957376.tmp", f"report.md.{dead}.7.tmp"]
    kept = [
        f"report.csv.{os.getpid()}.7.tmp",  # a live writer's: its rename is still to come
        f"notes.txt.{dead}.7.tmp",  # not a file a report writes
        "report.md.tmp",
    ]
    long_ago = time.time() - 2 * SHARED_TEMP_GRACE_S
    for name in killed + kept:
        (exp / name).write_bytes(b"partial")
        os.utime(exp / name, (long_ago, long_ago))
    # being written now by a process this machine cannot see (another machine's run writing
    # its report into a shared folder): its PID is no process here, and it stays
    (exp / f"report.csv.{dead}.9.tmp").write_bytes(b"partial")
    kept.append(f"report.csv.{dead}.9.tmp")
    assert main(["report", str(exp)]) == 0
    said = capsys.readouterr()
    assert "removed what a killed write left" in said.out + said.err  # said, as progress=false
    left = sorted(p.name for p in exp.iterdir() if p.is_file())
    assert not set(killed) & set(left)
    assert set(kept) <= set(left)
    assert {"report.md", "report.csv", "accuracy_vs_round.png"} <= set(left)
