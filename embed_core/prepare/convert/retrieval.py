"""Retrieval sources (QZhou §3.2.1): title–body, claim–evidence, question–answer, FlagEmbedding JSONL.

* title–body/abstract: title → query, body → positive (over-long bodies are truncated by the
  cleaning step to ``cleaning.max_chars``).
* claim–evidence: claim → query; evidence labelled Supports → positive, Refutes → negative;
  rows of the same claim are merged into one record. Evidence may be given as text, or as a
  document id looked up in ``corpus`` (e.g. SciFact's ``evidence_doc_id``).
* question–answer: question → query, answer → positive.
* FlagEmbedding JSONL: ``query``, ``pos``, ``neg``, ``pos_scores``, ``neg_scores``, ``prompt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embed_core.config import SourceSpec
from embed_core.errors import RowError
from embed_core.prepare.convert.base import (
    Columns,
    ConvertStream,
    Skipped,
    get_score_list,
    get_text,
    get_text_list,
    map_label,
    record_id,
)
from embed_core.prepare.readers import RawRow, read_jsonl
from embed_core.schema import Record, is_blank

TITLE_BODY_COLUMNS = ({"title": "title", "body": "text"}, {"title": 0, "body": 1})
QA_COLUMNS = ({"question": "question", "answer": "answer"}, {"question": 0, "answer": 1})
CLAIM_COLUMNS = ({"claim": "claim", "evidence": "evidence", "label": "label"}, {"claim": 0, "evidence": 1, "label": 2})
FLAG_COLUMNS = ({"query": "query", "pos": "pos", "neg": "neg", "pos_scores": "pos_scores",
                 "neg_scores": "neg_scores", "prompt": "prompt", "label": "category"},
                {"query": 0, "pos": 1, "neg": 2, "pos_scores": 3, "neg_scores": 4, "prompt": 5, "label": 6})
FLAG_OPTIONAL = ("neg", "pos_scores", "neg_scores", "prompt", "label")

CLAIM_LABELS = {
    "supports": "positive", "support": "positive", "supported": "positive",
    "refutes": "negative", "refute": "negative", "refuted": "negative",
    "contradict": "negative", "contradicts": "negative",
    "not enough info": "ignore", "nei": "ignore",
}


def _base(spec: SourceSpec, raw: RawRow) -> dict[str, Any]:
    return dict(dataset=spec.name, task=spec.task or "retrieval", instruction=spec.instruction,
                origin="original", source_ref=raw.ref)


def _two_texts(rows, spec: SourceSpec, cols: Columns, first: str, second: str) -> ConvertStream:
    for raw in rows:
        if isinstance(raw, RowError):
            yield raw
            continue
        try:
            query = get_text(raw, cols[first])
            positive = get_text(raw, cols[second])
        except RowError as err:
            yield err
            continue
        yield Record(id=record_id(spec, raw), query=query, positives=[positive], **_base(spec, raw))


def convert_title_body(rows, spec: SourceSpec, cols: Columns) -> ConvertStream:
    return _two_texts(rows, spec, cols, "title", "body")


def convert_qa(rows, spec: SourceSpec, cols: Columns) -> ConvertStream:
    return _two_texts(rows, spec, cols, "question", "answer")


def load_corpus(path: Path, display: str) -> tuple[dict[str, str], list[RowError]]:
    """BEIR-style corpus JSONL → {doc id: "title text"} (title joined as BEIR/MTEB do)."""
    docs: dict[str, str] = {}
    errors: list[RowError] = []
    for raw in read_jsonl(path, display):
        if isinstance(raw, RowError):
            errors.append(raw)
            continue
        doc_id = raw.values.get("_id")
        text = raw.values.get("text")
        if doc_id is None:
            errors.append(RowError(raw.file, raw.row, "_id", "missing_field", "missing field"))
            continue
        if not isinstance(text, str):
            errors.append(RowError(raw.file, raw.row, "text", "missing_field" if text is None else "wrong_type",
                                   "missing field" if text is None else "expected text"))
            continue
        title = raw.values.get("title") or ""
        full = f"{title.strip()} {text.strip()}".strip() if isinstance(title, str) else text.strip()
        if is_blank(full):
            errors.append(RowError(raw.file, raw.row, "text", "empty_text", "empty text"))
            continue
        docs[str(doc_id)] = full
    return docs, errors


def convert_claim_evidence(rows, spec: SourceSpec, cols: Columns, corpus: dict[str, str] | None = None) -> ConvertStream:
    mapping = spec.label_map or CLAIM_LABELS
    claims: dict[str, dict[str, Any]] = {}  # claim text -> first row, positives, negatives (file order)
    for raw in rows:
        if isinstance(raw, RowError):
            yield raw
            continue
        try:
            claim = get_text(raw, cols["claim"])
            role = map_label(raw, cols["label"], mapping)
            if role == "ignore":
                yield Skipped(raw.file, raw.row, "ignored_label")
                continue
            if role not in ("positive", "negative"):
                raise RowError(raw.file, raw.row, str(cols["label"]), "config",
                               f"label_map must map to 'positive', 'negative' or 'ignore', got {role!r}")
            evidence = get_text(raw, cols["evidence"])
            if corpus is not None:
                doc_key = evidence.removesuffix(".0")  # ids read from CSV as floats
                if doc_key not in corpus:
                    raise RowError(raw.file, raw.row, str(cols["evidence"]), "unknown_doc",
                                   f"evidence id {evidence!r} not in corpus {spec.corpus}")
                evidence = corpus[doc_key]
        except RowError as err:
            yield err
            continue
        entry = claims.setdefault(claim, {"raw": raw, "pos": [], "neg": []})
        bucket = entry["pos"] if role == "positive" else entry["neg"]
        if evidence not in bucket:
            bucket.append(evidence)
    for claim, entry in claims.items():
        raw = entry["raw"]
        if not entry["pos"]:
            yield RowError(raw.file, raw.row, str(cols["label"]), "no_positive",
                           "claim has no supporting evidence (only refuting)")
            continue
        yield Record(id=record_id(spec, raw), query=claim, positives=entry["pos"], negatives=entry["neg"],
                     **_base(spec, raw))


def convert_flagembedding(rows, spec: SourceSpec, cols: Columns) -> ConvertStream:
    for raw in rows:
        if isinstance(raw, RowError):
            yield raw
            continue
        try:
            query = get_text(raw, cols["query"])
            pos = get_text_list(raw, cols["pos"])
            neg = get_text_list(raw, cols["neg"], allow_missing=True)
            pos_scores = get_score_list(raw, cols["pos_scores"], len(pos), spec.score_range)
            neg_scores = get_score_list(raw, cols["neg_scores"], len(neg), spec.score_range)
            prompt = raw.values.get(cols["prompt"])
            label = raw.values.get(cols["label"])
        except RowError as err:
            yield err
            continue
        base = _base(spec, raw)
        if isinstance(prompt, str) and prompt.strip() and not spec.instruction:
            base["instruction"] = prompt.strip()
        yield Record(id=record_id(spec, raw), query=query, positives=pos, positive_scores=pos_scores,
                     negatives=neg, negative_scores=neg_scores,
                     label=str(label) if label is not None else None, **base)
