"""Standard files read as their writers meant, and bounded memory for every reader (issue 44).

A CSV that pandas, Excel or Python's csv module writes (quoted fields holding LF and CRLF, CRLF
line ends, doubled quotes) reads with the default source options into the records pandas reads; a
malformed record is quarantined whole, no fragment of it kept. Every reader bounds a line, a field,
a record and the decompressed file (``ReadLimits``): past a bound the row is one quarantined
``RowError`` naming the bound, or the file one ``SourceError``. The bounds are set small here so
the files stay small; ``tests/integration/cli/test_memory_bombs.py`` sends the full-size bombs
through the CLI under an address-space limit."""

from __future__ import annotations

import csv
import gzip
import io

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from embed_core.config_base import ReadLimits
from embed_core.errors import OUT_OF_MEMORY, RowError, SourceError, user_error
from embed_core.prepare.config import SourceSpec
from embed_core.prepare.readers import RawRow, read_lines, read_rows

TEXTS = ["plain", "two\nlines", "crlf\r\ninside", 'he said "hi"', "comma, inside",
         "", "ünïcode “quotes”", "ends with newline\n", "\r\nstarts with crlf", "a \"quote\"\nand a line"]
SMALL = ReadLimits(max_line_bytes=1024, max_record_bytes=2048, max_field_bytes=1024, max_decompressed_bytes=4096)


def frame() -> pd.DataFrame:
    return pd.DataFrame({"text": TEXTS, "label": [f"l{i}" for i in range(len(TEXTS))],
                         "other": [t.upper() for t in TEXTS]})


def write_pandas_lf(path):
    frame().to_csv(path, index=False)


def write_pandas_crlf(path):
    frame().to_csv(path, index=False, lineterminator="\r\n")


def write_excel(path):  # Python's csv module, Excel dialect: CRLF line ends, minimal quoting
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, dialect="excel")
        writer.writerow(frame().columns)
        writer.writerows(frame().itertuples(index=False))


def write_excel_utf8_all_quoted(path):  # Excel's "CSV UTF-8": a byte-order mark, every field quoted
    with open(path, "w", newline="", encoding="utf-8-sig") as fh:
        writer = csv.writer(fh, dialect="excel", quoting=csv.QUOTE_ALL)
        writer.writerow(frame().columns)
        writer.writerows(frame().itertuples(index=False))


@pytest.mark.parametrize("write", [write_pandas_lf, write_pandas_crlf, write_excel, write_excel_utf8_all_quoted])
def test_a_csv_from_pandas_excel_or_the_csv_module_reads_with_the_defaults_into_the_records_pandas_reads(
        tmp_path, write):
    path = tmp_path / "t.csv"
    write(path)
    expected = pd.read_csv(path, dtype=str, keep_default_na=False).to_dict("records")
    got = list(read_rows(path, "t.csv", required=["text", "label"]))
    assert all(isinstance(row, RawRow) for row in got), got
    # Line breaks come out as "\n" (text hygiene, docs/stages.md): pandas keeps a quoted CRLF as written.
    assert [row.values for row in got] == [{k: v.replace("\r\n", "\n") for k, v in rec.items()} for rec in expected]


def test_a_record_that_spans_lines_is_numbered_by_the_line_it_starts_on(tmp_path):
    (tmp_path / "t.csv").write_bytes(b'text,label\r\n"a\r\nb\r\nc",x\r\nd,y\r\n')
    assert [(r.row, r.values["text"]) for r in read_rows(tmp_path / "t.csv", "t.csv")] == [(2, "a\nb\nc"), (5, "d")]


def test_an_unterminated_quote_costs_only_its_line_and_the_rows_after_it_are_read(tmp_path):
    (tmp_path / "t.csv").write_text('text,label\ngood,1\n"never closed,2\nthree,3\nfour,4\n')
    got = list(read_rows(tmp_path / "t.csv", "t.csv"))
    assert [r.values for r in got if isinstance(r, RawRow)] == [
        {"text": "good", "label": "1"}, {"text": "three", "label": "3"}, {"text": "four", "label": "4"}]
    (err,) = [r for r in got if isinstance(r, RowError)]
    assert (err.row, err.reason) == (3, "unterminated_quote")
    assert err.detail == ("a quoted field opened on this line is never closed: this line is quarantined and the 2 "
                          "lines after it read again as rows")


