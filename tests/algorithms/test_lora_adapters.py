"""The ``fedlore.lora`` package: target selection, peft injection with a fixed adapter name,
strict adapter loading, fp32 merges, initialisations."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from fedlore.lora import (
    ADAPTER,
    adapter_arrays,
    factor_numel,
    find_targets,
    inject,
    kaiming_a,
    load_adapters,
    merge,
    principal_factors,
    product,
    scaling,
    truncated_svd,
    zeros_b,
)


class Encoder(nn.Module):
    """BERT-like names: query/key/value/dense Linears, a LayerNorm and a ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(6, 6)
        self.key = nn.Linear(6, 6)
        self.value = nn.Linear(6, 6)
        self.dense = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.query(x) + self.key(x) + self.value(x)
        return self.head(self.norm(torch.relu(self.dense(h))))


def build() -> Encoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Encoder()


def test_find_targets_defaults_names_and_errors() -> None:
    model = build()
    assert list(find_targets(model, (), ("head.",))) == ["query", "key", "value", "dense"]
    picked = find_targets(model, ("query", "value"), ("head.",))
    assert list(picked) == ["query", "value"]
    assert (picked["query"].m, picked["query"].n) == (6, 6)
    assert (find_targets(model, (), ("head.",))["dense"].m, 5) == (5, 5)
    with pytest.raises(ValueError, match="norm"):
        find_targets(model, ("norm",), ("head.",))
    with pytest.raises(ValueError, match=r"no nn\.Linear"):
        find_targets(model, ("nothing",), ("head.",))


def test_inject_keeps_names_stable_rng_untouched_and_fp32_adapters() -> None:
    model = build().to(torch.bfloat16)
    targets = find_targets(model, (), ("head.",))
    before = torch.random.get_rng_state()
    inject(model, targets, rank=2, alpha=4.0)
    assert torch.equal(before, torch.random.get_rng_state())
    keys = set(model.state_dict())
    assert f"query.lora_A.{ADAPTER}.weight" in keys and f"dense.lora_B.{ADAPTER}.weight" in keys
    assert "query.base_layer.weight" in keys and "head.weight" in keys
    arrays = adapter_arrays(model)
    assert set(arrays) == {f"{m}.{f}" for m in targets for f in "AB"}
    assert all(v.dtype == torch.float32 for v in arrays.values())
    assert arrays["dense.A"].shape == (2, 6) and arrays["dense.B"].shape == (5, 2)


def test_zero_b_adapter_is_the_plain_model_and_forward_matches_the_fp32_merge() -> None:
    plain = build()
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))
    targets = find_targets(plain, (), ("head.",))
    work = inject(copy.deepcopy(plain), targets, rank=3, alpha=6.0)
    g = torch.Generator().manual_seed(2)
    adapters = {}
    for mod, t in targets.items():
        adapters[f"{mod}.A"] = kaiming_a(3, t.n, g)
        adapters[f"{mod}.B"] = zeros_b(t.m, 3)
    load_adapters(work, adapters)
    torch.testing.assert_close(work(x), plain(x), rtol=0, atol=0)
    for mod, t in targets.items():
        adapters[f"{mod}.B"] = torch.randn(t.m, 3, generator=g)
    load_adapters(work, adapters)
    merged = copy.deepcopy(plain)
    with torch.no_grad():
        for mod in targets:
            lin = getattr(merged, mod)
            delta = product(adapters[f"{mod}.B"], adapters[f"{mod}.A"], scaling(6.0, 3))
            lin.weight.copy_(merge(lin.weight, delta))
    torch.testing.assert_close(work(x), merged(x), rtol=1e-5, atol=1e-6)


def test_load_adapters_is_strict() -> None:
    model = build()
    targets = find_targets(model, ("query", "value"), ("head.",))
    inject(model, targets, rank=2, alpha=2.0)
    good = adapter_arrays(model)
    load_adapters(model, good)  # the own arrays always load
    missing = {k: v for k, v in good.items() if k != "value.B"}
    with pytest.raises(KeyError, match=r"missing=\['value\.B'\]"):
        load_adapters(model, missing)
    with pytest.raises(KeyError, match=r"unexpected=\['key\.A'\]"):
        load_adapters(model, {**good, "key.A": torch.zeros(2, 6)})
    with pytest.raises(ValueError, match=r"query\.A"):
        load_adapters(model, {**good, "query.A": torch.zeros(3, 6)})


def test_merge_runs_in_fp32_for_a_bf16_base() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 8, generator=g).to(torch.bfloat16)
    b, a = torch.randn(8, 2, generator=g) * 1e-3, torch.randn(2, 8, generator=g)
    out = merge(w, product(b, a, 2.0))
    assert out.dtype == torch.bfloat16
    want = (w.float() + 2.0 * (b @ a)).to(torch.bfloat16)
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="weight"):
        merge(w, torch.zeros(8, 7))


def test_initialisations_and_sizes() -> None:
    g = torch.Generator().manual_seed(4)
    a = kaiming_a(4, 25, g)
    assert a.shape == (4, 25) and a.dtype == torch.float32
    assert float(a.abs().max()) <= 1 / math.sqrt(25)
    assert torch.equal(zeros_b(6, 4), torch.zeros(6, 4))
    w = torch.randn(9, 7, generator=g)
    b0, a0 = principal_factors(w, 3, scale=2.0)
    u, s, vh = truncated_svd(w, 3)
    torch.testing.assert_close(product(b0, a0, 2.0).double(), (u * s) @ vh, rtol=1e-5, atol=1e-6)
    assert factor_numel(9, 7, 3) == 3 * 16
    assert factor_numel(9, 7, 3, ("B",)) == 27 and factor_numel(9, 7, 3, ("A",)) == 21
