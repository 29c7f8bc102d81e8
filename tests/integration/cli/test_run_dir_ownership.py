"""A run directory is embedpipe's own (through the real CLI): a folder of the user's is refused
before anything in it is touched, and in a run directory embedpipe replaces only what it wrote."""

import hashlib
import os
from pathlib import Path

import pytest

from embed_core.rundir import claim_run_dir
from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data


@pytest.fixture
def data(tmp_path):
    return write_sts_data(tmp_path)


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` with its content hash (directories as 'dir')."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), folder)] = "dir"
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def users_folder(root: Path) -> Path:
    """A folder with what a user keeps, named like the leftovers embedpipe cleans up."""
    folder = root / "my_project"
    (folder / "prepare").mkdir(parents=True)
    (folder / "prepare" / "notes.md").write_text("my notes")
    (folder / ".draft.tmp").write_text("unsaved work")
    (folder / ".prepare.old-1234abcd").mkdir()
    (folder / ".prepare.old-1234abcd" / "keep.txt").write_text("keep")
    (folder / "config.yaml").write_text("mine: true\n")
    return folder


def test_a_run_dir_pointed_at_a_users_folder_is_refused_and_nothing_in_it_changes(data, capfd):
    folder = users_folder(data)
    before = snapshot(folder)
    line = in_process(capfd, "prepare", "--config", write_config(data, [STS_SOURCE]), "--run-dir", folder
                      ).assert_one_line_error(str(folder), "not an embedpipe run directory", "--run-dir")
    assert ".draft.tmp" in line
    assert snapshot(folder) == before


def test_the_run_dir_dot_holding_the_config_file_is_refused_and_the_config_is_kept(data, capfd, monkeypatch):
    config = write_config(data, [STS_SOURCE])
    before = config.read_bytes()
    monkeypatch.chdir(data)
    in_process(capfd, "prepare", "--config", config.name, "--run-dir", ".").assert_one_line_error(
        "not an embedpipe run directory")
    assert config.read_bytes() == before
    assert not (data / "prepare").exists() and not (data / ".embedpipe").exists()


def test_watch_without_pipeline_leaves_a_users_temporary_files_alone(data, capfd):
    folder = users_folder(data)
    before = snapshot(folder)
    in_process(capfd, "watch", "--no-pipeline", "--config", write_config(data, [STS_SOURCE]), "--run-dir", folder
               ).assert_one_line_error("not an embedpipe run directory")
    assert snapshot(folder) == before


@pytest.mark.prefect
def test_a_new_run_dir_is_marked_and_used_again(data, capfd, prefect_harness):
    config = write_config(data, [STS_SOURCE])
    run_dir = data / "new"
    for _ in range(2):
        result = in_process(capfd, "prepare", "--config", config, "--run-dir", run_dir)
        assert result.rc == 0, result.err[-2000:]
        assert (run_dir / ".embedpipe").is_file() and (run_dir / "prepare" / "manifest.json").is_file()


def test_a_config_yaml_the_user_put_into_a_run_dir_stops_the_run_before_it_starts(data, capfd):
    run_dir = data / "run"
    run_dir.mkdir()
    claim_run_dir(run_dir)  # a run directory ...
    (run_dir / "config.yaml").write_text("# my own config\nrun_name: other\n")  # ... holding a file of the user's
    in_process(capfd, "prepare", "--config", write_config(data, [STS_SOURCE]), "--run-dir", run_dir
               ).assert_one_line_error(f"{run_dir / 'config.yaml'}: not a config snapshot embedpipe wrote")
    assert (run_dir / "config.yaml").read_text() == "# my own config\nrun_name: other\n"
    assert not (run_dir / "prepare").exists()


def test_a_users_folder_holding_a_history_jsonl_is_refused_and_its_temporary_files_are_kept(data, capfd):
    folder = users_folder(data)
    (folder / "history.jsonl").write_text('{"stage": "prepare"}\n')  # a name any tool may use
    (folder / ".notes.abcd1234.tmp").write_text("unsaved work")  # named as embedpipe names its temporary files
    (folder / ".prepare.staging-1234abcd").mkdir()  # ... and its staging directories
    (folder / ".prepare.staging-1234abcd" / "keep.txt").write_text("keep")
    before = snapshot(folder)
    in_process(capfd, "prepare", "--config", write_config(data, [STS_SOURCE]), "--run-dir", folder
               ).assert_one_line_error(str(folder), "not an embedpipe run directory")
    assert snapshot(folder) == before


def test_a_refused_run_leaves_no_run_directory_behind_and_keeps_one_that_was_there(tmp_path, data, capfd,
                                                                                  prefect_harness):
    """``embedpipe mine`` before prepare: refused with one line; the run directory (and the parents it
    made) it created for the run are gone again, an empty folder the user made is kept."""
    config = write_config(tmp_path, [STS_SOURCE], mine={"tasks": ["sts"]})
    new = tmp_path / "runs" / "new" / "r"
    in_process(capfd, "mine", "--config", config, "--run-dir", new).assert_one_line_error(
        f"mine reads {new}/prepare, which has no manifest.json")
    assert not (tmp_path / "runs").exists()
    kept = tmp_path / "mine_to_keep"
    kept.mkdir()
    in_process(capfd, "mine", "--config", config, "--run-dir", kept).assert_one_line_error("has no manifest.json")
    assert kept.is_dir()
