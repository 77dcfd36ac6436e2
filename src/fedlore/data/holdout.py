"""How the kept training pool is cut before and after partitioning: the strata of regression
targets, the server's unlabeled set U, the selection split, and each client's local train/test
split (a random share, or, ``data.local_test=by_id``, the test examples of its own natural
ids).

U is the server's share of unlabeled training data of Meta-BayFL (seed 001, Sec. V-B: "10,000
training photos are stored as unlabeled data on the server"), held out, like the selection split,
as a stratified share (:func:`~fedlore.data.corruption.subsample_stratified`, as the shrinking
``data.fraction``). Every function draws only from the rng it is given (the builders pass the
streams :data:`~fedlore.seeding.DATA_SERVER`, :data:`~fedlore.seeding.DATA_SELECTION` and
:data:`~fedlore.seeding.DATA_SPLIT` of :func:`fedlore.seeding.data_rng`).
"""

from __future__ import annotations

import numpy as np

from fedlore.config import ConfigError
from fedlore.data.corruption import subsample_stratified

TARGET_STRATA = 10
"""Regression: equal-frequency bins of the training targets that stand in for classes."""


def target_strata(y: np.ndarray, bins: int = TARGET_STRATA) -> np.ndarray:
    """The equal-frequency bin (0 .. bins - 1) of every real target of ``y`` ``[n]`` (deciles
    by default): bin edges are the ``1/bins .. (bins-1)/bins`` quantiles of ``y`` itself, so the
    bins are fixed by the data, not by a seed.

    Returns:
        int64 ``[n]``.
    """
    y = np.asarray(y, dtype=np.float64).reshape(len(y), -1)[:, 0]
    edges = np.quantile(y, np.arange(1, bins) / bins)
    return np.digitize(y, edges).astype(np.int64)


def hold_out_server(
    labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray | None, np.ndarray]:
    """Split the pool into the server's unlabeled set U and the clients' share.

    U is a stratified share: each class with n_c examples gives ``max(1, round(fraction · n_c))``
    of them (:func:`~fedlore.data.corruption.subsample_stratified`, as ``data.fraction``).

    Args:
        labels: int array ``[n]`` of the pool's true classes.
        fraction: ``data.server_fraction`` in [0, 1); 0 holds nothing out.
        rng: the server stream ``data_rng(seed, DATA_SERVER)`` (used only when ``fraction > 0``).

    Returns:
        ``(server, clients)``: sorted int64 indices into the pool, disjoint, together all of
        ``[0, n)``; ``server`` is None when ``fraction`` is 0 (``clients`` is then ``arange(n)``).

    Raises:
        ConfigError: when ``fraction`` is outside [0, 1) or U would take every example.
    """
    n = len(labels)
    everything = np.arange(n, dtype=np.int64)
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"data.server_fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return None, everything
    server = subsample_stratified(labels, fraction, rng)
    clients = np.setdiff1d(everything, server, assume_unique=True)
    if len(clients) == 0:
        raise ConfigError(
            f"data.server_fraction={fraction} holds out all {n} training examples (at least one "
            "per class) for the server: nothing is left for the clients; lower it or raise "
            "data.fraction"
        )
    return server, clients


def hold_out_selection(
    labels: np.ndarray | None, candidates: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray | None, np.ndarray]:
    """Split ``candidates`` into the selection split and the clients' share.

    With ``labels`` (classes of every pool index) the split is stratified: each class with n_c
    candidates gives ``max(1, round(fraction · n_c))`` of them; without (documents of a corpus)
    it is a uniform draw of ``max(1, round(fraction · n))``.

    Args:
        labels: int array over the pool (indexed by ``candidates``), or None.
        candidates: sorted int64 indices still available to the clients.
        fraction: ``data.selection_fraction`` in [0, 1); 0 holds nothing out.
        rng: the selection stream ``data_rng(seed, DATA_SELECTION)`` (used only when
            ``fraction > 0``).

    Returns:
        ``(selection, rest)``: sorted int64 subsets of ``candidates``, disjoint, together all of
        it; ``selection`` is None when ``fraction`` is 0 (``rest`` is then ``candidates``).

    Raises:
        ConfigError: when ``fraction`` is outside [0, 1) or nothing would be left.
    """
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"data.selection_fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return None, candidates
    if labels is not None:
        chosen = candidates[subsample_stratified(labels[candidates], fraction, rng)]
    else:
        k = max(1, round(fraction * len(candidates)))
        chosen = np.sort(rng.choice(candidates, size=min(k, len(candidates)), replace=False))
    rest = np.setdiff1d(candidates, chosen, assume_unique=True)
    if len(rest) == 0:
        raise ConfigError(
            f"data.selection_fraction={fraction} holds out all {len(candidates)} remaining "
            "training examples for the selection split: nothing is left for the clients"
        )
    return np.sort(chosen).astype(np.int64), rest.astype(np.int64)


