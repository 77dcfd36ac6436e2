"""Seed 000 Tables 3-4 at the seed's shapes on a GPU, and a short pre-training quality check
(issue 17; not a test). Run by ``benchmarks/gpu_check.sh``; ``--dry-run`` uses the smallest
shapes on the CPU so that any machine proves the script works.

Cost tables. Side by side in one process, per shape (seed Table 5's LLaMA-60M, -130M and -350M
at batch 16 x 256 tokens with the ranks of seed Table 3, 128 / 256 / 256; a ViT-Base shape,
86 M parameters, 224 x 224 images in patches of 16, seed Table 1's backbone, rank 8; random
weights and synthetic data throughout) and per method (FedLore, FedFull, Local GaLore, FedIT):
seconds per round (the second round; the first warms the kernels up) and the ratio to FedFull,
optimizer-state bytes and peak device memory of one client, bytes up and down per client and
round, all read from the round loop's own metrics rows, in bf16 autocast with fp32 masters.
``--clients`` clients per round take ``--local-steps`` steps each (time per round grows
linearly in both; the seed's Table 3 has 20 clients x 50 steps).

Quality check. LLaMA-60M pre-trained through seed 000's C4 protocol on the fortunes corpus
(``data.name: fortunes_c4`` from ``--fortunes``): FedLore and FedFull, the same number of rounds
for both, as many as fit in ``--quality-seconds`` (measured on a first round), and their
validation perplexity.

Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md``. A shape that would start after
``--budget-s`` seconds is left out and named so (the whole check must end in 8 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlore.checks import setup_rounds
from fedlore.config import load_config
from fedlore.data.client_data import TensorSplit
from fedlore.data.federation import Federation
from fedlore.device import resolve_device, training_precision
from fedlore.engine.loop import RoundLoop
from fedlore.engine.rundir import run_dir
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.seeding import SERVER_INIT, generator

METHODS = ("fedlore", "fedfull", "local_galore", "fedit")


@dataclass(frozen=True)
class Shape:
    """One model shape of the cost tables."""

    name: str
    model: str
    kwargs: dict[str, Any]
    rank: int
    input_shape: tuple[int, ...]
    classes: int  # vocabulary size for a language model
    lm: bool
    exclude: tuple[str, ...] = ("head.",)


FULL = [
    Shape("LLaMA-60M", "llama", {"size": "60m"}, 128, (256,), 32000, True),
    Shape("LLaMA-130M", "llama", {"size": "130m"}, 256, (256,), 32000, True),
    Shape("LLaMA-350M", "llama", {"size": "350m"}, 256, (256,), 32000, True),
    Shape(
        "ViT-Base",
        "vit",
        {"patch_size": 16, "hidden_size": 768, "num_layers": 12, "num_heads": 12},
        8,
        (3, 224, 224),
        100,
        False,
        ("head.", "backbone.embeddings."),
    ),
]
DRY = [
    Shape("LLaMA-micro", "llama", {"size": "micro"}, 8, (32,), 512, True),
    Shape(
        "ViT-tiny",
        "vit",
        {"patch_size": 4, "hidden_size": 32, "num_layers": 2, "num_heads": 2},
        4,
        (3, 16, 16),
        10,
        False,
        ("head.", "backbone.embeddings."),
    ),
]


def synthetic_federation(shape: Shape, clients: int, batch: int, steps: int) -> Federation:
    """Random data of the shape's input: token ids with next-token targets (a language model)
    or images with labels; each client holds ``batch * steps`` examples, enough for one round
    without repeating; a validation / test set of one batch."""
    g = torch.Generator().manual_seed(0)
    per = batch * steps
    n = clients * per + batch
    if shape.lm:
        x = torch.randint(0, shape.classes, (n, *shape.input_shape), generator=g)
        y = torch.cat([x[:, 1:], torch.full((n, 1), -100, dtype=torch.long)], dim=1)
    else:
        x = torch.rand(n, *shape.input_shape, generator=g)
        y = torch.randint(0, shape.classes, (n,), generator=g)
    train = tuple(np.arange(i * per, (i + 1) * per, dtype=np.int64) for i in range(clients))
    empty = tuple(np.zeros(0, dtype=np.int64) for _ in range(clients))
    return Federation(
        source="synthetic",
        pool=TensorSplit(x[: clients * per], y[: clients * per]),
        train_labels=y[: clients * per],
        train_indices=train,
        test_indices=empty,
        central_test=TensorSplit(x[clients * per :], y[clients * per :]),
        num_classes=shape.classes,
        input_shape=shape.input_shape,
        class_names=[],
        task="language_modeling" if shape.lm else "classification",
    )


def cost_row(
    shape: Shape, method: str, device: str, clients: int, batch: int, steps: int
) -> dict[str, Any]:
    """Two rounds of ``method`` on ``shape``; the second round's metrics."""
    cfg = load_config(
        None,
        [
            f"algorithms=[{method}]",
            f"num_clients={clients}",
            "rounds=2",
            f"local_steps={steps}",
            f"batch_size={batch}",
            "lr=1e-3",
            f"rank={shape.rank}",
            f"model.name={shape.model}",
            f"model.kwargs={json.dumps(shape.kwargs)}",
            f"params.exclude={json.dumps(list(shape.exclude))}",
            "optim.betas=[0.9, 0.95]",
            "precision=bf16",
            f"device={device}",
            "store.max_memory_mb=null",
        ],
    )
    fed = synthetic_federation(shape, clients, batch, steps).to(resolve_device(device))
    algo = make_algorithm(method, cfg)
    build = model_factory(cfg, fed, 0)
    t_build = time.perf_counter()
    model = build()
    params = sum(p.numel() for p in model.parameters())
    state = algo.init_server(model, generator(0, SERVER_INIT))
    transport = LocalTransport(algo, fed.client, build, 0, ClientStore())
    build_s = time.perf_counter() - t_build
    loop = RoundLoop(algo, transport, lambda rnd: list(range(clients)))
    rows = []
    with training_precision("bf16"):
        for rnd in range(-setup_rounds(algo), 2):
            state, row = loop.run_round(state, rnd, 1)
            rows.append(row)
    last = rows[-1]
    return {
        "shape": shape.name,
        "method": method,
        "parameters": params,
        "rank": shape.rank,
        "s_per_round": last["wall_s"],
        "optimizer_state_bytes": last["optimizer_state_bytes"],
        "peak_memory_bytes": last.get("peak_memory_bytes"),
        "bytes_up_per_client": last["bytes_up"] / clients,
        "bytes_down_per_client": last["bytes_down"] / clients,
        "train_loss": last["train_loss"],
        "build_s": build_s,
    }


