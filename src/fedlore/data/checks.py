"""Checks of labelled data where it is read, so that bad data stops a run naming its file.

* :func:`check_rows`: one array file (``npz``): it holds examples, and no input or target is
  NaN or infinite (``data.non_finite``: refuse naming the file, the array and the first bad
  index, or leave such rows out with a count);
* :func:`central_splits`: the source of a central federation has training examples and a test
  split; without a test split (an ``npz`` folder with only ``train.npz``) a fixed stratified
  :data:`HOLDOUT_FRACTION` of the training data becomes the test set, and the run says so
  (``data.missing_test``: ``hold_out``, the default, or ``error``).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlore.config import Config, ConfigError, DataConfig
from fedlore.progress import say_once

if TYPE_CHECKING:
    from fedlore.data.datasource import DataSource

HOLDOUT_FRACTION = 0.2
"""Share of each class of the training data held out as the test set of a source without one."""

HOLDOUT_SEED = 0
"""Seed of that hold-out: a fixed split, the same for every run and experiment seed (like the
official 80/20 splits of the embedded and text sources)."""


class DataWarning(UserWarning):
    """Data that were read, but not as they are on disk (rows left out by ``data.non_finite``)."""


def check_rows(
    path: str | Path, x: np.ndarray, y: np.ndarray, non_finite: str = "error"
) -> tuple[np.ndarray, np.ndarray]:
    """One file's inputs ``x`` ``[B, ...]`` and targets ``y`` ``[B, ...]``, checked.

    Args:
        path: the file (named in every message).
        non_finite: ``"error"`` refuses a NaN or infinite value; ``"drop"`` leaves out every row
            of ``x`` or ``y`` that holds one, with a :class:`DataWarning` giving the count.

    Returns:
        ``(x, y)``, without the dropped rows.

    Raises:
        ValueError: naming the file when it holds no rows or an array of other than numbers,
            or (``"error"``) the array, the index and the value of its first non-finite entry
            and how many rows hold one; (``"drop"``) when no row is left.
    """
    if len(x) == 0:
        raise ValueError(f"{path}: holds no examples (x and y have 0 rows)")
    bad = np.zeros(len(x), dtype=bool)
    first = ""
    for name, arr in (("x", x), ("y", y)):
        if arr.dtype.kind not in "biufc":  # text, dates, ...: no input or target
            raise ValueError(f"{path}: array {name!r} must hold numbers, got dtype {arr.dtype}")
        if arr.dtype.kind not in "fc":  # integers and booleans are always finite
            continue
        finite = np.isfinite(arr)
        if bool(finite.all()):
            continue
        if not first:
            at = tuple(int(i) for i in np.argwhere(~finite)[0])
            first = f"{name}[{', '.join(map(str, at))}] is {arr[at]}"
        bad |= ~finite.reshape(len(arr), -1).all(axis=1)
    if not first:
        return x, y
    count = f"{int(bad.sum())} of its {len(x)} rows"
    if non_finite == "error":
        raise ValueError(
            f"{path}: {first} ({count} hold a NaN or infinite value); fix the file, or set "
            "data.non_finite=drop to leave those rows out"
        )
    if non_finite != "drop":
        raise ValueError(f"non_finite must be 'error' or 'drop', got {non_finite!r}")
    if bool(bad.all()):
        raise ValueError(f"{path}: every row holds a NaN or infinite value ({first})")
    warnings.warn(
        f"{path}: left out {count}, which hold a NaN or infinite value (data.non_finite=drop; "
        f"the first: {first})",
        DataWarning,
        stacklevel=2,
    )
    return x[~bad], y[~bad]


def _files(source: DataSource, root: str | None) -> tuple[str, str, str, str]:
    """What a source's training and test splits are read from, as named in messages (in full
    and short): ``root/train.npz`` and ``root/test.npz`` for an ``npz`` folder."""
    if source.name == "npz" and root is not None:
        return str(Path(root) / "train.npz"), str(Path(root) / "test.npz"), "train.npz", "test.npz"
    where = "" if root is None else f" in data.root={root!r}"
    return f"the training split{where}", f"a test split{where}", "the training data", "test split"


def central_splits(source: DataSource, data: DataConfig) -> tuple[DataSource, str | None]:
    """``source`` as a central federation uses it: with training examples and a test split.

    Without a test split, ``data.missing_test="hold_out"`` holds out a stratified
    :data:`HOLDOUT_FRACTION` of every class of the training data (at least one example of each
    class with two or more; drawn with :data:`HOLDOUT_SEED`) as the test set and says so once;
    ``"error"`` refuses.

    Returns:
        ``(source, note)``: the source with both splits (the natural ids of its examples,
        ``train_ids``, split with them), and what was held out (None when the source has its
        own test split), e.g. ``"held out 20 % of train.npz (...)"``, which the
        run's summary and report repeat.

    Raises:
        ValueError: naming the file when the source holds no training examples.
        ConfigError: naming the missing file under ``data.missing_test=error``, or when the
            training data are too few to hold anything out.
    """
    train_file, test_file, train_name, test_name = _files(source, data.root)
    share = f"{100 * HOLDOUT_FRACTION:g} %"
    if len(source.train) == 0:
        raise ValueError(
            f"data.name={source.name}: no training examples: {train_file} is missing or empty "
            "(a folder with only a test split is a server's data, for flower.site_data=true)"
        )
    if len(source.test) > 0:
        return source, None
    if data.missing_test == "error":
        raise ConfigError(
            f"data.name={source.name}: no test split: {test_file} does not exist "
            "(data.missing_test=error); add it, or set data.missing_test=hold_out to test on a "
            f"held-out {share} of {train_name}"
        )
    from fedlore.data.text import stratified_split  # text imports fedlore.data.sources

    y = source.train.y.numpy()
    if source.task == "regression":  # deciles of the targets stand in for the classes
        y = np.asarray(y, dtype=np.float64).reshape(len(y), -1)[:, 0]
        y = np.digitize(y, np.quantile(y, np.arange(1, 10) / 10))
    train_idx, test_idx = stratified_split(y, HOLDOUT_FRACTION, HOLDOUT_SEED)
    if len(test_idx) == 0:
        raise ConfigError(
            f"data.name={source.name}: no test split ({test_file} does not exist) and too few "
            f"training examples ({len(y)}, no class with two) to hold one out"
        )
    note = (
        f"held out {share} of {train_name} ({len(test_idx)} of {len(y)} examples, stratified, "
        f"seed {HOLDOUT_SEED}): no {test_name}"
    )
    say_once(
        "%s: no test split (%s does not exist): the test set is %s; "
        "data.missing_test=error refuses instead",
        source.name,
        test_file,
        f"a held-out {share} of {train_file} ({len(test_idx)} of {len(y)} "
        f"examples, stratified by class, seed {HOLDOUT_SEED})",
    )
    ids = source.train_ids
    held = dataclasses.replace(
        source,
        train=source.train.subset(train_idx),
        test=source.train.subset(test_idx),
        train_ids=None if ids is None else ids[train_idx],
        test_ids=None if ids is None else ids[test_idx],
    )
    return held, note


_OWN_KEYS = ("alpha", "min_size", "major_classes", "major_share")  # read by name, or not at all


_WARNED: set[str] = set()


def warn_unread_partition_keys(cfg: Config, name: str, params: Any) -> None:
    """Warn, once per process, about keys of ``partition`` given a value other than their
    default that partitioner ``name`` never reads (``partition.alpha=0.1`` with ``iid``): the
    run goes on, as a sweep over partitions needs, but the setting is not silently lost. A key
    at its default says nothing (it asks for nothing), wherever the config came from."""
    fields = type(cfg.partition).model_fields
    unread = [
        f"partition.{k}={getattr(cfg.partition, k)}"
        for k in _OWN_KEYS
        if k not in params and getattr(cfg.partition, k) != fields[k].default
    ]
    if not unread:
        return
    read = [f"partition.{k}" for k in _OWN_KEYS if k in params]
    text = (
        f"{', '.join(unread)} not used: partition {name!r} reads "
        f"{', '.join(read) or 'none of alpha, min_size, major_classes, major_share'}"
    )
    if name.startswith("flwr:"):
        text += " (a flwr-datasets partitioner takes its arguments from partition.kwargs)"
    if text not in _WARNED:
        _WARNED.add(text)
        warnings.warn(text, DataWarning, stacklevel=3)


def empty_client_message(cfg: Config, client: int, num_examples: int, params: Any) -> str:
    """The one-line refusal of a partition that leaves ``client`` without training data.

    It names the partitioner, the settings it reads (``params``: its signature's parameters)
    and a remedy that applies to it: ``partition.min_size >= 1`` only for a partitioner that
    reads ``min_size`` and has it below 1 (``dirichlet``); otherwise fewer clients, because
    raising a key the partitioner never reads (``step``, ``iid``) would change nothing. With
    more clients than examples, only fewer clients can help, and the message says so."""
    name = cfg.partition.name
    read = {k: getattr(cfg.partition, k) for k in _OWN_KEYS if k in params}
    if cfg.partition.kwargs:
        read["kwargs"] = dict(cfg.partition.kwargs)
    if cfg.num_clients > num_examples:
        remedy = f"use fewer clients (num_clients) than the {num_examples} examples"
    elif "min_size" in params and cfg.partition.min_size < 1:
        remedy = "set partition.min_size >= 1 or use fewer clients"
    else:
        remedy = "use fewer clients (num_clients) or a partition that gives every client data"
    return (
        f"client {client} received no training data from partition {name!r} ({read}, "
        f"{num_examples} examples, {cfg.num_clients} clients); {remedy}"
    )


def shared_pool(cfg: Config, shared: int, total: int) -> str:
    """Where the training examples the clients do not share went, for a partition's refusal
    (which counts only the ``shared`` ones): ``" (the clients share 4 of the 450 training
    examples: data.fraction=0.01)"``; empty when they share all ``total``."""
    if shared == total:
        return ""
    keys = ("fraction", "server_fraction", "selection_fraction")
    fields = type(cfg.data).model_fields
    said = [
        f"data.{k}={getattr(cfg.data, k)}"
        for k in keys
        if getattr(cfg.data, k) != fields[k].default
    ]
    return f" (the clients share {shared} of the {total} training examples: {', '.join(said)})"
