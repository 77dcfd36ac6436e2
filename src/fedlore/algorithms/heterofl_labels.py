"""HeteroFL's label-split masking (Diao, Ding, Tarokh, ICLR 2021: the "masked cross-entropy" of
its non-IID experiments), ``method.heterofl.mask_labels`` (:mod:`fedlore.algorithms.heterofl`).

**The client.** Its *label set* is the classes that occur in its training data
(:func:`label_set`). While it trains, the logits of every other class are set to ``-inf`` at the
output layer's output (:func:`mask_logits`, a forward hook active in training mode only), so the
cross-entropy is the one of a classifier over its own classes alone,
``-log(exp(z_y) / Σ_{c ∈ L_k} exp(z_c))``: an absent class gets no probability and no
gradient (its output row moves by the optimizer's weight decay only). Evaluation is unmasked.
The client uploads its label set with its update, as the boolean indicator ``labels`` of one
entry per class (:data:`LABELS`): which classes it holds, not how many examples of each.

**The server.** Each row c of the output layer (``head.weight[c]`` and ``head.bias[c]``) is
averaged only over the round's accepted clients whose label set holds c (their weights
renormalised over them, :func:`kept_rows`); a row no client of the round holds keeps its
value, as every entry no client holds.

The authors' code sets the absent logits to 0 instead of ``-inf`` (they stay in the softmax's
normaliser with weight ``exp(0)``, ``-log(exp(z_y) / (Σ_{c ∈ L_k} exp(z_c) + C - |L_k|))`` over
C classes, and still get no gradient); by default here they leave it (``mask_fill: exclude``),
as the name "masked out of the loss" says, so the loss is exactly the cross-entropy over the
client's classes; ``mask_fill: zero`` is the authors' variant.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fedlore.data.client_data import ClientData

LABELS = "labels"
"""Reply array (with ``mask_labels``): the client's label set, ``bool[num_classes]``."""
HEAD = "head"
"""The output layer of every model HeteroFL has a width plan for (its rows are the classes)."""


def label_set(data: ClientData, num_classes: int) -> torch.Tensor:
    """``bool[num_classes]``: True at each class that occurs in the client's training labels.

    Raises:
        ValueError: on real-valued targets (no classes to mask).
    """
    y = data.train.y
    if y.is_floating_point():
        raise ValueError("heterofl: mask_labels needs class labels, the data has real targets")
    present = torch.zeros(num_classes, dtype=torch.bool)
    present[y.reshape(-1).long().unique()] = True
    return present


FILL = {"exclude": float("-inf"), "zero": 0.0}
"""``mask_fill``'s value for the absent classes' logits."""


def mask_logits(model: nn.Module, present: torch.Tensor, fill: str = "exclude") -> RemovableHandle:
    """Set the output layer's logits of the classes outside ``present`` to ``FILL[fill]``
    (``-inf``, or 0 as the authors' code) while the model trains; returns the hook's handle
    (remove it when the local training ends)."""
    value = FILL[fill]

    def hook(module: nn.Module, _inputs: object, out: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return out
        return out.masked_fill(~present.to(out.device), value)

    return model.get_submodule(HEAD).register_forward_hook(hook)


def kept_rows(
    name: str, flat: torch.Tensor, delta: torch.Tensor, present: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat positions ``flat`` and values ``delta`` (both flattened, in the sub-tensor's
    order) of one client's upload of tensor ``name`` that enter the average: all of them, but
    of the output layer only the rows of the classes in ``present`` (None: every row)."""
    if present is None or not name.startswith(HEAD + "."):
        return flat, delta.reshape(-1)
    rows = present.to(delta.device).view(-1, *[1] * (delta.dim() - 1)).expand(delta.shape)
    keep = rows.reshape(-1)
    return flat[keep.to(flat.device)], delta.reshape(-1)[keep]
