"""Each converter against real rows from ../shared/data (skipped with a reason when absent)."""

import csv
import io
import json
import zipfile
from collections import Counter

import pytest

from embed_core.config import parse_config
from embed_core.errors import RowError
from embed_core.prepare.convert import Skipped, convert_source
from embed_core.schema import Record, check_table, records_to_table

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]  # real data: make test, not make test-fast


def run(shared, source: dict, seed: int = 42, root=None):
    cfg = parse_config({"data_root": str(root or shared), "seed": seed, "prepare": {"sources": [source]}})
    items = list(convert_source(cfg.prepare.sources[0], cfg))
    records = [i for i in items if isinstance(i, Record)]
    errors = [i for i in items if isinstance(i, RowError)]
    skipped = [i for i in items if isinstance(i, Skipped)]
    if records:
        check_table(records_to_table(records), file=source["path"])  # every record validates
    return records, errors, skipped


def test_stsb_scores_both_directions(shared_data):
    recs, errs, _ = run(shared_data, {"name": "stsb", "kind": "sts", "path": "stsb_en/stsb-en-train.csv",
                                      "header": False, "columns": {"text1": 0, "text2": 1, "score": 2}})
    assert not errs and len(recs) == 2 * 5749
    first, rev = recs[0], recs[1]
    assert (first.query, first.positives, first.positive_scores) == ("A plane is taking off.", ["An air plane is taking off."], [5.0])
    assert (rev.query, rev.positives) == ("An air plane is taking off.", ["A plane is taking off."])
    assert first.source_ref == "stsb_en/stsb-en-train.csv:1" and first.task == "sts"
    assert all(0 <= r.positive_scores[0] <= 5 for r in recs)


def test_sick_relatedness_and_entailment(shared_data):
    common = {"path": "sick/SICK_train.txt", "format": "tsv"}
    sts, errs, _ = run(shared_data, {"name": "sick-r", "kind": "sts", **common,
                                     "columns": {"text1": "sentence_A", "text2": "sentence_B", "score": "relatedness_score"}})
    assert not errs and len(sts) == 9000 and sts[0].positive_scores == [4.5]
    nli, errs, _ = run(shared_data, {"name": "sick-e", "kind": "entailment", **common,
                                     "columns": {"text1": "sentence_A", "text2": "sentence_B", "label": "entailment_judgment"}})
    assert not errs and len(nli) == 9000 and nli[0].task == "nli"
    assert Counter(r.positive_scores[0] for r in nli) .keys() == {0.0, 1.0, 2.0}
    assert nli[0].positive_scores == [1.0]  # row 1 is NEUTRAL


def test_scifact_beir_graded_positives(shared_data):
    recs, errs, skipped = run(shared_data, {"name": "scifact", "kind": "beir", "path": "beir/scifact", "params": {"split": "train"}})
    assert not errs and not skipped
    assert len(recs) == 809  # BEIR SciFact train: 809 queries with qrels
    assert sum(len(r.positives) for r in recs) == 919  # one positive per qrel line
    q0 = next(r for r in recs if r.id == "scifact:q0")
    assert q0.query == "0-dimensional biomaterials lack inductive properties."
    corpus = {json.loads(line)["_id"]: json.loads(line) for line in open(shared_data / "beir/scifact/corpus.jsonl")}
    doc = corpus["31715818"]
    assert q0.positives == [f"{doc['title']} {doc['text']}"] and q0.positive_scores == [1.0]


def test_msmarco_mini_graded_qrels_without_header(shared_data):
    recs, errs, skipped = run(shared_data, {"name": "ms", "kind": "beir", "path": "beir_mini_agentset/msmarco", "params": {"split": "test"}})
    assert not errs and len(recs) + len(skipped) == 43
    graded = [r for r in recs if len(set(r.positive_scores)) > 1]
    assert graded, "MS MARCO mini has graded relevance (1..3)"
    for r in graded:
        assert r.positive_scores == sorted(r.positive_scores, reverse=True)
    # this copy has no 0-judgments (1..3 only): every judged document is a positive
    assert sum(len(r.positives) for r in recs) == 4102 and not any(r.negatives for r in recs)


def test_title_body_on_scifact_corpus(shared_data):
    recs, errs, _ = run(shared_data, {"name": "scifact-tb", "kind": "title_body", "path": "beir/scifact/corpus.jsonl",
                                      "columns": {"title": "title", "body": "text"}, "max_rows": 200})
    assert not errs and len(recs) == 200
    first = json.loads(open(shared_data / "beir/scifact/corpus.jsonl").readline())
    assert recs[0].query == first["title"].strip() and recs[0].positives == [first["text"].strip()]


