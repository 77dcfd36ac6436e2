"""User-level central DP over FedBuff's buffer (DP-FedBuff; :mod:`fedlore.engine.buffered`).

**Mechanism.** As the synchronous DP-FedAvg of :mod:`fedlore.privacy.dp` and
:meth:`~fedlore.privacy.aggregation.Privacy.combine`, with one server step in place of one
round:

1. every client clips its whole upload ``x_i`` to L2 norm ``C`` (``dp.clip_norm``; the broadcast
   carries the clip, :func:`~fedlore.privacy.client.privatize` applies it) and the server
   rejects an upload above ``C`` (:meth:`~fedlore.privacy.aggregation.Privacy.screen`);
2. the server scales each buffered upload's ``update.*`` arrays by its staleness weight
   ``w_i = w(s_i) ≤ 1`` (every weighting of :func:`~fedlore.engine.buffered.staleness_weight`
   is at most 1 for s ≥ 0; :func:`check_weight` refuses any other), so ``‖w_i x_i‖ ≤ C``: the
   weight can only shrink a contribution, and its L2 sensitivity stays ``C``;
3. it sums the K weighted uploads of the buffer, adds ``N(0, (σC)² I)`` to the **sum**, from the
   privacy randomness (:mod:`fedlore.privacy.randomness`: OS entropy; the run seed only under
   ``dp.reproducible_noise``, for round = the server version and client ``SERVER``, exactly the
   synchronous path's draw), and divides by the number of contributions, K (``asynchronous.
   buffer``; fixed: an upload rejected on arrival does not fill a place in the buffer);
4. the method (FedAvg, FedProx, FedFull with ``weighting: uniform``) steps from that noised mean.

**One contribution per client and step.** Under DP a client whose update waits in the buffer is
not started again before the step (:meth:`BufferDP.startable`), so no client is in one step
twice: per step a client moves the sum by at most ``C`` (``w ≤ 1``), and replacing one client's
data moves it by at most ``2C``. :meth:`BufferDP.combine` refuses a buffer naming a client
twice.

**Accounting** (replace-one adjacency, as the synchronous accountant). A buffer's members are
chosen by their speeds, not by a Poisson or fixed-size sample independent of everything else,
so no amplification by sampling is claimed. Given the schedule (who is in which step, with which
staleness: public, see below), each released global version is, for every client in its step,
the Gaussian mechanism of sensitivity ``2C`` and noise ``σC``: ``GaussianDpEvent(σ/2)``; the
versions compose adaptively, so a client in ``m`` steps spends the ``m``-fold composition
(:func:`contribution_epsilon`: :func:`~fedlore.privacy.dp.epsilon_spent` unsampled, by RDP or
PLD as ``dp.accountant`` says). A step the client is not in does not read its data. The run's
ε (``dp_epsilon`` of a row) is the largest over the clients of their ε at ``dp.delta``
(:meth:`BufferDP.epsilon`); releases that a resume repeats (the DP ledger) and setup exchanges
are counted for every client. ``dp.max_contributions`` caps the steps a client may be in: a
client at the cap is not started again, so ε is bounded in advance by the cap's ε. A cap whose
replayed schedule starves the run is refused before training
(:mod:`fedlore.engine.cap_schedule`), and ``--resume`` may raise it
(:mod:`fedlore.engine.resume_changes`): ε stays each client's over its counted steps.

**Threat model.** A trusted server (it sees the clipped uploads, adds the noise and keeps it
secret); the adversary sees every released global version (every row's model), the run's
logs and config. Not protected: *when* clients trained and *which* clients were in which step
(a row names them, with their staleness); the guarantee is conditional on that schedule, which
fedlore draws from the run seed and the clients' sizes and speeds, not from the contents of
their data. Nor is the data-dependent refusal of a client whose training went non-finite (as
under synchronous DP, :doc:`/explanation/privacy`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fedlore.privacy.aggregation import Privacy
from fedlore.privacy.client import ReplySpec, flatten, released_metrics, unflatten
from fedlore.privacy.dp import epsilon_spent
from fedlore.privacy.local_dp import Uploads
from fedlore.privacy.randomness import SERVER
from fedlore.types import Broadcast, Reply, Scalars, State

CONTRIBUTIONS_KEY = "privacy.contributions"
"""Server-state value under DP-FedBuff: each client's count of steps it contributed to, as
``client:count`` pairs (so a resumed run goes on counting from the killed one's)."""


def contribution_epsilon(
    noise_multiplier: float, delta: float, steps: int, *, accountant: str = "rdp"
) -> float:
    """ε at ``delta`` of a client in ``steps`` server steps of DP-FedBuff: ``steps``
    compositions of the unsampled Gaussian of sensitivity 2C and noise σC
    (:func:`~fedlore.privacy.dp.epsilon_spent` for one client of one; ``inf`` for σ = 0, ``0``
    for no step)."""
    return epsilon_spent(noise_multiplier, delta, steps, 1, 1, accountant=accountant)


def check_weight(w: float) -> None:
    """Refuse a staleness weight that could raise a contribution's sensitivity above C.

    Raises:
        ValueError: unless ``0 <= w <= 1``.
    """
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"DP-FedBuff needs staleness weights in [0, 1], got {w!r}")


