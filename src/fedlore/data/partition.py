"""Partitioners: pure functions that split a labelled training set over clients, and
:func:`partition_labels`, which applies the configured one.

Every partitioner has the signature
``f(labels: np.ndarray, num_clients: int, rng: np.random.Generator, **kwargs) -> list[np.ndarray]``
and returns one sorted int64 index array per client; together they cover every index of
``labels`` exactly once. Irrelevant keyword arguments are accepted and ignored, so the config's
whole ``partition`` section can be passed. All randomness comes from ``rng``.

The schemes:

* ``iid``: a shuffled equal split.
* ``dirichlet``: per-class Dirichlet proportions, Hsu, Qi & Brown 2019, "Measuring the
  effects of non-identical data distribution for federated visual classification"; the
  'Dirichlet' scenario of Meta-BayFL (seed 001, Sec. V-B).
* ``step``: a few major classes per client plus a small equal share of every minor class,
  the 'Step' scenario of Meta-BayFL (seed 001: Rahman & Nguyen, Sec. V-B, crediting Cao et
  al. 2019).
* ``source_dirichlet``: seed 000's C4 allocation of source groups (here the "labels" are
  source-group ids): per-group Dirichlet proportions rounded by largest remainder, redrawn
  while some client is empty.
* ``natural``: one client per natural id (a LEAF user, a writer or speaker of an ``hf``
  dataset's ``data.id_column``), or whole ids grouped when there are more ids than clients.
* ``flwr:<Partitioner>``: any row partitioner of flwr-datasets, resolved by
  :func:`fedlore.registry.get` in :mod:`fedlore.data.flwr_partitions`.

A partitioner receives three more inputs only when its signature names them: ``ids`` (the
natural id of every example, int64 ``[n]``, when the source has ids), ``run_seed`` (the
experiment seed) and ``kwargs`` (``partition.kwargs`` whole); without a ``kwargs`` parameter,
each key of ``partition.kwargs`` must be a keyword parameter it declares, and is passed as one.
A partitioner with ``covers = False`` (flwr-datasets' shards, sizes) may leave examples to no
client; its parts must still be disjoint.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlore import registry
from fedlore.data.checks import warn_unread_partition_keys
from fedlore.progress import say
from fedlore.registry import register_partition
from fedlore.seeding import DATA_PARTITION, data_rng

if TYPE_CHECKING:
    from fedlore.config import Config

MAX_DIRICHLET_ATTEMPTS = 1000
"""Dirichlet redraws before ``min_size`` is declared infeasible."""

_ANNOUNCE_AT = (50, 100, 200, 400, 800)  # redraws after which a slow partition is announced
_MAX_MAJOR_SHUFFLES = 100  # Step: random major-class assignments tried before the cyclic one


def _announce_redraw(attempt: int, min_size: int) -> None:
    """After 50, 100, 200, 400 and 800 redraws, tell the person following the run that the
    partition is being redrawn (a slow start with a small alpha and a large ``min_size`` is
    otherwise silent); doubling keeps a refusal after :data:`MAX_DIRICHLET_ATTEMPTS` draws to
    five lines before it, where every 50 gave nineteen."""
    if attempt in _ANNOUNCE_AT:
        say(
            "Dirichlet partition: %d draws so far left a client below %d example%s; redrawing "
            "(at most %d)",
            attempt,
            min_size,
            "" if min_size == 1 else "s",
            MAX_DIRICHLET_ATTEMPTS,
        )


def _check(labels: np.ndarray, num_clients: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    return labels


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Integer counts summing to ``total``, proportional to ``weights`` (Hamilton's method)."""
    exact = total * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        # Stable sort: ties go to the lower client index, so the result is deterministic.
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


