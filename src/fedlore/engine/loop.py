"""THE round loop: sample -> broadcast -> transport.send -> validate -> aggregate -> callbacks.

``wall_s`` is the round's time (sampling, broadcast, client training, validation, aggregation)
without evaluation and diagnostics, which are timed separately as ``eval_s`` and ``diag_s``.

Communication is counted here, from the tensors actually in the messages: ``bytes_down`` sums
the broadcast arrays sent this round, ``bytes_up`` the reply arrays received (rejected ones
included: they crossed the wire). Scalars (round index, seeds) are not counted. Reply arrays
named ``diag.*`` exist only for diagnostics (FedLore's candidate gradients) and are counted as
``diag_bytes_up`` instead. Under in-process secure aggregation ``bytes_up`` counts every message
of the protocol the clients sent (public keys, encrypted shares, masked vectors, unmasking
answers) and ``bytes_down`` adds the protocol's messages to the clients (also recorded alone as
``secagg_bytes_down``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedlore.algorithm import Algorithm
from fedlore.engine import interrupt
from fedlore.engine.transport import Transport
from fedlore.engine.validate import method_problem, validate_reply
from fedlore.privacy import Privacy
from fedlore.privacy.plan import WHY
from fedlore.privacy.secagg import Abort
from fedlore.robust import norm_screen
from fedlore.tensors import nbytes
from fedlore.types import LOCAL_KEYS, LOOP_KEYS, Broadcast, Reply, State

log = logging.getLogger(__name__)

Row = dict[str, Any]


class Callback(Protocol):
    """Called after every round with the round's metrics row and the new server state."""

    def on_round_end(self, rnd: int, row: Row, state: State) -> None: ...


