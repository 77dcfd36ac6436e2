"""The experiments' derived tables and quoted numbers (``experiments/results/<experiment>/``
``summary.md`` / ``summary.json``), for ``scripts/results_tables.py``."""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path
from typing import Any

from results_common import EXP, LORA, dump_json, mb, rate, read, span, table


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
        "at_bottom_of_grid": sorted(x for x in m if m[x]["lr"] == min(tab["grid"][x])),
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
    rank_seeds = {r: read(abl / d / "table.json")["methods"]["fedlore"] for r, d in ranks.items()}
    facts_abl = {
        "methods": {k: {"ppl": v["mean"], "ppl_std": v["std"]} for k, v in am.items()},
        "seeds": len(am["fedlore"]["final_perplexity"]),
        # per seed (the same allocation and data order for each setting): how far each setting
        # is from FedLore, and on how many seeds it is worse
        "minus_fedlore_paired": {
            k: paired(v["final_perplexity"], am["fedlore"]["final_perplexity"])
            for k, v in am.items()
            if k != "fedlore"
        },
        "rank_ppl": rank_ppl,
        "rank_minus_r32_paired": {
            r: paired(v["final_perplexity"], rank_seeds["32"]["final_perplexity"])
            for r, v in rank_seeds.items()
            if r != "32"
        },
        "rank_8_to_32_gain_pct": 100 * (rank_ppl["8"] - rank_ppl["32"]) / rank_ppl["8"],
    }
    return {
        "experiments/results/pretrain_table3/summary.json": dump_json(facts3),
        "experiments/results/pretrain_ablation/summary.json": dump_json(facts_abl),
    }


def subspace_rivals() -> dict[str, str]:
    """FedLore's rivals side by side (issue 35) on the Table 1, 2 and 3 analogues
    (``subspace_rivals/``, ``text_rivals/``, ``pretrain_rivals/``; a table not yet produced is
    skipped): per method, the per-seed difference from FedLore (accuracy: FedLore minus it, so
    positive = FedLore ahead; perplexity: it minus FedLore, so positive = FedLore ahead too) and
    how many times FedLore's bytes up and optimizer state it uses. Where FedSLoP's SGD grid was
    extended (``fedslop_grid/``: downward on the ViT, upward in pre-training) also its seed-42
    selection score per rate over both grids and the rate they choose."""
    out: dict[str, str] = {}
    for name, metric in (
        ("subspace_rivals", "final_accuracy"),
        ("text_rivals", "final_accuracy"),
        ("pretrain_rivals", "final_perplexity"),
    ):
        folder = EXP / name
        if not (folder / "table.json").exists():
            continue
        methods = read(folder / "table.json")["methods"]
        fl = methods["fedlore"]
        facts: dict[str, Any] = {
            "fedlore_ahead_paired": {
                m: rivals_paired(v[metric], fl[metric], lower_is_better=metric.endswith("plexity"))
                for m, v in methods.items()
                if m != "fedlore"
            },
            "over_fedlore": {
                m: {
                    "mb_up": v["up_per_client"] / fl["up_per_client"],
                    "optimizer_state": v["optimizer_state_bytes"] / fl["optimizer_state_bytes"],
                }
                for m, v in methods.items()
                if m != "fedlore"
            },
            "best": (min if metric.endswith("plexity") else max)(
                methods, key=lambda m: methods[m]["mean"]
            ),
        }
        if (folder / "fedslop_grid" / "table.json").exists():  # FedSLoP's grid, extended
            grids = [methods["fedslop"]]
            grids.append(read(folder / "fedslop_grid" / "table.json")["methods"]["fedslop"])
            selection = {
                rate(float(lr)): score
                for g in grids
                for lr, score in g["selection_grid_seed42"].items()
            }
            finite = [k for k in selection if math.isfinite(selection[k])]
            facts["fedslop_selection_seed42"] = selection
            facts["fedslop_best_rate"] = (min if metric.endswith("plexity") else max)(
                finite, key=lambda k: selection[k]
            )
        out[f"experiments/results/{name}/summary.json"] = dump_json(facts)
    return out


def rivals_paired(
    values: dict[str, float], fedlore: dict[str, float], lower_is_better: bool
) -> dict[str, float]:
    """How far FedLore is ahead of a method, seed by seed: the mean of the per-seed margins
    (positive: FedLore better) and on how many of the seeds both hold FedLore is better."""
    seeds = [s for s in values if s in fedlore]
    sign = -1.0 if lower_is_better else 1.0
    margins = [sign * (fedlore[s] - values[s]) for s in seeds]
    return {
        "mean": statistics.fmean(margins),
        "seeds_ahead": sum(d > 0 for d in margins),
        "seeds": len(seeds),
    }


def paired(values: dict[str, float], reference: dict[str, float]) -> dict[str, float]:
    """Per-seed differences ``values - reference`` over the seeds both hold: their mean, and on
    how many seeds ``values`` is the larger (for a perplexity: the worse)."""
    seeds = [s for s in values if s in reference]
    diffs = [values[s] - reference[s] for s in seeds]
    return {"mean": statistics.fmean(diffs), "seeds_above": sum(d > 0 for d in diffs)}


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
