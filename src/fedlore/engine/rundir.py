"""Run folders: where a run writes, what it records there, and when it may continue.

A run of (config, method, seed) lives in ``<output_dir>/<name>/<method>/seed-<seed>``
(:func:`run_dir`): ``config.json`` records the settings that decide its results, the method's
resolved hyperparameters and the data fingerprint (:func:`run_record`); ``--resume`` continues
it only under the same config and data (:func:`check_same_config`, :func:`check_same_data`) from
its checkpoint (:func:`fedlore.engine.runstart.resume_point`), and a fresh run clears what an
earlier one left (:func:`fedlore.engine.runstart.start_fresh`). Client states spill to
:func:`spill_dir`. What a run may do with a folder that holds a *finished* run is
:mod:`fedlore.engine.rerun`'s.

The engine builds no method (it never imports one): a run's resolved settings are compared with
those of the method the config builds now through the ``make_algorithm`` the driver passes in
(:func:`fedlore.experiment_parts.make_algorithm`).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from fedlore import registry
from fedlore.algorithm import Algorithm
from fedlore.config import Config, ConfigError
from fedlore.config_unset import resolve_unset, unset_rules
from fedlore.device import PLATFORM_KEYS, platform_record
from fedlore.settings import RUN_WIDE, LocalTraining, config_paths, not_applicable

MakeAlgorithm = Callable[[str, Config], Algorithm]
"""``(method, config) -> the method as the config builds it``: the driver's
:func:`fedlore.experiment_parts.make_algorithm`, passed to what compares a run's recorded
settings with the config's."""


def run_dir(cfg: Config, method: str, seed: int) -> Path:
    """``<output_dir>/<name>/<method>/seed-<seed>``."""
    return Path(cfg.output_dir) / cfg.name / method / f"seed-{seed}"


def spill_dir(cfg: Config, method: str, seed: int, out: Path | None = None) -> Path:
    """Where a run's client states spill: ``client_states/`` in its run directory (``out``, by
    default :func:`run_dir`), or below ``store.spill_dir`` in a folder unique to the run
    directory (two runs never share one)."""
    out = run_dir(cfg, method, seed) if out is None else out
    if not cfg.store.spill_dir:
        return out / "client_states"
    tag = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:10]
    return Path(cfg.store.spill_dir) / f"{cfg.name}-{method}-seed{seed}-{tag}"


def recorded_threads(out: Path) -> int | None:
    """The thread count a run in ``out`` started with (``ran_threads`` of its ``config.json``),
    None when there is none or it cannot be read."""
    try:
        n = json.loads((out / "config.json").read_text()).get("ran_threads")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def check_output_dir(cfg: Config) -> None:
    """``<output_dir>/<name>`` can be a folder this process creates and writes: no part of the
    path is a file, and the deepest part that exists is a folder that can hold files (a
    temporary file is created in it and removed at once: :func:`_probe`; nothing else is
    created). So can ``store.spill_dir`` when client states may spill there
    (``store.max_memory_mb`` set), checked before any run trains instead of when a run builds
    its store.

    Raises:
        ConfigError: naming ``output_dir`` (or ``name``, ``store.spill_dir``) and the part of
            the path in the way.
    """
    target = Path(cfg.output_dir) / cfg.name
    where = f"output_dir={cfg.output_dir!r}, name={cfg.name!r}"
    _check_folder(target, "output_dir", where, "name")
    if cfg.store.spill_dir and cfg.store.max_memory_mb is not None:
        spill = Path(cfg.store.spill_dir)
        _check_folder(spill, "store.spill_dir", f"store.spill_dir={cfg.store.spill_dir!r}")


def _check_folder(target: Path, key: str, where: str, own_key: str | None = None) -> None:
    """``target`` can be created and written (see :func:`check_output_dir`); ``own_key`` names
    the setting when ``target`` itself is the file in the way."""
    for part in [target, *target.parents]:
        if not part.exists():
            continue
        if not part.is_dir():
            named = own_key if part == target and own_key else key
            raise ConfigError(
                f"{named}: {part} is a file, not a folder ({where}); choose another {key}"
                + (f" or {own_key}" if own_key else "")
            )
        problem = _probe(part)
        if problem is not None:
            raise ConfigError(
                f"{key}: cannot create or write {target} ({part} cannot hold files: {problem}; "
                f"{where}); choose another {key}"
            )
        break


