"""BEIR layout: ``corpus.jsonl`` + ``queries.jsonl`` + ``qrels/<split>.tsv`` → one record per query.

Every judged document with relevance > 0 is a positive (grades listed in the source's
``params.weak_positive_grades`` go to ``weak_positives`` instead: HMCL's level 2), with its graded relevance in
``positive_scores`` (highest first), so the graded BCE targets (BCE paper Eq. 4) and CoDiEmb's
multi-positive InfoNCE can use them. Documents judged 0 are kept as negatives with score 0.
Documents are "title text", as BEIR and MTEB encode them. A query whose judgments are all 0 is
skipped (counted). The qrels header is detected (some copies have none).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from embed_core.errors import RowError, SourceError
from embed_core.prepare.convert.base import Converter, ConverterParams, ConvertStream, Skipped, parse_score
from embed_core.config_base import ReadLimits
from embed_core.prepare.readers import DEFAULT_LIMITS, confine, read_delimited, read_jsonl, root_for
from embed_core.schema import is_blank


def _find(directory: Path, display: str, name: str, root: Path | None) -> tuple[Path, str]:
    for candidate in (name, name + ".gz"):
        if (directory / candidate).exists():
            return confine(directory / candidate, f"{display}/{candidate}", root), f"{display}/{candidate}"
    raise SourceError(f"{display}/{name}", None, None, "missing_file", f"file not found in {directory}")


def beir_files(directory: Path, display: str, split: str, root: Path | None = None) -> dict[str, tuple[Path, str]]:
    """(real path, display) of a BEIR directory's files, each confined to ``root`` (``readers.confine``)."""
    confine(directory, display, root)
    if not directory.is_dir():
        raise SourceError(display, None, None, "missing_file", f"BEIR directory not found (resolved to {directory})")
    return {"corpus": _find(directory, display, "corpus.jsonl", root),
            "queries": _find(directory, display, "queries.jsonl", root),
            "qrels": _find(directory, display, f"qrels/{split}.tsv", root)}


def read_qrels(path: Path, display: str, limits: ReadLimits = DEFAULT_LIMITS):
    """(line, query id, doc id, score) per judgment, or RowError; header detected."""
    first = True
    for raw in read_delimited(path, display, delimiter="\t", header=False, quoting="none", required=(),
                              limits=limits):
        if isinstance(raw, RowError):
            yield raw
            continue
        values = [raw.values[i] for i in sorted(raw.values)]
        if first:
            first = False
            try:
                float(values[-1])
            except ValueError:
                continue  # header line
        if len(values) < 3:
            yield RowError(raw.file, raw.row, None, "malformed_line", f"expected 3 fields, got {len(values)}")
            continue
        qid, did, score = values[0], values[-2], values[-1]  # TREC 4-column qrels have an iteration column
        try:
            yield raw.row, qid.strip(), did.strip(), parse_score(score, file=raw.file, row=raw.row, field="score")
        except RowError as err:
            yield err


def read_queries(path: Path, display: str,
                 limits: ReadLimits = DEFAULT_LIMITS) -> tuple[dict[str, tuple[str, int]], list[RowError]]:
    queries: dict[str, tuple[str, int]] = {}
    errors: list[RowError] = []
    for raw in read_jsonl(path, display, limits=limits):
        if isinstance(raw, RowError):
            errors.append(raw)
            continue
        qid, text = raw.values.get("_id"), raw.values.get("text")
        if qid is None:
            errors.append(RowError(raw.file, raw.row, "_id", "missing_field", "missing field"))
        elif not isinstance(text, str) or is_blank(text):
            errors.append(RowError(raw.file, raw.row, "text", "empty_text", "empty or missing text"))
        else:
            queries[str(qid)] = (text.strip(), raw.row)
    return queries, errors


