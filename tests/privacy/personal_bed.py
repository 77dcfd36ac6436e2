"""The test bed of FedPer, FedBN, FedRep and MOON under the privacy modes (imported by
``test_personal_methods.py``; not a test module): the four methods, a model with enough shared
coordinates for the noise checks, and an in-process run through the real round loop and
transport with a :class:`~fedlore.privacy.Privacy` that records what each client trained, what
left it and what the server ended with.

The federation is ``tests/algorithms/four_clusters.py``'s (clients naming the classes their own
way), with four clients of unequal sizes (32, 48, 64, 80 training examples), so that the
example-weighted mean differs from the uniform one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import fedlore.algorithms  # noqa: F401  (registers the methods)
from fedlore.algorithm import Algorithm
from fedlore.algorithms.fedavg import FedAvg
from fedlore.algorithms.fedrep import FedRep
from fedlore.algorithms.moon import Moon
from fedlore.algorithms.partial import FedBN, FedPer, PartialFedAvg
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.loop import RoundLoop
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.models import build_model
from fedlore.privacy import Contribution, DPSettings, NoiseSource, Privacy, SecureSource
from fedlore.seeding import generator
from fedlore.types import Broadcast, Reply, Scalars, State

D, C, N = 8, 4, 4
SEED = 11
SIGMA, CLIP, DELTA = 1.5, 0.5, 1e-5
HIDDEN = [160, 96]
"""The MLP 8-160-96-4: 16,896 shared coordinates under FedPer (the noise std is estimated
within 3.3 % at 6 standard errors), a head of 388."""
METHODS = ("fedper", "fedbn", "fedrep", "moon")
KEPT_STATE = {"fedper": "personal.", "fedbn": "personal.", "fedrep": "personal.", "moon": "prev."}
"""Where each method's client keeps what it does not upload: its L (``personal.*``), or MOON's
previous model (``prev.*``)."""
MODES = ("secagg", "dp", "ldp", "secagg+dp", "secagg+ldp")


def norm_of(method: str) -> str:
    """FedBN needs BatchNorm (it refuses a model without); the others run without."""
    return "batch" if method == "fedbn" else "none"


def model(norm: str = "none", hidden: list[int] | None = None) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return build_model("mlp", (D,), C, hidden=hidden or HIDDEN, norm=norm)


def client(cid: int) -> ClientData:
    """Client ``cid``: ``16 (cid + 2)`` training and 32 test examples of the four clusters, class
    c named (c + cid) mod 4."""
    n, m = 16 * (cid + 2), 32
    g = torch.Generator().manual_seed(1000 + cid)
    means = torch.randn(C, D, generator=torch.Generator().manual_seed(0)) * 1.5
    c = torch.randint(0, C, (n + m,), generator=g)
    x = means[c] + torch.randn(n + m, D, generator=g)
    y = (c + cid) % C
    return ClientData(cid, TensorSplit(x[:n], y[:n]), TensorSplit(x[n:], y[n:]))


def make(method: str, **kw: Any) -> FedAvg:
    cls: type[FedAvg] = {"fedper": FedPer, "fedbn": FedBN, "fedrep": FedRep, "moon": Moon}[method]
    settings = {"lr": 0.05, "local_steps": 4, "batch_size": 16, "rounds": 3, **kw}
    return cls.of(**settings)


def kept_local(algo: Algorithm, net: nn.Module) -> set[str]:
    """The model tensors a client keeps out of every upload: L of a partial method (its head,
    FedBN's BatchNorm tensors), none for MOON (its previous model is a client state)."""
    return set(algo.local_names(net)) if isinstance(algo, PartialFedAvg) else set()


def shared(algo: Algorithm, net: nn.Module) -> list[str]:
    """The tensors a private upload holds, in sorted order: not kept local, floating."""
    kept = kept_local(algo, net)
    return sorted(k for k, v in net.state_dict().items() if k not in kept and v.is_floating_point())


def privacy(mode: str, noise: NoiseSource | None = None, sigma: float = SIGMA) -> Privacy:
    """The :class:`Privacy` of ``mode`` (one of :data:`MODES`) over the N clients, every one
    sampled: under DP uniform weights (DP-FedAvg), else the clients' example counts."""
    dp = DPSettings(CLIP, sigma, DELTA) if "dp" in mode else None
    sizes = [client(c).num_examples for c in range(N)]
    return Privacy(
        "secagg" in mode,
        dp,
        dp is not None,
        N,
        N,
        0,
        SEED,
        max_weight=1.0 if dp is not None else float(max(sizes)),
        noise=SecureSource() if noise is None else noise,
        local="ldp" in mode,
    )


@dataclass
class Trace:
    """A run: the server state before and after each round, each round's row, each client's
    reply as it trained it (``raw``, with the transport's measurements), what left it (``sent``:
    the reply the server received, or under secure aggregation the contribution it masked) and
    every client's state after each round."""

    states: list[State] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    raw: dict[tuple[int, int], Reply] = field(default_factory=dict)
    sent: dict[tuple[int, int], Reply | Contribution] = field(default_factory=dict)
    clients: list[dict[int, State]] = field(default_factory=list)


def run(
    algo: Algorithm,
    norm: str,
    priv: Privacy | None,
    schedule: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    hidden: list[int] | None = None,
) -> Trace:
    """``algo`` over the clients of ``schedule`` (one list of client ids per round) through
    :class:`RoundLoop` and :class:`LocalTransport` (in-process secure aggregation, DP's
    clipping and local noise included) under ``priv``."""
    trace = Trace()
    import fedlore.engine.transport as transport_module

    real = transport_module.client_contribution

    def noted(reply: Reply, config: Scalars, cid: int, rnd: int, noise: NoiseSource) -> Any:
        trace.sent[(rnd, cid)] = c = real(reply, config, cid, rnd, noise)
        return c

    monkeypatch.setattr(transport_module, "client_contribution", noted)

    class Spy(LocalTransport):
        def _train(self, rnd: int, cid: int, msg: Broadcast) -> Reply:
            trace.raw[(rnd, cid)] = reply = super()._train(rnd, cid, msg)
            return reply

        def _run_client(self, rnd: int, cid: int, msg: Broadcast) -> Reply | BaseException:
            out = super()._run_client(rnd, cid, msg)
            if isinstance(out, Reply):
                trace.sent[(rnd, cid)] = out
            return out

    store = ClientStore()
    transport = Spy(algo, client, lambda: model(norm, hidden), SEED, store)
    trace.states.append(algo.init_server(model(norm, hidden), generator(SEED, 2)))
    loop = RoundLoop(algo, transport, lambda rnd: schedule[rnd], privacy=priv)
    for rnd in range(len(schedule)):
        state, row = loop.run_round(trace.states[-1], rnd, len(schedule) - 1)
        assert row["accepted"] == len(schedule[rnd]), row
        trace.states.append(state)
        trace.rows.append(row)
        trace.clients.append({c: store.get(c) for c in store.client_ids()})  # type: ignore[misc]
    return trace


def noise_std_ok(residual: torch.Tensor, std: float) -> bool:
    """Whether ``residual`` looks like N(0, std²) per coordinate: its sample std within 6
    standard errors (std/√(2n)) of ``std`` and its mean within 6 of 0."""
    n = residual.numel()
    sd, mean = float(residual.std()), float(residual.mean())
    return abs(sd / std - 1) < 6 / math.sqrt(2 * n) and abs(mean) < 6 * std / math.sqrt(n)
