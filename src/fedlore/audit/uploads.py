"""What a client's upload is, as a differentiable function of its training batch: the attacker's
model of each method's local round (:mod:`fedlore.audit`).

Each function here takes the broadcast model (and, for FedLore, the broadcast bases), the local
settings the server itself sent, and a batch ``(x, y)`` with soft labels ``y`` (rows summing to
1), and returns the tensors the server receives, in a fixed order, built with
``create_graph=True`` so that an attacker can differentiate them with respect to ``x`` (and
``y``). Every local step uses the whole batch (the client's data is one batch of ``B``
examples), as in Geiping et al. (2020, Sec. 6) for multi-step FedAvg updates.

* :func:`gradient`: one gradient, FedSGD; a one-step FedAvg update is ``-η`` times it.
* :func:`sgd_update`: FedAvg's upload after K local SGD steps, ``Δ = θ_K - θ_0``.
* :func:`adam_update`: FedFull's upload after K local Adam steps (Kingma & Ba, bias-corrected,
  no weight decay), ``Δ = θ_K - θ_0``.
* :func:`fedlore_update`: FedLore's upload (seed 000, Algorithm 1 lines 11-22): for each
  projected ``m x n`` weight ``W`` with broadcast basis ``P`` (``m x r``), K steps of Adam on the
  coordinates ``R_k = Pᵀ G_k`` (fresh moments), the weight moving by ``P`` times the step; the
  upload is the coordinates' total change ``ΔZ`` (``r x n``) and, for every unprojected tensor
  (biases, the head), its dense change. The candidate subspace ``P_i`` the client also sends is
  not modelled: the attacker here uses ``ΔZ`` and the dense tensors only (a stronger attacker
  could also match ``P_i``).
  With FedLore-Sketch's test matrices it also returns the sketches ``Y = G Ω`` of the last
  step's gradient (the sketch rule's upload).
* :func:`bayes_update`: BayFL's and Meta-BayFL's upload (seed 001, Algorithm 1; Meta-BayFL at
  the rate its search chose, which the run reports per client as ``lr_chosen``): a mean-field
  Gaussian twin of the model (means = the broadcast weights, ``rho`` = the broadcast scales), K
  steps of Adam on the per-example negative ELBO with one weight sample ``w = mu + softplus(rho)
  ε`` per step; the upload is every mean's and every scale's change ``(Δmu, Δrho)``. The noise
  ``ε`` comes from ``noise_seed``: the client's own draws, or the attacker's guess of them.
* :func:`lora_update`: FedIT's upload: K local Adam steps on the LoRA factors ``A``, ``B`` of
  each adapted weight (``W + s B A``, ``W`` frozen) and on the unadapted parameters; the upload
  is the factors' and the dense tensors' changes. With ``B = 0`` at the start (peft's
  initialization), the first step moves only ``B``, by a gradient ``s δ (A x)ᵀ`` that holds
  the input's projection ``A x`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.func import functional_call

Upload = Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]
"""``(x, soft labels) -> the uploaded tensors``, differentiable in both."""


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def soft_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` against soft labels ``y`` (one-hot: the usual loss)."""
    return -(y * torch.log_softmax(logits, dim=1)).sum(dim=1).mean()


