"""The types a run's ``summary.json`` values must have for ``fedlore report`` to trust them.

A summary edited by hand or damaged in a way JSON still parses (``"stopped_round": "a"``, a list
where a score belongs) would otherwise go into ``report.csv`` and the printed table as it is, or
end the report in a table's arithmetic. :func:`mistyped` names the values of the wrong type;
:mod:`fedlore.results.store` then treats each as it treats a damaged summary: not trusted,
derived from ``metrics.jsonl`` (and ``config.json``: the early-stopping rule replayed) where the
report can, otherwise left missing, and said in one note naming the file and the keys.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fedlore.results.summary import derive_summary, replayed_stopping

TEXT = frozenset({"method", "early_stopping_metric", "data_test_split"})
"""Keys whose value is a string."""
WHOLE = frozenset({"seed", "rounds"})
"""Keys whose value is an int."""
WHOLE_OR_NONE = frozenset({"stopped_round", "best_round"})
"""Keys whose value is an int or null (``stopped_round`` null: the run reached its rounds)."""
FLAGS = frozenset({"derived", "restored_best", "early_stopping_on_test", "early_stopping_derived"})
"""Keys whose value is true or false."""
NUMBER_SUFFIXES = ("_total", "_bytes", "_per_round")
NUMBER_PREFIXES = ("final_", "best_", "local_")
NUMBERS = frozenset({"dp_epsilon", "dp_delta"})


def expected(key: str) -> str | None:
    """What ``key``'s value must be (``"a string"``, ``"an int"``, ``"an int or null"``,
    ``"true or false"``, ``"a list of names"``, ``"a number or null"``), or None for a key
    the report reads no number from (a reason, a note of a later fedlore)."""
    if key in TEXT:
        return "a string"
    if key in WHOLE:
        return "an int"
    if key in WHOLE_OR_NONE:
        return "an int or null"
    if key in FLAGS:
        return "true or false"
    if key == "eval_metrics":
        return "a list of names"
    if key in NUMBERS or key.startswith(NUMBER_PREFIXES) or key.endswith(NUMBER_SUFFIXES):
        return "a number or null"
    return None


def fits(key: str, v: Any) -> bool:
    """Whether ``v`` has the type :func:`expected` asks of ``key`` (any value for a key it
    does not know)."""
    want = expected(key)
    number = isinstance(v, int | float) and not isinstance(v, bool)
    whole = isinstance(v, int) and not isinstance(v, bool)
    if want == "a string":
        return isinstance(v, str)
    if want == "an int":
        return whole
    if want == "an int or null":
        return v is None or whole
    if want == "true or false":
        return isinstance(v, bool)
    if want == "a list of names":
        return isinstance(v, list) and all(isinstance(n, str) for n in v)
    if want == "a number or null":
        return v is None or number
    return True


def mistyped(summary: dict[str, Any]) -> list[str]:
    """The keys of ``summary`` whose values do not have the type :func:`expected` asks."""
    return [k for k, v in summary.items() if not fits(k, v)]


def distrust(
    summary: dict[str, Any],
    method: str,
    seed: int,
    rows: list[dict[str, Any]],
    recorded: dict[str, Any] | None,
    extra: Sequence[str] = (),
) -> str | None:
    """Replace, in place, each value of ``summary`` (a run's ``summary.json``) of the wrong type
    (:func:`mistyped`) by the one derived from the run's ``rows`` (``metrics.jsonl``'s, as
    :func:`fedlore.results.summary.derive_summary` derives a missing summary, with the
    early-stopping rule of ``recorded`` (its ``config.json``) replayed), the folder's method and
    seed, or left out (missing) where nothing derives it. Returns what was done, as words for the
    run's note (None when every value has its type)."""
    bad = mistyped(summary)
    if not bad:
        return None
    derived: dict[str, Any] = {"method": method, "seed": seed}
    if rows:
        derived = derive_summary(method, seed, rows, extra)
        replayed_stopping(derived, rows, (recorded or {}).get("early_stopping"), extra)
    said = []
    for key in bad:
        shown = json.dumps(summary[key])
        shown = shown if len(shown) <= 20 else shown[:17] + "..."
        replayed = key in WHOLE_OR_NONE and derived.get("early_stopping_derived")
        if key in derived and fits(key, derived[key]) and (derived[key] is not None or replayed):
            summary[key] = derived[key]
            source = "the folder's name" if key in ("method", "seed") else "metrics.jsonl"
            if key in WHOLE_OR_NONE or key in ("restored_best", "early_stopping_on_test"):
                source = "metrics.jsonl and config.json"
            said.append(f"{key} ({shown}, not {expected(key)}: derived from {source})")
        else:  # missing, as in a summary that never had it (None would say "not finite")
            del summary[key]
            said.append(f"{key} ({shown}, not {expected(key)}: left missing)")
    return "values of the wrong type not trusted: " + "; ".join(said)
