"""What secure aggregation and DP cost per round, outside local training (issue 20).

For m clients with uploads of L float32 entries, one round of the in-process privacy layer:
every client's :func:`fedlore.privacy.privatize` (clip, encode, pairwise masks) and the server's
:meth:`fedlore.privacy.Privacy.combine` (sum, unmask, decode), for

* ``dp``: DP alone (clip on the client, noise on the server),
* ``secure``: secure aggregation with every pair masking (SecAgg, ``secure_aggregation_degree``
  0),
* ``secure-k8``: the SecAgg+ ring of degree 8.

Each setting is measured three times, interleaved, and the median is reported, in seconds of
one thread. Usage::

    python benchmarks/secagg.py --clients 10,100 --entries 10000,200000

Writes ``benchmarks/results/secagg.json`` and prints a table; last line ``results in <path>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedlore.privacy import DPSettings, Privacy, privatize
from fedlore.types import Broadcast, Reply

MODES = {
    "dp": (False, 0),
    "secure": (True, 0),
    "secure-k8": (True, 8),
}


def one_round(mode: str, m: int, length: int, replies: list[Reply]) -> float:
    secure, degree = MODES[mode]
    dp = DPSettings(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5)
    privacy = Privacy(secure, dp, True, 10 * m, m, 0, 7, mask_degree=degree)
    spec = {"update.w": ((length,), torch.float32)}
    t0 = time.perf_counter()
    msgs = privacy.configure(0, {c: Broadcast({}, {"round": 0}) for c in range(m)})
    sent = [(c, privatize(replies[c], msgs[c].config, c, 0, 7)) for c in range(m)]
    privacy.combine(0, spec, sent, torch.device("cpu"))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="10,100")
    ap.add_argument("--entries", default="10000,200000")
    ap.add_argument("--out", default="benchmarks/results/secagg.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for m in [int(x) for x in args.clients.split(",")]:
        for length in [int(x) for x in args.entries.split(",")]:
            g = torch.Generator().manual_seed(0)
            replies = [
                Reply({"update.w": 0.01 * torch.randn(length, generator=g)}, {"num_examples": 1})
                for _ in range(m)
            ]
            times: dict[str, list[float]] = {k: [] for k in MODES}
            for _ in range(3):
                for mode in MODES:  # interleaved
                    times[mode].append(one_round(mode, m, length, replies))
            row = {"clients": m, "entries": length}
            row.update({mode: statistics.median(v) for mode, v in times.items()})
            results.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": results}, indent=2))
    print("| clients m | entries L | DP alone (s) | secure, all pairs (s) | secure, degree 8 (s) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['clients']} | {r['entries']:,} | {r['dp']:.3f} | {r['secure']:.3f} "
            f"| {r['secure-k8']:.3f} |"
        )
    print(f"results in {out}")


if __name__ == "__main__":
    main()
