"""The typed stage contract: the manifest envelope the stage writer fills, one class per step, and
the artifact kinds with their readers."""

import json

import pyarrow as pa
import pytest

from embed_core import __version__
from embed_core.artifacts import ARTIFACT_KINDS, StageWriter, read_corpora, read_manifest, read_records
from embed_core.errors import EmbedpipeError
from embed_core.fingerprint import Fingerprint
from embed_core.manifests import (
    STEPS,
    Manifest,
    MineManifest,
    PrepareManifest,
    ReferenceManifest,
    RemineManifest,
    SynthManifest,
    TrainManifest,
    stage_result,
    step_class,
)
from embed_core.schema import CORPUS_KIND, PASSAGE_SCHEMA, RECORD_SCHEMA, SCHEMA_VERSION, Record, records_to_table

PREPARE_COUNTS = {"totals": {"rows_read": 3, "records_written": 2, "quarantined": 1, "quarantined_by_reason": {"x": 1},
                             "skipped": 0, "deduped": 0, "excluded_contamination": 0, "eval_texts": 0, "eval_pairs": 0},
                  "sources": [{"source": "d", "kind": "sts", "path": "d.csv", "records_converted": 2,
                               "rows_skipped": 0, "quarantined": 1}],
                  "datasets": [{"dataset": "d", "records_in": 2, "deduped_exact": 0, "deduped_normalized": 0,
                                "excluded_contamination": 0, "excluded_dev_overlap": 0, "written": 2,
                                "dev_records": 0, "tasks": {"sts": 2}}]}

# a prepare manifest as an earlier version wrote it: no step key, the envelope otherwise whole
OLD_PREPARE = {"stage": "prepare", "run_name": "demo", "input_fingerprint": "k0", "code": "c0", "schema_version": "1.0",
               "package_version": "0.1.0", "created_at": "2026-01-01T00:00:00+0000", "config_hash": "h",
               "outputs": {"d.parquet": {"kind": "records", "sha256": "ab", "rows": 2}},
               "counts": PREPARE_COUNTS, "timings_s": {"total": 1.5}, "inputs": {"d": "ff"}}


def _fingerprint(key="k1"):
    return Fingerprint(stage="prepare", key=key, code="code-1", inputs={})


def test_a_manifest_written_before_the_step_key_reads_by_fields_and_writes_back_unchanged():
    m = PrepareManifest.of(OLD_PREPARE)
    assert (m.step, m.run_name, m.input_fingerprint, m.code) == (None, "demo", "k0", "c0")
    assert (m.counts.totals.records_written, m.counts.datasets[0].tasks, m.near_duplicates_on) == (2, {"sts": 2}, False)
    assert m.counts.datasets[0].excluded_near_duplicate is None and m.hashes("records") == {"d.parquet": "ab"}
    assert m.as_dict() == OLD_PREPARE  # keys the class does not name are kept; none is added


def test_a_reference_manifest_without_run_name_or_code_still_reads_as_a_stage_manifest(tmp_path):
    raw = {k: v for k, v in OLD_PREPARE.items() if k not in ("run_name", "code", "counts")}
    (tmp_path / "reference-s").mkdir()
    (tmp_path / "reference-s/manifest.json").write_text(json.dumps(raw))
    manifest = read_manifest(tmp_path, "reference-s")
    assert manifest is not None and manifest["code"] is None and "run_name" not in manifest and "step" not in manifest


def test_a_manifest_missing_an_envelope_field_is_refused_in_one_line_naming_the_file_and_the_field(tmp_path):
    (tmp_path / "prepare").mkdir()
    (tmp_path / "prepare/manifest.json").write_text(json.dumps({k: v for k, v in OLD_PREPARE.items()
                                                                if k != "input_fingerprint"}))
    with pytest.raises(EmbedpipeError) as err:
        PrepareManifest.read(tmp_path, "prepare")
    line = str(err.value)
    assert "\n" not in line and str(tmp_path / "prepare/manifest.json") in line and "input_fingerprint" in line
    assert read_manifest(tmp_path, "prepare") is None  # the dict reader: a damaged manifest reads as missing


