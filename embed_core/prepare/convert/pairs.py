"""Scored text pairs: STS scores, entailment labels and pair-classification labels.

QZhou §3.2.2: STS pairs become (query, document, score) with binary labels yes/true → 1 and
no/false → 0; entailment/neutral/contradiction become 2/1/0; both kinds are symmetric, so every
pair is also emitted with the roles swapped. Pair classification (MRPC-style 0/1) is handled
like STS (CoDiEmb A.1.1: "same processing pipeline and objective functions as STS").
"""

from __future__ import annotations

from typing import Any

from embed_core.config import SourceSpec
from embed_core.errors import RowError
from embed_core.prepare.convert.base import Columns, ConvertStream, get_score, get_text, map_label, record_id
from embed_core.schema import Record

ENTAILMENT_LABELS = {"entailment": 2.0, "neutral": 1.0, "contradiction": 0.0}
PAIR_LABELS = {"1": 1.0, "0": 0.0, "yes": 1.0, "no": 0.0, "true": 1.0, "false": 0.0}

STS_COLUMNS = ({"text1": "sentence1", "text2": "sentence2", "score": "score"}, {"text1": 0, "text2": 1, "score": 2})
ENTAILMENT_COLUMNS = ({"text1": "premise", "text2": "hypothesis", "label": "label"}, {"text1": 0, "text2": 1, "label": 2})
PAIR_COLUMNS = ({"text1": "sentence1", "text2": "sentence2", "label": "label"}, {"text1": 0, "text2": 1, "label": 2})


def _pairs(rows, spec: SourceSpec, cols: Columns, task: str, score_of) -> ConvertStream:
    for raw in rows:
        if isinstance(raw, RowError):
            yield raw
            continue
        try:
            text1 = get_text(raw, cols["text1"])
            text2 = get_text(raw, cols["text2"])
            score = float(score_of(raw))
        except RowError as err:
            yield err
            continue
        common: dict[str, Any] = dict(dataset=spec.name, task=task, instruction=spec.instruction,
                                      origin="original", source_ref=raw.ref)
        yield Record(id=record_id(spec, raw), query=text1, positives=[text2], positive_scores=[score], **common)
        if spec.both_directions:
            yield Record(id=record_id(spec, raw, "~rev"), query=text2, positives=[text1], positive_scores=[score], **common)


def convert_sts(rows, spec: SourceSpec, cols: Columns) -> ConvertStream:
    if spec.label_map:
        return _pairs(rows, spec, cols, spec.task or "sts", lambda raw: map_label(raw, cols["score"], spec.label_map))
    return _pairs(rows, spec, cols, spec.task or "sts", lambda raw: get_score(raw, cols["score"], spec.score_range))


def convert_entailment(rows, spec: SourceSpec, cols: Columns) -> ConvertStream:
    mapping = spec.label_map or ENTAILMENT_LABELS
    return _pairs(rows, spec, cols, spec.task or "nli", lambda raw: map_label(raw, cols["label"], mapping))


def convert_pair_classification(rows, spec: SourceSpec, cols: Columns) -> ConvertStream:
    mapping = spec.label_map or PAIR_LABELS
    return _pairs(rows, spec, cols, spec.task or "pair_classification",
                  lambda raw: map_label(raw, cols["label"], mapping))
