"""Bad source files through the real CLI (``embedpipe prepare``): a file that cannot be read is
exit 2 with one stderr line naming it; a bad row is quarantined with its line and reason while
every good row is written."""

import gzip
import os

import pyarrow.parquet as pq
import pytest

from embed_core.artifacts import read_manifest, read_records
from tests.helpers.cli_run import in_process, write_config

pytestmark = pytest.mark.prefect

HEADER = "sentence1,sentence2,score\n"
GOOD = "A man plays a guitar.,A man is playing guitar.,4.6\n"


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


def prepare(capfd, tmp_path, sources):
    return in_process(capfd, "prepare", "--config", write_config(tmp_path, sources))


def quarantine(tmp_path):
    return pq.read_table(tmp_path / "runs/r/prepare/_quarantine.parquet").to_pylist()


def written_refs(tmp_path, dataset):
    return sorted({r["source_ref"] for r in read_records(tmp_path / "runs/r", "prepare")[f"{dataset}.parquet"].to_pylist()},
                  key=lambda ref: int(ref.rsplit(":", 1)[1]))


def sts(path, **extra):
    return {"name": "sts", "kind": "sts", "path": path, **extra}


@pytest.mark.parametrize("make, fragment", [
    (lambda: gzip.compress((HEADER + GOOD * 50).encode())[:40], "cannot read the gzip stream"),
    (lambda: (HEADER + GOOD).encode(), "cannot read the gzip stream"),  # plain text named .gz
], ids=["truncated-gz", "fake-gz"])
def test_a_damaged_gzip_is_one_line_naming_the_file(tmp_path, capfd, make, fragment):
    (tmp_path / "s.csv.gz").write_bytes(make())
    prepare(capfd, tmp_path, [sts("s.csv.gz")]).assert_one_line_error("s.csv.gz: ", fragment)


def test_a_directory_where_a_file_belongs_is_one_line(tmp_path, capfd):
    (tmp_path / "s.csv").mkdir()
    prepare(capfd, tmp_path, [sts("s.csv")]).assert_one_line_error("s.csv: is a directory, expected a file")


def test_random_bytes_named_parquet_are_one_line(tmp_path, capfd):
    (tmp_path / "s.parquet").write_bytes(os.urandom(3000))
    prepare(capfd, tmp_path, [sts("s.parquet")]).assert_one_line_error("s.parquet: not a readable Parquet file")


def test_inspect_on_a_corrupt_parquet_file_is_one_line(tmp_path, capfd):
    (tmp_path / "x.parquet").write_bytes(b"PAR1" + os.urandom(100))
    in_process(capfd, "inspect", tmp_path / "x.parquet").assert_one_line_error("x.parquet: not a readable Parquet file")


def test_a_binary_file_read_as_csv_is_one_printable_line_and_prefect_reports_it(tmp_path, capfd):
    (tmp_path / "s.csv").write_bytes(bytes(range(256)) * 4 + b"\n\xff\xfe,\x00\n")
    line = prepare(capfd, tmp_path, [sts("s.csv")]).assert_one_line_error("s.csv:1: field 'sentence1': column not in header")
    assert "\\x" in line and line.isprintable()


def test_a_latin1_byte_in_the_header_is_reported_escaped(tmp_path, capfd):
    (tmp_path / "s.csv").write_bytes(b"sentence1,sentence2,sc\xf6re\n" + GOOD.encode())
    prepare(capfd, tmp_path, [sts("s.csv")]).assert_one_line_error(
        "s.csv:1: field 'score': column not in header (header has: sentence1, sentence2, sc\\xf6re)")


def test_a_duplicated_header_column_is_an_error(tmp_path, capfd):
    (tmp_path / "s.csv").write_text("sentence1,sentence2,score,sentence2\n" + GOOD.rstrip() + ",x\n")
    prepare(capfd, tmp_path, [sts("s.csv")]).assert_one_line_error(
        "s.csv:1: field 'sentence2': column appears twice in the header (columns 2 and 4)")


def test_an_empty_source_is_an_error_unless_allowed(tmp_path, capfd):
    (tmp_path / "s.csv").write_text(HEADER)
    (tmp_path / "t.csv").write_text(HEADER + GOOD)
    prepare(capfd, tmp_path, [sts("s.csv"), sts("t.csv", name="t")]).assert_one_line_error(
        "s.csv: source 'sts' has no data rows", "allow_empty: true")
    assert prepare(capfd, tmp_path, [sts("s.csv", allow_empty=True), sts("t.csv", name="t")]).rc == 0
    assert written_refs(tmp_path, "t") == ["t.csv:2"]


