"""ε of several DP runs on the same clients' data, composed (``fedlore tune``'s search).

Each run is a number of exchanges of the mechanism of :mod:`fedlore.privacy.dp` at its own
(σ, N, m): its :class:`Exchanges`. Runs on the same data compose adaptively whatever their
settings, and Rényi DP composes additively at each order (Mironov 2017, Proposition 1), so the
runs together spend ``Σ_runs count × rdp_curve(σ, N, m)``, converted to ε once at δ:
:func:`composed_epsilon`, which is :func:`~fedlore.privacy.dp.epsilon_spent` for several parts
(the same per-exchange curves, :func:`~fedlore.privacy.dp.rdp_curve`; the same conversion,
dp-accounting's ``compute_epsilon``; under ``pld`` the same PLD of the unsampled Gaussians,
:func:`~fedlore.privacy.dp.pld_event`, and the smaller of the two). One part is exactly
``epsilon_spent``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fedlore.privacy.dp import PLD_RELATIVE_INTERVAL, check_accountant, pld_event, rdp_curve


@dataclass(frozen=True)
class Exchanges:
    """``count`` exchanges of the Gaussian mechanism of multiplier ``noise_multiplier`` (the
    total z under adaptive clipping, as a run's accountant is fed), with ``per_round`` of
    ``num_clients`` clients drawn each time (``per_round >= num_clients``: all of them)."""

    noise_multiplier: float
    num_clients: int
    per_round: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"a count of exchanges is >= 0, got {self.count!r}")

    def known(self) -> Exchanges:
        """The same exchanges against a party that knows who took part (no amplification)."""
        return Exchanges(self.noise_multiplier, self.num_clients, self.num_clients, self.count)


def composed_epsilon(parts: Iterable[Exchanges], delta: float, *, accountant: str = "rdp") -> float:
    """ε at ``delta`` of all ``parts`` composed, under replace-one adjacency; ``inf`` when a
    part with exchanges has σ = 0, ``0`` without any exchange.

    * ``rdp``: ``Σ count × rdp_curve(σ, N, m)`` at dp-accounting's default orders, converted
      with ``rdp_privacy_accountant.compute_epsilon``;
    * ``pld``: the smaller of that and dp-accounting's PLD accountant on every part's
      exchanges as the unsampled Gaussian (:func:`~fedlore.privacy.dp.pld_event`; counts of one
      σ composed at once, as :func:`~fedlore.privacy.dp.epsilon_spent` composes a run's), at
      the discretization :data:`~fedlore.privacy.dp.PLD_RELATIVE_INTERVAL` relative to the
      unsampled RDP ε.

    Raises:
        ValueError: for an unknown ``accountant``.
    """
    check_accountant(accountant)
    used = [p for p in parts if p.count > 0]
    if not used:
        return 0.0
    if any(p.noise_multiplier <= 0 for p in used):
        return math.inf
    eps = _rdp(used, delta)
    if accountant == "pld":
        interval = PLD_RELATIVE_INTERVAL * max(_rdp([p.known() for p in used], delta), 0.1)
        eps = min(eps, _pld(used, delta, interval))
    return eps


def _rdp(parts: Sequence[Exchanges], delta: float) -> float:
    from dp_accounting.rdp import rdp_privacy_accountant

    orders = total = None
    for p in parts:
        orders, curve = rdp_curve(p.noise_multiplier, p.num_clients, p.per_round)
        total = p.count * curve if total is None else total + p.count * curve
    eps, _ = rdp_privacy_accountant.compute_epsilon(orders, total, delta)
    return float(eps)


def _pld(parts: Sequence[Exchanges], delta: float, interval: float) -> float:
    import dp_accounting
    from dp_accounting import pld

    counts: dict[float, int] = {}
    for p in parts:  # sampling aside: the unsampled Gaussian of each σ, its counts together
        counts[p.noise_multiplier] = counts.get(p.noise_multiplier, 0) + p.count
    acc = pld.PLDAccountant(
        dp_accounting.NeighboringRelation.REPLACE_ONE, value_discretization_interval=interval
    )
    for sigma, count in sorted(counts.items()):
        acc.compose(pld_event(sigma), count)
    return float(acc.get_epsilon(delta))
