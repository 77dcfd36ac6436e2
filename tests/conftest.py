"""Test-wide settings: one torch thread per test process (tiny models run 10-60x faster than
with oversubscribed threads on a 2-core machine), restored afterwards. ``OMP_NUM_THREADS=1``
is exported too, so ``threads: auto`` in the runs under test keeps one thread and every
subprocess a test starts (the CLI, Flower's SuperNodes) starts with one."""

import os
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="session")
def digits_npz(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Overrides that read fedlore's ``digits`` source (sklearn's digits: the same fixed split,
    the same arrays, class names and federation) from an ``npz`` folder written once per test
    session. A process that reads it does not import scikit-learn (about 2 s of CPU), which
    every ClientApp process, ServerApp process and Ray actor of a Flower test, and every
    ``fedlore run`` a test starts, would otherwise pay on digits."""
    import numpy as np

    from fedlore.data.sources import load_digits

    src = load_digits()
    folder: Path = tmp_path_factory.mktemp("digits-npz").resolve()
    for part in ("train", "test"):
        split = getattr(src, part)
        np.savez(
            folder / f"{part}.npz",
            x=split.x.numpy(),
            y=split.y.numpy(),
            class_names=np.asarray(src.class_names),
        )
    return ["data.name=npz", f"data.root={folder}"]
