"""The client's side of a private round: flatten, clip, add the noise share, strip the metrics.

A method is sum-aggregable (:attr:`fedlore.algorithm.Capabilities.sum_aggregable`) when its
server needs only ``Σ p_i x_i`` and ``Σ p_i`` of the uploads ``x_i`` (all reply arrays,
flattened in sorted key order into one vector of length L). Right after ``client_update``:

1. DP: clip the upload to the round's clip norm ``C_t`` (:func:`~fedlore.privacy.dp.
   clip_upload`).
2. Secure aggregation with DP (:func:`client_contribution`): add the client's noise share
   ``N(0, s²)`` from OS entropy (:mod:`fedlore.privacy.randomness`), its size set by the server
   (:meth:`fedlore.privacy.Privacy.noise_share`); with adaptive clipping also the bit ``b_i``
   (1: the upload was not clipped) plus its own noise share, one extra entry.
   DP without secure aggregation (:func:`privatize`): the clipped arrays themselves, and the
   clip flag as a metric for the trusted curator; under local DP (``dp.mode: local``) the
   clipped arrays plus the client's own noise ``N(0, (σC)²)`` per coordinate, no clip flag
   (:mod:`fedlore.privacy.local_dp`). Local DP under secure aggregation: the noise share of
   step 2 is the whole σC.
3. Only :data:`CLEAR_METRICS` (timings and memory, which say nothing about the data) stay in
   the clear: training losses of single clients are not released. The one exception is opt-in:
   with ``eval.local`` the P-local scores a client computes in the run's last round
   (``local_*``, :func:`~fedlore.algorithms.base.local_scores`) travel with them, a simulation
   measurement outside the mechanism that the run warns of (:func:`released_metrics`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedlore.privacy.dp import clip_upload
from fedlore.privacy.local_dp import add_local_noise
from fedlore.privacy.randomness import NoiseSource, count_stream, noise_source
from fedlore.types import Arrays, Reply, Scalars

ReplySpec = dict[str, tuple[tuple[int, ...], torch.dtype]]

CLEAR_METRICS = ("train_s", "optimizer_state_bytes", "basis_bytes", "peak_memory_bytes")
"""Reply metrics that travel in the clear under secure aggregation or DP."""
MEASURED_PREFIX = "local_"
"""P-local scores (``eval.local``; the prefix is reserved for them,
:data:`fedlore.train.metrics.RESERVED_PREFIXES`): a measurement that travels beside
:data:`CLEAR_METRICS` when a client reports it (only in the run's last round, only with
``eval.local``), outside secure aggregation and DP."""


def released_metrics(metrics: Scalars) -> Scalars:
    """The reply metrics that leave a client under secure aggregation or DP: the
    :data:`CLEAR_METRICS` and the P-local scores it reports (``local_*``: with ``eval.local``, in
    the last round), nothing else (no training loss, no state size, no clip flag)."""
    return {k: v for k, v in metrics.items() if k in CLEAR_METRICS or k.startswith(MEASURED_PREFIX)}


def flatten(arrays: Arrays) -> torch.Tensor:
    """The arrays' values in sorted key order as one float64 vector (on the arrays' device)."""
    if not arrays:
        raise ValueError("no upload arrays to flatten")
    return torch.cat([arrays[k].detach().reshape(-1).double() for k in sorted(arrays)])


def unflatten(vector: torch.Tensor, spec: ReplySpec) -> Arrays:
    """Arrays of ``spec`` (key -> (shape, dtype)) from ``vector`` (sorted key order).

    Raises:
        ValueError: if the vector's length is not the spec's total size.
    """
    out: Arrays = {}
    at = 0
    for k in sorted(spec):
        shape, dtype = spec[k]
        n = math.prod(shape)
        out[k] = vector[at : at + n].reshape(shape).to(dtype).contiguous()
        at += n
    if at != vector.numel():
        raise ValueError(f"vector has {vector.numel()} entries, the reply spec needs {at}")
    return out


def spec_length(spec: ReplySpec) -> int:
    """L: the number of entries of an upload of ``spec``."""
    return sum(math.prod(shape) for shape, _ in spec.values())


def names_clients(config: Scalars) -> bool:
    """Whether the logs and rows of a round with broadcast ``config`` may name its clients: not
    under DP with secret noise, whose sample they must not give away
    (:attr:`fedlore.privacy.Privacy.hides_sample`)."""
    dp = float(config.get("privacy.clip_norm", 0.0)) > 0
    return not dp or bool(config.get("privacy.reproducible", False))


def client_name(config: Scalars, cid: int) -> str:
    """How a log line names client ``cid`` of a round with broadcast ``config``: ``"a client"``
    when it may not (:func:`names_clients`), else ``"client <cid>"``."""
    return f"client {cid}" if names_clients(config) else "a client"


def clients_named(config: Scalars, cids: list[int]) -> str:
    """``cids`` as a log line names them: ``"clients [1, 3]"``, or ``"2 client(s)"`` when the
    round's clients may not be named (:func:`names_clients`)."""
    return f"clients {cids}" if names_clients(config) else f"{len(cids)} client(s)"