@dataclass
class RoundLoop:
    """Drives an algorithm over a transport.

    Attributes:
        algorithm: the method.
        transport: delivers messages.
        sampler: round -> sorted client ids.
        evaluate: server state -> metrics (``accuracy``, ``loss``, ...), or None to skip.
        eval_every: evaluate every this many rounds (and after the last round).
        callbacks: called after every round.
        diagnose: ``(state, round, sampled ids) -> diag.* metrics`` measured at the start of
            the round (see :class:`fedlore.diagnostics.Diagnoser`); it returns {} on rounds it
            skips.
        norm_screen: reject valid replies whose upload norm exceeds this multiple of the
            round's median (:func:`fedlore.robust.norm_screen`); None: off. Not applied under
            ``privacy`` (masked uploads have no meaningful norm; DP clips every upload).
        privacy: secure aggregation and/or DP (:class:`fedlore.privacy.Privacy`): broadcasts
            carry its ``privacy.*`` settings. Under secure aggregation the transport's
            ``send_secure`` runs the protocol (in process: :mod:`fedlore.privacy.secagg`; on
            Flower: SecAgg+) and the method aggregates the unmasked mean; a round that cannot
            complete within the protocol's rules is aborted (the model does not move,
            ``secagg_aborted`` is 1). DP alone: replies are screened against the clip norm and
            the method aggregates the noised mean.
        stop: asked before every round; True ends the run there (early stopping,
            :mod:`fedlore.engine.early_stopping`, whose callback decides after a round).
        clock: ``(round, sampled ids) -> {"sim_round_s", "sim_time_s"}``, the simulated clock
            (:class:`fedlore.engine.simclock.SimClock`), recorded in rounds >= 0; None: none.
    """

    algorithm: Algorithm
    transport: Transport
    sampler: Callable[[int], list[int]]
    evaluate: Callable[[State], dict[str, float]] | None = None
    eval_every: int = 1
    callbacks: Sequence[Callback] = ()
    diagnose: Callable[[State, int, list[int]], dict[str, float]] | None = None
    norm_screen: float | None = None
    privacy: Privacy | None = None
    stop: Callable[[], bool] | None = None
    clock: Callable[[int, list[int]], dict[str, float]] | None = None

    def __post_init__(self) -> None:
        """Refuse a method whose per-client metrics would overwrite a key the loop records.

        Raises:
            ValueError: naming the method, the keys and what to do.
        """
        clash = sorted(set(self.algorithm.per_client_metrics) & LOOP_KEYS)
        if clash:
            raise ValueError(
                f"{type(self.algorithm).__name__}.per_client_metrics names {clash}: the round "
                "loop records these itself (train_loss is the mean over clients), so their "
                f"per-client values would replace them; give them another name (e.g. "
                f"'client_{clash[0]}')"
            )

    def run_round(self, state: State, rnd: int, last_round: int) -> tuple[State, Row]:
        """One round (``rnd < 0`` is an algorithm's setup exchange); returns (state, row)."""
        t0 = time.perf_counter()
        ids = self.sampler(rnd)
        diag: dict[str, float] = {}
        diag_s = 0.0
        if self.diagnose is not None and rnd >= 0:
            t1 = time.perf_counter()
            diag = self.diagnose(state, rnd, ids)
            diag_s = time.perf_counter() - t1
        messages = {cid: self.algorithm.broadcast(state, rnd, cid) for cid in ids}
        privacy = self.privacy
        private: dict[str, Any] = {}
        if privacy is not None:
            messages = privacy.configure(rnd, messages)
        rejected: list[str] = []
        bytes_up = diag_bytes_up = 0
        if privacy is not None and privacy.secure and ids:
            accepted, private, bytes_up, why = self._secure_round(state, rnd, ids, messages)
            rejected = [f"{c}: {why[c]}" for c, r in accepted if r is None]
        else:
            results = self.transport.send(rnd, messages)
            reasons: dict[int, str | None] = {}
            for cid in ids:
                res = results.get(cid)
                if isinstance(res, Reply):
                    sent = {k: v for k, v in res.arrays.items() if isinstance(v, torch.Tensor)}
                    extra = {k: v for k, v in sent.items() if k.startswith("diag.")}
                    diag_bytes_up += nbytes(extra)
                    bytes_up += nbytes(sent) - nbytes(extra)
                    spec = self.algorithm.expected_reply(state, rnd, cid)
                    reasons[cid] = validate_reply(res, spec)
                    if reasons[cid] is None:
                        reasons[cid] = method_problem(self.algorithm, state, rnd, cid, res)
                    if reasons[cid] is None and privacy is not None:
                        reasons[cid] = privacy.screen(res)
                else:
                    reasons[cid] = "no reply" if res is None else f"{type(res).__name__}: {res}"
            valid = {
                c: r for c, r in results.items() if isinstance(r, Reply) and reasons[c] is None
            }
            if privacy is None:
                reasons.update(norm_screen(valid, self.norm_screen))  # valid but absurd uploads
            accepted = []
            for cid in ids:
                reason, res = reasons[cid], results.get(cid)
                if reason is None and isinstance(res, Reply):
                    accepted.append((cid, res))
                else:
                    who = "a client" if privacy is not None and privacy.hides_sample else cid
                    log.warning("round %d: rejected client %s: %s", rnd, who, reason)
                    rejected.append(f"{cid}: {reason}")
                    accepted.append((cid, None))
            if privacy is not None and ids:
                spec = self.algorithm.expected_reply(state, rnd, ids[0])
                accepted, private = privacy.combine(rnd, spec, accepted, _device(self, state))
        state, agg = self.algorithm.aggregate(state, accepted, rnd)
        if privacy is not None:  # the adaptive clip norm of the next round, checkpointed
            state = privacy.record(state)
        agg = {**agg, **private}
        due = (rnd + 1) % self.eval_every == 0 or rnd == last_round
        state, asked = self._query(state, rnd, ids) if rnd >= 0 and due else (state, {})
        ok = [r for _, r in accepted if r is not None]
        row: Row = {
            "round": rnd,
            "clients": len(ids),
            "accepted": len(ok),
            "rejected": len(rejected),
            "accepted_clients": [c for c, r in accepted if r is not None],
            "bytes_up": bytes_up + int(asked.get("query_bytes_up", 0)),
            "bytes_down": sum(nbytes(m.arrays) for m in messages.values())
            + int(private.get("secagg_bytes_down", 0))
            + int(asked.get("query_bytes_down", 0)),
            "train_loss": _mean([r.metrics.get("train_loss") for r in ok]),
            "optimizer_state_bytes": max(
                (int(r.metrics.get("optimizer_state_bytes", 0)) for r in ok), default=0
            ),
            **_largest(ok, "peak_memory_bytes"),
            **_largest(ok, "client_state_bytes"),
            "skipped_steps": sum(int(r.metrics.get("skipped_steps", 0)) for r in ok),
        }
        row.update(client_reports(accepted, self.algorithm.per_client_metrics))
        if rejected:
            row["rejected_reasons"] = rejected
        if privacy is not None and privacy.hides_sample:
            hide_client_ids(row, self.algorithm.per_client_metrics)
        clash = sorted(agg.keys() & LOOP_KEYS)
        if clash:  # a method's aggregate metric would replace what the loop measured
            raise ValueError(
                f"{type(self.algorithm).__name__}.aggregate returned the metric(s) {clash}, "
                "which the round loop records itself; give them another name"
            )
        row.update(agg)
        row.update(asked)
        if self.clock is not None and rnd >= 0:
            row.update(self.clock(rnd, ids))
        row["wall_s"] = time.perf_counter() - t0 - diag_s
        if diag:
            row.update(diag)
            row["diag_s"] = diag_s
            row["diag_bytes_up"] = 0
        if diag_bytes_up:
            row["diag_bytes_up"] = diag_bytes_up
        if (
            rnd >= 0
            and self.evaluate is not None
            and ((rnd + 1) % self.eval_every == 0 or rnd == last_round)
        ):
            add_scores(row, self.evaluate, state)
        return state, row

    def _query(self, state: State, rnd: int, ids: list[int]) -> tuple[State, Row]:
        """A method's query exchange after aggregation, on the rounds that evaluate (and the
        last): ``query(state, rnd, cid)`` -> the message to each of the round's clients (None:
        none), sent over the transport, the replies (or None) to ``absorb_query`` (called with
        no replies when no client was asked). Its bytes
        go to ``bytes_up`` / ``bytes_down`` and alone to ``query_bytes_up`` /
        ``query_bytes_down`` (HeteroFL's static batch norm statistics)."""
        ask = getattr(self.algorithm, "query", None)
        if ask is None:
            return state, {}
        messages = {c: m for c in ids if (m := ask(state, rnd, c)) is not None}
        if not messages:  # nobody to ask: the method still decides (keep, or refuse)
            return self.algorithm.absorb_query(state, [], rnd)  # type: ignore[attr-defined]
        results = self.transport.send(rnd, messages)
        replies = [(c, r if isinstance(r, Reply) else None) for c, r in sorted(results.items())]
        tensors = [{k: v for k, v in r.arrays.items() if isinstance(v, torch.Tensor)}
                   for _, r in replies if r is not None]  # fmt: skip
        state, metrics = self.algorithm.absorb_query(state, replies, rnd)  # type: ignore[attr-defined]
        return state, {
            **metrics,
            "query_bytes_up": sum(nbytes(t) for t in tensors),
            "query_bytes_down": sum(nbytes(m.arrays) for m in messages.values()),
        }

    def _secure_round(
        self, state: State, rnd: int, ids: list[int], messages: dict[int, Broadcast]
    ) -> tuple[list[tuple[int, Reply | None]], dict[str, Any], int, dict[int, str]]:
        """A round through the transport's secure aggregation: the replies the method
        aggregates, the privacy metrics, the bytes uploaded and why each client is missing
        from the sum. A round the protocol aborts, or one with fewer survivors than
        ``secure_aggregation_threshold``, leaves every reply out (the model does not move)."""
        privacy = self.privacy
        assert privacy is not None
        spec = self.algorithm.expected_reply(state, rnd, ids[0])
        send_secure = getattr(self.transport, "send_secure", None)
        if send_secure is None:
            raise TypeError(
                f"{type(self.transport).__name__} has no send_secure: it cannot run secure "
                "aggregation"
            )
        res = send_secure(rnd, messages, spec, privacy)
        need = privacy.min_survivors(len(ids))
        if not isinstance(res, BaseException) and len(res.clients) < need:
            res = RuntimeError(
                f"{len(res.clients)} of {len(ids)} clients survived, "
                f"secure_aggregation_threshold needs {need}: nothing is unmasked"
            )
        if isinstance(res, BaseException):
            said = res.unnamed if isinstance(res, Abort) and privacy.hides_sample else res
            log.warning("round %d: the secure aggregation was aborted: %s", rnd, said)
            why = {c: f"the secure round was aborted: {said}" for c in ids}
            return [(c, None) for c in ids], privacy.aborted(rnd, ids), 0, why
        out, metrics = privacy.from_mean(
            rnd, spec, res.mean, res.metrics, ids, _device(self, state)
        )
        for name, n in res.counts.items():
            metrics[name] = n
            if n:
                log.warning("round %d: %s = %d (%s)", rnd, name, n, WHY.get(name, "a count"))
        why = {c: res.reasons.get(c, "dropped out of the secure sum") for c in ids}
        metrics["secagg_aborted"] = 0
        if res.bytes_down:  # the in-process protocol's own messages (keys, shares, lists)
            metrics["secagg_bytes_down"] = int(res.bytes_down)
        return out, metrics, int(res.bytes_up), why

    def run(self, state: State, start: int, rounds: int) -> State:
        """Rounds ``start .. rounds-1`` (start may be negative for setup exchanges), driven by
        :func:`drive` (signals, ``stop`` and callbacks)."""
        return drive(self.run_round, self.callbacks, self.stop, state, start, rounds)


