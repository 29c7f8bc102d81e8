"""The readers' text hygiene and root rule: every reader (CSV, TSV, JSONL, Parquet; every line-end
convention and byte-order mark) hands on texts without control characters other than tab and
newline, loses no good row, and follows no symlink out of its root.

The property tests generate hostile texts (``tests/helpers/hostile_text.py``: controls, bidi
overrides, zero-width characters, line and paragraph separators, BOMs, NUL, lone surrogates) and
check them against an oracle independent of ``clean_text``: the visible characters of a text
survive, in order."""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from embed_core.errors import RowError, SourceError
from embed_core.prepare.cleaning import clean_text
from embed_core.prepare.readers import RawRow, confine, read_lines, read_rows, root_for
from tests.helpers.hostile_text import TEXTS, assert_hygienic, usable, visible

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def check_rows(got: list, texts: list[str], first_row: int, column: str = "text") -> None:
    """Every row whose text is usable came through with its visible characters; the others are a
    RowError at their own row."""
    assert len(got) == len(texts), got
    for i, (item, text) in enumerate(zip(got, texts)):
        if usable(text):
            assert isinstance(item, RawRow), (item, text)
            assert item.row == first_row + i
            assert_hygienic(item.values[column])
            assert visible(item.values[column]) == visible(text)
        else:
            # named by its column, or by its line alone where the line is undecodable before it is parsed (JSONL)
            assert isinstance(item, RowError) and item.row == first_row + i and item.field in (column, None), item
            assert item.reason in ("control_character", "encoding")


# -- clean_text -------------------------------------------------------------------------------


@given(TEXTS)
@settings(max_examples=200, deadline=None)
def test_clean_text_keeps_every_visible_character_and_no_control_character(text):
    if not usable(text):
        with pytest.raises(ValueError):
            clean_text(text)
        return
    cleaned = clean_text(text)
    assert_hygienic(cleaned)
    assert visible(cleaned) == visible(text)
    assert clean_text(cleaned) == cleaned


@pytest.mark.parametrize("raw, clean", [
    ("a\r\nb\rc\x85d\u2028e\u2029f\x0bg\x0ch", "a\nb\nc\nd\ne\nf\ng\nh"),
    ("a\u202eevil\u202c \u2066x\u2069", "aevil x"),
    ("zero\u200bwidth\ufeff soft\u00adhyphen \u200e", "zerowidth softhyphen "),
    ("Treasury\x12s \x1b[31mred", "Treasury\ufffds \ufffd[31mred"),
    ("keep\ttab and ZWJ 👩\u200d💻 and ZWNJ \u200c", "keep\ttab and ZWJ 👩\u200d💻 and ZWNJ \u200c"),
])
def test_clean_text_normalises_each_class_as_the_table_says(raw, clean):
    assert clean_text(raw) == clean


# -- readers, every format ----------------------------------------------------------------------


@given(st.lists(TEXTS, min_size=1, max_size=6), st.booleans())
@SETTINGS
def test_jsonl_rows_with_hostile_texts_are_cleaned_or_quarantined(tmp_path, texts, ascii_only):
    lines = [json.dumps({"text": t, "tags": [t]}, ensure_ascii=ascii_only) for t in texts]
    # raw U+2028/U+2029/U+0085 inside a string (ascii_only False) stay text: the file's lines end in \n
    (tmp_path / "h.jsonl").write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
    got = list(read_rows(tmp_path / "h.jsonl", "h.jsonl"))
    check_rows(got, texts, 1)
    for item in got:
        if isinstance(item, RawRow):
            assert item.values["tags"] == [item.values["text"]]


@given(st.lists(TEXTS, min_size=1, max_size=6), st.sampled_from(["\n", "\r\n"]))
@SETTINGS
def test_multiline_csv_rows_with_hostile_texts_are_cleaned_or_quarantined(tmp_path, texts, line_end):
    buf = io.StringIO(newline="")
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator=line_end)
    writer.writerow(["text", "n"])
    writer.writerows([[t, i] for i, t in enumerate(texts)])
    (tmp_path / "h.csv").write_bytes(buf.getvalue().encode("utf-8", "surrogatepass"))
    got = list(read_rows(tmp_path / "h.csv", "h.csv", multiline=True, required=["text"]))
    assert len(got) == len(texts)
    for item, text in zip(got, texts):
        if usable(text):
            assert isinstance(item, RawRow), item
            assert_hygienic(item.values["text"])
            assert visible(item.values["text"]) == visible(text)
        else:
            assert isinstance(item, RowError) and item.reason in ("control_character", "encoding")


LINE_FREE = TEXTS.map(lambda t: "".join(ch for ch in t if ch not in "\r\n\x0b\x0c\x85\u2028\u2029\t"))


