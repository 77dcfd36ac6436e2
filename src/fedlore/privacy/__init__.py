"""Secure aggregation and user-level central differential privacy (issue 20).

* :mod:`fedlore.privacy.secagg`: in-process secure aggregation (fixed point, pairwise masks that
  cancel in the sum, dropout recovery); deployments use Flower's SecAgg+ (:mod:`fedlore.flower`).
* :mod:`fedlore.privacy.dp`: clipping, the Gaussian mechanism's settings and Google's
  dp-accounting RDP accountant (ε per round, σ from a target ε).
* :mod:`fedlore.privacy.aggregation`: the client side (:func:`privatize`,
  :func:`client_contribution`) and the server side (:class:`Privacy`) of a round.
"""

from fedlore.privacy.aggregation import (
    CLEAR_METRICS,
    MASKED,
    Contribution,
    Privacy,
    client_contribution,
    flatten,
    privatize,
    spec_length,
    unflatten,
)
from fedlore.privacy.dp import DPSettings, clip_upload, epsilon_spent, noise_for_epsilon

__all__ = [
    "CLEAR_METRICS",
    "MASKED",
    "Contribution",
    "DPSettings",
    "Privacy",
    "client_contribution",
    "clip_upload",
    "epsilon_spent",
    "flatten",
    "noise_for_epsilon",
    "privatize",
    "spec_length",
    "unflatten",
]
