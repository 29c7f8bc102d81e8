"""Filter calibration in the synthesize stage (``synthesize.calibration``), against the scripted
OpenAI-compatible server whose judge P(yes) and prompt logprobs are set per pair by the test, so
every figure is known by construction: the stage writes calibration.parquet, the report and the
manifest with those figures, filters the generated queries with the fitted thresholds (a query
between the configured and the fitted judge threshold is kept), refuses a filter below the floor
with one line before committing anything, and goes on without the likelihood filter when the server
sends no prompt logprobs."""

from __future__ import annotations

import json
import logging

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from embed_core.artifacts import read_records
from embed_core.config import parse_config
from embed_core.errors import ConfigError
from embed_core.prepare.run import run_prepare
from embed_core.schema import table_to_records
from embed_core.synthesize.calibrate import FilterRefused
from embed_core.synthesize.config import SynthesizeConfig
from embed_core.synthesize.run import input_fingerprint, run_synthesize
from embed_core.synthesize.stage import format_counts
from tests.helpers.llm_server import ScriptedLLMServer

NAMES = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
PASSAGES = ["The heart pumps blood through the arteries of the body.",
            "Kidneys filter waste from the blood and make urine.",
            "The liver stores glycogen and releases glucose when needed.",
            "Bones store calcium and phosphate for the whole skeleton."]
ORGANS = ["heart", "kidneys", "liver", "bones"]
# the judge's P(yes) for widget query i with its own passage / with another widget's passage
JUDGE_OWN = [0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.5, 0.2, 0.1]      # 8 of 10 >= 0.5
JUDGE_OTHER = [0.6, 0.55, 0.45, 0.44, 0.43, 0.42, 0.41, 0.4, 0.35, 0.3]  # 2 of 10 >= 0.5
JUDGE_GENERATED = {"heart": 0.55, "kidneys": 0.45, "liver": 0.3, "bones": 0.9}
# the mean token logprob of widget query i given its own passage / another's (multiples of 1/4: exact)
LP_OWN = [-0.25 * (i + 1) for i in range(10)]                          # -0.25 .. -2.5
LP_OTHER = [-1.0, -1.0] + [-3.0] * 8                                   # 2 of 10 pass any threshold <= -1
LP_GENERATED = {"heart": -1.0, "kidneys": -2.0, "liver": -2.75, "bones": -0.5}


def _widget(text: str) -> int | None:
    return next((i for i, n in enumerate(NAMES) if f"widget {n}" in text.lower()), None)


def _organ(passage: str) -> str:
    return next(o for o in ORGANS if o in passage.lower())


def _by_pair(own, other, generated):
    def score(query: str, passage: str) -> float:
        i = _widget(query)
        if i is None:
            return generated[_organ(passage)]
        return own[i] if _widget(passage) == i else other[i]
    return score


def _prompt_logprob(prompt: str) -> float:
    """The likelihood prompt is "Passage: P\\nA query this passage answers: Q"."""
    passage = prompt.split("\n")[0].removeprefix("Passage: ")
    return _by_pair(LP_OWN, LP_OTHER, LP_GENERATED)(prompt.rsplit("answers: ", 1)[1], passage)


def _config(tmp_path, url, calibration, judge_threshold=0.6, round_trip=None):
    """The user's data: 10 (question, answer) pairs about widgets; a corpus of 4 organ passages that
    gets one generated question each; the judge on, at ``judge_threshold``."""
    (tmp_path / "docs").mkdir(parents=True, exist_ok=True)
    (tmp_path / "docs/organs.md").write_text("\n\n".join(PASSAGES) + "\n")
    rows = [f"what does the widget {n} measure,The widget {n} measures the {n} quantity of a sample." for n in NAMES]
    (tmp_path / "faq.csv").write_text("question,answer\n" + "\n".join(rows) + "\n")
    return parse_config({"data_root": str(tmp_path), "prepare": {"sources": [
        {"name": "widgets", "kind": "qa", "path": "faq.csv"},
        {"name": "organs", "kind": "corpus", "path": "docs", "params": {"chunk_tokens": 16}}]},
        "synthesize": {"server": {"base_url": url, "model": "scripted-gen", "mode": "chat", "timeout_s": 2.0,
                                  "max_retries": 1, "backoff_s": 0.01},
                       "strategies": ["queries"],
                       "queries": {"max_passages": None, "types": ["question"], "per_type": 1, "round_trip": round_trip,
                                   "judge": {"threshold": judge_threshold}},
                       "calibration": calibration}})


