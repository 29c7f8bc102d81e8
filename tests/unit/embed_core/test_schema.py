import math

import pyarrow as pa
import pytest

from embed_core.errors import SchemaError
from embed_core.schema import (
    RECORD_SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    Record,
    check_table,
    records_to_table,
    table_to_records,
    validate_row,
)


def good(**kw) -> dict:
    rec = Record(id="d:1", dataset="d", task="sts", query="a cat", positives=["a dog"], positive_scores=[3.0],
                 source_ref="f.csv:1")
    row = rec.to_row()
    row.update(kw)
    return row


def test_round_trip_keeps_every_field_and_version():
    recs = [Record(id="d:1", dataset="d", task="classification", query="q", positives=["p"], negatives=["n"],
                   negative_labels=["b"], label="a", source_ref="f.csv:2", weak_positives=["w"])]
    table = records_to_table(recs)
    assert table.schema.metadata[SCHEMA_VERSION_KEY] == SCHEMA_VERSION.encode()
    assert table.schema.names == RECORD_SCHEMA.names
    assert table_to_records(table) == recs
    check_table(table, file="x.parquet")


@pytest.mark.parametrize("change, field, reason", [
    ({"query": "   "}, "query", "empty_text"),
    ({"positive_scores": [math.nan]}, "positive_scores[0]", "nan_score"),
    ({"positive_scores": ["3"]}, "positive_scores[0]", "wrong_type"),
    ({"positives": []}, "positives", "no_positive"),
    ({"positives": ["ok", ""], "positive_scores": [1.0, 2.0]}, "positives[1]", "empty_text"),
    ({"task": "ranking"}, "task", "unknown_task"),
    ({"positive_scores": []}, "positive_scores", "missing_score"),
    ({"positive_scores": [1.0, 2.0]}, "positive_scores", "length_mismatch"),
    ({"query": 5}, "query", "wrong_type"),
    ({"task": "classification", "label": None, "positive_scores": []}, "label", "missing_label"),
])
def test_validation_names_file_row_and_field(change, field, reason):
    with pytest.raises(SchemaError) as info:
        validate_row(good(**change), file="data/x.csv", row_number=7)
    err = info.value
    assert (err.file, err.row, err.field, err.reason) == ("data/x.csv", 7, field, reason)
    assert str(err).startswith(f"data/x.csv:7: field '{field}'")


def test_missing_field_is_named():
    row = good()
    del row["origin"]
    with pytest.raises(SchemaError, match="field 'origin': missing field"):
        validate_row(row, file="f", row_number=1)


def test_check_table_rejects_missing_column_and_bad_row():
    table = records_to_table([Record(**{k: v for k, v in good().items()})])
    with pytest.raises(SchemaError, match="field 'label'"):
        check_table(table.drop_columns(["label"]), file="t.parquet")
    bad = table.set_column(table.schema.get_field_index("positive_scores"), "positive_scores",
                           pa.array([[float("nan")]], pa.list_(pa.float64())))
    with pytest.raises(SchemaError, match=r"t.parquet:0: field 'positive_scores\[0\]'"):
        check_table(bad, file="t.parquet")


def test_duplicate_ids_rejected():
    rec = Record(**good())
    with pytest.raises(SchemaError, match="duplicate id"):
        check_table(records_to_table([rec, rec]), file="t.parquet")
