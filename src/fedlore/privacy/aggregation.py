"""Secure aggregation and central DP around a sum-aggregable method's round.

A method is sum-aggregable (:attr:`fedlore.algorithms.base.Hyper.sum_aggregable`) when its
server needs only ``Σ p_i x_i`` and ``Σ p_i`` of the uploads ``x_i`` (all reply arrays,
flattened in sorted key order into one vector of length L). Its ``aggregate`` then gives the same
result whether it sees every upload or, for each contributing client, the weighted mean
``x̄ = Σ p_i x_i / Σ p_i`` itself with weight 1: that is what :class:`Privacy` hands it.

Client side (:func:`privatize`, run right after ``client_update`` by the transports):

1. DP: clip the upload to ``dp.clip_norm`` (:func:`~fedlore.privacy.dp.clip_upload`).
2. Secure aggregation: add the client's DP noise share ``N(0, σ²C²/m)`` (m = sampled clients),
   form ``v_i = [p_i x_i, p_i, clipped]`` (L + 2 entries: the weight and the clip flag travel
   inside the masked sum), encode in fixed point and add the pairwise masks
   (:mod:`fedlore.privacy.secagg`); the reply is one int64 array ``secagg.masked``.
   DP without secure aggregation: the clipped arrays themselves, with the clip flag.
3. The reply's metrics keep only :data:`CLEAR_METRICS` (timings and memory, which the round log
   needs and which say nothing about the data), ``num_examples`` becomes 1 (the weight is in the
   sum): training losses and P-local scores of single clients are not released.

Server side (:meth:`Privacy.combine`): sum the masked uploads and remove the masks shared with
dropped clients from the survivors' revealed seeds, or (DP only) sum the clipped uploads after
checking each norm; add the DP noise the sum lacks (all of ``N(0, σ²C²)`` without secure
aggregation; with it, the shares of clients that dropped out); divide by the contributors'
weight; report ``dp_epsilon`` (the accountant's ε at ``dp.delta`` after this exchange),
``dp_clipped`` (clients whose upload was clipped) and ``secagg_dropped``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedlore.privacy import secagg
from fedlore.privacy.dp import DPSettings, clip_upload, epsilon_spent, upload_norm
from fedlore.seeding import DP_NOISE, SECAGG, derive_seed, generator
from fedlore.types import Arrays, Broadcast, Reply, Scalars

ReplySpec = dict[str, tuple[tuple[int, ...], torch.dtype]]

CLEAR_METRICS = ("train_s", "optimizer_state_bytes", "basis_bytes", "peak_memory_bytes")
"""Reply metrics that travel in the clear under secure aggregation or DP."""
MASKED = "secagg.masked"
"""The one array of a masked reply: int64, L + 2 entries."""
CONFIG_PREFIX = "privacy."


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


def pair_secret(seed: int) -> int:
    """The in-process clients' secret behind their pair seeds (see :mod:`fedlore.privacy.secagg`:
    a deployment agrees them by key exchange instead)."""
    return derive_seed(seed, SECAGG, -1)


@dataclass(frozen=True)
class Contribution:
    """What a client adds to the round's secure sum.

    Attributes:
        vector: float64, L + 1 entries on the CPU: the (clipped, DP-noised) upload vector in
            sorted key order, then the 0/1 clip flag. Not yet weighted.
        weight: p_i (1.0 under uniform weighting, else the client's training-set size).
        metrics: the reply metrics that travel in the clear.
    """

    vector: torch.Tensor
    weight: float
    metrics: Scalars


def client_contribution(
    reply: Reply, config: Scalars, client_id: int, rnd: int, seed: int
) -> Contribution:
    """Client side: clip (DP), add the client's noise share (DP with secure aggregation) and
    flatten (see the module docstring).

    Args:
        config: the broadcast's config (``privacy.*`` keys from :meth:`Privacy.configure`).
        seed: the run seed (the noise share draws from ``(seed, DP_NOISE, round, client)``).

    Raises:
        ValueError: for non-finite upload arrays (nothing is sent) or no ``privacy.`` config.
    """
    if "privacy.secure" not in config:
        raise ValueError("the broadcast carries no privacy settings (privacy.*)")
    arrays = {k: v for k, v in reply.arrays.items()}
    clip = float(config.get("privacy.clip_norm", 0.0))
    clipped = False
    if clip > 0:
        arrays, clipped = clip_upload(arrays, clip, float(config["privacy.sketch_share"]))
    vec = flatten(arrays).cpu()
    if not bool(torch.isfinite(vec).all()):
        raise ValueError("the upload contains NaN or Inf; nothing is sent")
    share = float(config.get("privacy.noise_share", 0.0))
    if share > 0:
        g = generator(seed, DP_NOISE, rnd, client_id)
        vec = vec + share * torch.randn(vec.numel(), generator=g, dtype=torch.float64)
    flag = torch.tensor([1.0 if clipped else 0.0], dtype=torch.float64)
    weight = 1.0 if config.get("privacy.uniform", True) else float(reply.num_examples)
    metrics = {k: reply.metrics[k] for k in CLEAR_METRICS if k in reply.metrics}
    return Contribution(torch.cat([vec, flag]), weight, metrics)


def privatize(reply: Reply, config: Scalars, client_id: int, rnd: int, seed: int) -> Reply:
    """Client side of the in-process modes: the reply a client sends under the broadcast's
    ``privacy.*`` settings (the reply unchanged when there are none).

    Secure aggregation: ``{secagg.masked: int64 (L + 2,)}``, the masked fixed-point encoding of
    ``[p_i x_i, p_i, clipped]``; DP alone: the clipped arrays (their own dtypes) and the metric
    ``dp_clipped``. Metrics: :data:`CLEAR_METRICS` and ``num_examples = 1``.

    Raises:
        ValueError: for non-finite uploads or entries too large for fixed point.
    """
    if "privacy.secure" not in config:
        return reply
    if not config["privacy.secure"]:  # DP alone: the server sees the clipped upload
        clip = float(config["privacy.clip_norm"])
        arrays, clipped = clip_upload(
            dict(reply.arrays), clip, float(config["privacy.sketch_share"])
        )
        metrics = {k: reply.metrics[k] for k in CLEAR_METRICS if k in reply.metrics}
        return Reply(arrays, {**metrics, "num_examples": 1, "dp_clipped": int(clipped)})
    c = client_contribution(reply, config, client_id, rnd, seed)
    weighted = torch.cat(
        [c.vector[:-1] * c.weight, torch.tensor([c.weight], dtype=torch.float64), c.vector[-1:]]
    )
    peers = [int(p) for p in str(config["privacy.peers"]).split(",") if p]
    masked = secagg.mask(secagg.encode(weighted), client_id, peers, rnd, pair_secret(seed))
    arr = torch.from_numpy(masked.view(np.int64).copy())
    return Reply({MASKED: arr}, {**c.metrics, "num_examples": 1})


@dataclass(frozen=True)
class Privacy:
    """The server's side of a round under secure aggregation and/or central DP.

    Attributes:
        secure: secure aggregation on.
        dp: the DP mechanism (None: off).
        uniform: p_i = 1 (``weighting: uniform``; required by DP), else p_i = n_i.
        num_clients: N. per_round: m, clients sampled per round.
        setup_rounds: exchanges before round 0 (they read client data: counted by the
            accountant).
        seed: the run seed (the server's noise draws from ``(seed, DP_NOISE, round, -1)``;
            in process, the clients' pair secret, used server-side only through the survivors'
            :func:`~fedlore.privacy.secagg.reveal`).
        mask_degree: in-process mask partners per client: 0 = every other sampled client
            (SecAgg), k > 0 = a seeded ring graph of degree k (SecAgg+; see
            :func:`~fedlore.privacy.secagg.neighbours`).
    """

    secure: bool
    dp: DPSettings | None
    uniform: bool
    num_clients: int
    per_round: int
    setup_rounds: int
    seed: int
    mask_degree: int = 0

    def neighbours(self, rnd: int, sampled: list[int]) -> dict[int, list[int]]:
        """Each sampled client's mask partners in round ``rnd``
        (:func:`~fedlore.privacy.secagg.neighbours` with :attr:`mask_degree`)."""
        return secagg.neighbours(
            sorted(sampled), self.mask_degree, derive_seed(self.seed, SECAGG, rnd, -2)
        )

    def configure(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Broadcast]:
        """The round's broadcasts with the ``privacy.*`` settings each client needs (its peers
        for the pairwise masks, the clip norm, its noise share)."""
        partners = self.neighbours(rnd, list(messages))
        out = {}
        for c, m in messages.items():
            peers: Scalars = {"privacy.peers": ",".join(str(j) for j in partners[c])}
            out[c] = Broadcast(m.arrays, {**m.config, **self._settings(len(messages)), **peers})
        return out

    def _settings(self, sampled: int) -> Scalars:
        """The ``privacy.*`` settings every client of a round of ``sampled`` clients gets."""
        return {
            "privacy.secure": self.secure,
            "privacy.uniform": self.uniform,
            "privacy.clip_norm": self.dp.clip_norm if self.dp else 0.0,
            "privacy.sketch_share": self.dp.sketch_share if self.dp else 0.5,
            "privacy.noise_share": (
                self.dp.noise_std / math.sqrt(sampled) if self.dp and self.secure else 0.0
            ),
        }

    def expected(self, spec: ReplySpec) -> ReplySpec:
        """The spec of a valid reply: the masked vector under secure aggregation, else the
        method's own."""
        if self.secure:
            return {MASKED: ((spec_length(spec) + 2,), torch.int64)}
        return spec

    def screen(self, reply: Reply) -> str | None:
        """DP without secure aggregation: why a (shape-valid) reply is rejected, or None: its
        norm must be within the clip norm (a client that did not clip would break the bound)."""
        if self.secure or self.dp is None:
            return None
        norm = upload_norm(reply.arrays)
        if norm > self.dp.clip_norm * (1 + 1e-5):
            return f"upload norm {norm:.6g} exceeds dp.clip_norm {self.dp.clip_norm:g}"
        return None

    def epsilon(self, rnd: int) -> float:
        """ε at ``dp.delta`` after the exchange of round ``rnd`` (setup exchanges counted)."""
        assert self.dp is not None
        done = rnd + 1 + self.setup_rounds
        return epsilon_spent(
            self.dp.noise_multiplier, self.dp.delta, done, self.num_clients, self.per_round
        )

    def combine(
        self,
        rnd: int,
        spec: ReplySpec,
        accepted: Sequence[tuple[int, Reply | None]],
        device: torch.device,
    ) -> tuple[list[tuple[int, Reply | None]], Scalars]:
        """In-process modes: the replies the method aggregates (each contributor: the weighted
        mean upload with weight 1, on ``device``; dropped or rejected clients: None) and the
        round's privacy metrics, from the validated replies ``accepted`` (None: dropped).

        Raises:
            ValueError: if the unmasked weight sum is not positive (a broken round).
        """
        sampled = [c for c, _ in accepted]
        ok = {c: r for c, r in accepted if r is not None}
        length = spec_length(spec)
        if not ok:
            return self._finish(rnd, spec, None, 0.0, 0.0, {}, sampled, device)
        metrics: Scalars = {}
        if self.secure:
            masked = {c: r.arrays[MASKED].cpu().numpy().view(np.uint64) for c, r in ok.items()}
            dropped = [c for c in sampled if c not in ok]
            secret = pair_secret(self.seed)  # the survivors' answers (secagg.reveal)
            partners = self.neighbours(rnd, sampled)
            revealed = {
                c: secagg.reveal(c, [j for j in dropped if j in partners[c]], rnd, secret)
                for c in ok
            }
            total = secagg.decode(secagg.unmask_sum(masked, revealed))
            sum_x, sum_p, clipped = total[:length], float(total[length]), float(total[length + 1])
            metrics["secagg_dropped"] = len(dropped)
        else:
            sum_x = torch.zeros(length, dtype=torch.float64)
            for r in ok.values():
                sum_x += flatten(r.arrays).cpu()
            sum_p = float(len(ok))
            clipped = float(sum(int(r.metrics.get("dp_clipped", 0)) for r in ok.values()))
        clear = {c: r.metrics for c, r in ok.items()}
        out, more = self._finish(rnd, spec, sum_x, sum_p, clipped, clear, sampled, device)
        return out, {**metrics, **more}

    def from_mean(
        self,
        rnd: int,
        spec: ReplySpec,
        mean: torch.Tensor,
        clear: dict[int, Scalars],
        sampled: list[int],
        device: torch.device,
    ) -> tuple[list[tuple[int, Reply | None]], Scalars]:
        """A secure sum computed elsewhere (Flower's SecAgg+): ``mean`` (L + 1 entries) is
        ``Σ p_i v_i / Σ p_i`` over the contributors ``clear`` (client -> clear metrics) of the
        :class:`Contribution` vectors ``v_i``; the rest as :meth:`combine`."""
        length = spec_length(spec)
        if mean.numel() != length + 1:
            raise ValueError(f"secure mean has {mean.numel()} entries, expected {length + 1}")
        mean = mean.detach().to("cpu", torch.float64)
        k = float(len(clear))
        if self.dp is not None:  # uniform weights: Σ v_i = k * mean
            sum_x, sum_p, clipped = mean[:length] * k, k, float(mean[length]) * k
        else:
            sum_x, sum_p, clipped = mean[:length], 1.0, 0.0
        out, metrics = self._finish(rnd, spec, sum_x, sum_p, clipped, clear, sampled, device)
        metrics["secagg_dropped"] = len(sampled) - len(clear)
        return out, metrics

    def _finish(
        self,
        rnd: int,
        spec: ReplySpec,
        sum_x: torch.Tensor | None,
        sum_p: float,
        clipped: float,
        clear: dict[int, Scalars],
        sampled: list[int],
        device: torch.device,
    ) -> tuple[list[tuple[int, Reply | None]], Scalars]:
        """Add the DP noise the sum lacks, divide by the weight and build the replies."""
        metrics: Scalars = {}
        if self.dp is not None:
            metrics["dp_epsilon"] = self.epsilon(rnd)
        if sum_x is None or not clear:
            return [(c, None) for c in sampled], metrics
        if self.dp is not None:
            have = len(clear) / len(sampled) if self.secure else 0.0  # noise shares already in
            top_up = self.dp.noise_std * math.sqrt(max(1.0 - have, 0.0))
            if top_up > 0:
                g = generator(self.seed, DP_NOISE, rnd, -1)
                sum_x = sum_x + top_up * torch.randn(
                    sum_x.numel(), generator=g, dtype=torch.float64
                )
            sum_p = float(len(clear))  # uniform weights: the contributors
            metrics["dp_clipped"] = round(clipped)
        if not sum_p > 0:
            raise ValueError(f"round {rnd}: the unmasked weight sum is {sum_p}")
        mean = {k: v.to(device) for k, v in unflatten(sum_x / sum_p, spec).items()}
        out: list[tuple[int, Reply | None]] = []
        for c in sampled:
            if c not in clear:
                out.append((c, None))
                continue
            kept = {k: clear[c][k] for k in CLEAR_METRICS if k in clear[c]}
            out.append((c, Reply(mean, {**kept, "num_examples": 1})))
        return out, metrics