def _assemble(pieces: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [
        np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in pieces
    ]


@register_partition("iid")
def partition_iid(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, **_: Any
) -> list[np.ndarray]:
    """Shuffle all indices and cut them into ``num_clients`` near-equal parts (sizes differ by ≤1).

    Args:
        labels: int array ``[n]`` of class labels (only its length is used).
        num_clients: number of clients N.
        rng: source of the shuffle.

    Returns:
        N sorted int64 index arrays.

    Raises:
        ValueError: when N < 1 or N > n (a client would get no data).
    """
    labels = _check(labels, num_clients)
    if num_clients > len(labels):
        raise ValueError(f"num_clients={num_clients} exceeds the {len(labels)} examples")
    parts = np.array_split(rng.permutation(len(labels)), num_clients)
    return [np.sort(p).astype(np.int64) for p in parts]


@register_partition("dirichlet")
def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float = 0.5,
    min_size: int = 0,
    **_: Any,
) -> list[np.ndarray]:
    """Label-skewed split of Hsu et al. (2019): per-class proportions drawn from Dir(alpha·1_N).

    For each class c, draw p_c ~ Dir(alpha·1_N) over the N clients, shuffle the class's indices
    and cut them at ``floor(cumsum(p_c) · n_c)``. Client sizes therefore differ. If some client
    ends with fewer than ``min_size`` examples, the whole draw is repeated with the same ``rng``
    (the minimum-size rule of PFLlib and the Meta-BayFL supplementary code), at most
    :data:`MAX_DIRICHLET_ATTEMPTS` times.

    Args:
        labels: int array ``[n]`` of class labels.
        num_clients: number of clients N.
        rng: source of the proportions and shuffles.
        alpha: concentration (> 0); small alpha -> few classes per client, large -> near IID.
        min_size: minimum number of examples per client (≥ 0).

    Returns:
        N sorted int64 index arrays.

    Raises:
        ValueError: on alpha ≤ 0, min_size < 0, or when no draw meets ``min_size`` (naming alpha,
            min_size and num_clients).
    """
    labels = _check(labels, num_clients)
    if alpha <= 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    if min_size < 0:
        raise ValueError(f"dirichlet min_size must be >= 0, got {min_size}")
    infeasible = (
        f"dirichlet partition infeasible: alpha={alpha}, min_size={min_size}, "
        f"num_clients={num_clients} for {len(labels)} examples"
    )
    if min_size * num_clients > len(labels):
        raise ValueError(
            infeasible + " (min_size * num_clients > number of examples); lower min_size or "
            f"num_clients until min_size * num_clients <= {len(labels)}"
        )
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for attempt in range(MAX_DIRICHLET_ATTEMPTS):
        _announce_redraw(attempt, min_size)
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            p = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for client, chunk in enumerate(np.split(rng.permutation(idx), cuts)):
                pieces[client].append(chunk)
        parts = _assemble(pieces)
        if min(len(p) for p in parts) >= min_size:
            return parts
    raise ValueError(
        infeasible + f": no draw in {MAX_DIRICHLET_ATTEMPTS} attempts gave every client "
        f">= {min_size} examples; raise alpha or lower min_size or num_clients"
    )


def _assign_majors(
    num_classes: int, num_clients: int, major_classes: int, rng: np.random.Generator
) -> np.ndarray:
    """``[N, m]`` major classes (indices into the present classes), distinct within a client.

    The N·m slots hold every class equally often (±1), like FedBE's equal-size label shards.
    Slots are shuffled and redrawn until no client holds a class twice; if that keeps failing
    (m close to C), the cyclic assignment over one random class permutation is used.
    """
    slots = np.resize(rng.permutation(num_classes), num_clients * major_classes)
    for _ in range(_MAX_MAJOR_SHUFFLES):
        majors = rng.permutation(slots).reshape(num_clients, major_classes)
        if all(len(set(row.tolist())) == major_classes for row in majors):
            return majors
    return slots.reshape(num_clients, major_classes)


