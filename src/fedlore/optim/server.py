"""Server optimizers: the step the global model takes from the round's aggregated client delta.

The server treats the aggregated delta ``Δ_t = Σ p_i Δ_i / Σ p_i`` (the clients' model change,
the negative of a pseudo-gradient) as the input of an optimizer, Reddi et al., "Adaptive
Federated Optimization", ICLR 2021, Algorithm 2 (FedAdagrad, FedAdam, FedYogi), and Hsu, Qi &
Brown 2019, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification" (FedAvgM, server momentum). With ``m_{-1} = 0`` and ``v_{-1} = v0``:

* ``sgd``: ``x ← x + η Δ_t`` (``η = 1``: FedAvg itself, returned unchanged, bit for bit);
* ``momentum`` (FedAvgM): ``m ← β1 m + Δ_t``, ``x ← x + η m``;
* ``adagrad``: ``m ← β1 m + (1-β1) Δ_t``, ``v ← v + Δ_t²``;
* ``adam``: the same ``m``, ``v ← β2 v + (1-β2) Δ_t²``;
* ``yogi``: the same ``m``, ``v ← v - (1-β2) Δ_t² sign(v - Δ_t²)``;

and for the three adaptive ones ``x ← x + η_t m / (√v + τ)``, where ``η_t = η`` (Reddi et al.)
or, with ``bias_correction``, ``η √(1-β2^t) / (1-β1^t)`` for the t-th server step (Kingma & Ba
2015; Flower's FedAdam corrects with t + 1, one step later, see the tests). Reddi et al. start
from ``v_{-1} ≥ τ²`` (``v0=None``: τ²); Flower's strategies start from 0 (``v0=0``).

The moments live in the server's :class:`~fedlore.types.State` (arrays ``sopt.m.<name>``,
``sopt.v.<name>``, value ``sopt.t``), so they are checkpointed and a resumed run continues them
exactly. Tensors that are not floating point (BatchNorm's step counters) take the plain delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

ServerOptimizer = Literal["sgd", "momentum", "adagrad", "adam", "yogi"]
ADAPTIVE = ("adagrad", "adam", "yogi")
PREFIX_M = "sopt.m."
PREFIX_V = "sopt.v."
STEPS = "sopt.t"


@dataclass(frozen=True)
class ServerOpt:
    """One server optimizer's settings (the ``server.*`` keys; module docstring).

    Attributes:
        kind: ``sgd``, ``momentum``, ``adagrad``, ``adam`` or ``yogi``.
        lr: η, the server learning rate.
        betas: (β1, β2); β1 is FedAvgM's momentum too.
        tau: τ, the adaptivity (added to √v).
        v0: the initial second moment (None: τ², Reddi et al.).
        bias_correction: scale η by √(1-β2^t) / (1-β1^t) (adam only).
    """

    kind: ServerOptimizer = "sgd"
    lr: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)
    tau: float = 1e-3
    v0: float | None = None
    bias_correction: bool = False

    @property
    def is_identity(self) -> bool:
        """Plain FedAvg: the server adds the aggregated delta as it is."""
        return self.kind == "sgd" and self.lr == 1.0

    def step(
        self,
        delta: dict[str, torch.Tensor],
        moments: dict[str, torch.Tensor],
        t: int,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The model's step for the ``t``-th server update (1-based) and the new moments.

        Args:
            delta: ``Δ_t`` by plain tensor name.
            moments: the previous moments (``sopt.m.<name>`` / ``sopt.v.<name>``; empty before
                the first step).
            t: how many server steps this one makes (1 for the first).

        Returns:
            ``(step, moments)``: the tensors to add to the global model, and the moments to keep.

        Raises:
            ValueError: for an unknown ``kind`` or ``t`` < 1.
        """
        if t < 1:
            raise ValueError(f"server step t must be >= 1, got {t}")
        if self.is_identity:
            return dict(delta), {}
        b1, b2 = self.betas
        out: dict[str, torch.Tensor] = {}
        kept: dict[str, torch.Tensor] = {}
        eta = self.lr
        if self.kind == "adam" and self.bias_correction:
            eta = self.lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        for name, d in delta.items():
            if not d.is_floating_point():
                out[name] = d
                continue
            m = moments.get(PREFIX_M + name)
            if self.kind == "sgd":
                out[name] = self.lr * d
                continue
            if self.kind == "momentum":
                m = d.clone() if m is None else b1 * m + d
                kept[PREFIX_M + name] = m
                out[name] = self.lr * m
                continue
            if self.kind not in ADAPTIVE:
                raise ValueError(f"unknown server optimizer {self.kind!r}")
            m = (1.0 - b1) * d if m is None else b1 * m + (1.0 - b1) * d
            v = moments.get(PREFIX_V + name)
            if v is None:
                v0 = self.tau**2 if self.v0 is None else self.v0
                v = torch.full_like(d, v0)
            sq = d * d
            if self.kind == "adagrad":
                v = v + sq
            elif self.kind == "adam":
                v = b2 * v + (1.0 - b2) * sq
            else:  # yogi
                v = v - (1.0 - b2) * sq * torch.sign(v - sq)
            kept[PREFIX_M + name] = m
            kept[PREFIX_V + name] = v
            out[name] = eta * m / (v.sqrt() + self.tau)
        return out, kept


def rotate_first_moments(
    moments: dict[str, torch.Tensor],
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """FedLore's server moments after a basis refresh P^t -> P^{t+1}: each first moment
    ``m`` (``r x n``, the coordinates of ``P^t m``) becomes ``P^{t+1}ᵀ P^t m``, the coordinates
    of the closest matrix in the new subspace (exact when the subspace is kept); the second
    moments ``v`` (elementwise squares, which no change of basis maps exactly) are kept, as
    GaLore keeps its Adam moments when its projector changes (Zhao et al. 2024).

    Args:
        moments: ``sopt.m.<name>`` / ``sopt.v.<name>`` tensors (others pass through).
        old: ``P^t`` by matrix name (``m x r``).
        new: ``P^{t+1}`` by matrix name.

    Returns:
        The moments in the new coordinates.
    """
    out = dict(moments)
    for name, p_new in new.items():
        m = out.get(PREFIX_M + name)
        if m is None or name not in old:
            continue
        rot = p_new.to(m.dtype).T @ old[name].to(m.dtype)  # r x r
        out[PREFIX_M + name] = (rot @ m).contiguous()
    return out
