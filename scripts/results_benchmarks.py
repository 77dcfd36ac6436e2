"""The benchmarks' tables and derived numbers (``benchmarks/results/<benchmark>.md`` and
``benchmarks/results/summary.json``), for ``scripts/results_tables.py``."""

from __future__ import annotations

import statistics
from typing import Any

from results_common import BENCH, dump_json, mb, read, span, table

# ---------------------------------------------------------------- benchmarks
SUBSPACE_ROWS = (
    ("cnn_fashion_mnist", "512x3136 r=8", "CNN fc 512x3136 r=8"),
    ("cnn_fashion_mnist", "64x800 r=8", "CNN conv2 64x800 r=8"),
    ("llama_pretrain_table3", "128x128 r=32", "LLaMA attn 128x128 r=32"),
    ("llama_pretrain_table3", "352x128 r=32", "LLaMA MLP 352x128 r=32"),
    ("llama_pretrain_table3", "128x352 r=32", "LLaMA MLP 128x352 r=32"),
)
ROUTES = {
    "exact f64 (seed)": "exact f64 (seed)",
    "exact f32": "exact, `svd_dtype=fp32`",
    "randomized p=10 q=2": "randomized p=10 q=2",
    "subspace p=0 q=0": "subspace, warm start only (p=0 q=0)",
    "subspace p=10 q=2": "subspace p=10 q=2 (defaults)",
}


def subspace() -> tuple[str, dict[str, Any]]:
    data = read(BENCH / "subspace.json")
    rows = []
    for group, shape, label in SUBSPACE_ROWS:
        entries = {e["route"]: e for e in data[group] if e["shape"] == shape}
        exact = entries["exact f64 (seed)"]
        first = True
        for route, name in ROUTES.items():
            if route not in entries:
                continue
            e = entries[route]
            rows.append(
                [
                    f"{label} ({e['captures']})" if first else "",
                    name,
                    f"{e['ms']:.3g}",
                    f"{e['ms'] / exact['ms']:.2f}",
                    f"{e['energy_median']:.6f}",
                    f"{e['energy_min']:.6f}",
                    f"{100 * e['within_0.1%']:.0f} %",
                ]
            )
            first = False
    md = table(
        [
            "matrix (captures)",
            "route",
            "ms / candidate",
            "÷ exact's time",
            "energy ÷ exact's, median",
            "worst",
            "within 0.1 %",
        ],
        rows,
    )

    def pick(group: str, shape: str, route: str) -> dict[str, Any]:
        return next(e for e in data[group] if e["shape"] == shape and e["route"] == route)

    real = [e for g in ("cnn_fashion_mnist", "llama_pretrain_table3") for e in data[g]]
    fc_exact = pick("cnn_fashion_mnist", "512x3136 r=8", "exact f64 (seed)")
    fc_sub = pick("cnn_fashion_mnist", "512x3136 r=8", "subspace p=10 q=2")
    s_exact = pick("synthetic", "256x256 r=8", "exact f64 (seed)")
    s_sub = pick("synthetic", "256x256 r=8", "subspace p=10 q=2")
    llama_sub = [e for e in data["llama_pretrain_table3"] if e["route"] == "subspace p=10 q=2"]
    facts = {
        "fc_exact_ms": fc_exact["ms"],
        "fc_subspace_ms": fc_sub["ms"],
        "synthetic256_exact_ms": s_exact["ms"],
        "synthetic256_subspace_ms": s_sub["ms"],
        "subspace_speedup": span([fc_exact["ms"] / fc_sub["ms"], s_exact["ms"] / s_sub["ms"]]),
        "warm_start_only_energy_pct": span(
            [100 * e["energy_median"] for e in real if e["route"] == "subspace p=0 q=0"]
        ),
        "llama_subspace_worst_loss_pct": 100 * (1 - min(e["energy_min"] for e in llama_sub)),
        "llama_subspace_beyond_0_1_pct": span([100 * (1 - e["within_0.1%"]) for e in llama_sub]),
    }
    return md, facts


