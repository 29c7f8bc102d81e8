"""``embedpipe lineage``: a trained text is found with its steps, dataset, field and source row,
through the chain of models (stage2 from stage1); a text never drawn or in no record is a clear
"not trained on" with exit 1 (as grep); a directory that is no trained model, or a damaged or
tampered stage file, is one error line naming the file."""

import json
import shutil

import pyarrow.parquet as pq
import pytest

from embed_core.config import parse_config
from embed_core.fingerprint import sha256_file
from embed_core.runs.lineage import chain, find_matches
from embed_core.prepare.cleaning import normalize_text
from tests.helpers.cli_run import in_process
from tests.helpers.repo import tiny_demo_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model):
    from embed_core.prepare.run import run_prepare
    from embed_core.stages import records_upstream
    from embed_core.train.run import run_train_stage

    tmp = tmp_path_factory.mktemp("lineage-cli")
    cfg = tiny_demo_config(tmp, tiny_model, "demo", [
        {"name": "stage1", "tasks": ["retrieval"], "steps": 3}, {"name": "stage2", "steps": 4, "eta": 0.5}])
    config = parse_config(cfg)
    run_dir = tmp / "runs/demo"
    run_prepare(config, run_dir)
    for stage in ("stage1", "stage2"):
        run_train_stage(config, run_dir, stage, upstream=records_upstream(config, "train"))
    return run_dir


def _record(run_dir, dataset, position):
    return pq.read_table(run_dir / "prepare" / f"{dataset}.parquet").slice(position, 1).to_pylist()[0]


def _texts_of(record):
    return [record["query"], *record["positives"], *record["negatives"], *(record["weak_positives"] or [])]


def test_a_trained_text_is_found_with_its_steps_dataset_field_and_source_row(trained, capfd):
    row = pq.read_table(trained / "train-stage2/lineage.parquet").to_pylist()[0]
    record = _record(trained, row["dataset"], row["positions"][0])
    shouted = record["query"].upper() + " !!"  # the same text after normalisation
    result = in_process(capfd, "lineage", trained / "train-stage2/model", "--text", shouted)
    assert result.rc == 0, result.err
    assert "': trained on (" in result.out.splitlines()[0]
    assert f"{row['dataset']} record {record['id']} as query" in result.out
    assert f"source {record['source_ref']}" in result.out
    assert f"train-stage2: trained on at step {row['step']}" in result.out or \
        f"train-stage2: trained on at steps {row['step']}" in result.out
    assert "train-stage1" in result.out  # the model stage2 started from is answered for too


def test_the_recorded_steps_are_the_steps_whose_lineage_rows_hold_the_record(trained):
    table = pq.read_table(trained / "train-stage2/lineage.parquet").to_pylist()
    dataset, position = table[-1]["dataset"], table[-1]["positions"][-1]
    record = _record(trained, dataset, position)
    matches = find_matches(chain(trained / "train-stage2"), None, record["id"])
    assert [(m.dataset, m.position) for m in matches] == [(dataset, position)]
    expected = sorted(r["step"] for r in table if r["dataset"] == dataset and position in r["positions"])
    assert matches[0].steps["train-stage2"] == expected
    assert len(table) == 4  # one micro-batch, so one dataset, a step


def test_a_text_in_the_records_but_never_drawn_is_not_trained_on_with_exit_1(trained, capfd):
    stages = chain(trained / "train-stage2")
    drawn = set()
    for stage in stages:
        for dataset, (_, _, flat) in stage.steps.items():
            drawn |= {(dataset, int(p)) for p in flat}
    drawn_texts = {normalize_text(t) for d, p in drawn for t in _texts_of(_record(trained, d, p))}
    table = pq.read_table(trained / "prepare/scifact.parquet").to_pylist()
    never = next(r for i, r in enumerate(table) if ("scifact", i) not in drawn
                 and normalize_text(r["query"]) not in drawn_texts)
    result = in_process(capfd, "lineage", trained / "train-stage2/model", "--text", never["query"])
    assert result.rc == 1, result.err
    assert "not trained on (in the records, never drawn)" in result.out.splitlines()[0]
    assert f"record {never['id']} as query" in result.out and never["source_ref"] in result.out
    assert "train-stage2: not drawn in its 4 steps" in result.out


def test_a_text_in_no_record_is_not_trained_on_with_exit_1(trained, capfd):
    result = in_process(capfd, "lineage", trained / "train-stage1/model", "--text", "zebra quartz xylophone 4711")
    assert result.rc == 1 and result.err == ""
    assert result.out.startswith("text 'zebra quartz xylophone 4711': not trained on: in no record of train-stage1")


def test_a_directory_that_is_not_a_trained_model_is_one_error_line_naming_it(trained, capfd, tmp_path):
    result = in_process(capfd, "lineage", trained / "prepare", "--text", "anything")
    result.assert_one_line_error(str(trained / "prepare"), "not a trained model")
    (tmp_path / "old/model").mkdir(parents=True)
    (tmp_path / "old/manifest.json").write_text(json.dumps({"outputs": {}}))
    result = in_process(capfd, "lineage", tmp_path / "old/model", "--id", "x/1")
    result.assert_one_line_error(str(tmp_path / "old"), "no lineage.parquet")


