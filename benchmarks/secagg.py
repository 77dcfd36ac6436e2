"""What secure aggregation and DP cost per round, outside local training (issues 20, 28).

For m clients with uploads of L float32 entries, one round of the in-process privacy layer,
in seconds of one thread, for

* ``dp``: DP alone (clip on the client; the server sums and adds noise from OS entropy);
* ``secure``: secure aggregation with every pair masking (SecAgg, ``secure_aggregation_degree``
  0) and DP: the four stages of :mod:`fedlore.privacy.secagg` (key agreement, Shamir shares
  of two 128-bit secrets per client, AES-CTR masks, unmasking);
* ``secure-k8``: the same on the SecAgg+ ring of degree 8.

Secure rounds are also split by stage: ``keys`` (advertise and share keys: X25519, Shamir,
AES-GCM), ``mask`` (each client's noise share, encoding and masks) and ``unmask`` (the
survivors' answers, rebuilding the self-mask seeds, removing the masks). Each setting is
measured three times, interleaved, and the median is reported. Usage::

    python benchmarks/secagg.py --clients 10,100 --entries 10000,200000

Writes ``benchmarks/results/secagg.json`` and prints a table; last line ``results in <path>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fedlore.privacy import DPSettings, Privacy, client_contribution, parties, privatize
from fedlore.privacy.client import ReplySpec
from fedlore.types import Broadcast, Reply

MODES = {
    "dp": (False, 0),
    "secure": (True, 0),
    "secure-k8": (True, 8),
}


class _Timed(parties.LocalParties):
    """In-process parties whose stages are timed (client and server work together)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.t: dict[str, float] = {"keys": 0.0, "mask": 0.0, "unmask": 0.0}

    def _clock(self, stage: str, f: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = f(*args)
        self.t[stage] += time.perf_counter() - t0
        return out

    def advertise(self) -> Any:
        return self._clock("keys", super().advertise)

    def share_keys(self, keys: Any) -> Any:
        return self._clock("keys", super().share_keys, keys)

    def masked_inputs(self, inbox: Any, u2: list[int]) -> Any:
        return self._clock("mask", super().masked_inputs, inbox, u2)

    def unmask(self, survivors: list[int], dropped: list[int]) -> Any:
        return self._clock("unmask", super().unmask, survivors, dropped)


def one_round(mode: str, m: int, length: int, replies: list[Reply]) -> dict[str, float]:
    secure, degree = MODES[mode]
    dp = DPSettings(clip_norm=1.0, noise_multiplier=1.0, delta=1e-5)
    privacy = Privacy(secure, dp, True, 10 * m, m, 0, 7, mask_degree=degree)
    spec: ReplySpec = {"update.w": ((length,), torch.float32)}
    t0 = time.perf_counter()
    msgs = privacy.configure(0, {c: Broadcast({}, {"round": 0}) for c in range(m)})
    if not secure:
        sent = [(c, privatize(replies[c], msgs[c].config)) for c in range(m)]
        privacy.combine(0, spec, sent, torch.device("cpu"))
        return {"total": time.perf_counter() - t0}
    plan = privacy.plan(0, list(range(m)), spec)

    def upload(c: int) -> Any:
        return plan.encode(client_contribution(replies[c], msgs[c].config, c, 0, privacy.noise))

    timed = _Timed(plan.params, upload)
    t1 = time.perf_counter()
    res = parties.secure_sum(plan.params, timed, plan.length)
    t2 = time.perf_counter()
    timed.t["unmask"] += (t2 - t1) - sum(timed.t.values())  # the server's own work
    sum_wx, sum_w, _ = plan.decode(res.total)
    privacy.from_mean(0, spec, sum_wx / sum_w, {c: {} for c in res.survivors},
                      list(range(m)), torch.device("cpu"))  # fmt: skip
    return {"total": time.perf_counter() - t0, **timed.t}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
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
            times: dict[str, list[dict[str, float]]] = {k: [] for k in MODES}
            for _ in range(3):
                for mode in MODES:  # interleaved
                    times[mode].append(one_round(mode, m, length, replies))
            row: dict[str, Any] = {"clients": m, "entries": length}
            for mode, runs in times.items():
                for key in runs[0]:
                    name = mode if key == "total" else f"{mode}.{key}"
                    row[name] = statistics.median(r[key] for r in runs)
            results.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": results}, indent=2))
    print(
        "| clients m | entries L | DP alone (s) | secure, all pairs (s): keys / mask / unmask "
        "| secure, degree 8 (s): keys / mask / unmask | all pairs ÷ degree 8 |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        parts = {
            mode: f"{r[mode]:.3f}: {r[mode + '.keys']:.3f} / {r[mode + '.mask']:.3f} / "
            f"{r[mode + '.unmask']:.3f}"
            for mode in ("secure", "secure-k8")
        }
        print(
            f"| {r['clients']} | {r['entries']:,} | {r['dp']:.3f} | {parts['secure']} "
            f"| {parts['secure-k8']} | {r['secure'] / r['secure-k8']:.2f} |"
        )
    print(f"results in {out}")


if __name__ == "__main__":
    main()