def _grads(
    model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    loss = soft_cross_entropy(functional_call(model, dict(params), (x,)), y)
    names = list(params)
    got = torch.autograd.grad(loss, [params[k] for k in names], create_graph=True)
    return dict(zip(names, got, strict=True))


def gradient(model: nn.Module) -> Upload:
    """FedSGD: the gradient of the batch loss at the broadcast model, one tensor per
    parameter."""
    start = _params(model)

    def upload(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        params = {k: v.requires_grad_(True) for k, v in start.items()}
        return list(_grads(model, params, x, y).values())

    return upload


def sgd_update(model: nn.Module, lr: float, steps: int) -> Upload:
    """FedAvg: ``θ_K - θ_0`` after ``steps`` full-batch SGD steps at ``lr``."""
    start = _params(model)

    def upload(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        params = {k: v.clone().requires_grad_(True) for k, v in start.items()}
        for _ in range(steps):
            g = _grads(model, params, x, y)
            params = {k: params[k] - lr * g[k] for k in params}
        return [params[k] - start[k] for k in start]

    return upload


def _adam_step(
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    t: int,
    betas: tuple[float, float],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(direction, m, v) of Adam's step ``t`` (1-based): ``m̂ / (√v̂ + ε)``."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat = m / (1 - b1**t)
    v_hat = v / (1 - b2**t)
    # √ of v̂ + tiny keeps the derivative finite where a gradient entry is exactly 0
    return m_hat / (torch.sqrt(v_hat + 1e-30) + eps), m, v


def _adam_all(
    loss: torch.Tensor,
    free: dict[str, torch.Tensor],
    m: dict[str, torch.Tensor],
    v2: dict[str, torch.Tensor],
    t: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> dict[str, torch.Tensor]:
    """Adam's step ``t`` on every tensor of ``free`` from ``loss`` (differentiable: the
    gradients keep their graph); updates the moments ``m``, ``v2`` in place, returns the new
    tensors."""
    names = list(free)
    grads = torch.autograd.grad(loss, [free[k] for k in names], create_graph=True)
    new = {}
    for k, g in zip(names, grads, strict=True):
        d, m[k], v2[k] = _adam_step(g, m[k], v2[k], t, betas, eps)
        new[k] = free[k] - lr * d
    return new


def adam_update(
    model: nn.Module,
    lr: float,
    steps: int,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> Upload:
    """FedFull: ``θ_K - θ_0`` after ``steps`` full-batch Adam steps at ``lr`` (fresh moments)."""
    start = _params(model)

    def upload(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        params = {k: v.clone().requires_grad_(True) for k, v in start.items()}
        m = {k: torch.zeros_like(v) for k, v in start.items()}
        v2 = {k: torch.zeros_like(v) for k, v in start.items()}
        for t in range(1, steps + 1):
            g = _grads(model, params, x, y)
            new = {}
            for k in params:
                d, m[k], v2[k] = _adam_step(g[k], m[k], v2[k], t, betas, eps)
                new[k] = params[k] - lr * d
            params = new
        return [params[k] - start[k] for k in start]

    return upload


def fedlore_update(
    model: nn.Module,
    bases: Mapping[str, torch.Tensor],
    lr: float,
    steps: int,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    side: str = "left",
    sketch: Mapping[str, torch.Tensor] | None = None,
) -> Upload:
    """FedLore: for each weight named in ``bases`` the coordinates' change ``ΔZ = -Σ_k η d_k``
    (``r x n``, ``d_k`` Adam's direction on ``Pᵀ G_k``, ``G_k`` the weight's ``m x n`` view),
    for the other parameters their dense change after Adam steps, in parameter order.

    ``side`` is FedLore's ``side`` rule for these weights (``MatrixSpec.side`` of
    :mod:`fedlore.optim.subspace`): ``left`` (the seed's default) views a Linear weight as
    ``out x in``, so the basis ``P`` is ``out x r`` and the coordinates keep the input
    dimension; ``right`` views it as ``in x out`` (``P`` is ``in x r``).

    With ``sketch`` (FedLore-Sketch: weight name -> its ``n x q`` test matrix Ω, which the
    server derives from the seed it broadcast) the upload ends with each sketched weight's
    ``Y = G Ω`` (``m x q``) of the last local step's gradient view ``G``, as the sketch rule's
    client sends it (:func:`fedlore.algorithms.lowrank.sketch_gradients`)."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    start = _params(model)
    for name, p in bases.items():
        rows = start[name].shape[0 if side == "left" else 1] if name in start else -1
        if name not in start or start[name].dim() != 2 or p.shape[0] != rows:
            raise ValueError(f"basis {name}: {tuple(p.shape)} does not fit the model's weight")

    def view(t: torch.Tensor) -> torch.Tensor:
        return t if side == "left" else t.T

    def upload(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        params = {k: v.clone().requires_grad_(True) for k, v in start.items()}
        coords = {k: p.new_zeros(p.shape[1], view(start[k]).shape[1]) for k, p in bases.items()}
        m: dict[str, torch.Tensor] = {}
        v2: dict[str, torch.Tensor] = {}
        g: dict[str, torch.Tensor] = {}
        for t in range(1, steps + 1):
            g = _grads(model, params, x, y)
            new = {}
            for k in params:
                grad = bases[k].T @ view(g[k]) if k in bases else g[k]
                d, m[k], v2[k] = _adam_step(
                    grad, m.get(k, torch.zeros_like(grad)), v2.get(k, torch.zeros_like(grad)),
                    t, betas, eps,
                )  # fmt: skip
                if k in bases:
                    coords[k] = coords[k] - lr * d
                    new[k] = params[k] - lr * view(bases[k] @ d)
                else:
                    new[k] = params[k] - lr * d
            params = new
        out = [coords[k] if k in bases else params[k] - start[k] for k in start]
        return out + [view(g[k]) @ omega for k, omega in (sketch or {}).items()]

    return upload


def bayes_update(
    model: nn.Module,
    lr: float,
    steps: int,
    noise_seed: int,
    rho_init: float = -5.0,
    prior_sigma: float = 1.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> Upload:
    """BayFL / Meta-BayFL: ``steps`` full-batch Adam steps on ``mean NLL + KL(q || p) / B`` of
    the mean-field Gaussian twin of ``model`` (every parameter ``w ~ N(mu, softplus(rho)²)``,
    ``mu`` the model's values, ``rho = rho_init``; prior ``N(0, prior_sigma²)``, ``B`` the
    batch: the client's data is one batch), one weight sample per step with standard normal
    noise drawn from ``noise_seed``. Returns ``[Δmu for every parameter] + [Δrho for every
    parameter]``, in parameter order."""
    start = _params(model)

    def upload(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(noise_seed)
        noise = [{k: torch.randn(v.shape, generator=g) for k, v in start.items()}]
        noise += [{k: torch.randn(v.shape, generator=g) for k, v in start.items()}
                  for _ in range(steps - 1)]  # fmt: skip
        free = {f"{k}.mu": v.clone().requires_grad_(True) for k, v in start.items()}
        free.update(
            {
                f"{k}.rho": torch.full_like(v, rho_init).requires_grad_(True)
                for k, v in start.items()
            }
        )
        first = {k: v.detach() for k, v in free.items()}
        m = {k: torch.zeros_like(v) for k, v in free.items()}
        v2 = {k: torch.zeros_like(v) for k, v in free.items()}
        for t in range(1, steps + 1):
            sigma = {k: nn.functional.softplus(free[f"{k}.rho"]) for k in start}
            weights = {k: free[f"{k}.mu"] + sigma[k] * noise[t - 1][k] for k in start}
            kl = sum(
                (torch.log(prior_sigma / sigma[k])
                 + (sigma[k] ** 2 + free[f"{k}.mu"] ** 2) / (2 * prior_sigma**2) - 0.5).sum()
                for k in start
            )  # fmt: skip
            loss = soft_cross_entropy(functional_call(model, weights, (x,)), y) + kl / x.shape[0]
            free = _adam_all(loss, free, m, v2, t, lr, betas, eps)
        return [free[f"{k}.{part}"] - first[f"{k}.{part}"] for part in ("mu", "rho") for k in start]

    return upload


def lora_update(
    model: nn.Module,
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    steps: int,
    scaling: float = 1.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> Upload:
    """FedIT (and any LoRA method that uploads its factors): each weight named in ``factors``
    is frozen and adapted as ``W + s B A`` (``A`` is ``r x n``, ``B`` is ``m x r``, the
    broadcast factors, ``s`` = ``scaling``); ``A``, ``B`` and every unadapted parameter take
    ``steps`` full-batch Adam steps at ``lr`` (fresh moments). The upload, in parameter order:
    for an adapted weight its factors' changes ``ΔA``, ``ΔB`` (the server knows the factors it
    sent, so the changes are what the factors reveal), for the others their dense change."""
    start = _params(model)
    for name, (a, b) in factors.items():
        w = start.get(name)
        if w is None or w.dim() != 2 or a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0]:
            raise ValueError(f"factors {name}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit")

    def upload(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        free = {k: v.clone().requires_grad_(True) for k, v in start.items() if k not in factors}
        for k, (a, b) in factors.items():
            free[f"{k}.lora_A"] = a.detach().clone().requires_grad_(True)
            free[f"{k}.lora_B"] = b.detach().clone().requires_grad_(True)
        m = {k: torch.zeros_like(v) for k, v in free.items()}
        v2 = {k: torch.zeros_like(v) for k, v in free.items()}
        first = {k: v.detach() for k, v in free.items()}
        for t in range(1, steps + 1):
            weights = {
                k: start[k] + scaling * free[f"{k}.lora_B"] @ free[f"{k}.lora_A"]
                if k in factors
                else free[k]
                for k in start
            }
            loss = soft_cross_entropy(functional_call(model, weights, (x,)), y)
            free = _adam_all(loss, free, m, v2, t, lr, betas, eps)
        out: list[torch.Tensor] = []
        for k in start:
            if k in factors:
                out += [free[f"{k}.lora_A"] - first[f"{k}.lora_A"]]
                out += [free[f"{k}.lora_B"] - first[f"{k}.lora_B"]]
            else:
                out.append(free[k] - first[k])
        return out

    return upload