@given(st.lists(LINE_FREE, min_size=1, max_size=6), st.sampled_from(["\n", "\r\n", "\r", "\u2028", "\u2029", "\x85"]),
       st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"]))
@SETTINGS
def test_tsv_in_every_line_end_convention_and_unicode_encoding_loses_no_row(tmp_path, texts, line_end, encoding):
    bom = {"utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE}.get(encoding, b"")
    content = line_end.join(["text\tn", *(f"{t}\t{i}" for i, t in enumerate(texts))]) + line_end
    (tmp_path / "h.tsv").write_bytes(bom + content.encode(encoding, "surrogatepass"))
    got = list(read_rows(tmp_path / "h.tsv", "h.tsv", required=["text", "n"]))
    check_rows(got, texts, 2)
    assert [item.values["n"] for item in got if isinstance(item, RawRow)] == [
        str(i) for i, t in enumerate(texts) if usable(t)]


@given(st.lists(TEXTS, min_size=1, max_size=6))
@SETTINGS
def test_parquet_rows_with_hostile_texts_are_cleaned_or_quarantined(tmp_path, texts):
    safe = [t for t in texts if not any("\ud800" <= ch <= "\udfff" for ch in t)]  # Arrow holds valid UTF-8 only
    if not safe:
        return
    pq.write_table(pa.table({"text": safe, "tags": [[t] for t in safe]}), tmp_path / "h.parquet")
    check_rows(list(read_rows(tmp_path / "h.parquet", "h.parquet", required=["text"])), safe, 1)


def test_a_file_whose_lines_end_in_cr_only_is_read_line_by_line(tmp_path):
    (tmp_path / "mac.csv").write_bytes(b"sentence1,sentence2,score\rA,B,1\rC,D,2\r")
    got = list(read_rows(tmp_path / "mac.csv", "mac.csv"))
    assert [(r.row, r.values) for r in got] == [(2, {"sentence1": "A", "sentence2": "B", "score": "1"}),
                                                (3, {"sentence1": "C", "sentence2": "D", "score": "2"})]


def test_lines_longer_than_a_read_chunk_keep_their_crlf_split_across_chunks(tmp_path):
    long = "x" * ((1 << 20) - 1)  # the \r of the first line's end is the last byte of the first chunk
    (tmp_path / "l.txt").write_bytes(f"{long}\r\nshort\r\n".encode())
    assert [(n, len(line)) for n, line in read_lines(tmp_path / "l.txt", "l.txt")] == [(1, len(long)), (2, 5)]


def test_a_utf16_file_that_ends_inside_a_character_is_a_source_error(tmp_path):
    (tmp_path / "t.csv").write_bytes("a,b\nc,d\n".encode("utf-16") + b"\x00")
    with pytest.raises(SourceError, match="UTF-16-LE byte-order mark but ends inside a character"):
        list(read_rows(tmp_path / "t.csv", "t.csv"))


# -- roots ------------------------------------------------------------------------------------------


def test_a_symlink_out_of_the_root_is_refused_and_one_inside_it_is_followed(tmp_path):
    root, outside = tmp_path / "data", tmp_path / "secret"
    root.mkdir(), outside.mkdir()
    (outside / "creds").write_text("aws_secret_access_key=SECRET\n")
    (root / "real.csv").write_text("a\n1\n")
    os.symlink(outside / "creds", root / "leak.csv")
    os.symlink(root / "real.csv", root / "alias.csv")
    os.symlink(outside, root / "sub")
    with pytest.raises(SourceError, match="leak.csv: leaves data_root") as err:
        list(read_rows(root / "leak.csv", "leak.csv", root=root))
    assert "SECRET" not in str(err.value)
    with pytest.raises(SourceError, match="leaves data_root"):
        list(read_rows(root / "sub/creds", "sub/creds", fmt="csv", root=root))
    assert [r.values for r in read_rows(root / "alias.csv", "alias.csv", root=root)] == [{"a": "1"}]
    assert confine(root / "alias.csv", "alias.csv", root) == (root / "real.csv").resolve()


def test_the_root_of_a_configured_path_is_data_root_or_the_folder_it_is_named_in(tmp_path):
    def resolve(p: str) -> Path:
        return Path(p) if Path(p).is_absolute() else tmp_path / "data" / p

    assert root_for(resolve, "sub/x.csv") == tmp_path / "data"
    assert root_for(resolve, "../elsewhere/x.csv") == tmp_path / "elsewhere"
    assert root_for(resolve, "/abs/dir/x.csv") == Path("/abs/dir")


def test_a_header_that_lacks_the_columns_shows_at_most_a_short_escaped_excerpt(tmp_path):
    (tmp_path / "c.csv").write_text("aws_secret_access_key=" + "S" * 60 + "\x1b]0;pwned\x07\n")
    with pytest.raises(SourceError) as err:
        list(read_rows(tmp_path / "c.csv", "c.csv", required=["text"]))
    message = str(err.value)
    assert message.endswith("(header has: aws_secret_access_key=" + "S" * 17 + "…)"), message
    assert "pwned" not in message and message.isprintable()


def test_a_symlink_loop_is_a_source_error(tmp_path):
    os.symlink(tmp_path / "b.csv", tmp_path / "a.csv")
    os.symlink(tmp_path / "a.csv", tmp_path / "b.csv")
    with pytest.raises(SourceError, match="a.csv: cannot resolve the path"):
        list(read_rows(tmp_path / "a.csv", "a.csv", root=tmp_path))


def test_a_data_root_relative_to_the_working_directory_confines_like_an_absolute_one(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.csv").write_text("x\n")
    monkeypatch.chdir(tmp_path)
    resolve = lambda p: Path("data") / p  # noqa: E731 - what RunConfig.resolve does for data_root: data
    assert confine(resolve("a.csv"), "a.csv", root_for(resolve, "a.csv")) == (tmp_path / "data" / "a.csv").resolve()
