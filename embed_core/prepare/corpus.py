"""The corpus artifact: the passages of a ``kind: corpus`` source (``convert/corpus.py``), written
by prepare as ``prepare/corpus-<name>.parquet`` (output kind ``corpus``) instead of records.

A passage has no query, so it is no record of the unified schema; it is the input of query
generation (synthesize strategy ``queries``, whose (query, passage) pairs become retrieval records
of dataset ``<name>`` with origin ``synthetic``) and the corpus the round-trip consistency filter
ranks a generated query's passage in. Prepare applies to passages what it applies to records:
length limits (``cleaning.max_chars``), deduplication (exact and normalised: the first of equal
passages is kept), the contamination sets (a passage equal, after normalisation, to an evaluation
text is excluded; with ``near_duplicates`` on, a near duplicate too) and quarantine of bad documents.
Columns: ``id``, ``dataset``, ``text``, ``source_ref`` (``<file>[:<line>]:<start>-<end>``: characters
of the document's text, see ``documents.py``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from embed_core.artifacts import StageWriter, TableStream
from embed_core.errors import RowError, SourceError
from embed_core.prepare.cleaning import EvalTexts, KeyStore, contaminated_field, normalize_text
from embed_core.prepare.convert import Skipped, convert_source
from embed_core.prepare.near_dup import NearDuplicateIndex
from embed_core.schema import CORPUS_KIND, PASSAGE_SCHEMA, Record


def corpus_file(name: str) -> str:
    return f"corpus-{name}.parquet"


def _as_record(passage, name: str) -> Record:
    """A passage as a one-text record, for the checks records go through."""
    return Record(id=passage.id, dataset=name, task="retrieval", query=passage.text, positives=[passage.text],
                  source_ref=passage.source_ref)


def write_corpus(spec, config, writer: StageWriter, keys: KeyStore, quarantine: TableStream, quarantine_row,
                 eval_texts: EvalTexts, near_evals: NearDuplicateIndex | None) -> dict[str, Any]:
    """Convert one corpus source into ``corpus-<name>.parquet``; its counts, in the shape of a
    record source's (``records_converted`` = passages read) plus the corpus's own."""
    cleaning = config.prepare.cleaning
    out = writer.stream_table(corpus_file(spec.name), PASSAGE_SCHEMA, kind=CORPUS_KIND)
    seen = keys.set(f"{spec.name}:corpus")
    counts: Counter = Counter()
    reasons: Counter = Counter()
    for item in convert_source(spec, config):
        if isinstance(item, Skipped):
            counts["skipped"] += 1
            continue
        if isinstance(item, RowError):
            quarantine.append(quarantine_row(spec.name, item))
            reasons[item.reason] += 1
            continue
        counts["converted"] += 1
        text = item.text
        if len(text) > cleaning.max_chars:
            if cleaning.over_long == "quarantine":
                err = RowError(item.source_ref, None, "text", "too_long", f"{len(text)} characters > max_chars")
                quarantine.append(quarantine_row(spec.name, err))
                reasons["too_long"] += 1
                continue
            text, counts["truncated_texts"] = text[: cleaning.max_chars], counts["truncated_texts"] + 1
        if cleaning.dedupe != "none" and not seen.add(normalize_text(text) if cleaning.dedupe == "normalized" else text):
            counts["deduped"] += 1
            continue
        as_record = _as_record(item, spec.name)
        if contaminated_field(as_record, eval_texts) is not None:
            counts["excluded_contamination"] += 1
            continue
        if near_evals is not None and near_evals.match(as_record) is not None:
            counts["excluded_near_duplicate"] += 1
            continue
        out.append({"id": item.id, "dataset": spec.name, "text": text, "source_ref": item.source_ref})
    out.close()
    if out.rows == 0 and not spec.allow_empty:  # success means data: an empty corpus is not a finished one
        quarantined = ", ".join(f"{n} {r}" for r, n in reasons.most_common()) or "none"
        raise SourceError(spec.path, None, None, "empty_source",
                          f"corpus source '{spec.name}' wrote no passage: {counts['converted']} read ({counts['deduped']} "
                          f"duplicates, {counts['excluded_contamination'] + counts['excluded_near_duplicate']} in "
                          f"evaluation sets), {counts['skipped']} too short, quarantined: {quarantined} (a folder's "
                          "documents are its files ending in params.suffixes); set allow_empty: true on the source "
                          "to accept an empty corpus")
    return {"source": spec.name, "kind": spec.kind, "path": spec.path, "records_converted": counts["converted"],
            "rows_skipped": counts["skipped"], "quarantined": sum(reasons.values()),
            "quarantined_by_reason": dict(reasons), "truncated_texts": counts["truncated_texts"], "dev_records": 0,
            "corpus": {"file": corpus_file(spec.name), "passages": out.rows, "deduped": counts["deduped"],
                       "excluded_contamination": counts["excluded_contamination"],
                       "excluded_near_duplicate": counts["excluded_near_duplicate"]}}

