"""Evaluation files too small for their task's metric, through the real CLI (``embedpipe
evaluate``): one line naming the file and the minimum, instead of a traceback (or a NaN score)."""

import pytest

from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data

pytestmark = pytest.mark.prefect

HEADER = "sentence1,sentence2,score\n"


@pytest.mark.parametrize("rows,count", [("", "0 rows"), ("A cat sleeps.,A cat is sleeping.,4.8\n", "1 row")])
def test_an_sts_file_with_fewer_than_two_rows_is_one_line_naming_it(tmp_path, capfd, tiny_model, prefect_harness,
                                                                    rows, count):
    write_sts_data(tmp_path)
    (tmp_path / "eval.csv").write_text(HEADER + rows)
    config = write_config(tmp_path, [STS_SOURCE], evaluate={
        "base_model": str(tiny_model), "tasks": [{"name": "LocalSTS", "type": "sts", "path": "eval.csv"}]})
    in_process(capfd, "evaluate", "--config", config).assert_one_line_error(
        f"eval.csv: {count}; a sts task (evaluate.tasks LocalSTS) needs at least 2")
    assert not (tmp_path / "runs/r/evaluate").exists()


def test_a_classification_train_file_with_one_label_is_one_line(tmp_path, capfd, tiny_model, prefect_harness):
    write_sts_data(tmp_path)
    (tmp_path / "train.csv").write_text("text,label\nfirst text,pos\nsecond text,pos\n")
    (tmp_path / "test.csv").write_text("text,label\nthird text,pos\nfourth text,neg\n")
    config = write_config(tmp_path, [STS_SOURCE], evaluate={"base_model": str(tiny_model), "tasks": [
        {"name": "LocalCls", "type": "classification", "path": "test.csv", "train_path": "train.csv"}]})
    in_process(capfd, "evaluate", "--config", config).assert_one_line_error("train.csv: one label only")
