"""FedLore with a server optimizer (:mod:`fedlore.optim.server`, issue 34): the step taken in
the shared ``r x n`` coordinates, so every client cache stays the server's model, and the first
moments carried into the new coordinates when the basis is refreshed."""

from __future__ import annotations

import pytest
import torch
from test_fedlore_sync import assert_bitwise, fedlore, run_rounds
from tiny_federation import RANK, SIZES

from fedlore.optim.server import rotate_first_moments


@pytest.mark.parametrize("kind", ["momentum", "adam", "yogi"])
def test_fedlore_steps_in_its_shared_coordinates_and_caches_stay_the_servers_model(
    kind: str,
) -> None:
    """FedLore with a server optimizer: the moments of each projected matrix are ``r x n`` (the
    shared coordinates), every client's cache is bit for bit the server's model in every round
    (partial participation, returning clients caught up from the log), and the trajectory
    differs from plain FedLore's."""
    rounds = 5
    settings = {"server_optimizer": kind, "server_eta": 0.5, "log_rounds": 50, "rounds": 6}
    run = run_rounds(fedlore(**settings), rounds, per_round=2)
    for rnd in range(rounds):
        for cid, cache in run.transport.caches[rnd].items():
            assert_bitwise(cache, run.globals_at[rnd], f"round {rnd} client {cid}")
    moments = {k: v for k, v in run.state.arrays.items() if k.startswith("sopt.m.")}
    assert moments["sopt.m.fc1.weight"].shape[0] == RANK  # r x n: the shared coordinates
    assert int(run.state.values["sopt.t"]) == rounds
    plain = run_rounds(fedlore(log_rounds=50, rounds=6), rounds, per_round=2)
    final, base = run.algo.global_arrays(run.state), plain.algo.global_arrays(plain.state)
    assert not torch.equal(final["fc1.weight"], base["fc1.weight"])
    assert len(SIZES) > 2  # some clients missed rounds and were caught up


def test_a_refresh_carries_the_first_moment_into_the_new_coordinates() -> None:
    g = torch.Generator().manual_seed(0)
    p_old, _ = torch.linalg.qr(torch.randn(6, 2, generator=g, dtype=torch.float64))
    m = torch.randn(2, 3, generator=g, dtype=torch.float64)
    same = rotate_first_moments({"sopt.m.w": m, "sopt.v.w": m * m}, {"w": p_old}, {"w": p_old})
    assert torch.allclose(same["sopt.m.w"], m) and torch.equal(same["sopt.v.w"], m * m)
    swap = p_old[:, [1, 0]]  # the same subspace, columns swapped: the coordinates swap
    got = rotate_first_moments({"sopt.m.w": m}, {"w": p_old}, {"w": swap})
    assert torch.allclose(got["sopt.m.w"], m[[1, 0]])
    # P_new m_new is the projection of P_old m onto the new subspace
    p_new, _ = torch.linalg.qr(torch.randn(6, 2, generator=g, dtype=torch.float64))
    got = rotate_first_moments({"sopt.m.w": m}, {"w": p_old}, {"w": p_new})
    want = p_new @ p_new.T @ (p_old @ m)
    assert torch.allclose(p_new @ got["sopt.m.w"], want)
