"""Bad input: each problem names file/row/field, good rows are still written, bad rows are quarantined."""

import json

import pyarrow.parquet as pq
import pytest

from embed_core.artifacts import read_manifest, read_records
from embed_core.config import parse_config
from embed_core.errors import ConfigError, SourceError
from embed_core.prepare.run import run_prepare


def prepare(tmp_path, sources, **extra):
    cfg = parse_config({"data_root": str(tmp_path), "prepare": {"sources": sources, **extra}})
    manifest = run_prepare(cfg, tmp_path / "run")
    quarantine = pq.read_table(tmp_path / "run/prepare/_quarantine.parquet").to_pylist()
    tables = read_records(tmp_path / "run", "prepare")
    return manifest, quarantine, tables


def test_each_bad_row_is_named_and_quarantined(tmp_path):
    (tmp_path / "sts.csv").write_bytes(
        b"sentence1,sentence2,score\n"
        b"A man plays a guitar.,A man is playing guitar.,4.6\n"       # 2 good
        b"one,two,3.0,surplus\n"                                         # 3 malformed line
        b",An empty first text.,2.0\n"                                   # 4 empty text
        b"A cat sleeps.,A dog barks.,nan\n"                              # 5 NaN score
        b"Caf\xff au lait.,Coffee with milk.,4.0\n"                     # 6 non-UTF-8
        b"A woman slices an onion.,Someone cuts an onion.,4.2\n"         # 7 good
        b"A child runs.,A kid is running.,high\n")                      # 8 not a number
    (tmp_path / "nli.tsv").write_text("premise\thypothesis\tlabel\n"
                                      "A dog runs.\tAn animal moves.\tentailment\n"
                                      "A dog runs.\tA cat sleeps.\tmaybe\n")  # unknown label
    (tmp_path / "fe.jsonl").write_text(json.dumps({"query": "q1", "pos": ["p1"]}) + "\n"
                                       + json.dumps({"pos": ["p2"]}) + "\n"        # missing field
                                       + "{not json\n")
    manifest, quarantine, tables = prepare(tmp_path, [
        {"name": "sts", "kind": "sts", "path": "sts.csv"},
        {"name": "nli", "kind": "entailment", "path": "nli.tsv"},
        {"name": "fe", "kind": "flagembedding", "path": "fe.jsonl"},
    ])
    got = {(q["file"], q["row"], q["field"], q["reason"]) for q in quarantine}
    assert got == {
        ("sts.csv", 3, None, "malformed_line"),
        ("sts.csv", 4, "sentence1", "empty_text"),
        ("sts.csv", 5, "score", "nan_score"),
        ("sts.csv", 6, "sentence1", "encoding"),
        ("sts.csv", 8, "score", "bad_score"),
        ("nli.tsv", 3, "label", "unknown_label"),
        ("fe.jsonl", 2, "query", "missing_field"),
        ("fe.jsonl", 3, None, "malformed_json"),
    }
    msgs = {q["row"]: q["message"] for q in quarantine if q["file"] == "sts.csv"}
    assert "expected 3 fields, got 4" in msgs[3] and "0xff" in msgs[6]
    assert tables["sts.parquet"].num_rows == 4  # rows 2 and 7, both directions
    assert {r["source_ref"] for r in tables["sts.parquet"].to_pylist()} == {"sts.csv:2", "sts.csv:7"}
    assert tables["nli.parquet"].num_rows == 2 and tables["fe.parquet"].num_rows == 1
    assert manifest["counts"]["totals"]["quarantined"] == 8
    assert manifest["counts"]["totals"]["quarantined_by_reason"]["unknown_label"] == 1


