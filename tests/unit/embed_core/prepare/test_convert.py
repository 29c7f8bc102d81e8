"""The converter registry: one file per source kind, found by discovery; each kind on a few
hand-written rows whose records are worked out by hand; the kind-only settings under ``params``."""

import json
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from embed_core import config_reference
from embed_core.config import parse_config
from embed_core.errors import ConfigError, RowError
from embed_core.prepare import convert
from embed_core.prepare.convert import CONVERTERS, Skipped, convert_source, source_files, source_texts
from embed_core.schema import Record
from tests.helpers.hostile_text import TEXTS, assert_hygienic, usable, visible


def items(tmp_path, source: dict, seed: int = 42) -> list:
    cfg = parse_config({"data_root": str(tmp_path), "seed": seed, "prepare": {"sources": [source]}})
    return list(convert_source(cfg.prepare.sources[0], cfg))


def brief(item) -> tuple:
    """A record as (id, query, positives, positive_scores, negatives, task)."""
    return item.id, item.query, item.positives, item.positive_scores, item.negatives, item.task


def test_every_kind_is_one_module_named_after_it():
    assert set(CONVERTERS) == {"beir", "claim_evidence", "classification", "corpus", "entailment", "flagembedding",
                               "pair_classification", "qa", "sts", "title_body"}
    for kind, cls in CONVERTERS.items():
        assert cls.__module__ == f"embed_core.prepare.convert.{kind}"


def test_sts_pairs_go_both_ways_unless_params_say_otherwise(tmp_path):
    (tmp_path / "s.csv").write_text("sentence1,sentence2,score\nA dog.,A hound.,4.5\n")
    got = [brief(r) for r in items(tmp_path, {"name": "s", "kind": "sts", "path": "s.csv"})]
    assert got == [("s:s.csv:2", "A dog.", ["A hound."], [4.5], [], "sts"),
                   ("s:s.csv:2~rev", "A hound.", ["A dog."], [4.5], [], "sts")]
    one_way = items(tmp_path, {"name": "s", "kind": "sts", "path": "s.csv", "params": {"both_directions": False}})
    assert [r.id for r in one_way] == ["s:s.csv:2"]


def test_sts_maps_word_labels_and_quarantines_scores_outside_the_range(tmp_path):
    (tmp_path / "s.csv").write_text("A,B,High\nC,D,low\n")
    mapped = items(tmp_path, {"name": "s", "kind": "sts", "path": "s.csv", "header": False,
                              "params": {"label_map": {"high": 5, "low": 0}, "both_directions": False}})
    assert [r.positive_scores for r in mapped] == [[5.0], [0.0]]
    (tmp_path / "n.csv").write_text("A,B,6\nC,D,2\n")
    ranged = items(tmp_path, {"name": "s", "kind": "sts", "path": "n.csv", "header": False,
                              "params": {"score_range": [0, 5], "both_directions": False}})
    assert isinstance(ranged[0], RowError) and ranged[0].reason == "score_range"
    assert ranged[1].positive_scores == [2.0]


def test_headerless_columns_are_the_declared_fields_in_order(tmp_path):
    (tmp_path / "e.tsv").write_text("A man sleeps.\tA person rests.\tENTAILMENT\n")
    (rec, _) = items(tmp_path, {"name": "e", "kind": "entailment", "path": "e.tsv", "header": False})
    assert brief(rec) == ("e:e.tsv:1", "A man sleeps.", ["A person rests."], [2.0], [], "nli")


def test_pair_classification_labels_are_scores(tmp_path):
    (tmp_path / "p.csv").write_text("sentence1,sentence2,label\nA,B,yes\nC,D,0\n")
    recs = items(tmp_path, {"name": "p", "kind": "pair_classification", "path": "p.csv",
                            "params": {"both_directions": False}})
    assert [(r.query, r.positive_scores, r.task) for r in recs] == [("A", [1.0], "pair_classification"),
                                                                    ("C", [0.0], "pair_classification")]


def test_title_body_and_qa_make_the_first_text_the_query(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"title": "Cats", "text": "Cats purr."}) + "\n")
    (tmp_path / "q.csv").write_text("question,answer\nWhy?,Because.\n")
    (tb,) = items(tmp_path, {"name": "t", "kind": "title_body", "path": "t.jsonl"})
    (qa,) = items(tmp_path, {"name": "q", "kind": "qa", "path": "q.csv"})
    assert brief(tb) == ("t:t.jsonl:1", "Cats", ["Cats purr."], [], [], "retrieval")
    assert brief(qa) == ("q:q.csv:2", "Why?", ["Because."], [], [], "retrieval")


