"""The Flower codec is lossless (dtype, shape, values, keys, scalars)."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
import torch
from flwr.app import Array

from fedlore.flower.codec import (
    arrays_to_record,
    broadcast_to_record,
    record_nbytes,
    record_to_arrays,
    record_to_broadcast,
    record_to_reply,
    record_to_state,
    reply_to_record,
    state_to_record,
)
from fedlore.flower.transport import MessageTooLarge, check_size
from fedlore.types import Broadcast, Reply, State

pytestmark = pytest.mark.flower

DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 3, 4, 5)])
def test_arrays_roundtrip_bitwise(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    rec = arrays_to_record({"a.b": t})
    assert rec["a.b"].data == Array(t.numpy()).data  # the bytes np.save writes (Flower's own)
    back = record_to_arrays(rec)["a.b"]
    assert back.dtype == t.dtype and tuple(back.shape) == tuple(t.shape)
    assert torch.equal(back, t)
    assert torch.equal(torch.from_numpy(rec["a.b"].numpy()), t)  # Flower reads ours


def test_decoded_tensors_are_writable_copies_and_flowers_own_arrays_decode() -> None:
    import numpy as np

    rec = arrays_to_record({"w": torch.arange(6.0).reshape(2, 3)})
    rec["f"] = Array(np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)))
    back = record_to_arrays(rec)
    back["w"].add_(1)  # writable, and not a view of the record's bytes
    assert torch.equal(record_to_arrays(rec)["w"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(back["f"], torch.arange(6, dtype=torch.int32).reshape(2, 3))


def test_special_values_and_non_contiguous() -> None:
    t = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])
    nc = torch.arange(12.0).reshape(3, 4).t()
    back = record_to_arrays(arrays_to_record({"s": t, "nc": nc}))
    assert torch.equal(back["s"].isnan(), t.isnan())
    assert torch.equal(back["s"][1:], t[1:]) and torch.signbit(back["s"][2])
    assert torch.equal(back["nc"], nc)


@pytest.mark.parametrize("shape", [(), (0,), (3, 4)])
def test_bfloat16_roundtrip_bitwise_through_flower_serialization(shape: tuple[int, ...]) -> None:
    """bfloat16 (16-bit transport) travels as its bit pattern under a dtype marker: values,
    NaN/Inf/-0 and shape come back, also after Flower's own deflate/inflate of the Array, at
    2 bytes per element (+ the .npy header)."""
    from flwr.app import Array, ArrayRecord

    g = torch.Generator().manual_seed(1)
    t = (torch.randn(shape, generator=g) * 1e4).to(torch.bfloat16)
    if t.numel():
        t.view(-1)[0] = float("nan")
    special = torch.tensor([float("inf"), -0.0, 3e38, 1e-40], dtype=torch.bfloat16)
    rec = arrays_to_record({"w": t, "s": special, "f": torch.ones(2)})
    assert rec["w"].dtype == "bfloat16" and rec["f"].dtype == "float32"
    wired = Array.inflate(rec["w"].deflate(), dict(rec["w"].children))
    for arr in (rec["w"], wired):
        back = record_to_arrays(ArrayRecord({"w": arr}))["w"]
        assert back.dtype == torch.bfloat16 and tuple(back.shape) == shape
        assert torch.equal(back.view(torch.int16), t.view(torch.int16))  # bit for bit
    backs = record_to_arrays(rec)
    assert torch.equal(backs["s"].view(torch.int16), special.view(torch.int16))
    assert backs["f"].dtype == torch.float32
    assert record_nbytes(arrays_to_record({"w": torch.zeros(1000, dtype=torch.bfloat16)})) < (
        2000 + 256
    )


def test_broadcast_reply_state_roundtrip() -> None:
    arrays = {"model.w": torch.randn(3, 2), "log.4.x": torch.arange(3)}
    b = Broadcast(arrays, {"round": 3, "mode": "log", "decay.2": 0.5, "flag": True})
    b2 = record_to_broadcast(broadcast_to_record(b))
    assert b2.config == b.config and list(b2.arrays) == list(b.arrays)
    assert all(torch.equal(b.arrays[k], b2.arrays[k]) for k in arrays)
    r = Reply({"update.w": torch.randn(2, 2)}, {"num_examples": 7, "loss": 0.25, "tag": "x"})
    r2 = record_to_reply(reply_to_record(r))
    assert r2.metrics == r.metrics and isinstance(r2.metrics["num_examples"], int)
    assert torch.equal(r2.arrays["update.w"], r.arrays["update.w"])
    s = State({"cache.w": torch.randn(4)}, {"version": 3, "held": -1})
    s2 = record_to_state(state_to_record(s))
    assert s2 is not None and s2.values == s.values
    assert torch.equal(s2.arrays["cache.w"], s.arrays["cache.w"])


def test_record_nbytes_counts_payload_plus_header() -> None:
    rec = arrays_to_record({"a": torch.zeros(1000), "b": torch.zeros(10, dtype=torch.float64)})
    n = record_nbytes(rec)
    assert 4000 + 80 < n < 4000 + 80 + 2 * 256  # numpy .npy headers are at most a few hundred B


def test_size_limit_names_the_large_arrays() -> None:
    msg = Broadcast({"model.big": torch.zeros(500_000), "model.small": torch.zeros(10)})
    check_size(0, msg, 3_000_000)
    with pytest.raises(MessageTooLarge, match=r"model\.big \(2\.00 MB\)"):
        check_size(0, msg, 1_000_000)
