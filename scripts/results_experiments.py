"""The experiments' derived tables and quoted numbers (``experiments/results/<experiment>/``
``summary.md`` / ``summary.json``), for ``scripts/results_tables.py``: Fashion-MNIST, the sketch
against the projector, DP; the rival tables' are in ``results_rivals.py``."""

from __future__ import annotations

import csv
import importlib.util
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from results_common import EXP, dump_json, mb, rate, read, read_grid, span, table


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
    tab = read_grid(SKETCH / folder / "table.json")
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


# ---------------------------------------------------------------- local against central DP
def ldp() -> dict[str, str]:
    """``experiments/ldp_digits.py``'s runs: per DP mode the test accuracy (mean ± std over the
    seeds, in %) and ε, at the runs' σ and C."""
    rows = read(EXP / "ldp_digits" / "table.json")
    modes: dict[str, Any] = {}
    for mode in ("none", "central", "local"):
        runs = [r for r in rows if r["mode"] == mode]
        accs = [100 * r["final_accuracy"] for r in runs]
        entry: dict[str, Any] = {
            "accuracy": statistics.mean(accs),
            "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "seeds": len(runs),
        }
        if mode != "none":
            epsilons = [r["dp_epsilon"] for r in runs]
            assert max(epsilons) == min(epsilons), f"{mode}: ε differs between seeds: {epsilons}"
            entry["epsilon"] = epsilons[0]
        modes[mode] = entry
    dp_run = next(r for r in rows if r["mode"] == "local")
    m = dp_run["clients_per_round"]
    facts = {
        "modes": modes,
        "sigma": dp_run["dp_noise_multiplier"],
        "clip_norm": dp_run["dp_clip_norm"],
        "delta": dp_run["dp_delta"],
        "rounds": dp_run["rounds"],
        "clients_per_round": m,
        "seeds": modes["local"]["seeds"],
        "local_over_central_noise": math.sqrt(m),
        "central_minus_local": modes["central"]["accuracy"] - modes["local"]["accuracy"],
        "none_minus_central": modes["none"]["accuracy"] - modes["central"]["accuracy"],
    }
    names = {"none": "no DP", "central": "central DP", "local": "local DP"}
    md_rows = []
    for mode, e in modes.items():
        noise = {"none": "–", "central": "σC on the sum", "local": "σC on each upload"}[mode]
        eps = f"{e['epsilon']:.3g}" if "epsilon" in e else "∞"
        md_rows.append([names[mode], noise, eps, f"{e['accuracy']:.1f} ± {e['accuracy_std']:.1f}"])
    delta = f"{facts['delta']:.0e}".replace("e-0", "e-")
    md = table(["DP", "noise", f"ε (δ = {delta})", "test acc. (%)"], md_rows)
    return {
        "experiments/results/ldp_digits/summary.md": md,
        "experiments/results/ldp_digits/summary.json": dump_json(facts),
    }


# ---------------------------------------------------------------- FedPer under central and local DP
def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def ldp_personal() -> dict[str, str]:
    """``experiments/ldp_personal.py``'s runs: per method and DP mode P-local and the global
    model's accuracy (mean ± std over the seeds, in %) and ε, at the runs' σ and C."""
    rows = read(EXP / "ldp_personal" / "table.json")
    methods: dict[str, Any] = {}
    for method in sorted({r["method"] for r in rows}):
        modes: dict[str, Any] = {}
        for mode in ("none", "central", "local"):
            runs = [r for r in rows if r["method"] == method and r["mode"] == mode]
            local, local_std = _mean_std([100 * r["local_accuracy"] for r in runs])
            glob, glob_std = _mean_std([100 * r["final_accuracy"] for r in runs])
            entry: dict[str, Any] = {"p_local": local, "p_local_std": local_std,
                                     "g_central": glob, "g_central_std": glob_std,
                                     "seeds": len(runs)}  # fmt: skip
            if mode != "none":
                epsilons = {r["dp_epsilon"] for r in runs}
                assert len(epsilons) == 1, f"{method} {mode}: ε differs between seeds: {epsilons}"
                entry["epsilon"] = epsilons.pop()
            modes[mode] = entry
        modes["none_minus_central"] = modes["none"]["p_local"] - modes["central"]["p_local"]
        modes["central_minus_local"] = modes["central"]["p_local"] - modes["local"]["p_local"]
        methods[method] = modes
    run = next(r for r in rows if r["mode"] == "local")
    m = run["clients_per_round"]
    facts = {
        "methods": methods,
        "sigma": run["dp_noise_multiplier"],
        "clip_norm": run["dp_clip_norm"],
        "delta": run["dp_delta"],
        "rounds": run["rounds"],
        "clients_per_round": m,
        "seeds": methods["fedper"]["local"]["seeds"],
        "local_over_central_noise": math.sqrt(m),
        "fedper_over_fedavg_p_local": {
            mode: methods["fedper"][mode]["p_local"] - methods["fedavg"][mode]["p_local"]
            for mode in ("none", "central", "local")
        },
    }
    names = {"fedavg": "FedAvg", "fedper": "FedPer"}
    dps = {"none": "no DP", "central": "central DP", "local": "local DP"}
    md_rows = []
    for method, modes in methods.items():
        for mode in ("none", "central", "local"):
            e = modes[mode]
            eps = f"{e['epsilon']:.3g}" if "epsilon" in e else "∞"
            md_rows.append([names.get(method, method), dps[mode], eps,
                            f"{e['p_local']:.1f} ± {e['p_local_std']:.1f}",
                            f"{e['g_central']:.1f} ± {e['g_central_std']:.1f}"])  # fmt: skip
    delta = f"{facts['delta']:.0e}".replace("e-0", "e-")
    md = table(["method", "DP", f"ε (δ = {delta})", "P-local (%)", "G-central (%)"], md_rows)
    return {
        "experiments/results/ldp_personal/summary.md": md,
        "experiments/results/ldp_personal/summary.json": dump_json(facts),
    }


# ---------------------------------------------------------------- upload compression
def compression() -> dict[str, str]:
    """``experiments/results/compression/summary.*`` from its ``table.json``, by the driver's
    own :func:`summarize` (``experiments/compression.py``)."""
    path = EXP.parents[0] / "compression.py"
    spec = importlib.util.spec_from_file_location("compression_driver", path)
    assert spec and spec.loader
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    md, facts = driver.summarize(read(EXP / "compression" / "table.json"))
    return {
        "experiments/results/compression/summary.md": md,
        "experiments/results/compression/summary.json": dump_json(facts),
    }


# ---------------------------------------------------------------- the canary audit of DP
def dp_audit() -> dict[str, str]:
    """``experiments/results/dp_audit_digits/summary.*`` from its ``table.json``, by the
    driver's own :func:`summarize` (``experiments/dp_audit_digits.py``)."""
    path = EXP.parents[0] / "dp_audit_digits.py"
    spec = importlib.util.spec_from_file_location("dp_audit_driver", path)
    assert spec and spec.loader
    driver = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # the driver imports dp_fmnist beside it
    try:
        spec.loader.exec_module(driver)
    finally:
        sys.path.remove(str(path.parent))
    md, facts = driver.summarize(read(EXP / "dp_audit_digits" / "table.json"))
    return {
        "experiments/results/dp_audit_digits/summary.md": md,
        "experiments/results/dp_audit_digits/summary.json": dump_json(facts),
    }
