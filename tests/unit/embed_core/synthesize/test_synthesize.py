"""Synthesize stage: prompts and parsing, task rules, filters, and the stage against real local
HTTP servers — a scripted OpenAI-compatible server for faults (429, 5xx, timeouts, malformed
bodies and answers), and the real llama.cpp server on the packaged Gemma-3-270M."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from embed_core.stages import records_upstream
from embed_core.artifacts import read_records
from embed_core.config import parse_config
from embed_core.errors import EmbedpipeError
from embed_core.synthesize.config import SynthesizeConfig
from embed_core.prepare.cleaning import EvalTexts, normalize_text
from embed_core.prepare.run import run_prepare
from embed_core.schema import Record, table_to_records
from embed_core.synthesize.prompts import MalformedAnswer, load_templates
from embed_core.synthesize.filters import filter_candidates, to_candidate
from embed_core.synthesize.jobs import Job, Outcome, plan_jobs
from embed_core.synthesize.run import run_synthesize
from tests.helpers.llm_server import ScriptedLLMServer, needs_llama

MALFORMED_ROW = "A MALFORMED sentence about a cat on a mat.,A cat sits on a mat.,4.0\n"


def _config(demo_copy: Path, tmp_path: Path, synth: dict, names=("scifact", "stsb", "banking77")):
    raw = yaml.safe_load(demo_copy.read_text())
    raw["prepare"]["sources"] = [s for s in raw["prepare"]["sources"] if s["name"] in names]
    raw["synthesize"] = synth
    return parse_config(raw), tmp_path / "runs" / "synth"


def _prepared(demo_copy, tmp_path, synth, **kw):
    config, run_dir = _config(demo_copy, tmp_path, synth, **kw)
    run_prepare(config, run_dir)
    return config, run_dir


def _rows(run_dir: Path) -> dict[str, list[Record]]:
    return {n.removesuffix(".parquet"): table_to_records(t) for n, t in read_records(run_dir, "synthesize").items()}


# ---------------------------------------------------------------- prompts and parsing

def test_templates_render_and_parse():
    t = load_templates()
    assert set(t) == {"paraphrase-retrieval", "paraphrase-sentence", "augmentation-retrieval", "hard_negative-retrieval",
                      "queries-question", "queries-keyword", "queries-claim", "queries-title", "judge-relevance"}
    para = t["paraphrase-retrieval"]
    prompt = para.render("completion", {"query": "line one\nline two", "positive": "p" * 5000})
    assert prompt.endswith('Output: {"query": "')            # the reply continues the JSON
    assert "Query: line one line two\n" in prompt              # one line per field in few-shot mode
    assert "p" * para.max_input_chars in prompt and "p" * (para.max_input_chars + 1) not in prompt
    ans = para.parse("completion", 'A rewritten query", "positive": "A rewritten  passage."}  trailing')
    assert (ans.query, ans.positive) == ("A rewritten query", "A rewritten passage.")
    chat = para.render("chat", {"query": "q", "positive": "p"})
    assert [m["role"] for m in chat] == ["system", "user"] and "Query: q" in chat[1]["content"]
    fenced = '```json\n{"query": "q2", "positive": "p2"}\n```'
    assert para.parse("chat", fenced).positive == "p2"
    for bad, why in [("no json here", "no JSON"), ('{"query": "q"', "invalid JSON"), ('{"query": "q"}', "positive"),
                     ('{"query": "  ", "positive": "p"}', "empty"), ('["q", "p"]', "no JSON object")]:
        with pytest.raises(MalformedAnswer, match=why):
            para.parse("chat", bad)


def test_prompt_dir_overrides_a_template(tmp_path):
    src = load_templates()["paraphrase-sentence"].source
    text = Path(src).read_text().replace("version: 1", "version: 2-local")
    (tmp_path / "mine.yaml").write_text(text)
    t = load_templates(tmp_path)
    assert t["paraphrase-sentence"].version == "2-local" and t["paraphrase-retrieval"].version == "1"


# ---------------------------------------------------------------- task rules and filters

def _rec(i, task, **kw):
    base = dict(id=f"d/{i}", dataset="d", task=task, query=f"query {i}", positives=[f"positive {i}"],
                source_ref=f"f.csv:{i}")
    return Record(**{**base, **kw})


def test_task_rules():
    t = load_templates()
    cfg = SynthesizeConfig(hard_negative_fraction=0.5)
    retrieval = [_rec(i, "retrieval") for i in range(200)]
    jobs = plan_jobs(cfg, "d", retrieval, t, seed=1)
    by = {s: [j for j in jobs if j.strategy == s] for s in ("paraphrase", "augmentation", "hard_negative")}
    assert len(by["paraphrase"]) == len(by["augmentation"]) == 200
    assert 70 < len(by["hard_negative"]) < 130                 # about half, drawn per record id
    assert [j.record.id for j in plan_jobs(cfg, "d", retrieval, t, seed=1) if j.strategy == "hard_negative"] == \
        [j.record.id for j in by["hard_negative"]]             # deterministic
    for task in ("nli", "sts", "classification", "pair_classification"):
        js = plan_jobs(cfg, "d", [_rec(0, task, positive_scores=[1.0], label="x")], t, seed=1)
        assert [(j.strategy, j.template.name) for j in js] == [("paraphrase", "paraphrase-sentence")]
    assert plan_jobs(cfg, "d", [_rec(0, "clustering")], t, seed=1) == []
    # synthetic records are never synthesized from again, and the slice bounds the run
    mixed = [_rec(0, "retrieval", origin="paraphrase"), *retrieval]
    capped = plan_jobs(SynthesizeConfig(max_records_per_dataset=3, strategies=["paraphrase"]), "d", mixed, t, seed=1)
    assert [j.record.id for j in capped] == ["d/0", "d/1", "d/2"] and capped[0].record.origin == "original"


class _Answer:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_filters_with_hand_made_similarities():
    t = load_templates()
    src = _rec(0, "retrieval", query="what is a cat", positives=["A cat is a small mammal."])
    vec = {"what is a cat": [1, 0, 0], "A cat is a small mammal.": [0.8, 0.6, 0],
           "what's a cat": [0.95, 0.312, 0], "Cats are small mammals.": [0.8, 0.6, 0],
           "far away text": [0, 0, 1], "Cats are little mammals.": [0.8, 0.6, 0], "A dog is a loyal animal.": [0.6, 0.8, 0], "Cats purr and are mammals.": [0.9, 0.436, 0]}
    embed = lambda texts: np.array([np.array(vec[x], dtype=float) / np.linalg.norm(vec[x]) for x in texts])

    def cand(strategy, **answer):
        name = {"hard_negative": "hard_negative-retrieval", "augmentation": "augmentation-retrieval"}.get(strategy, "paraphrase-retrieval")
        return to_candidate(Outcome(Job(strategy, "d", src, t[name], {}), answer=_Answer(**answer)))

    cands = [cand("paraphrase", query="what's a cat", positive="Cats are small mammals."),      # kept
             cand("paraphrase", query="what is a cat", positive="Cats are small mammals."),     # copy
             cand("paraphrase", query="far away text", positive="Cats are little mammals."),    # drifted
             cand("augmentation", query="tiny", positive="Cats are small mammals."),            # too short
             cand("hard_negative", negative="A dog is a loyal animal."),                        # 0.6 < 0.8: kept
             cand("hard_negative", negative="Cats purr and are mammals."),                      # 0.9 >= 0.8
             cand("hard_negative", negative="far away text"),                                   # below floor
             cand("augmentation", query="what's a cat", positive="An unrelated line here."),   # duplicate (kept above)
             cand("hard_negative", negative="Giant tortoises live on the Galapagos Islands and can weigh more "
                                            "than 400 kilograms.")]                        # the prompt's example
    vec["An unrelated line here."] = [0, 0, 1]
    vec["Giant tortoises live on the Galapagos Islands and can weigh more than 400 kilograms."] = [0.6, 0.8, 0]
    kept, filtered = filter_candidates(SynthesizeConfig(), cands, {"d": set()}, EvalTexts(), embed)
    assert [(c.outcome.job.strategy, c.record.origin) for c in kept] == [("paraphrase", "paraphrase"),
                                                                       ("hard_negative", "llm_negative")]
    assert [r["reason"] for r in filtered] == ["too_short", "copy_of_source", "rewrite_drifted",
                                               "negative_not_below_positive", "negative_below_floor", "duplicate",
                                               "copied_from_prompt"]
    para, neg = kept[0].record, kept[1].record
    assert para.id == "d/0~para" and para.source_ref == "f.csv:0" and para.positives == ["Cats are small mammals."]
    assert neg.id == "d/0" and neg.negatives[0] == "A dog is a loyal animal."
    # contamination: a generated text that is in an evaluation set is dropped
    evals = EvalTexts(texts={normalize_text("Cats are small mammals.")})
    _, filtered = filter_candidates(SynthesizeConfig(), [cand("paraphrase", query="what's a cat",
                                                             positive="Cats are small mammals.")], {"d": set()}, evals, embed)
    assert filtered[0]["reason"] == "contaminated:positives[0]"


# ---------------------------------------------------------------- the stage against real servers

def _server_cfg(url, **kw):
    return {"server": {"base_url": url, "model": "scripted", "mode": "completion", "timeout_s": 1.0, "max_retries": 4,
                       "backoff_s": 0.01, "max_backoff_s": 0.05, "max_concurrency": 2, **kw.pop("server", {})},
            "datasets": ["scifact", "stsb", "banking77"], "max_records_per_dataset": 3, "hard_negative_fraction": 1.0,
            "filter": {"paraphrase_min_sim": 0.3, "pair_min_sim": 0.1, "negative_min_sim": -1.0}, **kw}


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
def test_faults_are_retried_failures_recorded_and_reruns_make_no_calls(demo_copy, tmp_path):
    train = demo_copy.parent / "data" / "stsb" / "train.csv"
    train.write_text(MALFORMED_ROW + train.read_text())
    faults = ["429", "500", "timeout", "bad_json", "503", "429"]
    with ScriptedLLMServer(faults=faults, timeout_sleep=2.5) as server:
        config, run_dir = _prepared(demo_copy, tmp_path, _server_cfg(server.base_url))
        m1 = run_synthesize(config, run_dir, upstream=records_upstream(config, "synthesize"))
        calls_first = server.total_calls
        client = m1["counts"]["client"]
        assert {"http_429": 2, "http_500": 1, "timeout": 1, "bad_response": 1, "http_503": 1} == client["errors"]
        assert client["retries"] == 6 and client["requests"] == calls_first

        # jobs: scifact 3 records x (paraphrase, augmentation, hard_negative) + 3 stsb + 3 banking77 paraphrases
        strategies = m1["counts"]["strategies"]
        assert sum(s["requested"] for s in strategies.values()) == 15
        failures = pq.read_table(run_dir / "synthesize" / "_failures.parquet").to_pylist()
        assert [(f["reason"], f["attempts"]) for f in failures] == [("malformed", 3)]  # 1 + max_parse_retries
        assert "without JSON" in failures[0]["raw"] and failures[0]["source_id"].startswith("stsb:")
        assert sum(s.get("answered", 0) for s in strategies.values()) == 14            # no completed item lost

        rows = _rows(run_dir)
        prepared = {n.removesuffix(".parquet"): table_to_records(t) for n, t in read_records(run_dir, "prepare").items()}
        refs = {r.id: r.source_ref for recs in prepared.values() for r in recs}
        synthetic = [r for recs in rows.values() for r in recs if r.origin != "original"]
        assert len(synthetic) == m1["counts"]["kept"] > 0
        for r in synthetic:
            assert r.origin in ("paraphrase", "augmentation", "llm_negative")
            assert r.source_ref == refs[r.id.split("~")[0]]
        negs = [r for r in rows["scifact"] if r.origin == "llm_negative"]
        assert negs and all(r.negatives[0].startswith("A study of") for r in negs)
        assert {r.label for r in rows["banking77"] if r.origin == "paraphrase"} <= {r.label for r in prepared["banking77"]}
        assert len(rows["scifact"]) == len(prepared["scifact"]) + sum(
            1 for r in rows["scifact"] if r.origin in ("paraphrase", "augmentation"))

        # unchanged rerun (the stage recomputed from scratch): every answer from the cache, zero calls
        m2 = run_synthesize(config, run_dir, upstream=records_upstream(config, "synthesize"))
        assert server.total_calls == calls_first
        assert m2["counts"]["client"]["requests"] == 0
        assert m2["counts"]["client"]["cache_hits"] == m1["counts"]["client"]["cache_size"]
        assert _rows(run_dir) == rows


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
def test_two_endpoints_share_the_requests_and_one_dying_mid_run_loses_and_repeats_nothing(demo_copy, tmp_path):
    with ScriptedLLMServer() as steady, ScriptedLLMServer(die_after=3) as dying:
        cfg = _server_cfg(None, server={"base_urls": [dying.base_url, steady.base_url], "endpoint_cooldown_s": 60})
        config, run_dir = _prepared(demo_copy, tmp_path, cfg)
        m1 = run_synthesize(config, run_dir, upstream=records_upstream(config, "synthesize"))
        client = m1["counts"]["client"]
        strategies = m1["counts"]["strategies"]
        requested = sum(s["requested"] for s in strategies.values())
        assert requested == 15 and sum(s.get("answered", 0) for s in strategies.values()) == 15  # nothing lost
        assert dying.dead and len(dying.answered) == 3  # it took its share, then died
        answered = [json.dumps(b, sort_keys=True) for b in dying.answered + steady.answered]
        assert len(answered) == len(set(answered)) == 15  # every request answered exactly once
        assert client["errors"].get("connection", 0) >= 1
        assert client["endpoints"] == {dying.base_url: {"answered": 3, "failed": client["endpoints"][dying.base_url]["failed"]},
                                       steady.base_url: {"answered": 12, "failed": 0}}
        assert client["endpoints"][dying.base_url]["failed"] >= 1
        # run again (the dead endpoint still listed): the request cache answers everything
        calls = steady.total_calls
        m2 = run_synthesize(config, run_dir, upstream=records_upstream(config, "synthesize"))
        assert steady.total_calls == calls and m2["counts"]["client"]["requests"] == 0


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_down_fails_the_stage_and_commits_nothing(demo_copy, tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    config, run_dir = _prepared(demo_copy, tmp_path, _server_cfg(url, server={"max_retries": 0}))
    with pytest.raises(EmbedpipeError) as failure:
        run_synthesize(config, run_dir, upstream=records_upstream(config, "synthesize"))
    message = str(failure.value)
    assert message.startswith("synthesize: 15 of 15 requests to " + url + " got no answer (first: connection: ")
    assert "synthesize.max_failed_share 0.5" in message and "\n" not in message
    assert not (run_dir / "synthesize").exists()


@pytest.mark.slow  # commits a stage: loads the filter model
def test_failures_within_max_failed_share_commit_and_beyond_it_fail(demo_copy, tmp_path):
    # 5 of the 15 requests get a 500 (no retries): a third fails
    with ScriptedLLMServer(faults=["500"] * 5) as server:
        config, run_dir = _prepared(demo_copy, tmp_path, _server_cfg(server.base_url, server={"max_retries": 0},
                                                                      max_failed_share=0.2))
        with pytest.raises(EmbedpipeError, match=r"^synthesize: 5 of 15 requests to .* \(first: http_500: "):
            run_synthesize(config, run_dir, upstream=records_upstream(config, "synthesize"))
        assert not (run_dir / "synthesize").exists() and server.total_calls == 15
    # the same outage within the share commits, with the failures recorded (the 10 answers come from the cache)
    with ScriptedLLMServer(faults=["500"] * 5) as server:
        lenient = config.model_copy(update={"synthesize": config.synthesize.model_copy(update={"max_failed_share": 0.5})})
        manifest = run_synthesize(lenient, run_dir, upstream=records_upstream(lenient, "synthesize"))
    assert manifest["counts"]["client"]["cache_hits"] == 10 and manifest["counts"]["failed"] == 5


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
def test_budget_stops_cleanly_and_a_bigger_budget_resumes_from_the_cache(demo_copy, tmp_path):
    with ScriptedLLMServer() as server:
        config, run_dir = _prepared(demo_copy, tmp_path, _server_cfg(server.base_url, max_requests=5))
        m1 = run_synthesize(config, run_dir, upstream=records_upstream(config, "synthesize"))
        assert server.total_calls == 5 and m1["counts"]["client"]["budget_exhausted"]
        budget_failures = sum(v for s in m1["counts"]["strategies"].values() for k, v in s.items() if k == "failed:budget")
        assert budget_failures == 15 - 5
        config2 = config.model_copy(update={"synthesize": config.synthesize.model_copy(update={"max_requests": None})})
        m2 = run_synthesize(config2, run_dir, upstream=records_upstream(config2, "synthesize"))
        assert m2["counts"]["client"]["cache_hits"] == 5
        assert server.total_calls == 15                         # only the 10 missing requests were made
        assert m2["counts"]["failed"] == 0


@pytest.mark.slow
def test_runs_that_share_a_request_cache_ask_the_server_once_and_keep_their_keys(demo_copy, tmp_path):
    from embed_core.synthesize.run import input_fingerprint

    shared = tmp_path / "shared" / "llm.sqlite"
    with ScriptedLLMServer() as server:
        config, first = _prepared(demo_copy, tmp_path, _server_cfg(server.base_url, request_cache=str(shared)))
        upstream = records_upstream(config, "synthesize")
        m1 = run_synthesize(config, first, upstream=upstream)
        calls = server.total_calls
        assert calls == m1["counts"]["client"]["requests"] == 15 and shared.is_file()
        assert not (first / "cache" / "llm.sqlite").exists()  # the answers went to the shared file only
        second = tmp_path / "runs" / "another"
        run_prepare(config, second)
        m2 = run_synthesize(config, second, upstream=upstream)
        assert server.total_calls == calls and m2["counts"]["client"]["cache_hits"] == 15  # nothing asked again
    assert _rows(second) == _rows(first)
    # where the answers are cached is not part of the stage's key
    alone = config.model_copy(update={"synthesize": config.synthesize.model_copy(update={"request_cache": None})})
    assert input_fingerprint(alone, second, upstream=upstream).key == input_fingerprint(config, second, upstream=upstream).key


@pytest.mark.slow
def test_api_key_reaches_the_server_and_no_file_or_log(demo_copy, tmp_path, prefect_harness, capfd, caplog,
                                                       monkeypatch):
    from flows.stage import synthesize_flow

    secret = "sk-embedpipe-test-4f1c2b9e77d0"
    monkeypatch.setenv("EMBEDPIPE_TEST_LLM_KEY", secret)
    with ScriptedLLMServer(faults=["500"]) as server:
        synth = _server_cfg(server.base_url, server={"mode": "chat", "api_key_env": "EMBEDPIPE_TEST_LLM_KEY"})
        config, run_dir = _prepared(demo_copy, tmp_path, synth)
        res = synthesize_flow(config_path=None, config=config.model_dump(mode="json"), run_dir=str(run_dir))["synthesize"]
        assert f"Bearer {secret}" in server.keys_seen
        calls = server.total_calls
        again = synthesize_flow(config_path=None, config=config.model_dump(mode="json"),
                                run_dir=str(run_dir))["synthesize"]  # same inputs: a cache hit
        assert again["cached"] and not res["cached"] and server.total_calls == calls
    assert res["manifest"]["counts"]["kept"] > 0 and res["manifest"]["llm"]["api_key_env"] == "EMBEDPIPE_TEST_LLM_KEY"
    out, err = capfd.readouterr()
    assert secret not in out + err + caplog.text
    scanned = 0
    for root in (run_dir, Path(os.environ["PREFECT_HOME"])):
        for path in root.rglob("*"):
            if path.is_file():
                scanned += 1
                assert secret.encode() not in path.read_bytes(), path
    assert scanned > 5


@pytest.mark.llama_server
@needs_llama
def test_real_llama_cpp_server_paraphrase_and_hard_negatives(demo_copy, tmp_path):
    # 2 SciFact records (paraphrase + hard negative each) and 2 STS-B sentences (paraphrase): 6 requests
    # one thread: llama.cpp's threads spin at barriers, and a busy CI machine would stall them
    synth = {"server": {"launch": "llama_cpp", "mode": "completion", "n_ctx": 2048, "max_concurrency": 1,
                        "n_threads": 1},
             "sampling": {"temperature": 0.7, "max_tokens": 160, "seed": 7},
             "strategies": ["paraphrase", "hard_negative"], "datasets": ["scifact", "stsb"],
             "max_records_per_dataset": 2, "hard_negative_fraction": 1.0, "max_parse_retries": 1}
    config, run_dir = _prepared(demo_copy, tmp_path, synth, names=("scifact", "stsb"))
    manifest = run_synthesize(config, run_dir, upstream=records_upstream(config, "synthesize"))
    client = manifest["counts"]["client"]
    assert manifest["counts"]["client"]["server"]["launched"]
    assert client["requests"] >= 6 and client["completion_tokens"] > 0
    strategies = manifest["counts"]["strategies"]
    assert strategies["paraphrase"]["requested"] == 4 and strategies["hard_negative"]["requested"] == 2
    rows = _rows(run_dir)                                    # read back through the schema validator
    prepared = {r.id: r for t in read_records(run_dir, "prepare").values() for r in table_to_records(t)}
    synthetic = [r for recs in rows.values() for r in recs if r.origin != "original"]
    assert synthetic, f"nothing kept: {json.dumps(strategies)}"
    for r in synthetic:
        src = prepared[r.id.split("~")[0]]
        assert r.source_ref == src.source_ref and r.origin in ("paraphrase", "llm_negative")
        if r.origin == "paraphrase":
            assert r.query != src.query
        else:
            assert r.negatives[0] not in src.negatives and r.query == src.query
    filtered = pq.read_table(run_dir / "synthesize" / "_filtered.parquet").to_pylist()
    failures = pq.read_table(run_dir / "synthesize" / "_failures.parquet").to_pylist()
    assert manifest["counts"]["kept"] + len(filtered) + len(failures) == 6
    # the server was stopped: nothing listens on its port any more
    port = int(client["server"]["base_url"].rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    # an unchanged rerun makes zero requests and does not start the server
    again = run_synthesize(config, run_dir, upstream=records_upstream(config, "synthesize"))
    assert again["counts"]["client"]["requests"] == 0 and not again["counts"]["client"]["server"]["launched"]


@pytest.mark.llama_server
@needs_llama
def test_the_packaged_llama_cpp_server_answers_chat_requests_once_it_has_refused_openais_json_schema(tmp_path):
    from embed_core.synthesize.cache import RequestCache
    from embed_core.synthesize.client import LLMClient
    from embed_core.synthesize.config import LLMServerConfig, SamplingConfig
    from embed_core.synthesize.server import LlamaCppServer, default_gguf_path

    with LlamaCppServer(default_gguf_path(), model_alias="gemma", n_threads=1) as server:
        cfg = LLMServerConfig(base_url=server.base_url, model="gemma", launch="none", mode="chat")
        client = LLMClient(cfg, SamplingConfig(max_tokens=24, temperature=0.0), RequestCache(tmp_path / "r.sqlite"))
        answer = _chat(client)
    # the packaged Gemma-3-270M is a base model: in chat mode it may well answer nothing (completion
    # mode is the default); what counts here is that the plain request was answered with a 200
    assert not answer.cached and client.stats.endpoints[server.base_url] == {"answered": 1, "failed": 0}
    assert client.stats.errors == {"response_format_unsupported": 1} and not client.structured


def _client(server: ScriptedLLMServer, tmp_path: Path, **server_cfg):
    from embed_core.synthesize.config import LLMServerConfig, SamplingConfig
    from embed_core.synthesize.cache import RequestCache
    from embed_core.synthesize.client import LLMClient

    cfg = LLMServerConfig(base_url=server.base_url, model="scripted", launch="none", **server_cfg)
    return LLMClient(cfg, SamplingConfig(), RequestCache(tmp_path / "requests.sqlite"))


def _chat(client, text="Rewrite this sentence: A cat sits on a mat."):
    import asyncio

    return asyncio.run(client.complete(prompt_name="p", prompt_version="1", prompt=[{"role": "user", "content": text}],
                                       stop=(), schema=("text_answer", {"type": "object"})))


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
def test_a_retry_after_header_sets_the_wait_before_the_retry(tmp_path):
    with ScriptedLLMServer(faults=["429:retry-after=1.5", "429"]) as server:
        client = _client(server, tmp_path, mode="chat", backoff_s=0.01, max_backoff_s=0.01)
        answer = _chat(client)
    first, second, third = server.request_times
    assert second - first >= 1.5  # the server's Retry-After, not the 10 ms backoff
    assert third - second < 1.0   # a 429 without the header: the jittered backoff
    assert json.loads(answer.text)["text"] and client.stats.errors["http_429"] == 2 and client.stats.retries == 2


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
def test_chat_requests_carry_the_answer_schema_and_fall_back_when_the_server_rejects_it(tmp_path):
    from embed_core.synthesize.prompts import load_templates

    template = load_templates(None)["paraphrase-sentence"]
    name, schema = template.answer_schema()
    assert schema == {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                      "additionalProperties": False}
    with ScriptedLLMServer() as server:
        _chat(_client(server, tmp_path / "a", mode="chat"))
        assert server.bodies[0]["response_format"]["type"] == "json_schema"
    for rejection in (True, 500):  # a 400 as OpenAI-style servers send it; the 500 of llama-cpp-python's server
        with ScriptedLLMServer(reject_response_format=rejection) as server:
            client = _client(server, tmp_path / f"b{rejection}", mode="chat")
            first, second = _chat(client), _chat(client, "Rewrite this sentence: A dog runs.")
            assert json.loads(first.text) and json.loads(second.text)
            assert ["response_format" in b for b in server.bodies] == [True, False, False]  # one rejection, then plain
            assert client.stats.errors == {"response_format_unsupported": 1}
    with ScriptedLLMServer() as server:
        _chat(_client(server, tmp_path / "c", mode="chat", structured_output="off"))
        assert "response_format" not in server.bodies[0]
