"""Client candidate bases: exact vs randomized vs warm-started subspace iteration (not a test).

Two parts, every route timed side by side in one process (interleaved, each measure repeated
three times, the median reported):

* ``real``: gradients from REAL FedLore runs (the CNN on Fashion-MNIST as in
  ``benchmarks/round_time.py``, and the 0.93 M LLaMA of ``experiments/pretrain_table3.yaml``).
  The run trains with exact candidates (``candidate_svd=exact``); every client's last finite
  local gradient ``G`` (the matrix its candidate is taken from) and its then-current basis ``P^t``
  are captured in every round after the setup exchange. Per matrix shape: time per candidate and
  captured energy ``‖P̂ᵀG‖_F² / ‖G‖_F²`` relative to the exact top-r (the median and the worst
  case over the captures), and the share of captures within 0.1 % of exact.
* ``synthetic``: gradient-like matrices (sigma_j = j^-1 plus noise); the subspace route starts
  from the exact basis rotated by about 0.3 rad (a warm start near the answer).

Routes: ``exact`` (the seed's TopLeftSVD in float64: eigh of A Aᵀ, or the SVD of a tall A), the
same in float32 (``compute_dtype``; an option, not the seed's rule), the seeded randomized range
finder, and ``subspace`` (:func:`fedlore.optim.subspace.subspace_iteration` from ``P^t``) with
p extra sketch columns and q power iterations.

    python benchmarks/subspace.py [--rounds 3] [--threads 1] [--skip-real] [--skip-llama]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

import fedlore.algorithms.lowrank as lowrank_mod
from fedlore.checks import setup_rounds
from fedlore.config import load_config
from fedlore.data.federation import build_federation
from fedlore.engine.loop import RoundLoop
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.optim.subspace import captured_energy, projector_distance, top_left_singular
from fedlore.seeding import SERVER_INIT, generator

F64, F32 = torch.float64, torch.float32
# (label, method, oversample p, iterations q, compute dtype)
ROUTES: list[tuple[str, str, int, int, torch.dtype]] = [
    ("exact f64 (seed)", "exact", 0, 0, F64),
    ("exact f32", "exact", 0, 0, F32),
    ("randomized p=10 q=2", "randomized", 10, 2, F64),
    ("subspace p=0 q=0", "subspace", 0, 0, F32),
    ("subspace p=0 q=1", "subspace", 0, 1, F32),
    ("subspace p=0 q=2", "subspace", 0, 2, F32),
    ("subspace p=0 q=4", "subspace", 0, 4, F32),
    ("subspace p=10 q=1", "subspace", 10, 1, F32),
    ("subspace p=10 q=2", "subspace", 10, 2, F32),
    ("subspace p=10 q=2 f64", "subspace", 10, 2, F64),
]
CNN = [
    "data.name=fashion_mnist",
    "model.name=cnn",
    "num_clients=10",
    "local_steps=10",
    "rank=8",
    "partition.name=iid",
    "batch_size=32",
]


def capture(config: Path | None, overrides: list[str], rounds: int) -> list[dict[str, Any]]:
    """Run FedLore (exact candidates) for ``rounds`` rounds; return every client candidate's
    gradient view ``G`` (m x n), current basis ``P^t`` (m x r) and rank, in call order."""
    cfg = load_config(
        config,
        [
            *overrides,
            "progress=false",
            "checkpoint=false",
            f"rounds={rounds}",
            "algorithms=fedlore",
            "method.fedlore.candidate_svd=exact",  # the seed's candidates (the default is auto)
        ],
    )
    fed = build_federation(cfg, 0)
    algo = make_algorithm("fedlore", cfg)
    build = model_factory(cfg, fed, 0)
    got: list[dict[str, Any]] = []
    original = lowrank_mod.top_left_singular

    def recorder(mat: torch.Tensor, rank: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        warm = kwargs.get("warm")  # FedLore passes it by keyword
        if warm is not None:  # a client's candidate in a training round (not the setup)
            got.append({"G": mat.detach().clone(), "P": warm.detach().clone(), "rank": rank})
        return original(mat, rank, *args, **kwargs)

    lowrank_mod.top_left_singular = recorder
    try:
        transport = LocalTransport(algo, fed.client, build, 0, ClientStore())
        loop = RoundLoop(
            algo, transport, lambda r: sample_clients(cfg.num_clients, cfg.num_clients, 0, r)
        )
        state = algo.init_server(build(), generator(0, SERVER_INIT))
        for rnd in range(-setup_rounds(algo), rounds):
            state, _ = loop.run_round(state, rnd, rounds - 1)
    finally:
        lowrank_mod.top_left_singular = original
    return got


def route(mat: torch.Tensor, rank: int, warm: torch.Tensor | None, r: tuple) -> torch.Tensor:
    _, method, over, it, cdt = r
    return top_left_singular(
        mat,
        rank,
        method,
        torch.Generator().manual_seed(0),
        oversample=over if method != "exact" else 10,
        niter=it,
        warm=warm,
        compute_dtype=cdt,
    )


def evaluate(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape and route: median ms per candidate (median of 3 interleaved repetitions of
    the whole set), and energy relative to exact (median, min, share >= 0.999)."""
    by_shape: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in cases:
        by_shape["x".join(map(str, c["G"].shape)) + f" r={c['rank']}"].append(c)
    rows = []
    for shape, group in by_shape.items():
        exact = [route(c["G"], c["rank"], c["P"], ROUTES[0]) for c in group]
        e_exact = [captured_energy(b, c["G"]) for b, c in zip(exact, group, strict=True)]
        times: dict[str, list[float]] = defaultdict(list)
        for _ in range(3):  # repetitions; routes interleaved inside each
            for r in ROUTES:
                t = time.perf_counter()
                for c in group:
                    route(c["G"], c["rank"], c["P"], r)
                times[r[0]].append((time.perf_counter() - t) / len(group))
        for r in ROUTES:
            ratios, dists = [], []
            for c, ex, ee in zip(group, exact, e_exact, strict=True):
                b = route(c["G"], c["rank"], c["P"], r)
                ratios.append(captured_energy(b, c["G"]) / ee)
                dists.append(projector_distance(b, ex))
            rows.append(
                {
                    "shape": shape,
                    "captures": len(group),
                    "route": r[0],
                    "ms": 1e3 * statistics.median(times[r[0]]),
                    "energy_median": statistics.median(ratios),
                    "energy_min": min(ratios),
                    "within_0.1%": sum(x >= 0.999 for x in ratios) / len(ratios),
                    "dist_median": statistics.median(dists),
                    "exact_energy_median": statistics.median(e_exact),
                }
            )
    return rows


