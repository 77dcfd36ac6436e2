"""Canary clients for the one-shot empirical privacy audit of central DP (``dp.audit.*``).

Andrew, Kairouz, Oh, Oprea, McMahan & Suriyakumar, "One-shot Empirical Privacy Estimation for
Federated Learning" (ICLR 2024), Algorithm 1, on fedlore's DP-FedAvg
(:mod:`fedlore.privacy.dp`): k *canary clients* take part in the run beside the real ones. Each
canary i holds a secret direction ``c_i``, isotropic and of unit norm in the flattened upload
space (d coordinates: every reply array, sorted by key, as :func:`~fedlore.privacy.client.
flatten` lays them out), and whenever it is sampled it uploads ``C c_i`` (C: the round's clip
norm, so it is a valid clipped upload) instead of training. k' *unseen* canaries get directions
of their own that are never inserted. After training the auditor compares the model's change
``θ_T − θ_0`` (over the tensors the clients upload) with each direction
(:meth:`Canaries.summary`; the estimator is :mod:`fedlore.privacy.empirical`).

**Threat model.** The estimate is of the ε achieved by an adversary who sees the final model
(and ``θ_0``) and knows every canary direction, but not which rounds sampled which canary, and
who tests "was canary i inserted?" with one statistic, the cosine. The *all-iterates* estimate
is for an adversary who sees every round's model: its statistic is, per canary, the largest
cosine between a round's model change ``θ_t − θ_{t−1}`` and ``c_i`` over the rounds, with the
null fitted to the unseen canaries' same statistic (its distribution is no longer ``N(0, 1/d)``).
Both are *estimates*, not bounds: a small value does not prove privacy (the adversary, the
statistic and the Gaussian fit are particular), while a value well above the accountant's ε,
beyond the fit's own error (large with few canaries or rounds: the summary's interval,
:mod:`fedlore.privacy.empirical_error`, lying wholly above ε), shows that the mechanism or its
accounting is broken. The all-iterates statistic is the one of the authors' reference code
(google-research/federated, ``one_shot_epe``: a running maximum of each round's model-delta
cosine, for canaries and unseen canaries alike, each population fitted by a Gaussian), except
that a round that leaves the model unchanged is skipped, not counted as a cosine of 0.

**How the canaries join the mechanism** (in process and on Flower alike: the server's
:meth:`~fedlore.privacy.aggregation.Privacy.combine`, DP without secure aggregation):

* *Sampling.* Real clients are sampled exactly as without the audit (m of N, the run's rule).
  Each round also draws ``m_c = ⌊k m / N⌋`` of the k canaries uniformly without replacement
  from OS entropy, independently of the real sample, so a canary's sampling ratio ``m_c / k``
  is at most the real clients' ``m / N`` (all k every round under full participation).
* *Sum and count.* The sampled canaries' ``C c_i`` join the sum of the clipped real uploads
  before the server's Gaussian noise is added, like any client's upload; the noised sum is then
  divided by the number of *real* contributors: canaries add to the sum, not to its count, so
  a tiny federation is not diluted by hundreds of canaries.
* *Guarantee of the real clients.* Unchanged, and so is the accountant's ε: the real sample,
  the clip, the noise and the count are those of the run without the audit; the canaries add a
  vector that does not depend on any client's data (post-processing with independent
  randomness), and the accountant's N is still the real federation.
* *Why the canaries' ε is comparable.* A canary's upload lies in the C-ball, and "canary i
  inserted" against "a client uploading 0 in its place" is a replace-one pair of sensitivity C
  (≤ the 2C the accountant assumes), sampled without replacement at a ratio ≤ m / N (the bound
  the accountant uses, Wang, Balle & Kasiviswanathan 2019, depends on the ratio only). The
  accountant's ε therefore bounds what the canary test can detect: an estimate above it cannot
  come from a correct mechanism (up to the estimate's own sampling error).

**Randomness.** The directions come from AES-256-CTR keyed by 32 bytes of OS entropy drawn for
the run (:attr:`Canaries.key`; Box-Muller Gaussians, each row normalized: :func:`directions`),
the canary sample from :class:`secrets.SystemRandom`: nothing derived from the run seed, and
nothing shared with the DP noise, which is drawn as without the audit. The key is kept in the
server state (``checkpoint.pt``), so a resumed run goes on with the same canaries; it protects
no client's data (the canaries are the auditor's own), but whoever holds it knows the
directions.

Memory: the ``(k + k') × d`` directions are kept in float32 (:data:`MAX_DIRECTION_ENTRIES`).
"""

