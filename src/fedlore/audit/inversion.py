"""Reconstructing a client's training images from its upload: gradient inversion attacks and how
close they come (:mod:`fedlore.audit`).

* :func:`invert` with ``kind="dlg"``: Deep Leakage from Gradients (Zhu, Liu & Han, NeurIPS 2019,
  Algorithm 1): dummy inputs and dummy soft labels (softmax of free logits) optimized with
  L-BFGS to minimize the squared distance ``Σ ||u(x̂, ŷ) - u||²`` between the upload they would
  produce and the observed one; with known ``labels`` (iDLG, Zhao, Mopuri & Bilen 2020, which
  reads a single example's label off the output bias: :func:`infer_label`) only the inputs are
  free.
* :func:`invert` with ``kind="ig"``: Inverting Gradients (Geiping, Bauermeister, Dröge &
  Moeller, NeurIPS 2020, Eq. 4): Adam on the inputs, the labels known, minimizing
  ``1 - cos(u(x̂), u) + α TV(x̂)`` (cosine over all uploaded tensors joined; total variation
  as the image prior), with the learning rate divided by 10 at 3/8, 5/8 and 7/8 of the steps as
  their code does. Our choice: inputs are kept in the data's box [0, 1] by the parametrization
  ``x̂ = sigmoid(z)`` rather than by clipping after each step.
* :func:`analytic_first_layer`: the closed form for a fully connected first layer and one
  example (Phong et al., IEEE TIFS 2018, Sec. 3): ``∇W₁ = δ xᵀ`` and ``∇b₁ = δ``, so
  ``x = ∇W₁ᵀ δ / ||δ||²``; with FedLore's coordinates ``∇Z₁ = Pᵀ δ xᵀ`` and the dense bias,
  ``x = ∇Z₁ᵀ (Pᵀ δ) / ||Pᵀ δ||²`` — the projection of the output side does not hide the input.

The attacker keeps the best of ``restarts`` random starts by its own criterion (the matching
loss), never by the ground truth. :func:`score` compares a reconstruction with the true batch:
each reconstructed image is paired with a true one by the assignment that maximizes the summed
PSNR (an attacker does not know the batch order), then PSNR and SSIM per pair
(``torchmetrics``; SSIM with a 3 x 3 Gaussian window of σ 0.5 on images under 16 pixels wide,
torchmetrics' 11 x 11 window of σ 1.5 otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from scipy.optimize import linear_sum_assignment
from torchmetrics.functional.image import (
    peak_signal_noise_ratio,
    structural_similarity_index_measure,
)

from fedlore.audit.uploads import Upload


@dataclass(frozen=True)
class Reconstruction:
    """An attack's answer.

    Attributes:
        x: the reconstructed inputs, ``[B, *shape]`` in [0, 1].
        labels: the labels it used or found, ``[B]``.
        loss: its final matching loss (the attacker's own criterion).
    """

    x: torch.Tensor
    labels: torch.Tensor
    loss: float


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbouring pixels of images ``[B, C, H, W]``."""
    dh = (x[..., 1:, :] - x[..., :-1, :]).abs().mean()
    dw = (x[..., :, 1:] - x[..., :, :-1]).abs().mean()
    return dh + dw


def infer_label(output_bias_grad: torch.Tensor) -> int:
    """iDLG: the label of a single example from the gradient of the output layer's bias,
    ``p - onehot(y)``: its only negative entry."""
    return int(torch.argmin(output_bias_grad).item())


def analytic_first_layer(
    w_grad: torch.Tensor,
    b_grad: torch.Tensor,
    basis: torch.Tensor | None = None,
    side: str = "left",
) -> torch.Tensor:
    """One example's input from a fully connected first layer's upload (module docstring):
    ``w_grad`` is ``∇W₁`` (``m x n``) or, with ``basis`` ``P``, FedLore's coordinates; ``b_grad``
    is ``∇b₁`` (``m``, dense). On the ``left`` side (``P`` is ``m x r``, ``∇Z₁ = Pᵀ δ xᵀ``) the
    input comes back whole; on the ``right`` side (``P`` is ``n x r``, ``∇Z₁ = Pᵀ x δᵀ``) only
    its projection ``P Pᵀ x`` on the basis. Any positive multiple of the gradient (an SGD step
    ``-η g``) gives the same input; Adam's elementwise scaling does not."""
    if basis is None:
        return w_grad.T @ b_grad / (b_grad @ b_grad).clamp_min(1e-30)
    if side == "right":
        return basis @ (w_grad @ b_grad) / (b_grad @ b_grad).clamp_min(1e-30)
    delta = basis.T @ b_grad
    return w_grad.T @ delta / (delta @ delta).clamp_min(1e-30)


def _l2(u: Sequence[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return ((_flat(u) - target) ** 2).sum()


def _cosine(u: Sequence[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    flat = _flat(u)
    return 1 - (flat @ target) / (flat.norm() * target.norm()).clamp_min(1e-30)


def invert(
    upload: Upload,
    observed: Sequence[torch.Tensor],
    shape: tuple[int, ...],
    num_classes: int,
    batch: int,
    *,
    kind: Literal["dlg", "ig"] = "ig",
    labels: torch.Tensor | None = None,
    steps: int = 300,
    lr: float = 0.1,
    tv: float = 1e-2,
    restarts: int = 1,
    generator: torch.Generator | None = None,
) -> Reconstruction:
    """Reconstruct ``batch`` inputs of ``shape`` from the ``observed`` upload (module docstring).

    Args:
        upload: the attacker's model of the client's round (:mod:`fedlore.audit.uploads`).
        observed: the tensors the server received, in ``upload``'s order.
        shape: one input's shape, e.g. ``(1, 8, 8)``.
        num_classes: classes of the task.
        batch: examples in the client's batch.
        kind: ``dlg`` (L2 matching, L-BFGS, labels free unless given) or ``ig`` (cosine + TV,
            Adam; needs ``labels``).
        labels: the batch's labels if the attacker knows or inferred them.
        steps: optimizer iterations per start.
        lr: the optimizer's step size (L-BFGS: its ``lr``).
        tv: α, the weight of the total-variation prior (``ig``).
        restarts: random starts; the one with the lowest matching loss is returned.
        generator: the source of the starts (CPU).

    Raises:
        ValueError: ``ig`` without ``labels``, or labels of the wrong length.
    """
    if kind == "ig" and labels is None:
        raise ValueError("inverting gradients needs the labels (known, or infer_label)")
    if labels is not None and labels.shape != (batch,):
        raise ValueError(f"labels: expected shape ({batch},), got {tuple(labels.shape)}")
    device = observed[0].device
    target = _flat([t.detach() for t in observed])
    best: Reconstruction | None = None
    for _ in range(restarts):
        z = torch.randn((batch, *shape), generator=generator).to(device)
        y_logits = torch.randn((batch, num_classes), generator=generator).to(device)
        found = _one_start(upload, target, z, y_logits, labels, kind, steps, lr, tv)
        if best is None or found.loss < best.loss:
            best = found
    assert best is not None
    return best


def _one_start(
    upload: Upload,
    target: torch.Tensor,
    z: torch.Tensor,
    y_logits: torch.Tensor,
    labels: torch.Tensor | None,
    kind: str,
    steps: int,
    lr: float,
    tv: float,
) -> Reconstruction:
    """One start of :func:`invert` from the free variables ``z`` (inputs ``sigmoid(z)``) and
    ``y_logits`` (soft labels, when ``labels`` is None)."""
    num_classes = y_logits.shape[1]
    z.requires_grad_(True)
    y_logits.requires_grad_(labels is None)
    params = [z, y_logits] if labels is None else [z]

    def soft_labels() -> torch.Tensor:
        if labels is None:
            return torch.softmax(y_logits, dim=1)
        return torch.nn.functional.one_hot(labels, num_classes).to(z.dtype)

    def objective() -> torch.Tensor:
        x = torch.sigmoid(z)
        u = upload(x, soft_labels())
        if kind == "dlg":
            return _l2(u, target)
        return _cosine(u, target) + tv * total_variation(x)

    if kind == "dlg":
        lbfgs = torch.optim.LBFGS(params, lr=lr, max_iter=steps)

        def closure() -> torch.Tensor:
            lbfgs.zero_grad()
            loss = objective()
            loss.backward()
            return loss

        lbfgs.step(closure)
    else:
        adam = torch.optim.Adam(params, lr=lr)
        milestones = [int(steps * f) for f in (3 / 8, 5 / 8, 7 / 8)]
        sched = torch.optim.lr_scheduler.MultiStepLR(adam, milestones, gamma=0.1)
        for _ in range(steps):
            adam.zero_grad()
            objective().backward()
            adam.step()
            sched.step()
    final = float(objective().detach())  # the upload model needs autograd even here
    found = labels if labels is not None else soft_labels().detach().argmax(dim=1)
    if final != final or final in (float("inf"), float("-inf")):  # NaN or infinite
        final = float("inf")
    return Reconstruction(torch.sigmoid(z).detach(), found.detach(), final)


def _ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    small = a.shape[-1] < 16
    value = structural_similarity_index_measure(
        a,
        b,
        data_range=1.0,
        kernel_size=3 if small else 11,
        sigma=0.5 if small else 1.5,
    )
    return float(value)  # type: ignore[arg-type]


def score(reconstructed: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """PSNR (dB) and SSIM of ``reconstructed`` against ``truth`` (both ``[B, C, H, W]`` in
    [0, 1]), pairing images by the assignment of highest summed PSNR: the mean and the best
    pair of each."""
    batch = truth.shape[0]
    psnr = torch.empty(batch, batch)
    for i in range(batch):
        for j in range(batch):
            psnr[i, j] = peak_signal_noise_ratio(
                reconstructed[i : i + 1], truth[j : j + 1], data_range=1.0
            )
    rows, cols = linear_sum_assignment(psnr.numpy(), maximize=True)
    pairs = list(zip(rows.tolist(), cols.tolist(), strict=True))
    p = [float(psnr[i, j]) for i, j in pairs]
    s = [_ssim(reconstructed[i : i + 1], truth[j : j + 1]) for i, j in pairs]
    return {
        "psnr": sum(p) / batch,
        "psnr_best": max(p),
        "ssim": sum(s) / batch,
        "ssim_best": max(s),
    }
