"""Claim–evidence pairs (QZhou §3.2.1): claim → query; evidence labelled Supports → positive,
Refutes → negative, Not Enough Info → skipped; rows of the same claim are merged into one record.
Evidence may be given as text, or as a document id looked up in ``corpus`` (e.g. SciFact's
``evidence_doc_id``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from embed_core.errors import RowError
from embed_core.prepare.convert.base import Converter, ConverterParams, ConvertStream, Rows, Skipped, map_label
from embed_core.prepare.convert.beir import load_corpus
from embed_core.prepare.readers import RawRow, root_for

Role = Literal["positive", "negative", "ignore"]


class ClaimEvidence(Converter):
    kind = "claim_evidence"
    columns = {"claim": "claim", "evidence": "evidence", "label": "label"}
    text_fields = ("claim",)

    class Params(ConverterParams):
        label_map: dict[str, Role] = Field(
            default_factory=lambda: {
                "supports": "positive", "support": "positive", "supported": "positive",
                "refutes": "negative", "refute": "negative", "refuted": "negative",
                "contradict": "negative", "contradicts": "negative",
                "not enough info": "ignore", "nei": "ignore"},
            min_length=1, description="Raw label (case-insensitive) -> positive, negative or ignore; replaces the "
            "default mapping.")
        corpus: str | None = Field(None, description="JSONL corpus (_id, title, text), relative to data_root, to "
                                   "look the evidence column's document ids up in; None = the column holds text.")

    def files(self) -> list[tuple[str, Path]]:
        out = super().files()
        if self.params.corpus:
            out.append((self.params.corpus, self.run.resolve(self.params.corpus)))
        return out

    def _evidence(self, raw: RawRow, corpus: dict[str, str] | None) -> str:
        evidence = self.text(raw, "evidence")
        if corpus is None:
            return evidence
        doc_key = evidence.removesuffix(".0")  # ids read from CSV as floats
        if doc_key not in corpus:
            raise RowError(raw.file, raw.row, str(self.cols["evidence"]), "unknown_doc",
                           f"evidence id {evidence!r} not in corpus {self.params.corpus}")
        return corpus[doc_key]

    def convert(self, rows: Rows) -> ConvertStream:
        corpus = None
        if self.params.corpus:
            corpus, _ = load_corpus(self.run.resolve(self.params.corpus), self.params.corpus,
                                    root_for(self.run.resolve, self.params.corpus), self.spec.limits)
        claims: dict[str, dict[str, Any]] = {}  # claim text -> first row, positives, negatives (file order)
        for raw in rows:
            if isinstance(raw, RowError):
                yield raw
                continue
            try:
                claim = self.text(raw, "claim")
                role = map_label(raw, self.cols["label"], self.params.label_map)
                if role == "ignore":
                    yield Skipped(raw.file, raw.row, "ignored_label")
                    continue
                evidence = self._evidence(raw, corpus)
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
                yield RowError(raw.file, raw.row, str(self.cols["label"]), "no_positive",
                               "claim has no supporting evidence (only refuting)")
                continue
            yield self.row_record(raw, query=claim, positives=entry["pos"], negatives=entry["neg"])
