"""The engine's overhead: an in-process FedFull round against a bare PyTorch loop (not a test).

Both sides train the same federation the same way, interleaved round by round in one process:

* **fedlore**: the library's :class:`~fedlore.engine.loop.RoundLoop` over a
  :class:`~fedlore.engine.transport.LocalTransport` with the FedFull algorithm, as ``fedlore
  run`` drives it (client data from ``Federation.client``, a :class:`ClientStore`, the metrics
  JSONL callback; no checkpoint, no evaluation, which are timed separately by the library);
* **bare**: a plain PyTorch FedAvg + AdamW loop written out by hand: the clients' training
  tensors held in lists, one model, per client ``load_state_dict`` of the global weights, a fresh
  ``torch.optim.AdamW``, K steps of cross-entropy on the same minibatches (the permutations of
  ``generator(seed, CLIENT, round, client)``, as :func:`fedlore.data.client_data.minibatches`),
  the delta ``W_K - W^t`` and the ``n_i``-weighted mean of the deltas in float64.

Same data, model, initial weights, K, batch size, learning rate and minibatch order, so the two
global models must agree bit for bit after every round (checked: ``identical``). After one
warm-up round of each side (not timed), each repeat times ``--rounds`` rounds of each side
(default: 2 for the CNN, 20 for the quickstart), alternating a round of one with a round of the
other; the ratio fedlore / bare of each repeat's totals is reported as the median of three
repeats, of wall time and of this process's CPU time (``time.process_time``: on a shared machine
the wall time also counts the waits for a core, which the CPU time leaves out).

    python benchmarks/overhead.py [--rounds N] [--repeats 3] [--configs cnn,quickstart]

Threads: ``torch.set_num_threads(--threads)`` (default 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedlore.algorithms.fedavg import FedFull
from fedlore.config import Config, load_config
from fedlore.data.federation import Federation, build_federation
from fedlore.device import training_precision
from fedlore.engine.callbacks import MetricsWriter
from fedlore.engine.loop import RoundLoop
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.seeding import CLIENT, SERVER_INIT, generator

ROUNDS = {"cnn": 2, "quickstart": 20}
"""Rounds per repeat and side (``--rounds`` overrides): a CNN round takes seconds, a quickstart
round a fraction of one, so the quickstart needs more of them for a steady ratio."""

CONFIGS: dict[str, tuple[Path | None, list[str]]] = {
    "cnn": (  # as benchmarks/round_time.py
        None,
        [
            "data.name=fashion_mnist",
            "model.name=cnn",
            "num_clients=10",
            "local_steps=10",
            "partition.name=iid",
            "batch_size=32",
        ],
    ),
    "quickstart": (Path("experiments/quickstart.yaml"), []),
}


class Library:
    """One FedFull run through the engine, advanced a round at a time."""

    def __init__(self, cfg: Config, fed: Federation, seed: int, out: Path) -> None:
        algo = make_algorithm("fedfull", cfg)
        build = model_factory(cfg, fed, seed)
        self.algo = algo
        transport = LocalTransport(algo, fed.client, build, seed, ClientStore())
        per_round = cfg.clients_per_round()
        self.loop = RoundLoop(
            algo,
            transport,
            lambda r: sample_clients(cfg.num_clients, per_round, seed, r),
            callbacks=[MetricsWriter(out / "metrics.jsonl")],
        )
        (out / "metrics.jsonl").write_text("")
        self.state = algo.init_server(build(), generator(seed, SERVER_INIT))
        self.last = cfg.rounds - 1

    def round(self, rnd: int) -> None:
        self.state, row = self.loop.run_round(self.state, rnd, self.last)
        for cb in self.loop.callbacks:
            cb.on_round_end(rnd, row, self.state)

    def global_model(self) -> dict[str, torch.Tensor]:
        return self.algo.global_arrays(self.state)


class Bare:
    """The same training as a bare PyTorch FedAvg + AdamW loop."""

    def __init__(self, cfg: Config, fed: Federation, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        hyper = make_algorithm("fedfull", cfg)  # lr, betas, eps, weight decay
        assert isinstance(hyper, FedFull)
        self.hyper = hyper
        build: Callable[[], nn.Module] = model_factory(cfg, fed, seed)
        self.model = build()
        self.weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.data = []
        for c in range(cfg.num_clients):
            split = fed.client(c).train
            self.data.append((split.x, split.y))

    def batches(self, cid: int, rnd: int) -> Any:
        x, y = self.data[cid]
        n, bs, k = len(x), min(self.cfg.batch_size, len(x)), self.cfg.local_steps
        assert k is not None  # measure() refuses local_epochs
        g = generator(self.seed, CLIENT, rnd, cid)
        drawn = 0
        while drawn < k:
            perm = torch.randperm(n, generator=g)
            for s in range(0, n, bs):
                if drawn == k:
                    return
                idx = perm[s : s + bs]
                yield x[idx], y[idx]
                drawn += 1

    def round(self, rnd: int) -> None:
        cfg, model = self.cfg, self.model
        ids = sample_clients(cfg.num_clients, cfg.clients_per_round(), self.seed, rnd)
        deltas, sizes = [], []
        for cid in ids:
            model.load_state_dict(self.weights)
            model.train()
            h = self.hyper
            opt = torch.optim.AdamW(
                model.parameters(),
                lr=h.train.lr,
                betas=h.train.betas,
                eps=h.train.eps,
                weight_decay=h.train.weight_decay,
            )
            for x, y in self.batches(cid, rnd):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            deltas.append({k: v - self.weights[k] for k, v in model.state_dict().items()})
            sizes.append(float(len(self.data[cid][0])))
        total = sum(sizes)
        with torch.no_grad():
            for k, w in self.weights.items():
                acc = sum(n * d[k].double() for n, d in zip(sizes, deltas, strict=True))
                w += (acc / total).to(w.dtype)

    def global_model(self) -> dict[str, torch.Tensor]:
        return self.weights


def measure(name: str, rounds: int, repeats: int) -> dict[str, Any]:
    config, overrides = CONFIGS[name]
    cfg = load_config(config, [*overrides, "algorithms=fedfull", "progress=false"])
    seed = cfg.seeds[0]
    h = make_algorithm("fedfull", cfg)
    assert isinstance(h, FedFull)
    if (
        cfg.local_steps is None
        or h.train.schedule != "constant"
        or h.train.grad_clip is not None
        or h.train.freeze
        or h.train.local_eval
    ):
        raise SystemExit(
            f"{name}: the bare loop assumes local_steps, a constant lr, no clipping, no freeze"
        )
    fed = build_federation(cfg, seed)
    with tempfile.TemporaryDirectory() as tmp, training_precision(cfg.precision):
        lib, bare = Library(cfg, fed, seed, Path(tmp)), Bare(cfg, fed, seed)
        lib.round(0)  # warm-up of both (not timed)
        bare.round(0)
        rnd, identical = 1, True
        ratios, cpu_ratios, lib_s, bare_s = [], [], [], []
        for _ in range(repeats):
            wall, cpu = {"lib": 0.0, "bare": 0.0}, {"lib": 0.0, "bare": 0.0}
            for _ in range(rounds):
                for side, run in (("lib", lib), ("bare", bare)):
                    t, c = time.perf_counter(), time.process_time()
                    run.round(rnd)
                    wall[side] += time.perf_counter() - t
                    cpu[side] += time.process_time() - c
                a, b = lib.global_model(), bare.global_model()
                identical &= all(torch.equal(a[k], b[k]) for k in b)
                rnd += 1
            ratios.append(wall["lib"] / wall["bare"])
            cpu_ratios.append(cpu["lib"] / cpu["bare"])
            lib_s.append(wall["lib"] / rounds)
            bare_s.append(wall["bare"] / rounds)
    return {
        "config": name,
        "model": cfg.model.name,
        "data": cfg.data.name,
        "clients": cfg.num_clients,
        "local_steps": cfg.local_steps,
        "batch_size": cfg.batch_size,
        "rounds_per_repeat": rounds,
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "cpu_ratios": cpu_ratios,
        "fedlore_s_per_round": statistics.median(lib_s),
        "bare_s_per_round": statistics.median(bare_s),
        "identical": identical,
    }


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="cnn,quickstart")
    p.add_argument("--rounds", type=int, default=None, help="rounds per repeat and side")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/overhead.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    res = [measure(n, a.rounds or ROUNDS[n], a.repeats) for n in a.configs.split(",")]
    print(f"# engine overhead: in-process FedFull round vs bare PyTorch, {a.threads} thread(s)")
    print(
        "| config | fedlore s / round | bare s / round | ratio (wall) | ratio (CPU time) "
        "| identical |"
    )
    print("|---|---|---|---|---|---|")
    for r in res:
        print(
            f"| {r['config']} ({r['model']} on {r['data']}, {r['clients']} clients, "
            f"K={r['local_steps']}, B={r['batch_size']}) | {r['fedlore_s_per_round']:.4f} | "
            f"{r['bare_s_per_round']:.4f} | {r['ratio_median']:.3f} | "
            f"{r['cpu_ratio_median']:.3f} | {r['identical']} |"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "results": res}))
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
