"""Diagnostics in real runs (seed Appendix D, "Diagnostics").

* they observe without changing training: every non-diagnostic metric of a run with
  diagnostics on equals the run with them off, and the candidate gradients they need are counted
  as ``diag_bytes_up``, never in ``bytes_up``;
* FedLore: retained energy is ``‖Π G‖² / ‖G‖²`` of the broadcast basis, the Proposition 2
  certificate bounds the residual every measured round after the first;
* Local GaLore: ``b``, ``⟨G, A G + b⟩`` and the spectrum of ``A`` equal their dense definitions
  rebuilt from the same per-client gradients, and Theorem 3's ``‖b‖² ≤ v Σ p_i ‖G_i − G‖²``;
* FedLore's retained energy, residual, ``‖G‖²`` and heterogeneity recomputed by hand, outside
  :class:`Diagnoser`, from a saved run (its checkpoint's model and basis, every client's whole
  training split as the diagnostic batch, weights ``n_i / Σ n_j``), as the docs define them;
* a run killed mid-way resumes to the same diagnostics; ``fedlore report`` tables and plots
  them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.algorithms.local_galore import LocalGaLore
from fedlore.config import Config, load_config
from fedlore.data.federation import build_federation
from fedlore.diagnostics import Diagnoser, mixture_eigenvalues, normalized
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.results.report import report
from fedlore.seeding import SERVER_INIT, generator
from fedlore.trained import load_trained

SEED = 5
ROUNDS = 4


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(
        None,
        [
            "name=diag",
            "num_clients=4",
            f"rounds={ROUNDS}",
            "local_steps=3",
            "batch_size=16",
            "lr=3e-3",
            "rank=4",
            "model.kwargs={hidden: [32, 16]}",
            "partition.alpha=0.1",
            "partition.min_size=10",
            "progress=false",
            "diagnostics.batch_size=32",
            f"output_dir={out}",
            *extra,
        ],
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _training_view(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in row.items()
        if not k.startswith("diag") and not k.endswith("_s") and k != "diag_s"
    }


@pytest.mark.parametrize(
    "method", ["fedlore", "local_galore", "fedfull", "fedlore_random", "fedlore_sketch"]
)
def test_diagnostics_do_not_change_training(tmp_path: Path, method: str) -> None:
    on, off = _cfg(tmp_path / "on", "diagnostics.every=1"), _cfg(tmp_path / "off")
    run_one(on, method, SEED)
    run_one(off, method, SEED)
    a = _rows(run_dir(on, method, SEED) / "metrics.jsonl")
    b = _rows(run_dir(off, method, SEED) / "metrics.jsonl")
    assert [_training_view(r) for r in a] == [_training_view(r) for r in b]
    measured = [r for r in a if r["round"] >= 0]
    assert all("diag.grad_norm2" in r and r["diag_s"] > 0 for r in measured)
    assert not any(k.startswith("diag") for r in b for k in r)
    if method == "fedlore":  # candidate gradients travel in rounds 0..T-2 only, counted apart
        assert all(r.get("diag_bytes_up", 0) > 0 for r in a if 0 <= r["round"] < ROUNDS - 1)
        assert a[-1].get("diag_bytes_up", 0) == 0
    else:
        assert all(r.get("diag_bytes_up", 0) == 0 for r in a)
    if method in ("fedlore", "local_galore", "fedlore_random", "fedlore_sketch"):
        for r in measured:
            assert 0.0 <= r["diag.retained_energy"] <= 1.0 + 1e-9
            assert r["diag.rho2"] == pytest.approx(
                r["diag.grad_norm2"] * (1 - r["diag.retained_energy"]), rel=1e-6, abs=1e-12
            )
    else:
        assert "diag.retained_energy" not in measured[0]


def test_fedlore_certificate_bounds_residual_every_round(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "diagnostics.every=1", f"rounds={ROUNDS + 2}")
    run_one(cfg, "fedlore", SEED)
    rows = [r for r in _rows(run_dir(cfg, "fedlore", SEED) / "metrics.jsonl") if r["round"] >= 0]
    assert "diag.certificate2" not in rows[0]  # round 0's basis comes from the setup exchange
    for r in rows[1:]:
        assert r["diag.rho2"] <= r["diag.certificate2"] + 1e-12, r["round"]
        assert r["diag.d_r"] >= 0 and r["diag.eps_loc2"] >= 0 and r["diag.delta2"] > 0
        assert r["diag.inner"] == pytest.approx(
            r["diag.grad_norm2"] * r["diag.retained_energy"], rel=1e-9
        )


def test_certificate2_sums_each_matrix_bound_squared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs (diagnostics, outputs): ``diag.certificate2`` is Σ_k R_k² over the projected
    matrices, each R_k = ε_loc,k + M_k √(d_r,k + ε_eig,k) + δ_k from that matrix's own terms,
    while the row's ``eps_loc2``, ``d_r``, ``eps_eig`` and ``delta2`` are sums over matrices
    and ``M`` the largest: the bound with the row's values plugged in is another, looser
    number."""
    import fedlore.diagnostics as diagnostics

    seen: list[tuple[dict[str, float], float]] = []
    original = diagnostics.certificate_bound

    def spy(stats: dict[str, float], delta: float) -> float:
        seen.append((dict(stats), delta))
        return original(stats, delta)

    monkeypatch.setattr(diagnostics, "certificate_bound", spy)
    # a randomized server SVD without power iterations misses part of A's top-r mass, so
    # ε_eig is positive and the row's sum can be told from one matrix's
    cfg = _cfg(
        tmp_path,
        "diagnostics.every=1",
        "rounds=2",
        "method.fedlore.server_basis=randomized",
        "method.fedlore.svd_niter=0",
    )
    run_one(cfg, "fedlore", SEED)
    row = _rows(run_dir(cfg, "fedlore", SEED) / "metrics.jsonl")[-1]
    assert row["round"] == 1 and len(seen) == 2  # one call per projected matrix, round 1 only
    per_matrix = [
        (math.sqrt(s["eps_loc2"]) + s["M"] * math.sqrt(s["d_r"] + s["eps_eig"]) + d) ** 2
        for s, d in seen
    ]
    assert row["diag.certificate2"] == pytest.approx(sum(per_matrix), rel=1e-12)
    assert row["diag.eps_loc2"] == pytest.approx(sum(s["eps_loc2"] for s, _ in seen), rel=1e-12)
    assert row["diag.d_r"] == pytest.approx(sum(s["d_r"] for s, _ in seen), rel=1e-12)
    assert row["diag.M"] == max(s["M"] for s, _ in seen)
    assert row["diag.eps_eig"] == pytest.approx(sum(s["eps_eig"] for s, _ in seen), rel=1e-12)
    assert row["diag.eps_eig"] > 1e-6  # positive: a wrong sum shows
    assert row["diag.delta2"] == pytest.approx(sum(d * d for _, d in seen), rel=1e-12)
    plugged = (
        math.sqrt(row["diag.eps_loc2"])
        + row["diag.M"] * math.sqrt(row["diag.d_r"] + row["diag.eps_eig"])
        + math.sqrt(row["diag.delta2"])
    ) ** 2
    assert row["diag.rho2"] <= row["diag.certificate2"] < plugged


