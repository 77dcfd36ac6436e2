"""How much one client's upload leaks: gradient inversion against each method's upload
(issue 35, part 3; :mod:`fedlore.audit`).

For each data set (sklearn digits, 8 x 8; Fashion-MNIST, 28 x 28, when Debian's
``dataset-fashion-mnist`` is installed), batch size B and method, a client holding B training
images runs its local round on a freshly initialized MLP (``hidden`` below) and an
honest-but-curious server inverts the upload (threat model: :mod:`fedlore.audit`):

* ``fedavg-1``: FedAvg with one local SGD step (the FedSGD gradient, up to -η);
* ``fedavg-K``: FedAvg with K local SGD steps on the batch;
* ``fedfull``: K local Adam steps (FedFull's local optimizer), the dense delta;
* ``fedlore``: K steps of projected Adam in a shared rank-r basis per hidden weight (FedLore's
  ΔZ coordinates and dense biases and head; the bases are random orthonormal, known to the
  server as it broadcast them), on the seed's ``left`` side (the basis spans a weight's outputs)
  and, as ``fedlore side=right``, on the inputs' side (``side: right``);
* ``fedlore-sketch``: FedLore's upload plus FedLore-Sketch's sketches ``Y = G Ω`` of the last
  step's gradient (Gaussian Ω, ``n x (r + 5)``, from the seed the server broadcast); the sketch
  is meant to travel under secure aggregation, and is attacked here in the clear;
* ``fedit``: FedIT's LoRA factors (rank r, A Kaiming-uniform and B zero as peft initializes
  them, scaling 1) and dense biases and head after K local Adam steps;
* ``meta-bayfl noise-known``: Meta-BayFL's (and BayFL's) ``(Δmu, Δrho)`` after K Adam steps on
  the ELBO of the MLP's mean-field Gaussian twin (rho = -5, prior N(0, 1)) at the rate the
  client's search chose (the run reports it), the weight samples' noise known to the server (in
  fedlore it is drawn from the client's round generator, which derives from the run seed the
  server holds); ``meta-bayfl noise-guessed``: the same upload, attacked with the server's own
  draws of the noise; ``meta-bayfl flat-prior``: the ablation of the prior's pull (prior
  N(0, 10^12), whose KL gradient on the means is nil), noise known;
* ``fedavg-1`` and ``fedlore`` under central DP at ε = 8 and ε = 1 (δ = 1e-5, one release, N
  clients, all sampled): the clipped upload (C = its own norm, so clipping does not distort it)
  plus the Gaussian mechanism's noise σC per coordinate, σ from fedlore's accountant.

Attacks: inverting gradients (cosine + TV, Adam; the labels known: the strongest attacker), and
for B = 1 also DLG (L2, L-BFGS, labels free) and the closed form for a first fully connected
layer (the first layer's upload; for Adam-trained uploads it returns the input's sign pattern,
not its values). The best reconstruction of each cell (by the attacker's own loss, over
``--restarts`` starts) is scored by PSNR and SSIM against the true batch (pairs by the best
assignment). Writes ``benchmarks/results/leakage.json`` (every row, and a ``summary`` mapping
for the docs), ``leakage.md``, ``leakage.png`` (the B = 4 reconstructions on each data set, one
row per method) and ``leakage-images.pt`` (those images: ``--tables-only`` redraws the figure
and rewrites the table from the files, without attacking again).

    python benchmarks/leakage.py                 # the full table (about an hour on two cores)
    python benchmarks/leakage.py --quick          # digits, B = 1 and 4, fewer steps (CI-sized)
    python benchmarks/leakage.py --only meta-bayfl   # these methods' rows, merged into the files
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fedlore.atomic import save_figure, save_tensors, write_json, write_text
from fedlore.audit.inversion import analytic_first_layer, invert, score
from fedlore.audit.uploads import (
    Upload,
    adam_update,
    bayes_update,
    fedlore_update,
    gradient,
    lora_update,
    sgd_update,
)
from fedlore.models.mlp import mlp
from fedlore.privacy.dp import noise_for_epsilon

OUT = Path(__file__).resolve().parent / "results"
CLIENTS = 10
"""N for the DP rows: one release of the sum of N clients' uploads."""


