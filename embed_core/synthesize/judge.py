"""The optional LLM judge of generated queries (``synthesize.queries.judge``; InPars-v2, Promptagator):
after the other filters, each kept (query, passage) pair is one request to the same
OpenAI-compatible server, cached like the others, asking whether the passage answers the query
(packaged prompt ``judge-relevance.yaml``). Its score is P(yes) / (P(yes) + P(no)) over the top
logprobs of the answer's first non-blank token when the server returns them (tokens compared without case
and surrounding space), else 1 for an answer starting with yes and 0 for no; an answer that is
neither is asked again (``max_parse_retries``). A pair scored below ``threshold`` is dropped with
reason ``judge``; one the judge could not answer with reason ``judge_failed``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embed_core.errors import ConfigError
from embed_core.schema import Record
from embed_core.synthesize.client import LLMClient, RequestFailed
from embed_core.synthesize.config import JudgeConfig, SynthesizeConfig
from embed_core.synthesize.filters import Candidate
from embed_core.synthesize.jobs import Job, Outcome, Servers, generate
from embed_core.synthesize.prompts import JUDGMENT, PromptTemplate

STRATEGY = "judge"


@dataclass(frozen=True)
class Verdict:
    score: float        # 0..1: how sure the judge is that the passage answers the query
    source: str         # "logprobs" or "text"
    text: str           # the judge's answer


def judge_template(cfg: JudgeConfig, templates: dict[str, PromptTemplate]) -> PromptTemplate:
    """The judge's template, checked to be one (``output: judgment``)."""
    tpl = templates.get(cfg.prompt)
    if tpl is None:
        raise ConfigError(f"synthesize.queries.judge.prompt: no template named {cfg.prompt!r} "
                          f"(templates: {', '.join(sorted(templates))})")
    if tpl.output != JUDGMENT:
        raise ConfigError(f"{tpl.source}: synthesize.queries.judge.prompt {cfg.prompt!r} has output "
                          f"{tpl.output!r}, not {JUDGMENT!r}")
    return tpl


def _word(token: str) -> str:
    return token.strip().strip(".,!:;\"'").lower()


def verdict(text: str, top_logprobs: dict[str, float] | None) -> Verdict | None:
    """The judge's score from its answer: logprobs first, then the text; None when neither says."""
    yes = no = 0.0
    for token, logprob in (top_logprobs or {}).items():
        if _word(token) == "yes":
            yes += math.exp(logprob)
        elif _word(token) == "no":
            no += math.exp(logprob)
    if yes + no > 0:
        return Verdict(yes / (yes + no), "logprobs", text)
    words = text.split()
    first = _word(words[0]) if words else ""
    if first in ("yes", "no"):
        return Verdict(1.0 if first == "yes" else 0.0, "text", text)
    return None


def _ask_for(cfg: JudgeConfig):
    """How one judge job is asked: greedy, a few tokens, with logprobs; an answer that is neither
    yes nor no is asked again with the next attempt number (a fresh cache key)."""

    async def ask(client: LLMClient, job: Job, mode: str, max_parse_retries: int) -> Outcome:
        tpl = job.template
        prompt = tpl.render(mode, job.values)
        raw = None
        for attempt in range(max_parse_retries + 1):
            try:
                answer = await client.complete(prompt_name=tpl.name, prompt_version=tpl.version, prompt=prompt,
                                               stop=tpl.stop, attempt=attempt, logprobs=cfg.top_logprobs,
                                               overrides={"temperature": cfg.temperature, "max_tokens": cfg.max_tokens})
            except RequestFailed as exc:
                return Outcome(job, reason=exc.reason, detail=exc.detail, raw=raw, attempts=attempt + 1)
            raw = answer.text
            found = verdict(answer.text, answer.top_logprobs)
            if found is not None:
                return Outcome(job, answer=found, raw=raw, attempts=attempt + 1)
        return Outcome(job, reason="malformed", detail="the judge answered neither yes nor no", raw=raw,
                       attempts=max_parse_retries + 1)

    return ask


@dataclass
class Judged:
    """What the judge did: the kept candidates, the dropped ones as (candidate, reason, scores), every
    kept pair's score by record id, the requests' outcomes and the client's stats."""

    kept: list[Candidate]
    dropped: list[tuple[Candidate, str, dict[str, Any]]]
    scores: dict[str, float]
    outcomes: list[Outcome]
    client: dict[str, Any]


def judge_queries(cfg: SynthesizeConfig, candidates: list[Candidate], templates: dict[str, PromptTemplate],
                  run_dir: Path, seed: int, spent: dict[str, Any], servers: Servers | None = None) -> Judged:
    """Ask the judge about every candidate (``spent``: the run's client stats so far, off the budget;
    ``servers``: the stage's LLM servers, already up when generation launched them)."""
    jc = cfg.queries.judge
    tpl = judge_template(jc, templates)
    jobs = [Job(STRATEGY, c.record.dataset, c.record, tpl, {"query": c.record.query, "passage": c.record.positives[0]})
            for c in candidates]
    outcomes, stats = generate(cfg, jobs, run_dir, seed, ask=_ask_for(jc), spent=spent, servers=servers) if jobs else ([], {})
    out = Judged([], [], {}, outcomes, stats)
    for c, o in zip(candidates, outcomes):
        if o.answer is None:
            out.dropped.append((c, "judge_failed", {"failure": o.reason}))
        elif o.answer.score < jc.threshold:
            out.dropped.append((c, STRATEGY, {"judge": round(o.answer.score, 4), "threshold": jc.threshold,
                                              "from": o.answer.source, "answer": o.answer.text}))
        else:
            out.kept.append(c)
            out.scores[c.record.id] = round(o.answer.score, 4)
    return out


def judge_pair_scores(cfg: SynthesizeConfig, pairs: list[tuple[str, str]], templates: dict[str, PromptTemplate],
                      run_dir: Path, seed: int, spent: dict[str, Any],
                      servers: Servers | None = None) -> tuple[list[float], dict[str, Any], list[Outcome]]:
    """The judge's score of each (query, passage) pair, asked like ``judge_queries`` asks (the same
    requests, so the same cache entries): NaN for a pair it could not answer; the client's stats and
    the requests' outcomes."""
    tpl = judge_template(cfg.queries.judge, templates)
    jobs = [Job(STRATEGY, "calibration", Record(id=f"calibration-{i}", dataset="calibration", task="retrieval",
                                                query=q, positives=[p]), tpl, {"query": q, "passage": p})
            for i, (q, p) in enumerate(pairs)]
    if not jobs:
        return [], {}, []
    outcomes, stats = generate(cfg, jobs, run_dir, seed, ask=_ask_for(cfg.queries.judge), spent=spent, servers=servers)
    return [math.nan if o.answer is None else o.answer.score for o in outcomes], stats, outcomes
