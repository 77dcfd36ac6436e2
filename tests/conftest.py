"""Test-wide settings: one torch thread per test process (tiny models run 10-60x faster than
with oversubscribed threads on a 2-core machine), restored afterwards. ``OMP_NUM_THREADS=1``
is exported too, so ``threads: auto`` in the runs under test keeps one thread and every
subprocess a test starts (the CLI, Flower's SuperNodes) starts with one."""

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# The longest tests (Flower deployments, interrupted simulations, the docs' pages: 10-160 s each on
# two cores) start first, so that the two pytest-xdist workers do not end with one of them
# running a long test alone; the deployment tests run on one worker, one after another (their
# round timeouts assume the other worker is not starting SuperNodes too). `fedlore tune`'s
# worker tests stay where they are collected, near the end: moved to the front as well, beside
# the deployments and simulations, every long test ran slower and the suite took 74 s longer
# (docs/development/tests.md).
LONG_FIRST = (
    "tests/flower/test_deployment.py",
    "tests/reliability/test_interrupts.py",
    "tests/flower/test_simulation",
    "tests/test_docs_examples.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next(
            (i for i, p in enumerate(LONG_FIRST) if item.nodeid.startswith(p)), len(LONG_FIRST)
        )

    items.sort(key=rank)


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


@pytest.fixture(autouse=True)
def _progress_as_it_was() -> Iterator[None]:
    """A test that runs the command line switches fedlore's progress messages on for its whole
    process; the next test in that process starts with the logger as it was (off, as for a
    library user), so what it captures from standard error does not depend on the order."""
    log = logging.getLogger("fedlore.progress")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    yield
    log.handlers[:] = handlers
    log.setLevel(level)
    log.propagate = propagate


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
