"""The tables and quoted numbers of the documentation's Results pages, from the result files.

The pages under ``docs/results/`` never retype a measured number: they include Markdown tables
and quote single numbers (``{result}`` role) from JSON files of the tree. Where the experiment or
benchmark scripts leave no table in the form a page shows (they printed it to the terminal, or a
page combines several result files), or where a page's prose quotes a derived number (a ratio, a
difference, a span), this script writes it from the result files, beside them:

* ``experiments/results/<experiment>/summary.md`` / ``summary.json``: combined tables and the
  numbers the prose quotes (FedLore tables, partial participation, sketch vs projector, DP);
* ``benchmarks/results/<benchmark>.md`` and ``benchmarks/results/summary.json``: the benchmark
  tables and their derived numbers;
* the Meta-BayFL tables, through ``experiments/bayes_tables.py --write``.

    python scripts/results_tables.py           # (re)write every generated file
    python scripts/results_tables.py --check   # exit 1, naming each file that differs

It only reformats what the result files hold; it never reruns an experiment or a benchmark.
``tests/test_docs_results.py`` checks that every committed file is what this writes.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments" / "results"
BENCH = ROOT / "benchmarks" / "results"
LORA = ("fedit", "ffa_lora", "flexlora", "lora_fair", "rolora", "flora", "frlora")


# ---------------------------------------------------------------- helpers
def read(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def dump_json(data: Any) -> str:
    """The committed form of a generated JSON file (sorted keys, floats as Python writes them)."""
    return json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def span(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values)}


def rate(lr: float) -> str:
    """``0.003`` -> ``3e-3``: a learning rate as the pages write it (and a key without a dot)."""
    return f"{lr:.0e}".replace("e-0", "e-")


def per_seed(values: dict[str, float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values.values())


def mb(x: float) -> float:
    return x / 1e6


def bayes_tables() -> ModuleType:
    path = ROOT / "experiments" / "bayes_tables.py"
    spec = importlib.util.spec_from_file_location("bayes_tables", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- fedlore report folders
def report_csv(folder: Path) -> dict[str, dict[str, float]]:
    """``fedlore report``'s ``report.csv``: ``{method: {column: value}}``."""
    with (folder / "report.csv").open(encoding="utf-8") as f:
        return {
            row["method"]: {k: float(v) for k, v in row.items() if k != "method"}
            for row in csv.DictReader(f)
        }


def cell(text: str) -> dict[str, float] | float | None:
    """A report.md cell: ``0.500 ± 0.031`` -> mean and std, ``149`` -> 149, ``–`` -> None."""
    text = text.strip().replace(",", "")
    if text in ("–", "-", ""):
        return None
    if "±" in text:
        m, s = (float(x) for x in text.split("±"))
        return {"mean": m, "std": s}
    return float(text)


def report_diagnostics(folder: Path) -> dict[str, dict[str, Any]]:
    """The Diagnostics table of ``fedlore report``'s ``report.md``: ``{method: {column: ...}}``."""
    text = (folder / "report.md").read_text(encoding="utf-8")
    part = text.split("## Diagnostics", 1)[1]
    rows = [line for line in part.splitlines() if line.startswith("|")]
    header = [h.strip() for h in rows[0].strip("|").split("|")]
    out = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = {h: cell(c) for h, c in zip(header[1:], cells[1:], strict=True)}
    return out


def fmnist_dir01() -> dict[str, str]:
    rep = report_csv(EXP / "fmnist_dir01")
    ff, fl = rep["fedfull"], rep["fedlore"]
    facts = {
        "methods": rep,
        "fedfull_over_fedlore": {
            "mb_up": ff["mb_up_mean"] / fl["mb_up_mean"],
            "mb_down": ff["mb_down_mean"] / fl["mb_down_mean"],
            "optimizer_state": ff["optimizer_state_bytes_mean"] / fl["optimizer_state_bytes_mean"],
        },
        "fedlore_minus": {
            m: fl["final_accuracy_pct_mean"] - rep[m]["final_accuracy_pct_mean"]
            for m in ("fedfull", "local_galore", "fedlore_fixed", "fedlore_random")
        },
        "fedfull_minus_fedlore": ff["final_accuracy_pct_mean"] - fl["final_accuracy_pct_mean"],
    }
    return {"experiments/results/fmnist_dir01/summary.json": dump_json(facts)}