def test_a_quote_opened_on_the_last_line_quarantines_that_line(tmp_path):
    (tmp_path / "t.csv").write_text('text,label\ngood,1\n"never closed,2\n')
    got = list(read_rows(tmp_path / "t.csv", "t.csv"))
    assert [(r.row, r.reason, r.detail) for r in got if isinstance(r, RowError)] == [
        (3, "unterminated_quote", "a quoted field opened on this line is never closed")]


def test_a_malformed_record_across_lines_costs_its_first_line_and_the_next_line_that_parses_is_a_row(tmp_path):
    # Line 3 opens a quote that line 4 closes with text after it: line 3 is the broken one; line 4 parses alone.
    (tmp_path / "t.csv").write_text('text,label\ngood,1\n"opens here\ncloses" here,2\nafter,3\n')
    got = list(read_rows(tmp_path / "t.csv", "t.csv"))
    assert [(r.row, r.reason) for r in got if isinstance(r, RowError)] == [(3, "malformed_line")]
    assert [(r.row, r.values["text"]) for r in got if isinstance(r, RawRow)] == [
        (2, "good"), (4, 'closes" here'), (5, "after")]


@pytest.mark.parametrize("delimiter, suffix", [(",", "csv"), ("\t", "tsv")])
def test_a_stray_quote_that_swallows_rows_of_the_files_shape_costs_only_its_own_line(tmp_path, delimiter, suffix):
    """The quote opened on line 3 closes at the end of line 6's first field (a stray quote there too):
    RFC 4180 reads lines 3-6 as one record of the right width, but lines 4-5 are each a row of the
    file's shape."""
    rows = [["text", "other", "score"], ["good", "g", "1"], ['"stray quote', "a", "2"], ["three", "b", "3"],
            ["four", "c", "4"], ['close here"', "d", "5"], ["seven", "e", "7"]]
    path = tmp_path / f"t.{suffix}"
    path.write_text("".join(delimiter.join(r) + "\n" for r in rows))
    got = list(read_rows(path, path.name, delimiter=delimiter, quoting="minimal"))  # a TSV's quotes: text by default
    (err,) = [r for r in got if isinstance(r, RowError)]
    assert (err.row, err.reason) == (3, "stray_quote")
    assert err.detail.startswith("a quote opened on this line holds lines 4-5, which read as rows of this file")
    assert [(r.row, r.values["text"]) for r in got if isinstance(r, RawRow)] == [
        (2, "good"), (4, "three"), (5, "four"), (6, 'close here"'), (7, "seven")]


def test_a_quoted_field_whose_inner_lines_are_not_rows_of_the_files_shape_stays_one_record(tmp_path):
    """What pandas and the csv module write: a text with line breaks and commas, one record."""
    import csv

    path = tmp_path / "t.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["text", "other", "score"], ["a\nb, with one comma\nc", "x", "1"],
                                 ["Dear all,\n\nthanks\n", "y", "2"], ["plain", "z", "3"]])
    got = list(read_rows(path, "t.csv"))
    assert all(isinstance(r, RawRow) for r in got), got
    assert [r.values["text"] for r in got] == ["a\nb, with one comma\nc", "Dear all,\n\nthanks\n", "plain"]
    assert [r.values for r in got] == pd.read_csv(path, dtype=str, keep_default_na=False).to_dict("records")


def test_multiline_false_still_quarantines_a_stray_quote_on_its_own_line(tmp_path):
    (tmp_path / "t.csv").write_text('text,label\n"stray,1\nnext,2\n')
    got = list(read_rows(tmp_path / "t.csv", "t.csv", multiline=False))
    assert [(r.row, r.reason) for r in got if isinstance(r, RowError)] == [(2, "stray_quote")]
    assert [r.values["text"] for r in got if isinstance(r, RawRow)] == ["next"]


# -- bounds ---------------------------------------------------------------------------------------


def read(path, **kwargs):
    return list(read_rows(path, path.name, limits=SMALL, **kwargs))