def drive(
    run_round: Callable[[State, int, int], tuple[State, Row]],
    callbacks: Sequence[Callback],
    stop: Callable[[], bool] | None,
    state: State,
    start: int,
    rounds: int,
) -> State:
    """Call ``run_round(state, rnd, rounds - 1)`` for ``rnd`` in ``start .. rounds-1``, then
    every callback's ``on_round_end`` with the round's row.

    A SIGINT or SIGTERM (:mod:`fedlore.engine.interrupt`) stops the loop before another
    round starts, and a round during which one arrived is discarded: its callbacks (the
    metrics row, the checkpoint) are never called, so clients lost to the interrupt are
    never recorded as failed clients. The :class:`~fedlore.engine.interrupt.Interrupted`
    raised carries the last round recorded. ``stop`` ends the loop before a round too.
    Both the synchronous :class:`RoundLoop` and the buffered (FedBuff) loop run through it.
    """
    done = start - 1
    try:
        with interrupt.deferred():
            for rnd in range(start, rounds):
                if stop is not None and stop():
                    break  # stopped early (after the last round's callbacks, or resumed)
                interrupt.check()  # no round starts after a signal
                state, row = run_round(state, rnd, rounds - 1)
                interrupt.check()  # a signal during the round: it is not recorded
                for cb in callbacks:
                    cb.on_round_end(rnd, row, state)
                done = rnd
    except interrupt.Interrupted as e:
        e.last_round = done
        raise
    except Exception as e:  # a method's own code, a transport: the command names the round
        if getattr(e, "fedlore_round", None) is None:
            e.fedlore_round = done + 1  # type: ignore[attr-defined]
        raise
    return state


