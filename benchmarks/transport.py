"""16-bit transport (issue 19 item 7): bytes per round and the accuracy it costs (not a test).

Two parts, each written into ``benchmarks/results/transport.json`` under its own key:

* ``bytes``: FedLore and FedFull at LLaMA shapes (``experiments/pretrain_table3.yaml``'s model,
  data and clients) under ``transport_dtype`` fp32, fp16 and bf16, interleaved in one process.
  Bytes come from the round loop's counts of the tensors actually sent in real rounds (setup
  exchange + ``--rounds`` rounds; deterministic, so one run each), plus the size the Flower
  codec gives one client's messages of the last round (``record_nbytes``: payload + .npy
  headers). Steady round = the last measured round.
* ``accuracy``: final (and best) accuracy of ``fedlore`` and ``fedfull`` for a config under the
  three dtypes, seed by seed, interleaved (seed, then dtype, then method), every run a full
  ``fedlore run``-equivalent (:func:`fedlore.experiment.run_experiment`) into a scratch folder.

    python benchmarks/transport.py bytes [--rounds 2] [--set local_steps=2]
    python benchmarks/transport.py accuracy --config experiments/quickstart.yaml --seeds 42 43 44
    python benchmarks/transport.py accuracy --config experiments/fmnist_partial.yaml \
        --set diagnostics.every=0 --seeds 42

Threads: ``torch.set_num_threads(1)`` (and run with ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedlore.checks import setup_rounds
from fedlore.config import load_config
from fedlore.data.federation import build_federation
from fedlore.engine.loop import RoundLoop
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_experiment
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.flower.codec import broadcast_to_record, record_nbytes, reply_to_record
from fedlore.seeding import SERVER_INIT, generator
from fedlore.types import Broadcast, Reply

DTYPES = ("fp32", "fp16", "bf16")
METHODS = ("fedlore", "fedfull")
RESULTS = Path(__file__).parent / "results" / "transport.json"


class Recording(LocalTransport):
    """LocalTransport that keeps the last round's message and reply of one client."""

    last: tuple[Broadcast, Reply | BaseException] | None = None

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out = super().send(rnd, messages)
        cid = min(messages)
        self.last = (messages[cid], out[cid])
        return out


def measure_bytes(
    config: Path, method: str, dtype: str, rounds: int, sets: list[str]
) -> dict[str, Any]:
    """Real rounds of ``method`` under ``dtype``: per-round bytes (all clients) and codec sizes
    (``sets``: config overrides that leave the shapes alone, e.g. fewer local steps)."""
    over = [*sets, f"rounds={rounds}", f"algorithms=[{method}]", f"transport_dtype={dtype}"]
    cfg = load_config(config, over)
    seed = cfg.seeds[0]
    fed = build_federation(cfg, seed)
    algo = make_algorithm(method, cfg)
    build = model_factory(cfg, fed, seed)
    transport = Recording(algo, fed.client, build, seed, ClientStore())
    per = cfg.clients_per_round()
    loop = RoundLoop(algo, transport, lambda rnd: sample_clients(cfg.num_clients, per, seed, rnd))
    state = algo.init_server(build(), generator(seed, SERVER_INIT))
    rows = []
    t0 = time.perf_counter()
    for rnd in range(-setup_rounds(algo), rounds):
        state, row = loop.run_round(state, rnd, rounds - 1)
        if row["rejected"]:
            raise RuntimeError(f"{method} {dtype} round {rnd}: {row.get('rejected_reasons')}")
        rows.append({k: row[k] for k in ("round", "clients", "bytes_up", "bytes_down")})
    assert transport.last is not None
    msg, reply = transport.last
    if not isinstance(reply, Reply):
        raise RuntimeError(f"{method} {dtype}: the last client failed: {reply}")
    steady = rows[-1]
    return {
        "rows": rows,
        "clients_per_round": per,
        "steady_round": steady["round"],
        "steady_bytes_up": steady["bytes_up"],
        "steady_bytes_down": steady["bytes_down"],
        "steady_bytes": steady["bytes_up"] + steady["bytes_down"],
        "run_bytes": sum(r["bytes_up"] + r["bytes_down"] for r in rows),
        "codec_bytes_one_client": record_nbytes(broadcast_to_record(msg).array_records["arrays"])
        + record_nbytes(reply_to_record(reply).array_records["arrays"]),
        "counted_bytes_one_client": sum(t.numel() * t.element_size() for t in msg.arrays.values())
        + sum(t.numel() * t.element_size() for t in reply.arrays.values()),
        "wall_s": time.perf_counter() - t0,
    }


