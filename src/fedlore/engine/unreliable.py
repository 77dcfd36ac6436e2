"""Unreliable clients in simulation (``clients.*`` settings): clients that drop out, that are
slow, and that come and go.

* **Dropout.** Each sampled client fails to answer with probability ``dropout``, drawn from
  ``generator(seed, DROPOUT, round, client)``; its reply is lost as a dead node's is (the round
  loop records ``dropped out`` as the reason and every method treats the client as it treats a
  lost one: FedLore clients catch up from the log when they return).
* **Speeds and a deadline.** Client i has a relative speed s_i (``speed``: all 1, lognormal,
  uniform, or a trace file), drawn once per run from ``generator(seed, SPEED)``. Its round of
  K_i local steps takes ``W_i · step_s / s_i`` simulated seconds, W_i the optimizer steps the
  round runs (K_i, plus what the method runs besides: Meta-BayFL's trial steps, Ditto's
  personal steps; ``round_work`` of the method, :func:`client_work`); past
  ``round_deadline_s`` it is a straggler: dropped, or with ``partial_work`` it trains only the
  local steps whose work it finished (``floor(deadline · s_i / step_s)`` when W = K; at least
  1; the method's ``round_lrs`` stop there, :data:`fedlore.settings.STEP_BUDGET`) and its
  reply is weighted by the share of local steps done (reply metric ``work_share``).
* **Availability** (:func:`available_sampler`): a trace of which clients can be sampled in
  which round; the round samples ``clients_per_round`` of them (all when fewer are available).

Simulated time is a model, not a measurement: it decides who makes the deadline, reproducibly,
whatever the machine. In-process engine only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlore.config import Config, ConfigError
from fedlore.data.client_data import ClientData
from fedlore.engine.transport import Transport
from fedlore.seeding import DROPOUT, SAMPLING, SPEED, derive_seed, generator
from fedlore.settings import STEP_BUDGET
from fedlore.types import Broadcast, Reply


class ClientDropped(Exception):
    """A sampled client that did not answer (dropped out, or missed the deadline)."""


def client_speeds(cfg: Config, seed: int) -> np.ndarray:
    """Each client's relative compute speed (``clients.speed`` / ``speed_trace``).

    Raises:
        ConfigError: for a trace that is unreadable, of the wrong length, or not all > 0.
    """
    c, n = cfg.clients, cfg.num_clients
    if c.speed_trace is not None:
        path = Path(c.speed_trace)
        try:
            speeds = np.asarray(json.loads(path.read_text()), dtype=np.float64)
        except (OSError, ValueError) as e:
            raise ConfigError(f"clients.speed_trace: cannot read {path}: {e}") from None
        if speeds.shape != (n,) or not np.all(speeds > 0):
            raise ConfigError(
                f"clients.speed_trace: {path} must hold {n} speeds > 0 (one per client), got "
                f"{speeds.shape[0] if speeds.ndim == 1 else speeds.shape}"
            )
        return speeds
    g = generator(seed, SPEED)
    if c.speed == "lognormal":
        return torch.exp(c.speed_spread * torch.randn(n, generator=g, dtype=torch.float64)).numpy()
    if c.speed == "uniform":
        if c.speed_spread >= 1:
            raise ConfigError("clients.speed_spread must be below 1 for uniform speeds")
        u = torch.rand(n, generator=g, dtype=torch.float64)
        return (1.0 - c.speed_spread + 2.0 * c.speed_spread * u).numpy()
    return np.ones(n)


def client_work(algo: Any, num_examples: int) -> tuple[int, Callable[[int], int]]:
    """A client's round as the simulated clock sees it: its local steps K
    (``algo.round_steps``) and the optimizer steps it runs when it trains b of them
    (``algo.round_work``: b, plus what the method runs besides, e.g. Meta-BayFL's trials).
    A method of one's own that does not derive from :class:`~fedlore.algorithms.base.Hyper`
    and lacks the two is charged its ``local_steps``, b for b."""
    round_steps = getattr(algo, "round_steps", None) or algo.local_steps
    round_work = getattr(algo, "round_work", None)
    if round_work is None:
        return round_steps(num_examples), lambda b: b
    return round_steps(num_examples), lambda b: round_work(num_examples, b)


def client_plan(
    cfg: Config,
    speeds: np.ndarray,
    seed: int,
    rnd: int,
    cid: int,
    steps: int,
    work: Callable[[int], int] | None = None,
) -> ClientDropped | int | None:
    """What client ``cid``, whose round is ``steps`` local steps, does in round ``rnd``: drops
    out (the exception to report), trains a budget of steps (a straggler's partial work), or
    trains its whole round (None). ``work`` (local steps b -> the optimizer steps the round
    runs, :func:`client_work`; None: b) is what takes simulated time; a straggler's budget is
    the most local steps whose work fits before the deadline (at least 1)."""
    c = cfg.clients
    if c.dropout > 0:
        u = float(torch.rand(1, generator=generator(seed, DROPOUT, rnd, cid)))
        if u < c.dropout:
            return ClientDropped(f"dropped out (clients.dropout={c.dropout:g})")
    if c.round_deadline_s is None:
        return None
    cost = work or (lambda b: b)
    total = cost(steps)
    need = total * c.step_s / float(speeds[cid])
    if need <= c.round_deadline_s:
        return None
    if not c.partial_work:
        besides = f" (and {total - steps} other optimizer steps)" if total > steps else ""
        return ClientDropped(
            f"straggler: {need:.3g} s for {steps} steps{besides} > clients.round_deadline_s "
            f"{c.round_deadline_s:g}"
        )
    can = c.round_deadline_s * float(speeds[cid]) / c.step_s  # optimizer steps by the deadline
    lo, hi = 1, steps  # the work grows with the budget: the largest b with cost(b) <= can
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= can:
            lo = mid
        else:
            hi = mid - 1
    return lo


class UnreliableTransport:
    """Wraps a transport with dropouts and deadlines (module docstring)."""

    def __init__(
        self,
        inner: Transport,
        cfg: Config,
        algo: Any,
        client_data: Callable[[int], ClientData],
        seed: int,
    ) -> None:
        self.inner, self.cfg, self.algo, self.data, self.seed = inner, cfg, algo, client_data, seed
        self.speeds = client_speeds(cfg, seed)

    def plan(self, rnd: int, cid: int) -> ClientDropped | int | None:
        """What client ``cid`` does in round ``rnd`` (:func:`client_plan`)."""
        steps, work = client_work(self.algo, self.data(cid).num_examples)
        return client_plan(self.cfg, self.speeds, self.seed, rnd, cid, steps, work)

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out: dict[int, Reply | BaseException] = {}
        whole: dict[int, Broadcast] = {}
        for cid, msg in messages.items():
            what = self.plan(rnd, cid)
            if isinstance(what, ClientDropped):
                out[cid] = what
            elif what is None:
                whole[cid] = msg
            else:  # a straggler's partial work: its own send, under its step budget
                token = STEP_BUDGET.set(what)
                try:
                    got = self.inner.send(rnd, {cid: msg})
                finally:
                    STEP_BUDGET.reset(token)
                steps, _ = client_work(self.algo, self.data(cid).num_examples)
                for k, reply in got.items():
                    if isinstance(reply, Reply):
                        share = min(1.0, what / steps)
                        reply = Reply(reply.arrays, {**reply.metrics, "work_share": share})
                    out[k] = reply
        if whole:
            out.update(self.inner.send(rnd, whole))
        return out

    def send_secure(self, rnd: int, messages: dict[int, Broadcast], spec: Any, privacy: Any) -> Any:
        """A round under in-process secure aggregation with the same dropouts and deadlines: a
        client that drops out or misses the deadline leaves the protocol after it has shared
        its keys (SecAgg+'s dropout case: the survivors' sum is unmasked without it, or the
        round aborts below the threshold). ``partial_work`` is refused with secure
        aggregation (:mod:`fedlore.checks.methods`); a budget would still apply here."""
        inner_train = self.inner._train  # type: ignore[attr-defined]

        def train(r: int, cid: int, msg: Broadcast) -> Reply:
            what = self.plan(r, cid)
            if isinstance(what, ClientDropped):
                raise what  # its upload fails: it leaves the secure round
            if what is None:
                return inner_train(r, cid, msg)
            token = STEP_BUDGET.set(what)
            try:
                return inner_train(r, cid, msg)
            finally:
                STEP_BUDGET.reset(token)

        self.inner._train = train  # type: ignore[attr-defined]
        try:
            return self.inner.send_secure(rnd, messages, spec, privacy)  # type: ignore[attr-defined]
        finally:
            del self.inner._train  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def is_unreliable(cfg: Config) -> bool:
    """Whether any ``clients.*`` behaviour is on (dropout, a deadline)."""
    return cfg.clients.dropout > 0 or cfg.clients.round_deadline_s is not None


def unreliable(factory: Callable[..., Transport], cfg: Config) -> Callable[..., Transport]:
    """``factory`` (``(algorithm, client_data, model_factory, seed, store) -> Transport``) with
    dropouts and deadlines applied (unchanged when none is set)."""
    if not is_unreliable(cfg):
        return factory

    def make(algo: Any, client_data: Callable[[int], ClientData], *rest: Any) -> Transport:
        inner = factory(algo, client_data, *rest)
        return UnreliableTransport(inner, cfg, algo, client_data, int(rest[1]))

    return make


def availability_trace(cfg: Config) -> list[list[int]] | None:
    """The ``clients.availability`` trace (None without one).

    Raises:
        ConfigError: for an unreadable file, an empty trace or an id outside the federation.
    """
    if cfg.clients.availability is None:
        return None
    path = Path(cfg.clients.availability)
    try:
        trace = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"clients.availability: cannot read {path}: {e}") from None
    ok = isinstance(trace, list) and trace and all(isinstance(r, list) and r for r in trace)
    ids = {c for r in trace for c in r} if ok else set()
    if not ok or not all(isinstance(c, int) and 0 <= c < cfg.num_clients for c in ids):
        raise ConfigError(
            f"clients.availability: {path} must be a non-empty list of non-empty lists of client "
            f"ids in 0..{cfg.num_clients - 1}"
        )
    return [sorted(set(r)) for r in trace]


def available_sampler(cfg: Config, seed: int) -> Callable[[int], list[int]] | None:
    """Round -> its sorted clients, drawn from those the availability trace lists for the round
    (``clients_per_round`` of them, all when fewer are available), seeded by (seed, round);
    None without a trace."""
    trace = availability_trace(cfg)
    if trace is None:
        return None
    per_round = cfg.clients_per_round()

    def sample(rnd: int) -> list[int]:
        pool = trace[max(rnd, 0) % len(trace)]
        if per_round >= len(pool):
            return list(pool)
        rng = np.random.default_rng(derive_seed(seed, SAMPLING, rnd))
        return sorted(int(pool[i]) for i in rng.choice(len(pool), size=per_round, replace=False))

    return sample
