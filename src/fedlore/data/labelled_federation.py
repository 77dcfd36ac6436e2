"""Building the federation of a labelled source for one seed (:func:`labelled_federation`).

The steps are the data protocols of Meta-BayFL (seed 001): keep a stratified share |D| of the
training set (the shrinking of Table I, ``data.fraction``); hold out the server's unlabeled set U
and the selection split (:mod:`fedlore.data.holdout`); partition the rest over the clients
(``iid``, or seed 001's 'Step' and 'Dirichlet' scenarios of Sec. V-B,
:mod:`fedlore.data.partition`); split each client's share into local train/test; add the input
noise ε of Table I and flip labels (:mod:`fedlore.data.corruption`).

Seeding: every random step draws from its own stream ``data_rng(seed, DATA_<STEP>)``
(``data_rng(seed, DATA_<STEP>, client)`` for per-client steps; :mod:`fedlore.seeding`), so the
same seed gives the same federation for every method and every call, and changing one step (e.g.
the noise level) leaves the others (e.g. the partition) unchanged.
"""

from __future__ import annotations

import inspect

import torch

from fedlore import registry
from fedlore.config import Config, ConfigError
from fedlore.data.checks import central_splits, empty_client_message, shared_pool
from fedlore.data.client_data import TensorSplit
from fedlore.data.container import Federation
from fedlore.data.corruption import add_gaussian_noise, flip_labels, subsample_stratified
from fedlore.data.datasource import DataSource
from fedlore.data.holdout import (
    hold_out_selection,
    hold_out_server,
    local_test_mode,
    split_local,
    target_strata,
    tests_by_id,
)
from fedlore.data.partition import partition_labels
from fedlore.seeding import (
    DATA_FLIP,
    DATA_FRACTION,
    DATA_NOISE_TEST,
    DATA_NOISE_TRAIN,
    DATA_SELECTION,
    DATA_SERVER,
    DATA_SPLIT,
    client_stream_seeds,
    data_generator,
    data_rng,
)