def quality(device: str, fortunes: str, seconds: float, dry: bool, out: Path) -> dict[str, Any]:
    """FedLore vs FedFull pre-training LLaMA-60M (dry run: micro) on the fortunes corpus through
    the C4 protocol; the same number of rounds for both, as many as fit in ``seconds``."""
    base = [
        "name=gpu_quality",
        "data.name=fortunes_c4",
        f"data.root={fortunes}",
        "data.vocab_size=4096" if not dry else "data.vocab_size=512",
        "data.max_length=256" if not dry else "data.max_length=32",
        "partition.name=source_dirichlet",
        "partition.alpha=0.5",
        "num_clients=20" if not dry else "num_clients=4",
        "local_steps=10" if not dry else "local_steps=2",
        "batch_size=16" if not dry else "batch_size=4",
        "model.name=llama",
        "model.kwargs={size: 60m}" if not dry else "model.kwargs={size: micro}",
        "rank=128" if not dry else "rank=8",
        "optim.betas=[0.9, 0.95]",
        "optim.schedule=cosine",
        "optim.min_lr_ratio=0.1",
        "lr=3e-3",
        "precision=bf16",
        f"device={device}",
        "progress=false",
        f"output_dir={out / 'quality_runs'}",
        "eval.batch_size=64",
    ]
    methods = ("fedlore", "fedfull")
    probe: dict[str, float] = {}
    for m in methods:  # one round each, timed, to size the real runs
        cfg = load_config(None, [*base, "rounds=1", f"name=gpu_quality_probe_{m}"])
        t = time.perf_counter()
        run_one(cfg, m, 42)
        probe[m] = time.perf_counter() - t
    per_round = max(probe.values())
    rounds = max(2, int(seconds / len(methods) / per_round)) if not dry else 2
    result: dict[str, Any] = {"rounds": rounds, "probe_s": probe, "methods": {}}
    for m in methods:
        cfg = load_config(None, [*base, f"rounds={rounds}", f"eval.every={rounds}"])
        t = time.perf_counter()
        summary = run_one(cfg, m, 42)
        assert summary is not None
        result["methods"][m] = {
            "val_loss": summary["final_loss"],
            "val_perplexity": summary.get("final_perplexity"),
            "wall_s": time.perf_counter() - t,
            "bytes_up_total": summary["bytes_up_total"],
        }
        rows = (run_dir(cfg, m, 42) / "metrics.jsonl").read_text().splitlines()
        result["methods"][m]["rows"] = len(rows)
    return result