def _probe(folder: Path) -> str | None:
    """Why ``folder`` cannot hold files, or None when it can: a temporary file is created in it
    (atomically, under a name no other file has) and removed. ``os.access`` is no answer: as
    root it says yes to every folder, ``/proc`` and read-only mounts included, and the run would
    fail later, when it writes there."""
    try:
        fd, name = tempfile.mkstemp(prefix=".fedlore-probe-", dir=folder)
    except OSError as e:
        if e.errno == errno.ENOENT:  # the folder is there: its file system makes no files
            return "its file system creates no files there"
        return e.strerror or type(e).__name__
    os.close(fd)
    os.unlink(name)
    return None


def check_run_folder(cfg: Config, method: str, seed: int) -> None:
    """The run folder of ``method`` and ``seed`` (:func:`run_dir`) can be a folder: neither it
    nor its method's folder is a file (nothing is created).

    Raises:
        ConfigError: naming the file in the way.
    """
    target = run_dir(cfg, method, seed)
    for part in (target.parent, target):
        if part.exists() and not part.is_dir():
            raise ConfigError(
                f"{part} is a file, not a folder: the run of {method} seed {seed} cannot be made "
                "there; move the file away, or give this run another name=..."
            )


def make_output_dir(cfg: Config) -> None:
    """Create ``<output_dir>/<name>``.

    Raises:
        ConfigError: naming ``output_dir`` when the folder cannot be created.
    """
    target = Path(cfg.output_dir) / cfg.name
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"output_dir={cfg.output_dir!r}: cannot create {target} ({e.strerror or e}); "
            "choose another output_dir"
        ) from e


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """The folders of one run.

    Attributes:
        target: its run folder (:func:`run_dir`).
        out: the folder it writes: ``target``, or, while ``target`` holds a finished run that
            ``--overwrite`` replaces, the sibling the replacement trains in
            (:func:`fedlore.engine.rerun.write_dir`).
        spill: where its client states spill (:func:`spill_dir`).
        resume: whether it continues the run in ``out`` (``--resume``) instead of starting over.
        from_start: a resume that runs again from the first round without the checkpoint (an
            engine that cannot restore its clients' states, Flower's simulation): the run's
            record is kept, and its DP ledger counts the released rows it runs again.
    """

    target: Path
    out: Path
    spill: Path
    resume: bool
    from_start: bool = False


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
    its results, the data fingerprint, the method's resolved hyperparameters, and where and with
    how many threads it ran."""
    return {
        **_run_config(cfg, method),
        "data_fingerprint": fingerprint,
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
    details = config_diff(cfg, method, raw, make_algorithm)
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
    ``dp.clipped_count_stddev``'s value, and only ``participation`` is named)."""
    raw = dict(recorded)
    hyper_before = raw.pop("hyper", None)
    before = _flatten(raw)
    before.pop("data_fingerprint", None)  # compared by check_same_data
    before.pop("ran_on", None)  # a record: a run may resume on another device
    for key in ("ran_threads", *PLATFORM_KEYS):
        before.pop(key, None)
    before.pop("dp_noise_multiplier", None)  # a record: solved from the dp.* settings compared
    before.pop("dp_noise_source", None)  # a record of dp.reproducible_noise, which is compared
    now = _flatten(_run_config(cfg, method))
    for record in (before, now):  # the folder's name, not a setting: a renamed copy is the same
        record.pop("name", None)
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
        if before.get(k, defaults.get(k)) != now.get(k) and not (k in before and k not in now)
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
    return (
        "; ".join(f"{k}: {before.get(k, defaults.get(k))!r} -> {now.get(k)!r}" for k in diff[:5])
        + more
    )


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