def test_claim_evidence_on_scifact_claims(shared_data, tmp_path):
    with zipfile.ZipFile(shared_data / "beir/scifact/original_hf_scifact/scifact.zip") as zf:
        (tmp_path / "claims_train.csv").write_bytes(zf.read("claims_train.csv"))
    (tmp_path / "corpus.jsonl").write_bytes((shared_data / "beir/scifact/corpus.jsonl").read_bytes())
    recs, errs, skipped = run(shared_data, {
        "name": "scifact-claims", "kind": "claim_evidence", "path": "claims_train.csv",
        "columns": {"claim": "claim", "evidence": "evidence_doc_id", "label": "evidence_label"},
        "params": {"corpus": "corpus.jsonl",
                   "label_map": {"SUPPORT": "positive", "CONTRADICT": "negative", "": "ignore"}}}, root=tmp_path)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "claims_train.csv").read_text())))
    assert len(skipped) == sum(1 for r in rows if not r["evidence_label"])
    supported = {r["claim"] for r in rows if r["evidence_label"] == "SUPPORT"}
    assert {r.query for r in recs} == supported
    assert all(e.reason == "no_positive" for e in errs)  # claims with only contradicting evidence
    assert any(r.negatives for r in recs) or not any(
        r["evidence_label"] == "CONTRADICT" and r["claim"] in supported for r in rows)


def test_qa_on_msmarco_mini_pairs(shared_data, tmp_path):
    d = shared_data / "beir_mini_agentset/msmarco"
    queries = {json.loads(x)["_id"]: json.loads(x)["text"] for x in open(d / "queries.jsonl")}
    corpus = {json.loads(x)["_id"]: json.loads(x)["text"] for x in open(d / "corpus.jsonl")}
    with open(tmp_path / "qa.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["question", "answer"])
        n = 0
        for line in open(d / "qrels/test.tsv"):
            qid, did, score = line.split()
            if int(score) >= 2 and qid in queries and did in corpus:
                w.writerow([queries[qid], corpus[did]])
                n += 1
    recs, errs, _ = run(shared_data, {"name": "qa", "kind": "qa", "path": "qa.csv"}, root=tmp_path)
    assert not errs and len(recs) == n > 0 and recs[0].task == "retrieval"


@pytest.mark.parametrize("name, path, fmt, cols, n_rows, n_labels", [
    ("banking77", "banking77/train.csv", None, {"text": "text", "label": "category"}, 10003, 77),
    ("emotion", "emotion/train.txt", "delimited", {"text": "text", "label": "label_name"}, 16000, 6),
    ("amazon-cf", "amazon_counterfactual/EN_train.tsv", None, {"text": "sentence", "label": "is_counterfactual"}, 4018, 2),
])
def test_classification_example_based(shared_data, name, path, fmt, cols, n_rows, n_labels):
    src = {"name": name, "kind": "classification", "path": path, "columns": cols, "params": {"num_negatives": 4}}
    if name == "banking77":
        src["multiline"] = True  # ten of its texts are quoted across lines
    if fmt:
        src.update(format=fmt, delimiter=";")
    recs, errs, _ = run(shared_data, src)
    assert not errs and len(recs) == n_rows
    assert len({r.label for r in recs}) == n_labels
    by_text = {}
    for r in recs:
        by_text.setdefault(r.query, set()).add(r.label)
    for r in recs[:500]:
        assert r.positives[0] != r.query and r.label in by_text[r.positives[0]]
        assert len(r.negatives) == 4 and r.label not in r.negative_labels
        for neg, lab in zip(r.negatives, r.negative_labels):
            assert lab in by_text[neg]
    again, _, _ = run(shared_data, src)
    assert [r.positives for r in again] == [r.positives for r in recs]  # deterministic under the seed


def test_mrpc_pair_classification(shared_data):
    recs, errs, _ = run(shared_data, {"name": "mrpc", "kind": "pair_classification", "path": "mrpc/msr-para-train.tsv",
                                      "columns": {"text1": "#1 String", "text2": "#2 String", "label": "Quality"}})
    assert not errs and len(recs) == 2 * 3576
    assert recs[0].positive_scores == [1.0] and recs[2].positive_scores == [0.0]
    assert recs[0].positives[0].startswith('Referring to him as only "the witness"')  # bare quotes kept


@pytest.mark.parametrize("path, n_neg", [
    ("flagembedding_examples/embedder/retrieval/msmarco.jsonl", 25),
    ("flagembedding_examples/embedder/retrieval/nq.jsonl", 100),
    ("flagembedding_examples/embedder/retrieval/nli.jsonl", 1),
    ("flagembedding_examples/toy_finetune_data.jsonl", 7),
    ("flagembedding_examples/embedder/clustering-no_in_batch_neg/bioRXiv_title.jsonl", 24),
])
def test_flagembedding_jsonl(shared_data, path, n_neg):
    recs, errs, _ = run(shared_data, {"name": "fe", "kind": "flagembedding", "path": path})
    assert not errs and len(recs) == 10
    first = json.loads(open(shared_data / path).readline())
    assert recs[0].query == first["query"].strip() and len(recs[0].negatives) == n_neg
    assert recs[0].instruction == first.get("prompt", "").strip()
    if "neg_scores" in first:
        assert recs[0].negative_scores == [float(s) for s in first["neg_scores"]]
    if "category" in first:
        assert recs[0].label == first["category"]
