"""Names that become paths stay inside their root (through the real CLI)."""

import pytest

from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data

STS = STS_SOURCE


@pytest.fixture
def data(tmp_path):
    return write_sts_data(tmp_path)


def test_a_run_name_that_climbs_out_of_run_root_is_refused_and_nothing_is_written(data, capfd):
    path = write_config(data, [STS], run_name="../escaped_run")
    in_process(capfd, "prepare", "--config", path).assert_one_line_error("run_name", "becomes a path")
    assert not (data / "escaped_run").exists() and not (data / "runs").exists()


def test_a_run_name_given_on_the_command_line_is_checked_too(data, capfd):
    path = write_config(data, [STS])
    in_process(capfd, "prepare", "--config", path, "--run-name", "../../x").assert_one_line_error(
        "run_name '../../x' becomes a path")
    assert not (data / "runs").exists()


@pytest.mark.parametrize("name", ["../../etc/task", "a/b", "nul\0"])
def test_evaluation_task_names_that_would_leave_the_stage_directory_are_refused(data, capfd, name):
    path = write_config(data, [STS], evaluate={"base_model": "all-MiniLM-L6-v2", "tasks": [
        {"name": name, "type": "sts", "path": "sts.csv"}]})
    in_process(capfd, "evaluate", "--config", path).assert_one_line_error("evaluate.tasks.0.name", "becomes a path")


def test_a_run_dir_whose_parent_is_a_file_is_a_one_line_error(data, capfd):
    path = write_config(data, [STS])
    (data / "afile").write_text("x")
    in_process(capfd, "prepare", "--config", path, "--run-dir", data / "afile/run").assert_one_line_error(
        str(data / "afile/run"), "a parent of it is a file")