def hide_client_ids(row: Row, per_client: Sequence[str] = ()) -> None:
    """Under DP with secure noise, the row keeps counts and reasons but never a client id: the
    reported ε amplifies by subsampling, which assumes the sample stays secret from whoever
    reads the results (``accepted_clients`` and per-client metrics are dropped, the reasons
    lose their ``"<id>: "`` prefix and are sorted)."""
    row.pop("accepted_clients", None)
    for key in per_client:
        row.pop(key, None)
    if "rejected_reasons" in row:
        row["rejected_reasons"] = sorted(r.split(": ", 1)[-1] for r in row["rejected_reasons"])


def add_scores(row: Row, evaluate: Callable[[State], dict[str, Any]], state: State) -> None:
    """Add the evaluation of ``state`` and its time (``eval_s``) to a round's ``row``.

    Raises:
        ValueError: when a score has the name of a key the row holds already (a metric of
            ``eval.metrics``, or a method's metric, of the same name).
    """
    t1 = time.perf_counter()
    scores = evaluate(state)
    clash = sorted(scores.keys() & (row.keys() | {"eval_s"}))
    if clash:
        raise ValueError(
            f"the evaluation's score(s) {clash} have the name of a key the round's row "
            "holds already; rename the metric"
        )
    row.update(scores)
    row["eval_s"] = time.perf_counter() - t1


