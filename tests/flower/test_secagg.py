"""Secure aggregation on Flower: flwr's SecAgg+ workflow and ``secaggplus_mod`` around fedlore's
ClientApp.

In process (:class:`DirectGrid`: a Flower ``Grid`` that calls fedlore's ClientApp of
:func:`make_apps` here, one ``Context`` per node, no Ray): a secure round's unmasked mean
equals the plain weighted mean of the same clients' contribution vectors within the
quantization error; nothing of a client's vector or weight travels in the clear; a client that
drops out after sharing its keys is left out of the sum; ordinary rounds pass the mod
untouched; under local DP each ClientApp noises its own upload (with or without SecAgg+);
FedPer, FedBN, FedRep, MOON and SCAFFOLD mask their shared increments only, across rounds, and
end where the in-process secure run ends. The loopback deployment (real SuperLink and
SuperNodes) is at the end.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
import types
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.app.message import make_message  # the typed way to give a Message its Metadata
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.serverapp import Grid

from fedlore.config import Config, load_config
from fedlore.engine.loop import RoundLoop
from fedlore.experiment_parts import make_algorithm, model_factory, start_server
from fedlore.experiment_privacy import make_privacy
from fedlore.flower.app import _federation, make_apps
from fedlore.flower.loopback import LoopbackFederation
from fedlore.flower.secure import DROP_ROUND_KEY, SecAggSettings, _Workflow, secagg_settings
from fedlore.flower.transport import FlowerTransport
from fedlore.privacy import (
    CLEAR_METRICS,
    Contribution,
    NoiseSource,
    SecureSum,
    client_contribution,
    clip_upload,
    flatten,
    local_epsilon,
    privatize,
    spec_length,
)
from fedlore.seeding import generator
from fedlore.types import Broadcast, Reply, Scalars

pytestmark = pytest.mark.flower

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]

ROOT = Path(__file__).resolve().parents[2]
N = 3
SEED = 42
SMALL = [
    f"num_clients={N}",
    "local_steps=2",
    "batch_size=16",
    "progress=false",
    "model.kwargs={hidden: [8]}",
    "algorithms=[fedavg]",
    "secure_aggregation=true",
]


class DirectGrid(Grid):
    """A Flower ``Grid`` that delivers each pushed message to a ClientApp in this process at
    once (one ``Context`` per node, as a SuperNode keeps one) and keeps the replies for
    :meth:`pull_messages`. ``fail`` = {node id: SecAgg+ stage}: that node answers the stage
    with an error (it dropped out there). ``seen`` holds every reply the server received."""

    def __init__(self, app: Any, num_clients: int, fail: dict[int, str] | None = None) -> None:
        self.app = app
        self.fail = dict(fail or {})
        self.ctx = {
            100 + c: Context(
                run_id=1, node_id=100 + c, node_config={"partition-id": c},
                state=RecordDict(), run_config={},
            )
            for c in range(num_clients)
        }  # fmt: skip
        self.replies: dict[str, Message] = {}
        self.seen: list[tuple[str, Message]] = []

    def set_run(self, run: Any) -> None:
        raise NotImplementedError

    @property
    def run(self) -> Any:
        return types.SimpleNamespace(run_id=1)

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.ctx)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = str(uuid.uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS)
            stage = "" if cfg is None else str(cfg.get(Key.STAGE, ""))
            node = msg.metadata.dst_node_id
            # a copy, as if serialized: the workflow sends one content object to many nodes
            msg = make_message(copy.deepcopy(msg.metadata), copy.deepcopy(msg.content))
            if self.fail.get(node) == stage:
                reply = Message(Error(1, f"node {node} dropped out in {stage}"), reply_to=msg)
            else:
                try:
                    reply = self.app(msg, self.ctx[node])
                except Exception as e:  # as a SuperNode answers a failing ClientApp
                    reply = Message(Error(2, repr(e)), reply_to=msg)
            reply.metadata.__dict__["_src_node_id"] = node
            self.replies[mid] = reply
            self.seen.append((stage, reply))
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


@pytest.fixture
def contributions(monkeypatch: pytest.MonkeyPatch) -> dict[int, Contribution]:
    """``fedlore.privacy.client_contribution`` (the ClientApp imports it per message), noting
    what each client contributed."""
    seen: dict[int, Contribution] = {}

    def noted(
        reply: Reply, config: Scalars, client_id: int, rnd: int, noise: NoiseSource
    ) -> Contribution:
        seen[client_id] = client_contribution(reply, config, client_id, rnd, noise)
        return seen[client_id]

    monkeypatch.setattr("fedlore.privacy.client_contribution", noted)
    return seen


def _round(cfg: Config) -> tuple[dict[int, Broadcast], dict[int, Broadcast], Spec, list[int]]:
    """Round 0's plain and secure broadcasts of FedAvg (the latter with the run's
    ``privacy.*`` settings), the reply spec (L entries) and the clients' training-set sizes."""
    fed = _federation(cfg.model_dump_json(), SEED, "cpu")  # the one the ClientApp builds
    algo = make_algorithm("fedavg", cfg)
    model = model_factory(cfg, fed, SEED)()
    state = start_server(algo, model, generator(SEED, 0), fed, "fedavg")
    plain = {c: algo.broadcast(state, 0, c) for c in range(N)}
    privacy = make_privacy(cfg, algo, SEED)
    assert privacy is not None and privacy.secure
    secure = privacy.configure(0, plain)
    spec = algo.expected_reply(state, 0, 0)
    return plain, secure, spec, [fed.client(c).num_examples for c in range(N)]