from __future__ import annotations

import base64
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedlore.privacy.empirical import Fit, estimate_epsilon, fit, null_std
from fedlore.privacy.empirical_error import LEVEL, epsilon_interval
from fedlore.types import Arrays, Scalars, State

KEY = "privacy.audit.key"
"""Server-state value: the canaries' AES key (hex), so a resumed run keeps its canaries."""
BEST_KEY = "privacy.audit.best"
"""Server-state value: each canary's largest per-round cosine so far (float64, base64)."""
ROUNDS_KEY = "privacy.audit.rounds"
"""Server-state value: the rounds whose model change the all-iterates statistic has seen."""

MAX_DIRECTION_ENTRIES = 2**28
"""The most direction entries ``(k + k') · d`` kept (float32: 1 GiB)."""

_BLOCK = 256
"""Rows of directions generated at a time."""


def upload_model_keys(spec: dict[str, Any], model: Arrays) -> list[tuple[str, str]]:
    """``(upload key, global model key)`` for every reply array of ``spec`` in sorted order: the
    upload ``<role>.<name>`` must be the change of the global tensor ``<name>`` of the same
    shape (FedAvg's ``update.w`` of ``w``), or the model's change says nothing about it.

    Raises:
        ValueError: naming the first upload array without such a tensor.
    """
    pairs = []
    for key in sorted(spec):
        shape = tuple(spec[key][0])
        name = key.split(".", 1)[-1]
        found = model.get(name)
        if found is None or tuple(found.shape) != shape:
            raise ValueError(
                f"its upload {key!r} {list(shape)} is not the change of a global model tensor "
                f"{name!r} of that shape; the canary audit compares the model's change with "
                "each canary's upload, so it needs a method whose clients upload model deltas "
                "(such as fedavg, fedfull, fedprox)"
            )
        pairs.append((key, name))
    return pairs


