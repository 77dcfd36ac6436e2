"""User-level central differential privacy for sum-aggregated uploads (DP-FedAvg).

The mechanism of McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent
Language Models" (ICLR 2018), Algorithm 1 with the fixed clip: every sampled client clips its
whole upload vector ``x_i`` (all reply arrays, increments only: ``LocalTraining.upload_increments``)
to L2 norm ``C``; the server (or, under secure aggregation, the clients in shares) adds Gaussian
noise ``N(0, σ² C² I)`` to the sum ``Σ x_i``; the model moves by the noised sum divided by the
number of contributing clients (uniform weights, so one client moves the sum by at most ``C``).

The privacy spent is tracked by Google's ``dp-accounting`` under **replace-one-client
adjacency** (a federation of N clients; neighbouring federations differ in one client's data),
for the sampling the run uses:

* full participation (every client every round): ``T`` compositions of the Gaussian mechanism;
* ``m`` of ``N`` clients drawn uniformly without replacement each round
  (:func:`fedlore.engine.sampling.sample_clients`): ``T`` compositions of
  ``SampledWithoutReplacementDpEvent(N, m, Gaussian)`` (Wang, Balle & Kasiviswanathan 2019),
  at each Rényi order no worse than the unsampled Gaussian (:func:`rdp_curve`).

``dp.accountant`` picks the accountant (:func:`epsilon_spent`): ``rdp`` (default; Mironov 2017,
at dp-accounting's default orders) or ``pld`` (privacy loss distributions: within about 1e-5 of
the exact value for full participation; under sampling, the smaller of the unsampled PLD and
the sampled RDP bound, since dp-accounting has no PLD for sampling without replacement).

Replacing one client's upload moves the sum by up to ``2C`` (both uploads lie in the C-ball), so
the Gaussian's multiplier relative to that sensitivity is ``σ / 2`` in both cases: what the RDP
events get (dp-accounting's PLD doubles the sensitivity itself under ``REPLACE_ONE`` and is given
σ: :func:`pld_event`). One relation
for every participation rate keeps ε comparable across them, and it keeps the number of
contributors public (N is fixed, and dropouts are treated as data-independent: a client
whose training goes non-finite and so refuses to send is the exception, listed in
docs/explanation/privacy.md as not covered), so dividing the noised sum by it is
post-processing. (Under
add/remove adjacency the count itself would change between neighbours and DP-FedAvg's fixed
denominator would be needed.)

``T`` counts every exchange that reads client data: the rounds and a method's setup exchange
(FedLore-Sketch's P^0 sketch).

Adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy, NeurIPS 2021) is offered as pure
functions: :func:`update_noise_multiplier` splits the noise multiplier between the update and
the noised count of unclipped clients so that the round costs exactly what plain DP-FedAvg with
the same multiplier costs (the accountant is fed the total, unchanged), and
:func:`next_clip_norm` is the geometric clip update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from fedlore.types import Arrays

SKETCH_PREFIX = "sketch."
"""Reply arrays of this prefix (FedLore-Sketch's Y_i) get their own share of the clip budget."""


@dataclass(frozen=True)
class DPSettings:
    """The DP mechanism of a run.

    Attributes:
        clip_norm: C, the L2 bound on each client's whole upload vector.
        noise_multiplier: σ; the noise on the sum has standard deviation σ C per coordinate.
        delta: δ of the reported (ε, δ).
        sketch_share: s, the share of the squared budget C² given to the ``sketch.*`` arrays
            when a reply has both sketches and updates: the sketch is clipped to ``C √s`` and
            the rest to ``C √(1 − s)``, so the whole vector stays within ``C``. (One joint clip
            would let the gradient sketch, orders of magnitude larger than the lr-weighted ΔZ,
            take the whole budget.)
        accountant: ``"rdp"`` or ``"pld"``, the accountant :func:`epsilon_spent` and
            :func:`noise_for_epsilon` use (config ``dp.accountant``).
    """

    clip_norm: float
    noise_multiplier: float
    delta: float
    sketch_share: float = 0.5
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        if not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise ValueError(f"dp.clip_norm must be a positive number, got {self.clip_norm!r}")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"dp.noise_multiplier must be >= 0, got {self.noise_multiplier!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"dp.delta must be in (0, 1), got {self.delta!r}")
        if not 0 < self.sketch_share < 1:
            raise ValueError(f"dp.sketch_share must be in (0, 1), got {self.sketch_share!r}")
        check_accountant(self.accountant)

    @property
    def noise_std(self) -> float:
        """σ C: the standard deviation of the noise on each coordinate of the sum."""
        return self.noise_multiplier * self.clip_norm


def clip_upload(arrays: Arrays, clip_norm: float, sketch_share: float) -> tuple[Arrays, bool]:
    """``arrays`` scaled so their joint L2 norm (over every tensor, computed in float64) is at
    most ``clip_norm``: ``x · min(1, C / ‖x‖)`` (McMahan et al. 2018, Algorithm 1, ClipFn).
    When both ``sketch.*`` and other arrays are present, each part is clipped on its own to
    ``C √s`` and ``C √(1 − s)`` (s = ``sketch_share``), which bounds the whole by ``C``.

    Returns:
        (clipped arrays in their own dtypes, whether any part was scaled down).

    Raises:
        ValueError: if an array is not finite (a client must not mask or send it).
    """
    sketch = {k: v for k, v in arrays.items() if k.startswith(SKETCH_PREFIX)}
    rest = {k: v for k, v in arrays.items() if not k.startswith(SKETCH_PREFIX)}
    if sketch and rest:
        parts = [(sketch, clip_norm * math.sqrt(sketch_share))]
        parts.append((rest, clip_norm * math.sqrt(1.0 - sketch_share)))
    else:
        parts = [(arrays, clip_norm)]
    out: Arrays = {}
    clipped = False
    for part, bound in parts:
        norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in part.values()))
        if not math.isfinite(norm):
            bad = [k for k, v in part.items() if not bool(torch.isfinite(v).all())]
            raise ValueError(f"upload arrays {bad[:3]} contain NaN or Inf; nothing is sent")
        scale = 1.0 if norm <= bound else bound / norm
        clipped = clipped or scale < 1.0
        for k, v in part.items():
            out[k] = v if scale == 1.0 else (v.double() * scale).to(v.dtype)
    return {k: out[k] for k in arrays}, clipped