def _expected(seen: dict[int, Contribution], clients: list[int]) -> torch.Tensor:
    w = torch.tensor([seen[c].weight for c in clients], dtype=torch.float64)
    v = torch.stack([seen[c].vector for c in clients])
    return (w[:, None] * v).sum(0) / w.sum()


def _transport(grid: Grid, sizes: list[int]) -> FlowerTransport:
    settings = SecAggSettings(num_shares=1.0, reconstruction_threshold=0.5, max_weight=max(sizes))
    return FlowerTransport(grid, wait_for_nodes=0.0, expected_nodes=0, secagg=settings)


def test_secure_round_mean_equals_the_plain_weighted_mean(
    task_identity: None, contributions: dict[int, Contribution]
) -> None:
    cfg = load_config(None, SMALL)  # nothing is written; one federation for all (cached)
    plain, secure, spec, sizes = _round(cfg)
    length = spec_length(spec)
    assert len(set(sizes)) > 1  # unequal weights: the weighting is exercised
    _, client = make_apps(cfg, "fedavg", SEED)
    grid = DirectGrid(client, N)
    transport = _transport(grid, sizes)
    assert sorted(transport.node_of) == list(range(N))
    got = transport.send_secure(0, secure, spec)
    assert isinstance(got, SecureSum), got
    assert got.clients == list(range(N)) and sorted(got.metrics) == list(range(N))
    # only what may travel in the clear: no training loss of a single client
    assert all(set(m) <= set(CLEAR_METRICS) for m in got.metrics.values())
    assert got.mean.dtype == torch.float64 and got.mean.shape == (length,)
    want = _expected(contributions, got.clients)
    err = (got.mean - want).abs().max().item()
    max_abs = max(c.vector.abs().max().item() for c in contributions.values())
    bound = transport.secagg.mean_error_bound(
        [contributions[c].weight for c in got.clients], max_abs
    )
    assert err <= bound, (err, bound)
    print(f"secure mean error {err:.3g}, bound {bound:.3g}, max entry {max_abs:.3g}")
    # the weights matter: the uniform mean is farther away than the quantization error
    uniform = torch.stack([contributions[c].vector for c in got.clients]).mean(0)
    assert (uniform - want).abs().max().item() > 10 * bound
    # nothing of a vector or its weight in the clear: the collect-stage replies hold no arrays
    # and num_examples 0; the masked vector is not the quantized upload
    collected = [m for stage, m in grid.seen if stage == Stage.COLLECT_MASKED_VECTORS]
    assert len(collected) == N
    for m in collected:
        assert all(len(r) == 0 for r in m.content.array_records.values())
        assert m.content.metric_records["fitres.num_examples"]["num_examples"] == 0
        masked = m.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]
        assert isinstance(masked, list) and len(masked) == 2  # [weight factor, vector], masked
    # an ordinary round through the same ClientApp (the mod passes it through)
    replies = transport.send(1, {c: Broadcast(b.arrays, {**b.config, "round": 1})
                                 for c, b in plain.items()})  # fmt: skip
    assert all(isinstance(r, Reply) and "num_examples" in r.metrics for r in replies.values())