@dataclass
class BufferDP:
    """The server's side of DP-FedBuff (module docstring).

    Attributes:
        privacy: the run's :class:`~fedlore.privacy.aggregation.Privacy` (central DP without
            secure aggregation): its clip norm, noise source, canaries, setup exchanges and
            the ledger's repeats.
        max_contributions: ``dp.max_contributions`` (None: no cap).
        counts: each client's steps so far (checkpointed in the server state).
    """

    privacy: Privacy
    max_contributions: int | None = None
    counts: Uploads = field(default_factory=Uploads)

    def __post_init__(self) -> None:
        p = self.privacy
        if p.dp is None or p.secure or p.local or p.adaptive:
            raise ValueError(
                "DP-FedBuff is central DP without secure aggregation, fixed clip, server noise"
            )

    def configure(self, version: int, messages: dict[int, Broadcast]) -> dict[int, Broadcast]:
        """The broadcasts with the ``privacy.*`` settings (the clip) the clients need."""
        return self.privacy.configure(version, messages)

    def screen(self, reply: Reply) -> str | None:
        """Why an upload is rejected (its norm above C), or None."""
        return self.privacy.screen(reply)

    def startable(self, cid: int, buffered: set[int]) -> bool:
        """Whether ``cid`` may start now: not in the step's buffer (once per step) and, with
        ``max_contributions``, below the cap."""
        if cid in buffered:
            return False
        cap = self.max_contributions
        return cap is None or self.counts.counts.get(cid, 0) < cap

    def spent(self, cid: int) -> int:
        """The exchanges counted for ``cid``: its steps, the setup exchanges and the repeats."""
        return self.counts.counts.get(cid, 0) + self.privacy.setup_rounds + self.privacy.repeated

    def epsilon(self) -> float:
        """The run's ε: the largest over the clients of each one's ε after its steps (0 before
        any); ε grows with the count, so it is the most-counted client's."""
        dp = self.privacy.dp
        assert dp is not None
        ids = self.counts.counts
        if not ids:
            return 0.0
        eps = (
            contribution_epsilon(dp.noise_multiplier, dp.delta, n, accountant=dp.accountant)
            for n in {self.spent(c) for c in ids}
        )
        return max(eps)

    def combine(
        self,
        version: int,
        spec: ReplySpec,
        buffer: Sequence[tuple[int, Reply, float]],
        device: torch.device,
    ) -> tuple[list[tuple[int, Reply | None]], Scalars]:
        """The replies the method aggregates (each contributor: the noised mean with weight 1)
        and the step's privacy metrics, from the step's clipped uploads and their staleness
        weights ``(client, reply, w)``: ``(Σ w_i x_i + N(0, (σC)² I)) / K`` in float64, the
        whole upload vector scaled by its ``w_i`` (FedBuff's methods upload ``update.*`` only).

        Raises:
            ValueError: when a client is in the buffer twice (its sensitivity would be 2C), or
                for a weight outside [0, 1].
        """
        ids = [c for c, _, _ in buffer]
        if len(set(ids)) != len(ids):
            raise ValueError(f"DP-FedBuff: a client contributes twice to step {version}: {ids}")
        self.counts.add(ids)
        p = self.privacy
        metrics: Scalars = {"dp_clip_norm": p.clip_norm}
        if buffer:
            total = torch.zeros(sum(math.prod(s) for s, _ in spec.values()), dtype=torch.float64)
            for _, r, w in buffer:
                check_weight(w)
                total += w * flatten(r.arrays).cpu()
            if p.canaries is not None:  # the audit's canaries: in the sum, not in its count
                p.canaries.inject(total, p.clip_norm)
            assert p.dp is not None
            total = total + p.noise.gaussian(total.numel(), p.dp.noise_std, version, SERVER)
            mean = {k: v.to(device) for k, v in unflatten(total / len(buffer), spec).items()}
            clipped = sum(int(r.metrics.get("dp_clipped", 0)) for _, r, _ in buffer)
            metrics["dp_clipped"] = clipped
        metrics["dp_epsilon"] = self.epsilon()
        metrics["dp_contributions_max"] = max(self.counts.counts.values(), default=0)
        out: list[tuple[int, Reply | None]] = [
            (c, Reply(mean, {**released_metrics(r.metrics), "num_examples": 1}))
            for c, r, _ in buffer
        ]
        return out, metrics

    def record(self, state: State) -> State:
        """``state`` with the counts (and the canary audit's record) in its values."""
        state = self.privacy.record(state)
        values = {**state.values, CONTRIBUTIONS_KEY: self.counts.encode()}
        return State(state.arrays, values)

    def restore(self, state: State) -> None:
        """Go on counting from a checkpoint's state (nothing to do in a fresh one)."""
        if CONTRIBUTIONS_KEY in state.values:
            self.counts.restore(str(state.values[CONTRIBUTIONS_KEY]))
