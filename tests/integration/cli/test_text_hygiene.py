"""Text hygiene and the data_root boundary through the real CLI: sources in every line-end
convention and Unicode encoding lose no row, record texts hold no control character, ``inspect``
escapes what it prints, a degenerate STS task is an error instead of a NaN score, and a symlink out
of data_root is refused without showing the target's content."""

import os

import pyarrow.parquet as pq
import pytest

from embed_core.artifacts import read_records
from embed_core.schema import Record, records_to_table
from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data
from tests.helpers.hostile_text import assert_hygienic

pytestmark = pytest.mark.prefect

ROWS = ["A man plays a guitar.,A man is playing guitar.,4.6", "A cat sleeps.,A cat is sleeping.,4.8",
        "A child runs.,A kid is running.,3.9"]
HEADER = "sentence1,sentence2,score"


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


def prepared(tmp_path) -> list[dict]:
    return read_records(tmp_path / "runs/r", "prepare")["sts.parquet"].to_pylist()


def quarantined(tmp_path) -> list[dict]:
    return pq.read_table(tmp_path / "runs/r/prepare/_quarantine.parquet").to_pylist()


@pytest.mark.parametrize("line_end", ["\r", "\r\n", "\u2028", "\x85"], ids=["cr", "crlf", "u2028", "nel"])
def test_a_source_whose_lines_end_in_another_convention_loses_no_row(tmp_path, capfd, line_end):
    (tmp_path / "s.csv").write_bytes(line_end.join([HEADER, *ROWS]).encode() + line_end.encode())
    result = in_process(capfd, "prepare", "--config", write_config(tmp_path, [{**STS_SOURCE, "path": "s.csv"}]))
    assert result.rc == 0, result.err
    assert quarantined(tmp_path) == []
    assert sorted({r["source_ref"] for r in prepared(tmp_path)}) == ["s.csv:2", "s.csv:3", "s.csv:4"]


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-be-bom"])
def test_sources_saved_with_a_bom_or_as_utf16_are_read_like_utf8(tmp_path, capfd, encoding):
    text = "\r\n".join([HEADER, *ROWS, "Ünïcödé wörds.,Ein Satz.,1.0"]) + "\r\n"
    data = b"\xfe\xff" + text.encode("utf-16-be") if encoding == "utf-16-be-bom" else text.encode(encoding)
    (tmp_path / "s.csv").write_bytes(data)
    result = in_process(capfd, "prepare", "--config", write_config(tmp_path, [{**STS_SOURCE, "path": "s.csv"}]))
    assert result.rc == 0, result.err
    assert quarantined(tmp_path) == []
    queries = {r["query"] for r in prepared(tmp_path)}
    assert {"A man plays a guitar.", "Ünïcödé wörds."} <= queries


def test_control_and_bidi_characters_never_reach_a_record_and_nul_is_quarantined(tmp_path, capfd):
    (tmp_path / "s.csv").write_text(
        HEADER + "\n"
        + "Treasury\x12s plan \u202egnp.exe\u202c,A \u200bplan.,4.0\n"       # 2: control -> U+FFFD, bidi removed
        + "Red \x1b[31malert\x1b[0m.,An alert.,3.0\n"                      # 3: escape sequence neutralised
        + "A NUL\x00 byte.,Binary.,1.0\n"                                  # 4: quarantined
        + ROWS[0] + "\n")                                                # 5
    result = in_process(capfd, "prepare", "--config", write_config(tmp_path, [{**STS_SOURCE, "path": "s.csv"}]))
    assert result.rc == 0, result.err
    records = prepared(tmp_path)
    for rec in records:
        for text in (rec["query"], *rec["positives"]):
            assert_hygienic(text)
    assert "Treasury\ufffds plan gnp.exe" in {r["query"] for r in records}
    assert [(q["row"], q["field"], q["reason"]) for q in quarantined(tmp_path)] == [(4, "sentence1", "control_character")]
    assert sorted({r["source_ref"] for r in records}) == ["s.csv:2", "s.csv:3", "s.csv:5"]


def test_inspect_escapes_terminal_escapes_and_bidi_overrides(tmp_path, capfd):
    # a record file from someone else, written without embedpipe's readers
    rec = Record(id="x\x1b]0;owned\x07", dataset="d\u202e", task="sts", query="evil \u202eexe.txt\x1b[2J",
                 positives=["fine \u2066text\u2069"], positive_scores=[1.0], label="\x9b31m")
    pq.write_table(records_to_table([rec]), tmp_path / "r.parquet")
    result = in_process(capfd, "inspect", tmp_path / "r.parquet")
    assert result.rc == 0, result.err
    assert "\\u202eexe.txt\\x1b[2J" in result.out and "\\u2066text\\u2069" in result.out
    assert "\\x1b]0;owned\\x07" in result.out and "\\x9b31m" in result.out
    assert not any(ch in result.out for ch in "\x1b\x07\x9b\u202e\u2066\u2069")


def test_an_sts_task_with_constant_gold_scores_is_an_error_not_a_nan_score(tmp_path, capfd, tiny_model):
    write_sts_data(tmp_path)
    (tmp_path / "eval.csv").write_text(HEADER + "\nA cat.,A kitten.,3\nA dog.,A hound.,3\nA car.,An auto.,3.0\n")
    config = write_config(tmp_path, [STS_SOURCE], evaluate={
        "base_model": str(tiny_model), "tasks": [{"name": "FlatSTS", "type": "sts", "path": "eval.csv"}]})
    in_process(capfd, "evaluate", "--config", config).assert_one_line_error(
        "eval.csv: every gold score is 3", "FlatSTS", "undefined (NaN)")
    assert not (tmp_path / "runs/r/evaluate").exists()


SECRET = "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize("link", ["file", "directory", "beir-file"])
def test_a_symlink_out_of_the_data_root_is_refused_without_showing_the_target(tmp_path, capfd, link):
    data, home = tmp_path / "data", tmp_path / "home"
    data.mkdir(), home.mkdir()
    (home / "credentials").write_text(f"[default]\n{SECRET}\n")
    source = {**STS_SOURCE, "path": "s.csv"}
    if link == "file":
        os.symlink(home / "credentials", data / "s.csv")
    elif link == "directory":
        os.symlink(home, data / "shared")
        (home / "s.csv").write_text(HEADER + "\n" + ROWS[0] + "\n")
        source["path"] = "shared/s.csv"
    else:
        (data / "b/qrels").mkdir(parents=True)
        (data / "b/queries.jsonl").write_text('{"_id": "q", "text": "a query"}\n')
        (data / "b/qrels/train.tsv").write_text("q\td\t1\n")
        os.symlink(home / "credentials", data / "b/corpus.jsonl")
        source = {"name": "b", "kind": "beir", "path": "b"}
    config = write_config(tmp_path, [source], data_root=str(data))
    line = in_process(capfd, "prepare", "--config", config).assert_one_line_error("leaves data_root")
    assert "wJalr" not in line and "aws_secret" not in line and "[default]" not in line
    assert not (tmp_path / "runs/r/prepare").exists()


def test_a_symlink_inside_the_data_root_is_followed(tmp_path, capfd):
    (tmp_path / "real.csv").write_text(HEADER + "\n" + ROWS[0] + "\n")
    os.symlink(tmp_path / "real.csv", tmp_path / "s.csv")
    result = in_process(capfd, "prepare", "--config", write_config(tmp_path, [{**STS_SOURCE, "path": "s.csv"}]))
    assert result.rc == 0, result.err
    assert {r["source_ref"] for r in prepared(tmp_path)} == {"s.csv:2"}
