"""Where a run computes, and what it measures there.

:func:`resolve_device` turns the config's ``device`` into a :class:`torch.device`;
:func:`autocast` gives the training precision's autocast context; :class:`PeakMemory` measures a
client's peak device memory; :func:`use_threads` sets the CPU thread count (``threads``).
Randomness never comes from a device generator: every stream is a seeded CPU
``torch.Generator`` (:mod:`fedlore.seeding`) whose draws are moved to the device, so a run on a
GPU differs from the same run on the CPU only by float rounding.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar

import numpy as np
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


THREADS_ENV = "OMP_NUM_THREADS"
"""An explicit thread count in the environment wins over ``threads: auto``."""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else
    ``os.cpu_count()``), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def busy_cpus() -> float:
    """CPUs other work keeps busy now: the 1-minute load average (runnable processes, ours
    included once it has run a while), 0.0 where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0.0


def auto_threads(cpus: int | None = None, busy: float | None = None) -> int:
    """The intra-op thread count of ``threads: auto``: the CPUs left free by other work,
    ``clamp(round(cpus - busy), 1, cpus)``.

    Why: torch's OpenMP threads meet at a barrier after every parallel op, so on a CPU that
    another process occupies each op waits for a descheduled thread; the quickstart took 8 min
    34 s with torch's default 2 threads beside a competing process and 20 s with one thread
    (issue 19). A thread per *free* CPU keeps an idle machine's speed-up and takes one thread
    when the machine is busy. An explicit ``OMP_NUM_THREADS`` wins: the count torch already
    uses is kept.

    Args:
        cpus: CPUs available (default :func:`available_cpus`).
        busy: CPUs kept busy by other work (default :func:`busy_cpus`, the load average).

    Returns:
        Threads, ``1 <= threads <= cpus``.
    """
    if os.environ.get(THREADS_ENV):
        return torch.get_num_threads()
    cpus = available_cpus() if cpus is None else cpus
    busy = busy_cpus() if busy is None else busy
    return int(min(max(round(cpus - busy), 1), cpus))


def use_threads(setting: int | str, recorded: int | None = None) -> int:
    """Set torch's intra-op thread count from the config's ``threads`` and return it.

    Args:
        setting: a count >= 1, or ``"auto"`` (:func:`auto_threads`).
        recorded: the count a resumed run was started with; ``auto`` reuses it, so a resumed run
            sums in the same order as its first part (float sums depend on the thread count).

    Returns:
        The thread count now in effect.
    """
    if setting == "auto":
        n = recorded if recorded is not None and recorded >= 1 else auto_threads()
    else:
        n = int(setting)
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n


PLATFORM_KEYS = ("ran_torch", "ran_numpy", "ran_cpu", "ran_gpu")
"""The ``config.json`` keys of :func:`platform_record`."""


def platform_record(device: torch.device) -> dict[str, str]:
    """What a run's floats depend on beyond its settings, for its ``config.json``.

    The same settings and seed repeat a run bit for bit (``tests/engine/test_resume.py``) on one
    machine; elsewhere they may not. torch dispatches its CPU kernels by the instruction set it
    finds (``AVX2``, ``AVX512``, ...), and the kernels, like the thread count and the device,
    change float sums in the last digits; non-IID training can grow such digits into points of
    accuracy. Two seed-42 runs on Fashion-MNIST (Dirichlet α = 0.1, 60 rounds, ``threads=1``)
    moved by 1.7 and 4.5 points when rerun on a fresh machine, where every rerun on one machine
    was identical. Recorded so that such a difference can be traced; never compared by
    ``--resume``.

    Args:
        device: the run's device.

    Returns:
        ``ran_torch`` and ``ran_numpy`` (the versions), ``ran_cpu`` (the instruction set of
        torch's CPU kernels, ``torch.backends.cpu.get_cpu_capability()``) and, on CUDA,
        ``ran_gpu`` (the device's name).
    """
    out = {
        "ran_torch": str(torch.__version__),
        "ran_numpy": np.__version__,
        "ran_cpu": torch.backends.cpu.get_cpu_capability(),
    }
    if device.type == "cuda":
        out["ran_gpu"] = torch.cuda.get_device_name(device)
    return out
