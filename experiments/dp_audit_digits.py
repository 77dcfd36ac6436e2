"""The canary audit against the accountant on digits: the audit's ε beside dp-accounting's.

Protocol (``experiments/dp_audit_digits.yaml``, the digits federation of the local-against-central
DP section of docs/results/dp.md with ``dp.audit``: 500 canaries, 500 unseen directions): for
each seed and each σ of :data:`SIGMAS` one central-DP run, and one *sabotaged* run
(:data:`SABOTAGE`) whose server noise is σ/10 while the accountant is still told σ (the
driver patches :class:`fedlore.privacy.randomness.SecureSource` in that run's process; fedlore
has no such setting). Per run: the accountant's ``dp_epsilon``, the audit's final-model and
all-iterates estimates (``dp_audit_epsilon``, ``dp_audit_epsilon_all_iterates``), the fitted
cosine shift in null standard deviations, and the final test accuracy, from its
``summary.json``.

Usage::

    python experiments/dp_audit_digits.py experiments/dp_audit_digits.yaml
    python scripts/results_tables.py    # summary.md / summary.json for docs/results/dp.md

Each run is ``fedlore run CONFIG seeds=<s> dp.noise_multiplier=<σ> output_dir=<root>/<label>
--resume`` in its own process, one after another (8 runs of about 30 s on one core); rerunning
resumes. Writes ``experiments/results/dp_audit_digits/table.json``, one record per run;
:func:`summarize` turns it into the page's table and numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from dp_fmnist import run_logged  # experiments/ is the script's folder: on sys.path

SIGMAS = (4.0, 8.0, 16.0)
"""The noise multipliers audited as they are."""
SABOTAGE = (16.0, 0.1)
"""(σ the accountant is told, the share of its noise the server actually adds)."""


def label(sigma: float, scale: float = 1.0) -> str:
    return f"sigma-{sigma:g}" if scale == 1.0 else f"sabotaged-sigma-{sigma:g}-noise-{scale:g}"


def launch(config: str, root: Path, seed: int, sigma: float, scale: float) -> None:
    args = ["run", "--resume", config, f"seeds={seed}", f"dp.noise_multiplier={sigma:g}",
            f"output_dir={root / label(sigma, scale)}", "progress=false"]  # fmt: skip
    head = [sys.executable, "-m", "fedlore.cli"]
    if scale != 1.0:  # this process, with the server's noise cut to `scale` of what is claimed
        head = [sys.executable, __file__, "--sabotaged-run", f"{scale:g}", "--"]
    run_logged([*head, *args], root / "logs" / f"{label(sigma, scale)}-{seed}.log")


def sabotaged_run(scale: float, argv: list[str]) -> int:
    """``fedlore run`` with every Gaussian draw of the secure source scaled by ``scale``."""
    from fedlore.cli import main
    from fedlore.privacy.randomness import SecureSource

    honest = SecureSource.gaussian

    def weak(self: SecureSource, n: int, std: float, rnd: int, client: int) -> Any:
        return honest(self, n, std * scale, rnd, client)

    SecureSource.gaussian = weak  # type: ignore[method-assign]
    return main(argv)


def record(root: Path, cfg: Any, seed: int, sigma: float, scale: float) -> dict[str, Any]:
    (method,) = cfg.algorithms
    path = root / label(sigma, scale) / cfg.name / method / f"seed-{seed}" / "summary.json"
    s = json.loads(path.read_text())
    return {
        "label": label(sigma, scale),
        "seed": seed,
        "sigma": sigma,
        "noise_scale": scale,
        "rounds": s["rounds"],
        "final_accuracy": s["final_accuracy"],
        **{k: v for k, v in s.items() if k.startswith("dp_")},
    }


def intervals(run: dict[str, Any]) -> tuple[float, float, float, float]:
    """A run's 95 % intervals, final model and all iterates (low, high, low, high): from its
    summary (``dp_audit_epsilon_low`` ...), or, for a run recorded before the summary held
    them, from the fits it holds (the interval needs only each fit's mean, standard deviation
    and count: :func:`fedlore.privacy.empirical_error.epsilon_interval`)."""
    from fedlore.privacy.empirical import Fit
    from fedlore.privacy.empirical_error import epsilon_interval

    keys = [
        f"dp_audit_epsilon{part}_{end}" for part in ("", "_all_iterates") for end in ("low", "high")
    ]
    if all(k in run for k in keys):
        low, high, low_all, high_all = (float(run[k]) for k in keys)
        return low, high, low_all, high_all
    k, k0, d = run["dp_audit_canaries"], run["dp_audit_unseen"], run["dp_audit_dimension"]
    delta = run["dp_delta"]
    final = epsilon_interval(
        Fit(run["dp_audit_cosine_mean"], run["dp_audit_cosine_std"], k),
        Fit(0.0, run["dp_audit_null_std"], d),
        delta,
        null_exact=True,
    )
    every = epsilon_interval(
        Fit(run["dp_audit_max_cosine_mean"], run["dp_audit_max_cosine_std"], k),
        Fit(run["dp_audit_unseen_max_cosine_mean"], run["dp_audit_unseen_max_cosine_std"], k0),
        delta,
    )
    return final.low, final.high, every.low, every.high


def spans(setting: dict[str, Any], at: int) -> str:
    """Each seed's interval, "3.1–5.2, 2.9–4.8" (``at``: 0 final model, 2 all iterates)."""
    return ", ".join(f"{b[at]:.3g}–{b[at + 1]:.3g}" for b in setting["intervals"])


