"""Building the federation of an experiment: :func:`build_federation`, the one entry point,
loads the configured source (:func:`load_source`) and hands it to its builder (a labelled source:
:func:`~fedlore.data.labelled_federation.labelled_federation`; a pre-training corpus:
:func:`~fedlore.data.corpus_federation.corpus_federation`), then casts the result to the run's
precision. The :class:`~fedlore.data.container.Federation` it returns is importable from here.

Every random step of a builder draws from its own stream (:func:`fedlore.seeding.data_rng`), so
the same seed gives the same federation for every method and every call. A process that runs
many experiments of the same data (a ``fedlore tune`` search, sequential or on workers) may keep
the last federation built (:func:`keep_built`, :func:`keeping_built`): each call then gets a copy
of its own.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
from collections.abc import Iterator
from typing import Any

from fedlore import registry
from fedlore.config import Config, DataConfig
from fedlore.data.container import Federation, with_precision
from fedlore.data.corpus import Corpus
from fedlore.data.corpus_federation import corpus_federation
from fedlore.data.datasource import DataSource
from fedlore.data.labelled_federation import labelled_federation
from fedlore.progress import say

__all__ = [
    "FEDERATION_FIELDS",
    "SOURCE_OPTIONS",
    "Federation",
    "build_federation",
    "keep_built",
    "keeping_built",
    "load_source",
]

FEDERATION_FIELDS = ("data", "partition", "num_clients", "precision", "flower")
"""The config's settings a federation is built from, with the seed: every one a builder reads
(a test holds the builders to it). Two configs equal in these share a kept federation."""

_kept: dict[str, Federation] | None = None
"""The last federation built, by :func:`_key` (None: none is kept, the default)."""

# DataConfig fields that only some sources take (the text sources, npz, hf, leaf): passed as
# keyword arguments to a loader that declares them; set to a non-default value for any other
# source, an error.
SOURCE_OPTIONS = (
    "tokenizer",
    "max_length",
    "categories",
    "vocab_size",
    "max_documents",
    "validation_documents",
    "non_finite",
    "input_column",
    "label_column",
    "id_column",
    "train_split",
    "test_split",
)


def load_source(data: DataConfig) -> DataSource | Corpus:
    """Call the registered loader ``data.name`` with ``data.root`` and the options it takes.

    Raises:
        KeyError: for an unknown source.
        ValueError: when an option of :data:`SOURCE_OPTIONS` is set for a source that does not
            take it, input noise is asked of a source whose inputs are token ids or lie
            outside [0, 1] (the noise is clipped to [0, 1]), or the loader returns neither a
            DataSource nor a Corpus.
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
    if not isinstance(source, DataSource):  # a loader of one's own: said here, not deep inside
        raise ValueError(
            f"source {data.name!r}: its loader returned a {type(source).__name__}, not a "
            "fedlore.data.sources.DataSource (docs: how-to/add-model-data)"
        )
    if data.noise > 0 and not source.train.x.is_floating_point():
        raise ValueError(
            f"data.noise={data.noise} adds pixel noise, but source {data.name!r} gives "
            f"{source.train.x.dtype} inputs (token ids); use data.label_flip for label noise"
        )
    inputs = [split.x for split in (source.train, source.test) if split.x.numel()]
    # the noise is clipped to [0, 1], images' pixel range (regression: refused when built)
    if data.noise > 0 and inputs and source.task == "classification":
        lo, hi = min(float(x.min()) for x in inputs), max(float(x.max()) for x in inputs)
        if lo < 0 or hi > 1:
            raise ValueError(
                f"data.noise={data.noise} adds pixel noise and clips every input to [0, 1], but "
                f"the inputs of source {data.name!r} span [{lo:.4g}, {hi:.4g}]: the clip would "
                "replace every value outside [0, 1] (standardized features become 0 or 1); "
                "scale the inputs to [0, 1] first, or leave data.noise at 0"
            )
    return source


def build_federation(cfg: Config, seed: int) -> Federation:
    """The federation of an experiment for one seed: :func:`load_source`, then the source's
    builder (:func:`~fedlore.data.labelled_federation.labelled_federation` or, for a
    pre-training corpus, :func:`~fedlore.data.corpus_federation.corpus_federation`), with its
    floating-point tensors (inputs, regression targets) in the config's ``precision``
    (:func:`~fedlore.data.container.with_precision`).

    Args:
        cfg: the experiment config.
        seed: the experiment seed (≥ 0); the only source of randomness.

    Raises:
        ValueError: on a negative seed, from the loader (:func:`load_source`), or from the
            builder (a partition that is not a cover, a client left with no training data).
        ConfigError: from the builder, for a setting the source cannot honour.
    """
    what = (cfg.data.name, cfg.num_clients, cfg.partition.name, seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    key = None if _kept is None else _key(cfg, seed)
    if _kept is not None and key in _kept:
        say("the federation as built for the last run: %s, %d clients, %s partition (seed %d)",
            *what)  # fmt: skip
        return copy.deepcopy(_kept[key])  # its own: nothing a run changes reaches the next
    say("building the federation: %s, %d clients, %s partition (seed %d)", *what)
    source = load_source(cfg.data)
    if isinstance(source, Corpus):
        fed = corpus_federation(cfg, seed, source)
    else:
        fed = labelled_federation(cfg, seed, source)
    fed = with_precision(fed, cfg.precision)
    if _kept is not None and key is not None:
        _kept.clear()  # the last one only: a search over data settings keeps one at a time
        _kept[key] = fed
        return copy.deepcopy(fed)
    return fed


def keep_built() -> None:
    """From now on, in this process, :func:`build_federation` keeps the last federation it
    built and answers a later call of the same :data:`FEDERATION_FIELDS` and seed with a copy
    of it, instead of loading and partitioning the data again (a ``fedlore tune --workers``
    worker, whose trials differ in training settings only). Every call gets a deep copy of its
    own, so a run that changes its federation's tensors in place leaves the kept one as built:
    each run gets what a fresh process would build. Memory: the kept federation besides the
    running one's."""
    global _kept
    if _kept is None:
        _kept = {}


@contextlib.contextmanager
def keeping_built() -> Iterator[None]:
    """:func:`keep_built` for the duration of the ``with`` block (the sequential trials of a
    ``fedlore tune`` search): then the process forgets the kept federation, freeing its
    memory, unless it kept built federations before the block (a worker)."""
    global _kept
    before = _kept
    keep_built()
    try:
        yield
    finally:
        _kept = before


def _key(cfg: Config, seed: int) -> str:
    """The settings of :data:`FEDERATION_FIELDS` and ``seed``, as one string."""
    parts: dict[str, Any] = {}
    for name in FEDERATION_FIELDS:
        value = getattr(cfg, name)
        parts[name] = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    return json.dumps([seed, parts], sort_keys=True, default=str)
