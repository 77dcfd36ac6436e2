"""What a run records of its settings, and whether a config may continue it.

A run's ``config.json`` (:func:`run_record`) holds the settings that decide its results
(:func:`result_settings`), the method's resolved hyperparameters (:func:`resolved_hyper`), the
data fingerprint and where it ran. ``--resume``, the finished-run check, ``--overwrite``,
``--dry-run`` and ``fedlore track`` compare it with a config through :func:`config_diff`;
:func:`check_same_config` and :func:`check_same_data` refuse to continue a run that another
config or other data started. Where the run lives is :mod:`fedlore.engine.rundir`'s.

The engine builds no method (it never imports one): a run's resolved settings are compared with
those of the method the config builds now through the ``make_algorithm`` the driver passes in
(:func:`fedlore.experiment_parts.make_algorithm`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from fedlore import registry
from fedlore.algorithm import Algorithm
from fedlore.config import Config, ConfigError
from fedlore.config_unset import (
    FOLDERS_RECORD,
    resolve_unset,
    resolved_folders,
    same_folder,
    unset_rules,
)
from fedlore.device import PLATFORM_KEYS, platform_record
from fedlore.engine.resume_changes import CHANGES, tolerated
from fedlore.settings import RUN_WIDE, LocalTraining, config_paths, not_applicable

MakeAlgorithm = Callable[[str, Config], Algorithm]
"""``(method, config) -> the method as the config builds it``: the driver's
:func:`fedlore.experiment_parts.make_algorithm`, passed to what compares a run's recorded
settings with the config's."""


_NOT_RESULT_KEYS = (
    "progress", "algorithms", "seeds", "method", "store", "output_dir", "flower", "device",
    "threads", "tracking", "tune",
)  # fmt: skip
"""Config keys that do not change a run's results (or, ``method``, are compared per method;
``tracking`` only shows them elsewhere; ``tune`` is read by ``fedlore tune`` alone); ``device``
and ``threads`` change them by float rounding only, so a run may resume on another device or
with another thread count."""


def result_settings(cfg: Config, method: str) -> dict[str, Any]:
    """The settings of ``cfg`` that decide the results of a run of ``method`` (what its
    ``config.json`` records of the config: no name, folders, seeds, engine or progress; the
    method's own ``method.<name>`` section as ``method``), JSON-ready."""
    return _run_config(cfg, method)


def _run_config(cfg: Config, method: str) -> dict[str, Any]:
    raw = cfg.model_dump(mode="json")
    out = {k: v for k, v in raw.items() if k not in _NOT_RESULT_KEYS}
    out["method"] = raw["method"].get(method, {})
    return out


def run_record(
    cfg: Config,
    method: str,
    fingerprint: str,
    algo: Algorithm,
    device: torch.device,
    threads: int,
) -> dict[str, Any]:
    """A run's ``config.json`` (without the DP record the driver adds): the settings that decide
    its results, the data fingerprint, the data folders it read (:data:`FOLDERS_RECORD`: each
    path of ``data.root`` and ``data.tokenizer`` as named from the working folder,
    :func:`~fedlore.config_unset.resolved_folders`; the path as the config wrote it stays in its
    place), the method's resolved hyperparameters, and where and with how many threads it ran."""
    settings = _run_config(cfg, method)
    return {
        **settings,
        "data_fingerprint": fingerprint,
        FOLDERS_RECORD: resolved_folders(_flatten(settings)),
        "hyper": resolved_hyper(algo),
        "ran_on": str(device),
        "ran_threads": threads,
        **platform_record(device),
    }


def resolved_hyper(algo: Algorithm) -> dict[str, Any]:
    """An algorithm's hyperparameters as built (every field, defaults and normalized types:
    ``1e-3`` given as text is the number), JSON-ready: recorded in ``config.json`` so that
    ``--resume`` compares what the method will do, not how the config spelled it."""
    fields = dataclasses.fields(algo)  # type: ignore[arg-type]
    return _flat_hyper((f.name, getattr(algo, f.name)) for f in fields)