def fmnist_partial() -> dict[str, str]:
    folder = EXP / "fmnist_partial"
    rep = report_csv(folder)
    ff, fl = rep["fedfull"], rep["fedlore"]
    diag = report_diagnostics(folder)
    facts = {
        "methods": rep,
        "diagnostics": diag,
        "fedlore_certificate2_over_rho2": diag["fedlore"]["certificate2"]
        / diag["fedlore"]["rho2"]["mean"],
        "fedfull_over_fedlore": {
            "mb_up": ff["mb_up_mean"] / fl["mb_up_mean"],
            "mb_down": ff["mb_down_mean"] / fl["mb_down_mean"],
        },
        "local_galore_minus_fedlore": rep["local_galore"]["final_accuracy_pct_mean"]
        - fl["final_accuracy_pct_mean"],
    }
    return {"experiments/results/fmnist_partial/summary.json": dump_json(facts)}


# ---------------------------------------------------------------- sketch vs projector
SKETCH = EXP / "sketch_vs_projector"
SKETCH_METHODS = ("fedlore_sketch", "fedlore", "fedlore_random")
SEVEN = "7-rate grid on the selection split, seed 42"
# (folder, setting, protocol); ``{chosen}`` becomes the three chosen rates
SKETCH_SETTINGS = (
    ("quickstart", "quickstart (digits, 10 clients, MLP, r = 8)", SEVEN + "; chosen {chosen}"),
    (
        "pretrain",
        "LLaMA pre-training (0.93 M, fortunes/C4 protocol, 20 clients, r = 32)",
        "7-rate grid for FedLore-Sketch, which chose {sketch_lr} (selection PPL {sel:.1f}; next "
        "best {next_ppl:.1f} at {next_lr}); FedLore and FedLore-Random at {fedlore_lr}, the rate "
        "the same grid chose for them in Table 3",
    ),
    (
        "fmnist_full_screen",
        "Fashion-MNIST, full participation (20 clients, Dirichlet α = 0.1, CNN, r = 8, 30 × 10)",
        SEVEN + " (the rates 1e-4, 3e-4 and 8e-4 ran later, on another machine: "
        "`fmnist_full_screen/low_rates.md`); chosen {chosen}",
    ),
    ("fmnist_full", "the same, at the base config's 1e-3 for all", "one rate, seeds 42–44"),
    (
        "fmnist_partial_grid",
        "Fashion-MNIST, partial participation (100 clients, 10 per round, Dirichlet α = 0.1, "
        "CNN, r = 8, 60 × 10)",
        SEVEN + "; chosen {chosen}",
    ),
    (
        "fmnist_partial",
        "the same, at the base config's 1e-3 for all (earlier machine)",
        "one rate, seeds 42–44",
    ),
)


def sketch_setting(folder: str) -> dict[str, Any]:
    tab = read(SKETCH / folder / "table.json")
    energy = {e["method"]: e for e in read(SKETCH / folder / "energy.json")}
    out: dict[str, Any] = {}
    for m in SKETCH_METHODS:
        row = tab["methods"][m]
        scores = row.get("final_accuracy") or row["final_perplexity"]
        out[m] = {
            "lr": rate(row["lr"]),
            "mean": row["mean"],
            "std": row["std"],
            "per_seed": list(scores.values()),
            "energy": energy[m]["retained_energy"],
            "energy_std": energy[m]["retained_energy_std"],
            "mb_up_per_client_round": mb(row["up_per_client"]),
            "selection_grid_seed42": [
                row["selection_grid_seed42"][k]
                for k in sorted(row["selection_grid_seed42"], key=float)
            ],
            "selection_grid_rates": [
                rate(float(k)) for k in sorted(row["selection_grid_seed42"], key=float)
            ],
            "test_grid_seed42": {rate(float(k)): v for k, v in row["test_grid_seed42"].items()},
        }
    return out