@register_partition("step")
def partition_step(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    major_classes: int = 2,
    major_share: float = 0.8,
    **_: Any,
) -> list[np.ndarray]:
    """'Step' label imbalance: each client has a few major classes and a thin slice of the rest.

    Source: Meta-BayFL (Rahman & Nguyen, Sec. V-B): on CIFAR-10 with 10 clients "each client
    receives 10 images for each of the eight minor classes and 1,960 images for each of the two
    major classes" (40,000 images once the 10,000-image server pool is removed, so 4,000 per
    class); the paper credits Cao et al. 2019's step imbalance. The only code producing it is
    FedBE's ``utils/sampling.py`` ``step`` branch (2 random label-sorted shards per client plus
    10 random images of every class), whose shards may repeat a class and whose extra images
    also go to the majors; where the two differ we follow the paper's numbers.

    Reading implemented here (it reproduces those numbers exactly with ``major_classes=2``,
    ``major_share=0.98``): client i holds a set M_i of ``major_classes`` = m distinct classes.
    The N·m major slots cover every class equally often (±1) and are assigned at random. Client
    i's weight for class c is ``major_share / m`` if c ∈ M_i else ``(1 - major_share) / (C - m)``;
    each class's shuffled indices are divided over the clients in proportion to these weights
    (largest-remainder rounding). With balanced classes and N·m a multiple of C, every client
    gets the same size and exactly ``major_share`` of it from its majors (up to rounding);
    otherwise the share deviates where a class is major for more or fewer clients.

    Args:
        labels: int array ``[n]`` of class labels; C is the number of distinct labels.
        num_clients: number of clients N.
        rng: source of the major-class assignment and of the shuffles.
        major_classes: m, major classes per client (1 ≤ m ≤ C).
        major_share: share of a client's data drawn from its major classes, in (0, 1].

    Returns:
        N sorted int64 index arrays.

    Raises:
        ValueError: on m outside [1, C], major_share outside (0, 1], or major_share = 1 while
            some class is nobody's major (N·m < C), which would leave its examples unassigned.
    """
    labels = _check(labels, num_clients)
    classes = np.unique(labels)
    num_classes = len(classes)
    if not 1 <= major_classes <= num_classes:
        raise ValueError(f"step major_classes must be in [1, {num_classes}], got {major_classes}")
    if not 0.0 < major_share <= 1.0:
        raise ValueError(f"step major_share must be in (0, 1], got {major_share}")
    if major_share == 1.0 and num_clients * major_classes < num_classes:
        raise ValueError(
            f"step partition infeasible: major_share=1.0 with num_clients={num_clients} x "
            f"major_classes={major_classes} < {num_classes} classes leaves classes unassigned"
        )
    majors = _assign_majors(num_classes, num_clients, major_classes, rng)
    is_major = np.zeros((num_clients, num_classes), dtype=bool)
    np.put_along_axis(is_major, majors, True, axis=1)
    minor_weight = (
        (1.0 - major_share) / (num_classes - major_classes) if num_classes > major_classes else 0.0
    )
    weights = np.where(is_major, major_share / major_classes, minor_weight)
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for j, c in enumerate(classes):
        idx = rng.permutation(np.flatnonzero(labels == c))
        counts = _largest_remainder(len(idx), weights[:, j])
        for client, chunk in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
            pieces[client].append(chunk)
    return _assemble(pieces)


