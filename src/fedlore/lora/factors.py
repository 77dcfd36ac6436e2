"""Pure tensor math on LoRA factors (no peft): products, fp32 merges, initialisations, sizes.

Legend (reference notes section 0): one adapted weight ``W`` is ``m x n`` (``nn.Linear``:
``m = out_features``, ``n = in_features``); ``B`` is ``m x r`` (PEFT ``lora_B``, zero at init),
``A`` is ``r x n`` (PEFT ``lora_A``); the scaling is ``s = lora_alpha / r`` and the adapter adds
``ΔW = s B A``. Map factors by shape, never by letter (the NeurIPS RoLoRA text swaps them).

Precision: products and merges run in fp32 whatever the model dtype (a bf16 base is cast up,
updated, and cast back once); SVDs run in float64 on the tensors' device, and the server and
every client of a run compute on the same kind of device with the same function, so they get
bit-identical results from identical inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from fedlore.optim.svd import svd_triplets

Factor = Literal["A", "B"]
"""``"A"`` (``r x n``) or ``"B"`` (``m x r``)."""

FACTORS: tuple[Factor, Factor] = ("A", "B")


def scaling(alpha: float, rank: int) -> float:
    """PEFT's scaling ``s = alpha / r`` (no rsLoRA)."""
    return float(alpha) / int(rank)


def product(b: torch.Tensor, a: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * B A`` in fp32.

    Args:
        b: ``m x r``.
        a: ``r x n``.
        scale: s (or any weight folded into the product).

    Returns:
        ``m x n`` float32.
    """
    return (b.to(torch.float32) @ a.to(torch.float32)) * float(scale)


def merge(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``W + ΔW`` computed in fp32 (in fp64 for an fp64 base) and cast back to ``W``'s dtype once
    (a new tensor).

    Args:
        weight: ``m x n`` base weight in the model's dtype (fp32, bf16, fp16, fp64).
        delta: ``m x n`` update (any float dtype).
    """
    if weight.shape != delta.shape:
        raise ValueError(f"merge: weight {tuple(weight.shape)} vs delta {tuple(delta.shape)}")
    dtype = torch.promote_types(weight.dtype, torch.float32)  # fp32, or fp64 for fp64
    out = weight.to(dtype) + delta.to(dtype)
    return out.to(weight.dtype).contiguous()


def kaiming_a(
    rank: int, n: int, generator: torch.Generator, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """PEFT's default ``lora_A`` init, ``kaiming_uniform_(a=sqrt(5))``, which is
    ``U(-1/sqrt(n), 1/sqrt(n))``, drawn from the CPU ``generator`` and moved to ``device``
    (``r x n``, fp32; the same draw on every device)."""
    bound = 1.0 / math.sqrt(n)
    a = torch.empty(rank, n, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
    return a.to(device)


def zeros_b(m: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """PEFT's ``lora_B`` init: zeros (``m x r``, fp32, on ``device``)."""
    return torch.zeros(m, rank, dtype=torch.float32, device=device)


def truncated_svd(mat: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``rank`` singular triplets of ``mat`` (``m x n``), exact, in float64.

    Returns:
        ``(U_r m x r, S_r r, Vh_r r x n)``, float64, singular values descending.
    """
    if not 1 <= rank <= min(mat.shape):
        raise ValueError(f"truncated_svd: rank {rank} not in [1, {min(mat.shape)}]")
    u, s, vh = svd_triplets(mat.to(torch.float64))
    return u[:, :rank].contiguous(), s[:rank].contiguous(), vh[:rank].contiguous()


def principal_factors(
    weight: torch.Tensor, rank: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PiSSA-style factors of a weight (FRLoRA's ``ours_init``): ``B0 = U_r diag(sqrt(S_r/s))``,
    ``A0 = diag(sqrt(S_r/s)) Vh_r``, so that ``s B0 A0`` is the rank-r truncation of ``W``.

    Returns:
        ``(B0 m x r, A0 r x n)`` float32.
    """
    u, s, vh = truncated_svd(weight, rank)
    root = torch.sqrt(s / float(scale))
    return (u * root).to(torch.float32), (root[:, None] * vh).to(torch.float32)


def factor_numel(m: int, n: int, rank: int, factors: Sequence[Factor] = FACTORS) -> int:
    """Scalars of the named factors of one ``m x n`` matrix at rank r (``A``: rn, ``B``: mr)."""
    return sum(rank * n if f == "A" else m * rank for f in factors)