def load(name: str, count: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None:
    """``count`` training images (in [0, 1]) and labels of a data set, or None if absent."""
    from fedlore.data.sources import load_digits, load_fashion_mnist

    try:
        src = load_digits() if name == "digits" else load_fashion_mnist()
    except FileNotFoundError as e:
        print(f"{name}: skipped ({e})", file=sys.stderr)
        return None
    x, y = src.train.x[:count].float(), src.train.y[:count]
    return x, y, tuple(x.shape[1:])


def uploads(
    model: torch.nn.Module, rank: int, steps: int, seed: int
) -> dict[str, tuple[Upload, bool, Upload | None]]:
    """method -> (the attacker's model of its upload, whether its first layer is SGD-trained:
    closed form, the client's own round where it differs from the attacker's model)."""
    g = torch.Generator().manual_seed(seed)
    left, right, lora, omegas = {}, {}, {}, {}
    for name, p in model.named_parameters():
        if name.startswith("body.") and p.dim() == 2:
            left[name] = torch.linalg.qr(torch.randn(p.shape[0], rank, generator=g))[0]
            right[name] = torch.linalg.qr(torch.randn(p.shape[1], rank, generator=g))[0]
            bound = 1 / math.sqrt(p.shape[1])  # peft: A Kaiming-uniform, B zero
            a = (torch.rand(rank, p.shape[1], generator=g) * 2 - 1) * bound
            lora[name] = (a, torch.zeros(p.shape[0], rank))
            omegas[name] = torch.randn(p.shape[1], rank + 5, generator=g)  # Ω: n x (r + p)
    bnn = bayes_update(model, 1e-3, steps, noise_seed=seed + 7)  # the client's own draws
    return {
        "fedavg-1": (sgd_update(model, 0.1, 1), True, None),
        f"fedavg-{steps}": (sgd_update(model, 0.1, steps), True, None),
        "fedfull": (adam_update(model, 1e-3, steps), False, None),
        "fedlore": (fedlore_update(model, left, 1e-3, steps), False, None),
        "fedlore side=right": (
            fedlore_update(model, right, 1e-3, steps, side="right"),
            False,
            None,
        ),
        "fedlore-sketch": (fedlore_update(model, left, 1e-3, steps, sketch=omegas), False, None),
        "fedit": (lora_update(model, lora, 1e-3, steps), False, None),
        "meta-bayfl noise-known": (bnn, False, None),
        "meta-bayfl noise-guessed": (bayes_update(model, 1e-3, steps, seed + 8), False, bnn),
        "meta-bayfl flat-prior": (
            bayes_update(model, 1e-3, steps, seed + 7, prior_sigma=1e6),
            False,
            None,
        ),
    }


def first_layer(observed: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The closed form on the first layer's upload (weight, then bias: module docstring)."""
    x = analytic_first_layer(observed[0], observed[1])
    return x.reshape(1, *shape).clamp(0, 1)


def noisy(
    observed: list[torch.Tensor], epsilon: float, g: torch.Generator
) -> tuple[list[torch.Tensor], float]:
    """The upload as a DP release reveals it (module docstring) and σ."""
    sigma = noise_for_epsilon(epsilon, 1e-5, 1, CLIENTS, CLIENTS)
    clip = math.sqrt(sum(float(t.pow(2).sum()) for t in observed))
    out = [t + sigma * clip * torch.randn(t.shape, generator=g) for t in observed]
    return out, sigma


def _row(
    data: str, batch: int, method: str, attack: str, scores: dict[str, float], **extra: Any
) -> dict[str, Any]:
    return {"data": data, "batch": batch, "method": method, "attack": attack, **scores, **extra}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    pictures: dict[str, dict[str, torch.Tensor]] = {}
    for data in args.data:
        loaded = load(data, max(args.batch))
        if loaded is None:
            continue
        x_all, y_all, shape = loaded
        for batch in args.batch:
            torch.manual_seed(args.seed)
            model = mlp(shape, 10, hidden=[args.hidden[data]])
            x, y = x_all[:batch], y_all[:batch]
            onehot = torch.nn.functional.one_hot(y, 10).float()
            cells: list[tuple[str, Upload, list[torch.Tensor], bool, dict[str, Any]]] = []
            made = uploads(model, args.rank, args.steps, args.seed)
            for method, (up, sgd_first, client) in made.items():
                if args.only and not method.startswith(tuple(args.only)):
                    continue
                observed = [t.detach() for t in (client or up)(x, onehot)]
                cells.append((method, up, observed, sgd_first, {}))
                if method in ("fedavg-1", "fedlore"):
                    for eps in args.epsilons:
                        g = torch.Generator().manual_seed(args.seed + 1)
                        released, sigma = noisy(observed, eps, g)
                        cells.append((f"{method} ε={eps:g}", up, released, False, {"sigma": sigma}))
            for method, up, observed, sgd_first, extra in cells:
                gen = torch.Generator().manual_seed(args.seed)
                start = time.process_time()
                found = invert(
                    up, observed, shape, 10, batch, kind="ig", labels=y, steps=args.attack_steps,
                    lr=0.1, tv=args.tv, restarts=args.restarts, generator=gen,
                )  # fmt: skip
                cpu = time.process_time() - start
                rows.append(_row(data, batch, method, "ig", score(found.x, x), cpu_s=cpu, **extra))
                print(json.dumps(rows[-1]), flush=True)
                if batch == 4:
                    pictures.setdefault(data, {"truth": x})[method] = found.x
                if batch == 1 and sgd_first:
                    closed = score(first_layer(observed, shape), x)
                    rows.append(_row(data, 1, method, "closed form", closed))
                if batch == 1 and method == "fedavg-1":  # on g = -Δ/η, the labels free
                    dlg = invert(
                        gradient(model), [-t / 0.1 for t in observed], shape, 10, 1, kind="dlg",
                        steps=args.attack_steps, lr=1.0, restarts=args.restarts, generator=gen,
                    )  # fmt: skip
                    label_found = bool((dlg.labels == y).all())
                    rows.append(_row(data, 1, method, "dlg", score(dlg.x, x), label=label_found))
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    return {"settings": settings, "rows": rows, "pictures": pictures}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| data | B | method | attack | PSNR (dB) mean | best | SSIM mean | best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['data']} | {r['batch']} | {r['method']} | {r['attack']} | "
            f"{r['psnr']:.1f} | {r['psnr_best']:.1f} | {r['ssim']:.3f} | {r['ssim_best']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def slug(text: str) -> str:
    """A JSON key part without dots or spaces (``fedlore ε=8`` -> ``fedlore_eps8``)."""
    out = text.replace("ε=", "eps").replace("side=", "").replace(" ", "_").replace(".", "p")
    return out.replace("closed_form", "closed")


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``<data>_b<B>_<method>_<attack>_<psnr|ssim>`` -> value, for the docs' ``{result}``."""
    out: dict[str, float] = {}
    for r in rows:
        key = f"{r['data']}_b{r['batch']}_{slug(r['method'])}_{slug(r['attack'])}"
        out[f"{key}_psnr"] = r["psnr"]
        out[f"{key}_ssim"] = r["ssim"]
    return out


def figure(pictures: dict[str, dict[str, torch.Tensor]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(data, name, imgs) for data, d in pictures.items() for name, imgs in d.items()]
    if not rows:
        return
    cols = max(imgs.shape[0] for _, _, imgs in rows)
    fig, axes = plt.subplots(
        len(rows), cols, figsize=(1.3 * cols + 1.5, 1.3 * len(rows) + 0.4), layout="constrained"
    )
    for i, (data, name, imgs) in enumerate(rows):
        for j in range(cols):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j < imgs.shape[0]:
                ax.imshow(imgs[j, 0].numpy(), cmap="gray", vmin=0, vmax=1)
        axes[i][0].set_ylabel(f"{data}\n{name}", rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle("B = 4: the true batch and each upload's reconstruction\n(inverting gradients)")
    save_figure(fig, path, bbox_inches="tight", dpi=110)
    plt.close(fig)


def merged(
    stem: Path,
    result: dict[str, Any],
    pictures: dict[str, dict[str, torch.Tensor]],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``--only``: the rows and figure images of ``stem``'s files with this run's methods
    replaced, in the full run's order (data, B, method, attack); the settings must match.

    Raises:
        SystemExit: when the files are missing or were written with other settings.
    """
    path = stem.with_suffix(".json")
    if not path.exists():
        raise SystemExit(f"--only merges into {path}, which does not exist: run without --only")
    old = json.loads(path.read_text())
    same = ("data", "batch", "steps", "rank", "attack_steps", "restarts", "tv", "epsilons", "seed")
    differ = [k for k in same if old["settings"].get(k) != result["settings"].get(k)]
    if differ:
        raise SystemExit(f"--only: {path} was written with other settings ({', '.join(differ)})")
    ran = {r["method"] for r in result["rows"]}
    rows = [r for r in old["rows"] if r["method"] not in ran] + result["rows"]
    order = list(uploads(torch.nn.Linear(1, 1), 1, args.steps, 0))
    data_order = list(args.data)

    attacks = ["ig", "closed form", "dlg"]  # the order run() writes them in

    def key(r: dict[str, Any]) -> tuple[int, int, int, int, int]:
        base, _, eps = r["method"].partition(" ε=")
        at = order.index(base) if base in order else len(order)
        variant = 1 + [f"{e:g}" for e in args.epsilons].index(eps) if eps else 0
        return (data_order.index(r["data"]), r["batch"], at, variant, attacks.index(r["attack"]))

    rows.sort(key=key)
    images = stem.with_name(stem.name + "-images.pt")
    kept = torch.load(images, weights_only=True) if images.exists() else {}
    for data, imgs in pictures.items():
        kept.setdefault(data, {}).update(imgs)
    return {**old, "rows": rows}, kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="digits, B = 1 and 4, 100 steps")
    ap.add_argument("--data", nargs="+", default=["digits", "fashion_mnist"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=5, help="K, local steps")
    ap.add_argument("--rank", type=int, default=8, help="FedLore's r")
    ap.add_argument("--attack-steps", type=int, default=300)
    ap.add_argument("--restarts", type=int, default=1)
    ap.add_argument("--tv", type=float, default=1e-2)
    ap.add_argument("--epsilons", nargs="+", type=float, default=[8.0, 1.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run the methods whose names start so and merge their rows into the written files",
    )
    ap.add_argument(
        "--tables-only", action="store_true", help="rewrite the table and summary from the JSON"
    )
    args = ap.parse_args(argv)
    if args.tables_only:
        name = "leakage-quick" if args.quick else "leakage"
        result = json.loads((args.out / f"{name}.json").read_text())
        kept = args.out / f"{name}-images.pt"
        if kept.exists():
            figure(torch.load(kept, weights_only=True), args.out / f"{name}.png")
        result["summary"] = summary(result["rows"])
        write_json(args.out / f"{name}.json", result)
        write_text(args.out / f"{name}.md", table(result["rows"]))
        print(table(result["rows"]))
        return 0
    if args.quick:
        args.data, args.batch, args.attack_steps = ["digits"], [1, 4], 100
    args.hidden = {"digits": 64, "fashion_mnist": 128}
    torch.set_num_threads(1)
    result = run(args)
    pictures = result.pop("pictures")
    name = "leakage-quick" if args.quick else "leakage"
    if args.only:  # merged into what the files hold: the other methods' rows stay
        result, pictures = merged(args.out / name, result, pictures, args)
    result["summary"] = summary(result["rows"])
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / f"{name}.json", result)
    write_text(args.out / f"{name}.md", table(result["rows"]))
    # the figure's images, for --tables-only (copies: a slice of the data set would save it all)
    kept = {d: {m: t.clone() for m, t in imgs.items()} for d, imgs in pictures.items()}
    save_tensors(kept, args.out / f"{name}-images.pt")
    figure(pictures, args.out / f"{name}.png")
    print(table(result["rows"]))
    print(f"written: {args.out}/{name}.json, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
