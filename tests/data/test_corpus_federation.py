"""The federation of a pre-training corpus and the per-client minibatch streams."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedlore.config import load_config
from fedlore.data.c4 import load_c4
from fedlore.data.client_data import ClientData, TensorSplit, minibatches, stream_batches
from fedlore.data.corpus import IGNORE_INDEX
from fedlore.data.federation import Federation, build_federation

C4 = str(Path(__file__).parents[1] / "fixtures" / "c4")
BASE = [
    "data.name=c4",
    f"data.root={C4}",
    "data.max_length=16",
    "data.vocab_size=300",
    "partition.name=source_dirichlet",
    "num_clients=5",
]


def _fed(seed: int = 0, *extra: str) -> Federation:
    return build_federation(load_config(None, [*BASE, *extra]), seed)


def _decode_docs(fed: Federation, i: int, tok: Any) -> list[str]:
    x = fed.client(i).train.x.flatten().tolist()
    text = tok.decode([t for t in x if t != tok.pad_token_id])
    return [d for d in text.split(tok.eos_token) if d]


def test_clients_hold_disjoint_documents_covering_the_corpus() -> None:
    fed = _fed(0)
    corpus = load_c4(C4, max_length=16, vocab_size=300)
    assert fed.task == "language_modeling"
    assert fed.num_classes == corpus.vocab_size and fed.input_shape == (16,)
    docs = [_decode_docs(fed, i, corpus.tokenizer) for i in range(fed.num_clients)]
    # packing is per client: every client's sequences decode to whole documents of its own
    flat = [d for client in docs for d in client]
    assert sorted(flat) == sorted(corpus.train_texts)
    assert all(len(d) > 0 for d in docs)
    hist = fed.histogram()
    assert hist.shape == (5, len(corpus.group_names))
    assert [int(h.sum()) for h in hist] == [len(d) for d in docs]
    assert np.array_equal(hist.sum(axis=0), np.bincount(corpus.train_groups))
    assert "source groups" in fed.format_histogram()


def test_validation_corpus_is_common_and_separate() -> None:
    a, b = _fed(0), _fed(1)
    assert torch.equal(a.central_test.x, b.central_test.x)  # identical for every seed/method
    assert all(len(t) == 0 for t in a.test_indices)  # no client holds validation documents
    corpus = load_c4(C4, max_length=16, vocab_size=300)
    assert torch.equal(a.central_test.x, corpus.pack(corpus.validation_texts).x)


def test_same_seed_same_allocation_other_seed_differs() -> None:
    a, b, c = _fed(0), _fed(0), _fed(3)
    assert all(torch.equal(a.client(i).train.x, b.client(i).train.x) for i in range(5))
    assert not np.array_equal(a.histogram(), c.histogram())
    assert a.stream_seeds is not None and a.stream_seeds == b.stream_seeds


def test_targets_never_cross_clients_or_padding() -> None:
    fed = _fed(0)
    for i in range(fed.num_clients):
        split = fed.client(i).train
        assert torch.equal(
            split.y[:, :-1][split.y[:, :-1] != IGNORE_INDEX],
            split.x[:, 1:][split.y[:, :-1] != IGNORE_INDEX],
        )
        assert bool((split.y[:, -1] == IGNORE_INDEX).all())


def test_corpus_refuses_what_it_does_not_have() -> None:
    with pytest.raises(ValueError, match=r"data\.noise has no effect"):
        _fed(0, "data.noise=0.1")
    with pytest.raises(ValueError, match=r"data\.label_flip has no effect"):
        _fed(0, "data.label_flip=0.1")
    with pytest.raises(ValueError, match=r"data\.test_fraction has no effect"):
        _fed(0, "data.test_fraction=0.3")
    with pytest.raises(ValueError, match="exceeds the 36 documents"):
        _fed(0, "num_clients=40")
    with pytest.raises(ValueError, match="has no effect on source 'digits'"):
        build_federation(load_config(None, ["data.name=digits", "data.vocab_size=300"]), 0)


def test_fraction_keeps_a_uniform_share_of_documents() -> None:
    fed = _fed(0, "data.fraction=0.5")
    assert int(fed.histogram().sum()) == 18  # half of 36, whatever the number of hosts
    assert _fed(0, "data.fraction=0.01").histogram().sum() == 5  # at least one per client


def test_a_corpus_with_nothing_to_predict_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c4-train.json").write_text('{"text": "a b c d e f", "url": "http://a.org"}\n' * 5)
    (tmp_path / "c4-validation.json").write_text('{"text": "", "url": "http://a.org"}\n')
    cfg = load_config(None, [*BASE, f"data.root={tmp_path}", "num_clients=2"])
    with pytest.raises(ValueError, match=r"the validation corpus .* holds no next-token target"):
        build_federation(cfg, 0)


def test_fingerprint_tells_federations_apart() -> None:
    assert _fed(0).fingerprint() == _fed(0).fingerprint()
    assert _fed(0).fingerprint() != _fed(1).fingerprint()
    assert _fed(0).fingerprint() != _fed(0, "data.sampling=round").fingerprint()


def test_round_sampling_can_be_chosen_and_stream_is_the_default() -> None:
    assert _fed(0).client(0).stream_seed is not None
    assert _fed(0, "data.sampling=round").client(0).stream_seed is None
    digits = build_federation(load_config(None, ["data.name=digits"]), 0)
    assert digits.client(0).stream_seed is None
    streamed = build_federation(load_config(None, ["data.name=digits", "data.sampling=stream"]), 0)
    assert streamed.client(0).stream_seed is not None


def _split(n: int) -> TensorSplit:
    return TensorSplit(torch.arange(n).unsqueeze(1), torch.arange(n))


def test_stream_reads_every_example_before_repeating() -> None:
    batches = list(stream_batches(_split(10), 4, 5, seed=7))
    items = torch.cat([y for _, y in batches]).tolist()
    assert len(items) == 20 and all(len(y) == 4 for _, y in batches)
    assert sorted(items[:10]) == list(range(10)) and sorted(items[10:20]) == list(range(10))
    assert items[:10] != items[10:20]  # reshuffled when restarted


def test_stream_windows_continue_across_rounds() -> None:
    split = _split(13)
    client = ClientData(0, split, split, stream_seed=5)
    gen = torch.Generator()
    rounds = [torch.cat([y for _, y in client.batches(4, 3, gen, rnd)]) for rnd in range(4)]
    whole = torch.cat([y for _, y in stream_batches(split, 4, 12, seed=5)])
    assert torch.equal(torch.cat(rounds), whole)
    assert torch.equal(rounds[2], torch.cat([y for _, y in stream_batches(split, 4, 3, 5, 6)]))
    # a small client: every batch has all its examples, once each
    tiny = list(stream_batches(_split(3), 16, 4, seed=1))
    assert all(sorted(y.tolist()) == [0, 1, 2] for _, y in tiny)


def test_round_sampling_is_the_old_per_round_draw() -> None:
    split = _split(9)
    client = ClientData(0, split, split)
    a = [y for _, y in client.batches(4, 3, torch.Generator().manual_seed(3), 5)]
    b = [y for _, y in minibatches(split, 4, 3, torch.Generator().manual_seed(3))]
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_stream_errors() -> None:
    with pytest.raises(ValueError, match="empty split"):
        next(stream_batches(_split(0), 4, 1, seed=0))
    with pytest.raises(ValueError, match="start must be >= 0"):
        next(stream_batches(_split(3), 4, 1, seed=0, start=-1))
