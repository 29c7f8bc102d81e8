"""Query generation from a corpus (strategy ``queries``): through the scripted OpenAI-compatible
server the generated queries become retrieval records of origin synthetic with their passage as
positive, a rerun makes no request, and the filters (words, duplicates, round-trip consistency)
drop what they should; personas are drawn per passage and leave the prompts of a config without
them unchanged."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embed_core.artifacts import read_records
from embed_core.config import parse_config
from embed_core.prepare.run import run_prepare
from embed_core.schema import table_to_records
from embed_core.synthesize.consistency import passage_ranks, round_trip
from embed_core.synthesize.queries import persona_for
from embed_core.synthesize.run import run_synthesize
from tests.helpers.llm_server import ScriptedLLMServer

PASSAGES = ["The heart pumps blood through the arteries of the body.",
            "Kidneys filter waste from the blood and make urine.",
            "The liver stores glycogen and releases glucose when needed.",
            "Bones store calcium and phosphate for the whole skeleton."]


def corpus_config(tmp_path, url, passages=PASSAGES, mode="chat", **queries):
    """A config of one corpus source (``passages``, one chunk each, in docs/organs.md) whose
    synthesize stage writes queries through the scripted server at ``url``; ``queries`` overrides
    the strategy's settings."""
    (tmp_path / "docs").mkdir(parents=True, exist_ok=True)
    (tmp_path / "docs/organs.md").write_text("\n\n".join(passages) + "\n")
    return parse_config({"data_root": str(tmp_path), "prepare": {"sources": [
        {"name": "organs", "kind": "corpus", "path": "docs", "params": {"chunk_tokens": 16}}]},
        "synthesize": {"server": {"base_url": url, "model": "scripted", "mode": mode, "timeout_s": 2.0,
                                  "max_retries": 1, "backoff_s": 0.01},
                       "strategies": ["queries"],
                       "queries": {"max_passages": 3, "types": ["question", "keyword"], "per_type": 2,
                                   "round_trip": None, **queries}}})


def _config(tmp_path, url, mode="chat", **queries):
    return corpus_config(tmp_path, url, PASSAGES, mode, **queries)


def test_generated_queries_are_synthetic_retrieval_records_and_a_rerun_makes_no_request(tmp_path):
    with ScriptedLLMServer() as server:
        config = _config(tmp_path, server.base_url)
        run_dir = tmp_path / "run"
        run_prepare(config, run_dir)
        corpus = pq.read_table(run_dir / "prepare/corpus-organs.parquet").to_pylist()
        assert [p["text"] for p in corpus] == PASSAGES
        m1 = run_synthesize(config, run_dir, upstream="prepare")
        assert server.total_calls == 3 * 2  # 3 sampled passages x 2 kinds, 2 queries each
        records = table_to_records(read_records(run_dir, "synthesize")["organs.parquet"])
        assert len(records) == 3 * 2 * 2
        by_ref = {p["source_ref"]: p["text"] for p in corpus}
        for rec in records:
            assert rec.origin == "synthetic" and rec.task == "retrieval" and rec.dataset == "organs"
            assert rec.positives == [by_ref[rec.source_ref]] and rec.query.split()[:3] == rec.positives[0].split()[:3]
        assert {r.id.rsplit("~", 1)[1] for r in records} == {"question0", "question1", "keyword0", "keyword1"}
        q = m1["queries"]["organs"]
        assert (q["passages"], q["passages_asked"], q["generated"], q["kept"]) == (4, 3, 12, 12)

        m2 = run_synthesize(config, run_dir, upstream="prepare")
        assert server.total_calls == 6 and m2["counts"]["client"]["cache_hits"] == 6
        again = table_to_records(read_records(run_dir, "synthesize")["organs.parquet"])
        assert [(r.id, r.query) for r in again] == [(r.id, r.query) for r in records]


def test_a_larger_passage_budget_keeps_the_smaller_ones_passages_and_asks_only_for_the_new(tmp_path):
    with ScriptedLLMServer() as server:
        run_dir = tmp_path / "run"
        small = _config(tmp_path, server.base_url, max_passages=2, types=["claim"])
        run_prepare(small, run_dir)
        run_synthesize(small, run_dir, upstream="prepare")
        first = {r.source_ref for r in table_to_records(read_records(run_dir, "synthesize")["organs.parquet"])}
        large = _config(tmp_path, server.base_url, max_passages=3, types=["claim"])
        run_synthesize(large, run_dir, upstream="prepare")
        second = {r.source_ref for r in table_to_records(read_records(run_dir, "synthesize")["organs.parquet"])}
        assert first < second and len(second) == 3 and server.total_calls == 3