def test_a_csv_line_over_the_bound_is_quarantined_and_the_next_line_read(tmp_path):
    (tmp_path / "t.csv").write_text("text,label\n" + "x" * 5000 + ",1\nok,2\n")
    got = read(tmp_path / "t.csv")
    assert [(r.row, r.reason) for r in got if isinstance(r, RowError)] == [(2, "line_too_long")]
    assert "limits.max_line_bytes (1 KiB)" in str(got[0])
    assert [r.values["text"] for r in got if isinstance(r, RawRow)] == ["ok"]


def test_a_header_line_over_the_bound_refuses_the_file(tmp_path):
    (tmp_path / "t.csv").write_text("h" * 5000 + "\nok\n")
    with pytest.raises(SourceError, match=r"t.csv:1: cannot read the header: line of more than limits.max_line_bytes"):
        read(tmp_path / "t.csv")


def test_a_line_without_any_line_end_is_cut_at_the_bound_not_held(tmp_path):
    (tmp_path / "t.csv").write_text("text,label\nok,1\n" + "x" * 300_000)  # the last line has no line end
    got = read(tmp_path / "t.csv", header=True)
    assert [(r.row, r.reason) for r in got if isinstance(r, RowError)] == [(3, "line_too_long")]


def test_a_csv_field_over_the_bound_is_quarantined_naming_the_field(tmp_path):
    limits = SMALL.model_copy(update={"max_field_bytes": 1024, "max_line_bytes": 8192, "max_record_bytes": 8192})
    (tmp_path / "t.csv").write_text("text,label\nok,1\n" + "é" * 600 + ",2\n")  # 1,200 bytes, 600 characters
    got = list(read_rows(tmp_path / "t.csv", "t.csv", limits=limits))
    (err,) = [r for r in got if isinstance(r, RowError)]
    assert (err.row, err.field, err.reason) == (3, "text", "field_too_long")
    assert "1200 bytes, more than limits.max_field_bytes (1 KiB)" in err.detail


def test_a_quoted_record_over_the_bound_is_one_row_with_all_its_lines_and_no_fragment(tmp_path):
    lines = "\n".join(f"line {i} of a long quoted text, with commas" for i in range(100))
    (tmp_path / "t.csv").write_text(f'text,label\nok,1\n"{lines}",2\nafter,3\n')
    got = read(tmp_path / "t.csv")
    (err,) = [r for r in got if isinstance(r, RowError)]
    assert (err.row, err.reason) == (3, "record_too_long") and "lines 3-102, 100 lines" in err.detail
    assert [r.values["text"] for r in got if isinstance(r, RawRow)] == ["ok", "after"]


def test_a_jsonl_line_and_a_jsonl_string_over_their_bounds_are_quarantined(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"text": "ok"}\n{"text": "' + "x" * 5000 + '"}\n{"text": "after"}\n')
    got = read(tmp_path / "t.jsonl")
    assert [(r.row, r.reason) for r in got if isinstance(r, RowError)] == [(2, "line_too_long")]
    limits = SMALL.model_copy(update={"max_line_bytes": 8192})
    got = list(read_rows(tmp_path / "t.jsonl", "t.jsonl", limits=limits))
    assert [(r.row, r.field, r.reason) for r in got if isinstance(r, RowError)] == [(2, "text", "field_too_long")]
    assert [r.values["text"] for r in got if isinstance(r, RawRow)] == ["ok", "after"]


def test_a_gzip_that_expands_past_the_bound_refuses_the_file_with_one_error(tmp_path):
    (tmp_path / "t.csv.gz").write_bytes(gzip.compress(b"text,label\n" + b"ok,1\n" * 10_000))
    with pytest.raises(SourceError, match=r"t.csv.gz: expands when decompressed to more than "
                                          r"limits.max_decompressed_bytes \(4 KiB\)"):
        read(tmp_path / "t.csv.gz")


def test_a_one_row_parquet_cell_over_the_bound_is_quarantined_from_the_metadata(tmp_path):
    limits = ReadLimits(max_field_bytes=1024)
    pq.write_table(pa.table({"text": ["x" * (3 << 20)], "label": ["a"]}), tmp_path / "t.parquet")
    (err,) = list(read_rows(tmp_path / "t.parquet", "t.parquet", limits=limits))
    assert (err.row, err.field, err.reason) == (1, "text", "field_too_long") and "metadata" in err.detail


