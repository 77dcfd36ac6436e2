"""A federation: one data source split over clients, built deterministically from a seed.

:func:`build_federation` loads the source, keeps a stratified share |D| of its training set,
holds out a stratified share of that pool as the server's unlabeled set U
(``data.server_fraction``, the same for every method), partitions the rest over the clients,
splits each client's share into local train/test, and applies input noise and label flips. It
keeps the (possibly noisy) training tensors once plus index arrays per client;
:meth:`Federation.client` materializes one client's :class:`ClientData`.

Seeding: every random step draws from its own stream ``np.random.default_rng([seed, STREAM])``
(``[seed, STREAM, client]`` for per-client steps), so the same seed gives the same federation
for every method and every call, and changing one step (e.g. the noise level) leaves the others
(e.g. the partition) unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedlore import registry
from fedlore.config import Config, ConfigError, DataConfig
from fedlore.data.checks import central_splits
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.data.corpus import IGNORE_INDEX, Corpus
from fedlore.data.corruption import add_gaussian_noise, flip_labels, subsample_stratified
from fedlore.data.sources import DataSource
from fedlore.progress import say

# Stream ids: one per purpose, never reused.
STREAM_FRACTION = 0
STREAM_PARTITION = 1
STREAM_SPLIT = 2
STREAM_NOISE_TRAIN = 3
STREAM_NOISE_TEST = 4
STREAM_FLIP = 5
STREAM_SAMPLING = 6
STREAM_SERVER = 7
STREAM_SELECTION = 8
STREAM_SITE = 9


def _torch_generator(seed: int, stream: int) -> torch.Generator:
    derived = int(np.random.default_rng([seed, stream]).integers(2**63 - 1))
    return torch.Generator().manual_seed(derived)


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


@dataclass(frozen=True)
class Federation:
    """Clients' data as index arrays into one shared training pool.

    Attributes:
        source: registry name of the data source.
        pool: the kept training set; inputs ``[n, C, H, W]`` with noise already applied (text:
            int64 token ids ``[n, L]``), labels ``[n]`` the true (unflipped) classes.
        train_labels: labels ``[n]`` that clients train on (with label flips, if configured).
        train_indices: per client, sorted indices into ``pool`` of its local training split.
        test_indices: per client, sorted indices into ``pool`` of its local test split.
        central_test: the source's official test set (with noise, if configured).
        num_classes: number of classes.
        input_shape: shape of one example, ``(C, H, W)`` (text: ``(L,)``).
        class_names: one name per class.
        task: ``"classification"``, ``"regression"`` (real targets, see :attr:`strata`) or
            ``"language_modeling"`` (a pre-training corpus: ``pool``
            holds every client's packed sequences ``[n, L]`` with next-token targets ``[n, L]``,
            ``num_classes`` is the vocabulary size, ``central_test`` the packed validation
            corpus, and clients have no local test split).
        stream_seeds: per client, the seed of its minibatch stream (None: per-round sampling;
            see :class:`~fedlore.data.client_data.ClientData`).
        group_names: language modeling: the source groups (normalized hostnames).
        group_histogram: language modeling: documents per client and source group,
            int64 ``[N, len(group_names)]``.
        server_indices: sorted indices into ``pool`` of the server's unlabeled set U
            (``data.server_fraction``; None when there is none). Disjoint from every client's
            train and test indices; see :attr:`server_unlabeled`.
        selection: the selection split (``data.selection_fraction``; None when there is
            none): labelled data (inputs with the clients' noise, true labels) held out of every
            client, on which hyperparameters are chosen instead of the reported test set;
            language modeling: the packed selection documents ``[n, L]`` with targets.
        selection_indices: labelled sources: sorted indices into ``pool`` of
            :attr:`selection` (disjoint from every client's and from U); corpora: indices of
            the held-out training documents.
        strata: regression (``task="regression"``, real targets ``[n]`` in ``pool.y``): the
            target decile of every pool example, int64 ``[n]`` (:func:`target_strata`), which
            stands in for the class in every stratified step (``data.fraction``, U, the
            selection split) and in the label partitions (Dirichlet over deciles: clients
            differ in their target range); :meth:`histogram` counts them. None otherwise.
        test_split: how ``central_test`` was held out of the training data of a source without
            a test split (``data.missing_test``), e.g. ``"held out 20 % of train.npz (...)"``;
            None when it is the source's own.
    """

    source: str
    pool: TensorSplit
    train_labels: torch.Tensor
    train_indices: tuple[np.ndarray, ...]
    test_indices: tuple[np.ndarray, ...]
    central_test: TensorSplit
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: list[str]
    task: str = "classification"
    stream_seeds: tuple[int, ...] | None = None
    group_names: tuple[str, ...] = ()
    group_histogram: np.ndarray | None = None
    server_indices: np.ndarray | None = None
    selection: TensorSplit | None = None
    selection_indices: np.ndarray | None = None
    strata: np.ndarray | None = None
    test_split: str | None = None

    @property
    def device(self) -> torch.device:
        """Where the federation's tensors live."""
        return self.pool.x.device

    def to(self, device: torch.device | str) -> Federation:
        """The federation with its tensors (pool, training labels, central test set, selection
        split) on ``device``: one copy per run, after which every client's data are slices
        made there; ``self`` when they are there already. Index arrays stay numpy."""
        device = torch.device(device)
        if self.pool.x.device == device:
            return self

        def move(sp: TensorSplit | None) -> TensorSplit | None:
            return None if sp is None else TensorSplit(sp.x.to(device), sp.y.to(device))

        pool, test = move(self.pool), move(self.central_test)
        assert pool is not None and test is not None
        return dataclasses.replace(
            self,
            pool=pool,
            train_labels=self.train_labels.to(device),
            central_test=test,
            selection=move(self.selection),
        )

    @property
    def server_unlabeled(self) -> torch.Tensor | None:
        """The server's unlabeled set U: inputs ``[n_U, ...]`` of ``pool`` at
        :attr:`server_indices` (a copy; noise applied as to the clients' training inputs), or
        None without ``data.server_fraction``. Its labels are never exposed to an algorithm."""
        if self.server_indices is None:
            return None
        return self.pool.x[torch.from_numpy(self.server_indices).to(self.device)]

    @property
    def num_clients(self) -> int:
        """Number of clients N."""
        return len(self.train_indices)

    def client(self, i: int) -> ClientData:
        """Materialize client ``i``'s data (copies of its rows; identical on every call).

        Raises:
            IndexError: when ``i`` is not in ``[0, num_clients)``.
        """
        if not 0 <= i < self.num_clients:
            raise IndexError(f"client {i} out of range [0, {self.num_clients})")
        tr = torch.from_numpy(self.train_indices[i]).to(self.device)
        te = torch.from_numpy(self.test_indices[i]).to(self.device)
        return ClientData(
            client_id=i,
            train=TensorSplit(self.pool.x[tr], self.train_labels[tr]),
            test=TensorSplit(self.pool.x[te], self.pool.y[te]),
            stream_seed=None if self.stream_seeds is None else self.stream_seeds[i],
        )

    def fingerprint(self) -> str:
        """A digest of every client's data, the central test set and the sampling seeds (16 hex
        characters): equal for equal federations, different when the files behind a source
        changed. Stored in a run's ``config.json`` so ``--resume`` can refuse changed data."""
        h = hashlib.sha1()
        tensors = (self.pool.x, self.pool.y, self.train_labels, self.central_test.x)
        for t in (*tensors, self.central_test.y):
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        for idx in (*self.train_indices, *self.test_indices):
            h.update(np.ascontiguousarray(idx, dtype=np.int64).tobytes() + b"|")
        h.update(repr(self.stream_seeds).encode())
        if self.server_indices is not None:  # absent without U: earlier fingerprints still hold
            h.update(b"server|" + np.ascontiguousarray(self.server_indices, np.int64).tobytes())
        if self.selection_indices is not None:  # likewise absent without a selection split
            h.update(
                b"selection|" + np.ascontiguousarray(self.selection_indices, np.int64).tobytes()
            )
        return h.hexdigest()[:16]

    def client_sizes(self) -> np.ndarray:
        """Local training examples per client, int64 ``[N]`` (the aggregation weights)."""
        return np.array([len(idx) for idx in self.train_indices], dtype=np.int64)

    def histogram(self) -> np.ndarray:
        """Per-client counts of true training labels, int64 ``[N, num_classes]``; for a
        pre-training corpus, documents per client and source group ``[N, len(group_names)]``.

        Counts use the true classes (before label flips), so they show the partition itself.
        """
        if self.group_histogram is not None:
            return self.group_histogram
        y = self.pool.y.cpu().numpy() if self.strata is None else self.strata
        bins = self.num_classes if self.strata is None else TARGET_STRATA
        return np.stack([np.bincount(y[idx], minlength=bins) for idx in self.train_indices]).astype(
            np.int64
        )

    def format_histogram(self, max_columns: int = 40) -> str:
        """A plain-text table: one row per client with its count per class and its total.

        With more than ``max_columns`` classes or source groups (a web corpus has thousands of
        hosts) each row summarizes instead: total, groups present, and the largest group with
        its share. The title names the classes (fortunes categories, Fashion-MNIST garments)
        or source groups by column number where the data has names.
        """
        hist = self.histogram()
        if hist.shape[1] > max_columns:
            names = list(self.group_names) or [str(c) for c in range(hist.shape[1])]
            kind = "source groups" if self.group_names else "classes"
            out = [
                f"{self.source}: {self.num_clients} clients, {hist.shape[1]} {kind} "
                f"(more than {max_columns}: one summary line per client)",
                "client | total | groups present | largest group (share)",
            ]
            for i, h in enumerate(hist):
                top = int(h.argmax())
                share = h[top] / max(int(h.sum()), 1)
                out.append(
                    f"{i:6d} | {int(h.sum()):5d} | {int((h > 0).sum()):14d} | "
                    f"{names[top]} ({100 * share:.1f} %)"
                )
            return "\n".join(out)
        rows = [[str(i), *map(str, h), str(h.sum())] for i, h in enumerate(hist)]
        rows.append(["all", *map(str, hist.sum(axis=0)), str(hist.sum())])
        header = ["client", *map(str, range(hist.shape[1])), "total"]
        widths = [max(len(r[j]) for r in [header, *rows]) for j in range(len(header))]

        def fmt(r: list[str]) -> str:
            cells = [c.rjust(w) for c, w in zip(r, widths, strict=True)]
            return " ".join([cells[0], "|", *cells[1:-1], "|", cells[-1]])

        if self.group_histogram is not None:
            title = (
                f"{self.source}: {self.num_clients} clients, {len(self.group_names)} source "
                "groups, documents per client and group (groups: "
                + ", ".join(f"{j}={g}" for j, g in enumerate(self.group_names))
                + ")"
            )
        elif self.strata is not None:
            title = (
                f"{self.source}: {self.num_clients} clients, regression, training examples per "
                f"client and target decile (0 = lowest {100 // TARGET_STRATA} % of the targets)"
            )
        else:
            title = (
                f"{self.source}: {self.num_clients} clients, {self.num_classes} classes, "
                "training examples per client and class"
            )
            named = [str(n) for n in self.class_names]
            if named and named != [str(c) for c in range(len(named))]:  # digits name themselves
                title += " (classes: " + ", ".join(f"{j}={n}" for j, n in enumerate(named)) + ")"
        lines = [
            title,
            fmt(header),
            "-" * len(fmt(header)),
            *(fmt(r) for r in rows[:-1]),
            "-" * len(fmt(header)),
            fmt(rows[-1]),
        ]
        return "\n".join(lines)


def _check_cover(parts: list[np.ndarray], n: int, name: str) -> None:
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if len(flat) != n or not np.array_equal(np.sort(flat), np.arange(n)):
        raise ValueError(f"partition {name!r} does not cover each of the {n} indices exactly once")


def partition_labels(cfg: Config, seed: int, labels: np.ndarray) -> list[np.ndarray]:
    """Split ``labels`` (classes, or source groups of documents) over ``cfg.num_clients`` with
    the registered partitioner ``cfg.partition.name``, drawing from the partition stream
    ``[seed, STREAM_PARTITION]`` only.

    Raises:
        ValueError: from the partitioner, or when its parts do not cover every index once.
    """
    partition = registry.get("partition", cfg.partition.name)
    parts: list[np.ndarray] = partition(
        labels,
        cfg.num_clients,
        np.random.default_rng([seed, STREAM_PARTITION]),
        **cfg.partition.model_dump(exclude={"name"}),
    )
    _check_cover(parts, len(labels), cfg.partition.name)
    return parts


def hold_out_server(
    labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray | None, np.ndarray]:
    """Split the pool into the server's unlabeled set U and the clients' share.

    U is a stratified share: each class with n_c examples gives ``max(1, round(fraction · n_c))``
    of them (:func:`~fedlore.data.corruption.subsample_stratified`, as ``data.fraction``).

    Args:
        labels: int array ``[n]`` of the pool's true classes.
        fraction: ``data.server_fraction`` in [0, 1); 0 holds nothing out.
        rng: the server stream ``[seed, STREAM_SERVER]`` (used only when ``fraction > 0``).

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
        rng: the selection stream ``[seed, STREAM_SELECTION]`` (used only when ``fraction > 0``).

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


# DataConfig fields that only some sources take (the text sources): passed as keyword arguments
# to a loader that declares them; set to a non-default value for any other source, an error.
SOURCE_OPTIONS = (
    "tokenizer",
    "max_length",
    "categories",
    "vocab_size",
    "max_documents",
    "validation_documents",
    "non_finite",
)


def load_source(data: DataConfig) -> DataSource | Corpus:
    """Call the registered loader ``data.name`` with ``data.root`` and the options it takes.

    Raises:
        KeyError: for an unknown source.
        ValueError: when an option of :data:`SOURCE_OPTIONS` is set for a source that does not
            take it, or input noise is asked of a source whose inputs are token ids.
    """
    loader = registry.get("source", data.name)
    accepted = inspect.signature(loader).parameters
    options: dict[str, Any] = {}
    for key in SOURCE_OPTIONS:
        value = getattr(data, key)
        if key in accepted:
            options[key] = value
        elif value != DataConfig.model_fields[key].default:
            raise ValueError(f"data.{key}={value!r} has no effect on source {data.name!r}")
    source: DataSource | Corpus = loader(data.root, **options)
    if isinstance(source, Corpus):
        return source
    if data.noise > 0 and not source.train.x.is_floating_point():
        raise ValueError(
            f"data.noise={data.noise} adds pixel noise, but source {data.name!r} gives "
            f"{source.train.x.dtype} inputs (token ids); use data.label_flip for label noise"
        )
    return source


def build_federation(cfg: Config, seed: int) -> Federation:
    """:func:`federation_of` for ``cfg`` and ``seed``, with its floating-point tensors (inputs,
    regression targets) in the config's ``precision`` (:func:`with_precision`). Raises as
    :func:`federation_of` does."""
    say(
        "building the federation: %s, %d clients, %s partition (seed %d)",
        cfg.data.name,
        cfg.num_clients,
        cfg.partition.name,
        seed,
    )
    return with_precision(federation_of(cfg, seed), cfg.precision)


def with_precision(fed: Federation, precision: str) -> Federation:
    """``fed`` with every floating-point tensor (inputs and real targets of the pool, the
    central test set and the selection split) cast to float64 for ``precision="fp64"``;
    unchanged for ``"fp32"`` and ``"bf16"`` (autocast works on fp32 data). Integer tensors
    (labels, token ids) are never cast."""
    if precision != "fp64":  # bf16 autocasts the forward pass; the data stay fp32
        return fed
    dtype = torch.float64

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    def split(sp: TensorSplit | None) -> TensorSplit | None:
        return None if sp is None else TensorSplit(cast(sp.x), cast(sp.y))

    pool, test = split(fed.pool), split(fed.central_test)
    assert pool is not None and test is not None
    return dataclasses.replace(
        fed,
        pool=pool,
        train_labels=cast(fed.train_labels),
        central_test=test,
        selection=split(fed.selection),
    )


def federation_of(cfg: Config, seed: int) -> Federation:
    """Build the federation of an experiment for one seed.

    Steps: load ``cfg.data.name`` from ``cfg.data.root``; keep a stratified share
    ``cfg.data.fraction`` of the training set; hold out a stratified share
    ``cfg.data.server_fraction`` of it as the server's unlabeled set U (:func:`hold_out_server`,
    stream ``[seed, STREAM_SERVER]``) and a stratified share ``cfg.data.selection_fraction`` of
    what is left as the selection split (:func:`hold_out_selection`, stream
    ``[seed, STREAM_SELECTION]``); partition the rest over ``cfg.num_clients`` clients with
    ``cfg.partition``; split each client's examples into local train/test with
    ``cfg.data.test_fraction``; add input noise ``cfg.data.noise`` to the kept training inputs
    (so to client train and test) and, from another stream, to the central test set; flip a
    share ``cfg.data.label_flip`` of each client's training labels.

    Args:
        cfg: the experiment config.
        seed: the experiment seed (≥ 0); the only source of randomness.

    Returns:
        The :class:`Federation`.

    Raises:
        ValueError: on a negative seed, a partition that is not a cover, or a client left with
            no training data (the message suggests ``partition.min_size``).
        ConfigError: when ``data.server_fraction`` leaves the clients nothing, or is set for a
            pre-training corpus.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    source = load_source(cfg.data)
    if isinstance(source, Corpus):
        return corpus_federation(cfg, seed, source)
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
    keep = subsample_stratified(
        all_strata, cfg.data.fraction, np.random.default_rng([seed, STREAM_FRACTION])
    )
    pool = source.train if len(keep) == len(source.train) else source.train.subset(keep)
    labels = all_strata[keep]  # classes, or the target deciles of a regression source
    server_idx, client_idx = hold_out_server(
        labels, cfg.data.server_fraction, np.random.default_rng([seed, STREAM_SERVER])
    )
    selection_idx, client_idx = hold_out_selection(
        labels,
        client_idx,
        cfg.data.selection_fraction,
        np.random.default_rng([seed, STREAM_SELECTION]),
    )
    # without U and a selection split, client_idx is arange(n): the partition is exactly the
    # one without these steps
    parts = [client_idx[p] for p in partition_labels(cfg, seed, labels[client_idx])]

    train_idx, test_idx = [], []
    for i, part in enumerate(parts):
        tr, te = split_local(
            part, cfg.data.test_fraction, np.random.default_rng([seed, STREAM_SPLIT, i])
        )
        if len(tr) == 0:
            raise ValueError(
                f"client {i} received no training data from partition {cfg.partition.name!r} "
                f"({cfg.partition.model_dump(exclude={'name'})}, {len(client_idx)} examples, "
                f"{cfg.num_clients} clients); set partition.min_size >= 1 or use fewer clients"
            )
        train_idx.append(tr)
        test_idx.append(te)

    train_labels = pool.y.clone()
    if cfg.data.label_flip > 0:
        for i, tr in enumerate(train_idx):
            rng = np.random.default_rng([seed, STREAM_FLIP, i])
            flipped = flip_labels(labels[tr], cfg.data.label_flip, source.num_classes, rng)
            train_labels[torch.from_numpy(tr)] = torch.from_numpy(flipped)

    central_test = source.test
    if cfg.data.noise > 0:
        pool = TensorSplit(
            add_gaussian_noise(pool.x, cfg.data.noise, _torch_generator(seed, STREAM_NOISE_TRAIN)),
            pool.y,
        )
        central_test = TensorSplit(
            add_gaussian_noise(
                source.test.x, cfg.data.noise, _torch_generator(seed, STREAM_NOISE_TEST)
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
        stream_seeds=_stream_seeds(seed, cfg.num_clients)
        if cfg.data.sampling == "stream"
        else None,
        server_indices=server_idx,
        selection=selection,
        selection_indices=selection_idx,
        task=source.task,
        strata=labels if regression else None,
        test_split=test_split,
    )


def _stream_seeds(seed: int, num_clients: int) -> tuple[int, ...]:
    return tuple(
        int(np.random.default_rng([seed, STREAM_SAMPLING, i]).integers(2**62))
        for i in range(num_clients)
    )


def _check_targets(split: TensorSplit, what: str) -> None:
    """Refuse packed data in which no position has a next-token target."""
    if not bool((split.y != IGNORE_INDEX).any()):
        raise ValueError(
            f"{what} holds no next-token target ({int(split.x.numel())} token positions): its "
            "documents are empty or too short; a language model cannot train or be scored on it"
        )


def corpus_federation(cfg: Config, seed: int, corpus: Corpus) -> Federation:
    """The federation of a pre-training corpus (seed 000, "C4 Partitioning Protocol").

    Steps: keep a uniform random share ``cfg.data.fraction`` of the training documents (at least
    one per client; a stratified share would keep one document of every one-page host); allocate
    the kept documents (less a uniform share ``cfg.data.selection_fraction`` held out as the
    selection split, packed like the validation corpus) to ``cfg.num_clients`` clients with
    ``cfg.partition`` over their source groups (``source_dirichlet`` is the seed's rule), before
    tokenization; per client, tokenize and pack its documents in corpus order into sequences of
    ``cfg.data.max_length`` tokens (:func:`fedlore.data.corpus.pack_documents`); pack the
    validation corpus the same way as the common test set. The partition stream
    ``[seed, STREAM_PARTITION]`` is separate from every training stream, so the allocation is
    the same for every method. Clients sample minibatches from their own streams unless
    ``cfg.data.sampling`` is ``round``.

    Raises:
        ValueError: when the config asks for something a corpus does not have (input noise,
            label flips, a local test split), the partition is not a cover of the documents, or
            a client's data or the validation corpus has no next-token target (documents too
            short to predict anything).
    """
    data = cfg.data
    unsupported = {
        "noise": data.noise > 0,
        "label_flip": data.label_flip > 0,
        "test_fraction": data.test_fraction != DataConfig.model_fields["test_fraction"].default,
        "server_fraction": data.server_fraction > 0,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ConfigError(
            f"data.{bad[0]} has no effect on the pre-training corpus {corpus.name!r} (documents "
            "have no labels or pixels, and the validation corpus is the common test set)"
        )
    groups = corpus.train_groups
    keep = np.arange(len(groups), dtype=np.int64)
    if data.fraction < 1.0:  # a uniform share of the documents (most web hosts have one or two)
        rng = np.random.default_rng([seed, STREAM_FRACTION])
        size = max(cfg.num_clients, round(data.fraction * len(groups)))
        keep = np.sort(rng.choice(len(groups), size=min(size, len(groups)), replace=False))
    selection_docs, keep = hold_out_selection(
        None, keep, data.selection_fraction, np.random.default_rng([seed, STREAM_SELECTION])
    )
    docs = [keep[p] for p in partition_labels(cfg, seed, groups[keep])]
    for i, d in enumerate(docs):
        if len(d) == 0:
            raise ValueError(
                f"client {i} received no documents from partition {cfg.partition.name!r} "
                f"({len(keep)} documents, {cfg.num_clients} clients); use source_dirichlet, "
                "which redraws until no client is empty, or fewer clients"
            )
    packed = [corpus.pack([corpus.train_texts[j] for j in d]) for d in docs]
    for i, (d, p) in enumerate(zip(docs, packed, strict=True)):
        _check_targets(p, f"client {i} ({len(d)} documents)")
    central_test = corpus.pack(corpus.validation_texts)
    _check_targets(
        central_test, f"the validation corpus ({len(corpus.validation_texts)} documents)"
    )
    selection = None
    if selection_docs is not None:
        selection = corpus.pack([corpus.train_texts[j] for j in selection_docs])
        _check_targets(selection, f"the selection split ({len(selection_docs)} documents)")
    sizes = np.cumsum([0, *(len(p) for p in packed)])
    pool = TensorSplit(torch.cat([p.x for p in packed]), torch.cat([p.y for p in packed]))
    empty = np.zeros(0, dtype=np.int64)
    counts = np.stack([np.bincount(groups[d], minlength=len(corpus.group_names)) for d in docs])
    sampling = data.sampling or "stream"
    return Federation(
        source=corpus.name,
        pool=pool,
        train_labels=pool.y,
        train_indices=tuple(np.arange(a, b, dtype=np.int64) for a, b in itertools.pairwise(sizes)),
        test_indices=tuple(empty for _ in docs),
        central_test=central_test,
        num_classes=corpus.vocab_size,
        input_shape=(data.max_length,),
        class_names=[],
        task="language_modeling",
        stream_seeds=_stream_seeds(seed, cfg.num_clients) if sampling == "stream" else None,
        group_names=tuple(corpus.group_names),
        group_histogram=counts.astype(np.int64),
        selection=selection,
        selection_indices=selection_docs,
    )


SITE_REFUSED = {
    "eval.clients": "the server holds no client's test split (each site keeps its own)",
    "diagnostics.every": "the diagnostics read every client's data on the server",
    "data.server_fraction": "U would be cut from data the server does not hold",
    "data.selection_fraction": "the selection split would be cut from data the server does "
    "not hold (select on a held-out site, or give the server a selection test set)",
}
"""Settings a site-local deployment (``flower.site_data``) refuses, with the reason."""


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
    :func:`federation_of`), ``cfg.num_clients`` clients with no data on the server (their data
    stay on their sites, :func:`site_federation`; aggregation weights come from the replies'
    ``num_examples``).

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
        noisy = add_gaussian_noise(
            test.x, cfg.data.noise, _torch_generator(seed, STREAM_NOISE_TEST)
        )
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
    ``root`` (read by the loader ``data.name``, as :func:`federation_of` reads ``data.root``),
    as a one-client federation: the stratified share ``data.fraction`` is kept, input noise and
    label flips are applied, and the local test split ``data.test_fraction`` is held out,
    exactly as for a client of a central data set, from streams of
    ``[seed, STREAM_SITE, client_id]`` (no two sites share a draw). Nothing outside ``root``
    is read; the site's test file, if any, is not used (the server evaluates).

    Raises:
        FileNotFoundError / ValueError: from the loader, naming the site's files.
        ConfigError: for a setting of :data:`SITE_REFUSED`.
    """
    check_site_config(cfg)
    site_seed = int(np.random.default_rng([seed, STREAM_SITE, client_id]).integers(2**31))
    data = cfg.data.model_copy(update={"root": root})
    one = cfg.model_copy(
        update={
            "data": data,
            "num_clients": 1,
            "partition": cfg.partition.model_copy(update={"name": "iid"}),
        }
    )
    return build_federation(one, site_seed)