def sketch_vs_projector() -> dict[str, str]:
    settings = {folder: sketch_setting(folder) for folder, _, _ in SKETCH_SETTINGS}
    rows = []
    for folder, label, protocol in SKETCH_SETTINGS:
        s = settings[folder]
        sk = s["fedlore_sketch"]
        sel = sk["selection_grid_seed42"]
        ranked = sorted(zip(sel, sk["selection_grid_rates"], strict=True))
        text = protocol.format(
            chosen=" / ".join(s[m]["lr"] for m in SKETCH_METHODS),
            sketch_lr=sk["lr"],
            fedlore_lr=s["fedlore"]["lr"],
            sel=ranked[0][0],
            next_ppl=ranked[1][0] if len(ranked) > 1 else float("nan"),
            next_lr=ranked[1][1] if len(ranked) > 1 else "",
        )
        cells = []
        for m in SKETCH_METHODS:
            r = s[m]
            seeds = ", ".join(f"{v:.1f}" for v in r["per_seed"])
            score = (
                f"PPL {r['mean']:.2f} ± {r['std']:.2f}"
                if folder == "pretrain"
                else f"{r['mean']:.2f} ± {r['std']:.2f} %"
            )
            cells.append(f"{score} ({seeds}), energy {r['energy']:.3f}")
        rows.append([label, text, *cells])
    md = table(["setting", "protocol", "FedLore-Sketch", "FedLore", "FedLore-Random"], rows)

    def acc(folder: str, m: str) -> float:
        return float(settings[folder][m]["mean"])

    partial = settings["fmnist_partial"]
    facts = {
        "settings": settings,
        "fedlore_minus_sketch_full_tuned": acc("fmnist_full_screen", "fedlore")
        - acc("fmnist_full_screen", "fedlore_sketch"),
        "sketch_minus_fedlore_full_1e-3": acc("fmnist_full", "fedlore_sketch")
        - acc("fmnist_full", "fedlore"),
        "sketch_minus_fedlore_partial_1e-3": acc("fmnist_partial", "fedlore_sketch")
        - acc("fmnist_partial", "fedlore"),
        "sketch_ahead_on_seeds_partial_1e-3": sum(
            a > b
            for a, b in zip(
                partial["fedlore_sketch"]["per_seed"], partial["fedlore"]["per_seed"], strict=True
            )
        ),
        "sketch_minus_fedlore_partial_tuned": acc("fmnist_partial_grid", "fedlore_sketch")
        - acc("fmnist_partial_grid", "fedlore"),
    }
    return {
        "experiments/results/sketch_vs_projector/summary.md": md,
        "experiments/results/sketch_vs_projector/summary.json": dump_json(facts),
    }


