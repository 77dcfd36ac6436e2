"""The federations of a site-local Flower deployment (``flower.site_data: true``): the server's
(only its own test set, :func:`server_federation`) and each site's (its own folder as a
one-client federation, :func:`site_federation`), with the settings such a deployment refuses
(:func:`check_site_config`). Plain data code: nothing here imports flwr.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedlore.config import Config, ConfigError
from fedlore.data.client_data import TensorSplit
from fedlore.data.container import Federation, with_precision
from fedlore.data.corpus import Corpus
from fedlore.data.corruption import add_gaussian_noise
from fedlore.data.federation import build_federation, load_source
from fedlore.seeding import DATA_NOISE_TEST, DATA_SITE, data_generator, data_seed

SITE_REFUSED = {
    "eval.clients": "the server holds no client's test split (each site keeps its own)",
    "diagnostics.every": "the diagnostics read every client's data on the server",
    "data.server_fraction": "U would be cut from data the server does not hold",
    "data.selection_fraction": "the selection split would be cut from data the server does "
    "not hold (select on a held-out site, or give the server a selection test set)",
}
"""Settings a site-local deployment (``flower.site_data``) refuses, with the reason."""


SITE_SHAPE = "site.data_shape"
"""Broadcast config key of a site-local deployment: ``"<num_classes>|<input shape>"`` of the
server's test set, which every site's data must match (one model for all)."""

SITE_CLASSES = "site.class_names"
"""Broadcast config key of a site-local deployment: the server's class names (a JSON list),
which every site's must equal, in order (class k is one class on every site)."""


def data_shape(fed: Federation) -> str:
    """``"<num_classes>|<d1>,<d2>,..."`` of a federation (see :data:`SITE_SHAPE`)."""
    return f"{fed.num_classes}|" + ",".join(str(d) for d in fed.input_shape)


def site_config(fed: Federation) -> dict[str, int | float | str | bool]:
    """What the server of a site-local deployment broadcasts for :func:`check_site`."""
    return {SITE_SHAPE: data_shape(fed), SITE_CLASSES: json.dumps(list(fed.class_names))}


def _numbered(names: list[str]) -> bool:
    """Whether ``names`` are the numbers a source without class names gives (``"0"``, ``"1"``,
    ...: an npz file without ``class_names``): such a side names no class, so names are not
    compared with it."""
    return names == [str(k) for k in range(len(names))]


def check_site(fed: Federation, config: Mapping[str, Any], cid: int, root: str) -> None:
    """Refuse a site whose data do not fit the server's test set (:func:`site_config`).

    Raises:
        ValueError: naming the site, its folder and the server's value, when the number of
            classes or the input shape differ, or a class's name (two image folders whose
            class folders differ number their classes differently); a side whose classes are
            only numbered (an npz file without ``class_names``) is not compared by name.
    """
    want = config.get(SITE_SHAPE)
    if want is not None and data_shape(fed) != want:
        raise ValueError(
            f"site {cid}: data-root={root} gives {data_shape(fed)} (classes|input shape), "
            f"the server's test set {want}; every site needs the same classes and input shape"
        )
    names = config.get(SITE_CLASSES)
    theirs, mine = ([] if names is None else json.loads(names)), list(fed.class_names)
    if names is not None and theirs != mine and not (_numbered(theirs) or _numbered(mine)):
        k = next(k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b)
        raise ValueError(
            f"site {cid}: data-root={root} names class {k} {mine[k]!r}, the server's test set "
            f"{theirs[k]!r}; every site needs the same class names in the same order (in an "
            "image folder, the same class folders: an empty folder for a class it lacks)"
        )