def test_a_client_that_drops_out_after_sharing_keys_is_left_out(
    task_identity: None, contributions: dict[int, Contribution]
) -> None:
    cfg = load_config(None, SMALL)  # nothing is written; one federation for all (cached)
    _, secure, spec, sizes = _round(cfg)
    _, client = make_apps(cfg, "fedavg", SEED)
    grid = DirectGrid(client, N, fail={101: Stage.COLLECT_MASKED_VECTORS})
    transport = _transport(grid, sizes)
    got = transport.send_secure(0, secure, spec)
    assert isinstance(got, SecureSum), got
    assert got.clients == [0, 2] and 1 not in got.metrics
    want = _expected(contributions, [0, 2])
    err = (got.mean - want).abs().max().item()
    max_abs = max(c.vector.abs().max().item() for c in contributions.values())
    assert err <= transport.secagg.mean_error_bound(
        [contributions[c].weight for c in (0, 2)], max_abs
    )


def test_too_few_survivors_stop_the_round_with_the_reason(
    task_identity: None, contributions: dict[int, Contribution]
) -> None:
    cfg = load_config(None, SMALL)  # nothing is written; one federation for all (cached)
    _, secure, spec, sizes = _round(cfg)
    _, client = make_apps(cfg, "fedavg", SEED)
    fail = {101: Stage.SHARE_KEYS, 102: Stage.SHARE_KEYS}
    transport = _transport(DirectGrid(client, N, fail=fail), sizes)
    got = transport.send_secure(0, secure, spec)
    assert isinstance(got, RuntimeError)
    assert "share keys stage" in str(got) and "threshold" in str(got)


def _six_client_round(
    monkeypatch: pytest.MonkeyPatch, fail: dict[int, str], reconstruction: float | None
) -> tuple[dict[str, Any], bool, DirectGrid, list[int]]:
    """Round 0 of FedAvg under secure aggregation over 6 clients (m_min = 4 at the default
    secure_aggregation_threshold 2/3) through fedlore's round loop, the FlowerTransport and
    flwr's SecAgg+ on a :class:`DirectGrid` whose nodes ``fail`` answer that stage with an
    error; ``reconstruction``: ``SecAggSettings.reconstruction_threshold``. Returns the round's
    row, whether the model moved, the grid and how often the unmask stage ran."""
    n = 6
    cfg = load_config(None, [*SMALL, f"num_clients={n}"])
    fed = _federation(cfg.model_dump_json(), SEED, "cpu")
    algo = make_algorithm("fedavg", cfg)
    model = model_factory(cfg, fed, SEED)()
    state = start_server(algo, model, generator(SEED, 0), fed, "fedavg")
    privacy = make_privacy(cfg, algo, SEED)
    assert privacy is not None and privacy.min_survivors(n) == 4
    unmasked: list[int] = []
    unmask = _Workflow.unmask_stage

    def spy(self: _Workflow, *args: Any) -> bool:
        unmasked.append(len(args[2].active_node_ids))
        return bool(unmask(self, *args))

    monkeypatch.setattr(_Workflow, "unmask_stage", spy)
    _, client = make_apps(cfg, "fedavg", SEED)
    grid = DirectGrid(client, n, fail=fail)
    settings = dataclasses.replace(
        secagg_settings(cfg, "fedavg", fed.client), reconstruction_threshold=reconstruction
    )
    transport = FlowerTransport(grid, wait_for_nodes=0.0, expected_nodes=0, secagg=settings)
    loop = RoundLoop(algo, transport, lambda rnd: list(range(n)), privacy=privacy)
    new, row = loop.run_round(state, 0, 0)
    moved = any(not torch.equal(new.arrays[k], v) for k, v in state.arrays.items())
    return row, moved, grid, unmasked