CALIBRATION = {"filters": ["likelihood", "judge"], "precision_floor": 0.8, "beta": None}


def _server(**kw) -> ScriptedLLMServer:
    return ScriptedLLMServer(judge_score=_by_pair(JUDGE_OWN, JUDGE_OTHER, JUDGE_GENERATED), **kw)


def _prepared(tmp_path, server: ScriptedLLMServer, calibration):
    config = _config(tmp_path, server.base_url, calibration)
    run_prepare(config, tmp_path / "run")
    return config, tmp_path / "run"


def _kept_organs(run_dir) -> list[str]:
    return sorted(_organ(r.positives[0]) for r in table_to_records(read_records(run_dir, "synthesize")["organs.parquet"]))


def test_calibration_writes_the_figures_the_scores_imply_and_filters_with_the_fitted_thresholds(tmp_path):
    with _server(prompt_logprob=_prompt_logprob) as server:
        config, run_dir = _prepared(tmp_path, server, CALIBRATION)
        m = run_synthesize(config, run_dir, upstream="prepare")
        echoes = [b for b in server.bodies if b.get("echo")]
    # each filter scores 10 real + 10 mismatched pairs + the 4 generated queries
    assert len(echoes) == 24
    rows = {r["filter"]: r for r in pq.read_table(run_dir / "synthesize/calibration.parquet").to_pylist()}
    assert {r["generator"] for r in rows.values()} == {"scripted-gen"}
    lik, jud = rows["likelihood"], rows["judge"]
    # likelihood: at -2.5 every real pair passes and 2 of 10 mismatched ones: precision 1 / 1.2, the lowest
    # threshold meeting 0.8; generated: heart -1, kidneys -2, bones -0.5 pass, liver -2.75 does not
    assert (lik["status"], lik["threshold"], lik["recall"]) == ("calibrated", -2.5, 1.0)
    assert lik["precision"] == pytest.approx(1 / 1.2) and lik["keep_rate"] == 0.75
    assert (lik["n_real"], lik["n_mismatched"]) == (10, 10)
    # judge: at 0.5, 8 of 10 real and 2 of 10 mismatched pass: precision 0.8, recall 0.8; generated heart and bones
    assert (jud["status"], jud["threshold"], jud["recall"], jud["keep_rate"]) == \
        ("calibrated", pytest.approx(0.5), 0.8, 0.5)
    assert jud["precision"] == pytest.approx(0.8) and jud["applied"] == "queries.judge.threshold 0.6 -> 0.5"
    # liver is dropped by the likelihood, kidneys (0.45) by the judge at 0.5; heart (0.55) lies between the
    # configured 0.6 and the fitted 0.5: kept
    assert _kept_organs(run_dir) == ["bones", "heart"]
    dropped = {_organ(json.loads(d["generated"])["query"]): (d["reason"], json.loads(d["scores"]))
               for d in pq.read_table(run_dir / "synthesize/_filtered.parquet").to_pylist()}
    assert dropped["liver"] == ("likelihood", {"likelihood": -2.75, "threshold": -2.5})
    assert dropped["kidneys"][0] == "judge" and dropped["kidneys"][1]["threshold"] == pytest.approx(0.5)
    assert m["calibration"]["real_pairs"] == "records"
    assert [r["filter"] for r in m["calibration"]["filters"]] == ["likelihood", "judge"]
    report = (run_dir / "synthesize/report.md").read_text()
    assert "| scripted-gen | judge | calibrated | 0.5 | 0.80 | 0.80 | 0.50 | 10 / 10 | queries.judge.threshold" in report
    assert "calibration likelihood (scripted-gen): calibrated, threshold -2.5, precision 0.83" in format_counts(m)


