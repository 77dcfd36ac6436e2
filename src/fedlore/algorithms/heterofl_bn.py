"""HeteroFL's static batch norm (sBN; Diao, Ding, Tarokh, ICLR 2021, Section 3) and the width
slices of a ResNet's parameter-free shortcuts (:mod:`fedlore.algorithms.heterofl`).

**Training.** Every BatchNorm of a client's (sub-)model tracks no running statistics: it
normalizes with the statistics of the batch, in training as in any other pass
(:func:`static_bn`); its affine weight and bias are sliced, trained and averaged like every
other width-sliced parameter. The running statistics are never sent, trained or uploaded.

**The query.** After the round's aggregation, whenever the global model is evaluated (and after the
last round), the server sends each client of the round the (sub-)models whose statistics it needs
and the client can run (its own width or narrower: the full-width model to the clients of rate 1
only, :mod:`fedlore.algorithms.heterofl_levels`), and the client passes its training data through
each, without gradient and in minibatches of the run's ``batch_size`` (in order; a last minibatch of
one example joins the one before), every BatchNorm normalizing with the minibatch's own statistics
as in training and dropout off; per BatchNorm it uploads the number of values per channel ``N_k`` (a
float64 scalar), their per-channel sum ``S_k`` and sum of squares ``Q_k`` (float64) of the layer's
input (:func:`query_stats`). The server pools them per sub-model over the clients that ran it
(:func:`pooled`): ``N = Σ N_k``, mean ``S / N`` and variance ``(Q - N mean²) / (N - 1)``, exactly
the mean and unbiased variance (torch's convention for ``running_var``) of the union of the values
those clients saw, and sets them as that model's running statistics, which evaluation uses. The
query's bytes are counted in the round's ``bytes_up`` / ``bytes_down`` and recorded alone as
``query_bytes_up`` / ``query_bytes_down``.

**Shortcuts.** A CIFAR ResNet's option-A shortcut (:mod:`fedlore.models.resnet`) has no
parameters: at a stage change it feeds global input channel i to output channel ``offset + i``.
A sub-model keeps exactly that wiring restricted to its channels (:func:`route_shortcuts`), so
its output channel of global index u gets input channel ``u - offset`` when it holds it, else
zero: the sub-model is the global model with the other channels removed.
"""

from __future__ import annotations

import torch
from torch import nn

from fedlore.algorithms.heterofl_plan import WidthPlan
from fedlore.models.resnet import BasicBlock
from fedlore.types import Reply

QUERY = "query"
"""Broadcast config flag: the message is the sBN statistics query, not a training round."""
STATS = "stats."
"""Prefix of the query reply's arrays: ``stats.<norm>.count|sum|sumsq``."""
PARTS = ("count", "sum", "sumsq")


def static_bn(model: nn.Module) -> None:
    """Every BatchNorm of ``model`` tracks no running statistics (buffers dropped): it
    normalizes with the batch's statistics in every pass."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
            m.num_batches_tracked = None


def route_shortcuts(model: nn.Module, plan: WidthPlan, units: list[torch.Tensor]) -> None:
    """Set each stage-change block's ``route`` in a sub-model of ``plan``'s model holding the
    global ``units`` of every group: input position q feeds output position p when
    ``units[out][p] == units[in][q] + offset``."""
    for name, g_in, g_out, offset in plan.routes:
        block = model.get_submodule(name)
        assert isinstance(block, BasicBlock)
        match = units[g_out][None, :] == (units[g_in] + offset)[:, None]
        src, dst = match.nonzero(as_tuple=True)
        block.route = (src, dst)


def _batches(n: int, batch_size: int) -> list[int]:
    sizes = [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])
    if len(sizes) > 1 and sizes[-1] == 1:
        sizes[-2:] = [sizes[-2] + 1]
    return sizes


@torch.no_grad()
def query_stats(
    model: nn.Module, norms: tuple[str, ...], x: torch.Tensor, batch_size: int
) -> dict[str, torch.Tensor]:
    """Client side of the query: ``stats.<norm>.count|sum|sumsq`` of the inputs of the
    BatchNorms ``norms`` of ``model`` (static, :func:`static_bn`) over ``x`` in minibatches of
    ``batch_size``, per channel (dimension 1) in float64; ``count`` is the values per channel."""
    wide = torch.float64
    acc: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name in norms:

        def hook(_m: nn.Module, inputs: tuple[torch.Tensor, ...], name: str = name) -> None:
            z = inputs[0].to(wide)
            dims = [0, *range(2, z.dim())]
            part = [
                torch.tensor(z.numel() / z.shape[1], dtype=wide, device=z.device),
                z.sum(dims),
                z.square().sum(dims),
            ]
            acc[name] = (
                part if name not in acc else [a + b for a, b in zip(acc[name], part, strict=True)]
            )

        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    was = model.training
    model.eval()  # dropout off; a static BatchNorm still normalizes with the batch
    try:
        device = next(model.parameters()).device
        for chunk in x.split(_batches(len(x), batch_size)):
            model(chunk.to(device))
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return {
        f"{STATS}{n}.{p}": t for n, parts in acc.items() for p, t in zip(PARTS, parts, strict=True)
    }


def pooled(
    count: torch.Tensor, total: torch.Tensor, squares: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of the union from its count, per-channel sum and sum of
    squares (float64; the variance 0 when fewer than 2 values, never negative)."""
    n = count.to(torch.float64)
    mean = total.to(torch.float64) / n
    var = (squares.to(torch.float64) - n * mean.square()) / (n - 1).clamp_min(1)
    return mean, var.clamp_min(0)


def stats_problem(reply: Reply, plan: WidthPlan, widths: dict[str, int]) -> str | None:
    """Why a query reply is unusable (missing or extra arrays, wrong shapes or dtypes,
    non-finite values or a count below 1), or None."""
    want = {f"{STATS}{n}.{p}" for n in plan.norms for p in PARTS}
    if set(reply.arrays) != want:
        return f"arrays {sorted(set(reply.arrays) ^ want)[:3]} missing or unexpected"
    for n in plan.norms:
        for p in PARTS:
            t = reply.arrays[f"{STATS}{n}.{p}"]
            shape = () if p == "count" else (widths[n],)
            if tuple(t.shape) != shape or t.dtype != torch.float64:
                return f"{STATS}{n}.{p} is {tuple(t.shape)} {t.dtype}, not {shape} float64"
            if not bool(torch.isfinite(t).all()):
                return f"{STATS}{n}.{p} is not finite"
        if float(reply.arrays[f"{STATS}{n}.count"]) < 1:
            return f"{STATS}{n}.count is below 1"
    return None