def test_claim_evidence_merges_a_claims_rows_and_reads_ids_from_a_corpus(tmp_path):
    (tmp_path / "c.csv").write_text("claim,evidence,label\nC1,E1,SUPPORTS\nC1,E2,refutes\nC2,E3,NEI\nC3,E4,Refutes\n")
    got = items(tmp_path, {"name": "c", "kind": "claim_evidence", "path": "c.csv"})
    assert isinstance(got[0], Skipped) and got[0].row == 4
    assert brief(got[1]) == ("c:c.csv:2", "C1", ["E1"], [], ["E2"], "retrieval")
    assert isinstance(got[2], RowError) and got[2].reason == "no_positive" and len(got) == 3
    (tmp_path / "ids.csv").write_text("claim,evidence,label\nC1,7.0,positive\n")
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"_id": "7", "title": "T", "text": "body"}) + "\n")
    source = {"name": "c", "kind": "claim_evidence", "path": "ids.csv",
              "params": {"corpus": "corpus.jsonl", "label_map": {"positive": "positive"}}}
    (rec,) = items(tmp_path, source)
    assert rec.positives == ["T body"]
    cfg = parse_config({"data_root": str(tmp_path), "prepare": {"sources": [source]}})
    assert [name for name, _ in source_files(cfg.prepare.sources[0], cfg)] == ["ids.csv", "corpus.jsonl"]


def test_classification_draws_a_same_label_positive_and_other_label_negatives(tmp_path):
    (tmp_path / "c.csv").write_text("text,label\na1,A\na2,A\nb1,B\nb2,B\nc1,C\n")
    got = items(tmp_path, {"name": "c", "kind": "classification", "path": "c.csv",
                           "params": {"num_negatives": 2}})
    recs = [r for r in got if isinstance(r, Record)]
    (single,) = [e for e in got if isinstance(e, RowError)]
    assert single.reason == "singleton_label" and single.row == 6  # c1: no other text labelled C
    texts = {"a1": "A", "a2": "A", "b1": "B", "b2": "B", "c1": "C"}
    assert [(r.query, r.positives) for r in recs] == [("a1", ["a2"]), ("a2", ["a1"]), ("b1", ["b2"]), ("b2", ["b1"])]
    for r in recs:
        assert r.label == texts[r.query] and len(r.negatives) == 2
        assert [texts[n] for n in r.negatives] == r.negative_labels and r.label not in r.negative_labels
    again = items(tmp_path, {"name": "c", "kind": "classification", "path": "c.csv", "params": {"num_negatives": 2}})
    assert [r.negatives for r in again if isinstance(r, Record)] == [r.negatives for r in recs]  # seeded


def test_flagembedding_keeps_lists_scores_prompt_and_category(tmp_path):
    row = {"query": "q", "pos": ["p"], "neg": ["n1", "n2"], "neg_scores": [0.2, 0.1], "prompt": "Find it.",
           "category": "web"}
    (tmp_path / "f.jsonl").write_text(json.dumps(row) + "\n")
    (rec,) = items(tmp_path, {"name": "f", "kind": "flagembedding", "path": "f.jsonl"})
    assert brief(rec) == ("f:f.jsonl:1", "q", ["p"], [], ["n1", "n2"], "retrieval")
    assert (rec.negative_scores, rec.instruction, rec.label) == ([0.2, 0.1], "Find it.", "web")


def test_beir_grades_become_positives_weak_positives_and_negatives(tmp_path):
    d = tmp_path / "b"
    (d / "qrels").mkdir(parents=True)
    (d / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": "", "text": f"doc {i}"}) + "\n"
                                            for i in ("d1", "d2", "d3")))
    (d / "queries.jsonl").write_text(json.dumps({"_id": "1", "text": "a query"}) + "\n")
    (d / "qrels/test.tsv").write_text("query-id\tcorpus-id\tscore\n1\td1\t2\n1\td2\t1\n1\td3\t0\n")
    source = {"name": "b", "kind": "beir", "path": "b", "params": {"split": "test", "weak_positive_grades": [1]}}
    (rec,) = items(tmp_path, source)
    assert brief(rec) == ("b:q1", "a query", ["doc d1"], [2.0], ["doc d3"], "retrieval")
    assert rec.weak_positives == ["doc d2"] and rec.source_ref == "b/queries.jsonl:1"
    cfg = parse_config({"data_root": str(tmp_path), "prepare": {"sources": [source]}})
    assert list(source_texts(cfg.prepare.sources[0], cfg)) == ["a query"]


