"""fedlore: federated learning with shared low-rank gradient subspaces and Bayesian clients.

The architecture is described in ``docs/explanation/architecture.md`` of the project: an
algorithm is a frozen hyperparameter dataclass with four methods over explicit state and plain
messages (:mod:`fedlore.algorithm`), one round loop drives it (:mod:`fedlore.engine.loop`)
over a transport (in-process or Flower).

Importing the package loads nothing heavy: the message types below (which need torch) load on
first use, so the ``fedlore`` command's entry point (:mod:`fedlore.console`) is in place, and
Ctrl-C ends in one line, before torch starts loading.
"""

from __future__ import annotations

import os as _os
from typing import TYPE_CHECKING, Any

# Waiting OpenMP threads sleep instead of spinning, so a run whose threads share their CPUs with
# another process slows down rather than collapses (issue 19: a 2-thread training loop beside a
# competing process ran 30-100x slower spinning, 2-3x passive). Set before torch loads its
# OpenMP runtime, which reads it once; an OMP_WAIT_POLICY of the user's wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from fedlore.types import Arrays, Broadcast, Reply, State

__all__ = ["Arrays", "Broadcast", "Reply", "State"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``fedlore.Arrays`` and the other message types, imported from :mod:`fedlore.types` on
    first use (PEP 562)."""
    if name in __all__:
        from fedlore import types

        return getattr(types, name)
    raise AttributeError(f"module 'fedlore' has no attribute {name!r}")
