"""Fixtures of the Flower tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def task_identity() -> Iterator[None]:
    """Flower builds server messages with the process's run id (set by its runtimes)."""
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = old