def round_time() -> str:
    rows = []
    for name, label in (
        ("round_time.json", "CNN / Fashion-MNIST, 10 clients, K=10, r=8"),
        ("pretrain_round_time.json", "LLaMA 0.93 M (pretrain_table3), 20 clients, K=10, r=32"),
    ):
        data = read(BENCH / name)
        first = True
        for key, method in (
            ("fedfull", "FedFull"),
            ("fedlore", "FedLore (`auto`, the default)"),
            ("fedlore:candidate_svd=exact", "FedLore, `candidate_svd=exact`"),
        ):
            r = data[key]
            share = r["svd_share_of_client_time"]
            rows.append(
                [
                    label if first else "",
                    method,
                    f"{r['cpu_s_per_round']:.2f}",
                    f"{r['cpu_s_ratio_vs_fedfull']:.2f}",
                    f"{r['wall_s_ratio_vs_fedfull']:.2f}",
                    f"{100 * share:.1f} %" if share else "–",
                ]
            )
            first = False
    return table(
        [
            "config",
            "method",
            "CPU s / round",
            "CPU ratio vs FedFull",
            "wall ratio vs FedFull",
            "SVD share of client time",
        ],
        rows,
    )


def threads(name: str) -> str:
    data = read(BENCH / name)
    settings = [s for s in ("auto", "one thread", "all CPUs", "before") if s in data["idle"]]
    heads = {"before": "before issue 19"}
    competitors = data["args"]["competitors"]
    rows = []
    for cond, label in (
        ("idle", "idle"),
        ("busy", f"{competitors} competing process{'es' if competitors != '1' else ''}"),
    ):
        d = data[cond]
        chose = ", ".join(str(t) for t in d.get("auto_threads", [])) or "–"
        rows.append(
            [label, chose] + [f"{d[s]['wall_s']:.1f} s ({d[s]['ratio']:.2f})" for s in settings]
        )
    return table(["condition", "auto chose", *(heads.get(s, s) for s in settings)], rows)


def peer_pfl() -> str:
    data = read(BENCH / "peer_pfl.json")
    rows = []
    for key, label in (("digits", "digits MLP"), ("fmnist", "Fashion-MNIST CNN")):
        t = data["tasks"][key]
        fl, pf = t["fedlore"], t["pfl"]
        differ = max(a["predictions_differing"] for a in t["agreement"])
        rows.append(
            [
                f"{label}, {t['rounds']} rounds",
                f"{fl['s_per_round']:.3g}",
                f"{pf['s_per_round']:.3g}",
                f"{t['ratio_fedlore_over_pfl']:.2f}",
                f"{fl['cpu_per_wall']:.2f}, {pf['cpu_per_wall']:.2f}",
                f"{100 * statistics.median(fl['accuracy']):.2f} / "
                f"{100 * statistics.median(pf['accuracy']):.2f} % "
                f"({differ} of {t['n_test']:,} predictions differ)",
            ]
        )
    return table(
        [
            "task",
            "fedlore s / round",
            "pfl s / round",
            "fedlore ÷ pfl",
            "CPU / wall: fedlore, pfl",
            "accuracy fedlore / pfl",
        ],
        rows,
    )


def overhead() -> str:
    data = read(BENCH / "overhead.json")
    rows = []
    for r in data["results"]:
        rows.append(
            [
                f"{r['config']} ({r['model']} on {r['data']}, {r['clients']} clients, "
                f"K={r['local_steps']}, B={r['batch_size']})",
                f"{r['fedlore_s_per_round']:.4f}",
                f"{r['bare_s_per_round']:.4f}",
                f"{r['ratio_median']:.3f}",
                f"{r['cpu_ratio_median']:.3f}",
                "yes" if r["identical"] else "no",
            ]
        )
    return table(
        [
            "config",
            "fedlore engine s / round",
            "bare loop s / round",
            "ratio (wall)",
            "ratio (CPU time)",
            "bit-identical",
        ],
        rows,
    )


BAYES_TIME_ROWS = (
    ("fedavg", "FedAvg"),
    ("bayfl", "BayFL"),
    ("bayfl (local estimator)", "BayFL, `bnn_estimator=local`"),
    ("meta_bayfl (sequential trials)", "Meta-BayFL"),
    ("meta_bayfl (local estimator)", "Meta-BayFL, `bnn_estimator=local`"),
)


