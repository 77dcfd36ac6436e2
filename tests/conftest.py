"""Test-wide settings: one torch thread per test process (tiny models run 10-60x faster than
with oversubscribed threads on a 2-core machine), restored afterwards. ``OMP_NUM_THREADS=1``
is exported too, so ``threads: auto`` in the runs under test keeps one thread and every
subprocess a test starts (the CLI, Flower's SuperNodes) starts with one."""

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    if env_before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env_before