def test_the_word_filter_drops_short_queries_with_their_reason(tmp_path):
    with ScriptedLLMServer() as server:
        config = _config(tmp_path, server.base_url, min_words=9, types=["title"], per_type=1)
        run_dir = tmp_path / "run"
        run_prepare(config, run_dir)
        m = run_synthesize(config, run_dir, upstream="prepare")
        # the scripted queries are the passage's first 6 words + "variant N i": 9 words pass, and so
        # all are kept; with min_words 10 every one would be dropped
        assert m["queries"]["organs"]["kept"] == 3
        config = _config(tmp_path, server.base_url, min_words=10, types=["title"], per_type=1)
        m = run_synthesize(config, run_dir, upstream="prepare")
        assert m["queries"]["organs"]["kept"] == 0 and m["queries"]["organs"]["dropped"] == {"too_few_words": 3}
        dropped = pq.read_table(run_dir / "synthesize/_filtered.parquet").to_pylist()
        assert {d["reason"] for d in dropped} == {"too_few_words"} and server.total_calls == 3


def _bag_of_words(texts: list[str]) -> np.ndarray:
    """A deterministic embedding: normalised counts of a small vocabulary."""
    vocab = ["heart", "blood", "kidneys", "urine", "liver", "glucose", "bones", "calcium"]
    vecs = np.array([[t.lower().count(w) for w in vocab] for t in texts], dtype=np.float64) + 1e-3
    return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)


def test_round_trip_keeps_a_query_that_finds_its_passage_and_drops_one_that_does_not():
    queries = ["which organ makes urine", "where is calcium stored"]
    # query 0 was generated for the kidneys passage (it finds it first); query 1 for the liver
    # passage, but it finds the bones passage: the liver ranks below top-1
    keep, ranks = round_trip(queries, [1, 2], PASSAGES, _bag_of_words, top_k=1)
    assert keep == [True, False] and ranks[0] == 1 and ranks[1] > 1
    keep, _ = round_trip(queries, [1, 2], PASSAGES, _bag_of_words, top_k=len(PASSAGES))
    assert keep == [True, True]


def test_passage_ranks_count_ties_against_the_query():
    q = np.array([[1.0, 0.0]])
    p = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert passage_ranks(q, p, [0]).tolist() == [2] and passage_ranks(q, p, [2]).tolist() == [3]


def test_round_trip_in_the_stage_reports_kept_and_dropped_queries_with_examples(tmp_path):
    from embed_core.synthesize.stage import format_counts

    with ScriptedLLMServer() as server:
        # the packaged MiniLM ranks; a query of "variant" words shared by every passage's queries
        config = _config(tmp_path, server.base_url, max_passages=4, types=["question"], per_type=1,
                         round_trip={"model": "default", "top_k": 1})
        run_dir = tmp_path / "run"
        run_prepare(config, run_dir)
        m = run_synthesize(config, run_dir, upstream="prepare")
    q = m["queries"]["organs"]
    assert q["generated"] == 4 and q["kept"] + q["dropped"].get("round_trip", 0) == 4 and q["kept"] >= 1
    kept = table_to_records(read_records(run_dir, "synthesize")["organs.parquet"])
    assert len(kept) == q["kept"] and [e["query"] for e in q["kept_examples"]] == [r.query for r in kept][:5]
    assert m["counts"]["strategies"]["queries"]["kept"] == q["kept"]
    assert f"queries for corpus organs: 4 of 4 passages asked, 4 generated, {q['kept']} kept" in format_counts(m)


def test_mining_queries_of_a_corpus_draws_negatives_from_every_passage_not_only_the_asked_ones(tmp_path, tiny_model):
    from embed_core.mine.run import input_fingerprint as mine_fingerprint
    from embed_core.mine.run import run_mine

    with ScriptedLLMServer() as server:
        raw = _config(tmp_path, server.base_url, max_passages=1, types=["question"], per_type=1).model_dump(
            mode="json", exclude_none=True)
        raw["mine"] = {"model": str(tiny_model), "max_length": 32, "range_min": 0, "range_max": 3,
                       "relative_margin": None, "num_negatives": 3}
        config = parse_config(raw)
        run_dir = tmp_path / "run"
        run_prepare(config, run_dir)
        run_synthesize(config, run_dir, upstream="prepare")
    key = mine_fingerprint(config, run_dir, upstream="synthesize").key
    manifest = run_mine(config, run_dir, upstream="synthesize")
    (record,) = table_to_records(read_records(run_dir, "mine")["organs.parquet"])
    # one passage was asked about; its query's negatives are the three others, from the corpus artifact
    assert manifest["counts"]["datasets"][0]["pool"] == "corpus"
    assert sorted(record.negatives) == sorted(set(PASSAGES) - set(record.positives))
    # a changed corpus (a passage no query was made for) changes mining's key
    (tmp_path / "docs/organs.md").write_text("\n\n".join(PASSAGES + ["Skin is the largest organ of the body."]))
    run_prepare(config, run_dir)
    assert mine_fingerprint(config, run_dir, upstream="synthesize").key != key


PERSONAS = ["a nurse checking a drug label", "a student revising for an exam"]