def test_every_d_rounds_and_sampled_clients(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        "diagnostics.every=2",
        "diagnostics.clients=sampled",
        "participation=0.5",
        f"rounds={ROUNDS + 1}",
    )
    run_one(cfg, "fedlore", SEED)
    rows = _rows(run_dir(cfg, "fedlore", SEED) / "metrics.jsonl")
    measured = [r["round"] for r in rows if "diag.grad_norm2" in r]
    assert measured == [0, 2, 4]
    assert all(r["diag.clients"] == 2 for r in rows if "diag.clients" in r)
    uploads = [r["round"] for r in rows if r.get("diag_bytes_up", 0) > 0]
    assert uploads == [1, 3]  # the rounds before a measured one
    assert all("diag.certificate2" in r for r in rows if r["round"] in (2, 4))


def test_local_galore_quantities_match_their_definitions(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "diagnostics.every=1")
    fed = build_federation(cfg, SEED)
    algo = make_algorithm("local_galore", cfg)
    assert isinstance(algo, LocalGaLore)
    model = model_factory(cfg, fed, SEED)()
    state = algo.init_server(model, generator(SEED, SERVER_INIT))
    diag = Diagnoser(algo, model, fed.client, fed.num_clients, 1, 32, "all", SEED, cfg.rank)
    got = diag(state, 0, [])
    # dense recomputation from the same per-client gradients and bases
    grads, weights = zip(*(diag._gradient(c) for c in range(fed.num_clients)), strict=True)
    p = normalized(list(weights))
    b2 = inner = retained = het = tr = 0.0
    v = 0.0
    for k in diag.plan:
        gs = [g[k] for g in grads]
        zero_g = torch.zeros_like(gs[0])
        g_mean = sum((w * g for g, w in zip(gs, p, strict=True)), zero_g)
        bases = [
            algo.diagnostic_bases(state, 0, {k: g.float()}, generator(0))[k].double() for g in gs
        ]
        projs = [q @ q.t() for q in bases]
        a = sum((w * pr for pr, w in zip(projs, p, strict=True)), torch.zeros_like(projs[0]))
        b = sum(
            (w * (pr - a) @ (g - g_mean) for pr, g, w in zip(projs, gs, p, strict=True)), zero_g
        )
        b2 += float(b.pow(2).sum())
        inner += float((g_mean * (a @ g_mean + b)).sum())
        retained += float((g_mean * (a @ g_mean)).sum())
        het += sum(w * float((g - g_mean).pow(2).sum()) for g, w in zip(gs, p, strict=True))
        gap = torch.linalg.eigvalsh(a - a @ a)
        v = max(v, float(gap.max()))
        tr += float(torch.trace(a - a @ a))
        assert torch.allclose(
            mixture_eigenvalues(bases, list(weights)),
            torch.linalg.eigvalsh(a).flip(0)[: min(a.shape[0], len(bases) * cfg.rank)].clamp(0, 1),
            atol=1e-6,
        )
    assert got["diag.b_norm2"] == pytest.approx(b2, rel=1e-6)
    assert got["diag.inner"] == pytest.approx(inner, rel=1e-6)
    assert got["diag.retained_energy"] == pytest.approx(retained / got["diag.grad_norm2"], rel=1e-6)
    assert got["diag.heterogeneity"] == pytest.approx(het, rel=1e-6)
    assert got["diag.v"] == pytest.approx(v, abs=1e-6)
    assert got["diag.trace"] == pytest.approx(tr, abs=1e-5)
    assert 0 < got["diag.b_norm2"] <= got["diag.v"] * got["diag.heterogeneity"]  # Theorem 3
    assert 0 < got["diag.v"] <= 0.25 + 1e-9