def split_local(
    indices: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's indices at random into local train and test parts.

    The test part has ``round(test_fraction · n)`` indices, clamped to [1, n - 1] when n ≥ 2, so
    both parts are non-empty; a client with a single example keeps it for training.

    Args:
        indices: int array ``[n]`` of the client's example indices.
        test_fraction: share of the client's examples held out for its local test split.
        rng: source of the split.

    Returns:
        ``(train, test)``: sorted int64 index arrays, disjoint, together equal to ``indices``.
    """
    n = len(indices)
    if n < 2:
        return np.sort(indices).astype(np.int64), np.zeros(0, dtype=np.int64)
    n_test = min(max(1, round(test_fraction * n)), n - 1)
    perm = rng.permutation(indices)
    return np.sort(perm[n_test:]).astype(np.int64), np.sort(perm[:n_test]).astype(np.int64)


def local_test_mode(local_test: str | None, partition: str, test_ids: np.ndarray | None) -> str:
    """How the clients' local test splits are made (``data.local_test``): ``"split"`` (a random
    ``test_fraction`` of each partition, :func:`split_local`) or ``"by_id"`` (the test examples
    of the client's own ids, :func:`tests_by_id`). None: ``by_id`` for the ``natural`` partition
    of a source whose test examples carry ids, else ``split``.

    Raises:
        ConfigError: for ``by_id`` on a source without ids.
    """
    if local_test is None:
        return "by_id" if partition == "natural" and test_ids is not None else "split"
    if local_test == "by_id" and test_ids is None:
        raise ConfigError(
            "data.local_test=by_id needs a source whose examples carry natural ids: "
            "data.name=leaf (its users), or data.name=hf with data.id_column"
        )
    return local_test


def tests_by_id(
    parts: list[np.ndarray],
    ids: np.ndarray,
    test_ids: np.ndarray,
    offset: int,
    id_names: tuple[str, ...] = (),
) -> list[np.ndarray]:
    """Each client's local test split under ``data.local_test=by_id``: the test examples whose
    id is one of the client's (a LEAF user's own test data), as indices ``offset + j`` of test
    example ``j`` (the test split is appended to the pool after its ``offset`` training
    examples). Test examples of an id no client holds are in no local test split.

    Args:
        parts: per client, indices into the pool of its training examples.
        ids: the id of every pool training example.
        test_ids: the id of every test example.
        offset: where the test split starts in the pool.
        id_names: the ids' names, for messages.

    Returns:
        Per client, sorted int64 indices.

    Raises:
        ConfigError: when an id's training examples are on two clients (``by_id`` needs each id
            on one client: ``partition.name=natural``).
    """
    size = int(max(ids.max(initial=-1), test_ids.max(initial=-1))) + 1
    client_of = np.full(size, -1, dtype=np.int64)
    for client, part in enumerate(parts):
        mine = np.unique(ids[part])
        taken = mine[(client_of[mine] >= 0) & (client_of[mine] != client)]
        if len(taken):
            u = int(taken[0])
            name = id_names[u] if u < len(id_names) else str(u)
            raise ConfigError(
                f"data.local_test=by_id: the examples of id {name!r} are on clients "
                f"{int(client_of[u])} and {client}; by_id needs every id on one client "
                "(partition.name=natural), else set data.local_test=split"
            )
        client_of[mine] = client
    owner = client_of[test_ids]
    order = np.argsort(owner, kind="stable")[int((owner < 0).sum()) :]  # ids of no client first
    counts = np.bincount(owner[owner >= 0], minlength=len(parts))
    return [offset + p.astype(np.int64) for p in np.split(order, np.cumsum(counts)[:-1])]