def _flat_hyper(items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Hyperparameter ``(name, value)`` pairs as one flat JSON-ready mapping: a settings
    sub-model (``train``, :class:`fedlore.settings.LocalTraining`) contributes its fields in its
    place, so ``config.json`` records ``hyper.lr`` as before the sub-model existed; less its
    :data:`~fedlore.settings.RUN_WIDE` fields, recorded at their config paths."""
    out: dict[str, Any] = {}
    for name, v in items:
        if isinstance(v, BaseModel):
            fields = [k for k in type(v).model_fields if k not in RUN_WIDE]
            out.update(_flat_hyper((k, getattr(v, k)) for k in fields))
        else:
            out[name] = list(v) if isinstance(v, tuple) else v
    return dict(json.loads(json.dumps(out, default=str)))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config mappings as dotted keys (``{"optim": {"name": "adam"}}`` ->
    ``{"optim.name": "adam"}``); the per-method ``method`` mapping stays one value."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "method" and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _resumed_record(path: Path) -> dict[str, Any]:
    """The ``config.json`` of a run to resume.

    Raises:
        ConfigError: naming it when it cannot be read or is no JSON object (a torn or edited
            file): which config the run was started with is unknown.
    """
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raw = e
    if not isinstance(raw, dict):
        why = f"{type(raw).__name__}: {raw}" if isinstance(raw, Exception) else "not an object"
        raise ConfigError(
            f"--resume: {path} cannot be read ({why}), so the config the run was started with "
            "is unknown; run without --resume to start over"
        )
    return raw


def check_same_config(cfg: Config, method: str, out: Path, make_algorithm: MakeAlgorithm) -> None:
    """Refuse to resume a run that an earlier, different config started (:func:`config_diff`).

    Raises:
        ConfigError: naming the keys whose values differ from ``config.json`` in ``out``.
    """
    path = out / "config.json"
    if not path.exists():
        return
    raw = _resumed_record(path)
    if raw.get("hyper") is None and method in DEFAULTS_CHANGED:
        raise ConfigError(
            f"--resume: {out} was started by an earlier fedlore in which {method} behaved "
            f"differently by default ({DEFAULTS_CHANGED[method]}); resuming would mix the two "
            "in one run. Run without --resume to start over"
        )
    # a DP-FedBuff run may be resumed with another dp.max_contributions or rounds
    details = config_diff(cfg, method, tolerated(cfg, raw), make_algorithm)
    if details:
        raise ConfigError(
            f"--resume: {out} was started with a different config ({details}); run without "
            "--resume to start over, or restore the config"
        )


METHOD_ONLY = ("compression.", "transport_dtype")
"""Config paths (prefixes) that only the methods read (and the config checks): with a recorded
``hyper`` they are compared as each method resolved them (its ``hyper.*`` settings), since a
``method.<name>`` override makes the path's value one the run never used."""


def unread_given(cls: type, hyper: dict[str, Any]) -> set[str]:
    """The ``hyper.*`` keys a method of class ``cls`` does not read at these settings: its
    ``read_only_with`` maps a setting to ``(other, values)``, read only while ``other`` is one of
    ``values`` (FedFull's top-k fraction only under ``compression: topk``)."""
    rules: dict[str, tuple[str, tuple[Any, ...]]] = getattr(cls, "read_only_with", {})
    return {
        f"hyper.{k}"
        for k, (other, values) in rules.items()
        if hyper.get(f"hyper.{other}") not in values
    }


def resolve_none(cls: type, hyper: dict[str, Any]) -> None:
    """Replace, in place, each ``hyper.*`` None that stands for a value another setting decides
    by that value: a method class's ``none_means`` maps a setting to ``(other, {value of
    other: value})`` (FedFull's ``error_feedback`` None is on under top-k, off under QSGD), so
    a run that spelled the default out is the run that left it None."""
    rules: dict[str, tuple[str, dict[Any, Any]]] = getattr(cls, "none_means", {})
    for k, (other, means) in rules.items():
        key = f"hyper.{k}"
        if key in hyper and hyper[key] is None and hyper.get(f"hyper.{other}") in means:
            hyper[key] = means[hyper[f"hyper.{other}"]]


READ_BY_THE_RUN = {"diagnostics.every"}
"""Settings that some methods read (a field's config path) and the run reads for every method."""


def _unread_method_settings(method: str, before: dict[str, Any], now: dict[str, Any]) -> set[str]:
    """Config paths that feed other methods' settings but not ``method``'s (``rank`` for fedavg)
    and decide nothing else in its run, and the settings ``method`` declares it never reads
    (:func:`~fedlore.settings.not_applicable`, with their config paths and ``hyper.`` keys): no
    difference between two runs of ``method``. ``rank`` also sets the subspace diagnostics'
    rank while ``diagnostics.every`` is above 0."""
    cls = registry.get("algorithm", method)
    paths = {**config_paths(LocalTraining), **config_paths(cls)}
    ignored = set(not_applicable(cls))
    never = {f"hyper.{k}" for k in ignored} | {paths[k] for k in ignored if k in paths}
    own = {p for k, p in config_paths(cls).items() if k not in ignored}
    read = {
        path
        for name in registry.names("algorithm")
        for path in config_paths(registry.get("algorithm", name)).values()
    }
    unread = read - own - READ_BY_THE_RUN
    if (before.get("diagnostics.every") or 0) > 0 or (now.get("diagnostics.every") or 0) > 0:
        unread.discard("rank")
    return unread | (never - READ_BY_THE_RUN)


def config_diff(
    cfg: Config, method: str, recorded: dict[str, Any], make_algorithm: MakeAlgorithm
) -> str:
    """How ``cfg`` (for ``method``) differs from a run's recorded ``config.json``, as
    ``key: before -> now`` items (the first five, then how many more; empty when the same).
    Settings that decide no result (``device``, ``name``, the data fingerprint, the record
    keys) are left out; a setting the record lacks counts as its default; with a recorded
    ``hyper`` the method's resolved settings are compared instead of how the config spelled
    them (those of ``make_algorithm(method, cfg)``). A setting whose unset value stands for one
    the other settings decide (:data:`fedlore.config_unset.UNSET_MEANS`) is compared, and
    shown, at that value: ``asynchronous.concurrency`` unset and spelled out as
    ``clients_per_round`` are the same run. Unset on both sides it is no difference, whatever
    it stands for: that follows settings compared themselves (``participation`` changes
    ``dp.clipped_count_stddev``'s value, and only ``participation`` is named). ``data.root``
    and ``data.tokenizer`` are compared, and shown, as the folders they name
    (:func:`fedlore.config_unset.same_folder`): the run's as it recorded them, the config's from
    the working folder now."""
    raw = dict(recorded)
    hyper_before = raw.pop("hyper", None)
    folders = raw.pop(FOLDERS_RECORD, None)
    before = _flatten(raw)
    before.pop("data_fingerprint", None)  # compared by check_same_data
    before.pop(CHANGES, None)  # a record of what resumes changed (engine.resume_changes)
    before.pop("ran_on", None)  # a record: a run may resume on another device
    for key in ("ran_threads", *PLATFORM_KEYS):
        before.pop(key, None)
    before.pop("dp_noise_multiplier", None)  # a record: solved from the dp.* settings compared
    before.pop("dp_noise_source", None)  # a record of dp.reproducible_noise, which is compared
    now = _flatten(_run_config(cfg, method))
    for record in (before, now):  # the folder's name, not a setting: a renamed copy is the same
        record.pop("name", None)
    same_folder(before, folders)  # data.root=good/, ./good and /home/me/good are one folder
    same_folder(now)
    cls = registry.get("algorithm", method)
    defaults = _defaults(cls, method)
    if hyper_before is not None:  # the method's settings as resolved (types and defaults)
        before.pop("method", None)
        now.pop("method", None)
        # a copy of a run-wide setting, compared at its config path (recorded by a few runs of
        # fedlore 2026-12-05)
        before.update({f"hyper.{k}": v for k, v in hyper_before.items() if k not in RUN_WIDE})
        now.update(
            {f"hyper.{k}": v for k, v in resolved_hyper(make_algorithm(method, cfg)).items()}
        )
    # a field of the user's own method that the record lacks was added since the run started:
    # a change of the method, unlike a field added to fedlore's own (its default is the
    # behaviour the run was made with)
    gained = {k for k in users_fields(cls) if k in now and k not in before} if hyper_before else ()
    # an unset setting that stands for a value the others decide is that value: spelling it
    # out is no difference (asynchronous.concurrency unset is clients_per_round)
    rules = unset_rules({**config_paths(LocalTraining), **config_paths(cls)})
    unset = {k for k in rules if all(r.get(k, defaults.get(k)) is None for r in (before, now))}
    resolve_unset(before, rules, defaults, set(now))
    resolve_unset(now, rules, defaults)
    for record in (before, now):  # unset in both: what they stand for follows settings that
        record.update({k: None for k in unset if k in record})  # are compared themselves
    if hyper_before is not None:
        unread = _unread_method_settings(method, before, now)
        unread |= {k for k in set(before) | set(now) if k.startswith(METHOD_ONLY)}
        unread |= unread_given(cls, before) & unread_given(cls, now)
        resolve_none(cls, before)
        resolve_none(cls, now)
        for key in unread:
            before.pop(key, None)
            now.pop(key, None)
    # a setting added to fedlore after the run started is no difference while it keeps its
    # default (the run was made with that behaviour)
    diff = sorted(
        k
        for k in set(before) | set(now)
        if (before.get(k, defaults.get(k)) != now.get(k) and not (k in before and k not in now))
        or (k in gained and k in now)
    )
    diff += sorted(k for k in set(before) - set(now))
    # ``hyper.lr`` repeats ``lr`` (``hyper.betas`` repeats ``optim.betas``) when the method
    # takes the global setting: name it once
    path_of = {**config_paths(LocalTraining), **config_paths(cls)}
    diff = [
        k
        for k in diff
        if not (
            k.startswith("hyper.")
            and path_of.get(k.removeprefix("hyper."), k.removeprefix("hyper.")) in diff
        )
    ]
    more = f"; and {len(diff) - 5} more" if len(diff) > 5 else ""  # said, not left out

    def item(k: str) -> str:
        field = k.removeprefix("hyper.")
        if k in gained:  # the user's method gained the field since the run started
            return f"{method}'s field {field}: not in the run -> {now.get(k)!r} (added since)"
        if k.startswith("hyper.") and k not in now:  # the method lost the field since
            return f"{method}'s field {field}: {before.get(k)!r} -> no such field (removed since)"
        return f"{k}: {before.get(k, defaults.get(k))!r} -> {now.get(k)!r}"

    return "; ".join(item(k) for k in diff[:5]) + more


def _fedlores(cls: type) -> bool:
    """Whether ``cls`` is defined in the fedlore package (a built-in method or its base)."""
    module = getattr(cls, "__module__", "") or ""
    return module == "fedlore" or module.startswith("fedlore.")


def users_fields(cls: type) -> set[str]:
    """The ``hyper.*`` keys of the fields of method class ``cls`` that a class outside the
    fedlore package declares (a method of the user's own, registered through ``imports:``, or
    the user's subclass of a built-in method; a settings sub-model such a class declares gives
    its fields). A field the record of a run lacks counts as its default only when fedlore
    declares it (a field added to a built-in method by a later fedlore keeps, at its default,
    the behaviour the run was made with); a field of the user's added or removed since the run
    started is a difference (:func:`config_diff`)."""
    if not dataclasses.is_dataclass(cls):
        return set()
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        owner = next(
            (c for c in reversed(cls.__mro__) if f.name in getattr(c, "__dataclass_fields__", {})),
            cls,
        )
        if _fedlores(owner):
            continue
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if isinstance(default, BaseModel):
            keys |= {f"hyper.{k}" for k in type(default).model_fields if k not in RUN_WIDE}
        else:
            keys.add(f"hyper.{f.name}")
    return keys


def _defaults(cls: type, method: str) -> dict[str, Any]:
    """The default of every setting :func:`config_diff` compares for ``method`` (of class
    ``cls``): the config's at their paths, the method's fields' as ``hyper.*``."""
    defaults = _flatten(_run_config(Config(), method))
    fields = dataclasses.fields(cls)
    given = [(f.name, f.default) for f in fields if f.default is not dataclasses.MISSING]
    given += [
        (f.name, f.default_factory())
        for f in fields
        if f.default_factory is not dataclasses.MISSING
    ]
    defaults.update({f"hyper.{k}": v for k, v in _flat_hyper(given).items()})
    return defaults


DEFAULTS_CHANGED = {
    "meta_bayfl": "the learning-rate search scores by seed Eq. 19 and trains on all of D",
    "meta_bayfl_mcd": "the learning-rate search scores by seed Eq. 19 and trains on all of D",
    "meta_fl": "the learning-rate search scores by seed Eq. 19 and trains on all of D",
    "lora_fair": "the server correction is solved to its minimum",
    "fedfomo": "P-local scores the federated model before local training",
    "fedlore": "candidate_svd is auto: wide matrices take the subspace route (issue 30)",
}
"""Methods whose default behaviour changed after fedlore began recording ``hyper`` in a run's
``config.json``: a run of theirs without that record was made by the older behaviour."""


def check_same_data(out: Path, fingerprint: str) -> None:
    """Refuse to resume a run whose data changed since it started (the files under
    ``data.root``, a tokenizer folder): the same config would otherwise continue on other
    clients' data.

    Raises:
        ConfigError: naming the run folder and both fingerprints.
    """
    path = out / "config.json"
    if not path.exists():
        return
    before = _resumed_record(path).get("data_fingerprint")
    if before is not None and before != fingerprint:
        raise ConfigError(
            f"--resume: the data of {out} changed since the run started (fingerprint {before} "
            f"-> {fingerprint}): files under data.root or the tokenizer differ. Restore them, or "
            "run without --resume to start over"
        )
