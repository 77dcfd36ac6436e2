"""The in-place, batched projected step against the textbook update written out plainly.

Reference (module docstring of :mod:`fedlore.optim.projected_adam`; seed Algorithm 1 lines 14–18
with the decoupled decay of Proposition 8): ``R = Pᵀ G``, Adam moments on R, bias-corrected
``N = m_hat / (sqrt(v_hat) + eps)``, ``D = -lr·scale·N``, ``W <- a W + P D``, ``Z <- a Z + D``;
dense parameters by textbook AdamW; a skipped step applies only the decay.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedlore.optim.projected_adam import ProjectedAdam, ProjectedSGD
from fedlore.optim.subspace import MatrixSpec, Side, random_basis

LRS = [3e-2, 2e-2, 1e-2, 5e-3, 2.5e-2, 1e-3]
SKIP = 3  # the step that is skipped (a non-finite loss in the loop)
B1, B2, EPS, WD, SCALE = 0.9, 0.95, 1e-8, 0.1, 0.5


def problem(dtype: torch.dtype):
    """Projected: a left Linear weight, a right-side one, a conv kernel (left, ``out x in·kh·kw``)
    and a non-contiguous matrix; dense: a bias."""
    g = torch.Generator().manual_seed(0)
    shapes = {"left": (7, 11), "right": (6, 9), "conv": (5, 3, 2, 2), "strided": (8, 6)}
    params, specs = {}, {}
    for name, shape in shapes.items():
        w = torch.randn(shape, dtype=dtype, generator=g)
        if name == "strided":  # stored transposed: not contiguous, the copy path
            w = torch.randn(shape[::-1], dtype=dtype, generator=g).t()
        params[name] = nn.Parameter(w)
        out_d, in_d = shape[0], math.prod(shape[1:])
        side: Side = "right" if name == "right" else "left"
        m, n = (out_d, in_d) if side == "left" else (in_d, out_d)
        specs[name] = MatrixSpec(name, shape, side, m, n, 3)
    assert not params["strided"].is_contiguous()
    bases = {k: random_basis(7 + i, s.m, s.rank, dtype) for i, (k, s) in enumerate(specs.items())}
    bias = nn.Parameter(torch.randn(7, dtype=dtype, generator=g))
    return params, specs, bases, bias


def grads(step: int, params: dict, bias: nn.Parameter) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = {
        k: torch.randn(p.shape, dtype=p.dtype, generator=g) * (1 + step) for k, p in params.items()
    }
    out["bias"] = torch.randn(bias.shape, dtype=bias.dtype, generator=g)
    return out


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_in_place_step_equals_textbook_step(kind: str, dtype: torch.dtype, atol: float) -> None:
    params, specs, bases, bias = problem(dtype)
    w0 = {k: p.detach().clone() for k, p in params.items()}
    cls = ProjectedAdam if kind == "adam" else ProjectedSGD
    opt = cls(
        [bias],
        [(params[k], specs[k], bases[k]) for k in params],
        betas=(B1, B2),
        eps=EPS,
        weight_decay=WD,
        scale=SCALE,
    )
    # the reference, plain tensors and the textbook formulas
    ref = {k: p.detach().clone() for k, p in params.items()}
    ref_b = bias.detach().clone()
    # M, V (0 until the first step)
    mom = {k: [torch.zeros((), dtype=dtype)] * 2 for k in [*params, "bias"]}
    z = {k: torch.zeros(s.rank, s.n, dtype=dtype) for k, s in specs.items()}
    k_step, a_total = 0, 1.0
    for step, lr in enumerate(LRS):
        opt.set_lr(lr)
        a = 1 - lr * WD
        a_total *= a
        if step == SKIP:
            opt.zero_grad(set_to_none=True)
            opt.skip_step()
            ref = {k: a * w for k, w in ref.items()}
            ref_b = a * ref_b
            z = {k: a * v for k, v in z.items()}
        else:
            gr = grads(step, params, bias)
            for k, p in params.items():
                p.grad = gr[k].clone()
            bias.grad = gr["bias"].clone()
            opt.step()
            k_step += 1
            for k, s in [*specs.items(), ("bias", None)]:
                g_k = gr[k] if s is None else bases[k].t() @ s.view(gr[k])
                if kind == "sgd":
                    n_k = g_k
                else:
                    mom[k][0] = B1 * mom[k][0] + (1 - B1) * g_k
                    mom[k][1] = B2 * mom[k][1] + (1 - B2) * g_k * g_k
                    m_hat = mom[k][0] / (1 - B1**k_step)
                    v_hat = mom[k][1] / (1 - B2**k_step)
                    n_k = m_hat / (torch.sqrt(v_hat) + EPS)
                if s is None:
                    ref_b = a * ref_b - lr * n_k
                    continue
                d = -lr * SCALE * n_k
                ref[k] = a * ref[k] + s.unview(bases[k] @ d)
                z[k] = a * z[k] + d
        for k, p in params.items():
            torch.testing.assert_close(p.detach(), ref[k], rtol=0, atol=atol, msg=f"{k} {step}")
            torch.testing.assert_close(opt.coords[p], z[k], rtol=0, atol=atol)
        torch.testing.assert_close(bias.detach(), ref_b, rtol=0, atol=atol)
    for k, p in params.items():  # Proposition 8: W_K = (Π a_k) W_0 + P Z
        s = specs[k]
        recon = s.unview(a_total * s.view(w0[k]) + bases[k] @ opt.coords[p])
        torch.testing.assert_close(p.detach(), recon, rtol=0, atol=atol)
        assert float((p.detach() - a_total * w0[k]).abs().max()) > 1e-3  # it moved
        assert p.dtype == dtype and opt.coords[p].dtype == dtype
    moments = sum(2 * s.rank * s.n for s in specs.values()) + 2 * bias.numel()
    assert opt.state_bytes() == (moments * bias.element_size() if kind == "adam" else 0)
    assert opt.basis_bytes() == sum(s.m * s.rank for s in specs.values()) * bias.element_size()
    if kind == "adam":  # one moment update per taken step, none for the skipped one
        assert all(int(opt.state[p]["step"]) == len(LRS) - 1 for p in [*params.values(), bias])
