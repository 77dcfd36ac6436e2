"""Test-wide settings: one torch thread per test process (tiny models run 10-60x faster than
with oversubscribed threads on a 2-core machine), restored afterwards."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