@pytest.mark.parametrize("key, value, kind, message", [
    ("corpus", "c.jsonl", "claim_evidence",
     "prepare.sources[s]: 'corpus' is a parameter of the claim_evidence converter: write params: {corpus: \"c.jsonl\"}"),
    ("split", "test", "beir", "prepare.sources[s]: 'split' is a parameter of the beir converter: write params: "
     "{split: \"test\"}"),
    ("num_negatives", 2, "classification", "write params: {num_negatives: 2}"),
    ("label_map", {"x": 1}, "title_body", "'label_map' is a parameter of the claim_evidence, classification, "
     "entailment, pair_classification, sts converters, not of title_body (title_body parameters: none)"),
])
def test_a_kind_parameter_at_the_top_level_says_what_to_write_instead(key, value, kind, message):
    with pytest.raises(ConfigError) as info:
        parse_config({"prepare": {"sources": [{"name": "s", "kind": kind, "path": "x", key: value}]}})
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("source, message", [
    ({"kind": "stss"}, "prepare.sources[s].kind: unknown source kind 'stss'; expected one of beir, claim_evidence"),
    ({"kind": "sts", "params": {"split": "x"}}, "prepare.sources[s].params: split: Extra inputs are not permitted "
     "(sts parameters: "),
    ({"kind": "classification", "params": {"num_negatives": -1}}, "prepare.sources[s].params: num_negatives: "),
    ({"kind": "sts", "params": {"score_range": [5, 0]}}, "min < max"),
    ({"kind": "claim_evidence", "params": {"label_map": {"S": "yes"}}}, "prepare.sources[s].params: label_map.S: "),
    ({"kind": "qa", "match": "pair"}, "match 'pair' needs a kind of pairs (entailment, pair_classification, sts)"),
    ({"kind": "beir", "dev_path": "d"}, "beir sources set aside dev records with dev_fraction"),
    ({"kind": "beir", "columns": {"text": "t"}}, "unknown column key(s) ['text'] for kind 'beir'"),
])
def test_a_bad_kind_or_kind_setting_is_a_config_error_naming_the_source(source, message):
    with pytest.raises(ConfigError) as info:
        parse_config({"prepare": {"sources": [{"name": "s", "path": "x", **source}]}})
    assert message in str(info.value)


KIND_MODULE = textwrap.dedent('''
    """Upper-cased lines: each line's text is the query, its upper-case copy (and a suffix) the positive."""

    from pydantic import Field

    from embed_core.prepare.convert.base import Converter, ConverterParams


    class UpperLines(Converter):
        kind = "upper_lines"
        columns = {"text": "text"}
        text_fields = ("text",)

        class Params(ConverterParams):
            suffix: str = Field("!", description="Appended to the positive.")

        def convert_row(self, raw):
            text = self.text(raw, "text")
            return [self.row_record(raw, query=text, positives=[text.upper() + self.params.suffix])]
''')


@pytest.fixture
def upper_lines_kind(tmp_path, monkeypatch):
    """A source kind added the way every kind is: one module on the converter package's path."""
    modules = tmp_path / "more_converters"
    modules.mkdir()
    (modules / "upper_lines.py").write_text(KIND_MODULE)
    monkeypatch.setattr(convert, "__path__", [*convert.__path__, str(modules)])
    convert.discover()
    yield
    monkeypatch.undo()
    sys.modules.pop("embed_core.prepare.convert.upper_lines", None)
    convert.discover()
    assert "upper_lines" not in CONVERTERS


def test_a_kind_added_as_one_module_loads_prepares_and_is_documented(tmp_path, upper_lines_kind):
    from embed_core.artifacts import read_records
    from embed_core.prepare.run import run_prepare

    (tmp_path / "l.csv").write_text("text\nhello\nworld\n")
    cfg = parse_config({"data_root": str(tmp_path), "prepare": {"sources": [
        {"name": "lines", "kind": "upper_lines", "path": "l.csv", "params": {"suffix": "?"}}]}})
    manifest = run_prepare(cfg, tmp_path / "run")
    rows = read_records(tmp_path / "run", "prepare")["lines.parquet"].to_pylist()
    assert [(r["id"], r["query"], r["positives"], r["task"]) for r in rows] == [
        ("lines:l.csv:2", "hello", ["HELLO?"], "retrieval"), ("lines:l.csv:3", "world", ["WORLD?"], "retrieval")]
    assert manifest["counts"]["sources"][0]["kind"] == "upper_lines"
    assert "### `upper_lines`" in config_reference.render() and "| `suffix` | str |" in config_reference.render()
    with pytest.raises(ConfigError, match="params: suffix: Input should be a valid string"):
        parse_config({"prepare": {"sources": [{"name": "l", "kind": "upper_lines", "path": "l.csv",
                                               "params": {"suffix": 3}}]}})


# -- text hygiene through every kind (property-based) -------------------------------------------------