def upload_norm(arrays: Arrays) -> float:
    """The joint L2 norm of ``arrays`` (float64), the quantity :func:`clip_upload` bounds."""
    return math.sqrt(sum(float(v.double().pow(2).sum()) for v in arrays.values()))


ADJACENCY = "replace_one"
"""The neighbouring relation ε is reported under (recorded in each DP run's summary)."""

ACCOUNTANTS = ("rdp", "pld")
"""The accountants :func:`epsilon_spent` offers (config ``dp.accountant``; ``rdp`` by default)."""


def check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"dp.accountant must be one of {list(ACCOUNTANTS)}, got {accountant!r}")


def rdp_event(noise_multiplier: float, num_clients: int, per_round: int) -> Any:
    """The dp-accounting event of one exchange for the RDP accountant under ``REPLACE_ONE``:
    ``GaussianDpEvent(σ/2)`` (replacing one client moves the sum by up to 2C and the noise std
    is σC, so the multiplier relative to the sensitivity is σ/2), inside
    ``SampledWithoutReplacementDpEvent(N, m, ·)`` when ``m < N`` (Wang, Balle &
    Kasiviswanathan, AISTATS 2019, Theorem 27, whose noise multiplier is relative to the
    replace-one sensitivity: dp-accounting's ``_compute_rdp_sample_wor_gaussian``)."""
    import dp_accounting

    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2.0)  # sensitivity 2C
    if per_round >= num_clients:
        return gaussian
    return dp_accounting.SampledWithoutReplacementDpEvent(num_clients, per_round, gaussian)


def pld_event(noise_multiplier: float) -> Any:
    """The dp-accounting event of one (unsampled) exchange for the PLD accountant under
    ``REPLACE_ONE``: ``GaussianDpEvent(σ)``, **not** σ/2. dp-accounting's PLD treats the
    Gaussian's ``sensitivity`` (1 for a ``GaussianDpEvent``) as the radius of the ball each
    record lies in: for ``AdjacencyType.REPLACE`` it compares the noise centred at
    ``+sensitivity`` with the noise centred at ``-sensitivity`` (``privacy_loss_mechanism.
    AdditiveNoisePrivacyLoss``: "the privacy loss distribution for REPLACE adjacency
    corresponds to the same privacy loss distribution with twice the sensitivity"), so the
    2C of replacing one client is built in. Checked against the exact Gaussian-DP value
    (σ = 4, T = 10, δ = 1e-5: exact 7.5113; ``PLDAccountant(REPLACE_ONE)`` with
    ``GaussianDpEvent(4)``: 7.5113, with ``GaussianDpEvent(2)``: 17.86)."""
    import dp_accounting

    return dp_accounting.GaussianDpEvent(noise_multiplier)


