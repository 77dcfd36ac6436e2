"""Bytes per round of every LoRA baseline against the reference notes' section 14 formulas.

Counted by the round loop from the tensors actually sent, per m x n adapted matrix (fp32):
FedIT, LoRA-FAIR, FRLoRA r(m+n) up and down; FFA-LoRA mr both ways; RoLoRA the trained factor up
(mr in B-rounds, rn in A-rounds) and the factor the previous round moved down; FlexLoRA r_k(m+n)
both ways; FLoRA r_k(m+n) up and (Σ_k r_k)(m+n) down. On top: the dense head both ways every
round, and at first contact the frozen base (mn) and the initial adapter. Dense: every parameter
neither adapted nor frozen (the adapted layer's bias m and the head), as for FedLore.
"""

from __future__ import annotations

import pytest
import torch

from fedlore.algorithms.lora_common import LoraMethod
from fedlore.config import Config, load_config
from fedlore.data.federation import build_federation
from fedlore.engine.loop import RoundLoop, validate_reply
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.seeding import CLIENT, SERVER_INIT, generator
from fedlore.tensors import nbytes
from fedlore.types import State

SEED, N, R, ROUNDS = 3, 3, 2, 3
M, NIN, CLASSES = 16, 64, 10  # body.0 = Linear(64, 16); head = Linear(16, 10)
DENSE = CLASSES * M + CLASSES + M  # head + the adapted layer's bias
BASE = M * NIN
F32 = 4


def _cfg(*extra: str) -> Config:
    return load_config(
        None,
        [
            "name=lora-bytes",
            f"num_clients={N}",
            f"rounds={ROUNDS}",
            "local_steps=1",
            "batch_size=16",
            f"rank={R}",
            f"model.kwargs={{hidden: [{M}]}}",
            "partition.min_size=10",
            "progress=false",
            *extra,
        ],
    )


def section14(name: str, rnd: int, r: int = R, stack: int = N * R) -> tuple[int, int]:
    """(upload, download) scalars of the adapter per client for one m x n matrix, round >= 1."""
    mn = r * (M + NIN)
    if name in ("fedit", "lora_fair", "frlora", "flexlora"):
        return mn, mn
    if name == "ffa_lora":
        return M * r, M * r
    if name == "rolora":  # even rounds train B (mr up), receive A moved in the A-round before
        return (M * r, r * NIN) if rnd % 2 == 0 else (r * NIN, M * r)
    if name == "flora":
        return mn, stack * (M + NIN)
    raise KeyError(name)


FIRST_ADAPTER = {  # the adapter sent with the base at first contact (round 0)
    "fedit": R * (M + NIN),
    "ffa_lora": R * (M + NIN),
    "lora_fair": R * (M + NIN),
    "rolora": R * (M + NIN),
    "flexlora": R * (M + NIN),
    "frlora": R * (M + NIN),
    "flora": 0,
}


@pytest.mark.parametrize("name", sorted(FIRST_ADAPTER))
def test_bytes_per_round_match_section_14(name: str) -> None:
    cfg = _cfg()
    fed = build_federation(cfg, SEED)
    algo = make_algorithm(name, cfg)
    build = model_factory(cfg, fed, SEED)
    state = algo.init_server(build(), generator(SEED, SERVER_INIT))
    loop = RoundLoop(
        algo, LocalTransport(algo, fed.client, build, SEED, ClientStore()), lambda _: [0, 1, 2]
    )
    for rnd in range(ROUNDS):
        state, row = loop.run_round(state, rnd, ROUNDS - 1)
        assert row["rejected"] == 0, row.get("rejected_reasons")
        up, down = section14(name, rnd)
        if rnd == 0:
            down = BASE + FIRST_ADAPTER[name]
        assert row["bytes_up"] == N * F32 * (up + DENSE), rnd
        assert row["bytes_down"] == N * F32 * (down + DENSE), rnd


@pytest.mark.parametrize("name", ["flexlora", "flora"])
def test_heterogeneous_ranks_bytes_per_client(name: str) -> None:
    """Client k of rank r_k: r_k(m+n) up; down r_k(m+n) (FlexLoRA) or the whole stack (FLoRA).
    Driven by hand because the round loop validates every reply against one shape per round."""
    ranks = (1, 2, 3)
    cfg = _cfg(f"method.{name}.client_ranks=[1, 2, 3]")
    algo = make_algorithm(name, cfg)
    assert isinstance(algo, LoraMethod) and algo.client_ranks == ranks  # type: ignore[attr-defined]
    fed = build_federation(cfg, SEED)
    scratch = model_factory(cfg, fed, SEED)()
    state: State = algo.init_server(scratch, generator(SEED, SERVER_INIT))
    store: dict[int, State] = {}
    for rnd in range(ROUNDS):
        msgs = {c: algo.broadcast(state, rnd, c) for c in range(N)}
        replies = []
        for c in range(N):
            reply, store[c] = algo.client_update(
                msgs[c], store.get(c), scratch, fed.client(c), generator(SEED, CLIENT, rnd, c)
            )
            assert validate_reply(reply, algo.expected_reply(state, rnd, c)) is None
            replies.append((c, reply))
            up, down = section14(name, rnd, ranks[c], sum(ranks))
            assert nbytes(reply.arrays) == F32 * (up + DENSE)
            if rnd == 0:
                down = BASE + (ranks[c] * (M + NIN) if name == "flexlora" else 0)
            assert nbytes(msgs[c].arrays) == F32 * (down + DENSE), (rnd, c)
        state, _ = algo.aggregate(state, [(c, r) for c, r in replies], rnd)
    assert all(torch.isfinite(v).all() for v in algo.global_arrays(state).values())
