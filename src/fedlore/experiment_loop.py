"""How one run's rounds are driven, and what its summary says once they are done.

:func:`make_loop` builds the loop of a run (:func:`fedlore.experiment.run`): the synchronous
:class:`~fedlore.engine.loop.RoundLoop`, or FedBuff's
:class:`~fedlore.engine.buffered.BufferedLoop` under ``asynchronous.buffer`` (one round is one
server step), with the same callbacks, evaluation and early stopping. :func:`final_summary` is
the finished run's ``summary.json``: the rows' summary, early stopping's rounds, the held-out
test split, the privacy mechanism beside its ε, and a transport's own measurements.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedlore.config import Config, ConfigError
from fedlore.engine.buffered import AsyncState, BufferedLoop, buffered_loop
from fedlore.engine.early_stopping import EarlyStopping
from fedlore.engine.loop import Callback, RoundLoop
from fedlore.engine.simclock import sim_clock
from fedlore.engine.transport import Transport
from fedlore.experiment_parts import Experiment, make_diagnoser
from fedlore.experiment_privacy import client_sampler, privacy_summary
from fedlore.privacy import Privacy
from fedlore.privacy.buffer_dp import BufferDP
from fedlore.results.summary import read_metrics, summarize
from fedlore.types import State


def make_loop(
    exp: Experiment,
    clients: Transport,
    privacy: Privacy | None,
    evaluate: Callable[[State], dict[str, float]],
    callbacks: Sequence[Callback],
    stopper: EarlyStopping | None,
    progress: AsyncState | None,
    metrics: Path,
    last: int | None,
) -> RoundLoop | BufferedLoop:
    """The loop of ``exp`` over ``clients``: synchronous, or buffered when ``progress`` (the
    FedBuff state a checkpoint restores) is given.

    Args:
        privacy: the run's privacy as resumed (its ledger and clip norm carried on).
        evaluate: scores a server state (every ``eval.every`` rounds and after the last).
        callbacks: called after every round, in order.
        stopper: early stopping, whose ``stopped`` ends the loop before a round.
        metrics: the run's ``metrics.jsonl`` (the simulated clock resumes from its rows).
        last: the last round recorded (None for a fresh run).
    """
    cfg, algo, seed = exp.cfg, exp.algorithm, exp.seed
    stop = None if stopper is None else stopper.stopped
    if progress is not None:  # asynchronous.buffer: one round is one server step
        dp = None
        if privacy is not None and privacy.dp is not None:  # DP-FedBuff
            dp = BufferDP(privacy, cfg.dp.max_contributions)
        loop = buffered_loop(cfg, algo, clients, exp.fed.client, seed, progress,
                             evaluate=evaluate, eval_every=cfg.eval.every, callbacks=callbacks,
                             norm_screen=cfg.robust.norm_screen, stop=stop,
                             privacy=dp)  # fmt: skip
        return loop if cfg.asynchronous.clock == "simulated" else wall_clock(clients, loop)
    return RoundLoop(
        algo,
        clients,
        client_sampler(cfg, seed, privacy),
        evaluate,
        cfg.eval.every,
        callbacks,
        make_diagnoser(cfg, algo, exp.eval_model, exp.fed, seed),
        norm_screen=cfg.robust.norm_screen,
        privacy=privacy,
        stop=stop,
        clock=sim_clock(cfg, algo, exp.fed.client, seed, metrics, last, privacy),
    )


def wall_clock(clients: Transport, loop: BufferedLoop) -> BufferedLoop:
    """``loop`` on the wall clock (``asynchronous.clock: wall``): the Flower transport's own
    (:class:`fedlore.flower.wallclock.WallClockTransport`).

    Raises:
        ConfigError: for a transport without a real clock (in process).
    """
    make = getattr(clients, "wall_clock_loop", None)
    if make is None:
        raise ConfigError(
            f"asynchronous.clock=wall: the transport {type(clients).__name__} has no real "
            "clock to order the buffer (a Flower engine's has); use asynchronous.clock=simulated"
        )
    wall: BufferedLoop = make(loop)
    return wall


def final_summary(
    exp: Experiment,
    metrics: Path,
    stopper: EarlyStopping | None,
    privacy: Privacy | None,
    clients: Transport,
) -> dict[str, Any]:
    """The finished run's summary (module docstring): what ``summary.json`` holds."""
    cfg: Config = exp.cfg
    rows = read_metrics(metrics)  # once: the summary, the warning and the stopping rule's
    summary = summarize(exp.method, exp.seed, rows, cfg.eval.metrics)
    if not warn_no_update(exp, rows):
        warn_never_accepted(exp, rows)
    if stopper is not None:  # stopped_round, best_round; final_* of the best round
        stopper.finish(summary, rows, tuple(cfg.eval.metrics))
    if exp.fed.test_split is not None:  # no test split of its own: what was held out
        summary["data_test_split"] = exp.fed.test_split
    summary.update(privacy_summary(privacy))  # the mechanism, beside its ε
    if cfg.asynchronous.enabled and "dp_mode" in summary:  # DP-FedBuff's accounting
        summary["dp_accounting"] = "per-client steps, no amplification (max over clients)"
        if cfg.dp.max_contributions is not None:
            summary["dp_max_contributions"] = cfg.dp.max_contributions
    measured = getattr(clients, "summary_fields", None)  # a transport's own (Flower's bytes)
    if measured is not None:
        summary.update(measured())
    return summary


