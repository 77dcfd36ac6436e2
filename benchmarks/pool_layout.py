"""The CNN's max-pool on CPU: ``nn.MaxPool2d`` (NCHW kernel) against fedlore's
:class:`fedlore.models.cnn.MaxPool2d` (channels-last kernel), side by side in one run (not a
test).

Measured on ``experiments/bayes_table4.yaml``'s model (the small CNN, channels 8 and 16, hidden
64, on 28x28 images), deterministic and mean-field Bayesian (:func:`fedlore.bayes.bayesianize`):

* a training step (batch 32, AdamW; the BNN's loss adds its KL term), and
* an evaluation pass of 2,048 images in chunks of 512 (the MC predictive's chunk; the BNN draws
  5 weight samples per image, as ``eval.mc_samples: 5``).

The two pools alternate block by block, each block timed in process CPU seconds (the machine
may be shared: a process waiting for a core accrues none), ``--repeats`` blocks each (default
5); the median per pool and the ratio of the medians are reported. The two models share their
weights, and the run checks that they give the same logits and the same gradients, bit for bit.

    python benchmarks/pool_layout.py [--repeats 5] [--threads 1]

Writes ``benchmarks/results/pool_layout.json`` (its table: ``scripts/results_tables.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedlore.bayes import bayesianize, kl_divergence
from fedlore.models.cnn import CNN

RESULTS = Path(__file__).resolve().parent / "results"


def with_torch_pool(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose pools are plain ``nn.MaxPool2d``."""
    twin = copy.deepcopy(model)
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.MaxPool2d) and type(child) is not nn.MaxPool2d:
                setattr(module, name, nn.MaxPool2d(child.kernel_size))
    return twin


def cpu_ms(fn: Callable[[], None], n: int) -> float:
    """Process CPU milliseconds per call of ``fn`` over ``n`` calls."""
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n * 1e3


def measure(
    model: nn.Module, bayes: bool, x: torch.Tensor, y: torch.Tensor, xe: torch.Tensor
) -> tuple[Callable[[], None], Callable[[], None]]:
    """A training step and an evaluation pass of ``model``."""
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    draws = 5 if bayes else 1

    def step() -> None:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if bayes:
            loss = loss + kl_divergence(model) / 10_000
        loss.backward()
        opt.step()

    @torch.no_grad()
    def evaluate() -> None:
        for _ in range(draws):
            for i in range(0, xe.shape[0], 512):
                model(xe[i : i + 512])

    return step, evaluate


def same(a: nn.Module, b: nn.Module, x: torch.Tensor, y: torch.Tensor, xe: torch.Tensor) -> bool:
    """The two models' gradients on a training batch and their logits on an evaluation chunk
    (no autograd), each under the same weight draw, bit for bit."""
    seen = []
    for m in (a, b):
        m.zero_grad()
        torch.manual_seed(0)
        F.cross_entropy(m(x), y).backward()
        grads = [torch.zeros(0) if p.grad is None else p.grad.clone() for p in m.parameters()]
        torch.manual_seed(1)
        with torch.no_grad():
            seen.append((m(xe[:512]), grads))
    (oa, ga), (ob, gb) = seen
    return torch.equal(oa, ob) and all(torch.equal(p, q) for p, q in zip(ga, gb, strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "pool_layout.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (32,), generator=gen)
    xe = torch.randn(2048, 1, 28, 28, generator=gen)
    rows: list[dict[str, Any]] = []
    for bayes in (False, True):
        torch.manual_seed(0)
        ours: nn.Module = CNN((1, 28, 28), 10, (8, 16), 64, 0.0)
        if bayes:
            ours = bayesianize(ours)
        theirs = with_torch_pool(ours)
        identical = same(ours, theirs, x, y, xe)
        fns = {k: measure(m, bayes, x, y, xe) for k, m in (("nchw", theirs), ("ours", ours))}
        times: dict[str, dict[str, list[float]]] = {k: {"step": [], "eval": []} for k in fns}
        for step, evaluate in fns.values():  # warm-up
            step()
            evaluate()
        for _ in range(args.repeats):
            for k, (step, evaluate) in fns.items():  # alternating blocks
                times[k]["step"].append(cpu_ms(step, 40))
                times[k]["eval"].append(cpu_ms(evaluate, 2))
        med = {k: {p: statistics.median(v) for p, v in t.items()} for k, t in times.items()}
        rows.append(
            {
                "model": "bnn" if bayes else "cnn",
                "identical": identical,
                "ms": med,
                "step_speedup": med["nchw"]["step"] / med["ours"]["step"],
                "eval_speedup": med["nchw"]["eval"] / med["ours"]["eval"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "repeats": args.repeats, "torch": torch.__version__}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}; `python scripts/results_tables.py` writes its table")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
