"""The unified record: one Arrow schema every stage reads and writes.

One record = one training example, in a format wide enough for every method the pipeline
follows:

* QZhou-Embedding §3.2: retrieval (query, positive, hard negatives), NLI/STS as
  (query, document, score) with scores 0..5 or entailment 2/1/0, classification
  example-based with a class label used by the CLS mask (Eq. 3).
* CoDiEmb A.1.1: ``(t, q, {d+}, {d-}, {y+}, {y-})`` — task id, query, several positives and
  negatives, each with a score.
* Pair-relevance BCE B.1.5: graded relevance r in ``positive_scores``.
* HMCL: three levels — ``positives`` / ``weak_positives`` / ``negatives``.

Fields
------
id               unique within a dataset, stable across reruns (``<dataset>/<row>[~rev]``)
dataset          grouping key for batching (every batch comes from one dataset)
task             one of ``TASKS``; routes a record to its loss
instruction      task instruction ("" when none); symmetric tasks apply it on both sides
query            anchor text
positives        list of positive texts (>= 1)
positive_scores  one float per positive (STS score, entailment 2/1/0, graded relevance) or empty
negatives        list of negative texts
negative_scores  one float per negative (mining scores later) or empty
negative_labels  class label of each negative (classification only, for the CLS mask) or empty
weak_positives   HMCL level-2 texts
label            class label of the query (classification), else null
origin           one of ``ORIGINS``
source_ref       ``<file>:<row>`` the record came from
"""

from __future__ import annotations

import hashlib
import math
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from embed_core.errors import SchemaError

SCHEMA_VERSION = "1.0"
SCHEMA_VERSION_KEY = b"embedpipe.schema_version"

TASKS = ("retrieval", "sts", "nli", "classification", "pair_classification", "clustering")
# The task groups training, planning, dev evaluation and synthesis share (one place for each):
INFONCE_TASKS = ("retrieval",)  # query, positive and hard negatives; InfoNCE over gathered passages
CLS_TASKS = ("classification",)  # a text and its label text; negatives are the other labels
PAIR_TASKS = ("sts", "nli", "pair_classification")  # two texts and a score
TRAINABLE_TASKS = INFONCE_TASKS + CLS_TASKS + PAIR_TASKS
# Tasks whose two sides are interchangeable: instructions go on both sides (BCE paper B.1.1).
SYMMETRIC_TASKS = frozenset({"sts", "nli", "classification", "pair_classification", "clustering"})
# Tasks whose positive_scores are the training signal and therefore required.
SCORED_TASKS = frozenset({"sts", "nli", "pair_classification"})
ORIGINS = ("original", "paraphrase", "augmentation", "llm_negative", "mined", "edited", "synthetic")

_str_list = pa.list_(pa.string())
_float_list = pa.list_(pa.float64())

RECORD_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),
        pa.field("instruction", pa.string(), nullable=False),
        pa.field("query", pa.string(), nullable=False),
        pa.field("positives", _str_list, nullable=False),
        pa.field("positive_scores", _float_list, nullable=False),
        pa.field("negatives", _str_list, nullable=False),
        pa.field("negative_scores", _float_list, nullable=False),
        pa.field("negative_labels", _str_list, nullable=False),
        pa.field("weak_positives", _str_list, nullable=False),
        pa.field("label", pa.string(), nullable=True),
        pa.field("origin", pa.string(), nullable=False),
        pa.field("source_ref", pa.string(), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()},
)
FIELD_NAMES = tuple(RECORD_SCHEMA.names)

# A passage of a corpus source (``kind: corpus``): no query, so no record; prepare writes them as
# ``corpus-<name>.parquet``, output kind CORPUS_KIND (``prepare/corpus.py``, ``artifacts.read_corpora``).
CORPUS_KIND = "corpus"
PASSAGE_SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("dataset", pa.string(), nullable=False),
                            pa.field("text", pa.string(), nullable=False),
                            pa.field("source_ref", pa.string(), nullable=False)])

_TEXT_LIST_FIELDS = ("positives", "negatives", "weak_positives")
_SCORE_LIST_FIELDS = (("positive_scores", "positives"), ("negative_scores", "negatives"))