class NoUpdateWarning(UserWarning):
    """A finished run none of whose rounds aggregated a client's update."""


class NeverAcceptedWarning(UserWarning):
    """A finished run some of whose clients were asked in several rounds and never accepted."""


def warn_no_update(exp: Experiment, rows: list[dict[str, Any]]) -> bool:
    """Warn when no round of a finished run aggregated an update (every reply lost or
    rejected: a round deadline nobody meets, uploads the checks refuse): its model is the
    initial one, which its scores alone do not say. Names the first round's first reason.
    Returns whether it warned."""
    train = [r for r in rows if isinstance(r.get("round"), int) and r["round"] >= 0]
    if not train or any(r.get("accepted", 1) for r in train):
        return False
    reasons = [why for r in train for why in r.get("rejected_reasons", [])]
    first = f" (the first: {reasons[0]})" if reasons else ""
    warnings.warn(
        f"{exp.method} seed {exp.seed}: no round of {len(train)} aggregated a client update: "
        f"every reply was lost or rejected{first}; the model is the initial one",
        NoUpdateWarning,
        stacklevel=2,
    )
    return True


def warn_never_accepted(exp: Experiment, rows: list[dict[str, Any]]) -> None:
    """Warn about the clients of a finished run that were asked in two rounds or more and whose
    reply was rejected or lost every time (a site whose data does not match the server's, a
    client that never meets the round deadline): none of their data reached the model, which
    the run's scores do not say. Names each (up to five) with its first reason. Rows without
    client ids (DP that hides the sample: :func:`fedlore.engine.loop.hide_client_ids`) are not
    judged."""
    asked: dict[str, int] = {}
    first: dict[str, str] = {}
    accepted: set[str] = set()
    for row in rows:
        if not (isinstance(row.get("round"), int) and row["round"] >= 0):
            continue
        if "accepted_clients" not in row:
            continue
        accepted |= {str(c) for c in row["accepted_clients"]}
        for entry in row.get("rejected_reasons", []):
            cid, _, why = str(entry).partition(": ")
            asked[cid] = asked.get(cid, 0) + 1
            first.setdefault(cid, why)
    never = [c for c, n in asked.items() if n >= 2 and c not in accepted]
    if not never:
        return
    named = "; ".join(
        f"client {c}, rejected in {asked[c]} rounds (the first: {first[c]})" for c in never[:5]
    )
    more = f"; and {len(never) - 5} more" if len(never) > 5 else ""
    warnings.warn(
        f"{exp.method} seed {exp.seed}: {len(never)} client(s) asked in several rounds were "
        f"never accepted, so none of their data reached the model: {named}{more}",
        NeverAcceptedWarning,
        stacklevel=2,
    )
