"""C4-format corpora: source groups, reading, packing, tokenizer, fortunes conversion."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlore.cli import main
from fedlore.data.c4 import find_c4_files, load_c4, read_c4_file
from fedlore.data.corpus import (
    IGNORE_INDEX,
    UNKNOWN_SOURCE,
    group_documents,
    pack_documents,
    source_group,
)
from fedlore.data.corpus_tokenizer import train_bpe_tokenizer
from fedlore.data.fortunes_c4 import fortunes_c4_records, load_fortunes_c4

C4 = Path(__file__).parents[1] / "fixtures" / "c4"
FORTUNES = Path(__file__).parents[1] / "fixtures" / "fortunes"


@pytest.mark.parametrize(
    ("url", "group"),
    [
        ("WWW.Example.com", "example.com"),
        ("https://WWW.Example.COM/path?q=1", "example.com"),
        ("http://example.com", "example.com"),
        ("https://user:pw@Example.com:8080/x", "example.com"),
        ("https://example.com./x", "example.com"),
        ("https://blog.example.com/post", "blog.example.com"),
        ("https://www.blog.example.com/post", "blog.example.com"),
        ("https://www.www.example.com/", "www.example.com"),
        ("https://wwwexample.com/", "wwwexample.com"),
        ("example.com/page", "example.com"),
        ("//cdn.example.org/lib.js", "cdn.example.org"),
        ("http://192.168.0.1:80/admin", "192.168.0.1"),
        ("http://[::1]/", "::1"),
        ("https://Bücher.de/katalog", "xn--bcher-kva.de"),
        ("", UNKNOWN_SOURCE),
        ("   ", UNKNOWN_SOURCE),
        (None, UNKNOWN_SOURCE),
        (42, UNKNOWN_SOURCE),
        ("not a url", UNKNOWN_SOURCE),
        ("http://", UNKNOWN_SOURCE),
        ("https://exa mple.com/", UNKNOWN_SOURCE),
        ("https://-bad-.com/", UNKNOWN_SOURCE),
        ("https://a..b.com/", UNKNOWN_SOURCE),
        ("http://[::1/", UNKNOWN_SOURCE),
        ("https://" + "a" * 64 + ".com/", UNKNOWN_SOURCE),
        ("mailto:someone", UNKNOWN_SOURCE),
        ("mailto:x@example.com", UNKNOWN_SOURCE),
        ("https:/example.com/a", UNKNOWN_SOURCE),
        ("http//example.com", UNKNOWN_SOURCE),
        ("skype:1234", UNKNOWN_SOURCE),
        ("localhost:8080", UNKNOWN_SOURCE),
        ("http://localhost/x", "localhost"),
        ("example.com:8080/x", "example.com"),
        ("https://example.com:port/", UNKNOWN_SOURCE),
    ],
)
def test_source_group_normalizes_hostnames(url: object, group: str) -> None:
    assert source_group(url) == group


def test_group_documents_numbers_sorted_hosts() -> None:
    groups, names = group_documents(["https://b.org", None, "https://www.a.org/x", "a.org"])
    assert names == sorted(["a.org", "b.org", UNKNOWN_SOURCE])
    assert [names[g] for g in groups] == ["b.org", UNKNOWN_SOURCE, "a.org", "a.org"]


def test_read_c4_file_plain_and_gzip() -> None:
    train, validation = find_c4_files(C4)
    assert [p.name for p in train] == [
        "c4-train.00000-of-00002.json",
        "c4-train.00001-of-00002.json.gz",
    ]
    assert [p.name for p in validation] == ["c4-validation.00000-of-00001.json"]
    docs = read_c4_file(train[0]) + read_c4_file(train[1])
    assert len(docs) == 36
    assert docs[0][1] == "https://www.Example.com/a"
    assert any(url is None for _, url in docs)  # a document without a url field


def test_read_c4_file_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "c4-train.json"
    path.write_text('{"text": "ok", "url": "http://a.org"}\n{"url": "http://b.org"}\n')
    with pytest.raises(ValueError, match=r"c4-train\.json:2: no field 'text'"):
        read_c4_file(path)
    path.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r":2: not valid JSON.*one JSON object per line"):
        read_c4_file(path)
    path.write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r":1: field 'text' must be a string, got int"):
        read_c4_file(path)
    path.write_bytes('{"text": "ok"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"c4-train\.json:2: not UTF-8"):
        read_c4_file(path)
    gz = tmp_path / "c4-train.json.gz"
    gz.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="cannot read"):
        read_c4_file(gz)


def test_find_c4_files_says_where_it_looked_and_how_to_get_data(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no data\.root given.*fortunes-c4"):
        find_c4_files(None)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope'} does not exist"):
        find_c4_files(tmp_path / "nope")
    (tmp_path / "c4-train.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(FileNotFoundError, match="1 training and 0 validation files"):
        find_c4_files(tmp_path)


def test_pack_documents_eos_targets_and_padding() -> None:
    split = pack_documents([[5, 6, 7], [8], [9, 10]], eos_id=1, pad_id=0, max_length=4)
    # stream: 5 6 7 1 | 8 1 9 10 | 1 pad pad pad
    assert split.x.tolist() == [[5, 6, 7, 1], [8, 1, 9, 10], [1, 0, 0, 0]]
    assert split.y.tolist() == [
        [6, 7, 1, IGNORE_INDEX],
        [1, 9, 10, IGNORE_INDEX],
        [IGNORE_INDEX] * 4,
    ]
    empty = pack_documents([], eos_id=1, pad_id=0, max_length=4)
    assert empty.x.shape == (0, 4) and empty.y.shape == (0, 4)
    with pytest.raises(ValueError, match="max_length"):
        pack_documents([[1]], 1, 0, 1)


def test_padding_targets_are_never_real_tokens() -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, 50, size=rng.integers(1, 30)).tolist() for _ in range(17)]
    split = pack_documents(docs, eos_id=1, pad_id=0, max_length=16)
    total = sum(len(d) + 1 for d in docs)
    counted = int((split.y != IGNORE_INDEX).sum())
    full, rest = divmod(total, 16)
    assert counted == full * 15 + max(rest - 1, 0)  # L - 1 targets per block
    assert not bool((split.y == 0).any())  # the pad id is never a target


def test_bpe_tokenizer_is_deterministic_with_special_ids() -> None:
    texts = [d for d, _ in read_c4_file(next(iter(find_c4_files(C4)[0])))]
    a, b = train_bpe_tokenizer(texts, 300), train_bpe_tokenizer(texts, 300)
    assert a.get_vocab() == b.get_vocab()
    assert (a.pad_token_id, a.eos_token_id) == (0, 1)
    assert len(a) <= 300
    ids = a("café ☕", add_special_tokens=False)["input_ids"]
    assert a.decode(ids) == "café ☕"  # byte level: nothing is unknown
    with pytest.raises(ValueError, match="258"):
        train_bpe_tokenizer(texts, 100)


def test_load_c4_groups_and_limits() -> None:
    corpus = load_c4(str(C4), max_length=32, vocab_size=300)
    assert len(corpus.train_texts) == 36 and len(corpus.validation_texts) == 6
    assert set(corpus.group_names) == {
        "example.com",
        "blog.example.com",
        "news.site.org",
        "site.org",
        "shop.example.net",
        UNKNOWN_SOURCE,
    }
    # the url never enters the text
    assert not any("http" in t for t in corpus.train_texts)
    small = load_c4(str(C4), max_length=32, vocab_size=300, max_documents=25)
    assert len(small.train_texts) == 25
    assert small.train_texts == corpus.train_texts[:25]


def test_fortunes_c4_records_one_host_per_category() -> None:
    train, validation = fortunes_c4_records(FORTUNES)
    hosts = {source_group(r["url"]) for r in train}
    assert hosts == {"animals.fortunes.example", "space.fortunes.example", "tea.fortunes.example"}
    texts = [r["text"] for r in train]
    assert not set(texts) & {r["text"] for r in validation}
    assert len(validation) == 3  # one held-out entry per category (each has >= 2)
    again = fortunes_c4_records(FORTUNES)
    assert again == (train, validation)
    with pytest.raises(FileNotFoundError, match="no category file"):
        fortunes_c4_records(FORTUNES, ["animals", "nope"])


def test_fortunes_errors_name_the_setting_of_where_they_are_raised(tmp_path: Path) -> None:
    """``fedlore fortunes-c4`` takes ``--root``; a run's config takes ``data.root`` and
    ``data.categories``: each error names the one its user can change."""
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as err:
        fortunes_c4_records(missing)
    assert "point data.root=... at" in str(err.value) and "--root" not in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"data\.categories=\[") as err:
        fortunes_c4_records(FORTUNES, ["animals", "nope"])
    assert main(["fortunes-c4", str(tmp_path / "out"), "--root", str(missing)]) == 2
    from fedlore.data.fortunes_c4 import convert_fortunes

    with pytest.raises(FileNotFoundError) as err:
        convert_fortunes(tmp_path / "out", missing)
    assert "point --root FOLDER at" in str(err.value) and "data.root" not in str(err.value)


def test_fortunes_c4_with_a_file_or_a_folder_without_categories_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--root`` at a file, or at a folder holding only subfolders (``/usr/share/games``):
    one line each that says which, never "does not exist" or an empty list of categories."""
    (tmp_path / "fortunes").mkdir()
    note = tmp_path / "notes.txt"
    note.write_text("x\n")
    assert main(["fortunes-c4", str(tmp_path / "out"), "--root", str(note)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedlore: error: fortunes folder {note} is a file, not a folder. ")
    note.unlink()
    assert main(["fortunes-c4", str(tmp_path / "out"), "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedlore: error: fortunes: no category file in {tmp_path}. Install")
    assert "point --root FOLDER at" in err and err.count("\n") == 1
    (tmp_path / "config.yaml").write_text("rounds: 3\n")  # a folder of other files
    assert main(["fortunes-c4", str(tmp_path / "out"), "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedlore: error: fortunes: no category of {tmp_path} holds two entries")
    assert "is it a fortunes folder?" in err and not (tmp_path / "out").exists()


def test_fortunes_c4_cli_writes_files_the_c4_loader_reads(tmp_path: Path) -> None:
    assert main(["fortunes-c4", str(tmp_path), "--root", str(FORTUNES)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "c4-train.jsonl").read_text().splitlines()]
    assert set(rows[0]) == {"text", "url"}
    from_files = load_c4(str(tmp_path), max_length=32, vocab_size=300)
    in_memory = load_fortunes_c4(str(FORTUNES), max_length=32, vocab_size=300)
    assert from_files.train_texts == in_memory.train_texts
    assert from_files.group_names == in_memory.group_names
    assert np.array_equal(from_files.train_groups, in_memory.train_groups)
    assert from_files.tokenizer.get_vocab() == in_memory.tokenizer.get_vocab()


def test_gzip_round_trip(tmp_path: Path) -> None:
    from fedlore.data.c4 import write_c4_jsonl

    path = tmp_path / "c4-validation.json.gz"
    assert write_c4_jsonl([{"text": "é", "url": "http://x.org"}], path) == 1
    with gzip.open(path, "rt", encoding="utf-8") as f:
        assert json.loads(f.readline())["text"] == "é"
    assert read_c4_file(path) == [("é", "http://x.org")]


def test_text_spelling_a_special_token_stays_text() -> None:
    from fedlore.data.corpus import tokenize_documents

    tok = train_bpe_tokenizer(["a b c", "d e f <eos> <pad>"], 300)
    (ids,) = tokenize_documents(tok, ["a <eos> b <pad> c"])
    assert tok.eos_token_id not in ids and tok.pad_token_id not in ids
    assert tok.decode(ids) == "a <eos> b <pad> c"


def test_conversion_and_loader_refusals(tmp_path: Path) -> None:
    from fedlore.data.c4 import build_corpus
    from fedlore.data.fortunes_c4 import convert_fortunes

    with pytest.raises(ValueError, match=r"use data\.name=c4"):
        load_fortunes_c4(str(C4))
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        convert_fortunes(afile, FORTUNES)
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    (crowded / "c4-train.00001.json").write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="already holds other JSON files"):
        convert_fortunes(crowded, FORTUNES)
    convert_fortunes(tmp_path / "fresh", FORTUNES)
    convert_fortunes(tmp_path / "fresh", FORTUNES)  # rerunning overwrites its own files
    docs = [("a b", "http://a.org")]
    with pytest.raises(ValueError, match=r"vocab_size=300 has no effect with data\.tokenizer"):
        build_corpus("c4", docs, docs, str(tmp_path), 8, 300)
    with pytest.raises(ValueError, match="validation corpus holds no documents"):
        build_corpus("c4", docs, [], None, 8, 300)


def test_corpus_pack_uses_its_tokenizer() -> None:
    corpus = load_c4(str(C4), max_length=8, vocab_size=300)
    split = corpus.pack(corpus.validation_texts)
    assert split.x.dtype == torch.int64 and split.x.shape[1] == 8
    assert int(split.x.max()) < corpus.vocab_size
    eos = corpus.tokenizer.eos_token_id
    assert int((split.x == eos).sum()) == len(corpus.validation_texts)