def gpu_tests(python: str) -> dict[str, Any]:
    """``pytest -m gpu tests``: every test marked ``gpu`` (``tests/gpu`` and the CUDA checks
    beside the CPU tests, e.g. the fixed-point encoding of a CUDA vector): its exit status and
    summary line."""
    t = time.perf_counter()
    proc = subprocess.run(
        [python, "-m", "pytest", "-m", "gpu", "tests", "-q", "-rs", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
    )
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    return {
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else "",
        "failures": [x for x in lines if x.startswith(("FAILED", "ERROR"))],
        "seconds": time.perf_counter() - t,
    }


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        "# GPU check",
        "",
        f"{env['device_name']} ({env['device']}), torch {env['torch']}, "
        f"{'dry run (smallest shapes)' if result['dry_run'] else 'seed shapes'}; "
        f"{result['clients']} clients x {result['local_steps']} local steps per round, batch "
        f"{result['batch']}, bf16 autocast, fp32 masters.",
        "",
        f"GPU tests (`pytest -m gpu tests`): {result['tests']['summary']}",
        "",
        "| shape | method | params (M) | rank | s / round | ratio vs FedFull | optimizer state "
        "(MB) | peak device memory (MB) | MB up / client | MB down / client |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["costs"]:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | – | – | – | {r['skipped']} | | | | | |")
            continue
        peak = "–" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 1e6:,.0f}"
        lines.append(
            f"| {r['shape']} | {r['method']} | {r['parameters'] / 1e6:.1f} | {r['rank']} | "
            f"{r['s_per_round']:.3f} | {r.get('ratio_vs_fedfull', float('nan')):.2f} | "
            f"{r['optimizer_state_bytes'] / 1e6:,.1f} | {peak} | "
            f"{r['bytes_up_per_client'] / 1e6:,.2f} | {r['bytes_down_per_client'] / 1e6:,.2f} |"
        )
    q = result.get("quality")
    if q:
        lines += ["", f"Quality check: {q['rounds']} rounds each.", "",
                  "| method | val loss | val PPL | s |", "|---|---|---|---|"]  # fmt: skip
        for m, v in q["methods"].items():
            ppl = v["val_perplexity"]
            lines.append(
                f"| {m} | {v['val_loss']:.3f} | {'–' if ppl is None else f'{ppl:.1f}'} | "
                f"{v['wall_s']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dry-run", action="store_true", help="smallest shapes, on the CPU")
    ap.add_argument("--device", default=None, help="default: cuda (dry run: cpu)")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--local-steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--quality-seconds", type=float, default=180.0)
    ap.add_argument("--budget-s", type=float, default=300.0, help="start no shape after this")
    ap.add_argument("--fortunes", default=".gpu/fortunes", help="folder of fortune files")
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args(argv)
    dry = args.dry_run
    device = args.device or ("cpu" if dry else "cuda")
    steps, batch = (2, 4) if dry else (args.local_steps, args.batch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = resolve_device(device)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "dry_run": dry,
        "clients": args.clients,
        "local_steps": steps,
        "batch": batch,
        "environment": {
            "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "tests": {"summary": "not run"} if args.skip_tests else gpu_tests(sys.executable),
        "costs": [],
    }
    for shape in DRY if dry else FULL:
        if time.perf_counter() - t0 > args.budget_s:
            result["costs"].append({"shape": shape.name, "skipped": "time budget"})
            continue
        rows = [cost_row(shape, m, device, args.clients, batch, steps) for m in METHODS]
        full = next(r for r in rows if r["method"] == "fedfull")["s_per_round"]
        for r in rows:
            r["ratio_vs_fedfull"] = r["s_per_round"] / full if full > 0 else math.nan
        result["costs"] += rows
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    fortunes = Path(args.fortunes)
    if fortunes.is_dir():
        result["quality"] = quality(device, str(fortunes), args.quality_seconds, dry, out)
    else:
        result["quality"] = None
        result["quality_skipped"] = f"no fortunes corpus at {fortunes} (benchmarks/gpu_prepare.sh)"
    result["seconds"] = time.perf_counter() - t0
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    (out / "gpu_check.md").write_text(markdown(result))
    print(f"results in {out}/ (gpu_check.json, gpu_check.md)")
    print(markdown(result))
    failed = result["tests"].get("returncode", 0) not in (0, 5)  # 5: nothing collected / ran
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
