"""Lossless conversion between fedlore messages and Flower records.

``Broadcast(arrays, config)`` <-> ``RecordDict({"arrays": ArrayRecord, "config": ConfigRecord})``;
``Reply(arrays, metrics)`` <-> ``RecordDict({"arrays": ArrayRecord, "metrics": MetricRecord})``
(booleans and strings, which ``MetricRecord`` cannot hold, travel in a ``ConfigRecord``
``"metrics_other"``); ``State(arrays, values)`` <-> ``RecordDict({"arrays", "values"})`` for
``Context.state``. Tensors go through numpy (``np.save`` without pickle): dtype, shape and values
are preserved bit for bit. ``bfloat16``, which numpy lacks, travels as its 16-bit pattern (an
``int16`` view, bit for bit) in an ``Array`` whose ``dtype`` field says ``"bfloat16"``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedlore.types import Arrays, Broadcast, Reply, Scalars, State

BF16 = "bfloat16"
"""The ``Array.dtype`` marker of a bfloat16 tensor sent as its ``int16`` bit pattern."""


def arrays_to_record(arrays: Arrays) -> ArrayRecord:
    """Named tensors -> ``ArrayRecord`` (keys and order kept; bfloat16 as its bit pattern, an
    ``int16`` ``.npy`` payload under ``dtype="bfloat16"``, the same number of bytes).

    Raises:
        TypeError: for a non-tensor value.
    """
    out: OrderedDict[str, Array] = OrderedDict()
    for k, t in arrays.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"array {k!r} is a {type(t).__name__}, not a tensor")
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            bits = Array(t.view(torch.int16).numpy())
            out[k] = Array(dtype=BF16, shape=bits.shape, stype=bits.stype, data=bits.data)
        else:
            out[k] = Array(t.numpy())  # 0-d stays 0-d
    return ArrayRecord(out)


def record_to_arrays(record: ArrayRecord) -> Arrays:
    """``ArrayRecord`` -> named tensors (writable copies on the CPU; the receiving side moves
    them to its device; an ``Array`` marked ``"bfloat16"`` back to bfloat16, bit for bit)."""
    out: Arrays = {}
    for k, a in record.items():
        t = torch.from_numpy(np.array(a.numpy(), copy=True))
        out[k] = t.view(torch.bfloat16) if a.dtype == BF16 else t
    return out


def record_nbytes(record: ArrayRecord) -> int:
    """Bytes of the serialized arrays of a record (numpy payload including its header)."""
    return sum(len(a.data) for a in record.values())


def _split_scalars(values: Scalars) -> tuple[dict[str, Any], dict[str, Any]]:
    num: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, bool | str):
            other[k] = v
        elif isinstance(v, int | float):
            num[k] = v
        else:
            raise TypeError(f"scalar {k!r} has unsupported type {type(v).__name__}")
    return num, other


def broadcast_to_record(msg: Broadcast) -> RecordDict:
    """A :class:`Broadcast` as a ``RecordDict``."""
    return RecordDict(
        {"arrays": arrays_to_record(msg.arrays), "config": ConfigRecord(dict(msg.config))}
    )


def record_to_broadcast(rd: RecordDict) -> Broadcast:
    """Inverse of :func:`broadcast_to_record`."""
    config: Scalars = {}
    for k, v in rd.config_records["config"].items():
        if not isinstance(v, int | float | str | bool):
            raise TypeError(f"config value {k!r} has unsupported type {type(v).__name__}")
        config[k] = v
    return Broadcast(arrays=record_to_arrays(rd.array_records["arrays"]), config=config)


def reply_to_record(reply: Reply) -> RecordDict:
    """A :class:`Reply` as a ``RecordDict``."""
    num, other = _split_scalars(reply.metrics)
    return RecordDict(
        {
            "arrays": arrays_to_record(reply.arrays),
            "metrics": MetricRecord(num),
            "metrics_other": ConfigRecord(other),
        }
    )


def record_to_reply(rd: RecordDict) -> Reply:
    """Inverse of :func:`reply_to_record`."""
    metrics: Scalars = {}
    for k, mv in rd.metric_records["metrics"].items():
        if not isinstance(mv, int | float):
            raise TypeError(f"metric {k!r} has unsupported type {type(mv).__name__}")
        metrics[k] = mv
    if "metrics_other" in rd.config_records:
        for k, cv in rd.config_records["metrics_other"].items():
            if isinstance(cv, str | bool):
                metrics[k] = cv
    return Reply(arrays=record_to_arrays(rd.array_records["arrays"]), metrics=metrics)


def state_to_record(state: State) -> RecordDict:
    """A client :class:`State` as a ``RecordDict`` (for ``Context.state``)."""
    return RecordDict(
        {"arrays": arrays_to_record(state.arrays), "values": ConfigRecord(dict(state.values))}
    )


def record_to_state(rd: RecordDict) -> State | None:
    """Inverse of :func:`state_to_record`; None when the record holds no fedlore state."""
    if "arrays" not in rd.array_records and "values" not in rd.config_records:
        return None
    arrays = record_to_arrays(rd.array_records["arrays"]) if "arrays" in rd.array_records else {}
    values: Scalars = {}
    if "values" in rd.config_records:
        for k, v in rd.config_records["values"].items():
            if not isinstance(v, int | float | str | bool):
                raise TypeError(f"state value {k!r} has unsupported type {type(v).__name__}")
            values[k] = v
    return State(arrays=arrays, values=values)