def client_reports(accepted: list[tuple[int, Reply | None]], per_client: Sequence[str] = ()) -> Row:
    """What the round's row records from the accepted replies' metrics besides the loss:

    * ``client_train_s``: mean seconds of local training per client (reply ``train_s``);
    * ``local_accuracy`` / ``local_loss`` / ``local_ece``: P-local scores pooled with weights
      ``local_n`` (accuracy and NLL are then the pooled values; ECE the test-size-weighted mean of
      the clients' ECEs; NaN when a client's score is not finite), with ``local_clients`` = how
      many reported; regression: ``local_rmse``, the root of the pooled squared error;
    * ``local_<name>`` for each metric of ``eval.metrics`` the clients reported: the
      test-size-weighted mean of the clients' finite values (a metric undefined on one client's
      split, such as AUROC over a single class, leaves that client out), NaN when no client's
      value is finite or a client's model diverged (its ``local_loss`` not finite), as
      ``local_accuracy`` is;
    * the reply metrics named in ``per_client`` (an algorithm's ``per_client_metrics``) per
      client, e.g. ``lr_chosen: {"3": 0.001}``.
    """
    ok = [(c, r) for c, r in accepted if r is not None]
    row: Row = {}
    train_s = _mean([r.metrics.get("train_s") for _, r in ok])
    if train_s is not None:
        row["client_train_s"] = train_s
    local = [r.metrics for _, r in ok if isinstance(r.metrics.get("local_n"), int | float)]
    total = sum(float(m["local_n"]) for m in local)
    if local and total > 0:
        for key in LOCAL_KEYS:
            vals = [(float(m[key]), float(m["local_n"])) for m in local if key in m]
            if vals and all(math.isfinite(v) for v, _ in vals):
                row[key] = sum(v * n for v, n in vals) / sum(n for _, n in vals)
            elif vals:  # a diverged local model: the pooled score is NaN, not left out
                row[key] = float("nan")
        for key in sorted({k for m in local for k in m} - {*LOCAL_KEYS, "local_n"}):
            if not key.startswith("local_") or key in per_client:
                continue  # P-local scores only: local_<name> of eval.metrics
            scored = [m for m in local if _real(m.get(key))]
            losses = [m.get("local_loss") for m in scored]
            diverged = any(isinstance(v, float) and not math.isfinite(v) for v in losses)
            finite = [
                (float(m[key]), float(m["local_n"]))
                for m in scored
                if math.isfinite(float(m[key])) and float(m["local_n"]) > 0
            ]
            row[key] = (
                sum(v * n for v, n in finite) / sum(n for _, n in finite)
                if finite and not diverged
                else float("nan")
            )
        if "local_mse" in row:  # regression: the pooled RMSE of the clients' own models
            row["local_rmse"] = math.sqrt(row.pop("local_mse"))
        row["local_clients"] = len(local)
    for key in per_client:
        per = {str(c): r.metrics[key] for c, r in ok if key in r.metrics}
        if per:
            row[key] = per
    return row


def _largest(replies: list[Reply], key: str) -> Row:
    """``key``'s largest value over this round's accepted replies; absent when none reports it.

    * ``peak_memory_bytes``: a client's peak device memory during its update (measured on CUDA
      devices only: absent on the CPU).
    * ``client_state_bytes``: the bytes a client keeps between rounds (its state's tensors, as
      the transport stores them: control variates, personal layers, optimizer moments kept for
      the next round); 0 for a method that keeps nothing. Absent under secure aggregation or DP,
      which send only :data:`fedlore.privacy.CLEAR_METRICS` in the clear (the built-in methods
      keep states whose size the config fixes, but a method's state may be sized by its data).
    """
    values = [int(r.metrics[key]) for r in replies if key in r.metrics]
    return {key: max(values)} if values else {}


def _device(loop: RoundLoop, state: State) -> torch.device:
    """The device of the server's global model (where aggregated uploads must live)."""
    for v in loop.algorithm.global_arrays(state).values():
        return v.device
    return torch.device("cpu")


def _mean(values: list[Any]) -> float | None:
    xs = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(float(v))]
    return sum(xs) / len(xs) if xs else None


def _real(value: Any) -> bool:
    """A number a reply may carry as a score (not a bool, a string or a missing value)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
