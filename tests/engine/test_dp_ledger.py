"""The ledger of DP releases a resumed run repeats (fedlore.engine.dp_ledger): rows after the
checkpoint's round hold releases that the resume runs again with fresh noise, so their number is
kept (atomically, before the rows go) and accumulates over resumes."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from fedlore.engine import dp_ledger
from fedlore.engine.callbacks import MetricsWriter
from fedlore.privacy import DPSettings, Privacy


def _metrics(path: Path, rows: Sequence[Mapping[str, object]], torn: str = "") -> Path:
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


def test_a_line_that_is_no_row_does_not_end_the_count(tmp_path: Path) -> None:
    """A line that is not JSON (blank, or torn by a kill) is skipped, not the end of the file:
    the releases after it count. A DP row without a ``round`` counts as after any checkpoint:
    the resume's truncation drops it too, and a release counted once too often only overstates
    ε."""
    m = tmp_path / "metrics.jsonl"
    lines = ['{"round": 0, "dp_epsilon": 0.1}', "", '{"round": 1, "dp_eps', '{"dp_epsilon": 0.2}']
    m.write_text("".join(line + "\n" for line in [*lines, '{"round": 1, "dp_epsilon": 0.3}']))
    assert dp_ledger.released_after(m, None) == 3
    assert dp_ledger.released_after(m, 0) == 2  # the row without a round and round 1
    assert dp_ledger.released_after(m, 1) == 1
    MetricsWriter(m).truncate_after(0)  # what the resume after round 0 then discards
    assert m.read_text().splitlines() == ['{"round": 0, "dp_epsilon": 0.1}']


def test_account_repeats_counts_under_dp_only_and_names_the_ledger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under DP the releases a resume discards go to the ledger, the privacy comes back with
    the ledger's total as ``repeated`` and a warning names that total and the ledger file.
    Without DP (no privacy, or secure aggregation alone) nothing is recorded and the privacy
    comes back as it is."""
    m = _metrics(tmp_path / "metrics.jsonl", [{"round": r, "dp_epsilon": 1.0} for r in range(4)])
    common = functools.partial(
        Privacy, uniform=True, num_clients=4, per_round=4, setup_rounds=0, seed=0
    )
    secure = common(secure=True, dp=None)
    assert dp_ledger.account_repeats(None, tmp_path, m, 1) is None
    assert dp_ledger.account_repeats(secure, tmp_path, m, 1) is secure
    assert not (tmp_path / dp_ledger.LEDGER).exists()
    dp = common(secure=False, dp=DPSettings(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5))
    with caplog.at_level(logging.WARNING, logger="fedlore.engine.dp_ledger"):
        counted = dp_ledger.account_repeats(dp, tmp_path, m, 1)
        assert not caplog.records  # said once, by the caller (say_repeats or the ε warning)
        for nothing in (None, secure, dp):  # no DP, or no repeats: nothing to say
            dp_ledger.say_repeats(nothing, tmp_path)
        assert not caplog.records
        assert counted is not None
        dp_ledger.say_repeats(counted, tmp_path)
    assert counted is not None and counted.repeated == 2 and dp.repeated == 0
    assert dataclasses.replace(counted, repeated=0) == dp
    assert dp_ledger.repeated(tmp_path) == 2
    assert [r.getMessage() for r in caplog.records] == [
        "2 DP exchange(s) released before this resume run again with fresh noise: ε counts "
        f"them too ({tmp_path / dp_ledger.LEDGER})"
    ]


def test_a_damaged_ledger_is_named_not_read_as_a_count(tmp_path: Path) -> None:
    """A ledger that is not one (emptied, edited) cannot be counted: the error names the file;
    a fresh DP run over it still warns, of an unknown number of uncounted releases."""
    import pytest

    from fedlore.experiment_privacy import PrivacyWarning, warn_uncounted
    from fedlore.privacy import DPSettings, Privacy

    for text in ("{}", '{"repeated_exchanges": "2"}', '{"repeated_exchanges": -1}', "[1"):
        (tmp_path / dp_ledger.LEDGER).write_text(text)
        with pytest.raises(ValueError, match=rf"{tmp_path / dp_ledger.LEDGER}: not a DP ledger"):
            dp_ledger.repeated(tmp_path)
    private = Privacy(False, DPSettings(1.0, 1.0, 1e-5), True, 4, 4, 0, 0)
    with pytest.warns(PrivacyWarning, match="discards an unknown number of releases"):
        warn_uncounted(private, tmp_path)
