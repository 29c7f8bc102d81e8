import pyarrow as pa
import pytest

from embed_core.artifacts import StageWriter, read_manifest, read_records, stage_is_intact
from embed_core.errors import EmbedpipeError
from embed_core.schema import Record, records_to_table


def table(n):
    return records_to_table([Record(id=f"d:{i}", dataset="d", task="retrieval", query=f"q{i}", positives=["p"],
                                    source_ref=f"f:{i}") for i in range(n)])


def test_commit_swaps_in_and_interrupted_stage_keeps_previous(tmp_path):
    with StageWriter(tmp_path, "prepare") as w:
        w.write_table("d.parquet", table(3), kind="records")
        w.commit({"input_fingerprint": "k1"})
    assert stage_is_intact(tmp_path, "prepare", "k1") and not stage_is_intact(tmp_path, "prepare", "k2")

    class Killed(Exception):
        pass

    with pytest.raises(Killed):
        with StageWriter(tmp_path, "prepare") as w:
            w.write_table("d.parquet", table(5), kind="records")
            raise Killed  # the stage dies before commit
    assert read_records(tmp_path, "prepare")["d.parquet"].num_rows == 3
    assert read_manifest(tmp_path, "prepare")["input_fingerprint"] == "k1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepare"]


def test_tampered_output_is_detected(tmp_path):
    with StageWriter(tmp_path, "prepare") as w:
        w.write_table("d.parquet", table(2), kind="records")
        w.commit({"input_fingerprint": "k"})
    pa.parquet.write_table(table(1), tmp_path / "prepare/d.parquet")
    assert not stage_is_intact(tmp_path, "prepare", "k")
    with pytest.raises(EmbedpipeError, match="changed since its manifest"):
        read_records(tmp_path, "prepare")


def test_no_manifest_means_not_run(tmp_path):
    (tmp_path / "prepare").mkdir()
    with pytest.raises(EmbedpipeError, match="no manifest.json"):
        read_records(tmp_path, "prepare")
