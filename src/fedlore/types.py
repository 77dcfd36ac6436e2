"""Message and state types shared by every algorithm and every transport.

A message is named tensors plus scalars. ``Broadcast(arrays, config)`` goes from the server to
one client, ``Reply(arrays, metrics)`` comes back. They map one to one onto Flower's
``ArrayRecord`` / ``ConfigRecord`` / ``MetricRecord``. Array keys carry their role as a prefix
(``model.``, ``basis.``, ``update.``, ``lora.``, ``cand.``); keys under ``personal.`` never leave
the client.

Legend used in docstrings across the package: ``m, n`` are the rows and columns of a projected
weight matrix, ``r`` the rank, ``B`` a batch size, ``N`` the number of clients in a round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Arrays = dict[str, torch.Tensor]
"""Named tensors: the only wire format (detached, contiguous, on the run's device; checkpoints,
spill files and the Flower codec hold CPU copies)."""

Scalar = int | float | str | bool
Scalars = dict[str, Scalar]


@dataclass(frozen=True)
class Broadcast:
    """Server -> client message.

    Attributes:
        arrays: named tensors sent to the client (their bytes count as ``bytes_down``).
        config: plain scalars (round index, learning rate, seeds); not counted as payload bytes
            beyond what the transport actually serializes.
    """

    arrays: Arrays = field(default_factory=dict)
    config: Scalars = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """Client -> server message.

    Attributes:
        arrays: named tensors uploaded by the client (``bytes_up``).
        metrics: scalars; ``metrics["num_examples"]`` is the aggregation weight (int, > 0).
    """

    arrays: Arrays = field(default_factory=dict)
    metrics: Scalars = field(default_factory=dict)

    @property
    def num_examples(self) -> int:
        """The aggregation weight reported by the client (number of local training examples)."""
        return int(self.metrics.get("num_examples", 0))


@dataclass
class State:
    """Server or client state: named tensors plus scalars, so it can be checkpointed with
    safetensors/JSON and stored in Flower's ``Context.state`` without pickling.

    Algorithms return new ``State`` objects rather than mutating shared ones.
    """

    arrays: Arrays = field(default_factory=dict)
    values: Scalars = field(default_factory=dict)


LOCAL_KEYS = ("local_accuracy", "local_loss", "local_ece", "local_mse")
"""P-local reply metrics, pooled over clients weighted by their test size ``local_n``."""

LOOP_KEYS = frozenset(
    {
        "round",
        "sim_time_s",
        "sim_round_s",
        "staleness_mean",
        "staleness_max",
        "staleness",
        "in_flight",
        "clients",
        "accepted",
        "rejected",
        "accepted_clients",
        "query_bytes_up",
        "query_bytes_down",
        "rejected_reasons",
        "bytes_up",
        "bytes_down",
        "train_loss",
        "optimizer_state_bytes",
        "peak_memory_bytes",
        "client_state_bytes",
        "skipped_steps",
        "client_train_s",
        "local_clients",
        "local_rmse",
        "wall_s",
        "eval_s",
        "diag_s",
        "diag_bytes_up",
        *LOCAL_KEYS,
    }
)
"""The keys of a round's row that the loop itself measures: a method's per-client metrics
(:attr:`~fedlore.algorithm.Algorithm.per_client_metrics`) and its aggregate metrics must not
reuse them (:class:`fedlore.engine.loop.RoundLoop` refuses both), nor may a metric of
``eval.metrics`` (:mod:`fedlore.train.metrics`)."""