@dataclass
class Record:
    """In-memory form of one row of ``RECORD_SCHEMA`` (same field names and order)."""

    id: str
    dataset: str
    task: str
    query: str
    positives: list[str]
    instruction: str = ""
    positive_scores: list[float] = field(default_factory=list)
    negatives: list[str] = field(default_factory=list)
    negative_scores: list[float] = field(default_factory=list)
    negative_labels: list[str] = field(default_factory=list)
    weak_positives: list[str] = field(default_factory=list)
    label: str | None = None
    origin: str = "original"
    source_ref: str = ""

    def to_row(self) -> dict:
        """The record as a row (field -> value; lists shared with the record, not copied:
        ``dataclasses.asdict``'s deep copy was most of prepare's time)."""
        return {name: getattr(self, name) for name in FIELD_NAMES}

    def texts(self) -> Iterator[str]:
        """Every text of the record (query first)."""
        yield self.query
        yield from self.positives
        yield from self.negatives
        yield from self.weak_positives


def is_blank(text: str) -> bool:
    """True when ``text`` has nothing a model can read: only whitespace, zero-width or format
    characters (U+200B, U+FEFF, …: Unicode category Cf), control characters (Cc) or U+FFFD (what
    the readers make of a control character)."""
    return all(ch.isspace() or ch == "\ufffd" or unicodedata.category(ch) in ("Cf", "Cc") for ch in text)


def validate_row(row: dict, *, file: str, row_number: int | None) -> None:
    """Check one row (a dict with the schema's fields) and raise ``SchemaError`` on the first problem.

    The error names ``file``, ``row_number`` and the field. Checks: every field present with the
    right type, known task and origin, non-empty texts, finite scores, one score per text where
    scores are given, scores required for scored tasks, a label for classification.
    """

    def fail(fld: str, reason: str, msg: str) -> None:
        raise SchemaError(file, row_number, fld, reason, msg)

    for name in FIELD_NAMES:
        if name not in row:
            fail(name, "missing_field", "missing field")
    for name in ("id", "dataset", "task", "instruction", "query", "origin", "source_ref"):
        if not isinstance(row[name], str):
            fail(name, "wrong_type", f"expected a string, got {type(row[name]).__name__}")
    for name in ("id", "dataset", "query"):
        if is_blank(row[name]):
            fail(name, "empty_text", "empty text")
    if row["task"] not in TASKS:
        fail("task", "unknown_task", f"unknown task {row['task']!r} (expected one of {', '.join(TASKS)})")
    if row["origin"] not in ORIGINS:
        fail("origin", "unknown_origin", f"unknown origin {row['origin']!r} (expected one of {', '.join(ORIGINS)})")
    for name in (*_TEXT_LIST_FIELDS, "negative_labels"):
        value = row[name]
        if not isinstance(value, (list, tuple)):
            fail(name, "wrong_type", f"expected a list of strings, got {type(value).__name__}")
        for i, text in enumerate(value):
            if not isinstance(text, str):
                fail(f"{name}[{i}]", "wrong_type", f"expected a string, got {type(text).__name__}")
            if name != "negative_labels" and is_blank(text):
                fail(f"{name}[{i}]", "empty_text", "empty text")
    if not row["positives"]:
        fail("positives", "no_positive", "a record needs at least one positive")
    for score_name, text_name in _SCORE_LIST_FIELDS:
        scores = row[score_name]
        if not isinstance(scores, (list, tuple)):
            fail(score_name, "wrong_type", f"expected a list of floats, got {type(scores).__name__}")
        for i, s in enumerate(scores):
            if isinstance(s, bool) or not isinstance(s, (int, float)):
                fail(f"{score_name}[{i}]", "wrong_type", f"expected a number, got {s!r}")
            if not math.isfinite(s):
                fail(f"{score_name}[{i}]", "nan_score", f"score is {s}")
        if scores and len(scores) != len(row[text_name]):
            fail(score_name, "length_mismatch",
                 f"{len(scores)} scores for {len(row[text_name])} {text_name}")
    if row["task"] in SCORED_TASKS and not row["positive_scores"]:
        fail("positive_scores", "missing_score", f"task {row['task']!r} needs a score per positive")
    if row["negative_labels"] and len(row["negative_labels"]) != len(row["negatives"]):
        fail("negative_labels", "length_mismatch",
             f"{len(row['negative_labels'])} labels for {len(row['negatives'])} negatives")
    label = row["label"]
    if label is not None and not isinstance(label, str):
        fail("label", "wrong_type", f"expected a string or null, got {type(label).__name__}")
    if row["task"] == "classification" and not (label and label.strip()):
        fail("label", "missing_label", "classification records need a label")