def summarize(rows: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The page's table (Markdown) and numbers (JSON) from ``table.json``'s rows: per setting
    the accountant's ε, the audit's estimates and the accuracy, means over the seeds, and each
    run's 95 % interval (:func:`intervals`)."""
    from fedlore.privacy.empirical import gdp_epsilon

    settings: dict[str, Any] = {}
    for name in dict.fromkeys(r["label"] for r in rows):
        runs = [r for r in rows if r["label"] == name]
        honest = runs[0]["noise_scale"] == 1.0
        key = f"sigma{runs[0]['sigma']:g}" if honest else "sabotaged"  # no dots: {result} paths
        eps = {r["dp_epsilon"] for r in runs}
        assert len(eps) == 1, f"{key}: ε differs between seeds: {eps}"
        shift = [r["dp_audit_cosine_mean"] / r["dp_audit_null_std"] for r in runs]
        ratio = [r["dp_audit_cosine_std"] / r["dp_audit_null_std"] for r in runs]
        final = [r["dp_audit_epsilon"] for r in runs]
        every = [r["dp_audit_epsilon_all_iterates"] for r in runs]
        bounds = [intervals(r) for r in runs]
        settings[key] = {
            # each run's interval (final model; all iterates), the lowest and highest ends
            "audit_low": min(b[0] for b in bounds),
            "audit_high": max(b[1] for b in bounds),
            "audit_all_iterates_low": min(b[2] for b in bounds),
            "audit_all_iterates_high": max(b[3] for b in bounds),
            # runs whose final-model / all-iterates interval lies wholly above the accountant's ε
            "above": sum(b[0] > r["dp_epsilon"] for b, r in zip(bounds, runs, strict=True)),
            "above_all_iterates": sum(
                b[2] > r["dp_epsilon"] for b, r in zip(bounds, runs, strict=True)
            ),
            "intervals": [list(b) for b in bounds],
            "sigma": runs[0]["sigma"],
            "noise_scale": runs[0]["noise_scale"],
            "seeds": len(runs),
            "epsilon": runs[0]["dp_epsilon"],
            "audit": statistics.mean(final),
            "audit_min": min(final),
            "audit_max": max(final),
            "audit_all_iterates": statistics.mean(every),
            "audit_all_iterates_max": max(every),
            "shift": statistics.mean(shift),
            # the estimate with the null's variance instead of the fitted one: μ-GDP of the shift
            "audit_equal_variance": statistics.mean(
                gdp_epsilon(m, r["dp_delta"]) for m, r in zip(shift, runs, strict=True)
            ),
            "std_ratio": statistics.mean(ratio),
            "audit_over_epsilon": statistics.mean(final) / runs[0]["dp_epsilon"],
            "audit_max_over_epsilon": max(final) / runs[0]["dp_epsilon"],
            "accuracy": 100 * statistics.mean(r["final_accuracy"] for r in runs),
            # a canary's own μ-GDP (inserted in every round, sensitivity C, noise σC): what the
            # final-model shift can reach, half the replace-one μ the accountant covers
            "canary_mu": runs[0]["rounds"] ** 0.5 / runs[0]["sigma"],
            # the same under the noise the server actually added (the sabotage's σ/10)
            "noise_mu": runs[0]["rounds"] ** 0.5 / (runs[0]["sigma"] * runs[0]["noise_scale"]),
            "noise_sigma": runs[0]["sigma"] * runs[0]["noise_scale"],
        }
    first = rows[0]
    facts = {
        "settings": settings,
        "canaries": first["dp_audit_canaries"],
        "unseen": first["dp_audit_unseen"],
        "dimension": first["dp_audit_dimension"],
        "delta": first["dp_delta"],
        "clip_norm": first["dp_clip_norm"],
        "seeds": len({r["seed"] for r in rows}),
        "rounds": first["rounds"],
        # the relative standard error of a fitted standard deviation, 1/√(2k)
        "std_error": 1 / (2 * first["dp_audit_canaries"]) ** 0.5,
    }
    lines = [
        "| mechanism | σ told the accountant | accountant ε | audit ε̂, final model | "
        "95 % intervals (per seed) | audit ε̂, all iterates | 95 % intervals (per seed) | "
        "cosine shift (null sd) | test acc. (%) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in settings.values():
        what = (
            "central DP" if s["noise_scale"] == 1 else f"sabotaged: noise σ × {s['noise_scale']:g}"
        )
        lines.append(
            f"| {what} | {s['sigma']:g} | {s['epsilon']:.3g} | {s['audit']:.3g} "
            f"({s['audit_min']:.3g}–{s['audit_max']:.3g}) | {spans(s, 0)} | "
            f"{s['audit_all_iterates']:.3g} | {spans(s, 2)} | "
            f"{s['shift']:.2f} | {s['accuracy']:.1f} |"
        )
    return "\n".join(lines) + "\n", facts


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--sabotaged-run":
        raise SystemExit(sabotaged_run(float(sys.argv[2]), sys.argv[4:]))
    from fedlore.config import load_config

    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--root", default=None, help="runs folder (default: the config's)")
    ap.add_argument("--out", default="experiments/results/dp_audit_digits")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    cfg = load_config(args.config)
    root = Path(args.root or cfg.output_dir)
    jobs = [(s, sigma, 1.0) for s in cfg.seeds for sigma in SIGMAS]
    jobs += [(s, *SABOTAGE) for s in cfg.seeds]
    if not args.table_only:
        for seed, sigma, scale in jobs:
            launch(args.config, root, seed, sigma, scale)
    rows = [record(root, cfg, seed, sigma, scale) for seed, sigma, scale in jobs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        final, every = r["dp_audit_epsilon"], r["dp_audit_epsilon_all_iterates"]
        print(f"{r['label']:32s} seed {r['seed']}: accountant ε {r['dp_epsilon']:.3g}, "
              f"audit {final:.3g} / all iterates {every:.3g}")  # fmt: skip
    print(f"results in {out}")


if __name__ == "__main__":
    main()
