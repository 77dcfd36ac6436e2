"""The cheap finiteness checks (issue 19): :func:`fedlore.tensors.all_finite` answers as the
element-wise ``isfinite`` does, and local training still skips every step whose loss or gradient
is not finite, reading the losses once after the last step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlore.data.client_data import TensorSplit, minibatches
from fedlore.tensors import all_finite, model_arrays
from fedlore.train.local import FiniteCheck, local_train, task_loss

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64]


def exact(ts: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1000])  # below, at and past the vector width
def test_all_finite_finds_every_bad_value_anywhere(dtype: torch.dtype, n: int) -> None:
    clean = torch.linspace(-3, 3, n).to(dtype)
    assert all_finite([clean]) and all_finite([clean, torch.empty(0, dtype=dtype)])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in {0, n // 2, n - 1}:
            t = clean.clone()
            t[at] = bad
            assert not all_finite([clean, t]), (bad, at)
            assert all_finite([clean, t]) == exact([clean, t])


@pytest.mark.parametrize("dtype", DTYPES[:4])
def test_all_finite_is_exact_when_finite_values_sum_past_the_range(dtype: torch.dtype) -> None:
    big = torch.full((64,), torch.finfo(dtype).max, dtype=dtype)
    assert not bool(torch.isfinite(big.sum()))  # the fast path's sum overflows ...
    assert all_finite([big, -big, big])  # ... and the exact check still says finite
    big[3] = float("nan")
    assert not all_finite([big])


def test_all_finite_ignores_integer_tensors_and_mixes_dtypes() -> None:
    ints = torch.arange(5)
    assert all_finite([]) and all_finite([ints, torch.tensor(True)])
    mixed = [ints, torch.ones(3), torch.ones(2, dtype=torch.float64), torch.tensor(0.5)]
    assert all_finite(mixed)
    mixed[2][1] = float("inf")
    assert not all_finite(mixed)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def split(nan_rows: tuple[int, ...] = ()) -> TensorSplit:
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))
    for r in nan_rows:
        x[r, 0] = float("nan")
    return TensorSplit(x, torch.arange(12) % 2)


def test_mean_loss_is_the_mean_of_the_finite_steps_read_after_the_round() -> None:
    seen: list[float] = []

    def recording(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = task_loss(logits, y)
        seen.append(float(loss.detach()))
        return loss

    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = minibatches(split(nan_rows=(2,)), 3, 8, torch.Generator().manual_seed(4))
    stats = local_train(model, batches, opt, [1e-2] * 8, loss_fn=recording)
    finite = [v for v in seen if v == v]
    assert 0 < stats.skipped_steps == len(seen) - len(finite) < 8
    assert stats.mean_loss == sum(finite) / len(finite)  # the same floats, the same sum


def test_a_non_finite_loss_with_finite_gradients_is_still_skipped() -> None:
    """The loss and the gradients are checked together after the backward: an Inf loss term
    without a gradient leaves finite gradients, and the step must be skipped all the same (no
    hook, no moment, no update, no gradient left behind)."""
    model = Tiny()
    before = model_arrays(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooked: list[int] = []
    batches = minibatches(split(), 4, 3, torch.Generator().manual_seed(0))
    stats = local_train(
        model,
        batches,
        opt,
        [1e-2] * 3,
        loss_terms=[lambda m: torch.tensor(float("inf"))],
        on_grad=[lambda m, k: hooked.append(k)],
    )
    assert stats.skipped_steps == 3 and stats.mean_loss != stats.mean_loss
    assert hooked == [] and len(opt.state) == 0
    assert all(p.grad is None for p in model.parameters())
    after = model_arrays(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("dtype", DTYPES[:4])
def test_fused_step_check_leaves_gradients_bit_for_bit_and_finds_bad_values(
    dtype: torch.dtype,
) -> None:
    params = [torch.zeros(300, dtype=dtype), torch.zeros(3, dtype=dtype)]
    check = FiniteCheck(params)
    assert check.fused
    g = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(dtype)
    g[::7] = -0.0
    g[1::11] = torch.finfo(dtype).tiny / 4  # subnormals
    small = torch.tensor([1.0, -0.0, 3.0]).to(dtype)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
    before = [g.view(bits).clone(), small.view(bits).clone()]
    assert check(torch.tensor(0.5), [g, small])
    assert torch.equal(before[0], g.view(bits)) and torch.equal(before[1], small.view(bits))
    assert not check(torch.tensor(float("inf")), [g, small])  # the loss counts
    g[299] = float("nan")
    assert not check(torch.tensor(0.5), [small, g])
    assert check(torch.tensor(0.5), [small])  # the flag is cleared after a bad step


def test_step_check_without_the_fused_kernel_answers_the_same() -> None:
    complex_params = [torch.zeros(2, dtype=torch.complex64)]
    check = FiniteCheck(complex_params)
    assert not check.fused
    assert check(torch.tensor(1.0), [torch.ones(2, dtype=torch.complex64)])
    assert not check(torch.tensor(1.0), [torch.tensor([1.0, complex(0, float("inf"))])])
