"""Where a run computes, and what it measures there.

:func:`resolve_device` turns the config's ``device`` into a :class:`torch.device`;
:func:`autocast` gives the training precision's autocast context; :class:`PeakMemory` measures a
client's peak device memory. Randomness never comes from a device generator: every stream is a
seeded CPU ``torch.Generator`` (:mod:`fedlore.seeding`) whose draws are moved to the device, so
a run on a GPU differs from the same run on the CPU only by float rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from fedlore.config import ConfigError


def resolve_device(name: str) -> torch.device:
    """The device of a config's ``device``: ``auto`` is CUDA device 0 when one is present, else
    the CPU; ``cpu``, ``cuda`` and ``cuda:N`` as named.

    Raises:
        ConfigError: when CUDA is asked for and torch has no CUDA device (names what torch
            reports), or ``cuda:N`` names a device that does not exist.
    """
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU build)"
        raise ConfigError(
            f"device={name}: no CUDA device is available (torch {torch.__version__}, CUDA "
            f"{built}, torch.cuda.device_count() = {torch.cuda.device_count()}); use "
            "device=cpu or device=auto"
        )
    dev = torch.device(name)
    index = 0 if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"device={name}: there are {torch.cuda.device_count()} CUDA device(s) (0 .. "
            f"{torch.cuda.device_count() - 1})"
        )
    return torch.device("cuda", index)


_TRAINING_AUTOCAST: ContextVar[torch.dtype | None] = ContextVar("training_autocast", default=None)
"""The low-precision dtype of the current run's local training (None: full precision)."""


@contextlib.contextmanager
def training_precision(precision: str) -> Iterator[None]:
    """Within the block, :func:`autocast` of local training uses ``precision``: ``bf16`` turns
    on bfloat16 autocast of the forward passes; ``fp32`` / ``fp64`` turn it off (fp64 is a
    property of the model, not of autocast). The run and every client process set it, so a
    method never has to."""
    token = _TRAINING_AUTOCAST.set(torch.bfloat16 if precision == "bf16" else None)
    try:
        yield
    finally:
        _TRAINING_AUTOCAST.reset(token)


def autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The autocast context of one training forward pass on ``device``: bfloat16 autocast under
    ``training_precision("bf16")`` (CUDA and CPU alike), else a no-op. Only the forward pass
    (and the loss) runs in it: the backward follows the forward's dtypes, and optimizer steps,
    projections and aggregation stay in the parameters' fp32."""
    dtype = _TRAINING_AUTOCAST.get()
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class PeakMemory:
    """Peak device memory of a block, in bytes: ``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats`` for a CUDA device (tensors allocated by torch, not the caching
    allocator's reserve); None on the CPU, where torch keeps no such counter.

    Usage: ``with PeakMemory(device) as peak: ...``; then ``peak.bytes``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))