def client_noise(config: Scalars, seed: int) -> NoiseSource:
    """The noise source a client uses for its shares: OS entropy, or the run seed when the
    broadcast says ``privacy.reproducible`` (``dp.reproducible_noise``)."""
    return noise_source(bool(config.get("privacy.reproducible", False)), seed)


@dataclass(frozen=True)
class Contribution:
    """What a client adds to the round's secure sum.

    Attributes:
        vector: float64, L entries on the CPU: the (clipped, DP-noised) upload vector in sorted
            key order. Not yet weighted.
        extras: float64, 1 entry under adaptive clipping (``b_i`` plus its noise share), else
            none: summed beside the vector.
        weight: p_i (1.0 under uniform weighting, else the client's training-set size).
        clipped: whether DP clipping scaled the upload down (known to the client only).
        metrics: the reply metrics that travel in the clear (:func:`released_metrics`).
    """

    vector: torch.Tensor
    extras: torch.Tensor
    weight: float
    clipped: bool
    metrics: Scalars

    @property
    def summed(self) -> torch.Tensor:
        """``[vector, extras]``: what the secure sum adds up (weighted by the protocol)."""
        return torch.cat([self.vector, self.extras])


def client_contribution(
    reply: Reply, config: Scalars, client_id: int, rnd: int, noise: NoiseSource
) -> Contribution:
    """Client side of a secure round: clip (DP), add the client's noise shares (DP) and
    flatten (see the module docstring).

    Args:
        config: the broadcast's config (``privacy.*`` keys from
            :meth:`fedlore.privacy.Privacy.configure`).
        noise: where the noise shares come from (:func:`client_noise`).

    Raises:
        ValueError: for non-finite upload arrays (nothing is sent) or no ``privacy.`` config.
    """
    if "privacy.secure" not in config:
        raise ValueError("the broadcast carries no privacy settings (privacy.*)")
    arrays = dict(reply.arrays)
    clip = float(config.get("privacy.clip_norm", 0.0))
    clipped = False
    if clip > 0:
        arrays, clipped = clip_upload(arrays, clip, float(config["privacy.sketch_share"]))
    vec = flatten(arrays).cpu()
    if not bool(torch.isfinite(vec).all()):
        raise ValueError("the upload contains NaN or Inf; nothing is sent")
    share = float(config.get("privacy.noise_share", 0.0))
    if share > 0:
        vec = vec + noise.gaussian(vec.numel(), share, rnd, client_id)
    extras = torch.zeros(0, dtype=torch.float64, device="cpu")
    if "privacy.count_share" in config:  # adaptive clipping: b_i and its noise share
        bit = torch.tensor([0.0 if clipped else 1.0], dtype=torch.float64, device="cpu")
        count_share = float(config["privacy.count_share"])
        extras = bit + noise.gaussian(1, count_share, rnd, count_stream(client_id))
    weight = 1.0 if config.get("privacy.uniform", True) else float(reply.num_examples)
    metrics = released_metrics(reply.metrics)
    return Contribution(vec, extras, weight, clipped, metrics)


def privatize(
    reply: Reply,
    config: Scalars,
    noise: NoiseSource | None = None,
    rnd: int = 0,
    client_id: int = 0,
) -> Reply:
    """Client side of DP without secure aggregation: the arrays clipped to the round's
    ``privacy.clip_norm`` (their own dtypes), :func:`released_metrics` and ``num_examples = 1``;
    under central DP also the metric ``dp_clipped`` (for the trusted curator). Under local DP
    (``privacy.local``) the clipped arrays get ``N(0, s²)`` on every coordinate, s =
    ``privacy.noise_share`` (σC), drawn from ``noise`` for round ``rnd`` and ``client_id``
    (:func:`~fedlore.privacy.local_dp.add_local_noise`), and no clip flag leaves the client
    (it says something of the data and no one is trusted with it). The reply unchanged when
    the broadcast has no ``privacy.*`` settings or asks for secure aggregation (which
    :func:`client_contribution` handles).

    Raises:
        ValueError: for non-finite uploads, or local DP without a ``noise`` source.
    """
    if "privacy.secure" not in config or config["privacy.secure"]:
        return reply
    clip = float(config["privacy.clip_norm"])
    arrays, clipped = clip_upload(dict(reply.arrays), clip, float(config["privacy.sketch_share"]))
    metrics = released_metrics(reply.metrics)
    if not config.get("privacy.local", False):
        return Reply(arrays, {**metrics, "num_examples": 1, "dp_clipped": int(clipped)})
    if noise is None:
        raise ValueError("local DP: the client needs its noise source to noise its upload")
    std = float(config["privacy.noise_share"])
    arrays = add_local_noise(arrays, std, noise, rnd, client_id)
    return Reply(arrays, {**metrics, "num_examples": 1})