def test_a_manifest_missing_a_counts_field_of_its_step_is_refused_naming_the_field():
    broken = json.loads(json.dumps(OLD_PREPARE))
    del broken["counts"]["totals"]["deduped"]
    with pytest.raises(EmbedpipeError, match=r"manifest.json: not a prepare manifest: field counts\.totals\.deduped"):
        PrepareManifest.of(broken)
    assert Manifest.of(broken).stage == "prepare"  # the envelope alone is intact


def test_a_commit_fills_the_envelope_and_the_stage_gives_only_its_sections(tmp_path):
    with StageWriter(tmp_path, "prepare", PrepareManifest, fingerprint=_fingerprint(), run_name="demo") as w:
        w.write_table("d.parquet", records_to_table([Record(id="d:0", dataset="d", task="retrieval", query="q",
                                                            positives=["p"], source_ref="f:0")]), kind="records")
        returned = w.commit({"counts": PREPARE_COUNTS, "timings_s": {"total": 0.5}})
    on_disk = json.loads((tmp_path / "prepare/manifest.json").read_text())
    assert on_disk == returned
    assert {k: on_disk[k] for k in ("stage", "step", "run_name", "input_fingerprint", "code", "schema_version",
                                    "package_version")} == {
        "stage": "prepare", "step": "prepare", "run_name": "demo", "input_fingerprint": "k1", "code": "code-1",
        "schema_version": SCHEMA_VERSION, "package_version": __version__}
    assert on_disk["counts"] == PREPARE_COUNTS  # written as given: no default of the typed counts added
    assert PrepareManifest.read(tmp_path, "prepare").outputs["d.parquet"].rows == 1


def test_a_stage_that_gives_the_envelope_itself_to_a_writer_that_fills_it_is_refused_before_the_swap(tmp_path):
    with pytest.raises(ValueError, match="input_fingerprint of the manifest is filled by the stage writer"):
        with StageWriter(tmp_path, "prepare", PrepareManifest, fingerprint=_fingerprint(), run_name="demo") as w:
            w.commit({"input_fingerprint": "other", "counts": PREPARE_COUNTS})
    assert not (tmp_path / "prepare").exists()


def test_a_step_whose_counts_miss_a_field_is_refused_at_commit_and_nothing_is_swapped_in(tmp_path):
    counts = {**PREPARE_COUNTS, "totals": {"rows_read": 1}}
    with pytest.raises(ValueError, match="records_written"):
        with StageWriter(tmp_path, "prepare", PrepareManifest, fingerprint=_fingerprint(), run_name="demo") as w:
            w.commit({"counts": counts})
    assert not (tmp_path / "prepare").exists()


def test_a_writer_without_a_step_class_still_takes_the_envelope_in_the_body_as_before(tmp_path):
    with StageWriter(tmp_path, "train-s") as w:
        manifest = w.commit({"run_name": "demo", "input_fingerprint": "k", "code": "c", "stage_name": "s"})
    assert (manifest["run_name"], manifest["input_fingerprint"], manifest["code"]) == ("demo", "k", "c")
    assert "step" not in manifest


def test_a_remining_step_writes_its_own_step_and_reads_as_a_mine_manifest(tmp_path):
    counts = {"datasets": [{"dataset": "d", "records": 2, "mined": False}], "texts_encoded": 0, "cache_size": None}
    with StageWriter(tmp_path, "mine-s2", RemineManifest, fingerprint="k", run_name="demo") as w:
        w.commit({"counts": counts})
    m = MineManifest.read(tmp_path, "mine-s2")
    assert (m.step, m.code, m.counts.datasets[0].negatives_added) == ("remine", None, None)
    assert STEPS[m.step] is RemineManifest