def test_without_calibration_the_configured_judge_threshold_drops_the_query_between_the_two(tmp_path):
    with _server(prompt_logprob=_prompt_logprob) as server:
        config, run_dir = _prepared(tmp_path, server, None)
        m = run_synthesize(config, run_dir, upstream="prepare")
        assert not any(b.get("echo") for b in server.bodies)
    assert _kept_organs(run_dir) == ["bones"] and "calibration" not in m
    assert not (run_dir / "synthesize/calibration.parquet").exists()
    calibrated = _config(tmp_path, "http://x/v1", CALIBRATION)
    assert input_fingerprint(calibrated, run_dir, upstream="prepare").key != \
        input_fingerprint(config, run_dir, upstream="prepare").key


def test_a_filter_below_the_precision_floor_refuses_the_stage_with_one_line_and_commits_nothing(tmp_path):
    blind = _by_pair(JUDGE_OWN, JUDGE_OWN, JUDGE_GENERATED)   # the judge cannot tell a mismatched passage
    with ScriptedLLMServer(judge_score=blind, prompt_logprob=_prompt_logprob) as server:
        config, run_dir = _prepared(tmp_path, server, CALIBRATION)
        with pytest.raises(FilterRefused) as err:
            run_synthesize(config, run_dir, upstream="prepare")
    message = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in message
    assert message == ("synthesize calibration: filter 'judge' (generator 'scripted-gen'): precision 0.50 at best, "
                       "below the floor 0.80")
    assert not (run_dir / "synthesize").exists()


def test_a_server_without_prompt_logprobs_makes_the_likelihood_filter_step_aside_once_and_the_stage_go_on(
        tmp_path, caplog):
    with _server() as server:
        config, run_dir = _prepared(tmp_path, server, CALIBRATION)
        with caplog.at_level(logging.WARNING, logger="embedpipe.synthesize"):
            m = run_synthesize(config, run_dir, upstream="prepare")
        assert len([b for b in server.bodies if b.get("echo")]) == 1
    said = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert said == [f"synthesize: the likelihood filter steps aside: the server at {server.base_url} "
                    "returned no prompt logprobs"]
    rows = {r["filter"]: r for r in pq.read_table(run_dir / "synthesize/calibration.parquet").to_pylist()}
    assert rows["likelihood"]["status"] == "stepped aside" and rows["likelihood"]["precision"] is None
    assert rows["judge"]["status"] == "calibrated"
    reasons = {_organ(json.loads(d["generated"])["query"]): d["reason"]
               for d in pq.read_table(run_dir / "synthesize/_filtered.parquet").to_pylist()}
    assert reasons == {"kidneys": "judge", "liver": "judge"}     # no likelihood filter: liver reaches the judge
    assert _kept_organs(run_dir) == ["bones", "heart"]
    assert m["calibration"]["filters"][0]["threshold"] is None


def test_a_calibrated_round_trip_replaces_top_k_with_the_rank_its_fitted_threshold_allows(tmp_path):
    # each widget question names its widget, which only its own answer names: the packaged MiniLM ranks
    # the own passage first (rank 1, score -1) and a mismatched one lower, so the fitted threshold is -1
    with _server() as server:
        config = _config(tmp_path, server.base_url, {"filters": ["round_trip"], "precision_floor": 0.9},
                         round_trip={"model": "default", "top_k": 5})
        run_dir = tmp_path / "run"
        run_prepare(config, run_dir)
        m = run_synthesize(config, run_dir, upstream="prepare")
    (row,) = m["calibration"]["filters"]
    assert (row["filter"], row["status"], row["threshold"], row["precision"], row["recall"]) == \
        ("round_trip", "calibrated", -1.0, 1.0, 1.0)
    assert row["applied"] == "queries.round_trip.top_k 5 -> 1"
    dropped = [json.loads(d["scores"]) for d in pq.read_table(run_dir / "synthesize/_filtered.parquet").to_pylist()
               if d["reason"] == "round_trip"]
    assert all(d["top_k"] == 1 and d["rank"] > 1 for d in dropped)


def test_a_calibration_of_a_filter_that_is_off_or_without_generated_queries_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="calibration.filters lists round_trip, but queries.round_trip is null"):
        _config(tmp_path, "http://x/v1", {"filters": ["likelihood", "round_trip"]})
    with pytest.raises(ValidationError, match="calibration fits the filters of generated queries: add queries"):
        SynthesizeConfig.model_validate({"strategies": ["paraphrase"], "calibration": {"filters": ["likelihood"]}})
