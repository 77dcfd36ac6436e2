"""One short module per method; importing this package registers them all."""

from fedlore.algorithms import fedavg, fedlore, local_galore  # noqa: F401
from fedlore.algorithms.base import Hyper, build_hyper

__all__ = ["Hyper", "build_hyper"]
