"""The federation container: clients' data as index arrays into one shared training pool.

:class:`Federation` keeps the (possibly noisy) training tensors once plus index arrays per
client; :meth:`Federation.client` materializes one client's :class:`ClientData`;
:func:`with_precision` casts its tensors to the run's precision. It is built by
:func:`fedlore.data.federation.build_federation` (and, for a site-local Flower deployment, by
:mod:`fedlore.flower.sites`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.data.histogram import format_histogram
from fedlore.data.holdout import TARGET_STRATA


@dataclass(frozen=True)
class Federation:
    """Clients' data as index arrays into one shared training pool.

    Attributes:
        source: registry name of the data source.
        pool: the kept training set; inputs ``[n, C, H, W]`` with noise already applied (text:
            int64 token ids ``[n, L]``), labels ``[n]`` the true (unflipped) classes. Under
            ``data.local_test=by_id`` the source's test split follows it, the examples of the
            clients' local test splits.
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
            target decile of every pool example, int64 ``[n]``
            (:func:`~fedlore.data.holdout.target_strata`), which stands in for the class in
            every stratified step (``data.fraction``, U, the selection split) and in the label
            partitions (Dirichlet over deciles: clients differ in their target range);
            :meth:`histogram` counts them. None otherwise.
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
        """A plain-text table of :meth:`histogram`, one row per client (see
        :func:`fedlore.data.histogram.format_histogram`)."""
        return format_histogram(self, max_columns)


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