def labelled_federation(cfg: Config, seed: int, source: DataSource) -> Federation:
    """Build the federation of a labelled source (loaded by
    :func:`fedlore.data.federation.load_source`) for one seed.

    Steps: keep a stratified share ``cfg.data.fraction`` of the training set (its test split
    held out first when it has none, :func:`~fedlore.data.checks.central_splits`); hold out a
    stratified share ``cfg.data.server_fraction`` of it as the server's unlabeled set U
    (:func:`hold_out_server`, stream ``data_rng(seed, DATA_SERVER)``) and a stratified share
    ``cfg.data.selection_fraction`` of what is left as the selection split
    (:func:`hold_out_selection`, stream ``data_rng(seed, DATA_SELECTION)``); partition the rest
    over ``cfg.num_clients`` clients with ``cfg.partition`` (given the source's natural ids,
    ``train_ids``, where it has them); split each client's examples into local train/test with
    ``cfg.data.test_fraction`` (or, ``data.local_test=by_id``, give each client the test
    examples of its own ids, appended to the pool: :func:`tests_by_id`); add input noise
    ``cfg.data.noise`` to the kept training inputs (so to client train and test) and, from
    another stream, to the central test set; flip a share ``cfg.data.label_flip`` of each
    client's training labels.

    Args:
        cfg: the experiment config.
        seed: the experiment seed (≥ 0); the only source of randomness.
        source: the loaded source.

    Returns:
        The :class:`~fedlore.data.container.Federation`.

    Raises:
        KeyError: for an unknown partitioner.
        ValueError: on a partition that is not a cover, or a client left with no training data
            (the message suggests ``partition.min_size``).
        ConfigError: when ``data.server_fraction`` or ``data.selection_fraction`` leaves the
            clients nothing, input noise or label flips are asked of a regression source, or
            ``data.local_test=by_id`` of a source without ids or a partition that splits an id.
    """
    test_split = None
    if not cfg.flower.site_data:  # a site's test file is never read: the server evaluates
        source, test_split = central_splits(source, cfg.data)
    regression = source.task == "regression"
    if regression:
        bad = [k for k in ("noise", "label_flip") if getattr(cfg.data, k) > 0]
        if bad:
            raise ConfigError(
                f"data.{bad[0]} is defined for images and class labels; source "
                f"{source.name!r} is a regression data set (standardized features, real targets)"
            )
    all_strata = target_strata(source.train.y.numpy()) if regression else source.train.y.numpy()
    keep = subsample_stratified(all_strata, cfg.data.fraction, data_rng(seed, DATA_FRACTION))
    pool = source.train if len(keep) == len(source.train) else source.train.subset(keep)
    labels = all_strata[keep]  # classes, or the target deciles of a regression source
    server_idx, client_idx = hold_out_server(
        labels, cfg.data.server_fraction, data_rng(seed, DATA_SERVER)
    )
    selection_idx, client_idx = hold_out_selection(
        labels,
        client_idx,
        cfg.data.selection_fraction,
        data_rng(seed, DATA_SELECTION),
    )
    ids = None if source.train_ids is None else source.train_ids[keep]  # natural ids, if any
    # without U and a selection split, client_idx is arange(n): the partition is exactly the
    # one without these steps
    try:
        split = partition_labels(
            cfg, seed, labels[client_idx], None if ids is None else ids[client_idx]
        )
    except ValueError as e:  # "for 4 examples": say where the rest of the data went
        raise ValueError(f"{e}{shared_pool(cfg, len(client_idx), len(source.train))}") from e
    parts = [client_idx[p] for p in split]
    by_id = local_test_mode(cfg.data.local_test, cfg.partition.name, source.test_ids) == "by_id"
    if by_id:  # each client tests on the test examples of its own ids, appended to the pool
        assert ids is not None and source.test_ids is not None
        own_tests = tests_by_id(parts, ids, source.test_ids, len(pool), source.id_names)
        pool = TensorSplit.concat([pool, source.test])

    train_idx, test_idx = [], []
    for i, part in enumerate(parts):
        if by_id:
            tr, te = part, own_tests[i]
        else:
            tr, te = split_local(part, cfg.data.test_fraction, data_rng(seed, DATA_SPLIT, i))
        if len(tr) == 0:
            params = inspect.signature(registry.get("partition", cfg.partition.name)).parameters
            message = empty_client_message(cfg, i, len(client_idx), params)
            raise ValueError(message + shared_pool(cfg, len(client_idx), len(source.train)))
        train_idx.append(tr)
        test_idx.append(te)

    train_labels = pool.y.clone()
    if cfg.data.label_flip > 0:
        for i, tr in enumerate(train_idx):
            rng = data_rng(seed, DATA_FLIP, i)
            flipped = flip_labels(labels[tr], cfg.data.label_flip, source.num_classes, rng)
            train_labels[torch.from_numpy(tr)] = torch.from_numpy(flipped)

    central_test = source.test
    if cfg.data.noise > 0:
        pool = TensorSplit(
            add_gaussian_noise(pool.x, cfg.data.noise, data_generator(seed, DATA_NOISE_TRAIN)),
            pool.y,
        )
        central_test = TensorSplit(
            add_gaussian_noise(
                source.test.x, cfg.data.noise, data_generator(seed, DATA_NOISE_TEST)
            ),
            source.test.y,
        )
    selection = None
    if selection_idx is not None:  # inputs as the clients see them (noise), true labels
        sel = torch.from_numpy(selection_idx)
        selection = TensorSplit(pool.x[sel], pool.y[sel])
    return Federation(
        source=source.name,
        pool=pool,
        train_labels=train_labels,
        train_indices=tuple(train_idx),
        test_indices=tuple(test_idx),
        central_test=central_test,
        num_classes=source.num_classes,
        input_shape=source.input_shape,
        class_names=list(source.class_names),
        stream_seeds=client_stream_seeds(seed, cfg.num_clients)
        if cfg.data.sampling == "stream"
        else None,
        server_indices=server_idx,
        selection=selection,
        selection_indices=selection_idx,
        task=source.task,
        strata=labels if regression else None,
        test_split=test_split,
    )