def gradient_like(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = min(m, n, 64)
    u = torch.linalg.qr(torch.randn(m, k, generator=g))[0]
    v = torch.linalg.qr(torch.randn(n, k, generator=g))[0]
    s = 1.0 / torch.arange(1, k + 1, dtype=torch.float32)
    return (u * s) @ v.t() + 1e-3 * torch.randn(m, n, generator=g)


def synthetic(rank: int) -> list[dict[str, Any]]:
    """Gradient-like matrices with a warm start 0.3 rad away from their exact basis."""
    cases = []
    for m, n in [(64, 64), (256, 256), (512, 3136), (1024, 4096)]:
        mat = gradient_like(m, n, 0)
        exact = top_left_singular(mat, rank, dtype=F64)
        g = torch.Generator().manual_seed(1)
        perp = torch.randn(m, rank, dtype=F64, generator=g)
        perp -= exact @ (exact.t() @ perp)
        perp = torch.linalg.qr(perp)[0]
        warm = torch.cos(torch.tensor(0.3)) * exact + torch.sin(torch.tensor(0.3)) * perp
        cases.append({"G": mat, "P": warm.float(), "rank": rank})
    return cases


def table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n# {title}")
    print(
        "| shape | captures | route | ms / candidate | energy / exact (median) | "
        "energy / exact (worst) | within 0.1 % | ‖ΠΠ̂ − Π‖₂ (median) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['captures']} | {r['route']} | {r['ms']:.3f} | "
            f"{r['energy_median']:.6f} | {r['energy_min']:.6f} | "
            f"{100 * r['within_0.1%']:.0f} % | {r['dist_median']:.2e} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="FedLore rounds of each real run")
    p.add_argument("--rank", type=int, default=8, help="rank of the synthetic part")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/subspace.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(a).items()}}
    out["synthetic"] = evaluate(synthetic(a.rank))
    table(
        f"synthetic gradients, top-{a.rank}, warm start 0.3 rad off, {a.threads} threads",
        out["synthetic"],
    )
    if not a.skip_real:
        runs: list[tuple[str, Path | None, list[str]]] = [("cnn_fashion_mnist", None, CNN)]
        if not a.skip_llama:
            runs.append(("llama_pretrain_table3", Path("experiments/pretrain_table3.yaml"), []))
        for name, config, overrides in runs:
            cases = capture(config, overrides, a.rounds)
            out[name] = evaluate(cases)
            table(
                f"real FedLore gradients: {name}, {a.rounds} rounds, every client's last "
                f"gradient and current basis, {a.threads} threads",
                out[name],
            )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
