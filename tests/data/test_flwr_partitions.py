"""flwr-datasets' partitioners by name (``partition.name: flwr:<Partitioner>`` with
``partition.kwargs``), the ``natural`` partitioner, and how ``partition_labels`` hands
partitioners their ids, the run seed and their keyword arguments.

Which of flwr-datasets' partitioners work on fedlore's labels-only dataset is the table
:data:`CASES`: every one that splits rows, each checked for what it promises."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("flwr_datasets", reason="needs the [hf] extra: pip install -e '.[hf]'")

from fedlore import registry
from fedlore.checks import name_problems
from fedlore.config import ConfigError, load_config
from fedlore.data.federation import build_federation
from fedlore.data.flwr_partitions import EXCLUDED, available
from fedlore.data.partition import partition_labels, partition_natural

RNG = np.random.default_rng(0)
LABELS = RNG.integers(0, 10, 600)  # 600 examples, 10 classes
IDS = RNG.integers(0, 6, 600)  # 6 natural ids (writers)


def cfg_for(name: str, kwargs: str = "{}", clients: int = 5, *over: str) -> Any:
    return load_config(
        None,
        [f"partition.name={name}", f"partition.kwargs={kwargs}", f"num_clients={clients}", *over],
    )


CASES: dict[str, tuple[str, int]] = {
    "IidPartitioner": ("{}", 5),
    "DirichletPartitioner": ("{alpha: 0.5, min_partition_size: 20}", 5),
    "InnerDirichletPartitioner": ("{partition_sizes: [100, 100, 100, 100, 200], alpha: 0.5}", 5),
    "ShardPartitioner": ("{num_shards_per_partition: 2, shard_size: 30}", 5),
    "PathologicalPartitioner": ("{num_classes_per_partition: 2}", 5),
    "LinearPartitioner": ("{}", 5),
    "SquarePartitioner": ("{}", 5),
    "ExponentialPartitioner": ("{}", 5),
    "SizePartitioner": ("{partition_sizes: [50, 100, 150, 200, 100]}", 5),
    "NaturalIdPartitioner": ("{partition_by: id}", 6),
    "GroupedNaturalIdPartitioner": ("{partition_by: id, group_size: 2}", 3),
    "ContinuousPartitioner": ("{strictness: 0.5}", 5),
    "DistributionPartitioner": (  # 10 clients x 2 labels: a [10 labels, 2] array
        "{distribution_array: [[1, 2], [2, 1], [1, 1], [3, 1], [1, 3], [2, 2], [1, 2], [2, 1],"
        " [1, 1], [1, 1]], num_unique_labels_per_partition: 2, "
        "preassigned_num_samples_per_label: 5}",
        10,
    ),
}
"""flwr-datasets' row partitioners, each with arguments it accepts on these labels, and the
number of clients: every one of :func:`available` is here."""


def test_every_row_partitioner_of_flwr_datasets_is_covered() -> None:
    assert set(available()) == set(CASES)
    assert set(EXCLUDED) == {
        "Partitioner", "IdToSizeFncPartitioner", "VerticalEvenPartitioner",
        "VerticalSizePartitioner",
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_partitioner_gives_the_rows_flwr_datasets_gives(name: str) -> None:
    """Disjoint sorted parts, one per client, reproducible from the seed, and the labels of
    each client's examples are those flwr-datasets' own ``load_partition`` returns on the same
    shuffled dataset (so the index column maps rows back to the right examples)."""
    from datasets import Dataset

    kwargs, clients = CASES[name]
    cfg = cfg_for(f"flwr:{name}", kwargs, clients)
    parts = partition_labels(cfg, 3, LABELS, IDS)
    assert len(parts) == clients and all(p.dtype == np.int64 for p in parts)
    assert all(np.all(np.diff(p) > 0) for p in parts)
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat) and flat.max() < len(LABELS)
    again = partition_labels(cfg, 3, LABELS, IDS)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    # flwr-datasets by itself, given the same arguments and the shuffled dataset
    partitioner = registry.get("partition", f"flwr:{name}")
    args = partitioner.arguments(clients, 3, dict(cfg.partition.kwargs), True)
    direct = partitioner.cls(**args)
    direct.dataset = Dataset.from_dict(
        {"index": np.arange(600), "label": LABELS, "id": IDS}
    ).shuffle(seed=3)
    for i, part in enumerate(parts):
        theirs = direct.load_partition(i)
        assert sorted(theirs["label"]) == sorted(LABELS[part].tolist())
        assert sorted(theirs["index"]) == part.tolist()


def test_what_each_partitioner_promises() -> None:
    def parts(name: str, kwargs: str = "{}", clients: int = 5) -> list[np.ndarray]:
        return partition_labels(cfg_for(f"flwr:{name}", kwargs, clients), 1, LABELS, IDS)

    shards = parts("ShardPartitioner", CASES["ShardPartitioner"][0])
    assert [len(p) for p in shards] == [60] * 5  # 2 shards of 30 each; the rest to no client
    assert all(len(np.unique(LABELS[p])) <= 4 for p in shards)  # shards of label-sorted rows
    patho = parts("PathologicalPartitioner", CASES["PathologicalPartitioner"][0])
    assert all(len(np.unique(LABELS[p])) <= 2 for p in patho)
    assert [len(p) for p in parts("SizePartitioner", CASES["SizePartitioner"][0])] == [
        50, 100, 150, 200, 100,
    ]  # fmt: skip
    assert [len(p) for p in parts("LinearPartitioner")] == [40, 80, 120, 160, 200]
    assert [len(p) for p in parts("IidPartitioner")] == [120] * 5
    natural = parts("NaturalIdPartitioner", "{partition_by: id}", 6)
    assert sorted(np.unique(IDS[p]).tolist() for p in natural) == [[k] for k in range(6)]
    assert sorted(len(p) for p in natural) == sorted(np.bincount(IDS).tolist())
    grouped = parts("GroupedNaturalIdPartitioner", "{partition_by: id, group_size: 2}", 3)
    assert all(len(np.unique(IDS[p])) == 2 for p in grouped)
    assert all(np.isin(np.flatnonzero(np.isin(IDS, IDS[p])), p).all() for p in grouped)


def test_the_seed_is_the_run_seed_unless_given() -> None:
    kwargs = "{alpha: 0.3, min_partition_size: 5}"
    run7 = partition_labels(cfg_for("flwr:DirichletPartitioner", kwargs), 7, LABELS)
    named7 = partition_labels(
        cfg_for("flwr:DirichletPartitioner", "{alpha: 0.3, min_partition_size: 5, seed: 7}"),
        7,
        LABELS,
    )
    run8 = partition_labels(cfg_for("flwr:DirichletPartitioner", kwargs), 8, LABELS)
    assert all(np.array_equal(a, b) for a, b in zip(run7, named7, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(run7, run8, strict=True))


def test_bad_names_and_arguments_are_refused_clearly() -> None:
    listed = r"'flwr:Shards'; flwr-datasets' partitioners: \[flwr:Continuous.*flwr:Shard"
    with pytest.raises(KeyError, match=listed):
        registry.get("partition", "flwr:Shards")
    with pytest.raises(KeyError, match=r"not usable: its partition_id_to_size_fn is a Python"):
        registry.get("partition", "flwr:IdToSizeFncPartitioner")
    with pytest.raises(
        KeyError,
        match=r"'diri' \(did you mean 'dirichlet'\?\); registered: .*'natural'.*; or flwr:<class>",
    ):
        registry.get("partition", "diri")

    def refused(name: str, kwargs: str, match: str, clients: int = 5, ids: Any = IDS) -> None:
        with pytest.raises(ValueError, match=match):
            partition_labels(cfg_for(name, kwargs, clients), 0, LABELS, ids)

    shard, dirichlet, natural = "flwr:ShardPartitioner", "flwr:DirichletPartitioner", "natural"
    takes = r"\['shards'\] are not arguments of ShardPartitioner; it takes \[.*'shard_size'"
    refused(shard, "{shards: 2}", takes)
    refused(shard, "{num_partitions: 3}", "num_partitions=3 disagrees with num_clients=5")
    refused(
        "flwr:InnerDirichletPartitioner", "{alpha: 0.5}", r"needs partition.kwargs \['partition_si"
    )
    columns = r"partition_by='writer'; fedlore's examples have the columns 'label'"
    refused(dirichlet, "{alpha: 0.5, partition_by: writer}", columns)
    by_id, no_ids = "{partition_by: id}", "partition_by=id needs the natural id of every example"
    refused("flwr:NaturalIdPartitioner", by_id, no_ids, ids=None)
    six = "makes 6 partitions .* but num_clients=5; set num_clients=6"
    refused("flwr:NaturalIdPartitioner", by_id, six)
    refused(dirichlet, "{alpha: -1}", r"flwr:DirichletPartitioner with \{")
    grouped = "flwr:GroupedNaturalIdPartitioner"
    refused(grouped, "{partition_by: id, group_size: 0}", r"group_size': 0\}: ZeroDivisionError")
    own = r"partition.kwargs \['beta'\]: partitioner 'dirichlet' takes no such argument"
    refused("dirichlet", "{beta: 2}", own)
    refused(natural, "{}", "needs the natural id of every example", ids=None)
    refused(natural, "{}", "num_clients=7, but the clients' data hold 6 ids", clients=7)


def test_config_checks_name_flwr_partitioners() -> None:
    assert name_problems(cfg_for("flwr:ShardPartitioner")) == []
    problems = name_problems(cfg_for("flwr:Nope"))
    assert len(problems) == 1 and problems[0].startswith("partition.name: unknown partition")
    assert "flwr:IidPartitioner" in problems[0]
    with pytest.raises(ConfigError, match=r"named by its class, e\.g\. flwr:ShardPartitioner"):
        load_config(None, ["partition.name=flwr:1x"])
    with pytest.raises(ConfigError, match="keyword arguments must be Python names"):
        load_config(None, ["partition.kwargs={'a b': 1}"])


def test_registered_partitioners_get_only_what_they_name() -> None:
    seen: dict[str, Any] = {}

    @registry.register_partition("_test_takes_ids")
    def takes(
        labels: np.ndarray,
        num_clients: int,
        rng: np.random.Generator,
        ids: Any = None,
        run_seed: int = -1,
        width: int = 0,
        **rest: Any,
    ) -> list[np.ndarray]:
        seen.update(ids=ids, run_seed=run_seed, width=width, rest=sorted(rest))
        return np.array_split(np.arange(len(labels)), num_clients)

    try:
        partition_labels(cfg_for("_test_takes_ids", "{width: 3}", 2), 11, LABELS, IDS)
        assert seen["ids"] is IDS and seen["run_seed"] == 11 and seen["width"] == 3
        assert seen["rest"] == ["alpha", "major_classes", "major_share", "min_size"]
    finally:
        registry._TABLES["partition"].pop("_test_takes_ids")


def test_natural_partition_is_one_client_per_id_in_order_or_whole_groups() -> None:
    parts = partition_natural(LABELS, 6, np.random.default_rng(0), ids=IDS)
    assert [np.unique(IDS[p]).tolist() for p in parts] == [[k] for k in range(6)]
    assert all(np.array_equal(p, np.flatnonzero(np.equal(IDS, k))) for k, p in enumerate(parts))
    grouped = partition_natural(LABELS, 4, np.random.default_rng(0), ids=IDS)
    groups = [np.unique(IDS[p]).tolist() for p in grouped]
    assert sorted(len(g) for g in groups) == [1, 1, 2, 2]
    assert sorted(k for g in groups for k in g) == list(range(6))
    other = partition_natural(LABELS, 4, np.random.default_rng(1), ids=IDS)
    assert groups != [np.unique(IDS[p]).tolist() for p in other]  # the grouping is seeded


def test_a_flwr_partition_builds_a_federation_end_to_end() -> None:
    cfg = cfg_for(
        "flwr:ShardPartitioner", "{num_shards_per_partition: 2, shard_size: 30}", 5, "seeds=[4]"
    )
    fed = build_federation(cfg, 4)
    sizes = [len(tr) + len(te) for tr, te in zip(fed.train_indices, fed.test_indices, strict=True)]
    assert sizes == [60] * 5 and fed.histogram().sum() == 5 * 48
    assert all((row > 0).sum() <= 4 for row in fed.histogram())
    same = build_federation(cfg, 4)
    assert fed.fingerprint() == same.fingerprint()
