"""DP releases that a resumed run repeats, so that ε counts them.

A round's row in ``metrics.jsonl`` is a release: it carries the evaluation of the noised model.
A DP run killed after a row was written but before its checkpoint (or run with
``checkpoint: false``) resumes from an earlier round and runs the rounds after it again with
fresh noise: the adversary then holds two independent noisy versions of those rounds, and
composition counts both. Before the resume discards those rows, their number is added to
``dp_ledger.json`` in the run folder (written atomically, before the rows go; a kill in between
counts them twice, never zero times), and the accountant adds the ledger's total to the rounds
it counts (:attr:`fedlore.privacy.aggregation.Privacy.repeated`). A fresh run starts without a
ledger; started over an unfinished DP run, it warns that the releases it discards go uncounted
(:func:`fedlore.experiment_privacy.warn_uncounted`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from fedlore.atomic import write_json
from fedlore.privacy import Privacy

log = logging.getLogger(__name__)

LEDGER = "dp_ledger.json"
"""The run folder's count of DP exchanges released and then run again."""


def released_after(metrics: Path, last: int | None) -> int:
    """The rows of ``metrics`` that hold a DP release (``dp_epsilon``) of a round after
    ``last`` (every such row when ``last`` is None: no checkpoint), i.e. what a resume discards
    and runs again. A torn last line (a kill mid-write) is not a row."""
    if not metrics.exists():
        return 0
    count = 0
    for line in metrics.read_text("utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (
            isinstance(row, dict)
            and "dp_epsilon" in row
            and (last is None or int(row.get("round", last + 1)) > last)
        ):
            count += 1
    return count


def repeated(folder: Path) -> int:
    """The ledger's total (0 without a ledger).

    Raises:
        ValueError: naming the file when it is not a ledger (damaged or edited): ε cannot be
            counted without it.
    """
    path = folder / LEDGER
    if not path.exists():
        return 0
    try:
        total = json.loads(path.read_text("utf-8"))["repeated_exchanges"]
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise TypeError(total)
        return total
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path}: not a DP ledger ({type(e).__name__}: {e}); ε cannot count the releases "
            "this run repeated without it: restore it, or start the run over without --resume"
        ) from None


def record_repeats(folder: Path, metrics: Path, last: int | None) -> int:
    """Add the releases a resume is about to discard (:func:`released_after`) to the ledger,
    write it, and return the new total. Call before the rows are discarded."""
    total = repeated(folder)
    new = released_after(metrics, last)
    if new:
        total += new
        write_json(folder / LEDGER, {"repeated_exchanges": total})
    return total


def account_repeats(
    privacy: Privacy | None, folder: Path, metrics: Path, last: int | None
) -> Privacy | None:
    """``privacy`` with the ledger's total as :attr:`~fedlore.privacy.aggregation.Privacy.
    repeated`, after recording the releases this resume discards (rows after ``last``; all of
    them when there is no checkpoint). Without DP, ``privacy`` as it is. Says nothing: the
    caller says it once (:func:`say_repeats`)."""
    if privacy is None or privacy.dp is None:
        return privacy
    total = record_repeats(folder, metrics, last)
    return dataclasses.replace(privacy, repeated=total)


def say_repeats(privacy: Privacy | None, folder: Path) -> None:
    """Log, once per resume, that ε counts the ledger's releases (none without repeats); not
    when :func:`fedlore.experiment_privacy.warn_over_target` has said it with the ε the run
    will end at (one fact, one line)."""
    if privacy is not None and privacy.dp is not None and privacy.repeated:
        log.warning(
            "%d DP exchange(s) released before this resume run again with fresh noise: "
            "ε counts them too (%s)",
            privacy.repeated,
            folder / LEDGER,
        )
