"""Building the federation of a pre-training corpus for one seed (seed 000, "C4 Partitioning
Protocol"): documents allocated to clients by source group, then packed per client.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from fedlore.config import Config, ConfigError, DataConfig
from fedlore.data.client_data import TensorSplit
from fedlore.data.container import Federation
from fedlore.data.corpus import IGNORE_INDEX, Corpus
from fedlore.data.holdout import hold_out_selection
from fedlore.data.partition import partition_labels
from fedlore.seeding import DATA_FRACTION, DATA_SELECTION, client_stream_seeds, data_rng


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
    ``data_rng(seed, DATA_PARTITION)`` is separate from every training stream, so the allocation is
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
        rng = data_rng(seed, DATA_FRACTION)
        size = max(cfg.num_clients, round(data.fraction * len(groups)))
        keep = np.sort(rng.choice(len(groups), size=min(size, len(groups)), replace=False))
    selection_docs, keep = hold_out_selection(
        None, keep, data.selection_fraction, data_rng(seed, DATA_SELECTION)
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
        stream_seeds=client_stream_seeds(seed, cfg.num_clients) if sampling == "stream" else None,
        group_names=tuple(corpus.group_names),
        group_histogram=counts.astype(np.int64),
        selection=selection,
        selection_indices=selection_docs,
    )
