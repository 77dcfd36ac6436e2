"""flwr-datasets' row partitioners as fedlore partitioners: ``partition.name:
flwr:<Partitioner>`` with the partitioner's keyword arguments in ``partition.kwargs``.

:func:`resolve` (called by :func:`fedlore.registry.get` for a ``flwr:`` name) returns a
:class:`FlwrPartitioner`, which fedlore calls like its own partitioners
(:func:`fedlore.data.partition.partition_labels`). It builds a ``datasets.Dataset`` of the
examples being partitioned, with the columns

* ``label``: the class of every example (the target decile of a regression source),
* ``id``: its natural id (a LEAF user, an ``hf`` source's ``data.id_column``), when the source
  has ids,
* ``index``: its position, which maps a partition's rows back to fedlore's examples,

shuffles its rows with the run's seed (as ``flwr_datasets.FederatedDataset`` shuffles with its
``seed`` before partitioning: flwr-datasets' IID, Linear, Square, Exponential and Size
partitioners cut the rows in order), sets ``partitioner.dataset`` and reads
``load_partition(i)`` for every client ``i``. The arguments: ``num_partitions`` is
``num_clients`` (a different ``num_partitions`` in ``partition.kwargs`` is refused);
``seed``, where the partitioner takes one, is the run's seed unless ``partition.kwargs``
gives one; ``partition_by`` is ``label`` unless given (``id`` partitions by the natural ids, as
``NaturalIdPartitioner`` needs). Lists in ``partition.kwargs`` become numpy arrays where the
partitioner's signature takes arrays (``DistributionPartitioner``'s ``distribution_array``).
A partitioner that derives its number of partitions from the data (``NaturalIdPartitioner``:
one per id; ``GroupedNaturalIdPartitioner``) must make ``num_clients`` of them.

Every partition depends only on the labels, the ids, the arguments and the seed, so the same
config and seed give the same clients in process and on every Flower node. Some of flwr-datasets'
partitioners leave examples to no client (``ShardPartitioner`` drops incomplete shards,
``PathologicalPartitioner`` classes no client draws, ``SizePartitioner`` sizes that sum to less
than the data): their parts are checked to be disjoint, and the count left out is said.

``datasets`` and ``flwr_datasets`` are imported when a ``flwr:`` partitioner is first named (the
``hf`` extra: ``pip install -e '.[hf]'``).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import numpy as np

LABEL = "label"
"""Column of the classes (``partition_by: label``, the default)."""

ID = "id"
"""Column of the natural ids (``partition_by: id``)."""

INDEX = "index"
"""Column of each example's position among the examples partitioned."""

EXCLUDED = {
    "Partitioner": "the abstract base class",
    "IdToSizeFncPartitioner": "its partition_id_to_size_fn is a Python function, which a config "
    "cannot hold (flwr:LinearPartitioner, flwr:SquarePartitioner and "
    "flwr:ExponentialPartitioner are its ready-made forms)",
    "VerticalEvenPartitioner": "it splits the columns (features) between parties, not the "
    "examples between clients",
    "VerticalSizePartitioner": "it splits the columns (features) between parties, not the "
    "examples between clients",
}
"""flwr-datasets' partitioner classes that fedlore cannot use by name, with the reason."""

HINT = "install the hf extra: pip install -e '.[hf]' (datasets and flwr-datasets)"


def available() -> dict[str, type]:
    """flwr-datasets' row partitioners usable by name: class name -> class.

    Raises:
        ImportError: without flwr-datasets.
    """
    import flwr_datasets.partitioner as fp

    return {
        name: obj
        for name, obj in sorted(vars(fp).items())
        if isinstance(obj, type) and issubclass(obj, fp.Partitioner) and name not in EXCLUDED
    }


def resolve(class_name: str) -> FlwrPartitioner:
    """The partitioner ``flwr:<class_name>``.

    Raises:
        KeyError: for a name that is not one of :func:`available` (why, for one of
            :data:`EXCLUDED`), listing the available ones, or without flwr-datasets.
    """
    try:
        classes = available()
    except ImportError as e:
        raise KeyError(f"partition 'flwr:{class_name}' needs flwr-datasets ({e}); {HINT}") from e
    if class_name not in classes:
        why = f" (not usable: {EXCLUDED[class_name]})" if class_name in EXCLUDED else ""
        names = ", ".join(f"flwr:{n}" for n in classes)
        raise KeyError(
            f"unknown partition 'flwr:{class_name}'{why}; flwr-datasets' partitioners: [{names}]"
        )
    return FlwrPartitioner(class_name, classes[class_name])