# ---------------------------------------------------------------- DP at equal epsilon
def dp() -> dict[str, str]:
    rows = read(EXP / "dp_fmnist" / "table.json")
    by = {(r["method"], r["epsilon"]): r for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    names = {"fedlore_sketch": "FedLore-Sketch", "fedfull": "FedFull", "fedit": "FedIT"}
    names["ffa_lora"] = "FFA-LoRA"
    full = {eps: by[("fedfull", eps)] for eps in ("2", "8", "none")}
    facts: dict[str, Any] = {"methods": {}}
    md_rows = []
    for m in methods:
        none = by[(m, "none")]
        entry: dict[str, Any] = {
            "upload_coordinates": none["upload_coordinates"],
            "fedfull_coordinates_over_own": full["none"]["upload_coordinates"]
            / none["upload_coordinates"],
            "accuracy_no_dp": none["accuracy_mean"],
        }
        for eps in ("2", "8"):
            r = by[(m, eps)]
            entry[f"eps{eps}"] = {
                "accuracy": r["accuracy_mean"],
                "accuracy_std": r["accuracy_std"],
                "minus_no_dp": r["accuracy_mean"] - none["accuracy_mean"],
                "lost_to_dp": none["accuracy_mean"] - r["accuracy_mean"],
                "noise_to_signal": r["noise_to_signal"],
                "fedfull_noise_to_signal_over_own": full[eps]["noise_to_signal"]
                / r["noise_to_signal"],
                "clip_norm": r["clip_norm"],
                "sigma": r["noise_multiplier"],
            }
        facts["methods"][m] = entry
        md_rows.append(
            [
                names.get(m, m),
                f"{entry['upload_coordinates']:,.0f}",
                f"{entry['fedfull_coordinates_over_own']:.1f}",
                *(f"{entry[f'eps{e}']['fedfull_noise_to_signal_over_own']:.1f}" for e in "28"),
                *(f"{entry[f'eps{e}']['minus_no_dp']:+.2f}" for e in "28"),
            ]
        )
    low = [m for m in methods if m != "fedfull"]
    facts["low_rank"] = {
        "fedfull_coordinates_over_own": span(
            [facts["methods"][m]["fedfull_coordinates_over_own"] for m in low]
        ),
        "fedfull_noise_to_signal_over_own": span(
            [
                facts["methods"][m][f"eps{e}"]["fedfull_noise_to_signal_over_own"]
                for m in low
                for e in "28"
            ]
        ),
        **{
            f"eps{e}_accuracy": span([facts["methods"][m][f"eps{e}"]["accuracy"] for m in low])
            for e in "28"
        },
    }
    facts["max_std_under_dp"] = max(r["accuracy_std"] for r in rows if r["epsilon"] != "none")
    fedfull_none = full["none"]["accuracy_mean"]
    facts["fedfull_lead_without_dp"] = span(
        [fedfull_none - facts["methods"][m]["accuracy_no_dp"] for m in low]
    )
    md = table(
        [
            "method",
            "upload coords / client / round",
            "FedFull's coords ÷ own",
            "FedFull's noise / signal ÷ own, ε = 2",
            "the same, ε = 8",
            "ε = 2: acc. − no DP (points)",
            "ε = 8: acc. − no DP (points)",
        ],
        md_rows,
    )
    return {
        "experiments/results/dp_fmnist/summary.md": md,
        "experiments/results/dp_fmnist/summary.json": dump_json(facts),
    }


# ---------------------------------------------------------------- Tables 1 and 2 (lr_grid)
def grid_table_facts(folder: str) -> dict[str, str]:
    """The ratios and differences the Table 1 / Table 2 reading quotes."""
    tab = read(EXP / folder / "table.json")
    m = tab["methods"]
    fl = m["fedlore"]
    lora = [x for x in LORA if x in m]
    two_factor = [x for x in lora if x not in ("ffa_lora", "rolora")]
    top = {x: max(tab["grid"][x]) for x in lora}
    facts = {
        "methods": {
            k: {
                "lr": rate(v["lr"]),
                "mean": v["mean"],
                "std": v["std"],
                "mb_up": mb(v["up_per_client"]),
                "mb_down": mb(v["down_per_client"]),
                "optimizer_state_mb": mb(v["optimizer_state_bytes"]),
            }
            for k, v in m.items()
        },
        "fedfull_over_fedlore": {
            "mb_up": m["fedfull"]["up_per_client"] / fl["up_per_client"],
            "optimizer_state": m["fedfull"]["optimizer_state_bytes"] / fl["optimizer_state_bytes"],
        },
        "local_galore_over_fedlore_mb_up": m["local_galore"]["up_per_client"] / fl["up_per_client"],
        "two_factor_lora_over_fedlore_optimizer_state": span(
            [m[x]["optimizer_state_bytes"] / fl["optimizer_state_bytes"] for x in two_factor]
        ),
        "lora_minus_fedlore": span([m[x]["mean"] - fl["mean"] for x in lora]),
        "fedfull_minus_fedlore": m["fedfull"]["mean"] - fl["mean"],
        "lora_at_top_of_grid": sum(m[x]["lr"] == top[x] for x in lora),
        "lora_methods": len(lora),
        "at_top_of_grid": sorted(x for x in m if m[x]["lr"] == max(tab["grid"][x])),
        "at_top_of_grid_count": sum(m[x]["lr"] == max(tab["grid"][x]) for x in m),
        "method_count": len(m),
        "seeds": len(fl.get("final_accuracy") or fl.get("final_accuracy_pct") or {}),
    }
    if isinstance(fl.get("final_accuracy"), dict):  # per seed: the same partition for each method
        facts["fedlore_minus_paired"] = {
            x: {
                "mean": statistics.fmean(
                    fl["final_accuracy"][s] - v["final_accuracy"][s] for s in fl["final_accuracy"]
                ),
                "seeds_ahead": sum(
                    fl["final_accuracy"][s] > v["final_accuracy"][s] for s in fl["final_accuracy"]
                ),
            }
            for x, v in m.items()
            if x != "fedlore"
        }
        facts["lora_above_fedlore"] = sorted(x for x in lora if m[x]["mean"] > fl["mean"])
    return {f"experiments/results/{folder}/summary.json": dump_json(facts)}


# ---------------------------------------------------------------- Tables 3 and 4 (pre-training)
def pretrain() -> dict[str, str]:
    t3 = read(EXP / "pretrain_table3" / "table.json")["methods"]
    fl, ff = t3["fedlore"], t3["fedfull"]

    def sel(method: str) -> dict[str, float]:
        grid = t3[method]["selection_grid_seed42"]
        return {rate(float(k)): v for k, v in grid.items()}

    facts3 = {
        "methods": {
            k: {
                "lr": rate(v["lr"]),
                "ppl": v["mean"],
                "ppl_std": v["std"],
                "loss": v["loss_mean"],
                "mb_up": mb(v["up_per_client"]),
                "mb_down": mb(v["down_per_client"]),
                "optimizer_state_mb": mb(v["optimizer_state_bytes"]),
                "selection_ppl": sel(k),
            }
            for k, v in t3.items()
        },
        "fedlore_upload_saving_vs_fedfull_pct": 100
        * (1 - fl["up_per_client"] / ff["up_per_client"]),
        "fedlore_state_saving_vs_fedfull_pct": 100
        * (1 - fl["optimizer_state_bytes"] / ff["optimizer_state_bytes"]),
        "fedlore_minus_fedit_ppl": fl["mean"] - t3["fedit"]["mean"],
    }
    abl = EXP / "pretrain_ablation"
    ranks = {"8": "rank-8", "16": "rank-16", "32": ".", "48": "rank-48"}
    rank_ppl = {
        r: read(abl / d / "table.json")["methods"]["fedlore"]["mean"] for r, d in ranks.items()
    }
    am = read(abl / "table.json")["methods"]
    facts_abl = {
        "methods": {k: {"ppl": v["mean"], "ppl_std": v["std"]} for k, v in am.items()},
        "rank_ppl": rank_ppl,
        "rank_8_to_32_gain_pct": 100 * (rank_ppl["8"] - rank_ppl["32"]) / rank_ppl["8"],
    }
    return {
        "experiments/results/pretrain_table3/summary.json": dump_json(facts3),
        "experiments/results/pretrain_ablation/summary.json": dump_json(facts_abl),
    }


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
            total = mb(per[0]["bytes_up_total"] + per[0]["bytes_down_total"])
            rows.append(
                [
                    name,
                    dtype,
                    ", ".join(f"{r['final_accuracy']:.4f}" for r in per),
                    "–" if dtype == "fp32" else f"{delta:+.4f}",
                    f"{total:.1f}",
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


def benchmarks() -> dict[str, str]:
    sub_md, sub_facts = subspace()
    scale_md, scale_facts = scale()
    bytes_md, acc_md, transport_facts = transport()
    facts = {"subspace": sub_facts, "scale": scale_facts, "transport": transport_facts}
    return {
        "benchmarks/results/subspace.md": sub_md,
        "benchmarks/results/round_time.md": round_time(),
        "benchmarks/results/threads.md": threads("threads.json"),
        "benchmarks/results/threads_busy2.md": threads("threads_busy2.json"),
        "benchmarks/results/peer_pfl.md": peer_pfl(),
        "benchmarks/results/overhead.md": overhead(),
        "benchmarks/results/bayes_time.md": bayes_time(),
        "benchmarks/results/scale.md": scale_md,
        "benchmarks/results/flower_round_time.md": flower_round_time(),
        "benchmarks/results/transport_bytes.md": bytes_md,
        "benchmarks/results/transport_accuracy.md": acc_md,
        "benchmarks/results/summary.json": dump_json(facts),
    }


# ---------------------------------------------------------------- all of it
def bayes_fedlore() -> dict[str, str]:
    """Bayesian FedLore against BayFL and Meta-BayFL (``experiments/bayes_fedlore.yaml``): per
    table the methods' means over seeds, and the ratios and differences the page quotes."""
    facts: dict[str, Any] = {}
    for name in ("table3", "table6"):
        path = EXP / "bayes_fedlore" / name / "table.json"
        if not path.exists():
            continue
        mean = {
            r["method"]: {
                k: statistics.fmean(v)
                for k, v in r.items()
                if isinstance(v, list) and v and k != "setting"
            }
            for r in read(path)
        }
        pairs = {"fedlore_bayfl": "bayfl", "fedlore_bayes": "meta_bayfl"}
        best = {"fedlore_bayes_vs_bayfl": ("fedlore_bayes", "bayfl")}
        facts[name] = {
            "methods": mean,
            "bytes_up_ratio": {
                m: mean[m]["bytes_up_total"] / mean[d]["bytes_up_total"] for m, d in pairs.items()
            },
            "bytes_down_ratio": {
                m: mean[m]["bytes_down_total"] / mean[d]["bytes_down_total"]
                for m, d in pairs.items()
            },
            "accuracy_pct_minus": {
                m: 100 * (mean[m]["final_accuracy"] - mean[d]["final_accuracy"])
                for m, d in pairs.items()
            },
            "nll_minus": {
                m: mean[m]["final_loss"] - mean[d]["final_loss"] for m, d in pairs.items()
            },
            "ece_minus": {m: mean[m]["final_ece"] - mean[d]["final_ece"] for m, d in pairs.items()},
        }
        for key, (m, d) in best.items():
            facts[name][key] = {
                "accuracy_pct_minus": 100 * (mean[m]["final_accuracy"] - mean[d]["final_accuracy"]),
                "nll_minus": mean[m]["final_loss"] - mean[d]["final_loss"],
                "ece_minus": mean[m]["final_ece"] - mean[d]["final_ece"],
            }
    return {"experiments/results/bayes_fedlore/summary.json": dump_json(facts)}


GENERATORS: tuple[Callable[[], dict[str, str]], ...] = (
    fmnist_dir01,
    fmnist_partial,
    sketch_vs_projector,
    dp,
    lambda: grid_table_facts("vision_table1"),
    lambda: grid_table_facts("text_table2"),
    pretrain,
    bayes_fedlore,
    benchmarks,
)


def outputs() -> dict[str, str]:
    """``{path relative to the repository: text}`` of every generated file."""
    out = {
        f"experiments/results/{path}": text for path, text in bayes_tables().outputs(EXP).items()
    }
    for gen in GENERATORS:
        out.update(gen())
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    stale = []
    for path, text in outputs().items():
        file = ROOT / path
        if check:
            if not file.is_file() or file.read_text(encoding="utf-8") != text:
                stale.append(path)
        else:
            file.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    for path in stale:
        print(f"differs from its result files: {path}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