@lru_cache(maxsize=256)
def rdp_curve(noise_multiplier: float, num_clients: int, per_round: int) -> tuple[Any, Any]:
    """``(orders, rdp)``: Rényi DP of **one** exchange at dp-accounting's default orders
    (``DEFAULT_RDP_ORDERS``, 1.1 to 1024), under replace-one adjacency (read-only arrays).

    Full participation: the Gaussian's curve ``α / (2 (σ/2)²)``. ``m < N``: at each order the
    smaller of the sampled curve (:func:`rdp_event`) and the unsampled Gaussian's. Both bound
    one round: the sample is drawn independently of the data, so a round's output is a mixture,
    with the same weights under both neighbours, of Gaussians whose means differ by at most 2C
    (or not at all when the replaced client is not sampled), and Rényi divergence is jointly
    quasi-convex (van Erven & Harremoës, IEEE Trans. Inf. Theory 2014); the minimum of two
    valid bounds at one order is valid. Wang et al.'s bound is loose as ``m → N``: 99 of 100
    clients at σ = 4 over 50 rounds gave ε = 47.5 against 22.2 for all 100 (issue 28, item 4).

    RDP composes additively at each order (Mironov 2017, Proposition 1), so ``T`` exchanges
    spend ``T · rdp``: computed once per (σ, N, m) and scaled for every round's ε.
    """
    import numpy as np
    from dp_accounting import NeighboringRelation, rdp

    def one_round(event: Any) -> tuple[Any, Any]:
        acc = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
        acc.compose(event)
        return acc.orders, acc.rdp

    orders, curve = one_round(rdp_event(noise_multiplier, num_clients, num_clients))
    if per_round < num_clients:
        _, sampled = one_round(rdp_event(noise_multiplier, num_clients, per_round))
        curve = np.fmin(curve, sampled)  # fmin: a NaN order falls back to the Gaussian's
    orders.setflags(write=False)
    curve.setflags(write=False)
    return orders, curve


def _rdp_epsilon(
    noise_multiplier: float, delta: float, rounds: int, num_clients: int, per_round: int
) -> float:
    from dp_accounting.rdp import rdp_privacy_accountant

    orders, curve = rdp_curve(noise_multiplier, num_clients, per_round)
    eps, _ = rdp_privacy_accountant.compute_epsilon(orders, rounds * curve, delta)
    return float(eps)


def _pld_epsilon(noise_multiplier: float, delta: float, rounds: int, interval: float) -> float:
    import dp_accounting
    from dp_accounting import pld

    acc = pld.PLDAccountant(
        dp_accounting.NeighboringRelation.REPLACE_ONE, value_discretization_interval=interval
    )
    acc.compose(pld_event(noise_multiplier), rounds)
    return float(acc.get_epsilon(delta))


PLD_RELATIVE_INTERVAL = 1e-3
"""The PLD accountant's discretization interval (``value_discretization_interval``) relative to
the unsampled Gaussian's RDP ε (floored at 0.1, so 1e-4, dp-accounting's default, for ε ≤ 0.1).
The discretization is pessimistic (ε is never understated); against the exact Gaussian-DP value
it overstates ε by under 2e-5 relative for ε from 0.06 to 80, at 10-20 ms a call, where the
fixed 1e-4 takes 0.1-4 s at large ε (σ = 2 over 51 rounds: 3.6 s)."""


