"""Settings whose unset value (None) stands for a value the config's other settings decide.

``asynchronous.concurrency`` unset is ``clients_per_round``; ``server.v0`` unset is
``server.tau`` squared. A run that spells such a value out is the run that left it unset, so
``--resume`` and the check of a finished run (:func:`fedlore.engine.run_record.config_diff`) compare
these settings at their effective value: :data:`UNSET_MEANS` says what each unset value is, as a
function of the config paths it depends on, the value the run uses
(:meth:`fedlore.config_model.Config.async_concurrency`, the server optimizer's ``v0``,
:meth:`fedlore.config_sections.DPAuditConfig.unseen_count`,
:func:`fedlore.privacy.dp.default_clipped_count_stddev`; a test holds each to it).

Only settings whose unset value the config alone decides are here: ``robust.multi_krum_keep``
(n - f of each round's updates), ``data.local_test`` and ``data.sampling`` (the data source
decides) are not, and stay compared as written. This module imports nothing of fedlore, so that
the config models can use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def clients_per_round(participation: float, num_clients: int) -> int:
    """Number of clients sampled each round: max(1, floor(C * num_clients))."""
    return max(1, int(participation * num_clients + 1e-9))


def _concurrency(buffer: Any, participation: Any, num_clients: Any) -> int | None:
    """C of FedBuff: ``clients_per_round`` while ``asynchronous.buffer`` is set (without it
    the setting is off, and a config may not set it)."""
    if buffer is None or not _number(participation) or not _number(num_clients):
        return None
    return clients_per_round(participation, num_clients)


def _tau_squared(tau: Any) -> float | None:
    """The adaptive server optimizers' v_{-1}: τ² (``fedlore.optim.server``)."""
    return float(tau**2) if _number(tau) else None


def _error_feedback(kind: Any) -> bool | None:
    """On under top-k, off under QSGD (unbiased already); no value without compression."""
    return {"topk": True, "qsgd": False}.get(kind) if isinstance(kind, str) else None


def _unseen(canaries: Any) -> int | None:
    """k' of the DP audit: as many as ``canaries``."""
    return canaries if _number(canaries) else None


def _count_stddev(participation: Any, num_clients: Any) -> float | None:
    """σ_b of adaptive clipping: clients per round / 20."""
    if not _number(participation) or not _number(num_clients):
        return None
    return clients_per_round(participation, num_clients) / 20.0


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


UnsetRule = tuple[tuple[str, ...], Callable[..., Any]]
"""``(config paths it depends on, function of their values)``: the value an unset setting
stands for, None where it stands for none (the function is given the values in order)."""

UNSET_MEANS: dict[str, UnsetRule] = {
    "asynchronous.concurrency": (
        ("asynchronous.buffer", "participation", "num_clients"),
        _concurrency,
    ),
    "server.v0": (("server.tau",), _tau_squared),
    "compression.error_feedback": (("compression.kind",), _error_feedback),
    "dp.audit.unseen": (("dp.audit.canaries",), _unseen),
    "dp.clipped_count_stddev": (("participation", "num_clients"), _count_stddev),
}
"""Config path -> what its None stands for (:data:`UnsetRule`)."""


def unset_rules(fields: dict[str, str], prefix: str = "hyper.") -> dict[str, UnsetRule]:
    """:data:`UNSET_MEANS` with, beside each config path, the same rule for the method setting
    that copies it: ``fields`` maps a setting to its config path (``server_v0`` ->
    ``server.v0``), and a rule whose inputs are all such settings applies to
    ``<prefix><setting>`` over ``<prefix><input setting>`` (``hyper.server_v0`` is
    ``hyper.server_tau`` squared, the method's own τ)."""
    setting_of = {path: name for name, path in fields.items()}
    out = dict(UNSET_MEANS)
    for path, (inputs, means) in UNSET_MEANS.items():
        if path in setting_of and all(i in setting_of for i in inputs):
            own = tuple(prefix + setting_of[i] for i in inputs)
            out[prefix + setting_of[path]] = (own, means)
    return out


def resolve_unset(
    record: dict[str, Any],
    rules: dict[str, UnsetRule],
    fallback: dict[str, Any],
    keys: set[str] | None = None,
) -> None:
    """Replace, in place, each None of ``record`` (flat dotted keys) that a rule of ``rules``
    gives a value by that value, read from the record's values (``fallback``'s where the record
    lacks a key: a setting an older record lacks is at its default). A key the record lacks is
    resolved too when it is in ``keys`` and ``fallback`` (it is compared at its default)."""
    missing = object()

    def get(key: str) -> Any:
        return record.get(key, fallback.get(key, missing))

    for key, (inputs, means) in rules.items():
        if key not in record and not (keys is not None and key in keys and key in fallback):
            continue
        args = [get(i) for i in inputs]
        if get(key) is not None or any(a is missing for a in args):
            continue
        if (value := means(*args)) is not None:
            record[key] = value


FOLDER_KEYS = ("data.root", "data.tokenizer")
"""Config paths that name a file or folder whose contents the run's data fingerprint holds: two
runs whose paths name one folder (``good``, ``good/``, ``./good``, ``/home/me/good`` run from
``/home/me``) are of one setting."""

FOLDERS_RECORD = "data_folders"
"""The key of a run's ``config.json`` that records, beside each path of :data:`FOLDER_KEYS` as
the config wrote it, the file or folder it named where the run was made
(:func:`resolved_folders`)."""


def _local(value: Any) -> bool:
    """Whether ``value`` is a path of a local file or folder (not unset, empty or a URL)."""
    return isinstance(value, str) and bool(value) and "://" not in value


def _named(path: str) -> str:
    """The file or folder ``path`` names from the working folder: ``..`` and symbolic links
    resolved, relative to the working folder when inside it (a project moved to another
    folder or machine keeps its runs), else absolute."""
    folder, here = Path(path).resolve(), Path.cwd().resolve()
    return str(folder.relative_to(here)) if folder.is_relative_to(here) else str(folder)


def resolved_folders(record: Mapping[str, Any]) -> dict[str, str]:
    """Each path of :data:`FOLDER_KEYS` in ``record`` (flat dotted keys) that names a local file
    or folder, as the one it names from the working folder now (``good/``, ``./good``,
    ``/home/me/good`` from ``/home/me`` and a link to it are ``good``; ``../data`` is
    ``/home/data``)."""
    paths = {k: record.get(k) for k in FOLDER_KEYS}
    return {k: _named(v) for k, v in paths.items() if isinstance(v, str) and _local(v)}


def same_folder(record: dict[str, Any], recorded: Any = None) -> None:
    """Write, in place, each path of :data:`FOLDER_KEYS` in ``record`` (flat dotted keys) as the
    file or folder it names, so that two spellings of one folder compare equal: ``recorded``'s
    value for the path where it has one (a run's :data:`FOLDERS_RECORD`, as named where the run
    was made), else as named from the working folder now (:func:`resolved_folders`: a config
    about to run, or a run recorded before fedlore 2026-12-06). A URL is left alone."""
    given = recorded if isinstance(recorded, Mapping) else {}
    now = resolved_folders(record)
    for key, path in now.items():
        was = given.get(key)
        record[key] = was if isinstance(was, str) and was else path
