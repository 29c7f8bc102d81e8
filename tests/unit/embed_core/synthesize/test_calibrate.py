"""Filter calibration (``synthesize/calibrate.py``): on a fixture where exactly k of n real pairs and
m of n mismatched pairs pass a given threshold, the calibration reports exactly those figures; a
filter below the precision floor is refused with one line; mismatched pairs are a seeded
derangement; the likelihood filter reads the query's mean token logprob, and steps aside once,
saying so, against a server that returns no logprobs."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import pytest

from embed_core.errors import ConfigError
from embed_core.synthesize.calibrate import (LIKELIHOOD_TEMPLATE, FilterRefused, LikelihoodScorer, calibrate_filters,
                                             calibrate_threshold, calibration_markdown, calibration_rows,
                                             held_out, mean_query_logprob, mismatched_pairs, openai_echo,
                                             pairs_from_records, round_trip_scorer)
from embed_core.schema import Record
from tests.helpers.llm_server import ScriptedLLMServer, needs_llama

N = 10
REAL = [(f"q{i} what about topic {i}", f"p{i} a passage on topic {i}") for i in range(N)]
# score of query i with its own passage / with any other passage
OWN = [0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.5, 0.2, 0.1]        # 8 of 10 >= 0.5
OTHER = [0.6, 0.55, 0.45, 0.44, 0.43, 0.42, 0.41, 0.4, 0.35, 0.3]  # 2 of 10 >= 0.5


def _index(text: str) -> int:
    return int(text.split()[0][1:])


def table_filter(own, other):
    """A filter whose score depends only on the query and whether the passage is its own, so which
    mismatched passage a query gets does not change the figures."""
    return lambda pairs: [own[_index(q)] if _index(q) == _index(p) else other[_index(q)] for q, p in pairs]


def test_a_fixture_with_k_of_n_real_and_m_of_n_mismatched_pairs_passing_reports_exactly_those_figures():
    # threshold 0.5: recall 8/10, false passes 2/10, precision 0.8 / (0.8 + 0.2) = 0.8; the lowest
    # threshold meeting the floor 0.8 (0.2 gives 0.9 / (0.9 + 1.0) = 0.47)
    c = calibrate_threshold(OWN, OTHER, precision_floor=0.8, beta=None, candidates=OWN[5:])
    assert (c.threshold, c.recall, c.false_pass, c.precision) == (0.5, 0.8, 0.2, pytest.approx(0.8))
    assert c.keep_rate == pytest.approx(3 / 5) and c.meets_floor and (c.n_pos, c.n_neg) == (10, 10)
    # F1 at 0.65: 2·1·0.6/1.6 = 0.75; at 0.6: 2·0.875·0.7/1.575 = 0.778; at 0.5: 2·0.8·0.8/1.6 = 0.8 (the best)
    f1 = calibrate_threshold(OWN, OTHER, precision_floor=0.8, beta=1.0)
    assert (f1.threshold, f1.f_beta) == (0.5, pytest.approx(0.8))
    # F0.5 weighs precision: at 0.65, 1.25·1·0.6/(0.25 + 0.6) = 0.882 beats 0.833 at 0.6 and at 0.7
    half = calibrate_threshold(OWN, OTHER, precision_floor=0.8, beta=0.5)
    assert (half.threshold, half.precision, half.recall) == (0.65, 1.0, pytest.approx(0.6))
    assert half.f_beta == pytest.approx(1.25 * 0.6 / 0.85)


def test_calibrating_each_filter_on_records_builds_the_mismatched_pairs_and_reports_per_filter_and_generator():
    strong_other = [1.0] + [0.0] * (N - 1)                          # 1 of 10 mismatched pairs passes
    scorers = {"table": table_filter(OWN, OTHER), "strict": table_filter([1.0] * N, strong_other)}
    out = calibrate_filters(REAL, scorers, generator="gemma-270m", precision_floor=0.8, beta=None, seed=3,
                            candidates=REAL[5:])
    rows = {r["filter"]: r for r in calibration_rows(out)}
    assert [r.filter for r in out] == ["table", "strict"] and {r.generator for r in out} == {"gemma-270m"}
    t = rows["table"]
    assert (t["status"], t["threshold"], t["recall"], t["precision"], t["keep_rate"]) == \
        ("calibrated", 0.5, 0.8, pytest.approx(0.8), pytest.approx(0.6))
    s = rows["strict"]   # recall 10/10, false passes 1/10: precision 1 / 1.1
    assert (s["threshold"], s["recall"], s["precision"], s["keep_rate"]) == (1.0, 1.0, pytest.approx(1 / 1.1), 1.0)
    md = calibration_markdown(out).splitlines()
    assert md[2] == "| gemma-270m | table | calibrated | 0.5 | 0.80 | 0.80 | 0.60 | 10 / 10 |"


def test_a_filter_below_the_precision_floor_is_refused_with_one_line_naming_it_its_precision_and_the_floor():
    scorers = {"table": table_filter(OWN, OTHER), "coin": lambda pairs: [0.5] * len(pairs)}
    with pytest.raises(FilterRefused) as err:
        calibrate_filters(REAL, scorers, generator="gemma-270m", precision_floor=0.8)
    message = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in message
    assert "filter 'coin' (generator 'gemma-270m'): precision 0.50 at best, below the floor 0.80" in message
    assert "'table'" not in message
    out = calibrate_filters(REAL, scorers, generator="g", precision_floor=0.8, refuse=False)
    assert [r.status for r in out] == ["calibrated", "refused"] and out[1].calibration.precision == 0.5


def test_mismatched_pairs_are_a_seeded_derangement_that_never_shows_a_query_its_own_passage_text():
    pairs = REAL + [("q10 a copy", REAL[0][1])]          # two queries share the passage text of pair 0
    neg = mismatched_pairs(pairs, seed=7)
    assert [q for q, _ in neg] == [q for q, _ in pairs]
    assert all(p != own for (_, p), (_, own) in zip(neg, pairs))
    assert sorted(p for _, p in neg) == sorted(p for _, p in pairs)   # each passage shown once
    assert mismatched_pairs(pairs, seed=7) == neg and mismatched_pairs(pairs, seed=8) != neg


def _toy_echo(prompt: str) -> dict:
    """A toy language model's echoed logprobs: a word of the prompt's passage costs -0.5, any other -3.0;
    the first token has none, as in the OpenAI API."""
    passage = prompt.split("\n")[0].split()
    tokens, offsets, at = [], [], 0
    for word in prompt.split(" "):
        tokens.append(word)
        offsets.append(at)
        at += len(word) + 1
    lps = [None] + [-0.5 if t in passage else -3.0 for t in tokens[1:]]
    return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets}


def test_the_likelihood_filter_scores_the_mean_logprob_of_the_query_tokens_only():
    scorer = LikelihoodScorer(_toy_echo, template="Passage: the heart pumps blood\nQuery:")
    # query "heart pumps rain": (-0.5 - 0.5 - 3.0) / 3 = -1.3333 (the template's tokens are not counted)
    assert scorer([("heart pumps rain", "ignored")]) == [pytest.approx(-4.0 / 3)]
    lp = {"tokens": ["a", " b", " c"], "token_logprobs": [None, -1.0, -2.0], "text_offset": [0, 1, 3]}
    assert mean_query_logprob(lp, 1, 5) == pytest.approx(-1.5) and mean_query_logprob(lp, 5, 9) is None
    liked = LikelihoodScorer(_toy_echo)
    out = calibrate_filters([("heart pumps blood", "the heart pumps blood"), ("kidneys filter waste",
                             "kidneys filter waste and make urine")], {"likelihood": liked}, generator="toy",
                            precision_floor=0.9)
    # own passage: every query word is in it (-0.5); the other: none (-3.0); threshold -0.5 passes exactly the real
    assert (out[0].calibration.threshold, out[0].calibration.recall, out[0].calibration.precision) == (-0.5, 1.0, 1.0)


def test_the_likelihood_filter_steps_aside_once_saying_why_when_the_server_returns_no_logprobs(caplog):
    with ScriptedLLMServer() as server:
        liked = LikelihoodScorer(openai_echo(server.base_url, "scripted", timeout_s=5.0))
        with caplog.at_level(logging.WARNING, logger="embedpipe.synthesize"):
            out = calibrate_filters(REAL, {"likelihood": liked, "table": table_filter(OWN, OTHER)},
                                    generator="scripted", precision_floor=0.8)
            assert liked(REAL[:3]) is None
        assert server.total_calls == 1 and server.bodies[0]["echo"] is True
    assert [r.status for r in out] == ["stepped aside", "calibrated"] and out[0].calibration is None
    said = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert said == [f"synthesize: the likelihood filter steps aside: the server at {server.base_url} "
                    "returned no prompt logprobs"]
    assert math.isnan(calibration_rows(out)[0]["precision"])


def test_the_likelihood_filter_times_the_shortest_prompt_and_steps_aside_when_all_would_exceed_its_budget(caplog):
    asked = []

    def slow_echo(prompt):
        asked.append(prompt)
        time.sleep(0.05)
        return _toy_echo(prompt)

    pairs = [("heart pumps blood", "the heart pumps blood " * k) for k in (4, 1, 2, 3)]
    tight = LikelihoodScorer(slow_echo, max_seconds=0.1)
    with caplog.at_level(logging.WARNING, logger="embedpipe.synthesize"):
        assert tight(pairs) is None and tight(pairs) is None
    # one echo, the shortest prompt's; >= 0.05 s scaled by 4 prompts of 1 to 4 times its length > 0.1 s
    assert asked == [f"{LIKELIHOOD_TEMPLATE.format(passage=pairs[1][1])} heart pumps blood"]
    (said,) = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert "would take about" in said and "for 4 pairs" in said and "likelihood_max_minutes" in said
    asked.clear()
    roomy = LikelihoodScorer(slow_echo, max_seconds=60.0)
    assert roomy(pairs) == LikelihoodScorer(_toy_echo)(pairs) and len(asked) == 4 and roomy.stepped_aside is None


@pytest.mark.parametrize("fault", ["timeout", "500"])
def test_a_server_failing_or_timing_out_on_echo_makes_the_likelihood_filter_step_aside_saying_so(fault, caplog):
    # the openai client tries each request 3 times (2 retries): every try fails
    with ScriptedLLMServer(faults=[fault] * 3, timeout_sleep=2.0) as server:
        liked = LikelihoodScorer(openai_echo(server.base_url, "scripted", timeout_s=0.5))
        with caplog.at_level(logging.WARNING, logger="embedpipe.synthesize"):
            assert liked(REAL[:2]) is None
        assert server.total_calls == 3
    assert liked.stepped_aside.startswith(f"the server at {server.base_url} did not answer a prompt-logprobs (echo) "
                                          "request (")
    assert liked.stepped_aside.endswith("3 tries)")
    assert ("APITimeoutError, no answer within 0.5 s" if fault == "timeout" else "InternalServerError, HTTP 500"
            ) in liked.stepped_aside


@pytest.mark.llama_server
@needs_llama
def test_the_packaged_llama_cpp_server_answers_echo_too_slowly_and_the_likelihood_filter_steps_aside(tmp_path):
    # llama-cpp-python returns prompt logprobs, but computes each token's over Gemma-3's whole 262k-token
    # vocabulary in Python: seconds for a short prompt, so 6 pairs would exceed a 3-second budget
    from embed_core.synthesize.server import LlamaCppServer, default_gguf_path

    pairs = [(f"what does the {organ} do", f"The {organ} is an organ of the human body.")
             for organ in ["heart", "liver", "kidney", "lung", "brain", "skin"]]
    with LlamaCppServer(default_gguf_path(), model_alias="gemma-3-270m", n_threads=1,
                        log_path=tmp_path / "llama.log") as server:
        echo = openai_echo(server.base_url, "gemma-3-270m", timeout_s=120.0)
        got = echo(f"{LIKELIHOOD_TEMPLATE.format(passage=pairs[0][1])} {pairs[0][0]}")
        liked = LikelihoodScorer(echo, max_seconds=3.0)
        assert liked(pairs) is None
    assert isinstance(got, dict) and any(lp is not None for lp in got["token_logprobs"])   # logprobs it does send
    assert "would take about" in liked.stepped_aside and "for 6 pairs" in liked.stepped_aside


def test_round_trip_as_a_score_is_minus_the_rank_of_the_shown_passage():
    passages = ["heart blood", "kidney urine", "liver glucose"]
    vocab = sorted({w for p in passages for w in p.split()})

    def embed(texts):
        v = np.array([[float(w in t.split()) for w in vocab] for t in texts])
        return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-9)

    score = round_trip_scorer(passages, embed)
    # "heart": its passage scores 1/sqrt(2), the others 0 -> rank 1; shown "kidney urine", the heart passage beats it
    assert score([("heart", "heart blood"), ("heart", "kidney urine")]) == [-1.0, -3.0]


def test_the_real_pairs_come_from_retrieval_records_or_a_seeded_held_out_slice_of_kept_queries():
    records = [Record("a", "d", "retrieval", "what pumps blood", ["the heart pumps blood"]),
               Record("b", "d", "sts", "a man sings", ["a person sings"]),
               Record("c", "d", "retrieval", "no positive", [])]
    assert pairs_from_records(records) == [("what pumps blood", "the heart pumps blood")]
    part = held_out(REAL, 0.3, seed=1)
    assert len(part) == 3 and set(part) <= set(REAL) and held_out(REAL, 0.3, seed=1) == part
    assert [REAL.index(p) for p in part] == sorted(REAL.index(p) for p in part)   # in the input's order
