"""The server's side of a round under secure aggregation and/or central DP (:class:`Privacy`).

A sum-aggregable method's ``aggregate`` gives the same result whether it sees every upload or,
for each contributing client, the weighted mean ``x̄ = Σ p_i x_i / Σ p_i`` with weight 1: that
is what :class:`Privacy` hands it, from a secure round's mean (:meth:`Privacy.from_mean`) or, DP
alone, from the clipped uploads it sums and noises itself (:meth:`Privacy.combine`). It reports
``dp_epsilon`` (the accountant's ε at ``dp.delta`` after this exchange), ``dp_clip_norm`` (the
round's C_t), ``dp_clipped`` (DP alone: the trusted curator's count of clipped uploads) and
``secagg_dropped``.

Noise: N(0, (z_Δ C_t)²) on the sum, from the server's secure source (DP alone) or from the
clients' shares of std ``z_Δ C_t / sqrt(m_min − c)`` (with secure aggregation: the honest
survivors of any completed round carry at least the whole). z_Δ = z for a fixed clip; with
adaptive clipping (Andrew et al. 2021; ``dp.target_quantile``) the round also releases the
count of unclipped clients with noise σ_b, z_Δ is raised so the pair spends exactly what
Gaussian(z) does (:func:`~fedlore.privacy.dp.update_noise_multiplier`), and the noised fraction
moves C for the next round (:func:`~fedlore.privacy.dp.next_clip_norm`). The accountant is fed
z either way.

Local DP (``local``; :mod:`fedlore.privacy.local_dp`): each client adds N(0, (σC)²) to its own
clipped upload (DP alone: :func:`~fedlore.privacy.client.privatize`; with secure aggregation its
noise share is the whole σC), the server adds none, and ``dp_epsilon`` is the largest ε over the
clients, from each one's count of exchanges (:class:`~fedlore.privacy.local_dp.Uploads`), without
amplification by sampling.

With ``dp.reproducible_noise: true`` every draw comes from the run seed instead
(:class:`~fedlore.privacy.randomness.SeededSource`): a debugging mode with no privacy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fedlore.privacy.canaries import Canaries
from fedlore.privacy.client import ReplySpec, flatten, released_metrics, spec_length, unflatten
from fedlore.privacy.dp import (
    DEFAULT_CLIP_LR,
    DPSettings,
    epsilon_spent,
    next_clip_norm,
    update_noise_multiplier,
    upload_norm,
)
from fedlore.privacy.fixedpoint import FixedPoint
from fedlore.privacy.local_dp import UPLOADS_KEY, Uploads, local_epsilon
from fedlore.privacy.plan import SecurePlan
from fedlore.privacy.randomness import SERVER, SERVER_COUNT, NoiseSource, SecureSource
from fedlore.privacy.secagg import RoundParams
from fedlore.privacy.topology import neighbours, threshold_count
from fedlore.seeding import SECAGG, derive_seed
from fedlore.types import Broadcast, Reply, Scalars, State

DEFAULT_THRESHOLD = 2 / 3
"""``secure_aggregation_threshold``'s default: two thirds of the round's clients must survive,
and two thirds of a client's share holders rebuild its secrets (the round tolerates a third
dropping out and t − 1 colluders)."""
DEFAULT_RANGE = 1000.0
"""``secure_aggregation_range``'s default: without DP, upload entries beyond ±1000 are clipped
(and counted) before fixed-point encoding."""
NOISE_TAIL = 12.0
"""Under DP the fixed-point bound is ``C + 12 s`` (s: the noise share's std): a share entry
lies beyond 12 standard deviations with probability 3.6e-33."""
CLIP_KEY = "privacy.clip_norm"
"""Server-state value under adaptive clipping: C of the coming round (so a resumed run goes on
with the clip norm the killed one had reached)."""


@dataclass
class ClipNorm:
    """The clip norm of the coming round: ``dp.clip_norm`` for good, or (``target_quantile``
    set) adapted after every round.

    Attributes:
        value: C_t. target_quantile: γ (None: fixed). clip_lr: η_C.
        count_stddev: σ_b, the noise std on the count of unclipped clients.
    """

    value: float
    target_quantile: float | None = None
    clip_lr: float = DEFAULT_CLIP_LR
    count_stddev: float = 0.0

    @property
    def adaptive(self) -> bool:
        return self.target_quantile is not None


@dataclass(frozen=True)
class Privacy:
    """The server's side of a round under secure aggregation and/or central DP.

    Attributes:
        secure: secure aggregation on.
        dp: the DP mechanism (None: off); its ``clip_norm`` is C_0.
        uniform: p_i = 1 (``weighting: uniform``; required by DP), else p_i = n_i.
        num_clients: N. per_round: m, clients sampled per round.
        setup_rounds: exchanges before round 0 (they read client data: counted by the
            accountant).
        seed: the run seed: it orders the SecAgg+ ring (public) and, only with
            ``reproducible`` noise, seeds the noise and the DP sample.
        mask_degree: in-process mask partners per client: 0 = every other sampled client
            (SecAgg), k > 0 = the SecAgg+ ring of degree k
            (:func:`~fedlore.privacy.topology.neighbours`).
        threshold: ``secure_aggregation_threshold``: the fewest survivors of a round and the
            shares that rebuild a secret, as a count or a fraction (of the sampled clients,
            resp. of a client's share holders).
        colluders: ``dp.colluding_clients``: clients whose noise shares may be known to the
            server; the others' shares alone reach the full noise.
        entry_bound: ``secure_aggregation_range`` (no DP): the fixed point's entry bound.
        max_weight: W, the largest client weight (1 under uniform weighting).
        noise: where DP noise and the DP client sample come from.
        clip: the clip norm schedule (None: fixed at ``dp.clip_norm``).
        repeated: DP exchanges released by an earlier attempt of this run and run again after a
            resume (:mod:`fedlore.engine.dp_ledger`): counted by the accountant on top of the
            rounds (under local DP, for every client: who took part in them is not known).
        local: ``dp.mode: local``: each client noises its own upload (needs ``dp``; no
            adaptive clipping, no colluders).
        uploads: under local DP, each client's count of exchanges.
        canaries: the canary clients of the empirical privacy audit (``dp.audit``; central DP
            without secure aggregation): :meth:`combine` adds them to the sum before the noise
            (not to its count), :meth:`record` shows them each new model
            (:mod:`fedlore.privacy.canaries`).
    """

    secure: bool
    dp: DPSettings | None
    uniform: bool
    num_clients: int
    per_round: int
    setup_rounds: int
    seed: int
    mask_degree: int = 0
    threshold: int | float = DEFAULT_THRESHOLD
    colluders: int = 0
    entry_bound: float = DEFAULT_RANGE
    max_weight: float = 1.0
    noise: NoiseSource = field(default_factory=SecureSource)
    clip: ClipNorm | None = None
    repeated: int = 0
    local: bool = False
    uploads: Uploads = field(default_factory=Uploads)
    canaries: Canaries | None = None

    def __post_init__(self) -> None:
        if self.clip is None and self.dp is not None:
            object.__setattr__(self, "clip", ClipNorm(self.dp.clip_norm))
        if self.local and self.dp is None:
            raise ValueError("local DP needs the DP mechanism (dp.clip_norm)")
        if self.local and (self.adaptive or self.colluders):
            raise ValueError("local DP takes neither adaptive clipping nor colluding clients")
        if self.canaries is not None and (self.dp is None or self.local or self.secure):
            raise ValueError("the canary audit needs central DP without secure aggregation")

    # ------------------------------------------------------------------ the round's mechanism

    @property
    def reproducible(self) -> bool:
        """True when the noise comes from the run seed (no privacy)."""
        return not self.noise.secure

    @property
    def hides_sample(self) -> bool:
        """Whether the round's rows must not name its clients: under DP with secure noise the
        sample is part of what amplification by subsampling keeps secret (the reported ε
        assumes that whoever sees the models and logs does not know who took part)."""
        return self.dp is not None and not self.reproducible

    @property
    def adaptive(self) -> bool:
        return self.clip is not None and self.clip.adaptive

    @property
    def clip_norm(self) -> float:
        """C_t, the clip norm of the coming round (0 without DP)."""
        return 0.0 if self.clip is None else self.clip.value

    @property
    def update_multiplier(self) -> float:
        """z_Δ: the noise multiplier on the upload sum (z for a fixed clip)."""
        assert self.dp is not None and self.clip is not None
        if not self.clip.adaptive:
            return self.dp.noise_multiplier
        return update_noise_multiplier(self.dp.noise_multiplier, self.clip.count_stddev)

    def sample(self, rnd: int) -> list[int]:
        """The DP client sample of round ``rnd`` (from :attr:`noise`: secret by default)."""
        return self.noise.sample(self.num_clients, self.per_round, rnd)

    def min_survivors(self, sampled: int) -> int:
        """m_min: the fewest clients a secure round of ``sampled`` clients completes with."""
        return min(sampled, threshold_count(self.threshold, sampled))

    def _honest(self, sampled: int) -> int:
        honest = self.min_survivors(sampled) - self.colluders
        if honest < 1:
            raise ValueError(
                f"dp.colluding_clients={self.colluders} leaves no honest survivor in a round "
                f"that completes with {self.min_survivors(sampled)} clients"
            )
        return honest

    def noise_share(self, sampled: int) -> float:
        """A client's noise std on its upload: under local DP its whole σC (with or without
        secure aggregation); under secure aggregation with central DP its share
        z_Δ C_t / sqrt(m_min − c); else 0."""
        if self.dp is not None and self.local:
            return self.dp.noise_multiplier * self.clip_norm
        if self.dp is None or not self.secure:
            return 0.0
        return self.update_multiplier * self.clip_norm / math.sqrt(self._honest(sampled))

    def count_share(self, sampled: int) -> float:
        """A client's noise-share std on its adaptive-clipping bit: σ_b / sqrt(m_min − c)."""
        assert self.clip is not None
        return self.clip.count_stddev / math.sqrt(self._honest(sampled))

    def entry_bound_of(self, sampled: int) -> float:
        """The largest upload entry a client of a round of ``sampled`` sends: C_t + 12 s under
        DP (its noise share's tail; the adaptive bit, 1 + 12 s_b, too), else
        ``secure_aggregation_range``."""
        if self.dp is None:
            return self.entry_bound
        bound = self.clip_norm + NOISE_TAIL * self.noise_share(sampled)
        if self.adaptive and self.secure:
            bound = max(bound, 1.0 + NOISE_TAIL * self.count_share(sampled))
        return bound

    # ------------------------------------------------------------------ configuring a round

    def neighbours(self, rnd: int, sampled: list[int]) -> dict[int, list[int]]:
        """Each sampled client's mask partners in round ``rnd``."""
        return neighbours(
            sorted(sampled), self.mask_degree, derive_seed(self.seed, SECAGG, rnd, -2)
        )

    def round_params(self, rnd: int, sampled: list[int]) -> RoundParams:
        """The protocol parameters of round ``rnd`` (see :mod:`fedlore.privacy.secagg`).

        Raises:
            ValueError: when the thresholds cannot hold for this round's clients.
        """
        graph = {c: tuple(v) for c, v in self.neighbours(rnd, sampled).items()}
        partners = min(len(v) for v in graph.values())
        if partners < 2:
            raise ValueError(
                f"a client of this round has {partners} mask partner(s): secure aggregation "
                "needs at least 2 (3 or more clients per round, secure_aggregation_degree 0 or "
                "at least 2), or its one partner alone could unmask it"
            )
        # t <= partners: t - 1 colluders never make up all of a client's partners; the round
        # withstands t - 1 of them (every survivor keeps t surviving partners)
        t = min(partners, threshold_count(self.threshold, partners + 1))
        return RoundParams(rnd, graph, t, self.min_survivors(len(sampled)), colluders=t - 1)

    def fixed_point(self, sampled: int) -> FixedPoint:
        """The fixed point of a round of ``sampled`` clients (weights p_i / W ≤ 1 keep w x
        within the entry bound)."""
        return FixedPoint.for_sum(max(self.entry_bound_of(sampled), 1.0), sampled)

    def plan(self, rnd: int, sampled: list[int], spec: ReplySpec) -> SecurePlan:
        """The :class:`~fedlore.privacy.plan.SecurePlan` of an in-process secure round."""
        return SecurePlan(
            self.round_params(rnd, sampled),
            self.fixed_point(len(sampled)),
            spec_length(spec),
            1 if self.adaptive else 0,
            self.dp is None,
            self.max_weight,
        )

    def configure(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Broadcast]:
        """The round's broadcasts with the ``privacy.*`` settings each client needs."""
        m = len(messages)
        settings: Scalars = {
            "privacy.secure": self.secure,
            "privacy.uniform": self.uniform,
            "privacy.clip_norm": self.clip_norm,
            "privacy.sketch_share": self.dp.sketch_share if self.dp else 0.5,
            "privacy.noise_share": self.noise_share(m),
            "privacy.reproducible": self.reproducible,
        }
        if self.adaptive and self.secure:
            settings["privacy.count_share"] = self.count_share(m)
        if self.local:
            settings["privacy.local"] = True
        return {c: Broadcast(b.arrays, {**b.config, **settings}) for c, b in messages.items()}

    def screen(self, reply: Reply) -> str | None:
        """Central DP without secure aggregation: why a (shape-valid) reply is rejected, or
        None: its norm must be within the round's clip norm (a client that did not clip would
        break the bound). Local DP's uploads carry their noise, so they are not screened."""
        if self.secure or self.dp is None or self.local:
            return None
        norm = upload_norm(reply.arrays)
        if norm > self.clip_norm * (1 + 1e-5):
            return f"upload norm {norm:.6g} exceeds the clip norm {self.clip_norm:g}"
        return None

    def epsilon(self, rnd: int, sample_known: bool = False) -> float:
        """ε at ``dp.delta`` after the exchange of round ``rnd`` (setup exchanges counted).

        Args:
            sample_known: ε against a party that knows which clients took part in each round
                (the server itself, which sends them the model): no amplification by
                subsampling, every round a full Gaussian release. Under local DP always so:
                the ε of a client in every exchange so far, the most any client can have spent
                (what ``dp.epsilon`` is solved for; :meth:`epsilon_metrics` reports the ε the
                clients did spend).
        """
        assert self.dp is not None
        done = rnd + 1 + self.setup_rounds + self.repeated
        return epsilon_spent(
            self.dp.noise_multiplier,
            self.dp.delta,
            done,
            self.num_clients,
            self.num_clients if sample_known or self.local else self.per_round,
            accountant=self.dp.accountant,
        )

    def epsilon_metrics(self, rnd: int) -> Scalars:
        """``dp_epsilon`` (against whoever sees the models and the logs, which do not name the
        sample) and, when clients are sampled, ``dp_epsilon_sample_known`` (against a party that
        knows the sample: the server, and under secure aggregation the server is who the
        noise protects against). Under local DP ``dp_epsilon`` alone: the largest ε over the
        clients, each one's from its own count of exchanges (:attr:`uploads`, plus the
        :attr:`repeated` ones), never amplified."""
        assert self.dp is not None
        if self.local:
            most = self.uploads.most() + self.repeated
            dp = self.dp
            return {"dp_epsilon": local_epsilon(dp.noise_multiplier, dp.delta, most,
                                                accountant=dp.accountant)}  # fmt: skip
        out: Scalars = {"dp_epsilon": self.epsilon(rnd)}
        if self.per_round < self.num_clients:
            out["dp_epsilon_sample_known"] = self.epsilon(rnd, sample_known=True)
        return out

    # ------------------------------------------------------------------ the round's result

    def combine(
        self,
        rnd: int,
        spec: ReplySpec,
        accepted: Sequence[tuple[int, Reply | None]],
        device: torch.device,
    ) -> tuple[list[tuple[int, Reply | None]], Scalars]:
        """DP without secure aggregation: the replies the method aggregates (each contributor:
        the noised mean upload with weight 1, on ``device``; dropped or rejected clients:
        None) and the round's privacy metrics, from the validated, clipped replies
        ``accepted`` (None: dropped). The noise comes from :attr:`noise`.

        Raises:
            ValueError: under secure aggregation (its sum comes from the transport).
        """
        if self.secure:
            raise ValueError("a secure round's sum comes from the transport's send_secure")
        sampled = [c for c, _ in accepted]
        self._count(sampled)
        ok = {c: r for c, r in accepted if r is not None}
        if not ok:
            return self._finish(rnd, spec, None, {}, sampled, device)
        total = torch.zeros(spec_length(spec), dtype=torch.float64, device="cpu")
        for r in ok.values():
            total += flatten(r.arrays).cpu()
        metrics: Scalars = {}
        count = None
        if self.dp is not None and not self.local:  # local DP: the uploads carry the noise
            if self.canaries is not None:  # the audit's canaries: in the sum, not in its count
                self.canaries.inject(total, self.clip_norm)
            std = self.update_multiplier * self.clip_norm
            total = total + self.noise.gaussian(total.numel(), std, rnd, SERVER)
            clipped = sum(int(r.metrics.get("dp_clipped", 0)) for r in ok.values())
            metrics["dp_clipped"] = clipped
            if self.adaptive:
                assert self.clip is not None
                noise = self.noise.gaussian(1, self.clip.count_stddev, rnd, SERVER_COUNT)
                count = (len(ok) - clipped) + float(noise[0])
        clear = {c: r.metrics for c, r in ok.items()}
        out, more = self._finish(rnd, spec, total / len(ok), clear, sampled, device, count)
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
        """A secure round's result (:class:`~fedlore.privacy.plan.SecureSum`): ``mean`` (L
        entries, and the noised adaptive-clipping bit after them) is ``Σ p_i v_i / Σ p_i`` over
        the contributors ``clear`` (client -> clear metrics); the clients' noise shares
        already carry the DP noise."""
        self._count(sampled)
        length = spec_length(spec)
        extras = 1 if self.adaptive else 0
        if mean.numel() != length + extras:
            raise ValueError(f"secure mean has {mean.numel()} entries, expected {length + extras}")
        mean = mean.detach().to("cpu", torch.float64)
        count = float(mean[length]) * len(clear) if extras else None  # uniform weights under DP
        out, metrics = self._finish(rnd, spec, mean[:length], clear, sampled, device, count)
        metrics["secagg_dropped"] = len(sampled) - len(clear)
        return out, metrics

    def _finish(
        self,
        rnd: int,
        spec: ReplySpec,
        mean: torch.Tensor | None,
        clear: dict[int, Scalars],
        sampled: list[int],
        device: torch.device,
        noised_count: float | None = None,
    ) -> tuple[list[tuple[int, Reply | None]], Scalars]:
        """The replies the method aggregates (the mean for each contributor), ε, and the
        adaptive clip norm's step from the noised count of unclipped contributors."""
        metrics: Scalars = {}
        if self.dp is not None:
            metrics.update(self.epsilon_metrics(rnd))
            metrics["dp_clip_norm"] = self.clip_norm
        if mean is None or not clear:
            return [(c, None) for c in sampled], metrics
        if noised_count is not None and self.clip is not None and self.clip.adaptive:
            assert self.clip.target_quantile is not None
            metrics["dp_unclipped_fraction"] = noised_count / len(clear)
            self.clip.value = next_clip_norm(
                self.clip.value,
                noised_count,
                len(clear),
                self.clip.target_quantile,
                self.clip.clip_lr,
            )
        arrays = {k: v.to(device) for k, v in unflatten(mean, spec).items()}
        out: list[tuple[int, Reply | None]] = []
        for c in sampled:
            if c not in clear:
                out.append((c, None))
                continue
            kept = released_metrics(clear[c])
            out.append((c, Reply(arrays, {**kept, "num_examples": 1})))
        return out, metrics

    def aborted(self, rnd: int, sampled: list[int]) -> Scalars:
        """The privacy metrics of a round whose secure aggregation was aborted (ε still
        counts the exchange: the clients computed on their data)."""
        self._count(sampled)
        metrics: Scalars = {"secagg_dropped": len(sampled), "secagg_aborted": 1}
        if self.dp is not None:
            metrics.update(self.epsilon_metrics(rnd))
            metrics["dp_clip_norm"] = self.clip_norm
        return metrics

    # ------------------------------------------------------------------ state across rounds

    def _count(self, sampled: list[int]) -> None:
        """Local DP: one more exchange for each client of the round (its noised upload may have
        left it, whether or not it arrived)."""
        if self.local:
            self.uploads.add(sampled)

    def record(self, state: State) -> State:
        """``state`` with the adaptive clip norm of the coming round, local DP's counts of
        exchanges or the canary audit's record in its values (checkpointed with it); ``state``
        itself otherwise."""
        values: Scalars = {}
        if self.adaptive:
            values[CLIP_KEY] = self.clip_norm
        if self.local:
            values[UPLOADS_KEY] = self.uploads.encode()
        if self.canaries is not None:  # the audit sees every model (all-iterates statistic)
            self.canaries.observe(state)
            values.update(self.canaries.record())
        if not values:
            return state
        return State(state.arrays, {**state.values, **values})

    def restore(self, state: State) -> None:
        """Go on from a checkpoint: the adaptive clip norm, the counts of exchanges or the
        canary audit :meth:`record` stored in ``state``."""
        if self.adaptive and CLIP_KEY in state.values:
            assert self.clip is not None
            self.clip.value = float(state.values[CLIP_KEY])
        if self.local and UPLOADS_KEY in state.values:
            self.uploads.restore(str(state.values[UPLOADS_KEY]))
        if self.canaries is not None:
            self.canaries.restore(state)