@lru_cache(maxsize=4096)
def epsilon_spent(
    noise_multiplier: float,
    delta: float,
    rounds: int,
    num_clients: int,
    per_round: int,
    *,
    accountant: str = "rdp",
) -> float:
    """ε at ``delta`` after ``rounds`` exchanges of the mechanism (module docstring), under
    replace-one adjacency; ``inf`` for σ = 0, ``0`` for no exchange.

    * ``accountant="rdp"`` (default): dp-accounting's RDP bound at its default orders, from the
      per-round curve :func:`rdp_curve` scaled by ``rounds`` and converted with dp-accounting's
      ``rdp_privacy_accountant.compute_epsilon`` (Canonne, Kamath & Steinke 2020, Proposition
      12; Asoodeh et al. 2021).
    * ``accountant="pld"``: dp-accounting's PLD accountant (Meiser & Mohammadi 2018; Koskela et
      al. 2020; Doroshenko et al. 2022) on ``rounds`` exchanges of the unsampled Gaussian
      (:func:`pld_event`), which is within the discretization of the exact value (the
      composition of ``T`` Gaussians is the Gaussian of multiplier σ/√T: Dong, Roth & Su 2022,
      μ-GDP with μ = 2√T/σ). dp-accounting 0.6.0's ``PLDAccountant`` has no
      ``SampledWithoutReplacementDpEvent`` ("Unsupported event"), and its
      ``PoissonSampledDpEvent`` models Poisson sampling, which is not a bound for drawing a
      fixed m of N (the two can differ widely: Lebeda, Regehr, Kamath & Steinke, "Avoiding
      Pitfalls for Privacy Accounting of Subsampled Mechanisms under Composition", 2024).
      So for ``m < N`` the PLD counts each round
      as the unsampled Gaussian (a valid bound: :func:`rdp_curve`), and the reported ε is the
      smaller of that and the RDP bound (both are valid ε at the same δ). Near full
      participation the PLD value wins; at m ≪ N the RDP's amplification by sampling does.

    Args:
        noise_multiplier: σ (noise std σ C on the sum).
        delta: δ of the reported (ε, δ).
        rounds: exchanges that read client data so far (setup exchanges included).
        num_clients: N, the federation's clients.
        per_round: m, clients sampled per round (m >= N: full participation).
        accountant: ``"rdp"`` or ``"pld"`` (config ``dp.accountant``).

    Raises:
        ValueError: for an unknown ``accountant``.
    """
    check_accountant(accountant)
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    eps = _rdp_epsilon(noise_multiplier, delta, rounds, num_clients, per_round)
    if accountant == "pld":
        unsampled = _rdp_epsilon(noise_multiplier, delta, rounds, num_clients, num_clients)
        interval = PLD_RELATIVE_INTERVAL * max(unsampled, 0.1)
        eps = min(eps, _pld_epsilon(noise_multiplier, delta, rounds, interval))
    return eps


SIGMA_SEARCH_FLOOR = 1e-3
"""The smallest σ :func:`noise_for_epsilon` considers (as dp-accounting's calibration did)."""

SIGMA_SEARCH_RTOL = 1e-4
""":func:`noise_for_epsilon` stops when its bracket is this narrow relative to σ (σ is at most
this much above the smallest that meets the target)."""


