"""fedlore: federated learning with shared low-rank gradient subspaces and Bayesian clients.

The architecture is described in ``docs/ARCHITECTURE.md`` of the project: an algorithm is a
frozen hyperparameter dataclass with four methods over explicit state and plain messages
(:mod:`fedlore.algorithm`), one round loop drives it (:mod:`fedlore.engine.loop`) over a
transport (in-process or Flower).
"""

from fedlore.types import Arrays, Broadcast, Reply, State

__all__ = ["Arrays", "Broadcast", "Reply", "State"]
__version__ = "0.1.0"
