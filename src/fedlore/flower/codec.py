"""Lossless conversion between fedlore messages and Flower records.

``Broadcast(arrays, config)`` <-> ``RecordDict({"arrays": ArrayRecord, "config": ConfigRecord})``;
``Reply(arrays, metrics)`` <-> ``RecordDict({"arrays": ArrayRecord, "metrics": MetricRecord})``
(booleans and strings, which ``MetricRecord`` cannot hold, travel in a ``ConfigRecord``
``"metrics_other"``); ``State(arrays, values)`` <-> ``RecordDict({"arrays", "values"})`` for
``Context.state``. Tensors go through numpy (``np.save`` without pickle): dtype, shape and values
are preserved bit for bit. ``bfloat16``, which numpy lacks, travels as its 16-bit pattern (an
``int16`` view, bit for bit) in an ``Array`` whose ``dtype`` field says ``"bfloat16"``.

The ``.npy`` bytes are written and read here (:func:`npy_array`, :func:`npy_tensor`) rather
than by ``np.save`` / ``np.load`` per array: the same bytes (Flower's ``Array.numpy()`` reads
them), but each distinct header is built or parsed once per process and the payload is copied
once, which matters for methods whose messages hold many small arrays (FedLore's bases and
coordinates per weight matrix).
"""

from __future__ import annotations

import functools
import io
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.constant import SType

from fedlore.types import Arrays, Broadcast, Reply, Scalars, State

BF16 = "bfloat16"
"""The ``Array.dtype`` marker of a bfloat16 tensor sent as its ``int16`` bit pattern."""


def arrays_to_record(arrays: Arrays) -> ArrayRecord:
    """Named tensors -> ``ArrayRecord`` (keys and order kept; bfloat16 as its bit pattern, an
    ``int16`` ``.npy`` payload under ``dtype="bfloat16"``, the same number of bytes).

    Raises:
        TypeError: for a non-tensor value.
    """
    out = ArrayRecord()  # filled in place: ArrayRecord(dict) would build every Array again
    for k, t in arrays.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"array {k!r} is a {type(t).__name__}, not a tensor")
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            bits = npy_array(t.view(torch.int16).numpy())
            out[k] = Array(dtype=BF16, shape=bits.shape, stype=bits.stype, data=bits.data)
        else:
            out[k] = npy_array(t.numpy())  # 0-d stays 0-d
    return out


def record_to_arrays(record: ArrayRecord) -> Arrays:
    """``ArrayRecord`` -> named tensors (writable copies on the CPU; the receiving side moves
    them to its device; an ``Array`` marked ``"bfloat16"`` back to bfloat16, bit for bit)."""
    out: Arrays = {}
    for k, a in record.items():
        t = npy_tensor(a)
        out[k] = t.view(torch.bfloat16) if a.dtype == BF16 else t
    return out


NPY_MAGIC = b"\x93NUMPY"


@functools.lru_cache(maxsize=1024)
def _npy_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> tuple[bytes, str]:
    """The ``.npy`` header that ``np.save`` writes for a C-order array of this dtype and shape
    (format 1.0: magic, version, length, the padded dict) and the dtype's name."""
    buf = io.BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, d)
    return buf.getvalue(), str(dtype)


def npy_array(arr: np.ndarray) -> Array:
    """A C-contiguous ndarray as a Flower ``Array`` of ``np.save``'s bytes (header + payload,
    one copy); the same as ``Array(arr)``."""
    shape = tuple(arr.shape)
    header, name = _npy_header(arr.dtype, shape)
    return Array(dtype=name, shape=shape, stype=SType.NUMPY, data=b"".join((header, arr.data)))


@functools.lru_cache(maxsize=1024)
def _parse_npy_header(header: bytes) -> tuple[np.dtype[Any], tuple[int, ...], bool]:
    """dtype, shape and Fortran order of a ``.npy`` header (magic through padding)."""
    buf = io.BytesIO(header)
    version = np.lib.format.read_magic(buf)
    read = (
        np.lib.format.read_array_header_1_0
        if version == (1, 0)
        else np.lib.format.read_array_header_2_0
    )
    shape, fortran, dtype = read(buf)
    return dtype, tuple(shape), bool(fortran)


def npy_tensor(a: Array) -> torch.Tensor:
    """A Flower ``Array`` of ``.npy`` bytes as a writable CPU tensor (the payload copied once).
    Anything but a C-order numeric array of format 1.0 or 2.0 goes through ``Array.numpy()``.

    Raises:
        TypeError: for an ``Array`` that does not hold ``.npy`` bytes (Flower's own error).
    """
    data = a.data
    if a.stype == SType.NUMPY and data[:6] == NPY_MAGIC and data[6] in (1, 2):
        size = 2 if data[6] == 1 else 4
        start = 8 + size + int.from_bytes(data[8 : 8 + size], "little")
        dtype, shape, fortran = _parse_npy_header(bytes(data[:start]))
        if not fortran and not dtype.hasobject:
            count = int(np.prod(shape, dtype=np.int64))
            arr = np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(shape)
            return torch.from_numpy(arr.copy())
    return torch.from_numpy(np.array(a.numpy(), copy=True))


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
