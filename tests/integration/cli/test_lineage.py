"""``embedpipe lineage``: a trained text is found with its steps, dataset, field and source row,
through the chain of models (stage2 from stage1); a text never drawn or in no record is a clear
"not trained on" with exit 1 (as grep); a directory that is no trained model is one error line."""

import json

import pyarrow.parquet as pq
import pytest

from embed_core.config import parse_config
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