def test_fewer_survivors_than_the_threshold_are_never_unmasked(
    task_identity: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6 clients, 3 drop out after sharing their keys: each node keeps the 3 live neighbours
    flwr's own threshold asks (t = round(0.5 * 6) = 3), so flwr alone would unmask a sum of 3;
    secure_aggregation_threshold's m_min is 4, so the round stops after collecting the masked
    vectors: the unmask stage never runs, the round is aborted and the model stays."""
    fail = {100 + c: Stage.COLLECT_MASKED_VECTORS for c in (1, 3, 5)}
    row, moved, grid, unmasked = _six_client_round(monkeypatch, fail, 0.5)
    assert row["secagg_aborted"] == 1 and row["accepted_clients"] == [] and not moved
    assert not unmasked and all(stage != Stage.UNMASK for stage, _ in grid.seen)
    assert all(
        c.state.config_records[RECORD_KEY_STATE]["threshold"] == 3 for c in grid.ctx.values()
    )
    (why, *rest) = row["rejected_reasons"]
    assert len(rest) == 5 and "collect masked vectors stage" in why, why
    assert "3 of 6 clients live, secure_aggregation_threshold needs 4" in why, why


@pytest.mark.parametrize(("reconstruction", "t"), [(0.5, 3), (None, 4)])
def test_survivors_at_the_threshold_complete(
    task_identity: None, monkeypatch: pytest.MonkeyPatch, reconstruction: float | None, t: int
) -> None:
    """6 clients, 2 drop out after sharing their keys: 4 = m_min survive and the round
    completes over them. Left unset, flwr's reconstruction threshold is secure_aggregation_
    threshold's share of a node's 6 share holders, ceil(2/3 * 6) = 4 (flwr's 0.5: 3)."""
    fail = {104: Stage.COLLECT_MASKED_VECTORS, 105: Stage.COLLECT_MASKED_VECTORS}
    row, moved, grid, unmasked = _six_client_round(monkeypatch, fail, reconstruction)
    assert row["secagg_aborted"] == 0 and row["accepted_clients"] == [0, 1, 2, 3] and moved
    assert unmasked == [4]
    assert all(
        c.state.config_records[RECORD_KEY_STATE]["threshold"] == t for c in grid.ctx.values()
    )


def test_a_secure_broadcast_outside_a_secagg_round_is_refused(
    task_identity: None, contributions: dict[int, Contribution]
) -> None:
    cfg = load_config(None, SMALL)  # nothing is written; one federation for all (cached)
    _, secure, _, sizes = _round(cfg)
    _, client = make_apps(cfg, "fedavg", SEED)
    transport = _transport(DirectGrid(client, N), sizes)
    replies = transport.send(0, secure)  # plain messages of a secure broadcast: no clear upload
    assert all(isinstance(r, RuntimeError) and "disagree" in str(r) for r in replies.values())
    assert not contributions


def test_adaptive_clipping_under_secagg_plus_sums_the_noised_bits(
    task_identity: None, contributions: dict[int, Contribution]
) -> None:
    """DP with adaptive clipping on Flower: each client's vector carries its noised bit b_i
    after the upload (L + 1 entries); the SecAgg+ mean's last entry is the mean of those bits,
    which moves the clip norm for the next round; the clipping range follows C_t."""
    cfg = load_config(None, [*SMALL, "weighting=uniform", "dp.clip_norm=0.05",
                             "dp.noise_multiplier=0.2", "dp.target_quantile=0.5",
                             "dp.clipped_count_stddev=0.2"])  # fmt: skip
    fed = _federation(cfg.model_dump_json(), SEED, "cpu")
    algo = make_algorithm("fedavg", cfg)
    model = model_factory(cfg, fed, SEED)()
    state = start_server(algo, model, generator(SEED, 0), fed, "fedavg")
    privacy = make_privacy(cfg, algo, SEED)
    assert privacy is not None and privacy.adaptive
    secure = privacy.configure(0, {c: algo.broadcast(state, 0, c) for c in range(N)})
    spec = algo.expected_reply(state, 0, 0)
    _, client = make_apps(cfg, "fedavg", SEED)
    settings = secagg_settings(cfg, "fedavg", fed.client)
    assert settings.follow_privacy
    transport = FlowerTransport(DirectGrid(client, N), wait_for_nodes=0.0, expected_nodes=0,
                                secagg=settings)  # fmt: skip
    got = transport.send_secure(0, secure, spec, privacy)
    assert isinstance(got, SecureSum), got
    assert got.mean.shape == (spec_length(spec) + 1,)
    bits = torch.stack([contributions[c].extras for c in got.clients]).mean()
    assert float(got.mean[-1]) == pytest.approx(float(bits), abs=1e-5)
    assert all(c.extras.numel() == 1 for c in contributions.values())
    _, metrics = privacy.from_mean(0, spec, got.mean, got.metrics, list(range(N)),
                                   torch.device("cpu"))  # fmt: skip
    assert metrics["dp_clip_norm"] == 0.05 and privacy.clip_norm != 0.05


def _local_dp_round(extra: list[str]) -> tuple[Config, Any, dict[int, Broadcast], Spec]:
    """Round 0 of FedAvg under local DP (C = 0.05, σ = 2): the config, its Privacy, the
    broadcasts with the run's ``privacy.*`` settings and the reply spec."""
    cfg = load_config(None, [*SMALL, "weighting=uniform", "dp.clip_norm=0.05", "dp.mode=local",
                             "dp.noise_multiplier=2", *extra])  # fmt: skip
    fed = _federation(cfg.model_dump_json(), SEED, "cpu")
    algo = make_algorithm("fedavg", cfg)
    model = model_factory(cfg, fed, SEED)()
    state = start_server(algo, model, generator(SEED, 0), fed, "fedavg")
    privacy = make_privacy(cfg, algo, SEED)
    assert privacy is not None and privacy.local
    msgs = privacy.configure(0, {c: algo.broadcast(state, 0, c) for c in range(N)})
    return cfg, privacy, msgs, algo.expected_reply(state, 0, 0)


def _noise_of_std(residual: torch.Tensor, std: float) -> bool:
    n = residual.numel()
    sd, mean = float(residual.std()), float(residual.mean())
    return abs(sd / std - 1) < 6 / math.sqrt(2 * n) and abs(mean) < 6 * std / math.sqrt(n)


def test_local_dp_noises_each_upload_inside_the_client_app(
    task_identity: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local DP on Flower without secure aggregation: the reply that leaves each ClientApp is its
    clipped update (noted as the ClientApp computes it) plus noise of std σC per coordinate,
    with no clip flag in the clear; a second round of the same broadcasts draws other noise."""
    cfg, _, msgs, _ = _local_dp_round(["secure_aggregation=false"])
    clipped: dict[int, torch.Tensor] = {}
    real = privatize

    def noted(reply: Reply, config: Scalars, noise: Any, rnd: int, cid: int) -> Reply:
        clipped[cid] = flatten(clip_upload(dict(reply.arrays), 0.05, 0.5)[0])
        return real(reply, config, noise, rnd, cid)

    monkeypatch.setattr("fedlore.privacy.privatize", noted)
    _, client = make_apps(cfg, "fedavg", SEED)
    transport = FlowerTransport(DirectGrid(client, N), wait_for_nodes=0.0, expected_nodes=0)
    got = transport.send(0, msgs)
    again = transport.send(0, msgs)
    assert sorted(clipped) == list(range(N))
    replies = [got[c] for c in range(N)]
    assert all(isinstance(r, Reply) for r in replies), replies
    residual = torch.cat([flatten(got[c].arrays) - clipped[c] for c in range(N)])  # type: ignore[union-attr]
    assert _noise_of_std(residual, 2 * 0.05)
    assert all("dp_clipped" not in got[c].metrics for c in range(N))  # type: ignore[union-attr]
    assert not torch.equal(flatten(got[0].arrays), flatten(again[0].arrays))  # type: ignore[union-attr]


def test_local_dp_under_secagg_plus_masks_each_clients_whole_noise(
    task_identity: None, contributions: dict[int, Contribution]
) -> None:
    """Local DP with SecAgg+: each client's contribution carries noise of std σC (not a share of
    it), the unmasked mean is the mean of those noised vectors, and the server adds nothing."""
    cfg, privacy, msgs, spec = _local_dp_round([])
    _, client = make_apps(cfg, "fedavg", SEED)
    settings = secagg_settings(
        cfg, "fedavg", _federation(cfg.model_dump_json(), SEED, "cpu").client
    )
    assert settings.follow_privacy
    transport = FlowerTransport(DirectGrid(client, N), wait_for_nodes=0.0, expected_nodes=0,
                                secagg=settings)  # fmt: skip
    got = transport.send_secure(0, msgs, spec, privacy)
    assert isinstance(got, SecureSum), got
    want = _expected(contributions, got.clients)
    assert (got.mean - want).abs().max().item() < 1e-3  # SecAgg+'s quantization
    assert all(float(c.vector.norm()) > 0.05 * 5 for c in contributions.values())  # noised
    _, metrics = privacy.from_mean(0, spec, got.mean, got.metrics, list(range(N)),
                                   torch.device("cpu"))  # fmt: skip
    assert metrics["dp_epsilon"] == local_epsilon(2.0, 1e-5, 1)


# ------------------------------------------------- FedPer, FedBN, FedRep, MOON and SCAFFOLD


@pytest.mark.parametrize("method", ["fedper", "fedbn", "fedrep", "moon", "scaffold"])
def test_personal_methods_sum_only_their_shared_increments_under_secagg_plus(
    task_identity: None, contributions: dict[int, Contribution], method: str
) -> None:
    """Two rounds of each method through fedlore's round loop, the FlowerTransport and SecAgg+
    on a :class:`DirectGrid` (in round 1 the ClientApps lay their own kept tensors, held in
    their node's ``Context.state``, over a broadcast without them; MOON contrasts with its
    previous model from there; SCAFFOLD its c_i, uploading Δy and Δc_i): each client masks
    exactly its shared increment (the reply
    spec's entries; no kept tensor, no training loss in the clear); each round's unmasked mean
    is the clients' weighted mean within SecAgg+'s quantization; the server's kept tensors stay
    its initialization; and the run ends where the in-process secure run ends."""
    from fedlore.algorithms.partial import PartialFedAvg
    from fedlore.engine.store import ClientStore
    from fedlore.engine.transport import LocalTransport
    from fedlore.tensors import select

    own = ["model.kwargs={hidden: [8], norm: batch}"] if method == "fedbn" else []
    cfg = load_config(None, [*SMALL, *own, f"algorithms=[{method}]", "rounds=2", "lr=0.1"])
    fed = _federation(cfg.model_dump_json(), SEED, "cpu")
    sizes = [fed.client(c).num_examples for c in range(N)]
    algo = make_algorithm(method, cfg)
    net = model_factory(cfg, fed, SEED)()
    start = start_server(algo, net, generator(SEED, 0), fed, method)
    kept = set(algo.local_names(net)) if isinstance(algo, PartialFedAvg) else set()
    assert bool(kept) == (method not in ("moon", "scaffold"))
    _, client = make_apps(cfg, method, SEED)
    transport = FlowerTransport(DirectGrid(client, N), wait_for_nodes=0.0, expected_nodes=0,
                                secagg=secagg_settings(cfg, method, fed.client))  # fmt: skip
    real = transport.send_secure
    checked: list[int] = []

    def checking(rnd: int, messages: Any, spec: Spec, privacy: Any = None) -> Any:
        got = real(rnd, messages, spec, privacy)
        assert isinstance(got, SecureSum), got
        assert not {k[len("update.") :] for k in spec} & kept
        assert all(c.vector.numel() == spec_length(spec) for c in contributions.values())
        assert all(set(m) <= set(CLEAR_METRICS) for m in got.metrics.values())
        err = (got.mean - _expected(contributions, got.clients)).abs().max().item()
        max_abs = max(c.vector.abs().max().item() for c in contributions.values())
        assert err <= transport.secagg.mean_error_bound(sizes, max_abs), (rnd, err)
        checked.append(rnd)
        return got

    transport.send_secure = checking  # type: ignore[method-assign]
    privacy = make_privacy(cfg, algo, SEED, max_weight=float(max(sizes)))
    loop = RoundLoop(algo, transport, lambda rnd: list(range(N)), privacy=privacy)
    state = start
    for rnd in range(2):
        state, row = loop.run_round(state, rnd, 1)
        assert row["accepted"] == N and row["secagg_aborted"] == 0 and row["train_loss"] is None
    assert checked == [0, 1]
    assert all(torch.equal(state.arrays["model." + k], start.arrays["model." + k]) for k in kept)
    # the in-process secure run (fedlore's own SecAgg, 50 fraction bits) ends at the same model
    here = make_privacy(cfg, algo, SEED, max_weight=float(max(sizes)))
    local = LocalTransport(algo, fed.client, model_factory(cfg, fed, SEED), SEED, ClientStore())
    loop = RoundLoop(algo, local, lambda rnd: list(range(N)), privacy=here)
    other = start
    for rnd in range(2):
        other, _ = loop.run_round(other, rnd, 1)
    moved = 0.0
    for k, v in select(other.arrays, "model.").items():
        if v.is_floating_point():
            torch.testing.assert_close(state.arrays["model." + k], v, rtol=0, atol=1e-5, msg=k)
            moved = max(moved, float((v - start.arrays["model." + k]).abs().max()))
    assert moved > 100 * 1e-5, moved  # the comparison is not of two models that stayed put


# ------------------------------------------------------------------ the loopback deployment


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


@pytest.mark.slow  # ~120 s on two cores (4 ClientApp process starts per node, one 40 s timeout)
def test_deployed_secagg_round_completes_without_a_supernode_that_dies(tmp_path: Path) -> None:
    """1 SuperLink + 3 SuperNodes, FedAvg under secure aggregation (flwr's SecAgg+), one
    round: SuperNode 1 kills itself in the collect-masked-vectors stage, after sharing its
    keys (node config ``fault-drop-round=0``); the round completes with clients 0 and 2 once
    the stage's timeout has passed, the dead node's masks removed with the survivors' shares of
    its key. Every SecAgg+ stage starts a ClientApp process per node, so the run takes about a
    minute and a half on two busy cores, most of it process starts and the one timeout."""
    victim = 1
    out_dir = tmp_path / "runs"
    overrides = " ".join(
        [
            f"num_clients={N}",
            "rounds=1",
            "local_steps=2",
            "progress=false",
            "secure_aggregation=true",
            # each stage's wait: the first ClientApp processes of a busy machine are slow to
            # start; the collect stage waits it out for the dead node
            "flower.round_timeout_s=40",
            "flower.wait_for_nodes_s=60",
            f"output_dir={out_dir}",
            "model.kwargs.hidden=[16]",
        ]
    )
    fed = LoopbackFederation(
        tmp_path / "fed", num_nodes=N, node_config={victim: f"{DROP_ROUND_KEY}=0"}
    )
    try:
        fed.start()
        fed.submit(ROOT / "experiments" / "quickstart.yaml", "fedavg", SEED, overrides)
        metrics = out_dir / "quickstart" / "fedavg" / f"seed-{SEED}" / "metrics.jsonl"
        summary = metrics.with_name("summary.json")
        deadline = time.monotonic() + 300
        while not summary.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert summary.exists(), "the deployed run did not finish; see " + str(fed.work)
        assert fed.nodes[victim].poll() is not None  # the SuperNode itself is gone
    finally:
        fed.close()
    (row,) = _rows(metrics)
    assert row["accepted_clients"] == [0, 2] and row["aggregated"] == 2
    assert row["rejected_reasons"] == [f"{victim}: dropped out of the secure sum"]
    assert row["secagg_dropped"] == 1
    assert row["bytes_up"] > 0  # the two masked vectors
    result = json.loads(summary.read_text())
    assert result["rounds"] == 1 and result["final_accuracy"] > 0.0


@pytest.mark.parametrize(
    ("extra", "warned"),
    [
        (["secure_aggregation=false"], False),  # a plain Flower run: nothing is clipped
        ([], True),  # SecAgg+ with nothing bounding the uploads: the warning holds
        (["flower.secagg_clipping_range=4.0"], False),  # the user set the range
        (["weighting=uniform", "dp.clip_norm=1.0", "dp.noise_multiplier=0.5"], False),  # C_t
    ],
)
def test_the_clipping_warning_is_said_only_when_it_holds(
    monkeypatch: pytest.MonkeyPatch, extra: list[str], warned: bool
) -> None:
    said: list[str] = []
    monkeypatch.setattr(
        "fedlore.flower.secure.say_once", lambda msg, *a: said.append(msg % a if a else msg)
    )
    settings = secagg_settings(load_config(None, [*SMALL, *extra]), "fedavg")
    assert any("clipped to [-1, 1]" in s for s in said) is warned
    assert settings.clipping_range == (4.0 if "flower.secagg_clipping_range=4.0" in extra else 1.0)
