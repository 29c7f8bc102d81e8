"""Strategy ``queries``: query generation for the passages of corpus sources (InPars, Promptagator,
GPL, doc2query). For a seeded sample of each corpus's passages (``queries.max_passages``), one
request per passage and kind of query (``queries.types``: question, keyword, claim, title; the
packaged prompts ``queries-<type>.yaml``) asks for ``per_type`` queries; each answer's queries
become retrieval records of dataset <corpus name> (query, the passage as positive, origin
``synthetic``, the passage's ``source_ref``). They go through the stage's filters (lengths, copies,
duplicates, contamination: ``filters.py``), then a word-count filter and round-trip consistency
(``consistency.py``) and, when configured, the LLM judge (``judge.py``); every drop is a row of
``_filtered.parquet`` with its reason. With ``queries.personas``, each passage's requests name one
persona (drawn by seed and passage id) through the prompts' ``$persona_note``, which is empty
without personas (so the rendered prompts, and the cache keys, are those of a config without the
key)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from embed_core.errors import ConfigError
from embed_core.schema import Record
from embed_core.synthesize.config import SynthesizeConfig
from embed_core.synthesize.consistency import round_trip
from embed_core.synthesize.filters import Candidate
from embed_core.synthesize.jobs import Job, Outcome
from embed_core.synthesize.prompts import PromptTemplate

STRATEGY = "queries"


def _draw(seed: int, passage_id: str) -> bytes:
    return hashlib.sha256(f"{seed}:queries:{passage_id}".encode()).digest()


def persona_for(personas: list[str], seed: int, passage_id: str) -> str | None:
    """The persona of a passage's requests: a draw by seed and passage id (stable across reruns,
    budgets and corpus order); None without personas."""
    if not personas:
        return None
    h = int.from_bytes(hashlib.sha256(f"{seed}:persona:{passage_id}".encode()).digest()[:8], "big")
    return personas[h % len(personas)]


def persona_note(persona: str | None) -> str:
    """What ``$persona_note`` becomes in a query prompt (after its first sentence)."""
    return f" Here the searcher is {persona}; write the queries as they would." if persona else ""


def sample_passages(table: pa.Table, budget: int | None, seed: int) -> list[dict[str, Any]]:
    """``budget`` passages of a corpus artifact, a seeded draw by id (a larger budget keeps the
    smaller one's passages), in corpus order; all of them with no budget."""
    rows = table.to_pylist()
    if budget is None or budget >= len(rows):
        return rows
    chosen = set(sorted(range(len(rows)), key=lambda i: _draw(seed, rows[i]["id"]))[:budget])
    return [r for i, r in enumerate(rows) if i in chosen]


def plan_query_jobs(cfg: SynthesizeConfig, corpora: dict[str, pa.Table], templates: dict[str, PromptTemplate],
                    seed: int) -> list[Job]:
    """One job per sampled passage and kind of query; the passage rides along as a record (its
    text the only positive) so the job's answer knows what it was asked about."""
    q = cfg.queries
    for kind in q.types if q.personas else ():
        tpl = templates[f"queries-{kind}"]
        if "$persona" not in tpl.chat_user + tpl.completion:
            raise ConfigError(f"{tpl.source}: synthesize.queries.personas are set, but template {tpl.name!r} has no "
                              "$persona_note (or $persona) placeholder to put them in")
    jobs = []
    for name, table in sorted(corpora.items()):
        for p in sample_passages(table, q.max_passages, seed):
            persona = persona_for(q.personas, seed, p["id"])
            passage = Record(id=p["id"], dataset=name, task="retrieval", query="", positives=[p["text"]],
                             origin="synthetic", source_ref=p["source_ref"])
            for kind in q.types:
                values = {"passage": p["text"], "k": str(q.per_type), "type": kind, "persona_note": persona_note(persona)}
                jobs.append(Job(STRATEGY, name, passage, templates[f"queries-{kind}"],
                                {**values, "persona": persona} if persona else values))
    return jobs


def query_candidates(o: Outcome) -> list[Candidate]:
    """The records of one answered request: one per generated query."""
    passage, kind = o.job.record, o.job.values["type"]
    out = []
    for i, query in enumerate(o.answer.queries):
        rec = Record(id=f"{passage.id}~{kind}{i}", dataset=passage.dataset, task="retrieval", query=query,
                     positives=list(passage.positives), origin="synthetic", source_ref=passage.source_ref)
        out.append(Candidate(o, rec, {"query": query}, []))
    return out


def query_dropped(c: Candidate, reason: str, scores: dict[str, float] | None = None) -> dict[str, Any]:
    return {"dataset": c.outcome.job.dataset, "source_id": c.outcome.job.record.id, "strategy": STRATEGY,
            "reason": reason, "generated": json.dumps(c.generated, ensure_ascii=False),
            "scores": json.dumps(scores or {})}


def word_filter(cfg: SynthesizeConfig, candidates: list[Candidate]) -> tuple[list[Candidate], list[dict]]:
    """``queries.min_words`` / ``max_words``: (kept, dropped rows)."""
    q = cfg.queries
    kept, dropped = [], []
    for c in candidates:
        words = len(c.record.query.split())
        if words < q.min_words:
            dropped.append(query_dropped(c, "too_few_words", {"words": words}))
        elif words > q.max_words:
            dropped.append(query_dropped(c, "too_many_words", {"words": words}))
        else:
            kept.append(c)
    return kept, dropped


def round_trip_filter(cfg: SynthesizeConfig, kept: list[Candidate], corpora: dict[str, pa.Table],
                      embed_for: Callable[[], Callable[[list[str]], np.ndarray]]) -> tuple[list[Candidate], list[dict]]:
    """Round-trip consistency per corpus with ``queries.round_trip`` (none when it is off): (kept, dropped rows)."""
    q = cfg.queries
    if q.round_trip is None or not kept:
        return kept, []
    embed = embed_for()
    survivors, dropped = [], []
    for name in sorted({c.record.dataset for c in kept}):
        mine = [c for c in kept if c.record.dataset == name]
        ids = corpora[name].column("id").to_pylist()
        where = {pid: i for i, pid in enumerate(ids)}
        keep, ranks = round_trip([c.record.query for c in mine], [where[c.outcome.job.record.id] for c in mine],
                                 corpora[name].column("text").to_pylist(), embed, q.round_trip.top_k)
        for c, ok, rank in zip(mine, keep, ranks):
            if ok:
                survivors.append(c)
            else:
                dropped.append(query_dropped(c, "round_trip", {"rank": int(rank), "top_k": q.round_trip.top_k}))
    return survivors, dropped
