"""Randomized subspace construction: seeded, close to exact, selectable on client and server."""

from __future__ import annotations

import torch

from fedlore.algorithms.fedlore import FedLore
from fedlore.config import load_config
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.optim.subspace import average_projectors, projector_distance, random_basis


def test_randomized_server_basis_matches_exact_and_is_seeded() -> None:
    cands = [random_basis(s, 300, 4) for s in range(6)]
    shared = random_basis(99, 300, 2)
    cands = [torch.linalg.qr(torch.cat([shared, c[:, :2]], 1))[0] for c in cands]
    w = [1.0, 2.0, 1.0, 3.0, 1.0, 1.0]
    exact = average_projectors(cands, w, 2, "svd")
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    r1 = average_projectors(cands, w, 2, "randomized", generator=g1)
    r2 = average_projectors(cands, w, 2, "randomized", generator=g2)
    assert torch.equal(r1, r2)  # same seed, same basis
    assert projector_distance(r1, exact) < 1e-2  # 2 power iterations, spectral gap ~3
    assert projector_distance(exact, shared) < 1e-5  # the common directions win


def test_fedlore_runs_with_randomized_client_and_server_svd(tmp_path) -> None:
    cfg = load_config(
        None,
        [
            "rounds=2",
            "num_clients=3",
            "local_steps=2",
            "progress=false",
            f"output_dir={tmp_path}",
            "algorithms=[fedlore]",
            "method.fedlore.candidate_svd=randomized",
            "method.fedlore.server_basis=randomized",
            "method.fedlore.svd_niter=1",
        ],
    )
    algo = make_algorithm("fedlore", cfg)
    assert isinstance(algo, FedLore)
    assert (algo.candidate_svd, algo.server_basis, algo.svd_niter) == ("randomized",) * 2 + (1,)
    a = run_one(cfg, "fedlore", 3)
    b = run_one(cfg.model_copy(update={"output_dir": str(tmp_path / "again")}), "fedlore", 3)
    assert a is not None and b is not None
    assert a["final_accuracy"] == b["final_accuracy"]  # seeded: reproducible
    assert a["rejected_total"] == 0
