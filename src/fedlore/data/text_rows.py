"""Rows of the ``text_csv`` and ``text_jsonl`` sources' files, read strictly (UTF-8, every CSV
quote closed, every CSV field under a header name), each problem named with its file and line.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
from pathlib import Path
from typing import Any


def _read_text(path: Path) -> str:
    """The file's text as UTF-8 (a leading byte-order mark, as spreadsheets write, is dropped);
    bytes that are not UTF-8 are an error naming the file and line."""
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text ({e}); save the file as UTF-8") from None


def _csv_rows(path: Path, text: str) -> list[dict[str, Any]]:
    """:func:`read_rows` of a CSV file, read strictly: a quote left open is an error naming
    the line it opened on (the first of its row) and the line the csv module gave up on (the
    end of the file, or a later quote that closed it with text after it); text after a closing
    quote on one line is an error naming that line. (Read leniently, an open quote swallowed
    the rows after it into one field, and the error, if any, named the file's last line.) A
    row with more fields than the header names, not empty, is an error naming its line: a
    comma in an unquoted text moved the text's end into the label, a class of its own."""
    reader = csv.DictReader(io.StringIO(text, newline=""), strict=True)
    rows: list[dict[str, Any]] = []
    done = 0  # the last line read without error: the header's, then each row's
    try:
        if reader.fieldnames is not None:  # reads the header
            done = reader.reader.line_num
        header = list(reader.fieldnames or ())
        if reader.fieldnames == []:  # a blank first line, read as a header of no names
            raise ValueError(
                f"{path}:1: the first line is blank; a CSV file's first line is its header, "
                "the names of its columns (text,label)"
            )
        for row in reader:
            if any(v.strip() for v in row.pop(None, None) or ()):  # fields past the header
                raise ValueError(
                    f"{path}:{reader.line_num}: more fields than the header's {len(header)} "
                    f"({', '.join(header)}); {_extra_hint(header)}"
                )
            rows.append(dict(row, _line=reader.line_num))
            done = reader.line_num
    except csv.Error as e:
        # the failed row's first line (blank lines are no rows): a row runs on past its first
        # line only inside a quote opened on it
        lines = list(io.StringIO(text, newline=""))
        starts = (i for i in range(done + 1, len(lines) + 1) if lines[i - 1].strip("\r\n"))
        opened, at = next(starts, done + 1), reader.reader.line_num
        eof = str(e) == "unexpected end of data"
        if opened >= at and not eof:  # on one line: text after a closing quote, or too long
            hint = "; a field that starts with a quote must end with it, and a quote inside it "
            hint += 'is written twice ("")'
            hint = hint if '"' in str(e) else ""
            raise ValueError(f"{path}:{at}: not valid CSV ({e}){hint}") from None
        to = f"line {at} ({e})"
        if eof:
            to = "the end of the file" + (f" (line {at})" if at > opened else "")
        raise ValueError(
            f"{path}:{opened}: the quote opened on line {opened} runs on past its line, to {to}; "
            'close it where its field ends, or write a quote inside a quoted field twice ("")'
        ) from None
    return rows


def _extra_hint(header: list[str]) -> str:
    """The remedy for a row with more fields than ``header``: quotes around a text holding a
    comma, unless the header is one name holding a tab or semicolon (a file of another
    separator, whose texts' commas are then the only ones)."""
    if len(header) == 1 and (sep := next((c for c in "\t;" if c in header[0]), None)):
        name = "tabs" if sep == "\t" else "semicolons"
        return f"the header is one name: the file is separated by {name}, not commas"
    return 'a text that holds a comma must be in quotes ("a, b")'


def read_rows(path: Path, kind: str) -> list[dict[str, Any]]:
    """Rows of a CSV (header line) or JSONL (one object per line) file, as dicts.

    Each row keeps its line number in ``_line``, blank lines counted (a CSV row whose quoted
    field spans several lines: its last line). A CSV quote left open is an error naming the
    line it opened on (:func:`_csv_rows`).
    """
    text = _read_text(path)
    if kind == "csv":
        return _csv_rows(path, text)
    rows = []
    for i, line in enumerate(io.StringIO(text, newline=None), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object, got {type(obj).__name__}")
        rows.append(dict(obj, _line=i))
    return rows