@pytest.mark.parametrize("multiline", [False, True], ids=["one-line-records", "rfc4180-default"])
def test_a_stray_quote_costs_its_own_line_and_no_good_row(tmp_path, capfd, multiline):
    """Line 3 opens a quote that a field three lines later closes. With multiline: false each line is
    a record of its own; with the default (RFC 4180, as pandas reads it) lines 3-6 read as one record
    of three fields, but lines 4-5 are rows of the file's shape: the reader recovers at line 4."""
    (tmp_path / "s.csv").write_text(
        HEADER + GOOD
        + '"A stray quote opens here.,A man is playing.,4.0\n'                 # 3 stray quote
        + "A woman slices an onion.,Someone cuts an onion.,4.2\n"              # 4
        + "A child runs.,A kid is running.,3.9\n"                             # 5
        + 'Closing it here",A dog barks.,1.0\n'                                # 6 the quote "closes" here
        + "A cat sleeps.,A cat is sleeping.,4.8\n")                           # 7
    result = prepare(capfd, tmp_path, [sts("s.csv", **({} if multiline else {"multiline": False}))])
    assert result.rc == 0, result.err
    assert [(q["row"], q["reason"]) for q in quarantine(tmp_path)] == [(3, "stray_quote")]
    assert written_refs(tmp_path, "sts") == ["s.csv:2", "s.csv:4", "s.csv:5", "s.csv:6", "s.csv:7"]


def test_quoted_fields_that_span_lines_are_read_with_the_defaults(tmp_path, capfd):
    (tmp_path / "s.csv").write_text(HEADER + '"Two\nlines.",One line.,3.0\n' + GOOD)
    assert prepare(capfd, tmp_path, [sts("s.csv")]).rc == 0
    assert written_refs(tmp_path, "sts") == ["s.csv:2", "s.csv:4"]
    rows = read_records(tmp_path / "runs/r", "prepare")["sts.parquet"].to_pylist()
    assert "Two\nlines." in {r["query"] for r in rows}


def test_an_unterminated_quote_costs_only_its_line_and_the_rows_after_it_are_kept(tmp_path, capfd):
    after = "".join(f"A cat sleeps {i}.,A cat is sleeping.,4.{i}\n" for i in range(3))  # distinct: not deduplicated
    (tmp_path / "s.csv").write_text(HEADER + GOOD + '"Never closed,x,1\n' + after)
    assert prepare(capfd, tmp_path, [sts("s.csv")]).rc == 0
    (q,) = quarantine(tmp_path)
    assert (q["row"], q["reason"]) == (3, "unterminated_quote")
    assert "this line is quarantined and the 3 lines after it read again as rows" in q["message"]
    assert written_refs(tmp_path, "sts") == ["s.csv:2", "s.csv:4", "s.csv:5", "s.csv:6"]


def test_invisible_only_texts_and_scores_outside_the_range_are_quarantined(tmp_path, capfd):
    (tmp_path / "s.csv").write_text(
        HEADER + GOOD
        + "\u200b\u200c\ufeff,A man is playing.,4.0\n"      # 3 zero-width only
        + "\x01\x02,A man is playing.,4.0\n"               # 4 control characters only
        + "A cat sleeps.,A cat is sleeping.,500\n"         # 5 above the range
        + "A dog runs.,A dog is running.,-7\n"             # 6 below the range
        + "A child runs.,A kid is running.,5\n")           # 7 on the edge: kept
    assert prepare(capfd, tmp_path, [sts("s.csv", params={"score_range": [0, 5]})]).rc == 0
    got = [(q["row"], q["field"], q["reason"]) for q in quarantine(tmp_path)]
    assert got == [(3, "sentence1", "empty_text"), (4, "sentence1", "empty_text"),
                   (5, "score", "score_range"), (6, "score", "score_range")]
    assert written_refs(tmp_path, "sts") == ["s.csv:2", "s.csv:7"]
    assert read_manifest(tmp_path / "runs/r", "prepare")["counts"]["totals"]["quarantined"] == 4