def test_fedlore_diagnostics_recomputed_from_a_saved_run(tmp_path: Path) -> None:
    """docs/explanation/methods/diagnostics.md by hand: a run of one round saves W^1 and the
    basis P^1 round 1 trains in; with a diagnostic batch larger than every client, G_i is the
    gradient of the client's mean loss over its whole training split, G = Σ n_i G_i / Σ n_j, and
    round 1 of the same run with two rounds reports ‖P^1ᵀ G‖² / ‖G‖², ‖G‖² − ‖P^1ᵀ G‖², ‖G‖² and
    Σ p_i ‖G_i − G‖² over the projected matrices."""
    extra = ("diagnostics.every=1", "diagnostics.batch_size=100000")
    one = _cfg(tmp_path / "one", *extra, "rounds=1")
    two = _cfg(tmp_path / "two", *extra, "rounds=2")
    run_one(one, "fedlore", SEED)
    run_one(two, "fedlore", SEED)
    row = _rows(run_dir(two, "fedlore", SEED) / "metrics.jsonl")[-1]
    assert row["round"] == 1
    saved = load_trained(run_dir(one, "fedlore", SEED))
    _, state, _ = Checkpointer.load(run_dir(one, "fedlore", SEED) / "checkpoint.pt")
    basis_id = int(state.values["basis_id"])
    prefix = f"bank.{basis_id}."
    plan = {k[len(prefix) :] for k in state.arrays if k.startswith(prefix)}
    assert plan and basis_id == 1
    model = saved.model.double().train()
    params = dict(model.named_parameters())
    sizes: list[int] = []
    grads: list[dict[str, torch.Tensor]] = []
    for cid in range(saved.fed.num_clients):
        data = saved.fed.client(cid).train
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(data.x.double()), data.y).backward()
        sizes.append(len(data.y))
        grads.append({k: torch.as_tensor(params[k].grad).detach().clone() for k in plan})
    p = [n / sum(sizes) for n in sizes]
    g = {k: torch.stack([w * gi[k] for w, gi in zip(p, grads, strict=True)]).sum(0) for k in plan}
    g2 = sum(float(v.pow(2).sum()) for v in g.values())
    kept = sum(float((state.arrays[prefix + k].double().t() @ g[k]).pow(2).sum()) for k in plan)
    het = sum(
        w * sum(float((gi[k] - g[k]).pow(2).sum()) for k in plan)
        for w, gi in zip(p, grads, strict=True)
    )
    assert row["diag.grad_norm2"] == pytest.approx(g2, rel=1e-5)
    assert row["diag.heterogeneity"] == pytest.approx(het, rel=1e-5)
    assert row["diag.retained_energy"] == pytest.approx(kept / g2, rel=1e-5)
    assert row["diag.rho2"] == pytest.approx(g2 - kept, rel=1e-5)
    assert 0.05 < kept / g2 < 0.95  # a measurement, not a degenerate case