def bayes_time() -> str:
    rows = []
    for k, suffix in (("20", ""), ("240", "_epoch")):
        before = read(BENCH / f"bayes_time{suffix}_before.json")
        after = read(BENCH / f"bayes_time{suffix}.json")

        def fmt(d: dict[str, Any], key: str) -> str:
            if key not in d:
                return "–"
            r = d[key]
            return f"{r['client_cpu_s_per_round']:.3f} ({r['ratio_vs_fedavg']:.2f})"

        for key, label in BAYES_TIME_ROWS:
            rows.append([k, label, fmt(before, key), fmt(after, key)])
    return table(["K", "method", "before: CPU s (ratio to FedAvg)", "after: CPU s (ratio)"], rows)


def scale() -> tuple[str, dict[str, Any]]:
    data = read(BENCH / "scale.json")
    rows = []
    for key, label in (
        ("a", "(a) 1,000 clients, 10 sampled per round"),
        ("b", "(b) 10 clients, all sampled"),
        ("a_no_spill", "(a) with spilling off"),
    ):
        r = data[key]
        st = r["store"]
        rows.append(
            [
                label,
                f"{mb(r['peak_rss_bytes']):,.0f} MB",
                f"{r['wall_s_per_round']:.2f}",
                f"{st['in_memory']} / {st['spilled']}",
                f"{mb(st['memory_bytes']):.1f} / {mb(st['disk_bytes']):.1f}",
            ]
        )
    md = table(
        [
            "configuration",
            "peak RSS",
            "s / round",
            "client states in memory / on disk",
            "store MB in memory / on disk",
        ],
        rows,
    )
    ns = data["a_no_spill"]["round_end_store_memory_bytes"]
    b = data["b"]
    per_client = b["store"]["memory_bytes"] / b["store"]["clients"]
    facts = {
        "fixed_mb": mb(data["a"]["rss_after_federation_bytes"]),
        "no_spill_store_growth_mb_per_round": mb(ns[-1] - ns[0]) / (len(ns) - 1),
        "one_state_per_client_gb_at_1000": per_client * 1000 / 1e9,
    }
    return md, facts


def flower_round_time() -> str:
    data = read(BENCH / "flower_round_time.json")
    rows = [
        [
            m,
            f"{data[m]['local']:.3f}",
            f"{data[m]['flower_sim']:.3f} ({data[m]['flower_sim_ratio']:.2f}×)",
        ]
        for m in ("fedlore", "fedfull")
    ]
    return table(["method", "in-process s / round", "Flower simulation s / round (ratio)"], rows)


def sim_ending() -> tuple[str, dict[str, Any]]:
    data = read(BENCH / "sim_ending.json")
    med = data["median"]
    labels = {"fedlore": "fedlore's (`sim_threads`)", "flower": "Flower's own"}
    rows = [
        [labels[arm], f"{med[arm]['tail']:.3f}", f"{med[arm]['total']:.2f}"]
        for arm in ("fedlore", "flower")
    ]
    md = table(["threads", "s after the ServerApp ended", "s per 2-round simulation"], rows)
    facts = {
        "repeats": data["repeats"],
        "tail_fedlore_s": med["fedlore"]["tail"],
        "tail_flower_s": med["flower"]["tail"],
        "saved_per_simulation_s": med["flower"]["total"] - med["fedlore"]["total"],
    }
    return md, facts


