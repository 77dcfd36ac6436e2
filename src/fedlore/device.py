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
import functools
import math
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

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


CPU_SAMPLE_S = 0.25
"""Seconds over which :func:`busy_cpus` watches the CPUs (``threads: auto`` waits this long once
per run, before its first round)."""

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""A cgroup v2 CPU quota (``"<quota> <period>"`` microseconds, or ``"max <period>"``): a
container started with ``--cpus=N`` may use N CPUs' time whatever its affinity mask says."""


def cgroup_cpus(path: Path = CGROUP_CPU_MAX) -> int | None:
    """CPUs the cgroup's quota allows (the quota over the period, rounded up), None without a
    quota or where the file is missing or unreadable."""
    try:
        quota, period = path.read_text().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one (else
    ``os.cpu_count()``), capped by a cgroup CPU quota (:func:`cgroup_cpus`), at least 1."""
    try:
        cpus = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        cpus = max(1, os.cpu_count() or 1)
    quota = cgroup_cpus()
    return cpus if quota is None else min(cpus, quota)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds at one instant, over the CPUs this process may run on.

    Attributes:
        busy: seconds those CPUs spent on anything but idling or waiting for I/O (user, nice,
            system, interrupts, and steal: time a hypervisor gave to another machine).
        total: all their seconds (busy and idle; guest time is already in user).
        own: this process's CPU seconds, all its threads (user and system).
        cpus: how many CPUs ``busy`` and ``total`` cover.
    """

    busy: float
    total: float
    own: float
    cpus: int


def cpu_sample() -> CpuSample | None:
    """The CPU counters now (psutil's per-CPU times, ``/proc/stat`` on Linux), over this
    process's affinity mask where psutil lists one entry per CPU; None where the OS gives no
    per-CPU times."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        per_cpu = psutil.cpu_times(percpu=True)
        own = psutil.Process().cpu_times()
    except (psutil.Error, OSError, AttributeError, RuntimeError):
        return None
    try:
        mask = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        mask = set(range(len(per_cpu)))
    if len(per_cpu) != (os.cpu_count() or 0) or not mask <= set(range(len(per_cpu))):
        mask = set(range(len(per_cpu)))  # offline CPUs make the indices unreliable: all of them
    busy = total = 0.0
    for i in mask:
        t = {k: v for k, v in per_cpu[i]._asdict().items() if k not in ("guest", "guest_nice")}
        # (guest time is counted in user / nice already)
        all_s = sum(t.values())
        total += all_s
        busy += all_s - t.get("idle", 0.0) - t.get("iowait", 0.0)
    return CpuSample(busy=busy, total=total, own=own.user + own.system, cpus=len(mask))


def busy_cpus(
    interval: float = CPU_SAMPLE_S, sample: Callable[[], CpuSample | None] = cpu_sample
) -> float:
    """CPUs other work keeps busy now: the busy time of this process's CPUs over ``interval``
    seconds, less this process's own CPU time in that interval, in CPUs.

    Measured, not averaged: the 1-minute load average that ``auto`` used before issue 30 lags a
    minute and counted fedlore's own start-up and the job that had just ended, so on an idle
    2-core machine it often gave one thread. Here a neighbour that runs now counts as the CPUs it
    occupies; fedlore's own threads (a progress bar, a previous run's pool) never count.

    Args:
        interval: seconds between the two samples.
        sample: the counter source (tests pass recorded counters).

    Returns:
        Busy CPUs, ``0 <= busy <= cpus``; the 1-minute load average where the OS gives no
        per-CPU times (macOS without psutil's counters, a /proc-less container).
    """
    first = sample()
    if first is not None:
        time.sleep(interval)
    second = sample() if first is not None else None
    if first is None or second is None or second.cpus != first.cpus:
        try:
            return float(os.getloadavg()[0])
        except (AttributeError, OSError):
            return 0.0
    total = second.total - first.total
    if total <= 0:
        return 0.0
    per_cpu = total / first.cpus  # seconds each CPU was watched (the clock the counters tick)
    others = (second.busy - first.busy) - (second.own - first.own)
    return float(min(max(others / per_cpu, 0.0), first.cpus))


def auto_threads(cpus: int | None = None, busy: float | None = None) -> int:
    """The intra-op thread count of ``threads: auto``: the CPUs left free by other work,
    ``clamp(round(cpus - busy), 1, cpus)``.

    Why: torch's OpenMP threads meet at a barrier after every parallel op, so on a CPU that
    another process occupies each op waits for a descheduled thread; the quickstart took 8 min
    34 s with torch's default 2 threads beside a competing process and 20 s with one thread
    (issue 19). A thread per *free* CPU keeps an idle machine's speed-up (every CPU: issue 30)
    and takes one thread when the machine is busy. An explicit ``OMP_NUM_THREADS`` wins: the
    count torch already uses is kept.

    Args:
        cpus: CPUs available (default :func:`available_cpus`).
        busy: CPUs kept busy by other work (default :func:`busy_cpus`, measured now).

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


PLATFORM_KEYS = ("ran_fedlore", "ran_torch", "ran_numpy", "ran_cpu", "ran_gpu")
"""The ``config.json`` keys of :func:`platform_record`."""


@functools.cache
def fedlore_version() -> str:
    """fedlore's version, and when it runs from a git checkout its commit and whether tracked
    files differ from it: ``0.1.0 (git 3798d78c1a2b, modified)``."""
    from fedlore import __version__

    src = Path(__file__).resolve().parent
    try:
        git = ["git", "-C", str(src)]
        head = subprocess.run(
            [*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return __version__
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", str(src)],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):  # no git, or a very slow file system
        return __version__
    modified = ", modified" if changed.stdout.strip() else ""
    return f"{__version__} (git {head.stdout.strip()}{modified})"


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
        ``ran_fedlore`` (:func:`fedlore_version`: the version, the git commit and whether the
        package's files were modified), ``ran_torch`` and ``ran_numpy`` (the versions),
        ``ran_cpu`` (the instruction set of torch's CPU kernels,
        ``torch.backends.cpu.get_cpu_capability()``) and, on CUDA, ``ran_gpu`` (the device's
        name).
    """
    out = {
        "ran_fedlore": fedlore_version(),
        "ran_torch": str(torch.__version__),
        "ran_numpy": np.__version__,
        "ran_cpu": torch.backends.cpu.get_cpu_capability(),
    }
    if device.type == "cuda":
        out["ran_gpu"] = torch.cuda.get_device_name(device)
    return out