@lru_cache(maxsize=256)
def noise_for_epsilon(
    epsilon: float,
    delta: float,
    rounds: int,
    num_clients: int,
    per_round: int,
    *,
    accountant: str = "rdp",
    whom: str | None = None,
) -> float:
    """The smallest σ whose ε (:func:`epsilon_spent` with this ``accountant``) after ``rounds``
    exchanges is at most ``epsilon`` at ``delta``, within a relative
    :data:`SIGMA_SEARCH_RTOL` (the σ returned always meets ``epsilon``); ``0`` for no exchange.
    ``whom`` says who takes part in the exchanges in the error (default: ``per_round`` of
    ``num_clients`` clients).

    ε decreases in σ: a bracket is widened by doubling from σ = 1 until it holds the target,
    then narrowed by regula falsi on (log σ, log ε), where ε is close to a power of σ, with the
    Illinois modification (Dowell & Jarratt 1971): about 5 evaluations where bisection needs 13
    (each evaluation at a new σ with sampling computes the RDP curve at dp-accounting's 156
    default orders, 0.3-0.8 s on one core). A tiny ε needs a huge σ: the run is refused above
    :data:`MAX_NOISE_MULTIPLIER`; a target met already at σ = :data:`SIGMA_SEARCH_FLOOR` gets
    that σ.

    Raises:
        ValueError: if ``epsilon`` is not positive, ``accountant`` is unknown, or the σ it needs
            exceeds :data:`MAX_NOISE_MULTIPLIER`.
    """
    check_accountant(accountant)
    if not epsilon > 0:
        raise ValueError(f"dp.epsilon must be positive, got {epsilon!r}")
    if rounds <= 0:
        return 0.0

    def excess(sigma: float) -> float:  # log ε(σ) − log target: near linear in log σ
        eps = epsilon_spent(sigma, delta, rounds, num_clients, per_round, accountant=accountant)
        return math.log(eps / epsilon) if eps > 0 else -math.inf

    lo, hi = 0.5, 1.0
    while excess(hi) > 0:
        if hi >= MAX_NOISE_MULTIPLIER:
            raise ValueError(
                f"dp.epsilon={epsilon} at dp.delta={delta} needs a noise multiplier above "
                f"{MAX_NOISE_MULTIPLIER:g} over {rounds} exchanges "
                f"{whom or f'of {per_round} of {num_clients} clients'}: noise that many times "
                "the clip norm on every "
                f"coordinate leaves no signal; raise dp.epsilon, or use fewer rounds"
            )
        lo, hi = hi, min(2.0 * hi, MAX_NOISE_MULTIPLIER)
    while excess(lo) <= 0:
        if lo <= SIGMA_SEARCH_FLOOR:
            return SIGMA_SEARCH_FLOOR
        lo, hi = max(lo / 2.0, SIGMA_SEARCH_FLOOR), lo
    # regula falsi on (log σ, log ε), Illinois variant; invariant: f(lo) > 0 >= f(hi)
    x_lo, x_hi = math.log(lo), math.log(hi)
    f_lo, f_hi = excess(lo), excess(hi)  # cached: no new evaluation
    stale = 0  # the end that stayed put last step (-1: lo, 1: hi)
    for _ in range(200):
        if x_hi - x_lo <= math.log1p(SIGMA_SEARCH_RTOL):
            break
        x = 0.5 * (x_lo + x_hi)
        if math.isfinite(f_lo) and math.isfinite(f_hi):
            secant = x_hi - f_hi * (x_hi - x_lo) / (f_hi - f_lo)
            if x_lo < secant < x_hi:
                x = secant
        sigma = math.exp(x)
        f_x = excess(sigma)
        if f_x > 0:
            x_lo, f_lo = x, f_x
            if stale == 1:
                f_hi /= 2.0  # Illinois: halve the value of the end kept twice in a row
            stale = 1
        else:
            x_hi, f_hi, hi = x, f_x, sigma
            if stale == -1:
                f_lo /= 2.0
            stale = -1
    return float(hi)  # a σ that was evaluated and meets the target


MAX_NOISE_MULTIPLIER = 1000.0
"""The largest σ :func:`noise_for_epsilon` returns: beyond it the mean of even 10^5 clients'
clipped uploads is buried under noise 10 C per coordinate."""


# Adaptive clipping: Andrew, Thakkar, McMahan & Ramaswamy, "Differentially Private Learning with
# Adaptive Clipping" (NeurIPS 2021, arXiv:1905.03871); Flower's
# DifferentialPrivacyServerSideAdaptiveClipping and TF Privacy's QuantileAdaptiveClipSumQuery.

DEFAULT_CLIP_LR = 0.2
"""η_C of the geometric clip update (Andrew et al.'s recommendation; Flower's default)."""


def default_clipped_count_stddev(per_round: int) -> float:
    """σ_b when ``dp.clipped_count_stddev`` is not given: ``m / 20`` for m clients per round
    (Andrew et al.'s recommendation; Flower's ``compute_adaptive_noise_params``)."""
    if per_round < 1:
        raise ValueError(f"clients per round must be at least 1, got {per_round!r}")
    return per_round / 20.0


