"""Scale of the in-process transport: many clients, few sampled, vs few clients, all sampled.

Same model, data and local work per sampled client; FedLore (whose clients keep a full model
copy, ``cache.*``, plus their bases as state). Configs, each run in its own subprocess so that
its peak RSS is its own:

* (a) ``--clients-a`` clients (default 1,000), participation ``--participation-a`` (0.01: 10
  sampled per round), the client store limited to ``--store-mb`` MB so states spill to disk;
* (b) ``--clients-b`` clients (default 10), all sampled every round;
* (a, no spill) as (a) with ``store.max_memory_mb=null``, to show what spilling saves.

Reported per config: peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss`` in the child), RSS after
the federation is built and the highest RSS sampled at a round's end, mean wall seconds per
round (``wall_s`` of ``metrics.jsonl``: sampling, broadcast, client training, spilling and
aggregation; evaluation and checkpointing excluded), and the client store at the end (states,
in memory / on disk, bytes). Then the ratios (a) / (b).

    python benchmarks/scale.py [--model cnn] [--rounds 8] [--store-mb 64] [--threads 1]

Run it alone on the machine; results go to ``benchmarks/results/scale.json``.

Reading the numbers: about 600 MB of every process is fixed (torch, the float32 Fashion-MNIST
pool, the central test set); client states add on top. Round-end RSS creeps for a few rounds
from glibc heap fragmentation (with ``MALLOC_MMAP_THRESHOLD_=1048576`` it stays flat) and
levels off at (b)'s level; ``round_end_store_memory_bytes`` is the store's own exact count.
Without spilling, states of clients that received the dense model share the round's broadcast
tensors, so the store grows by about one model per round (plus one per returning client),
up to one model per client of the federation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FASHION = Path("/usr/share/datasets/fashion-mnist")
SEED = 0


def _rss_bytes() -> int:
    """Current resident set size in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One config in this process; returns its measurements."""
    import torch

    from fedlore.config import validate
    from fedlore.data.federation import build_federation
    from fedlore.engine.rundir import run_dir
    from fedlore.engine.store import ClientStore
    from fedlore.engine.transport import LocalTransport
    from fedlore.experiment import run_one
    from fedlore.types import State

    torch.set_num_threads(spec["threads"])
    rss_start = _rss_bytes()
    cfg = validate(
        {
            "name": "scale",
            "num_clients": spec["clients"],
            "participation": spec["participation"],
            "rounds": spec["rounds"],
            "local_steps": spec["local_steps"],
            "batch_size": spec["batch_size"],
            "rank": spec["rank"],
            "algorithms": ["fedlore"],
            "data": {"name": spec["data"]},
            "model": {"name": spec["model"]},
            "partition": {"name": "iid"},
            "eval": {"every": spec["rounds"]},  # only after the last round
            "progress": False,
            "output_dir": spec["out"],
            "store": {"max_memory_mb": spec["store_mb"]},
        }
    )
    fed = build_federation(cfg, SEED)
    rss_setup = _rss_bytes()
    stores: list[ClientStore] = []
    round_rss: list[int] = []
    round_store: list[int] = []

    def make_transport(*args: Any) -> LocalTransport:
        stores.append(args[4])
        return LocalTransport(*args)

    class SampleRss:
        def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
            round_rss.append(_rss_bytes())
            round_store.append(stores[0].nbytes())

    t0 = time.perf_counter()
    summary = run_one(
        cfg, "fedlore", SEED, fed=fed, make_transport=make_transport, extra_callbacks=(SampleRss(),)
    )
    total_s = time.perf_counter() - t0
    assert summary is not None
    out = run_dir(cfg, "fedlore", SEED)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    walls = [r["wall_s"] for r in rows if r["round"] >= 0]
    store = stores[0]
    return {
        "clients": spec["clients"],
        "participation": spec["participation"],
        "sampled_per_round": cfg.clients_per_round(),
        "store_max_memory_mb": spec["store_mb"],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_at_start_bytes": rss_start,
        "rss_after_federation_bytes": rss_setup,
        "max_round_end_rss_bytes": max(round_rss),
        "round_end_rss_bytes": round_rss,
        "round_end_store_memory_bytes": round_store,
        # from the end of round 0 to the end of the last round
        "rss_growth_per_round_bytes": (round_rss[-1] - round_rss[1]) / max(len(round_rss) - 2, 1),
        "wall_s_per_round": sum(walls) / len(walls),
        "wall_s_per_round_after_first": sum(walls[1:]) / max(len(walls) - 1, 1),
        "wall_s_rounds": walls,
        "setup_round_wall_s": next(r["wall_s"] for r in rows if r["round"] < 0),
        "run_total_s": total_s,
        "final_accuracy": summary["final_accuracy"],
        "store": {
            **store.stats(),
            "spill_dir_bytes": _dir_bytes(out / "client_states"),
            "checkpoint_bytes": (out / "checkpoint.pt").stat().st_size,
        },
    }


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"child failed ({proc.returncode}): {spec}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    p = argparse.ArgumentParser(allow_abbrev=False, description=(__doc__ or "").splitlines()[0])
    p.add_argument("--data", default="fashion_mnist" if FASHION.is_dir() else "digits")
    p.add_argument("--model", default="cnn")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--clients-a", type=int, default=1000)
    p.add_argument("--participation-a", type=float, default=0.01)
    p.add_argument("--clients-b", type=int, default=10)
    p.add_argument(
        "--store-mb",
        type=float,
        default=None,
        help="store limit of (a), MB (1e6 B); default: what (b) holds, +5 %%",
    )
    p.add_argument("--no-spill-off", action="store_true", help="skip the (a, no spill) run")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/scale.json"))
    a = p.parse_args()
    common = {
        "rounds": a.rounds,
        "local_steps": a.local_steps,
        "batch_size": a.batch_size,
        "rank": a.rank,
        "data": a.data,
        "model": a.model,
        "threads": a.threads,
    }
    res: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="fedlore-scale-") as tmp:

        def run(name: str, spec: dict[str, Any]) -> None:
            res[name] = run_child({**common, **spec, "out": str(Path(tmp) / name)})
            print(f"{name}: done in {res[name]['run_total_s']:.1f} s", file=sys.stderr)

        # (b) first: unless given, (a)'s limit is the memory (b)'s states take (+5 %), so both
        # hold the same bytes of client state in memory and (b) never spills
        run("b", {"clients": a.clients_b, "participation": 1.0, "store_mb": a.store_mb})
        if a.store_mb is None:
            a.store_mb = round(1.05 * res["b"]["store"]["memory_bytes"] / 1e6, 1)
        spec_a = {"clients": a.clients_a, "participation": a.participation_a}
        run("a", {**spec_a, "store_mb": a.store_mb})
        if not a.no_spill_off:
            run("a_no_spill", {**spec_a, "store_mb": None})
    res = {k: res[k] for k in ("a", "b", "a_no_spill") if k in res}
    ra, rb = res["a"], res["b"]
    ratios = {
        "peak_rss_a_over_b": ra["peak_rss_bytes"] / rb["peak_rss_bytes"],
        "max_round_end_rss_a_over_b": ra["max_round_end_rss_bytes"] / rb["max_round_end_rss_bytes"],
        "wall_s_per_round_a_over_b": ra["wall_s_per_round"] / rb["wall_s_per_round"],
        "wall_s_per_round_after_first_a_over_b": (
            ra["wall_s_per_round_after_first"] / rb["wall_s_per_round_after_first"]
        ),
    }
    if "a_no_spill" in res:
        ratios["peak_rss_a_no_spill_over_b"] = (
            res["a_no_spill"]["peak_rss_bytes"] / (rb["peak_rss_bytes"])
        )
    mb = 1e6
    print(
        f"# scale: FedLore, {a.model} on {a.data}, K={a.local_steps}, r={a.rank}, "
        f"{a.rounds} rounds, store limit {a.store_mb} MB"
    )
    print(
        "| config | clients | sampled | peak RSS MB | RSS growth MB / round | s / round "
        "| states (mem / disk) | store MB mem / disk |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        s = r["store"]
        print(
            f"| {name} | {r['clients']} | {r['sampled_per_round']} | "
            f"{r['peak_rss_bytes'] / mb:.0f} | {r['rss_growth_per_round_bytes'] / mb:.1f} | "
            f"{r['wall_s_per_round']:.3f} | "
            f"{s['clients']} ({s['in_memory']} / {s['spilled']}) | "
            f"{s['memory_bytes'] / mb:.1f} / {s['disk_bytes'] / mb:.1f} |"
        )
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    args = {k: str(v) for k, v in vars(a).items()}
    a.out.write_text(json.dumps({"args": args, "ratios": ratios, **res}, indent=2) + "\n")
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