def test_a_train_manifest_reads_its_counts_and_selection_by_field():
    raw = {**OLD_PREPARE, "stage": "train-s", "stage_name": "s", "init_model": "base", "steps": 4,
           "counts": {"steps": 4, "examples": 16, "tokens": 300, "final_loss": 0.5, "selected_step": 2,
                      "selected_dev_score": 0.7},
           "datasets": {"d": {"task": "sts", "records": 2, "weight": 1.0}}}
    m = TrainManifest.of(raw)
    assert (m.counts.selected_step, m.counts.selected_dev_score, m.datasets["d"].weight, m.processes) == (2, 0.7, 1.0, 1)


def test_every_artifact_kind_has_a_reader_and_the_corpus_reads_through_its_own(tmp_path):
    assert set(ARTIFACT_KINDS) == {"records", "dev_records", CORPUS_KIND, "model", "metrics"}
    assert ARTIFACT_KINDS["records"].schema == RECORD_SCHEMA and ARTIFACT_KINDS[CORPUS_KIND].schema == PASSAGE_SCHEMA
    passages = pa.Table.from_pylist([{"id": "c:0", "dataset": "c", "text": "a passage", "source_ref": "f:0-9"}],
                                    schema=PASSAGE_SCHEMA)
    with StageWriter(tmp_path, "prepare") as w:
        w.write_table("corpus-c.parquet", passages, kind=CORPUS_KIND)
        w.commit({"input_fingerprint": "k"})
    assert read_corpora(tmp_path, "prepare")["c"].column("text").to_pylist() == ["a passage"]
    assert ARTIFACT_KINDS[CORPUS_KIND].read(tmp_path, "prepare").keys() == {"c"}
    assert read_records(tmp_path, "prepare") == {}  # a corpus is no record table


def test_a_corpus_file_with_other_columns_is_refused_by_the_corpus_reader(tmp_path):
    with StageWriter(tmp_path, "prepare") as w:
        w.write_table("corpus-c.parquet", pa.table({"id": ["c:0"], "body": ["x"]}), kind=CORPUS_KIND)
        w.commit({"input_fingerprint": "k"})
    with pytest.raises(EmbedpipeError, match="corpus-c.parquet: not a corpus of passages"):
        read_corpora(tmp_path, "prepare")


def test_a_stage_result_is_one_shape_whether_it_ran_here_or_on_another_pool():
    here = stage_result("prepare", OLD_PREPARE, cached=True, seconds=1.0, run_dir="runs/x", summary="s")
    there = stage_result("prepare", OLD_PREPARE, cached=True, seconds=1.0, run_dir="runs/x", summary="s",
                         work_pool="gpu", flow_run="id")
    assert set(here) == {"stage", "cached", "seconds", "run_dir", "manifest", "summary"}
    assert {k: v for k, v in there.items() if k not in ("work_pool", "flow_run")} == here


def test_the_step_of_a_manifest_is_its_step_key_and_for_an_older_one_told_by_its_sections():
    assert step_class({**OLD_PREPARE, "step": "remine"}) is RemineManifest
    assert step_class(OLD_PREPARE) is PrepareManifest  # no step key: the stage prepare is the step
    older = {k: v for k, v in OLD_PREPARE.items() if k != "counts"}
    assert step_class({**older, "stage": "train-s", "stage_name": "s"}) is TrainManifest
    assert step_class({**older, "stage": "reference-s", "stage_name": "s", "decoder": "d"}) is ReferenceManifest
    assert step_class({**older, "stage": "synth-s", "targeted": {}, "counts": {}}) is SynthManifest
    assert step_class({**older, "stage": "mine-s", "counts": {}}) is RemineManifest
    assert step_class({**older, "stage": "elsewhere"}) is Manifest


def test_a_bare_key_with_its_code_fills_the_envelope_like_a_fingerprint(tmp_path):
    counts = {"examples": 2, "negatives": 3}
    with StageWriter(tmp_path, "reference-s", ReferenceManifest, fingerprint="k", code="c", run_name="demo") as w:
        w.commit({"stage_name": "s", "init_model": "m", "decoder": "d", "counts": counts})
    m = ReferenceManifest.read(tmp_path, "reference-s")
    assert (m.step, m.input_fingerprint, m.code, m.run_name, m.counts.negatives) == ("reference", "k", "c", "demo", 3)
