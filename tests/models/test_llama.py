"""The LLaMA causal language model, the token-level loss and perplexity."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedlore.data.client_data import TensorSplit
from fedlore.data.corpus import IGNORE_INDEX, pack_documents
from fedlore.models import build_model
from fedlore.models.llama import LLAMA_SIZES
from fedlore.train.local import evaluate, task_loss


def _model(seq_len: int = 12, vocab: int = 50, **kw: object) -> nn.Module:
    torch.manual_seed(0)
    return build_model("llama", (seq_len,), vocab, **{"size": "micro", **kw})


def test_shapes_names_and_causality() -> None:
    model = _model()
    names = dict(model.named_parameters())
    assert names["head.weight"].shape == (50, 64)
    assert names["backbone.embed_tokens.weight"].shape == (50, 64)
    assert "backbone.layers.1.mlp.down_proj.weight" in names
    assert not any(n.endswith(".bias") for n in names)  # LLaMA has no biases
    x = torch.randint(0, 50, (3, 12))
    out = model(x)
    assert out.shape == (3, 12, 50)
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % 50
    out2 = model(y)
    assert torch.allclose(out[:, :7], out2[:, :7], atol=1e-5)  # the past never sees the future
    assert not torch.allclose(out[:, 7:], out2[:, 7:])


def test_same_seed_same_weights() -> None:
    a, b = _model(), _model()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_seed_table5_sizes() -> None:
    assert LLAMA_SIZES["60m"].hidden == 512 and LLAMA_SIZES["60m"].layers == 8
    assert (LLAMA_SIZES["1b"].hidden, LLAMA_SIZES["1b"].intermediate) == (2048, 5461)
    torch.manual_seed(0)
    model = build_model("llama", (256,), 32000, size="60m")  # GaLore's vocabulary
    n = sum(p.numel() for p in model.parameters())
    assert 57e6 < n < 59e6  # GaLore's "60M" has 58.1 M parameters


def test_bad_configurations_are_named() -> None:
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        _model(size="huge")
    with pytest.raises(ValueError, match="not divisible by heads=3"):
        _model(heads=3)
    with pytest.raises(ValueError, match="exceed max_position_embeddings=8"):
        _model(max_position_embeddings=8)
    with pytest.raises(ValueError, match="positive integers"):
        _model(layers=0)
    with pytest.raises(ValueError, match="head size hidden/heads = 24/8 = 3 is odd"):
        _model(hidden=24, heads=8)


class _Uniform(nn.Module):
    """Predicts every token with the same probability."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*x.shape, self.vocab) + self.dummy


def test_uniform_predictions_have_perplexity_equal_to_the_vocabulary() -> None:
    split = pack_documents([[3, 4, 5, 6, 7]] * 9, eos_id=1, pad_id=0, max_length=8)
    res = evaluate(_Uniform(37), split, batch_size=4)
    assert res["perplexity"] == pytest.approx(37.0, rel=1e-6)  # fp32 log-softmax
    assert res["loss"] == pytest.approx(math.log(37.0), rel=1e-6)
    assert res["num_tokens"] == int((split.y != IGNORE_INDEX).sum())


@torch.no_grad()
def test_padding_never_counts_in_the_loss_or_the_perplexity() -> None:
    model = _model(seq_len=8)
    split = pack_documents([[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]], 1, 0, 8)
    assert int((split.y == IGNORE_INDEX).sum()) > split.x.shape[0]  # some padding is there
    loss = task_loss(model(split.x), split.y)
    res = evaluate(model, split)
    repadded = torch.where(split.x == 0, torch.full_like(split.x, 42), split.x)
    other_pad = TensorSplit(repadded, split.y)
    # the pad id only sits after the last real token, which no real position attends to
    other_loss = float(task_loss(model(other_pad.x), other_pad.y))
    assert other_loss == pytest.approx(float(loss), abs=1e-6)
    assert evaluate(model, other_pad)["perplexity"] == pytest.approx(res["perplexity"], rel=1e-6)
    # the mean over counted targets equals a hand-computed one
    logits = model(split.x).flatten(0, 1)
    keep = split.y.flatten() != IGNORE_INDEX
    nll = torch.nn.functional.cross_entropy(logits[keep], split.y.flatten()[keep])
    assert float(loss) == pytest.approx(float(nll), abs=1e-6)
    assert res["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-5)


def test_all_padding_batch_has_a_non_finite_loss() -> None:
    logits = torch.zeros(2, 4, 10)
    targets = torch.full((2, 4), IGNORE_INDEX)
    assert not math.isfinite(float(task_loss(logits, targets)))  # the step is skipped


def test_evaluate_splits_large_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedlore.train.local as local

    model = _model(seq_len=8)
    split = pack_documents([list(range(2, 40))] * 3, 1, 0, 8)
    whole = evaluate(model, split, batch_size=64)
    monkeypatch.setattr(local, "EVAL_LOGITS_ELEMENTS", 8 * 50)  # one sequence per forward pass
    assert evaluate(model, split, batch_size=64)["perplexity"] == pytest.approx(
        whole["perplexity"], rel=1e-6
    )
