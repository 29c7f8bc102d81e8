import json

import pyarrow.parquet as pq

from embed_core.config import parse_config
from embed_core.prepare.cleaning import EvalTexts, contaminated_field, dedupe, limit_length, normalize_text, pair_key
from embed_core.prepare.run import run_prepare
from embed_core.schema import Record


def rec(q, p, **kw):
    return Record(id=kw.pop("id", q), dataset="d", task=kw.pop("task", "retrieval"), query=q, positives=[p],
                  source_ref="f.csv:3", **kw)


def test_normalize():
    assert normalize_text("  Héllo,   WORLD!! ") == normalize_text("héllo world") == "héllo world"
    assert normalize_text("ﬁne") == "fine"  # NFKC


def test_dedupe_exact_then_normalized():
    records = [rec("A cat.", "B"), rec("A cat.", "B", id="2"), rec("a  CAT", "b", id="3"), rec("A dog", "B", id="4")]
    kept, n_exact, n_norm = dedupe(records, "normalized")
    assert [r.id for r in kept] == ["A cat.", "4"] and (n_exact, n_norm) == (1, 1)
    kept, n_exact, n_norm = dedupe(records, "exact")
    assert len(kept) == 3 and (n_exact, n_norm) == (1, 0)


def test_limit_length_truncates_or_quarantines():
    r = rec("q", "x" * 50)
    new, cut = limit_length(r, 10, "truncate")
    assert new.positives == ["x" * 10] and cut == 1
    try:
        limit_length(r, 10, "quarantine")
    except Exception as err:  # RowError
        assert (err.file, err.row, err.field, err.reason) == ("f.csv", 3, "positives[0]", "over_long")
    else:
        raise AssertionError("expected an over_long error")


def test_contamination_text_and_pair_level():
    evals = EvalTexts(texts={normalize_text("The test query?")})
    assert contaminated_field(rec("the TEST query", "doc"), evals) == "query"
    assert contaminated_field(rec("other", "x", negatives=["The test query"]), evals) == "negatives[0]"
    pairs = EvalTexts(pairs={pair_key("A man sings.", "A man is singing.")})
    assert contaminated_field(rec("a man is singing", "A man sings"), pairs) == "positives[0]"
    assert contaminated_field(rec("A man sings.", "A woman dances."), pairs) is None


def test_prepare_excludes_eval_texts_but_not_a_shared_beir_corpus(tmp_path):
    d = tmp_path / "beir"
    (d / "qrels").mkdir(parents=True)
    (d / "corpus.jsonl").write_text("\n".join(json.dumps({"_id": i, "title": "", "text": f"document {i}"}) for i in "abc") + "\n")
    (d / "queries.jsonl").write_text("\n".join(json.dumps({"_id": f"q{i}", "text": f"training question {i}"}) for i in range(3))
                                     + "\n" + json.dumps({"_id": "t1", "text": "held-out question"}) + "\n")
    (d / "qrels/train.tsv").write_text("query-id\tcorpus-id\tscore\nq0\ta\t1\nq1\tb\t1\nq2\tb\t1\n")
    (d / "qrels/test.tsv").write_text("query-id\tcorpus-id\tscore\nt1\ta\t1\n")
    (tmp_path / "test.csv").write_text("s1,s2,score\ntraining question 2,unrelated,1\n")
    cfg = parse_config({"data_root": str(tmp_path), "prepare": {
        "sources": [{"name": "b", "kind": "beir", "path": "beir", "params": {"split": "train"}}],
        "contamination": [{"name": "bt", "kind": "beir", "path": "beir", "params": {"split": "test"}},
                          {"name": "st", "kind": "sts", "path": "test.csv", "columns": {"text1": "s1", "text2": "s2"}}]}})
    manifest = run_prepare(cfg, tmp_path / "run")
    rows = pq.read_table(tmp_path / "run/prepare/b.parquet").to_pylist()
    # q0's positive "document a" is also judged for the test query: shared corpus, not contamination.
    assert sorted(r["query"] for r in rows) == ["training question 0", "training question 1"]
    assert manifest["counts"]["totals"]["excluded_contamination"] == 1