class FlwrPartitioner:
    """One flwr-datasets partitioner class, called as a fedlore partitioner (see the module
    docstring)."""

    covers = False
    """flwr-datasets' partitioners may leave examples to no client (shards, sizes)."""

    def __init__(self, name: str, cls: type) -> None:
        self.name = name
        self.cls = cls

    def __repr__(self) -> str:
        return f"flwr:{self.name}"

    def arguments(
        self, num_clients: int, run_seed: int, kwargs: dict[str, Any], has_ids: bool
    ) -> dict[str, Any]:
        """The constructor's keyword arguments: ``kwargs`` with ``num_partitions``, ``seed`` and
        ``partition_by`` filled in (see the module docstring).

        Raises:
            ValueError: naming an argument the class does not take (and those it takes), one it
                needs that is missing, a ``num_partitions`` other than ``num_clients``, or a
                ``partition_by`` other than ``label`` / ``id`` (``id`` without ids).
        """
        params = {
            k: p
            for k, p in inspect.signature(self.cls).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        where = f"partition.name=flwr:{self.name}"
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ValueError(
                f"{where}: partition.kwargs {unknown} are not arguments of {self.name}; it "
                f"takes {sorted(params)}"
            )
        args = dict(kwargs)
        if "num_partitions" in params:
            given = args.get("num_partitions", num_clients)
            if given != num_clients:
                raise ValueError(
                    f"{where}: partition.kwargs.num_partitions={given} disagrees with "
                    f"num_clients={num_clients} (fedlore sets num_partitions to num_clients: "
                    "leave it out)"
                )
            args["num_partitions"] = num_clients
        if "seed" in params:
            args.setdefault("seed", run_seed)
        if "partition_by" in params:
            by = args.setdefault("partition_by", LABEL)
            if by not in (LABEL, ID):
                raise ValueError(
                    f"{where}: partition.kwargs.partition_by={by!r}; fedlore's examples have "
                    f"the columns {LABEL!r} (the classes) and {ID!r} (the natural ids)"
                )
            if by == ID and not has_ids:
                raise ValueError(
                    f"{where}: partition_by=id needs the natural id of every example: "
                    "data.name=leaf (its users), or data.name=hf with data.id_column"
                )
        for k, p in params.items():
            if isinstance(args.get(k), list) and "ndarray" in str(p.annotation):
                args[k] = np.asarray(args[k])
        missing = [k for k, p in params.items() if p.default is p.empty and k not in args]
        if missing:
            raise ValueError(
                f"{where} needs partition.kwargs {missing} (it takes {sorted(params)})"
            )
        return args

    def __call__(
        self,
        labels: np.ndarray,
        num_clients: int,
        rng: np.random.Generator,
        *,
        run_seed: int,
        kwargs: dict[str, Any],
        ids: np.ndarray | None = None,
        **_: Any,
    ) -> list[np.ndarray]:
        """Split the examples of ``labels`` (and ``ids``) over ``num_clients`` clients.

        Args:
            labels: int array ``[n]`` of classes.
            num_clients: number of clients N.
            rng: unused (the partitioner draws from its ``seed``).
            run_seed: the experiment seed (the shuffle; the partitioner's default ``seed``).
            kwargs: ``partition.kwargs``.
            ids: the natural id of every example, or None.

        Returns:
            N sorted int64 index arrays into ``labels``, disjoint.

        Raises:
            ValueError: from :meth:`arguments`, when the partitioner refuses its arguments or
                the data, or makes another number of partitions than N.
        """
        args = self.arguments(num_clients, run_seed, kwargs, ids is not None)
        from datasets import Dataset

        labels = np.asarray(labels, dtype=np.int64)
        columns: dict[str, np.ndarray] = {INDEX: np.arange(len(labels)), LABEL: labels}
        if ids is not None:
            columns[ID] = np.asarray(ids, dtype=np.int64)
        where = f"partition.name=flwr:{self.name} with {args}"
        try:
            partitioner = self.cls(**args)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # pyarrow's, inside flwr-datasets
                partitioner.dataset = Dataset.from_dict(columns).shuffle(seed=run_seed)
                made = int(partitioner.num_partitions)
                if made != num_clients:
                    raise ValueError(
                        f"it makes {made} partitions for these data (e.g. one per id), but "
                        f"num_clients={num_clients}; set num_clients={made}"
                    )
                parts = [
                    partitioner.load_partition(i).with_format("numpy")[:][INDEX]
                    for i in range(made)
                ]
        except (TypeError, ValueError, KeyError, IndexError, ArithmeticError) as e:
            # ArithmeticError: a size flwr-datasets divides by (GroupedNaturalId's group_size=0)
            raise ValueError(f"{where}: {type(e).__name__}: {e}") from e
        return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