def test_a_parquet_cell_and_row_over_their_bounds_are_quarantined_and_the_other_rows_kept(tmp_path):
    texts = ["ok", "x" * 5000, "fine", "y" * 900]
    pq.write_table(pa.table({"text": texts, "extra": ["z" * 900] * 4}), tmp_path / "t.parquet")
    limits = SMALL.model_copy(update={"max_record_bytes": 1500, "max_decompressed_bytes": 1 << 20})
    got = list(read_rows(tmp_path / "t.parquet", "t.parquet", limits=limits))
    assert [(r.row, r.field, r.reason) for r in got if isinstance(r, RowError)] == [
        (2, "text", "field_too_long"), (4, None, "record_too_long")]
    assert [(r.row, r.values["text"]) for r in got if isinstance(r, RawRow)] == [(1, "ok"), (3, "fine")]


def test_a_parquet_file_whose_pages_expand_past_the_bound_is_refused_from_its_metadata(tmp_path):
    pq.write_table(pa.table({"text": [f"text number {i}" for i in range(5000)]}), tmp_path / "t.parquet")
    with pytest.raises(SourceError, match=r"t.parquet: its pages expand to .*more than limits.max_decompressed_bytes"):
        read(tmp_path / "t.parquet")


def test_the_bounds_are_source_options_with_defaults_far_above_real_data():
    spec = SourceSpec.model_validate({"name": "s", "kind": "sts", "path": "s.csv",
                                      "limits": {"max_line_bytes": 128 << 20}})
    assert spec.limits.max_line_bytes == 128 << 20 and spec.limits.max_field_bytes == 32 << 20
    assert spec.multiline is True
    with pytest.raises(ValueError, match="limits.max_lines_bytes|Extra inputs"):
        SourceSpec.model_validate({"name": "s", "kind": "sts", "path": "s.csv", "limits": {"max_lines_bytes": 1}})


def test_a_memory_error_or_a_thread_that_cannot_start_is_one_line_with_advice():
    assert user_error(MemoryError()) == OUT_OF_MEMORY
    assert user_error(RuntimeError("can't start new thread")) == OUT_OF_MEMORY
    assert user_error(RuntimeError("something else")) is None
    assert "\n" not in OUT_OF_MEMORY and "ulimit" in OUT_OF_MEMORY and "max_line_bytes" in OUT_OF_MEMORY


# No bare "\r": Python 3.11's csv writer leaves a field holding one unquoted (pandas then splits the line there).
FIELD = st.lists(st.sampled_from(list('ab ,"\n\t') + ["\r\n", "é", "“"]), max_size=12).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.lists(FIELD, min_size=3, max_size=3), min_size=1, max_size=8),
       terminator=st.sampled_from(["\n", "\r\n"]), quote_all=st.booleans())
def test_any_csv_the_csv_module_writes_reads_back_field_for_field(tmp_path, rows, terminator, quote_all):
    """Round trip against the writer, whatever the fields hold (quotes, delimiters, CR, LF)."""
    buffer = io.StringIO(newline="")
    csv.writer(buffer, lineterminator=terminator, quoting=csv.QUOTE_ALL if quote_all else csv.QUOTE_MINIMAL
               ).writerows(rows)
    (tmp_path / "t.csv").write_text(buffer.getvalue(), encoding="utf-8", newline="")
    got = list(read_rows(tmp_path / "t.csv", "t.csv", header=False))
    normal = [[f.replace("\r\n", "\n") for f in row] for row in rows]
    assert [[r.values[i] for i in range(3)] for r in got] == normal


@pytest.mark.parametrize("sizes", [[500, 1000, 1025, 3000, 10, 1024], [1 << 20] * 3, [1023, 1025] * 700])
def test_lines_past_the_bound_are_cut_wherever_chunks_end(tmp_path, sizes):
    """Lines around the bound, placed so some straddle the reader's 1 MiB chunks: exactly those
    over the bound come out as None, the others whole."""
    lines = [bytes([97 + i % 26]) * n for i, n in enumerate(sizes)]
    (tmp_path / "t.txt").write_bytes(b"x" * ((1 << 20) - 700) + b"\n" + b"\r\n".join(lines))
    got = [raw for _, raw in read_lines(tmp_path / "t.txt", "t.txt", limits=ReadLimits(max_line_bytes=1024))][1:]
    assert got == [line if len(line) <= 1024 else None for line in lines]