def beir_eval_queries(directory: Path, display: str, split: str, root: Path | None = None,
                      limits: ReadLimits = DEFAULT_LIMITS) -> list[str]:
    """Texts of the queries judged in ``split`` (what contamination exclusion compares against)."""
    files = beir_files(directory, display, split, root)
    queries, _ = read_queries(*files["queries"], limits=limits)
    judged = {item[1] for item in read_qrels(*files["qrels"], limits=limits) if not isinstance(item, RowError)}
    return [queries[q][0] for q in judged if q in queries]


def load_corpus(path: Path, display: str, root: Path | None = None,
                limits: ReadLimits = DEFAULT_LIMITS) -> tuple[dict[str, str], list[RowError]]:
    """BEIR-style corpus JSONL → {doc id: "title text"} (title joined as BEIR/MTEB do)."""
    docs: dict[str, str] = {}
    errors: list[RowError] = []
    for raw in read_jsonl(path, display, root, limits):
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


class Beir(Converter):
    """A BEIR directory (``path``), not a file: no columns, and dev records come from dev_fraction."""

    kind = "beir"
    one_file: ClassVar[bool] = False

    class Params(ConverterParams):
        split: str = Field("train", description="The qrels split read (qrels/{split}.tsv).")
        weak_positive_grades: list[float] | None = Field(
            None, description="Relevance grades that make a judged document a weak-positive (HMCL level 2) "
            "instead of a positive, e.g. [1] for TREC-DL's 'relevant topic, no answer'.")

    def _files(self) -> dict[str, tuple[Path, str]]:
        return beir_files(self.run.resolve(self.spec.path), self.spec.path.rstrip("/"), self.params.split,
                          root_for(self.run.resolve, self.spec.path))

    def files(self) -> list[tuple[str, Path]]:
        return [(display, path) for path, display in self._files().values()]

    def texts(self):
        """The texts of the queries judged in ``split``."""
        yield from beir_eval_queries(self.run.resolve(self.spec.path), self.spec.path, self.params.split,
                                     root_for(self.run.resolve, self.spec.path), self.spec.limits)

    def records(self) -> ConvertStream:
        files = self._files()
        limits = self.spec.limits
        queries, query_errors = read_queries(*files["queries"], limits=limits)
        yield from query_errors
        qrel_rows: list = list(read_qrels(*files["qrels"], limits=limits))
        corpus, corpus_errors = load_corpus(*files["corpus"], limits=limits)
        yield from corpus_errors
        judged: dict[str, list[tuple[str, float, int]]] = {}
        qrels_display = files["qrels"][1]
        for item in qrel_rows:
            if isinstance(item, RowError):
                yield item
                continue
            line, qid, did, score = item
            if qid not in queries:
                yield RowError(qrels_display, line, "query-id", "unknown_query", f"query id {qid!r} not in queries.jsonl")
            elif did not in corpus:
                yield RowError(qrels_display, line, "corpus-id", "unknown_doc", f"document id {did!r} not in corpus.jsonl")
            else:
                judged.setdefault(qid, []).append((did, score, line))
        yield from self._query_records(files["queries"][1], queries, judged, corpus)

    def _query_records(self, queries_display: str, queries: dict[str, tuple[str, int]],
                       judged: dict[str, list[tuple[str, float, int]]], corpus: dict[str, str]) -> ConvertStream:
        weak_grades = set(self.params.weak_positive_grades or ())
        for qid, items in judged.items():
            text, qline = queries[qid]
            pos = sorted(((corpus[d], s) for d, s, _ in items if s > 0 and s not in weak_grades), key=lambda x: -x[1])
            weak = [corpus[d] for d, s, _ in items if s in weak_grades and s > 0]
            neg = [(corpus[d], s) for d, s, _ in items if s <= 0]
            if not pos:
                yield Skipped(queries_display, qline, "no_relevant_document")
                continue
            yield self.record(id=f"{self.spec.name}:q{qid}", source_ref=f"{queries_display}:{qline}", query=text,
                              positives=[p for p, _ in pos], positive_scores=[s for _, s in pos],
                              negatives=[n for n, _ in neg], negative_scores=[s for _, s in neg], weak_positives=weak)
