"""fedlore: federated learning with shared low-rank gradient subspaces and Bayesian clients.

The architecture is described in ``docs/explanation/architecture.md`` of the project: an
algorithm is a frozen hyperparameter dataclass with four methods over explicit state and plain
messages (:mod:`fedlore.algorithm`), one round loop drives it (:mod:`fedlore.engine.loop`)
over a transport (in-process or Flower).
"""

import os as _os

# Waiting OpenMP threads sleep instead of spinning, so a run whose threads share their CPUs with
# another process slows down rather than collapses (issue 19: a 2-thread training loop beside a
# competing process ran 30-100x slower spinning, 2-3x passive). Set before torch loads its
# OpenMP runtime, which reads it once; an OMP_WAIT_POLICY of the user's wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fedlore.types import Arrays, Broadcast, Reply, State

__all__ = ["Arrays", "Broadcast", "Reply", "State"]
__version__ = "0.1.0"
