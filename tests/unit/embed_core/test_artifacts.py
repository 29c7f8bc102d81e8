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


def test_a_manifest_without_its_input_fingerprint_is_refused_and_the_previous_artifact_stays(tmp_path):
    from pydantic import ValidationError

    with StageWriter(tmp_path, "s") as w:
        w.write_file("a.txt", b"one", kind="note")
        w.commit({"input_fingerprint": "k1", "counts": {"n": 1}})
    with pytest.raises(ValidationError, match="input_fingerprint"):
        with StageWriter(tmp_path, "s") as w:
            w.write_file("a.txt", b"two", kind="note")
            w.commit({"counts": {"n": 2}})
    manifest = read_manifest(tmp_path, "s")
    assert manifest["input_fingerprint"] == "k1" and manifest["counts"] == {"n": 1}
    assert (tmp_path / "s" / "a.txt").read_bytes() == b"one"
    assert set(manifest["outputs"]["a.txt"]) == {"kind", "sha256"}


def test_a_file_that_is_not_a_manifest_reads_as_missing(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "manifest.json").write_text('{"stage": "s"}')
    assert read_manifest(tmp_path, "s") is None and not stage_is_intact(tmp_path, "s")


def test_a_streamed_table_is_written_in_row_groups_and_registered_with_its_rows_and_hash(tmp_path):
    import pyarrow.parquet as pq

    from embed_core.schema import RECORD_SCHEMA

    rows = table(25).to_pylist()
    with StageWriter(tmp_path, "prepare") as w:
        stream = w.stream_table("d.parquet", RECORD_SCHEMA, kind="records", rows_per_group=10)
        for row in rows:
            stream.append(row)
        (w.scratch / "spill.tmp").write_text("scratch files never reach the artifact")
        w.commit({"input_fingerprint": "k1"})  # closes the stream: the last 5 rows are flushed
    assert pq.read_metadata(tmp_path / "prepare" / "d.parquet").num_row_groups == 3
    assert read_manifest(tmp_path, "prepare")["outputs"]["d.parquet"]["rows"] == 25
    assert read_records(tmp_path, "prepare")["d.parquet"].to_pylist() == rows
    assert sorted(p.name for p in (tmp_path / "prepare").iterdir()) == ["d.parquet", "manifest.json"]

    with pytest.raises(RuntimeError):
        with StageWriter(tmp_path, "prepare") as w:
            stream = w.stream_table("d.parquet", RECORD_SCHEMA, kind="records", rows_per_group=10)
            for row in rows[:12]:
                stream.append(row)
            raise RuntimeError("the stage dies with a half-written stream")
    assert read_records(tmp_path, "prepare")["d.parquet"].num_rows == 25
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepare"]


def test_a_tree_registered_with_a_link_out_of_the_staging_directory_is_refused(tmp_path):
    from embed_core.paths import OutsideRootError

    (tmp_path / "secret.txt").write_text("not an output")
    with pytest.raises(OutsideRootError, match="leak.txt: a symbolic link to"):
        with StageWriter(tmp_path / "run", "train-s1") as w:
            (w.staging / "model").mkdir()
            (w.staging / "model/config.json").write_text("{}")
            (w.staging / "model/leak.txt").symlink_to(tmp_path / "secret.txt")
            w.register_tree("model", kind="model")
    assert not (tmp_path / "run/train-s1").exists()


def test_a_write_that_runs_out_of_space_is_one_line_naming_the_stage_and_the_previous_artifact_stays(tmp_path):
    """A real failed write without root: the process's file-size limit (RLIMIT_FSIZE) makes the
    kernel refuse pyarrow's write with EFBIG, as a full disk refuses it with ENOSPC."""
    import subprocess
    import sys
    import textwrap

    with StageWriter(tmp_path, "prepare") as w:
        w.write_table("d.parquet", table(3), kind="records")
        w.commit({"input_fingerprint": "k1"})
    before = (tmp_path / "prepare/d.parquet").read_bytes()
    code = textwrap.dedent("""
        import os, resource, signal, sys
        import pyarrow as pa
        from embed_core.artifacts import StageWriter
        from embed_core.errors import DiskFullError

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        big = pa.table({"text": [os.urandom(64).hex() for _ in range(20000)]})
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            with StageWriter(sys.argv[1], "prepare") as w:
                w.write_table("d.parquet", big, kind="records")
        except DiskFullError as exc:
            print(exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert line.startswith(f"{tmp_path}/.prepare.staging-"), line
    assert "no space left to write the prepare stage (EFBIG" in line and f"{tmp_path / 'prepare'} is as it was" in line
    assert (tmp_path / "prepare/d.parquet").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepare"]