@register_partition("source_dirichlet")
def partition_source_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float = 0.5,
    min_size: int = 0,
    **_: Any,
) -> list[np.ndarray]:
    """Seed 000's C4 allocation: a Dirichlet split of every source group, exact integer counts.

    Source: seed 000, Appendix "C4 Partitioning Protocol" (Eqs. 68-70). For each group c (in
    increasing group id) with ``M_c`` documents: draw ``p_c ~ Dir(alpha·1_N)``; set
    ``n_{c,i} = floor(M_c p_{c,i})``; give the ``M_c - Σ_i n_{c,i}`` remaining documents one each
    to the clients with the largest fractional remainders ``M_c p_{c,i} - n_{c,i}`` (ties: lower
    client index); shuffle the group's documents and hand out consecutive blocks of sizes
    ``n_{c,1}, ..., n_{c,N}``. If any client ends with no document (or, with ``min_size`` > 1,
    fewer than ``min_size``), the whole allocation is redrawn with the next values of the same
    ``rng`` (at most :data:`MAX_DIRICHLET_ATTEMPTS` times). Client sizes are not rebalanced.
    Unlike ``dirichlet`` (cut points at ``floor(cumsum(p)·M)``), the counts here are the seed's
    largest-remainder rounding.

    Args:
        labels: int array ``[M]`` of source-group ids (any integers; one group per value).
        num_clients: number of clients N.
        rng: source of the proportions and shuffles (its own stream, separate from training).
        alpha: concentration alpha_C4 (> 0; the seed uses 0.5).
        min_size: documents every client must receive (0 or 1: the seed's rule, none empty).

    Returns:
        N sorted int64 index arrays, disjoint, covering ``0..M-1``, none empty.

    Raises:
        ValueError: on alpha ≤ 0, min_size < 0, N · max(1, min_size) > M, or when no draw in
            :data:`MAX_DIRICHLET_ATTEMPTS` gives every client enough documents.
    """
    labels = _check(labels, num_clients)
    if alpha <= 0:
        raise ValueError(f"source_dirichlet alpha must be > 0, got {alpha}")
    if min_size < 0:
        raise ValueError(f"source_dirichlet min_size must be >= 0, got {min_size}")
    need = max(1, min_size)
    if num_clients * need > len(labels):
        raise ValueError(
            f"source_dirichlet: num_clients={num_clients} x {need} document(s) each exceeds the "
            f"{len(labels)} documents, so some client would receive too few"
        )
    by_group = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for attempt in range(MAX_DIRICHLET_ATTEMPTS):
        _announce_redraw(attempt, min_size)
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_group:
            p = rng.dirichlet(np.full(num_clients, alpha))
            counts = _largest_remainder(len(idx), p)
            for client, block in enumerate(np.split(rng.permutation(idx), np.cumsum(counts)[:-1])):
                pieces[client].append(block)
        parts = _assemble(pieces)
        if min(len(p) for p in parts) >= need:
            return parts
    raise ValueError(
        f"source_dirichlet: no draw in {MAX_DIRICHLET_ATTEMPTS} attempts gave each of the "
        f"{num_clients} clients >= {need} document(s) (alpha={alpha}, {len(labels)} documents "
        f"in {len(by_group)} groups); raise alpha, lower partition.min_size or use fewer clients"
    )


@register_partition("natural")
def partition_natural(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    ids: np.ndarray | None = None,
    **_: Any,
) -> list[np.ndarray]:
    """Natural partition: every example goes to the client of its natural id (the LEAF user, the
    writer or speaker of ``data.id_column``), never split between clients.

    With as many clients as ids present, client ``k`` holds the ``k``-th id in increasing order
    (the sorted id names of the source): no randomness. With fewer clients, the ids are shuffled
    with ``rng`` and cut into ``num_clients`` groups of near-equal numbers of ids
    (``numpy.array_split``), each client holding the examples of one group; client sizes then
    follow the ids' sizes.

    Args:
        labels: int array ``[n]`` of class labels (only checked).
        num_clients: number of clients N (at most the number of ids present).
        rng: source of the grouping (unused when N equals the number of ids).
        ids: int array ``[n]``, the id of every example (from the source).

    Returns:
        N sorted int64 index arrays, none empty.

    Raises:
        ValueError: without ids (naming the sources that have them), on ids of another length
            than ``labels``, or for more clients than ids.
    """
    labels = _check(labels, num_clients)
    if ids is None:
        raise ValueError(
            "partition 'natural' needs the natural id of every example: data.name=leaf (its "
            "users), or data.name=hf with data.id_column=<the column of writers, speakers, ...>"
        )
    ids = np.asarray(ids, dtype=np.int64)
    if ids.shape != labels.shape:
        raise ValueError(f"natural partition: {len(ids)} ids for {len(labels)} labels")
    present = np.unique(ids)
    if num_clients > len(present):
        raise ValueError(
            f"partition 'natural': num_clients={num_clients}, but the clients' data hold "
            f"{len(present)} ids (users, writers, ...): set num_clients={len(present)} for one "
            "id per client, or fewer to group whole ids"
        )
    if num_clients == len(present):
        groups = [present[k : k + 1] for k in range(num_clients)]
    else:
        groups = np.array_split(rng.permutation(present), num_clients)
    owner = np.full(int(present.max()) + 1, -1, dtype=np.int64)
    for client, group in enumerate(groups):
        owner[group] = client
    client_of = owner[ids]
    order = np.argsort(client_of, kind="stable")  # within a client: increasing index
    return [
        np.asarray(p, dtype=np.int64)
        for p in np.split(order, np.cumsum(np.bincount(client_of, minlength=num_clients))[:-1])
    ]


