"""Randomized vs exact top-r subspaces: error and time per shape (not a test).

Matrices look like gradients: a decaying spectrum (sigma_j = j^-1) plus small noise. For each
shape, ``top_left_singular`` with the exact route (eigenvectors of A Aᵀ, or the SVD for tall
matrices) and the seeded randomized range finder (oversample p, power iterations q); error is
the projector distance ‖PPᵀ − P̂P̂ᵀ‖₂ to the exact basis and the captured-energy ratio
‖P̂ᵀA‖²/‖PᵀA‖²; times are medians of 3 runs.

    python benchmarks/subspace.py [--rank 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedlore.optim.subspace import captured_energy, projector_distance, top_left_singular

SHAPES = [(64, 64), (256, 256), (512, 3136), (1024, 4096), (2048, 8192)]
VARIANTS = [("randomized", 10, 2), ("randomized", 10, 1), ("randomized", 5, 0)]


def gradient_like(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = min(m, n, 64)
    u = torch.linalg.qr(torch.randn(m, k, generator=g))[0]
    v = torch.linalg.qr(torch.randn(n, k, generator=g))[0]
    s = 1.0 / torch.arange(1, k + 1, dtype=torch.float32)
    return (u * s) @ v.t() + 1e-3 * torch.randn(m, n, generator=g)


def timed(fn) -> tuple[torch.Tensor, float]:  # type: ignore[no-untyped-def]
    times, out = [], None
    for _ in range(3):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)  # type: ignore[return-value]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/subspace.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for m, n in SHAPES:
        mat = gradient_like(m, n, 0)
        exact, t_exact = timed(lambda mat=mat: top_left_singular(mat, a.rank))
        e_exact = captured_energy(exact, mat)
        rows.append(
            {"shape": f"{m}x{n}", "method": "exact", "s": t_exact, "dist": 0.0, "energy": 1.0}
        )
        for method, over, it in VARIANTS:
            fn = lambda mat=mat, method=method, over=over, it=it: top_left_singular(  # noqa: E731
                mat, a.rank, method, torch.Generator().manual_seed(0), over, it
            )
            basis, t = timed(fn)
            rows.append(
                {
                    "shape": f"{m}x{n}",
                    "method": f"randomized p={over} q={it}",
                    "s": t,
                    "dist": projector_distance(basis, exact),
                    "energy": captured_energy(basis, mat) / e_exact,
                }
            )
    print(f"# top-{a.rank} left singular subspace, {a.threads} threads")
    print("| shape | method | time (s) | ‖ΠΠ̂ − Π‖₂ vs exact | captured energy / exact |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['method']} | {r['s']:.4f} | {r['dist']:.2e} | {r['energy']:.6f} |"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=2))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
