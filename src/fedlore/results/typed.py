"""The types a run's ``summary.json`` values must have for ``fedlore report`` to trust them.

A summary edited by hand or damaged in a way JSON still parses (``"stopped_round": "a"``, a list
where a score belongs) would otherwise go into ``report.csv`` and the printed table as it is, or
end the report in a table's arithmetic. :func:`mistyped` names the values of the wrong type;
:mod:`fedlore.results.store` then treats each as it treats a damaged summary: not trusted,
derived from ``metrics.jsonl`` (and ``config.json``: the early-stopping rule replayed) where the
report can, otherwise left missing, and said in one note naming the file and the keys.

A number that is ``null`` or ``NaN`` (a diverged run's score: ``metrics.jsonl`` and
``summary.json`` write a value that was not finite as ``null``) is of its type, but no
statistic can use it: the table shows "–" for it, as for a value the run never recorded.
:func:`not_finite` names such values, so that the report notes them in the same way: a "–"
without a note is a value the run did not record.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from fedlore.results.summary import SUMMARY_LAST, derive_summary, replayed_stopping

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


OWN_KEYS = frozenset(
    {"diverged", "diverged_after_best", "privacy", "client_num_examples", *SUMMARY_LAST}
)
"""Keys of a fedlore summary that :func:`expected` reads no number from (the divergence mark,
the no-privacy mark, the clients' sizes Flower records) or that are optional last values."""
OWN_PREFIXES = ("dp_",)
"""Prefixes of the summary keys of the DP mechanism and its audit
(:func:`fedlore.experiment_privacy.privacy_summary`)."""


def written_by_fedlore(key: str) -> bool:
    """Whether fedlore writes ``key`` in a run's ``summary.json``: ``method``, ``seed``, the
    keys :func:`expected` knows (``rounds``, ``final_*``, ``best_*``, ``local_*``, ``*_total``,
    ``*_bytes``, ``*_per_round``, the early-stopping keys, ...), :data:`OWN_KEYS` and
    :data:`OWN_PREFIXES`. A summary without any (``{"acc": 0.9}``) is another tool's."""
    return key in OWN_KEYS or key.startswith(OWN_PREFIXES) or expected(key) is not None


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


def _row_key(key: str) -> str | None:
    """The ``metrics.jsonl`` key whose value the summary's ``key`` holds (``final_accuracy``,
    ``best_accuracy``: ``accuracy``; :data:`~fedlore.results.summary.SUMMARY_LAST`'s: ``local_*``,
    ``dp_epsilon``), None for a total or a cost."""
    if key in SUMMARY_LAST:
        return SUMMARY_LAST[key]
    for prefix in ("final_", "best_"):
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    return None


def not_finite(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str | None:
    """The numbers of ``summary`` (keys :func:`expected` asks a number or null of) that no
    statistic can use, as words for the run's note (None when there are none): ``NaN`` or an
    infinity (a summary edited, or of another writer), and ``null``, which a summary writes for a
    value that was not finite, unless no row of ``rows`` (the run's ``metrics.jsonl``) records
    its key: then the run never measured it (a regression's accuracy), as a key it lacks."""
    said = []
    for key, v in summary.items():
        if expected(key) != "a number or null":
            continue
        if v is None:
            source = _row_key(key)
            if source is not None and rows and not any(source in r for r in rows):
                continue  # never recorded: missing, as a key the summary lacks
            said.append(f"{key} (null: not finite)")
        elif isinstance(v, float) and not math.isfinite(v):
            said.append(f"{key} ({json.dumps(v)})")  # NaN, Infinity or -Infinity
    if not said:
        return None
    return (
        "values that are not finite numbers, left out of the statistics (a – in the "
        "table where no seed has one): " + "; ".join(said)
    )