def _check_cover(
    parts: list[np.ndarray], n: int, name: str, clients: int, complete: bool = True
) -> None:
    """One integer index array per client, and every index in ``[0, n)`` in exactly one part
    (``complete``), or in at most one (a partitioner that may leave examples out: the count left
    out is said)."""
    if not isinstance(parts, (list, tuple)) or len(parts) != clients:
        got = f"{len(parts)} parts" if isinstance(parts, (list, tuple)) else type(parts).__name__
        raise ValueError(f"partition {name!r} returned {got} for num_clients={clients}; it "
                         "must return one index array per client")  # fmt: skip
    kinds = {np.asarray(p).dtype for p in parts if np.asarray(p).size}
    if any(k.kind not in "iu" for k in kinds):
        raise ValueError(f"partition {name!r} returned indices of dtype {sorted(map(str, kinds))}"
                         "; index arrays must be integers")  # fmt: skip
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if complete:
        if len(flat) != n or not np.array_equal(np.sort(flat), np.arange(n)):
            raise ValueError(
                f"partition {name!r} does not cover each of the {n} indices exactly once"
            )
        return
    if len(flat) and (flat.min() < 0 or flat.max() >= n):
        raise ValueError(f"partition {name!r} gave an index outside [0, {n})")
    if len(np.unique(flat)) != len(flat):
        raise ValueError(f"partition {name!r} gave some example to two clients")
    if len(flat) < n:
        say("partition %s: %d of the %d examples went to no client", name, n - len(flat), n)


_FIXED = ("labels", "num_clients", "rng")  # positional inputs of every partitioner
_ON_REQUEST = ("ids", "run_seed", "kwargs")  # inputs a partitioner gets when it names them


def _declared_kwargs(partition: Any, cfg: Config) -> dict[str, Any]:
    """``partition.kwargs`` as keyword arguments of a partitioner that declares each of them.

    Raises:
        ValueError: naming a key the partitioner does not declare, and those it does.
    """
    params = inspect.signature(partition).parameters
    named = {
        k
        for k, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and k not in (*_FIXED, *_ON_REQUEST)
        and k not in type(cfg.partition).model_fields
    }
    unknown = sorted(set(cfg.partition.kwargs) - named)
    if unknown:
        raise ValueError(
            f"partition.kwargs {unknown}: partitioner {cfg.partition.name!r} takes no such "
            f"argument (its own: {sorted(named) or 'none'}; partition.alpha, min_size, "
            "major_classes and major_share are keys of their own)"
        )
    return dict(cfg.partition.kwargs)


def partition_labels(
    cfg: Config, seed: int, labels: np.ndarray, ids: np.ndarray | None = None
) -> list[np.ndarray]:
    """Split ``labels`` (classes, or source groups of documents) over ``cfg.num_clients`` with
    the partitioner ``cfg.partition.name`` (registered, or ``flwr:<Partitioner>``), drawing from
    the partition stream ``data_rng(seed, DATA_PARTITION)`` only (a flwr-datasets partitioner:
    from its ``seed``, the run's ``seed`` unless ``partition.kwargs`` gives one).

    Args:
        cfg: the experiment config.
        seed: the experiment seed.
        labels: int array ``[n]``.
        ids: the natural id of every example, int64 ``[n]``, or None (the source has none).

    Raises:
        KeyError: for an unknown partitioner.
        ValueError: from the partitioner, for ``partition.kwargs`` it does not take, or when its
            parts do not cover every index once (leave none to two clients, for a partitioner
            with ``covers = False``).
    """
    name = cfg.partition.name
    partition = registry.get("partition", name)
    params = inspect.signature(partition).parameters
    warn_unread_partition_keys(cfg, name, params)
    given = {"ids": ids, "run_seed": seed, "kwargs": dict(cfg.partition.kwargs)}
    extra = {k: v for k, v in given.items() if k in params}
    if "kwargs" not in params:
        extra.update(_declared_kwargs(partition, cfg))
    settings = cfg.partition.model_dump(exclude={"name", "kwargs"})
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):  # no **settings: what it names
        settings = {k: v for k, v in settings.items() if k in params}
    parts: list[np.ndarray] = partition(
        labels, cfg.num_clients, data_rng(seed, DATA_PARTITION), **settings, **extra
    )
    _check_cover(parts, len(labels), name, cfg.num_clients, getattr(partition, "covers", True))
    return parts
