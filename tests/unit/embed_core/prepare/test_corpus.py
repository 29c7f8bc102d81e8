"""A corpus without queries (``kind: corpus``): hand-made documents split into the expected spans,
every passage its file's text at its span, ids and source_refs, and prepare's checks on passages
(duplicates, contamination, a PDF it cannot parse) in the corpus artifact; a PDF's text."""

import json

import pyarrow.parquet as pq

from embed_core.config import parse_config
from embed_core.prepare.chunking import Chunker
from embed_core.prepare.convert import convert_source
from embed_core.prepare.convert.corpus import Passage
from embed_core.prepare.documents import html_text
from embed_core.prepare.run import run_prepare

DOC = "Alpha beta gamma.\n\nDelta epsilon zeta.\nEta theta iota kappa lambda mu."


def test_chunking_a_hand_made_document_gives_the_expected_spans():
    # 4 MiniLM tokens at most: "iota" is two (io ##ta), "mu." two; paragraphs and lines first
    spans = Chunker.for_tokenizer("default", 4).spans(DOC)
    assert [DOC[a:b] for a, b in spans] == ["Alpha beta gamma.", "Delta epsilon zeta.", "Eta theta iota",
                                           "kappa lambda mu."]
    assert spans == [(0, 17), (19, 38), (39, 53), (54, 70)]
    whole = Chunker.for_tokenizer("default", 64).spans(DOC)
    assert whole == [(0, len(DOC))]


def source(tmp_path, contamination=(), **params):
    return parse_config({"data_root": str(tmp_path), "prepare": {"contamination": list(contamination), "sources": [
        {"name": "docs", "kind": "corpus", "path": "docs", "params": {"chunk_tokens": 8, "min_chars": 5, **params}}]}})


def write_docs(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "a.md").write_text("# Title\n\nThe heart pumps blood through the body.\n\nLungs exchange oxygen and carbon dioxide.\n")
    (d / "sub/b.txt").write_text("Kidneys filter the blood and make urine every day.")
    (d / "c.html").write_text("<html><head><title>x</title><script>var a;</script></head>"
                              "<body><p>The liver stores glycogen for later.</p></body></html>")
    (d / "d.jsonl").write_text(json.dumps({"_id": "7", "title": "Bones", "text": "Bones hold calcium salts."}) + "\n")
    (d / "e.pdf").write_bytes(b"%PDF-1.4 not really")
    (d / "notes.csv").write_text("ignored,file\n")
    return d


def test_the_corpus_converter_gives_every_passage_an_id_and_the_span_of_its_text(tmp_path):
    d = write_docs(tmp_path)
    items = list(convert_source(source(tmp_path).prepare.sources[0], parse_config(
        {"data_root": str(tmp_path), "prepare": {"sources": [{"name": "x", "kind": "sts", "path": "x"}]}})))
    passages = [i for i in items if isinstance(i, Passage)]
    assert [p.id for p in passages][:3] == ["docs:docs/a.md:0", "docs:docs/a.md:1", "docs:docs/a.md:2"]
    for p in passages:
        ref, _, span = p.source_ref.rpartition(":")
        start, end = map(int, span.split("-"))
        if ref.endswith((".md", ".txt")):
            assert (tmp_path / ref).read_text()[start:end] == p.text
    jsonl = [p for p in passages if "d.jsonl" in p.source_ref]
    assert [(p.id, p.source_ref) for p in jsonl][0] == ("docs:7:0", "docs/d.jsonl:1:0-32")
    html = [p.text for p in passages if "c.html" in p.source_ref]
    assert " ".join(html) == "The liver stores glycogen for later." and "var a" not in html_text((d / "c.html").read_text())
    assert not any("notes.csv" in p.source_ref for p in passages)


def test_prepare_writes_a_corpus_artifact_with_duplicates_contamination_and_a_pdf_left_out(tmp_path):
    d = write_docs(tmp_path)
    (d / "dup.txt").write_text("Kidneys filter the blood and make urine every day.")
    (tmp_path / "test.jsonl").write_text(json.dumps({"sentence1": "The liver stores glycogen for later.",
                                                     "sentence2": "x", "score": 1}) + "\n")
    cfg = source(tmp_path, [{"name": "t", "kind": "sts", "path": "test.jsonl"}], chunk_tokens=32)
    manifest = run_prepare(cfg, tmp_path / "run")
    assert manifest["outputs"]["corpus-docs.parquet"]["kind"] == "corpus"
    rows = pq.read_table(tmp_path / "run/prepare/corpus-docs.parquet").to_pylist()
    texts = [r["text"] for r in rows]
    assert texts.count("Kidneys filter the blood and make urine every day.") == 1
    assert "The liver stores glycogen for later." not in texts
    assert len({r["id"] for r in rows}) == len(rows) and all(r["dataset"] == "docs" for r in rows)
    corpus = manifest["counts"]["sources"][0]["corpus"]
    assert corpus["deduped"] == 1 and corpus["excluded_contamination"] == 1 and corpus["passages"] == len(rows)
    quarantine = pq.read_table(tmp_path / "run/prepare/_quarantine.parquet").to_pylist()
    assert [(q["file"], q["reason"]) for q in quarantine] == [("docs/e.pdf", "unreadable_pdf")]
    assert "cannot parse the PDF" in quarantine[0]["message"]
    assert not any(n.endswith(".parquet") and not n.startswith(("corpus-", "_")) for n in manifest["outputs"])


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF showing ``text`` (Helvetica), with a correct cross-reference table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def test_a_pdfs_text_becomes_passages_with_the_span_of_its_extracted_text(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/spleen.pdf").write_bytes(minimal_pdf("The spleen filters old red blood cells."))
    items = list(convert_source(source(tmp_path, chunk_tokens=32).prepare.sources[0], source(tmp_path)))
    assert [(p.id, p.text, p.source_ref) for p in items] == [
        ("docs:docs/spleen.pdf:0", "The spleen filters old red blood cells.", "docs/spleen.pdf:0-39")]


def test_the_prepare_summary_shows_a_corpus_with_the_passages_it_wrote_not_written_0(tmp_path):
    from embed_core.prepare.stage import format_counts

    write_docs(tmp_path)
    manifest = run_prepare(source(tmp_path, chunk_tokens=32), tmp_path / "run")
    passages = pq.read_metadata(tmp_path / "run/prepare/corpus-docs.parquet").num_rows
    summary = format_counts(manifest)
    (row,) = [line.split() for line in summary.splitlines() if line.startswith("docs ")]
    assert passages > 0 and row[6] == str(passages) and row[7:] == ["corpus", "passages"]
    assert f"written 0 records and {passages} corpus passages" in summary