def flat_model(model: Arrays, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """The global tensors of ``pairs`` (:func:`upload_model_keys`) flattened in upload order,
    float64 on the CPU: the model in the coordinates of the canaries."""
    return torch.cat([model[name].detach().reshape(-1).double().cpu() for _, name in pairs])


def directions(key: bytes, rows: int, dim: int) -> torch.Tensor:
    """``rows`` unit vectors of dimension ``dim``, uniformly distributed on the sphere, float32
    on the CPU: normalized standard Gaussians (Box-Muller in float32, from 24-bit uniforms of
    an AES-256-CTR stream keyed by ``key``); the same key gives the same rows. (A 24-bit
    uniform caps a pair's radius at 5.9, whose tail beyond holds a mass of 2^-25 = 3e-8: the
    rows stay isotropic to far better than the audit can see.)"""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    stream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    pairs = (dim + 1) // 2
    out = torch.empty(rows, dim, dtype=torch.float32, device="cpu")
    for at in range(0, rows, _BLOCK):
        n = min(_BLOCK, rows - at)
        words = np.frombuffer(stream.update(bytes(8 * pairs * n)), dtype="<u4")
        # (k + 1/2) 2^-24 for the top 24 bits k: in (0, 1], never 0, so the log is finite
        u = ((words >> np.uint32(8)).astype(np.float32) + np.float32(0.5)) * np.float32(2**-24)
        u = u.reshape(n, 2 * pairs)
        radius = np.sqrt(np.float32(-2.0) * np.log(u[:, :pairs]))
        theta = np.float32(2.0 * math.pi) * u[:, pairs:]
        z = np.concatenate([radius * np.cos(theta), radius * np.sin(theta)], axis=1)[:, :dim]
        z /= np.linalg.norm(z.astype(np.float64), axis=1, keepdims=True).astype(np.float32)
        out[at : at + n] = torch.from_numpy(z)
    return out


def canaries_per_round(count: int, num_clients: int, per_round: int) -> int:
    """``m_c = ⌊k m / N⌋``: the canaries inserted per round, at a ratio ``m_c / k`` never above
    the real clients' ``m / N`` (k when every client takes part)."""
    if per_round >= num_clients:
        return count
    return (count * per_round) // num_clients


@dataclass
class Canaries:
    """The canary clients of one run (module docstring).

    Attributes:
        count: k, the canaries inserted (each sampled per round as described above).
        unseen: k', directions never inserted: the null of the all-iterates statistic.
        per_round: m_c, the canaries inserted per round.
        pairs: ``(upload key, global model key)`` of every uploaded tensor, sorted by upload
            key (:func:`upload_model_keys`): the d coordinates of the audit.
        start: ``θ_0`` over those tensors (float64, CPU).
        model_of: the global model of a server state (the method's ``global_arrays``).
        key: the directions' AES key (32 bytes of OS entropy; restored on resume).
    """

    count: int
    unseen: int
    per_round: int
    pairs: list[tuple[str, str]]
    start: torch.Tensor
    model_of: Callable[[State], Arrays]
    key: bytes = field(default_factory=lambda: os.urandom(32))
    vectors: torch.Tensor = field(init=False, repr=False)
    inverse_norms: torch.Tensor = field(init=False, repr=False)
    previous: torch.Tensor = field(init=False, repr=False)
    best: torch.Tensor = field(init=False, repr=False)
    rounds: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.count < 2:
            raise ValueError(f"the audit needs at least 2 canaries, got {self.count}")
        if self.unseen == 1 or self.unseen < 0:
            raise ValueError(f"unseen canaries: 0, or at least 2 for a fit; got {self.unseen}")
        if not 1 <= self.per_round <= self.count:
            raise ValueError(
                f"{self.per_round} canaries per round of {self.count}: need 1 to {self.count}"
            )
        entries = (self.count + self.unseen) * self.dimension
        if entries > MAX_DIRECTION_ENTRIES:
            raise ValueError(
                f"{self.count} + {self.unseen} canaries of dimension {self.dimension} are "
                f"{entries:,} direction entries, above the {MAX_DIRECTION_ENTRIES:,} (1 GiB) "
                "kept in memory; use fewer canaries or unseen canaries"
            )
        self._make_vectors()
        self.previous = self.start.clone()
        self.best = torch.full(
            (self.count + self.unseen,), -math.inf, dtype=torch.float64, device="cpu"
        )

    def _make_vectors(self) -> None:
        """The directions of :attr:`key` and the inverses of their float64 norms (the float32
        rows are unit vectors up to rounding; each canary's upload uses its exact norm)."""
        self.vectors = directions(self.key, self.count + self.unseen, self.dimension)
        self.inverse_norms = 1.0 / self.vectors.double().norm(dim=1)

    @property
    def dimension(self) -> int:
        """d: the number of uploaded coordinates."""
        return int(self.start.numel())

    @property
    def rate(self) -> float:
        """A canary's chance of being inserted in a round, ``m_c / k``."""
        return self.per_round / self.count

    def flat(self, model: Arrays) -> torch.Tensor:
        """The uploaded tensors of a global model in upload order (:func:`flat_model`)."""
        return flat_model(model, self.pairs)

    def cosines(self, vector: torch.Tensor) -> torch.Tensor:
        """The cosine of every direction (inserted first, then unseen) with ``vector``
        (float64; NaN for a zero vector). The products are float32 (relative error about
        1e-7 √d of the vector's norm, far below the null's 1/√d)."""
        v = vector.to("cpu", torch.float64)
        dots = (self.vectors @ v.to(torch.float32)).double()
        return dots * self.inverse_norms / float(v.norm())

    def inject(self, total: torch.Tensor, clip_norm: float) -> list[int]:
        """Add this round's canaries to ``total`` (the flattened sum of the clipped uploads, in
        place, before the noise): ``m_c`` canaries drawn without replacement from OS entropy,
        each uploading ``C c_i`` (norm C, up to float32 rounding). Returns the canaries
        inserted (their indices)."""
        chosen = sorted(secrets.SystemRandom().sample(range(self.count), self.per_round))
        weights = torch.zeros(self.count, dtype=torch.float64, device="cpu")
        weights[chosen] = clip_norm * self.inverse_norms[chosen]
        total += (weights.to(torch.float32) @ self.vectors[: self.count]).double().to(total.device)
        return chosen

    def observe(self, state: State) -> None:
        """A round's new global model: the all-iterates statistic takes the cosine of each
        direction with the model's change this round (a round that did not move the model is
        skipped)."""
        now = self.flat(self.model_of(state))
        change = now - self.previous
        if float(change.norm()) > 0:
            self.best = torch.maximum(self.best, self.cosines(change))
            self.rounds += 1
        self.previous = now

    def record(self) -> Scalars:
        """What the server state keeps to resume the audit: the key, the per-canary maxima and
        the rounds they have seen."""
        best = base64.b64encode(self.best.numpy().astype("<f8").tobytes()).decode("ascii")
        return {KEY: self.key.hex(), BEST_KEY: best, ROUNDS_KEY: self.rounds}

    def restore(self, state: State) -> None:
        """Go on from a checkpoint's ``state``: the same directions (its key), the maxima so far
        and the model it holds as the last one seen.

        Raises:
            ValueError: when the state holds no canary key or a damaged audit record.
        """
        values = state.values
        if KEY not in values:
            raise ValueError(
                "the checkpoint holds no canary key (dp.audit): its canaries' directions are "
                "lost, so the audit cannot go on; start the run over without --resume"
            )
        try:
            key = bytes.fromhex(str(values[KEY]))
            best = np.frombuffer(base64.b64decode(str(values[BEST_KEY])), dtype="<f8")
            rounds = int(values[ROUNDS_KEY])
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"the checkpoint's canary audit record is damaged: {e}") from None
        if len(key) != 32 or best.size != self.count + self.unseen:
            raise ValueError(
                "the checkpoint's canary audit record does not match dp.audit (key of "
                f"{len(key)} bytes, {best.size} canaries for {self.count} + {self.unseen})"
            )
        if key != self.key:
            self.key = key
            self._make_vectors()
        self.best = torch.from_numpy(best.astype(np.float64))
        self.rounds = rounds
        self.previous = self.flat(self.model_of(state))

    def summary(self, delta: float) -> dict[str, Any]:
        """The audit's record for the run's ``summary.json`` (``dp_audit_*``): the final-model
        estimate against the exact null ``N(0, 1/d)``, the cosine statistics and, with unseen
        canaries, their own cosines and the all-iterates estimate; beside each estimate its
        confidence interval at :data:`~fedlore.privacy.empirical_error.LEVEL`
        (``*_low``, ``*_high``: :func:`~fedlore.privacy.empirical_error.epsilon_interval`). No
        estimate when the model never moved."""
        k = self.count
        out: dict[str, Any] = {
            "dp_audit_canaries": k,
            "dp_audit_unseen": self.unseen,
            "dp_audit_canaries_per_round": self.per_round,
            "dp_audit_dimension": self.dimension,
            "dp_audit_null_std": null_std(self.dimension),
        }
        change = self.previous - self.start
        if not float(change.norm()) > 0:
            return out
        cos = self.cosines(change)
        seen = fit(cos[:k].numpy())
        null = Fit(0.0, null_std(self.dimension), self.dimension)
        out["dp_audit_epsilon"] = estimate_epsilon(seen, null, delta)
        out["dp_audit_level"] = LEVEL
        low, high = _interval(seen, null, delta, exact=True)
        out["dp_audit_epsilon_low"], out["dp_audit_epsilon_high"] = low, high
        out["dp_audit_cosine_mean"] = seen.mean
        out["dp_audit_cosine_std"] = seen.std
        if self.unseen:
            unseen = fit(cos[k:].numpy())
            out["dp_audit_unseen_cosine_mean"] = unseen.mean
            out["dp_audit_unseen_cosine_std"] = unseen.std
        if self.unseen and self.rounds:
            best, best_null = fit(self.best[:k].numpy()), fit(self.best[k:].numpy())
            out["dp_audit_epsilon_all_iterates"] = estimate_epsilon(best, best_null, delta)
            low, high = _interval(best, best_null, delta)
            out["dp_audit_epsilon_all_iterates_low"] = low
            out["dp_audit_epsilon_all_iterates_high"] = high
            out["dp_audit_max_cosine_mean"] = best.mean
            out["dp_audit_max_cosine_std"] = best.std
            out["dp_audit_unseen_max_cosine_mean"] = best_null.mean
            out["dp_audit_unseen_max_cosine_std"] = best_null.std
        return out


def _interval(seen: Fit, null: Fit, delta: float, exact: bool = False) -> tuple[float, float]:
    """The estimate's interval (both ends ``inf`` when the seen canaries' cosines do not vary:
    every canary told apart, and the estimate is ``inf``)."""
    if not seen.std > 0:
        return math.inf, math.inf
    found = epsilon_interval(seen, null, delta, null_exact=exact)
    return found.low, found.high