def bytes_part(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "config": str(args.config),
        "set": args.set,
        "rounds": args.rounds,
        "runs": {},
    }
    for dtype in DTYPES:  # interleaved: the dtypes of one method never run back to back
        for method in METHODS:
            res = measure_bytes(args.config, method, dtype, args.rounds, args.set)
            out["runs"][f"{method}/{dtype}"] = res
            print(f"  {method} {dtype}: steady {res['steady_bytes'] / 1e6:.2f} MB/round")
    runs = out["runs"]
    ref = runs["fedfull/fp32"]["steady_bytes"]
    out["ratios"] = {
        f"{m}/{d}": {
            "vs_fedfull_fp32": runs[f"{m}/{d}"]["steady_bytes"] / ref,
            "vs_fedfull_same_dtype": runs[f"{m}/{d}"]["steady_bytes"]
            / runs[f"fedfull/{d}"]["steady_bytes"],
            "vs_own_fp32": runs[f"{m}/{d}"]["steady_bytes"] / runs[f"{m}/fp32"]["steady_bytes"],
        }
        for m in METHODS
        for d in DTYPES
    }
    n = runs["fedfull/fp32"]["clients_per_round"]
    print(
        f"\n| method | transport | MB up / down per round (all {n} clients, steady round) "
        "| / FedFull fp32 | / FedFull same dtype | / own fp32 |"
    )
    print("|---|---|---|---|---|---|")
    for key, r in out["ratios"].items():
        m, d = key.split("/")
        run = runs[key]
        print(
            f"| {m} | {d} | {run['steady_bytes_up'] / 1e6:.2f} / "
            f"{run['steady_bytes_down'] / 1e6:.2f} | {r['vs_fedfull_fp32']:.3f} | "
            f"{r['vs_fedfull_same_dtype']:.3f} | {r['vs_own_fp32']:.3f} |"
        )
    return out


def accuracy_part(args: argparse.Namespace) -> dict[str, Any]:
    base = load_config(args.config, args.set)
    out: dict[str, Any] = {
        "config": str(args.config),
        "set": args.set,
        "rounds": base.rounds,
        "seeds": args.seeds,
        "runs": {},
    }
    scratch = Path(tempfile.mkdtemp(prefix="transport-bench-"))
    for seed in args.seeds:
        for dtype in DTYPES:
            for method in METHODS:
                cfg = load_config(
                    args.config,
                    [
                        *args.set,
                        f"transport_dtype={dtype}",
                        f"algorithms=[{method}]",
                        f"seeds=[{seed}]",
                        f"output_dir={scratch}",
                        f"name={base.name}-{dtype}",
                        "progress=false",
                        "checkpoint=false",
                    ],
                )
                t0 = time.perf_counter()
                summary = run_experiment(cfg, overwrite=True)[method][0]
                res = {
                    k: summary.get(k)
                    for k in (
                        "final_accuracy",
                        "best_accuracy",
                        "final_loss",
                        "bytes_up_total",
                        "bytes_down_total",
                        "rejected_total",
                    )
                }
                res["wall_s"] = time.perf_counter() - t0
                out["runs"][f"{method}/{dtype}/{seed}"] = res
                print(
                    f"  {method} {dtype} seed {seed}: final accuracy {res['final_accuracy']:.4f} "
                    f"({res['wall_s']:.0f} s)"
                )
    out["median_final_accuracy"] = {}
    print(f"\n{base.name} ({base.rounds} rounds), final accuracy per seed {args.seeds}")
    print("\n| method | transport | final accuracy | median | - fp32 median | MB total |")
    print("|---|---|---|---|---|---|")
    for method in METHODS:
        ref = statistics.median(
            out["runs"][f"{method}/fp32/{s}"]["final_accuracy"] for s in args.seeds
        )
        for dtype in DTYPES:
            runs = [out["runs"][f"{method}/{dtype}/{s}"] for s in args.seeds]
            accs = [r["final_accuracy"] for r in runs]
            med = statistics.median(accs)
            out["median_final_accuracy"][f"{method}/{dtype}"] = med
            mb = statistics.median(r["bytes_up_total"] + r["bytes_down_total"] for r in runs)
            print(
                f"| {method} | {dtype} | {', '.join(f'{a:.4f}' for a in accs)} | {med:.4f} | "
                f"{med - ref:+.4f} | {mb / 1e6:.1f} |"
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("part", choices=["bytes", "accuracy"])
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=2, help="bytes: rounds after the setup")
    p.add_argument("--seeds", type=int, nargs="+", default=[42])
    p.add_argument("--set", nargs="*", default=[], help="key=value config overrides")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.part == "bytes":
        args.config = args.config or Path("experiments/pretrain_table3.yaml")
        key, res = "bytes", bytes_part(args)
    else:
        if args.config is None:
            p.error("accuracy needs --config")
        res = accuracy_part(args)
        key = f"accuracy/{args.config.stem}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".lock"), "w") as lock:  # parts may run side by side
        fcntl.flock(lock, fcntl.LOCK_EX)
        results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
        results[key] = res
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".lock").unlink(missing_ok=True)
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