def test_resume_reproduces_diagnostics(tmp_path: Path) -> None:
    ref = _cfg(tmp_path / "ref", "diagnostics.every=2")
    run_one(ref, "fedlore", SEED)
    cfg = _cfg(tmp_path / "killed", "diagnostics.every=2")
    assert run_one(cfg, "fedlore", SEED, stop_after=1) is None  # the certificate state is pending
    _, state, _ = Checkpointer.load(run_dir(cfg, "fedlore", SEED) / "checkpoint.pt")
    assert state.values.get("diag.for_round") == 2
    run_one(cfg, "fedlore", SEED, resume=True)
    a = _rows(run_dir(cfg, "fedlore", SEED) / "metrics.jsonl")
    b = _rows(run_dir(ref, "fedlore", SEED) / "metrics.jsonl")
    strip = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in a]
    assert strip == [{k: v for k, v in r.items() if not k.endswith("_s")} for r in b]


def test_report_tables_and_plots_diagnostics(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "diagnostics.every=1", "algorithms=[fedlore, local_galore, fedfull]")
    for m in cfg.algorithms:
        run_one(cfg, m, SEED)
    text = report(tmp_path / "diag")
    assert "## Diagnostics" in text
    table = text.split("## Diagnostics")[1]
    assert "| fedlore |" in table and "| local_galore |" in table
    assert "| fedfull |" not in table  # no projector, nothing to diagnose
    assert (tmp_path / "diag" / "diag.retained_energy_vs_round.png").stat().st_size > 0
    assert (tmp_path / "diag" / "diag.b_norm2_vs_round.png").stat().st_size > 0