def check_site_config(cfg: Config) -> None:
    """Refuse what a site-local deployment cannot do (:data:`SITE_REFUSED`).

    Raises:
        ConfigError: naming every such setting and why, or ``flower.site_data`` outside a
            ``flwr run`` deployment.
    """
    if cfg.engine != "local":
        raise ConfigError(
            f"flower.site_data=true is for `flwr run` deployments (each SuperNode reads its own "
            f"data-root); engine={cfg.engine} simulates a central data set: leave it false"
        )
    bad = {
        "eval.clients": cfg.eval.clients,
        "diagnostics.every": cfg.diagnostics.every > 0,
        "data.server_fraction": cfg.data.server_fraction > 0,
        "data.selection_fraction": cfg.data.selection_fraction > 0,
    }
    problems = [f"{k}: {SITE_REFUSED[k]}" for k, on in bad.items() if on]
    if problems:
        raise ConfigError("flower.site_data=true cannot honour:\n  " + "\n  ".join(problems))


def server_federation(cfg: Config, seed: int) -> Federation:
    """The server's side of a site-local deployment: only the test set of ``data.root`` (in
    the format of ``data.name``; with input noise ``data.noise`` from the central stream as in
    :func:`~fedlore.data.labelled_federation.labelled_federation`), ``cfg.num_clients``
    clients with no data on the server (their data stay on their sites,
    :func:`site_federation`; aggregation weights come from the replies' ``num_examples``).

    Raises:
        ConfigError: for a setting of :data:`SITE_REFUSED`, a pre-training corpus, or a
            ``data.root`` with no test examples.
    """
    check_site_config(cfg)
    source = load_source(cfg.data)
    if isinstance(source, Corpus):
        raise ConfigError(
            "flower.site_data=true: pre-training corpora are partitioned by source group on "
            "one machine; site-local data are labelled sources (npz, IDX, CSV/JSONL)"
        )
    if len(source.test) == 0:
        raise ConfigError(
            f"flower.site_data=true: the server's data.root={cfg.data.root!r} holds no test "
            f"examples for source {source.name!r} (the server evaluates on them)"
        )
    test = source.test
    if cfg.data.noise > 0:
        noisy = add_gaussian_noise(test.x, cfg.data.noise, data_generator(seed, DATA_NOISE_TEST))
        test = TensorSplit(noisy, test.y)
    empty = TensorSplit(test.x[:0], test.y[:0])
    none = np.zeros(0, dtype=np.int64)
    fed = Federation(
        source=source.name,
        pool=empty,
        train_labels=empty.y,
        train_indices=tuple(none for _ in range(cfg.num_clients)),
        test_indices=tuple(none for _ in range(cfg.num_clients)),
        central_test=test,
        num_classes=source.num_classes,
        input_shape=source.input_shape,
        class_names=list(source.class_names),
        task=source.task,
    )
    return with_precision(fed, cfg.precision)


def site_federation(cfg: Config, seed: int, client_id: int, root: str) -> Federation:
    """One site of a site-local deployment: the training split of the site's own folder
    ``root`` (read by the loader ``data.name``, as
    :func:`~fedlore.data.labelled_federation.labelled_federation` reads ``data.root``), as a
    one-client federation: the stratified share ``data.fraction`` is kept, input noise and
    label flips are applied, and the local test split ``data.test_fraction`` is held out,
    exactly as for a client of a central data set, from the streams of the site's own seed
    ``data_seed(seed, DATA_SITE, client_id, bound=2**31)`` (no two sites share a draw). Nothing
    outside ``root`` is read; the site's test file, if any, is not used (the server
    evaluates).

    Raises:
        FileNotFoundError / ValueError: from the loader, naming the site's files.
        ConfigError: for a setting of :data:`SITE_REFUSED`.
    """
    check_site_config(cfg)
    site_seed = data_seed(seed, DATA_SITE, client_id, bound=2**31)
    data = cfg.data.model_copy(update={"root": root})
    one = cfg.model_copy(
        update={
            "data": data,
            "num_clients": 1,
            "partition": type(cfg.partition)(name="iid"),
        }
    )
    return build_federation(one, site_seed)