def update_noise_multiplier(noise_multiplier: float, clipped_count_stddev: float) -> float:
    """z_Δ: the noise multiplier of the update sum under adaptive clipping, so that the round,
    which also releases the noised count of unclipped clients, spends exactly the privacy of
    plain DP-FedAvg with noise multiplier z = ``noise_multiplier`` (Andrew et al. 2021, the
    noise split of DP-FedAvg with adaptive clipping):

        z_Δ = (z⁻² − (2 σ_b)⁻²)^(−1/2).

    Derivation under fedlore's replace-one adjacency. A round releases the pair
    (Σ x_i + N(0, z_Δ² C² I), Σ b_i + N(0, σ_b²)), with ‖x_i‖ ≤ C and b_i ∈ {0, 1} (1 when
    client i's upload was not clipped). Divided by the noise stds, this is one Gaussian
    mechanism with unit noise on the vector (Σ x_i / (z_Δ C), Σ b_i / σ_b). Replacing one
    client moves the sum by up to 2C and the count by up to 1 (both at once: x_i = Cu unclipped,
    x_i' = −Cu clipped), so its L2 sensitivity is √((2/z_Δ)² + (1/σ_b)²). Plain DP-FedAvg's is
    2/z (sensitivity 2C, noise zC). They are equal exactly when 4 z_Δ⁻² + σ_b⁻² = 4 z⁻², the
    formula above; the paper's add/remove version (sensitivity C and, with b_i centred to
    ±1/2, 1/2) gives the same equation. The two releases are then one Gaussian of the same
    multiplier z/2 relative to its sensitivity as the accountant's ``GaussianDpEvent(z/2)``,
    also inside sampling (the mechanism of the sampled clients is the same), so the accountant
    is fed z, unchanged; z_Δ ≥ z is the (larger) noise put on the update. Centring b_i or
    dividing the count by the number of contributors is post-processing (that number is public
    under replace-one).

    Args:
        noise_multiplier: z, the total (what ``dp.noise_multiplier`` sets or ``dp.epsilon``
            solves); 0 gives 0 (no noise: ε is infinite anyway).
        clipped_count_stddev: σ_b, the std of the noise on the count Σ b_i.

    Raises:
        ValueError: if σ_b ≤ z / 2 (the count alone would spend the whole budget: z⁻² −
            (2σ_b)⁻² ≤ 0 has no root), or either value is negative or not finite.
    """
    z, sb = noise_multiplier, clipped_count_stddev
    if not (math.isfinite(z) and z >= 0):
        raise ValueError(f"dp.noise_multiplier must be >= 0, got {z!r}")
    if not (math.isfinite(sb) and sb > 0):
        raise ValueError(f"dp.clipped_count_stddev must be a positive number, got {sb!r}")
    if z == 0:
        return 0.0
    if sb <= z / 2.0:
        raise ValueError(
            f"dp.clipped_count_stddev = {sb:g} is too small for noise multiplier {z:g}: "
            f"adaptive clipping needs it above z/2 = {z / 2:g} (the noised count of unclipped "
            "clients would spend the whole privacy budget, z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) is "
            "undefined); raise dp.clipped_count_stddev (default: clients per round / 20) or "
            "lower the noise multiplier"
        )
    return float((z**-2 - (2.0 * sb) ** -2) ** -0.5)


def next_clip_norm(
    clip_norm: float,
    noised_count: float,
    contributors: int,
    target_quantile: float,
    clip_lr: float = DEFAULT_CLIP_LR,
) -> float:
    """The clip norm of the next round, by the geometric update of Andrew et al. 2021
    (Flower's ``DifferentialPrivacyServerSideAdaptiveClipping``):

        C ← C · exp(−η_C (b̃ − γ)),   b̃ = noised count / contributors,

    with b̃ the noised fraction of contributors whose upload was not clipped (norm ≤ C), γ the
    target quantile and η_C the clip learning rate. Too few unclipped (b̃ < γ) raises C; too
    many lowers it; b̃ = γ keeps it (the fixed point: C at the γ-quantile of the upload norms).
    b̃ is not clamped to [0, 1] (the noise on the count is unbiased), so one step changes C by
    a factor exp(η_C max(γ, 1 − γ)) at most when b̃ ∈ [0, 1]. With FedLore-Sketch's split clip,
    b_i = 1 when :func:`clip_upload` scaled neither part.

    Raises:
        ValueError: if ``clip_norm`` or ``clip_lr`` is not positive, ``target_quantile`` is
            not in (0, 1), ``contributors`` < 1, or ``noised_count`` is not finite.
    """
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip norm must be a positive number, got {clip_norm!r}")
    if not 0 < target_quantile < 1:
        raise ValueError(f"dp.target_quantile must be in (0, 1), got {target_quantile!r}")
    if not (math.isfinite(clip_lr) and clip_lr > 0):
        raise ValueError(f"dp.clip_lr must be a positive number, got {clip_lr!r}")
    if contributors < 1:
        raise ValueError(f"adaptive clipping needs at least 1 contributor, got {contributors!r}")
    if not math.isfinite(noised_count):
        raise ValueError(f"the noised count must be finite, got {noised_count!r}")
    fraction = noised_count / contributors
    return float(clip_norm * math.exp(-clip_lr * (fraction - target_quantile)))