def _copy(trained, tmp_path):
    """A copy of the run to damage (the module's run stays as trained)."""
    shutil.copytree(trained, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _rewrite_lineage(run_dir, table, *, rehash: bool) -> None:
    """Replace train-stage2's lineage file; ``rehash``: and its hash in the manifest, so the stage
    looks intact and only the file's own content can give it away."""
    path = run_dir / "train-stage2/lineage.parquet"
    if isinstance(table, bytes):
        path.write_bytes(table)
    else:
        pq.write_table(table, path)
    if rehash:
        manifest = json.loads((run_dir / "train-stage2/manifest.json").read_text())
        manifest["outputs"]["lineage.parquet"]["sha256"] = sha256_file(path, remember=False)
        (run_dir / "train-stage2/manifest.json").write_text(json.dumps(manifest))


def _with_metadata(table, **changes):
    metadata = json.loads(table.schema.metadata[b"embedpipe.lineage"])
    return table.replace_schema_metadata({b"embedpipe.lineage": json.dumps({**metadata, **changes}).encode()})


@pytest.mark.parametrize("rehash", [False, True])
def test_lineage_metadata_naming_records_outside_the_run_directory_is_refused(trained, capfd, tmp_path, rehash):
    run_dir = _copy(trained, tmp_path)
    table = pq.read_table(run_dir / "train-stage2/lineage.parquet")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    metadata = json.loads(table.schema.metadata[b"embedpipe.lineage"])
    for dataset in metadata["datasets"]:
        shutil.copy(run_dir / "prepare" / f"{dataset}.parquet", outside / f"{dataset}.parquet")
    record = _record(run_dir, "scifact", 0)
    _rewrite_lineage(run_dir, _with_metadata(table, upstream="../../elsewhere"), rehash=rehash)
    result = in_process(capfd, "lineage", run_dir / "train-stage2/model", "--id", record["id"])
    if rehash:  # the stage looks intact: the metadata itself is refused
        result.assert_one_line_error(str(run_dir / "train-stage2/lineage.parquet"), "field upstream", "damaged")
    else:  # what embedpipe status calls damaged
        result.assert_one_line_error(str(run_dir / "train-stage2/lineage.parquet"),
                                     "changed since its manifest was written")


@pytest.mark.parametrize("damage", ["truncated", "missing column", "metadata not JSON", "metadata field",
                                    "not in the manifest"])
def test_a_damaged_lineage_file_is_one_line_naming_it(trained, capfd, tmp_path, damage):
    run_dir = _copy(trained, tmp_path)
    path = run_dir / "train-stage2/lineage.parquet"
    table = pq.read_table(path)
    if damage == "truncated":
        _rewrite_lineage(run_dir, path.read_bytes()[:path.stat().st_size // 2], rehash=True)
        expected = "not readable as a lineage file"
    elif damage == "missing column":
        _rewrite_lineage(run_dir, table.drop_columns(["positions"]), rehash=True)
        expected = "no column 'positions'"
    elif damage == "metadata not JSON":
        _rewrite_lineage(run_dir, table.replace_schema_metadata({b"embedpipe.lineage": b"{x"}), rehash=True)
        expected = "lineage metadata is not JSON"
    elif damage == "metadata field":
        _rewrite_lineage(run_dir, _with_metadata(table, model_step="3"), rehash=True)
        expected = "lineage metadata field model_step"
    else:
        manifest = json.loads((run_dir / "train-stage2/manifest.json").read_text())
        del manifest["outputs"]["lineage.parquet"]
        (run_dir / "train-stage2/manifest.json").write_text(json.dumps(manifest))
        expected = "not an output of"
    in_process(capfd, "lineage", run_dir / "train-stage2/model", "--id", "x/1").assert_one_line_error(str(path), expected)


def test_a_damaged_stage_manifest_is_one_line_naming_it(trained, capfd, tmp_path):
    run_dir = _copy(trained, tmp_path)
    (run_dir / "train-stage2/manifest.json").write_text('{"outputs": ')
    in_process(capfd, "lineage", run_dir / "train-stage2", "--id", "x/1").assert_one_line_error(
        str(run_dir / "train-stage2/manifest.json"), "not a stage manifest")


@pytest.mark.parametrize("settings, expected", [
    ('{"training": ', "not readable as the model's settings JSON"), ("[" * 100_000, "not readable"),
    ('{"training": [1]}', "field training.stage.name"), ('{"training": {"stage": {"name": "../x"}}}', "'../x'")])
def test_a_released_model_with_a_damaged_embedpipe_json_is_one_line_naming_it(trained, capfd, tmp_path, settings,
                                                                              expected):
    run_dir = _copy(trained, tmp_path)
    shutil.copytree(run_dir / "train-stage2/model", run_dir / "evaluate/model")
    (run_dir / "evaluate/manifest.json").write_text("{}")
    record = _record(run_dir, "scifact", 0)
    found = in_process(capfd, "lineage", run_dir / "evaluate/model", "--id", record["id"])
    assert found.rc in (0, 1) and ("models: train-stage2" in found.out or "of train-stage2" in found.out), found.err
    (run_dir / "evaluate/model/embedpipe.json").write_text(settings)
    in_process(capfd, "lineage", run_dir / "evaluate/model", "--id", record["id"]).assert_one_line_error(
        str(run_dir / "evaluate/model/embedpipe.json"), expected)