def transport() -> tuple[str, str, dict[str, Any]]:
    data = read(BENCH / "transport.json")
    b = data["bytes"]
    rows = []
    for key, label in (
        ("fedlore/fp32", ("FedLore", "fp32")),
        ("fedlore/fp16", ("FedLore", "fp16 or bf16")),
        ("fedfull/fp32", ("FedFull", "fp32")),
        ("fedfull/fp16", ("FedFull", "fp16 or bf16")),
    ):
        r, q = b["runs"][key], b["ratios"][key]
        rows.append(
            [
                *label,
                f"{mb(r['steady_bytes_up']):.2f} / {mb(r['steady_bytes_down']):.2f}",
                f"{q['vs_fedfull_fp32']:.3f}",
                f"{q['vs_fedfull_same_dtype']:.3f}",
                f"{q['vs_own_fp32']:.3f}",
            ]
        )
    md_bytes = table(
        [
            "method",
            "transport",
            "MB up / down per round",
            "÷ FedFull fp32",
            "÷ FedFull same dtype",
            "÷ own fp32",
        ],
        rows,
    )
    acc = data["accuracy/quickstart"]
    runs, med = acc["runs"], acc["median_final_accuracy"]
    rows = []
    for method, name in (("fedlore", "FedLore"), ("fedfull", "FedFull")):
        for dtype in ("fp32", "fp16", "bf16"):
            per = [runs[f"{method}/{dtype}/{s}"] for s in acc["seeds"]]
            delta = med[f"{method}/{dtype}"] - med[f"{method}/fp32"]
            total_mb = mb(per[0]["bytes_up_total"] + per[0]["bytes_down_total"])
            rows.append(
                [
                    name,
                    dtype,
                    ", ".join(f"{r['final_accuracy']:.4f}" for r in per),
                    "–" if dtype == "fp32" else f"{delta:+.4f}",
                    f"{total_mb:.1f}",
                ]
            )
    seeds = ", ".join(str(s) for s in acc["seeds"])
    md_acc = table(
        ["method", "transport", f"final accuracy (seeds {seeds})", "median − fp32's", "MB total"],
        rows,
    )
    fp = data["accuracy/fmnist_partial"]["runs"]

    def total(key: str) -> float:
        return float(fp[key]["bytes_up_total"] + fp[key]["bytes_down_total"])

    one = b["runs"]
    facts = {
        "fedlore_fp32_mb_per_client_direction": mb(one["fedlore/fp32"]["steady_bytes_up"])
        / one["fedlore/fp32"]["clients_per_round"],
        "codec_mb_one_client_fp32": mb(one["fedlore/fp32"]["codec_bytes_one_client"]),
        "codec_mb_one_client_16bit": mb(one["fedlore/fp16"]["codec_bytes_one_client"]),
        "codec_header_kb": (
            one["fedlore/fp32"]["codec_bytes_one_client"]
            - one["fedlore/fp32"]["counted_bytes_one_client"]
        )
        / 1e3,
        "fmnist_partial_fedlore_total_mb": {
            "fp32": mb(total("fedlore/fp32/42")),
            "fp16": mb(total("fedlore/fp16/42")),
        },
        "fmnist_partial_fedlore_total_fall_pct": 100
        * (1 - total("fedlore/fp16/42") / total("fedlore/fp32/42")),
    }
    return md_bytes, md_acc, facts


def pool_layout() -> str:
    """``benchmarks/pool_layout.py``: the CNN's two max-pools side by side."""
    rows = []
    for r in read(BENCH / "pool_layout.json")["rows"]:
        m = r["ms"]
        rows.append(
            [
                r["model"],
                f"{m['nchw']['step']:.2f}",
                f"{m['ours']['step']:.2f}",
                f"{r['step_speedup']:.2f}x",
                f"{m['nchw']['eval']:.0f}",
                f"{m['ours']['eval']:.0f}",
                f"{r['eval_speedup']:.2f}x",
                "yes" if r["identical"] else "NO",
            ]
        )
    header = [
        "model",
        "train step, nn.MaxPool2d (ms CPU)",
        "train step, fedlore (ms CPU)",
        "speed-up",
        "eval 2,048 images, nn.MaxPool2d (ms CPU)",
        "eval, fedlore (ms CPU)",
        "speed-up",
        "same logits and gradients",
    ]
    return table(header, rows)


def benchmarks() -> dict[str, str]:
    sub_md, sub_facts = subspace()
    scale_md, scale_facts = scale()
    bytes_md, acc_md, transport_facts = transport()
    ending_md, ending_facts = sim_ending()
    facts = {
        "subspace": sub_facts,
        "scale": scale_facts,
        "transport": transport_facts,
        "sim_ending": ending_facts,
    }
    return {
        "benchmarks/results/subspace.md": sub_md,
        "benchmarks/results/round_time.md": round_time(),
        "benchmarks/results/threads.md": threads("threads.json"),
        "benchmarks/results/threads_busy2.md": threads("threads_busy2.json"),
        "benchmarks/results/peer_pfl.md": peer_pfl(),
        "benchmarks/results/overhead.md": overhead(),
        "benchmarks/results/bayes_time.md": bayes_time(),
        "benchmarks/results/pool_layout.md": pool_layout(),
        "benchmarks/results/scale.md": scale_md,
        "benchmarks/results/flower_round_time.md": flower_round_time(),
        "benchmarks/results/sim_ending.md": ending_md,
        "benchmarks/results/transport_bytes.md": bytes_md,
        "benchmarks/results/transport_accuracy.md": acc_md,
        "benchmarks/results/summary.json": dump_json(facts),
    }
