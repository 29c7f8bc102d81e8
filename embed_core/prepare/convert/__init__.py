"""Converters: one per source kind, each a small function from raw rows to unified records.

``convert_source(spec, config)`` reads a configured source and yields ``Record`` for good rows,
``RowError`` for bad ones (to quarantine) and ``Skipped`` for rows deliberately left out.
``source_texts(spec, config)`` yields the raw texts of a source (used for contamination checks).
"""

from __future__ import annotations

from collections.abc import Iterator

from embed_core.config import RunConfig, SourceSpec
from embed_core.errors import ConfigError, RowError
from embed_core.prepare.convert.base import Columns, ConvertStream, Skipped, get_text
from embed_core.prepare.convert.beir import beir_eval_queries, beir_files, convert_beir
from embed_core.prepare.convert.classification import CLASSIFICATION_COLUMNS, convert_classification
from embed_core.prepare.convert.pairs import (
    ENTAILMENT_COLUMNS,
    PAIR_COLUMNS,
    STS_COLUMNS,
    convert_entailment,
    convert_pair_classification,
    convert_sts,
)
from embed_core.prepare.convert.retrieval import (
    CLAIM_COLUMNS,
    FLAG_COLUMNS,
    FLAG_OPTIONAL,
    QA_COLUMNS,
    TITLE_BODY_COLUMNS,
    convert_claim_evidence,
    convert_flagembedding,
    convert_qa,
    convert_title_body,
    load_corpus,
)
from embed_core.prepare.readers import read_rows

__all__ = ["convert_source", "source_texts", "source_pairs", "source_files", "Skipped", "COLUMN_SPECS"]

# kind -> (default column names, default positions without a header, optional logical fields)
COLUMN_SPECS: dict[str, tuple[dict[str, str], dict[str, int], tuple[str, ...]]] = {
    "sts": (*STS_COLUMNS, ()),
    "entailment": (*ENTAILMENT_COLUMNS, ()),
    "pair_classification": (*PAIR_COLUMNS, ()),
    "title_body": (*TITLE_BODY_COLUMNS, ()),
    "qa": (*QA_COLUMNS, ()),
    "claim_evidence": (*CLAIM_COLUMNS, ()),
    "classification": (*CLASSIFICATION_COLUMNS, ()),
    "flagembedding": (*FLAG_COLUMNS, FLAG_OPTIONAL),
}

# Which logical fields hold the texts a contamination check compares (per kind).
_TEXT_FIELDS = {
    "sts": ("text1", "text2"), "entailment": ("text1", "text2"), "pair_classification": ("text1", "text2"),
    "title_body": ("title",), "qa": ("question",), "claim_evidence": ("claim",),
    "classification": ("text",), "flagembedding": ("query",),
}


def _columns(spec: SourceSpec) -> Columns:
    names, positions, optional = COLUMN_SPECS[spec.kind]
    return Columns(spec, names, positions, optional)


def _rows(spec: SourceSpec, config: RunConfig, cols: Columns):
    rows = read_rows(config.resolve(spec.path), spec.path, fmt=spec.format, delimiter=spec.delimiter,
                     header=spec.header, quoting=spec.quoting, multiline=spec.multiline, required=cols.required())
    if spec.max_rows is None:
        return rows
    return _limit(rows, spec.max_rows)


def _limit(rows, n: int):
    seen = 0
    for item in rows:
        if seen >= n:
            return
        if not isinstance(item, RowError):
            seen += 1
        yield item


def convert_source(spec: SourceSpec, config: RunConfig) -> ConvertStream:
    if spec.kind == "beir":
        return convert_beir(spec, config.resolve(spec.path))
    cols = _columns(spec)
    rows = _rows(spec, config, cols)
    if spec.kind == "sts":
        return convert_sts(rows, spec, cols)
    if spec.kind == "entailment":
        return convert_entailment(rows, spec, cols)
    if spec.kind == "pair_classification":
        return convert_pair_classification(rows, spec, cols)
    if spec.kind == "title_body":
        return convert_title_body(rows, spec, cols)
    if spec.kind == "qa":
        return convert_qa(rows, spec, cols)
    if spec.kind == "classification":
        return convert_classification(rows, spec, cols, seed=config.seed)
    if spec.kind == "flagembedding":
        return convert_flagembedding(rows, spec, cols)
    if spec.kind == "claim_evidence":
        corpus = None
        if spec.corpus:
            corpus, _ = load_corpus(config.resolve(spec.corpus), spec.corpus)
        return convert_claim_evidence(rows, spec, cols, corpus)
    raise AssertionError(f"unhandled kind {spec.kind}")  # pydantic restricts kind


def source_texts(spec: SourceSpec, config: RunConfig) -> Iterator[str]:
    """Raw texts of an evaluation source: BEIR judged queries of ``split``, or the kind's text columns."""
    if spec.kind == "beir":
        yield from beir_eval_queries(config.resolve(spec.path), spec.path, spec.split)
        return
    cols = _columns(spec)
    for raw in _rows(spec, config, cols):
        if isinstance(raw, RowError):
            continue
        for logical in _TEXT_FIELDS[spec.kind]:
            try:
                yield get_text(raw, cols[logical])
            except RowError:
                continue


def source_pairs(spec: SourceSpec, config: RunConfig) -> Iterator[tuple[str, str]]:
    """(text1, text2) of a pair source (sts / entailment / pair_classification)."""
    if spec.kind not in ("sts", "entailment", "pair_classification"):
        raise ConfigError(f"contamination source '{spec.name}': match 'pair' needs a pair kind, not '{spec.kind}'")
    cols = _columns(spec)
    for raw in _rows(spec, config, cols):
        if isinstance(raw, RowError):
            continue
        try:
            yield get_text(raw, cols["text1"]), get_text(raw, cols["text2"])
        except RowError:
            continue


def source_files(spec: SourceSpec, config: RunConfig) -> list[tuple[str, "object"]]:
    """(display name, resolved path) of every file a source reads: what its fingerprint hashes."""
    if spec.kind == "beir":
        files = beir_files(config.resolve(spec.path), spec.path.rstrip("/"), spec.split)
        return [(display, path) for path, display in files.values()]
    out = [(spec.path, config.resolve(spec.path))]
    if spec.dev_path:
        out.append((spec.dev_path, config.resolve(spec.dev_path)))
    if spec.kind == "claim_evidence" and spec.corpus:
        out.append((spec.corpus, config.resolve(spec.corpus)))
    return out