# Per kind: the logical fields that hold a text, and fixed good values for the others.
TEXT_FIELDS = {"sts": ("text1", "text2"), "entailment": ("text1", "text2"), "pair_classification": ("text1", "text2"),
               "qa": ("question", "answer"), "title_body": ("title", "body"), "classification": ("text",),
               "claim_evidence": ("claim", "evidence"), "flagembedding": ("query", "pos", "neg")}
FIXED = {"sts": {"score": 3}, "entailment": {"label": "entailment"}, "pair_classification": {"label": "1"},
         "claim_evidence": {"label": "SUPPORT"}}
LIST_FIELDS = {"pos", "neg"}


def good(text: str) -> bool:
    return usable(text) and bool(visible(text).strip())


def record_texts(rec: Record) -> list[str]:
    return [*rec.texts(), rec.instruction, rec.label or "", *rec.negative_labels]


@pytest.mark.parametrize("kind", sorted(TEXT_FIELDS))
@given(rows=st.lists(st.lists(TEXTS, min_size=3, max_size=3), min_size=1, max_size=4))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_kind_makes_hygienic_records_and_keeps_every_good_row(tmp_path, kind, rows):
    columns = CONVERTERS[kind].columns
    lines = []
    for i, texts in enumerate(rows):
        row = {columns[f]: ([t] if f in LIST_FIELDS else t) for f, t in zip(TEXT_FIELDS[kind], texts)}
        row.update({columns[f]: v for f, v in FIXED.get(kind, {}).items()})
        if kind == "classification":
            row[columns["label"]] = "ab"[i % 2]
        lines.append(row)
    if kind == "classification":  # other texts of each label, for positives and negatives
        lines += [{"text": f"padding {n} {label}", "label": label} for label in "ab" for n in range(2)]
    (tmp_path / "h.jsonl").write_bytes("\n".join(json.dumps(r) for r in lines).encode("utf-8", "surrogatepass"))
    got = items(tmp_path, {"name": "h", "kind": kind, "path": "h.jsonl"})
    records = [r for r in got if isinstance(r, Record)]
    for rec in records:
        for text in record_texts(rec):
            assert_hygienic(text)
    queries = {visible(r.query).strip() for r in records}  # converters strip their texts
    errors = {e.row for e in got if isinstance(e, RowError)}
    for i, texts in enumerate(rows, start=1):
        fields = texts[:len(TEXT_FIELDS[kind])]
        if all(good(t) for t in fields):
            assert visible(fields[0]).strip() in queries, (i, fields, got)
        else:
            assert i in errors, (i, fields, got)


@given(query=TEXTS, title=TEXTS, doc=TEXTS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_beir_directory_with_hostile_texts_makes_hygienic_records(tmp_path, query, title, doc):
    (tmp_path / "b/qrels").mkdir(parents=True, exist_ok=True)
    (tmp_path / "b/queries.jsonl").write_bytes(json.dumps({"_id": "q1", "text": query}).encode())
    (tmp_path / "b/corpus.jsonl").write_bytes(
        (json.dumps({"_id": "d1", "title": title, "text": doc}) + "\n"
         + json.dumps({"_id": "d2", "title": "", "text": "plain"})).encode())
    (tmp_path / "b/qrels/train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t1\n")
    got = items(tmp_path, {"name": "b", "kind": "beir", "path": "b"})
    records = [r for r in got if isinstance(r, Record)]
    for rec in records:
        for text in record_texts(rec):
            assert_hygienic(text)
    if good(query):
        (rec,) = records
        assert visible(rec.query).strip() == visible(query).strip()  # a lost character (U+FFFD) may end the text
        assert len(rec.positives) == (2 if usable(title) and usable(doc) and good(title + doc) else 1)
    else:
        assert not records


def test_a_beir_directory_is_read_with_its_sources_limits(tmp_path):
    d = tmp_path / "b"
    (d / "qrels").mkdir(parents=True)
    (d / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "text": "doc"}) + "\n"
                                    + json.dumps({"_id": "d2", "text": "x" * 5000}) + "\n")
    (d / "queries.jsonl").write_text(json.dumps({"_id": "1", "text": "a query"}) + "\n")
    (d / "qrels/train.tsv").write_text("query-id\tcorpus-id\tscore\n1\td1\t1\n")
    got = items(tmp_path, {"name": "b", "kind": "beir", "path": "b", "limits": {"max_line_bytes": 1024}})
    assert [(e.file, e.row, e.reason) for e in got if isinstance(e, RowError)] == [
        ("b/corpus.jsonl", 2, "line_too_long")]
    assert [r.positives for r in got if isinstance(r, Record)] == [["doc"]]