def records_to_table(records: list[Record]) -> pa.Table:
    """Build an Arrow table with ``RECORD_SCHEMA`` (schema version in its metadata)."""
    columns = {name: [getattr(r, name) for r in records] for name in FIELD_NAMES}
    return pa.Table.from_pydict(columns, schema=RECORD_SCHEMA)


def table_to_records(table: pa.Table) -> list[Record]:
    return [Record(**row) for row in table.to_pylist()]


def check_table(table: pa.Table, *, file: str) -> None:
    """Validate a table read from ``file`` against the unified schema, row by row.

    A schema-level mismatch (missing column, wrong Arrow type, other version) raises with
    row ``None``; a bad value raises naming its row and field (``RowChecker``: a slice at a time,
    so a memory-mapped table of millions of records is never turned into Python objects at once).
    """
    check_schema(table.schema, file=file)
    checker = RowChecker(file)
    for batch in table.to_batches(max_chunksize=CHECK_SLICE_ROWS):
        checker.check(batch)
    checker.finish(lambda row: table.column("id")[row].as_py())


CHECK_SLICE_ROWS = 4096


class RowChecker:
    """Rows of one file validated as they stream by (``check`` each slice in order, then
    ``finish``): every row with ``validate_row``, and ids unique, found from an 8-byte BLAKE2b
    digest per row (8 bytes a row held) whose collisions are confirmed on the ids themselves."""

    def __init__(self, file: str):
        self.file = file
        self.rows = 0
        self._digests: list[np.ndarray] = []

    def check(self, batch: pa.RecordBatch | pa.Table) -> None:
        ids = batch.column("id").to_pylist()
        for i, row in enumerate(batch.to_pylist(), start=self.rows):
            validate_row(row, file=self.file, row_number=i)
        self._digests.append(np.fromiter((int.from_bytes(hashlib.blake2b(x.encode(), digest_size=8).digest(), "little")
                                          for x in ids), dtype=np.uint64, count=len(ids)))
        self.rows += len(ids)

    def finish(self, id_at) -> None:
        """Raise on the first row (in file order) whose id an earlier row has, naming that earlier
        row; ``id_at(row)`` reads one row's id (only where two digests are equal)."""
        digests = np.concatenate(self._digests) if self._digests else np.empty(0, dtype=np.uint64)
        order = np.argsort(digests, kind="stable")  # equal digests stay in row order
        ordered = digests[order]
        found: tuple[int, int] | None = None  # (row, first row with its id)
        for k in np.flatnonzero(ordered[1:] == ordered[:-1]) + 1:
            row = int(order[k])
            start = k
            while start > 0 and ordered[start - 1] == ordered[k]:
                start -= 1
            first = next((int(order[j]) for j in range(start, k) if id_at(int(order[j])) == id_at(row)), None)
            if first is not None and (found is None or row < found[0]):
                found = (row, first)
        if found is not None:
            raise SchemaError(self.file, found[0], "id", "duplicate_id",
                              f"duplicate id {id_at(found[0])!r} (first at row {found[1]})")


def check_schema(schema: pa.Schema, *, file: str) -> None:
    """The schema-level half of ``check_table``: version, every column, every column's type."""
    meta = schema.metadata or {}
    version = meta.get(SCHEMA_VERSION_KEY, b"").decode() or None
    if version is not None and version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise SchemaError(file, None, None, "schema_version",
                          f"schema version {version} is not compatible with {SCHEMA_VERSION}")
    for expected in RECORD_SCHEMA:
        if expected.name not in schema.names:
            raise SchemaError(file, None, expected.name, "missing_field", "missing column")
        actual = schema.field(expected.name).type
        if actual != expected.type and not (pa.types.is_null(actual) and expected.nullable):
            raise SchemaError(file, None, expected.name, "wrong_type",
                              f"column type {actual}, expected {expected.type}")
