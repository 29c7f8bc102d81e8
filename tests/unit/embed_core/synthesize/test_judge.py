"""The optional LLM judge of generated queries (``synthesize.queries.judge``): against the scripted
OpenAI-compatible server, a pair the judge says no to is dropped with reason judge, a yes is kept,
the score comes from the logprobs when the server sends them (else from the answer text), and a
rerun is answered from the request cache."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from embed_core.artifacts import read_records
from embed_core.config import parse_config
from embed_core.errors import ConfigError
from embed_core.prepare.run import run_prepare
from embed_core.schema import table_to_records
from embed_core.synthesize.config import JudgeConfig
from embed_core.synthesize.judge import judge_template, verdict
from embed_core.synthesize.prompts import load_templates
from embed_core.synthesize.run import run_synthesize
from embed_core.synthesize.stage import format_counts
from tests.helpers.llm_server import ScriptedLLMServer, needs_llama
from tests.unit.embed_core.synthesize.test_queries import corpus_config

PASSAGES = ["The heart pumps blood through the arteries of the body.",
            "Kidneys filter waste from the blood and make urine.",
            "The liver stores glycogen and releases glucose when needed."]


def _config(tmp_path, url, mode="chat", **judge):
    return corpus_config(tmp_path, url, PASSAGES, mode, max_passages=None, types=["question"], per_type=1,
                         judge=judge)


def _judge_requests(server: ScriptedLLMServer) -> list[dict]:
    return [b for b in server.bodies if "logprobs" in b]


def test_a_pair_the_judge_says_no_to_is_dropped_with_reason_judge_a_yes_is_kept_and_a_rerun_asks_nothing(tmp_path):
    with ScriptedLLMServer(judge_no=("kidneys",)) as server:
        config = _config(tmp_path, server.base_url)
        run_dir = tmp_path / "run"
        run_prepare(config, run_dir)
        m = run_synthesize(config, run_dir, upstream="prepare")
        judged = _judge_requests(server)
        assert server.total_calls == 3 + 3 and len(judged) == 3       # 3 queries generated, 3 judged
        assert all(b["logprobs"] is True and b["top_logprobs"] == 5 and b["temperature"] == 0.0
                   and "response_format" not in b for b in judged)
        kept = table_to_records(read_records(run_dir, "synthesize")["organs.parquet"])
        assert sorted(r.positives[0] for r in kept) == sorted(set(PASSAGES) - {PASSAGES[1]})
        (dropped,) = pq.read_table(run_dir / "synthesize/_filtered.parquet").to_pylist()
        scores = json.loads(dropped["scores"])
        assert dropped["reason"] == "judge" and json.loads(dropped["generated"])["query"].startswith("Kidneys")
        assert (scores["from"], scores["judge"], scores["threshold"]) == ("logprobs", pytest.approx(0.1), 0.5)
        q = m["queries"]["organs"]
        assert (q["judged"], q["kept"], q["dropped"]) == (3, 2, {"judge": 1})
        assert q["dropped_examples"][0]["reason"] == "judge" and q["kept_examples"][0]["judge"] == pytest.approx(0.8)
        rows = pq.read_table(run_dir / "synthesize/_queries.parquet").to_pylist()
        assert [r["judge"] for r in rows] == [pytest.approx(0.8)] * 2 and {r["persona"] for r in rows} == {None}
        assert "3 generated, 3 judged, 2 kept; dropped: judge 1" in format_counts(m)
        assert m["counts"]["judge_client"]["requests"] == 3

        again = run_synthesize(config, run_dir, upstream="prepare")
        assert server.total_calls == 6 and again["counts"]["judge_client"]["cache_hits"] == 3
        assert again["queries"]["organs"]["dropped"] == {"judge": 1}


def test_the_score_comes_from_the_logprobs_when_the_server_sends_them_else_from_the_answer_text(tmp_path):
    run_dir = tmp_path / "run"
    # threshold 0.9: the scripted yes has P(yes) 0.8 in its logprobs (dropped), but 1.0 as text (kept)
    with ScriptedLLMServer(judge_no=("kidneys",)) as server:
        config = _config(tmp_path, server.base_url, mode="completion", threshold=0.9)
        run_prepare(config, run_dir)
        m = run_synthesize(config, run_dir, upstream="prepare")
        assert all(b["logprobs"] == 5 for b in _judge_requests(server))   # completion: logprobs is a count
    assert m["queries"]["organs"]["kept"] == 0 and m["queries"]["organs"]["dropped"] == {"judge": 3}
    with ScriptedLLMServer(judge_no=("kidneys",), logprobs=False) as server:
        config = _config(tmp_path / "plain", server.base_url, mode="completion", threshold=0.9)
        run_prepare(config, tmp_path / "plain-run")
        m = run_synthesize(config, tmp_path / "plain-run", upstream="prepare")
    assert m["queries"]["organs"]["kept"] == 2 and m["queries"]["organs"]["dropped"] == {"judge": 1}
    (dropped,) = pq.read_table(tmp_path / "plain-run/synthesize/_filtered.parquet").to_pylist()
    assert json.loads(dropped["scores"])["from"] == "text" and json.loads(dropped["scores"])["judge"] == 0.0


def test_the_verdict_normalises_yes_against_no_over_the_top_tokens_and_falls_back_to_the_text():
    lp = {" Yes": math.log(0.6), "yes": math.log(0.15), " no": math.log(0.25), " maybe": math.log(0.1)}
    v = verdict(" Yes", lp)
    assert v.source == "logprobs" and v.score == pytest.approx(0.75)
    assert (verdict("No.", None).score, verdict("No.", None).source) == (0.0, "text")
    assert verdict(" yes, it does", {" perhaps": -0.1}).score == 1.0      # no yes/no token: the text decides
    assert verdict("I cannot tell", None) is None and verdict("", {}) is None


def test_a_judge_prompt_that_is_not_a_judgment_template_is_refused_with_one_line():
    with pytest.raises(ConfigError, match="judge.prompt 'queries-question' has output 'queries', not 'judgment'"):
        judge_template(JudgeConfig(prompt="queries-question"), load_templates())
    with pytest.raises(ConfigError, match="no template named 'judge-strict'"):
        judge_template(JudgeConfig(prompt="judge-strict"), load_templates())


def test_the_logprobs_are_read_at_the_first_answer_token_that_is_not_blank_in_both_api_shapes():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    from embed_core.synthesize.client import first_token_logprobs

    def top(pairs):
        return [{"token": t, "logprob": v, "bytes": None} for t, v in pairs]

    chat = ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [{
            "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "\nYes"},
            "logprobs": {"content": [
                {"token": "\n", "logprob": -0.1, "bytes": None, "top_logprobs": top([("\n", -0.1), ("Yes", -3.0)])},
                {"token": "Yes", "logprob": -0.2, "bytes": None, "top_logprobs": top([("Yes", -0.2), ("No", -1.8)])}]}}]})
    assert first_token_logprobs(chat.choices[0], chat=True) == {"Yes": -0.2, "No": -1.8}
    completion = Completion.model_validate({
        "id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [{
            "index": 0, "finish_reason": "stop", "text": " no",
            "logprobs": {"tokens": [" no"], "token_logprobs": [-0.3], "text_offset": [0],
                         "top_logprobs": [{" no": -0.3, " yes": -1.4}]}}]})
    assert first_token_logprobs(completion.choices[0], chat=False) == {" no": -0.3, " yes": -1.4}
    no_logprobs = Completion.model_validate({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                             "choices": [{"index": 0, "finish_reason": "stop", "text": "yes"}]})
    assert first_token_logprobs(no_logprobs.choices[0], chat=False) is None


@pytest.mark.llama_server
@needs_llama
def test_the_real_llama_cpp_server_returns_the_logprobs_the_judge_scores_from(tmp_path):
    # the packaged Gemma-3-270M in completion mode: 3 queries generated, 3 judged (one thread: see
    # test_real_llama_cpp_server_paraphrase_and_hard_negatives)
    raw = _config(tmp_path, "unused", mode="completion").model_dump(mode="json", exclude_none=True)
    raw["synthesize"]["server"] = {"launch": "llama_cpp", "mode": "completion", "max_concurrency": 1, "n_threads": 1}
    raw["synthesize"]["sampling"] = {"max_tokens": 48, "seed": 1}
    raw["synthesize"]["queries"].update(min_words=1, judge={"threshold": 0.0})
    config, run_dir = parse_config(raw), tmp_path / "run"
    run_prepare(config, run_dir)
    m = run_synthesize(config, run_dir, upstream="prepare")
    assert m["counts"]["judge_client"]["server"]["launched"] and m["counts"]["judge_client"]["requests"] >= 1
    # the judge asks the server generation launched (its port and startup time): one start for the stage
    assert m["counts"]["judge_client"]["server"] == m["counts"]["client"]["server"]
    assert m["counts"]["client"]["server"]["launched"]
    q = m["queries"]["organs"]
    assert q["judged"] == q["kept"] >= 1 and "judge_failed" not in q["dropped"]
    rows = pq.read_table(run_dir / "synthesize/_queries.parquet").to_pylist()
    # scores from logprobs lie strictly between 0 and 1 (the text alone gives only 0 or 1)
    assert rows and all(0.0 <= r["judge"] <= 1.0 for r in rows) and any(0.0 < r["judge"] < 1.0 for r in rows)


def test_a_judge_that_answers_neither_yes_nor_no_fails_the_stage_instead_of_committing_no_query(tmp_path):
    """Every judge round malformed ("maybe", no logprobs to score): beyond max_malformed_share the
    stage fails with one line and commits nothing (it used to commit synthesize with 0 queries)."""
    from embed_core.errors import EmbedpipeError

    with ScriptedLLMServer(judge_answer="maybe", logprobs=False) as server:
        config = _config(tmp_path, server.base_url)
        run_dir = tmp_path / "run"
        run_prepare(config, run_dir)
        with pytest.raises(EmbedpipeError) as failed:
            run_synthesize(config, run_dir, upstream="prepare")
    line = str(failed.value)
    assert line.startswith("synthesize: 3 of 3 answers of the judge do not parse or validate") and "\n" not in line
    assert "it answered 'maybe'" in line and "synthesize.max_malformed_share 0.9" in line
    assert not (run_dir / "synthesize").exists()
