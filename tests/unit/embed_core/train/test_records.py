"""Training records memory-mapped from Arrow copies (embed_core.train.records)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from embed_core.artifacts import StageWriter, read_records
from embed_core.errors import SchemaError
from embed_core.schema import Record, records_to_table
from embed_core.train.engine.batches import DatasetRecords, build_batch
from embed_core.train.records import mapped_records


def _records(n: int, dup_at: int | None = None) -> pa.Table:
    return records_to_table([
        Record(id=f"d:{0 if i == dup_at else i}", dataset="d", task="classification", query=f"text {i} " * (i % 7 + 1),
               instruction="Classify the text.", positives=[f"same {i}", f"also {i}"], positive_scores=[],
               negatives=[f"other {i}", f"more {i}", f"third {i}"], negative_labels=["b", "c", "b"],
               label="a" if i % 2 else "z", origin="original", source_ref=f"f:{i}")
        for i in range(n)])


def _stage(tmp_path, table: pa.Table):
    with StageWriter(tmp_path, "prepare") as w:
        w.write_table("d.parquet", table, kind="records")
        w.commit({"input_fingerprint": "k"})


def test_memory_mapped_records_build_the_same_batches_as_records_read_into_memory(tmp_path):
    _stage(tmp_path, _records(300))
    mapped = DatasetRecords("d", *mapped_records(tmp_path, "prepare", tmp_path / "cache")["d.parquet"])
    loaded = DatasetRecords("d", read_records(tmp_path, "prepare")["d.parquet"])
    assert (mapped.task, mapped.size, mapped.label_ids, mapped.max_score, mapped.instructions()) == \
        (loaded.task, loaded.size, loaded.label_ids, loaded.max_score, loaded.instructions()) == \
        ("classification", 300, {"a": 0, "b": 1, "c": 2, "z": 3}, 1.0, {"Classify the text."})
    for step, rows in enumerate(([0, 5, 299], [17, 3, 250, 12])):
        a, b = (build_batch(r, rows, step=step, seed=1, num_negatives=2, query_max_length=16, passage_max_length=16,
                            use_instructions=True) for r in (mapped, loaded))
        assert a == b
    assert list(mapped.cols["query"])[:2] == ["text 0 ", "text 1 text 1 "]


def test_opening_memory_mapped_records_allocates_nothing_for_their_texts(tmp_path):
    _stage(tmp_path, _records(5000))
    mapped_records(tmp_path, "prepare", tmp_path / "cache")  # converts once
    before = pa.total_allocated_bytes()
    table, summary = mapped_records(tmp_path, "prepare", tmp_path / "cache")["d.parquet"]
    records = DatasetRecords("d", table, summary)
    build_batch(records, [1, 4000], step=0, seed=0, num_negatives=1, query_max_length=8, passage_max_length=8,
                use_instructions=False)
    assert table.nbytes > 400_000
    # the labels, scores and instructions come from the summary beside the copy
    assert pa.total_allocated_bytes() - before < 10_000
    assert records.cols["query"][4000] == "text 4000 " * (4000 % 7 + 1)


def test_a_duplicate_id_in_the_records_is_refused_naming_file_row_and_first_row_and_leaves_no_copy(tmp_path):
    _stage(tmp_path, _records(9000, dup_at=8500))
    with pytest.raises(SchemaError) as err:
        mapped_records(tmp_path, "prepare", tmp_path / "cache")
    assert "d.parquet" in str(err.value) and "8500" in str(err.value) and "first at row 0" in str(err.value)
    assert err.value.field == "id"
    assert list((tmp_path / "cache").iterdir()) == []