def test_two_personas_are_put_in_the_requests_as_drawn_by_seed_and_passage_id(tmp_path):
    with ScriptedLLMServer() as server:
        config = _config(tmp_path, server.base_url, max_passages=None, personas=PERSONAS)
        run_dir = tmp_path / "run"
        run_prepare(config, run_dir)
        run_synthesize(config, run_dir, upstream="prepare")
        corpus = pq.read_table(run_dir / "prepare/corpus-organs.parquet").to_pylist()
        expected = {p["text"]: persona_for(PERSONAS, config.seed, p["id"]) for p in corpus}
        assert set(expected.values()) == set(PERSONAS)          # both are drawn among the four passages
        assert len(server.bodies) == 4 * 2
        for body in server.bodies:                             # each request names its passage's persona only
            prompt = body["messages"][-1]["content"]
            (text,) = [t for t in PASSAGES if t in prompt]
            assert f"Here the searcher is {expected[text]};" in prompt
            assert sum(p in prompt for p in PERSONAS) == 1
        rows = pq.read_table(run_dir / "synthesize/_queries.parquet").to_pylist()
        by_id = {p["id"]: expected[p["text"]] for p in corpus}
        assert len(rows) == 16 and all(r["persona"] == by_id[r["passage_id"]] for r in rows)
    assert [persona_for(PERSONAS, config.seed, p["id"]) for p in corpus] == list(expected.values())
    assert persona_for([], config.seed, corpus[0]["id"]) is None


# The request keys of the query prompts as rendered before personas existed (a passage, k 2,
# model "m", no sampling parameters): without personas a prompt must render to the same text, so
# the request caches of earlier runs stay valid.
KEYS_BEFORE_PERSONAS = {
    ("question", "chat"): "13d87851e3e56f9a569478f49794880752b37d5e393a25e4dffaa890bfe7c6b0",
    ("question", "completion"): "7ef4b9c5e5bfa0b15a4686f329be3e918de27673660ae817a4e39cc6dbcf7021",
    ("keyword", "chat"): "aa6d86286bad63bee8b7597ab702de2de8363f39bfdcba2b72cd24e6d9f529de",
    ("keyword", "completion"): "a304db4bb8a0db1611691b8b00e7d88d13f7ad83c4c6ed8bb083e2753f6e3548",
    ("claim", "chat"): "b252eed65efd28d12efcb7580de7566210275a19297e87a858a3ae806c474d2c",
    ("claim", "completion"): "fc62a153395326a801af0e005012903aaf7e5667af5f05ec1312444a904f575c",
    ("title", "chat"): "226391f31655e8cc0d2e1e545e70ae2e2639cb0ada74b817e4fe438f4df3e466",
    ("title", "completion"): "22da8470782577cce7e5120939497ecab2934b2446ae56086652e6e117883d81",
}


def test_without_personas_the_query_prompts_render_as_before_so_cached_answers_stay_valid():
    from embed_core.synthesize.cache import request_key
    from embed_core.synthesize.config import SynthesizeConfig
    from embed_core.synthesize.prompts import load_templates
    from embed_core.synthesize.queries import plan_query_jobs

    templates = load_templates()
    corpus = pa.table({"id": ["organs/0"], "text": [PASSAGES[0]], "source_ref": ["organs.md:0-55"]})
    cfg = SynthesizeConfig(strategies=["queries"], queries={"types": ["question", "keyword", "claim", "title"],
                                                            "per_type": 2})
    jobs = plan_query_jobs(cfg, {"organs": corpus}, templates, seed=0)
    for job in jobs:
        for mode in ("chat", "completion"):
            tpl = job.template
            key = request_key(model="m", mode=mode, prompt=tpl.name, prompt_version=tpl.version,
                              rendered=tpl.render(mode, job.values), sampling={}, attempt=0)
            assert key == KEYS_BEFORE_PERSONAS[(job.values["type"], mode)], (job.values["type"], mode)
    with_persona = plan_query_jobs(cfg.model_copy(update={"queries": cfg.queries.model_copy(
        update={"personas": ["a nurse"]})}), {"organs": corpus}, templates, seed=0)
    assert all("Here the searcher is a nurse;" in str(j.template.render(m, j.values))
               for j in with_persona for m in ("chat", "completion"))


def test_personas_with_a_prompt_that_has_no_place_for_them_are_refused_with_one_line(tmp_path):
    from embed_core.errors import ConfigError
    from embed_core.synthesize.config import SynthesizeConfig
    from embed_core.synthesize.prompts import load_templates
    from embed_core.synthesize.queries import plan_query_jobs

    src = load_templates()["queries-title"].source
    (tmp_path / "title.yaml").write_text(open(src).read().replace("$persona_note", ""))
    cfg = SynthesizeConfig(strategies=["queries"], queries={"types": ["title"], "personas": ["a nurse"]})
    corpus = pa.table({"id": ["organs/0"], "text": [PASSAGES[0]], "source_ref": ["organs.md:0-55"]})
    with pytest.raises(ConfigError, match="template 'queries-title' has no \\$persona_note"):
        plan_query_jobs(cfg, {"organs": corpus}, load_templates(tmp_path), seed=0)
