"""Corpus documents through the real CLI (``embedpipe prepare`` on a ``kind: corpus`` folder):
success means data — a folder with no readable document is exit 2 with one line, as any other
empty source is, unless the source sets ``allow_empty`` — and every document is bounded and costs
only itself: one larger than ``limits.max_record_bytes`` is quarantined naming the file and the
bound before it is decoded, a FIFO of a document's name is a quarantined row, not a silent skip."""

import os

import pyarrow.parquet as pq
import pytest
import yaml

from tests.helpers.cli_run import in_process

pytestmark = pytest.mark.prefect

TEXT = "The heart pumps blood through the body and the lungs exchange oxygen for carbon dioxide."


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


def _prepare(capfd, tmp_path, **source):
    spec = {"name": "docs", "kind": "corpus", "path": "docs", "params": {"chunk_tokens": 16, "min_chars": 5},
            **source}
    config = {"data_root": str(tmp_path), "run_root": str(tmp_path / "runs"), "run_name": "r",
              "prepare": {"sources": [spec]}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return in_process(capfd, "prepare", "--config", path)


@pytest.mark.parametrize("files", [{}, {"notes.docx": b"PK\x03\x04 a word file"}], ids=["empty", "only-docx"])
def test_a_corpus_folder_without_a_readable_document_is_one_line_unless_allow_empty(tmp_path, capfd, files):
    (tmp_path / "docs").mkdir()
    for name, data in files.items():
        (tmp_path / "docs" / name).write_bytes(data)
    _prepare(capfd, tmp_path).assert_one_line_error(
        "docs: corpus source 'docs' wrote no passage: 0 read", "set allow_empty: true on the source")
    assert not (tmp_path / "runs/r/prepare/manifest.json").exists()
    assert _prepare(capfd, tmp_path, allow_empty=True).rc == 0


def test_a_document_over_the_record_bound_is_quarantined_naming_it_and_the_others_are_kept(tmp_path, capfd):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/small.txt").write_text(TEXT)
    (tmp_path / "docs/huge.txt").write_text("word " * 1000)  # 5,000 bytes
    result = _prepare(capfd, tmp_path, limits={"max_record_bytes": 2048})
    assert result.rc == 0, result.err
    (q,) = pq.read_table(tmp_path / "runs/r/prepare/_quarantine.parquet").to_pylist()
    assert (q["file"], q["reason"]) == ("docs/huge.txt", "record_too_long")
    assert "document of more than limits.max_record_bytes (2 KiB)" in q["message"]
    passages = pq.read_table(tmp_path / "runs/r/prepare/corpus-docs.parquet").column("source_ref").to_pylist()
    assert passages and all(ref.startswith("docs/small.txt:") for ref in passages)


def test_a_fifo_named_like_a_document_is_a_quarantined_row_not_a_hang_or_a_silent_skip(tmp_path, capfd):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.txt").write_text(TEXT)
    os.mkfifo(tmp_path / "docs/pipe.txt")
    result = _prepare(capfd, tmp_path)
    assert result.rc == 0, result.err
    (q,) = pq.read_table(tmp_path / "runs/r/prepare/_quarantine.parquet").to_pylist()
    assert (q["file"], q["reason"]) == ("docs/pipe.txt", "not_a_file")
    assert "is not a regular file (a FIFO, a device or a socket)" in q["message"]