def test_missing_column_names_file_header_row_and_column_and_keeps_previous_output(tmp_path):
    (tmp_path / "ok.csv").write_text("sentence1,sentence2,score\nA b.,C d.,1\n")
    prepare(tmp_path, [{"name": "ok", "kind": "sts", "path": "ok.csv"}])
    before = read_manifest(tmp_path / "run", "prepare")
    (tmp_path / "bad.csv").write_text("sentence1,sentence2,similarity\nA b.,C d.,1\n")
    cfg = parse_config({"data_root": str(tmp_path), "prepare": {"sources": [
        {"name": "ok", "kind": "sts", "path": "ok.csv"}, {"name": "bad", "kind": "sts", "path": "bad.csv"}]}})
    with pytest.raises(SourceError) as info:
        run_prepare(cfg, tmp_path / "run")
    assert str(info.value).startswith("bad.csv:1: field 'score': column not in header")
    assert read_manifest(tmp_path / "run", "prepare") == before  # earlier artifact untouched
    assert not list((tmp_path / "run").glob(".prepare.*"))  # no staging debris


def test_missing_file_and_bad_config_are_one_line_errors(tmp_path):
    cfg = parse_config({"data_root": str(tmp_path), "prepare": {"sources": [{"name": "x", "kind": "sts", "path": "nope.csv"}]}})
    with pytest.raises(SourceError, match="nope.csv: file not found"):
        run_prepare(cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"prepare.sources\[x\].kind"):
        parse_config({"prepare": {"sources": [{"name": "x", "kind": "stss", "path": "a.csv"}]}})
    with pytest.raises(ConfigError, match="unknown column key"):
        cfg = parse_config({"data_root": str(tmp_path), "prepare": {"sources": [
            {"name": "x", "kind": "sts", "path": "a.csv", "columns": {"txt1": "a"}}]}})
        list(__import__("embed_core.prepare.convert", fromlist=["x"]).convert_source(cfg.prepare.sources[0], cfg))


def test_beir_zero_judgments_become_negatives_and_unknown_ids_are_quarantined(tmp_path):
    d = tmp_path / "beir"
    (d / "qrels").mkdir(parents=True)
    (d / "corpus.jsonl").write_text("\n".join(json.dumps(x) for x in [
        {"_id": "d1", "title": "T1", "text": "relevant"}, {"_id": "d2", "title": "", "text": "judged irrelevant"},
        {"_id": "d3", "title": "T3", "text": "highly relevant"}]) + "\n")
    (d / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "a question"}) + "\n"
                                     + json.dumps({"_id": "q2", "text": "only irrelevant"}) + "\n")
    (d / "qrels/train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t0\nq1\td3\t2\nq1\td9\t1\nq2\td2\t0\nq7\td1\t1\n")
    manifest, quarantine, tables = prepare(tmp_path, [{"name": "b", "kind": "beir", "path": "beir"}])
    (rec,) = tables["b.parquet"].to_pylist()
    assert rec["positives"] == ["T3 highly relevant", "T1 relevant"] and rec["positive_scores"] == [2.0, 1.0]
    assert rec["negatives"] == ["judged irrelevant"] and rec["negative_scores"] == [0.0]
    assert {(q["file"], q["row"], q["field"], q["reason"]) for q in quarantine} == {
        ("beir/qrels/train.tsv", 5, "corpus-id", "unknown_doc"),
        ("beir/qrels/train.tsv", 7, "query-id", "unknown_query")}
    assert manifest["counts"]["totals"]["skipped"] == 1  # q2: no relevant document

    # HMCL levels from graded qrels: grade 1 documents become weak-positives
    _, _, tables = prepare(tmp_path, [{"name": "b", "kind": "beir", "path": "beir", "params": {"weak_positive_grades": [1]}}])
    (rec,) = tables["b.parquet"].to_pylist()
    assert rec["positives"] == ["T3 highly relevant"] and rec["positive_scores"] == [2.0]
    assert rec["weak_positives"] == ["T1 relevant"] and rec["negatives"] == ["judged irrelevant"]


def test_row_errors_survive_pickling_across_processes():
    import pickle

    from embed_core.errors import RowError

    err = SourceError("a.csv", 3, "score", "bad_score", "not a number: 'x'")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is SourceError and str(back) == str(err) == "a.csv:3: field 'score': not a number: 'x'"
    assert (back.file, back.row, back.field, back.reason) == ("a.csv", 3, "score", "bad_score")
    assert isinstance(back, RowError)
