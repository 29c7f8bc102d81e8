"""A corpus without queries (``kind: corpus``): documents split into passages, each with an id and
its ``source_ref`` (file, JSONL line, character span of the document's text).

Passages are not training records (a record needs a query): prepare writes them to the corpus
artifact ``prepare/corpus-<name>.parquet`` (``embed_core/prepare/corpus.py``), cleaned, deduplicated
and checked against the contamination sets like records, and the synthesize strategy ``queries``
generates queries for them; ``mine.corpora`` can name the source's documents as the mining pool.
Documents are read by ``embed_core/prepare/documents.py``, split by ``embed_core/prepare/chunking.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import ClassVar

from pydantic import Field, model_validator

from embed_core.errors import RowError
from embed_core.prepare.chunking import Chunker
from embed_core.prepare.convert.base import Converter, ConverterParams, Skipped
from embed_core.prepare.documents import SUFFIXES, corpus_files, read_documents
from embed_core.prepare.readers import root_for
from embed_core.schema import CORPUS_KIND


@dataclass(frozen=True)
class Passage:
    id: str
    text: str
    source_ref: str  # <file>[:<line>]:<start>-<end>, characters of the document's text


class Corpus(Converter):
    """A file or folder of documents → passages (not records: see the module docstring)."""

    kind = "corpus"
    one_file: ClassVar[bool] = False
    produces: ClassVar[str] = CORPUS_KIND  # prepare writes a corpus artifact, not records

    class Params(ConverterParams):
        chunk_tokens: int = Field(256, ge=8, description="Largest passage, in tokens of `tokenizer` (no special "
                                  "tokens): documents are split at the largest boundary that fits (blank line, line, "
                                  "sentence, clause, word; semchunk).")
        chunk_overlap: int = Field(0, ge=0, description="Tokens a passage shares with the one before it (0: none).")
        tokenizer: str = Field("default", description="Model directory whose tokenizer.json counts tokens "
                               "('default': the packaged all-MiniLM-L6-v2); use the base model you train.")
        min_chars: int = Field(20, ge=1, description="Passages shorter than this (characters) are skipped "
                               "(counted): headings and stray lines are no passages.")
        suffixes: list[str] = Field(default_factory=lambda: list(SUFFIXES), description="File name endings read "
                                    "from a folder (a file given as path is read whatever its name).")
        text_field: str = Field("text", description="JSONL: the field holding a document's text.")
        title_field: str | None = Field("title", description="JSONL: a field put before the text, separated by a "
                                        "blank line (BEIR's title); None: none.")
        id_field: str | None = Field("_id", description="JSONL: the document id used in passage ids (missing: "
                                     "the line number).")

        @model_validator(mode="after")
        def _overlap_below_size(self):
            if self.chunk_overlap >= self.chunk_tokens:
                raise ValueError(f"chunk_overlap {self.chunk_overlap} must be below chunk_tokens {self.chunk_tokens}")
            return self

    def _files(self) -> list[tuple[str, Path]]:
        spec = self.spec
        return corpus_files(self.run.resolve(spec.path), spec.path, root_for(self.run.resolve, spec.path),
                            tuple(s.lower() for s in self.params.suffixes))

    def files(self) -> list[tuple[str, Path]]:
        return self._files()

    def records(self) -> Iterator[Passage | RowError | Skipped]:
        """The passages of every document (a bad document is one RowError, a short passage Skipped)."""
        p = self.params
        chunker = Chunker.for_tokenizer(p.tokenizer, p.chunk_tokens, p.chunk_overlap)
        documents = 0
        for display, path in self._files():
            for doc in read_documents(display, path, text_field=p.text_field, title_field=p.title_field,
                                      id_field=p.id_field, limits=self.spec.limits):
                if isinstance(doc, RowError):
                    yield doc
                    continue
                documents += 1
                if self.spec.max_rows is not None and documents > self.spec.max_rows:  # max_rows: documents
                    return
                base = doc.doc_id if doc.line is not None else PurePath(doc.file).as_posix()
                for n, (start, end) in enumerate(chunker.spans(doc.text)):
                    text = doc.text[start:end]
                    if len(text.strip()) < p.min_chars:
                        yield Skipped(doc.file, doc.line or 0, "short_passage")
                        continue
                    yield Passage(f"{self.spec.name}:{base}:{n}", text, f"{doc.ref}:{start}-{end}")

    def texts(self) -> Iterator[str]:
        """The passages' texts (a corpus used as a contamination set)."""
        for item in self.records():
            if isinstance(item, Passage):
                yield item.text
