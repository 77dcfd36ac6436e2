"""The ledger of DP releases a resumed run repeats (fedlore.engine.dp_ledger): rows after the
checkpoint's round hold releases that the resume runs again with fresh noise, so their number is
kept (atomically, before the rows go) and accumulates over resumes."""

from __future__ import annotations

import json
from pathlib import Path

from fedlore.engine import dp_ledger


def _metrics(path: Path, rows: list[dict[str, object]], torn: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn, "utf-8")
    return path


def test_released_rows_after_the_checkpoint_are_counted(tmp_path: Path) -> None:
    """Rows with ``dp_epsilon`` after round ``last`` (all of them without a checkpoint) count;
    rows without DP, rows up to ``last`` and a torn last line do not; no file counts 0."""
    rows = [{"round": r, "dp_epsilon": 0.1 * (r + 1)} for r in range(5)]
    rows.insert(2, {"round": 9})  # a row without a DP release
    m = _metrics(tmp_path / "metrics.jsonl", rows, torn='{"round": 5, "dp_eps')
    assert dp_ledger.released_after(m, 2) == 2  # rounds 3 and 4
    assert dp_ledger.released_after(m, None) == 5
    assert dp_ledger.released_after(m, 4) == 0
    assert dp_ledger.released_after(tmp_path / "none.jsonl", None) == 0


def test_the_ledger_accumulates_over_resumes(tmp_path: Path) -> None:
    """Two resumes that each discard released rows: the ledger holds their sum, written in the
    run folder; a resume that discards nothing leaves it (and no ledger means 0)."""
    m = tmp_path / "metrics.jsonl"
    assert dp_ledger.repeated(tmp_path) == 0
    _metrics(m, [{"round": r, "dp_epsilon": 1.0} for r in range(4)])
    assert dp_ledger.record_repeats(tmp_path, m, 1) == 2
    _metrics(m, [{"round": r, "dp_epsilon": 1.0} for r in range(3)])
    assert dp_ledger.record_repeats(tmp_path, m, None) == 5
    assert dp_ledger.record_repeats(tmp_path, m, 2) == 5
    assert json.loads((tmp_path / dp_ledger.LEDGER).read_text()) == {"repeated_exchanges": 5}
    assert dp_ledger.repeated(tmp_path) == 5
