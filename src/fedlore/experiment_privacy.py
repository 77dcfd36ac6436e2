"""The privacy of a run: the secure aggregation and DP a config asks for, made concrete.

:func:`make_privacy` turns the config's ``secure_aggregation`` and ``dp.*`` settings into the
run's :class:`~fedlore.privacy.Privacy` (solving the DP noise multiplier for ``dp.epsilon``, and
saying once what the mechanism is); :func:`client_sampler` draws each round's clients as the
mechanism needs; :func:`privacy_record` and :func:`privacy_summary` are what a run's
``config.json`` and ``summary.json`` record of it; :func:`make_canaries` the canary clients of
the empirical privacy audit (``dp.audit``), whose estimate the summary records beside ε.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedlore.algorithm import Algorithm
from fedlore.checks import check_secure_round, privacy_modes, setup_rounds
from fedlore.config import Config, ConfigError
from fedlore.engine.dp_ledger import released_after, repeated
from fedlore.engine.sampling import sample_clients
from fedlore.engine.unreliable import available_sampler
from fedlore.privacy import ClipNorm, DPSettings, Privacy, noise_for_epsilon, noise_source
from fedlore.privacy.canaries import (
    MAX_DIRECTION_ENTRIES,
    Canaries,
    canaries_per_round,
    flat_model,
    upload_model_keys,
)
from fedlore.privacy.dp import (
    ADJACENCY,
    default_clipped_count_stddev,
    epsilon_spent,
    update_noise_multiplier,
)
from fedlore.privacy.empirical_error import (
    LEVEL,
    MAX_ADVISED,
    canaries_for,
    false_alarm,
    sound_canary,
)
from fedlore.privacy.local_dp import local_noise_for_epsilon
from fedlore.progress import say_once, warn_once
from fedlore.types import State

NO_PRIVACY = (
    "no privacy: dp.reproducible_noise drew the DP noise and the client sample from the run seed"
)
"""The ``privacy`` entry of a summary whose DP noise anyone who knows the seed can regenerate."""


class PrivacyWarning(UserWarning):
    """A setting that weakens or removes a run's privacy: shown whether or not progress
    messages are (``progress: false`` silences those, never these)."""


class AuditWarning(UserWarning):
    """A canary audit (``dp.audit``) too small to tell a sound mechanism from a broken one:
    shown whether or not progress messages are."""


def _privacy_warning(message: str) -> None:
    warn_once(message, PrivacyWarning)  # each run of an experiment would repeat it


def dp_noise_multiplier(cfg: Config, setup: int) -> float:
    """σ of a DP run of ``cfg`` whose method runs ``setup`` setup exchanges:
    ``dp.noise_multiplier``, or solved from ``dp.epsilon`` for the run's exchanges and sampling
    (under ``dp.mode: local`` for a client in every exchange, without sampling:
    :mod:`fedlore.privacy.local_dp`). The accountant is fed this σ (the total z under adaptive
    clipping).

    Raises:
        ValueError: if ``dp.epsilon`` cannot be reached.
    """
    if cfg.dp.noise_multiplier is not None:
        return cfg.dp.noise_multiplier
    assert cfg.dp.epsilon is not None
    exchanges, accountant = cfg.rounds + setup, cfg.dp.accountant
    if cfg.asynchronous.enabled:  # DP-FedBuff: a client in every step, or in the cap's steps
        cap = cfg.dp.max_contributions
        exchanges = setup + (cfg.rounds if cap is None else min(cap, cfg.rounds))
    if cfg.dp.mode == "local" or cfg.asynchronous.enabled:  # a client in every exchange
        return local_noise_for_epsilon(
            cfg.dp.epsilon, cfg.dp.delta, exchanges, accountant=accountant
        )
    return noise_for_epsilon(
        cfg.dp.epsilon, cfg.dp.delta, exchanges, cfg.num_clients, cfg.clients_per_round(),
        accountant=accountant,
    )  # fmt: skip


def make_privacy(
    cfg: Config,
    algo: Algorithm,
    seed: int,
    max_weight: float | None = None,
    state: State | None = None,
) -> Privacy | None:
    """The run's :class:`~fedlore.privacy.Privacy` (None when neither secure aggregation nor DP
    is on). With ``dp.epsilon`` the noise multiplier is solved for the run's exchanges (its
    rounds plus the method's setup exchanges) and sampling; under ``dp.mode: local`` for a
    client in every exchange, without sampling (:mod:`fedlore.privacy.local_dp`).

    Args:
        max_weight: the largest client weight (training examples) under
            ``weighting: num_examples``; weights travel as p_i / max_weight in the secure sum.
        state: the server's first state: needed by the canary audit (``dp.audit.canaries``),
            whose canaries live in the method's upload space and whose θ_0 it holds.

    Raises:
        ValueError: if ``dp.epsilon`` cannot be reached; ConfigError when the secure round's
            thresholds or fixed point cannot hold for the config, or the canary audit cannot
            run with the method.
    """
    if not (cfg.secure_aggregation or cfg.dp.enabled):
        return None
    setup = setup_rounds(algo)
    per_round = cfg.clients_per_round()
    if cfg.asynchronous.enabled:  # DP-FedBuff: no sampling to amplify by (buffer_dp)
        per_round = cfg.num_clients
    local = cfg.dp.enabled and cfg.dp.mode == "local"
    dp = None
    if cfg.dp.enabled:
        assert cfg.dp.clip_norm is not None
        sigma = dp_noise_multiplier(cfg, setup)
        dp = DPSettings(
            cfg.dp.clip_norm, sigma, cfg.dp.delta, cfg.dp.sketch_share, cfg.dp.accountant
        )
        how = "solved from dp.epsilon" if cfg.dp.noise_multiplier is None else "dp.noise_multiplier"
        say_once(
            "DP: clip norm C = %g, noise multiplier σ = %.4g (%s) over %d exchanges of %d of %d "
            "clients, δ = %g",
            cfg.dp.clip_norm,
            sigma,
            how,
            cfg.rounds + setup,
            per_round,
            cfg.num_clients,
            cfg.dp.delta,
        )
        if local:
            say_once(
                "DP: local mode: each client adds noise of std σC = %g to every coordinate of its "
                "own upload, and ε is each client's over the exchanges it takes part in, "
                "without amplification by sampling%s",
                sigma * cfg.dp.clip_norm,
                " (with secure aggregation: inside its masked upload)"
                if cfg.secure_aggregation
                else "",
            )
        if cfg.asynchronous.enabled:
            say_once(
                "DP-FedBuff: each buffer of %d clipped, staleness-weighted uploads gets noise "
                "σC on its sum; a client is in a step at most once, and its ε composes the "
                "steps it is in, without amplification by sampling (dp_epsilon: the largest "
                "over the clients%s)",
                cfg.asynchronous.buffer,
                "" if cfg.dp.max_contributions is None
                else f"; at most {cfg.dp.max_contributions} steps a client",
            )  # fmt: skip
        if sigma == 0:
            _privacy_warning(
                "DP: dp.noise_multiplier = 0 adds no noise: ε is infinite (clipping only)"
            )
        if cfg.dp.delta >= 1.0 / cfg.num_clients:
            _privacy_warning(
                f"DP: dp.delta = {cfg.dp.delta:g} is not below 1/num_clients = "
                f"{1.0 / cfg.num_clients:g}: a mechanism that publishes one client's data outright "
                "would meet it"
            )
        if cfg.diagnostics.every > 0 or cfg.eval.clients:
            _privacy_warning(
                "DP: diagnostics.every / eval.clients read client data outside the mechanism "
                "(simulation measurements, not covered by ε)"
            )
    if cfg.eval.local:
        _privacy_warning(
            f"{privacy_modes(cfg)}: eval.local sends each client's P-local scores (its own model "
            "on its own test split, in the last round) to the server in the clear, beside its "
            "masked or noised upload: a measurement outside the mechanism, which neither secure "
            "aggregation nor ε covers (the rows keep only the pooled scores); drop eval.local "
            "where a single client's scores must stay private"
        )
    if cfg.dp.enabled and cfg.dp.reproducible_noise:
        _privacy_warning(
            "DP: dp.reproducible_noise=true draws the noise and the client sample from the run "
            "seed: anyone who knows it can remove the noise. This run has NO PRIVACY (debugging "
            "only); its summary and report row say so"
        )
    clip = None
    if dp is not None:
        clip = ClipNorm(dp.clip_norm)
        if cfg.dp.target_quantile is not None:
            sb = cfg.dp.clipped_count_stddev
            clip = ClipNorm(
                dp.clip_norm,
                cfg.dp.target_quantile,
                cfg.dp.clip_lr,
                default_clipped_count_stddev(per_round) if sb is None else sb,
            )
            try:
                z_update = update_noise_multiplier(dp.noise_multiplier, clip.count_stddev)
            except ValueError as e:
                raise ConfigError(f"dp.target_quantile: {e}") from e
            say_once(
                "DP: adaptive clipping (Andrew et al. 2021) towards the %g quantile of the upload "
                "norms from C = %g, clip_lr %g; the unclipped count gets noise %g, so the update "
                "gets noise multiplier %.4g (total, accounted: %.4g)",
                cfg.dp.target_quantile,
                dp.clip_norm,
                cfg.dp.clip_lr,
                clip.count_stddev,
                z_update,
                dp.noise_multiplier,
            )
    privacy = Privacy(
        cfg.secure_aggregation,
        dp,
        cfg.weighting == "uniform",
        cfg.num_clients,
        per_round,
        setup,
        seed,
        cfg.secure_aggregation_degree,
        threshold=cfg.secure_aggregation_threshold,
        colluders=cfg.dp.colluding_clients,
        entry_bound=cfg.secure_aggregation_range,
        max_weight=1.0 if cfg.weighting == "uniform" or max_weight is None else float(max_weight),
        noise=noise_source(cfg.dp.enabled and cfg.dp.reproducible_noise, seed),
        clip=clip,
        local=local,
        canaries=make_canaries(cfg, algo, state) if cfg.dp.audit.canaries else None,
    )
    if cfg.secure_aggregation:
        check_secure_round(cfg, privacy)
    if privacy.canaries is not None and dp is not None:
        c = privacy.canaries
        warn_few_canaries(cfg, c.rate, dp.noise_multiplier, setup, c.dimension)
    return privacy


@functools.lru_cache(maxsize=64)
def _advice(
    count: int, rounds: int, rate: float, sigma: float, claim: float, delta: float
) -> tuple[float, int]:
    shift, spread = sound_canary(rounds, rate, sigma)
    chance = false_alarm(shift, spread, count, claim, delta)
    if chance <= 0.5 * (1.0 - LEVEL):
        return chance, count
    return chance, canaries_for(shift, spread, claim, delta)


def warn_few_canaries(
    cfg: Config, rate: float, sigma: float, setup: int, dimension: int | None = None
) -> None:
    """An :class:`AuditWarning` when ``dp.audit.canaries`` is too few for the run: a sound
    mechanism's final-model estimate would land above the accountant's ε with a probability
    above the one-sided error of the estimate's interval, ``(1 − LEVEL) / 2`` = 2.5 %
    (:func:`~fedlore.privacy.empirical_error.false_alarm`, for the canary of a sound mechanism
    at the run's rounds, canary rate and σ: :func:`~fedlore.privacy.empirical_error.
    sound_canary`), naming the fewest canaries that bring it there
    (:func:`~fedlore.privacy.empirical_error.canaries_for`), or saying the audit cannot resolve
    the ε when that many would not fit in memory for a model of ``dimension`` coordinates
    (:data:`~fedlore.privacy.canaries.MAX_DIRECTION_ENTRIES`); with early stopping it says the
    count assumes every round runs."""
    k = cfg.dp.audit.canaries
    if sigma <= 0:
        return  # ε is infinite: nothing to land above (warned already)
    claim = epsilon_spent(
        sigma,
        cfg.dp.delta,
        cfg.rounds + setup,
        cfg.num_clients,
        cfg.clients_per_round(),
        accountant=cfg.dp.accountant,
    )
    if cfg.asynchronous.enabled:  # DP-FedBuff: the least ε the run can report (fedbuff_claim)
        claim = fedbuff_claim(cfg, sigma, setup)
    if not math.isfinite(claim):
        return
    chance, enough = _advice(k, cfg.rounds, rate, sigma, claim, cfg.dp.delta)
    if enough <= k:
        return
    more = f"at least {enough:,}" if enough <= MAX_ADVISED else f"more than {MAX_ADVISED:,}"
    rounds = f"{cfg.rounds} round{'s' * (cfg.rounds != 1)}"
    # the most canaries the audit keeps directions for in this model (``dimension`` entries
    # each; unseen ones as many as the canaries unless set)
    most = None
    if dimension is not None:
        rows, unseen = MAX_DIRECTION_ENTRIES // dimension, cfg.dp.audit.unseen
        most = rows // 2 if unseen is None else rows - unseen
    use = f"use {more} canaries to read ε̂ against ε"
    if most is not None and enough > most:
        use = (
            f"it would need {more}, more than the {max(most, 0):,} whose directions this "
            "model's size lets the audit hold in memory: it cannot resolve an ε this small "
            "on this model"
        )
    stops = (
        "; this assumes all its rounds run, and early stopping may stop sooner, which needs "
        "more canaries"
        if cfg.early_stopping.metric is not None
        else ""
    )
    accountant = "the accountant's ε"
    if cfg.asynchronous.enabled:
        accountant = "the least dp_epsilon this DP-FedBuff run can report"
    warn_once(
        f"dp.audit.canaries = {k:,} is too few for {rounds} at σ = {sigma:.4g}: a sound "
        f"mechanism's final-model ε̂ would land above {accountant} = "
        f"{claim:.3g} with probability {chance:.1%}, above the {0.5 * (1 - LEVEL):.1%} its "
        f"interval allows; {use} (the all-iterates estimate errs more){stops}",
        AuditWarning,
    )


def fedbuff_claim(cfg: Config, sigma: float, setup: int) -> float:
    """The smallest ``dp_epsilon`` a DP-FedBuff run of ``cfg`` can end with, the claim the
    few-canaries advice of :func:`warn_few_canaries` reads the estimate against: no sampling
    amplifies it (a buffer fills by speed), and it is the most-counted client's, who is in at
    least ⌈T·K / N⌉ of the T steps (T·K places over N clients; a cap allows that many).
    The canaries themselves are drawn per step from OS entropy, ⌊k·K / N⌋ of k, independent of
    the speeds (:func:`make_canaries`), which is the rate the advice's canary has."""
    k, n = int(cfg.asynchronous.buffer or 1), cfg.num_clients
    steps = -(-cfg.rounds * k // n)  # at most the cap: the config holds N·cap ≥ T·K
    return epsilon_spent(sigma, cfg.dp.delta, steps + setup, 1, 1, accountant=cfg.dp.accountant)


def make_canaries(cfg: Config, algo: Algorithm, state: State | None) -> Canaries:
    """The canary clients of ``dp.audit`` (:mod:`fedlore.privacy.canaries`) in the upload space
    of ``algo``, from its first server ``state``.

    Raises:
        ConfigError: when the method's uploads are not changes of its global model's tensors,
            or the directions would not fit in memory.
    """
    if state is None:
        raise ValueError("the canary audit needs the server's first state (make_privacy(state=))")
    audit = cfg.dp.audit
    model = algo.global_arrays(state)
    try:
        pairs = upload_model_keys(dict(algo.expected_reply(state, 0, 0)), model)
        real = cfg.clients_per_round()
        if cfg.asynchronous.enabled:  # DP-FedBuff: K of N clients a step
            real = int(cfg.asynchronous.buffer or 1)
        per_round = canaries_per_round(audit.canaries, cfg.num_clients, real)
        start = flat_model(model, pairs)  # θ_0
        canaries = Canaries(
            audit.canaries, audit.unseen_count, per_round, pairs, start, algo.global_arrays
        )
    except ValueError as e:
        method = getattr(algo, "name", type(algo).__name__)
        raise ConfigError(f"dp.audit.canaries with method {method!r}: {e}") from e
    say_once(
        "DP audit (Andrew et al. 2024): %d canary clients, %d per round (rate %.3g, the real "
        "clients' %d of %d), %d unseen, in %d upload coordinates; their uploads join the sum "
        "before the noise, not its count; the real clients and their ε are unchanged",
        audit.canaries,
        per_round,
        canaries.rate,
        real,
        cfg.num_clients,
        canaries.unseen,
        canaries.dimension,
    )
    return canaries


def client_sampler(cfg: Config, seed: int, privacy: Privacy | None) -> Callable[[int], list[int]]:
    """Round -> the sorted ids of its clients: from OS entropy under DP (amplification by
    subsampling assumes nobody can predict the sample; :meth:`Privacy.sample`), else seeded
    from ``(seed, round)`` (:func:`~fedlore.engine.sampling.sample_clients`)."""
    if privacy is not None and privacy.dp is not None:
        return privacy.sample
    trace = available_sampler(cfg, seed)  # clients.availability: who can be sampled when
    if trace is not None:
        return trace
    per_round = cfg.clients_per_round()
    return lambda rnd: sample_clients(cfg.num_clients, per_round, seed, rnd)


def privacy_record(privacy: Privacy | None) -> dict[str, Any]:
    """What a run's ``config.json`` records of its DP mechanism: the noise multiplier (solved
    from ``dp.epsilon`` or as set) and where the noise came from; empty without DP."""
    if privacy is None or privacy.dp is None:
        return {}
    return {
        "dp_noise_multiplier": privacy.dp.noise_multiplier,
        "dp_noise_source": "seed (no privacy)" if privacy.reproducible else "os",
    }


def warn_uncounted(privacy: Privacy | None, out: Path) -> None:
    """A :class:`PrivacyWarning` when a fresh DP run starts over an unfinished one in ``out``
    that released rounds (rows with ``dp_epsilon``, and the repeats of its DP ledger): the new
    run's ε starts from zero and does not count them, where ``--resume`` would have
    (:mod:`fedlore.engine.dp_ledger`). Those rows may have been seen (the file, a tracker)."""
    if privacy is None or privacy.dp is None:
        return
    try:
        n = released_after(out / "metrics.jsonl", None) + repeated(out)
        count = f"the {n} release(s)"
    except ValueError:  # a damaged ledger: the number is unknown, the warning is not
        n, count = -1, "an unknown number of releases"
    if n:
        _privacy_warning(
            f"DP: starting over discards {count} the unfinished run in {out} made, and this "
            "run's ε does not count them; if anyone may have seen them (its metrics.jsonl, a "
            "tracker), continue that run with --resume, whose ε does"
        )


def warn_over_target(cfg: Config, privacy: Privacy | None, run: str = "") -> bool:
    """A :class:`PrivacyWarning` when a resumed run will end above its ``dp.epsilon``: σ was
    solved for the run's exchanges, and the releases an interrupted attempt made and this
    resume runs again (the DP ledger, :attr:`~fedlore.privacy.aggregation.Privacy.repeated`)
    add to them. The run goes on (its rows and summary report the ε it reaches); the warning
    names that ε before any further release, so the user can stop it. Returns whether it
    warned (the ledger's count is then said: :func:`fedlore.engine.dp_ledger.say_repeats` is
    not called)."""
    target = cfg.dp.epsilon
    if privacy is None or privacy.dp is None or target is None or not privacy.repeated:
        return False
    final = privacy.epsilon(cfg.rounds - 1)
    if final > target:
        _privacy_warning(
            f"DP{f' ({run})' if run else ''}: {privacy.repeated} exchange(s) released before "
            f"this resume run again with fresh noise, so the run will end at ε = {final:.4g}, "
            f"above its target dp.epsilon = {target:g} (σ was solved for the exchanges without "
            "repeats)"
        )
        return True
    return False


def privacy_summary(privacy: Privacy | None) -> dict[str, Any]:
    """What a finished run's summary records of its DP mechanism, beside the ε its rows report:
    noise multiplier, clip norm (where it began, and under adaptive clipping where it ended),
    δ, adjacency, noise source, accountant and mode (``central`` or ``local``), and
    :data:`NO_PRIVACY` for noise drawn from the seed; empty without DP."""
    if privacy is None or privacy.dp is None:
        return {}
    out: dict[str, Any] = {
        "dp_noise_multiplier": privacy.dp.noise_multiplier,
        "dp_clip_norm": privacy.dp.clip_norm,
        "dp_delta": privacy.dp.delta,
        "dp_adjacency": ADJACENCY,
        "dp_noise_source": "seed" if privacy.reproducible else "os",
        "dp_accountant": privacy.dp.accountant,
        "dp_mode": "local" if privacy.local else "central",
    }
    if privacy.adaptive:  # where adaptive clipping left C (dp_clip_norm: where it began)
        out["dp_clip_norm_final"] = privacy.clip_norm
    if privacy.repeated:  # releases an interrupted attempt made and a resume ran again
        out["dp_repeated_exchanges"] = privacy.repeated
    if privacy.reproducible:
        out["privacy"] = NO_PRIVACY
    if privacy.canaries is not None:  # the empirical estimate, beside the accountant's ε
        out.update(privacy.canaries.summary(privacy.dp.delta))
    return out
