"""Secure aggregation and user-level central and local differential privacy.

* :mod:`fedlore.privacy.randomness`: where every draw that protects privacy comes from (OS
  entropy; the run seed only under ``dp.reproducible_noise``, a debugging mode with no privacy).
* :mod:`fedlore.privacy.secagg`: in-process secure aggregation with Bonawitz et al.'s double
  masking, Shamir-shared secrets and thresholds; deployments use Flower's SecAgg+
  (:mod:`fedlore.flower`).
* :mod:`fedlore.privacy.fixedpoint`: the 64-bit ring encoding, its resolution from the entry
  bound and the number of clients.
* :mod:`fedlore.privacy.dp`: clipping, the Gaussian mechanism's settings and Google's
  dp-accounting accountants (ε per round, σ from a target ε).
* :mod:`fedlore.privacy.local_dp`: local DP (``dp.mode: local``): each client noises its own
  upload; each client's ε over the exchanges it took part in.
* :mod:`fedlore.privacy.buffer_dp`: central DP over FedBuff's buffer (DP-FedBuff): the noised
  buffer mean, one contribution per client and step, each client's ε over its own steps.
* :mod:`fedlore.privacy.client`: the client side of a round (:func:`client_contribution`,
  :func:`privatize`); :mod:`fedlore.privacy.plan`: what a secure round sums and returns;
  :mod:`fedlore.privacy.aggregation`: the server side (:class:`Privacy`).
* :mod:`fedlore.privacy.canaries` and :mod:`fedlore.privacy.empirical`: the canary audit of
  central DP (``dp.audit``): canary clients in the noised sum and the one-shot empirical ε of
  Andrew et al. (ICLR 2024) from their cosines with the model's change;
  :mod:`fedlore.privacy.empirical_error`: its confidence interval and false-alarm probability.
* :mod:`fedlore.privacy.crypto`, :mod:`fedlore.privacy.topology` and
  :mod:`fedlore.privacy.parties`: the protocol's primitives, its mask graphs and thresholds, and
  the driver of its stages with the in-process clients.
"""

from fedlore.privacy.aggregation import ClipNorm, Privacy
from fedlore.privacy.client import (
    CLEAR_METRICS,
    Contribution,
    client_contribution,
    client_name,
    client_noise,
    clients_named,
    flatten,
    names_clients,
    privatize,
    released_metrics,
    spec_length,
    unflatten,
)
from fedlore.privacy.dp import DPSettings, clip_upload, epsilon_spent, noise_for_epsilon
from fedlore.privacy.local_dp import (
    Uploads,
    add_local_noise,
    local_epsilon,
    local_noise_for_epsilon,
)
from fedlore.privacy.plan import SecurePlan, SecureSum
from fedlore.privacy.randomness import NoiseSource, SecureSource, SeededSource, noise_source

__all__ = [
    "CLEAR_METRICS",
    "ClipNorm",
    "Contribution",
    "DPSettings",
    "NoiseSource",
    "Privacy",
    "SecurePlan",
    "SecureSource",
    "SecureSum",
    "SeededSource",
    "Uploads",
    "add_local_noise",
    "client_contribution",
    "client_name",
    "client_noise",
    "clients_named",
    "clip_upload",
    "epsilon_spent",
    "flatten",
    "local_epsilon",
    "local_noise_for_epsilon",
    "names_clients",
    "noise_for_epsilon",
    "noise_source",
    "privatize",
    "released_metrics",
    "spec_length",
    "unflatten",
]
