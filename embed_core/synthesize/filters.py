"""The synthesize stage's filters: a validated answer becomes a candidate record, which is kept
only if it passes the length limits, is no copy (of its source, of a text the dataset has, of the
prompt's few-shot examples), shares no text with the contamination sets, and meets the
embedding-similarity bounds."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from embed_core.prepare.cleaning import EvalTexts, contaminated_field, normalize_text
from embed_core.schema import Record
from embed_core.synthesize.config import SynthesizeConfig
from embed_core.synthesize.jobs import Outcome


@dataclass
class Candidate:
    outcome: Outcome
    record: Record                        # the record to write (new, or the source with a negative)
    generated: dict[str, str]             # field -> generated text
    pairs: list[tuple[str, str, str]]     # (check name, text a, text b) similarities to compute


def to_candidate(o: Outcome) -> Candidate:
    rec, a, strategy = o.job.record, o.answer, o.job.strategy
    if strategy == "hard_negative":
        scores = [] if not rec.negative_scores else [float("nan")] + list(rec.negative_scores)
        new = replace(rec, negatives=[a.negative, *rec.negatives], negative_scores=scores, origin="llm_negative")
        return Candidate(o, new, {"negative": a.negative},
                         [("negative", rec.query, a.negative), ("positive", rec.query, rec.positives[0])])
    if rec.task == "retrieval":
        suffix = "para" if strategy == "paraphrase" else "aug"
        new = Record(id=f"{rec.id}~{suffix}", dataset=rec.dataset, task=rec.task, instruction=rec.instruction,
                     query=a.query, positives=[a.positive],
                     positive_scores=list(rec.positive_scores[:1]) if strategy == "paraphrase" else [],
                     negatives=list(rec.negatives) if strategy == "paraphrase" else [],
                     negative_scores=list(rec.negative_scores) if strategy == "paraphrase" else [],
                     origin=strategy, source_ref=rec.source_ref)
        checks = [("pair", a.query, a.positive)]
        if strategy == "paraphrase":
            checks += [("query_rewrite", rec.query, a.query), ("positive_rewrite", rec.positives[0], a.positive)]
        return Candidate(o, new, {"query": a.query, "positive": a.positive}, checks)
    new = replace(rec, id=f"{rec.id}~para", query=a.text, origin="paraphrase")
    return Candidate(o, new, {"query": a.text}, [("query_rewrite", rec.query, a.text)])


def filter_candidates(cfg: SynthesizeConfig, candidates: list[Candidate], existing: dict[str, set[str]],
                      evals: EvalTexts, embed) -> tuple[list[Candidate], list[dict[str, Any]]]:
    """(kept, filtered rows). ``existing``: normalised texts per dataset (grows with kept texts)."""
    f = cfg.filter
    filtered: list[dict[str, Any]] = []

    def drop(c: Candidate, reason: str, scores: dict[str, float] | None = None) -> None:
        filtered.append({"dataset": c.outcome.job.dataset, "source_id": c.outcome.job.record.id,
                         "strategy": c.outcome.job.strategy, "reason": reason,
                         "generated": json.dumps(c.generated, ensure_ascii=False),
                         "scores": json.dumps(scores or {})})

    survivors = []
    for c in candidates:  # cheap checks first: over-long text is never embedded
        texts = list(c.generated.values())
        if any(len(t) < f.min_chars for t in texts):
            drop(c, "too_short")
        elif any(len(t) > f.max_chars for t in texts):
            drop(c, "too_long")
        else:
            survivors.append(c)

    unique = sorted({t for c in survivors for _, a, b in c.pairs for t in (a, b)})
    vecs = dict(zip(unique, embed(unique))) if unique else {}
    kept = []
    for c in survivors:  # in order: a text kept earlier makes a later identical one a duplicate
        src, ds = c.outcome.job.record, c.outcome.job.dataset
        s = {name: float(np.dot(vecs[a], vecs[b])) for name, a, b in c.pairs}
        if c.outcome.job.strategy == "paraphrase" and normalize_text(c.record.query) == normalize_text(src.query):
            drop(c, "copy_of_source")
        elif any(normalize_text(t) in existing[ds] for t in c.generated.values()):
            drop(c, "duplicate")
        elif _copies_prompt(c):
            drop(c, "copied_from_prompt")
        elif (fld := contaminated_field(c.record, evals)) is not None:
            drop(c, f"contaminated:{fld}")
        elif s.get("query_rewrite", 1.0) < f.paraphrase_min_sim or s.get("positive_rewrite", 1.0) < f.paraphrase_min_sim:
            drop(c, "rewrite_drifted", s)
        elif "pair" in s and s["pair"] < f.pair_min_sim:
            drop(c, "low_query_positive", s)
        elif "negative" in s and s["negative"] >= s["positive"] - f.negative_margin:
            drop(c, "negative_not_below_positive", s)
        elif "negative" in s and s["negative"] < f.negative_min_sim:
            drop(c, "negative_below_floor", s)
        else:
            if "negative" in s and c.record.negative_scores:
                c.record.negative_scores[0] = s["negative"]
            existing[ds].update(normalize_text(t) for t in c.generated.values())
            kept.append(c)
    return kept, filtered


def _copies_prompt(c: Candidate) -> bool:
    """Small base models often repeat a few-shot example instead of answering (seen with Gemma-3-270M)."""
    tpl = c.outcome.job.template
    prompt = normalize_text(" ".join([tpl.completion, tpl.chat_system, tpl.chat_user]))
    return any(len(t) >= 20 and normalize_text(t) in prompt for t in c.generated.values())
