"""A disk that fills up while a stage writes, through the real CLI: one line naming the stage's
directory and saying the disk is full (pyarrow's own error names no file, safetensors' is no
OSError), exit 2, and the previous artifact is left as it was.

The full disk is real: a small tmpfs mounted for the test (needs root with CAP_SYS_ADMIN;
skipped elsewhere), so the failing writes are the stage's own, through pyarrow, safetensors,
torch and Python."""

import os
import subprocess

import pytest
import yaml

from tests.helpers.cli_run import in_process, write_config
from tests.helpers.repo import tiny_demo_config

pytestmark = pytest.mark.prefect

HEADER = "sentence1,sentence2,score\n"


def _mount(tmp_path, size: str):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    yield from _mount(tmp_path, "512k")


@pytest.fixture
def disk_for_a_tiny_model(tmp_path):
    """Room for the records, their training cache and one tiny model (~4 MB), not for much more."""
    yield from _mount(tmp_path, "24m")


def _fill(mount, leave: int) -> None:
    """Fill the disk up to ``leave`` free bytes (a file of zeros the size of the rest)."""
    stat = os.statvfs(mount)
    with open(mount / "filler", "wb") as fh:
        fh.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))


def _rows(n: int) -> str:
    return "".join(f"{os.urandom(24).hex()},{os.urandom(24).hex()},{i % 5}\n" for i in range(n))


def test_a_full_disk_during_a_stage_is_one_line_and_keeps_the_previous_artifact(tmp_path, capfd, small_disk,
                                                                                 prefect_harness):
    (tmp_path / "s.csv").write_text(HEADER + _rows(20))
    config = write_config(tmp_path, [{"name": "sts", "kind": "sts", "path": "s.csv"}])
    run_dir = small_disk / "run"
    assert in_process(capfd, "prepare", "--config", config, "--run-dir", run_dir).rc == 0
    before = {p.name: p.read_bytes() for p in (run_dir / "prepare").iterdir()}

    (tmp_path / "s.csv").write_text(HEADER + _rows(20000))  # ~2 MB of records: more than the disk holds
    result = in_process(capfd, "prepare", "--config", config, "--run-dir", run_dir)
    line = result.assert_one_line_error("no space left to write the prepare stage (ENOSPC", "nothing was committed",
                                        f"{run_dir / 'prepare'} is as it was")
    assert str(run_dir) in line.split(":")[2]  # the path it names is in the run directory (its staging dir)
    assert {p.name: p.read_bytes() for p in (run_dir / "prepare").iterdir()} == before
    assert not [p for p in run_dir.iterdir() if ".staging-" in p.name]  # the space it took is given back


def test_a_full_disk_at_the_final_model_save_is_one_line_and_keeps_the_previous_model(
        tmp_path, capfd, disk_for_a_tiny_model, tiny_model, prefect_harness):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_demo_config(disk_for_a_tiny_model, tiny_model, "demo", [
        {"name": "stage1", "tasks": ["retrieval"], "steps": 1}])))
    run_dir = disk_for_a_tiny_model / "runs/demo"
    assert in_process(capfd, "prepare", "--config", config).rc == 0
    result = in_process(capfd, "train", "--config", config)
    assert result.rc == 0, result.err[-3000:]
    before = {p: p.read_bytes() for p in (run_dir / "train-stage1").rglob("*") if p.is_file()}

    _fill(disk_for_a_tiny_model, leave=6 << 20)  # the records' training cache (~3.5 MB) fits, the 4 MB model then not
    result = in_process(capfd, "train", "--config", config, "--force")
    line = result.assert_one_line_error("no space left to write the train-stage1 stage (ENOSPC", "nothing was committed",
                                        f"{run_dir / 'train-stage1'} is as it was")
    assert str(run_dir) in line
    assert {p: p.read_bytes() for p in (run_dir / "train-stage1").rglob("*") if p.is_file()} == before
    assert not [p for p in run_dir.iterdir() if ".staging-" in p.name]  # the space it took is given back


def test_a_full_disk_at_a_checkpoint_is_one_line_naming_it_and_leaves_no_partial_checkpoint(
        tmp_path, capfd, disk_for_a_tiny_model, tiny_model, prefect_harness):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_demo_config(disk_for_a_tiny_model, tiny_model, "demo", [
        {"name": "stage1", "tasks": ["retrieval"], "steps": 2, "checkpoint_every": 1}])))
    run_dir = disk_for_a_tiny_model / "runs/demo"
    assert in_process(capfd, "prepare", "--config", config).rc == 0
    _fill(disk_for_a_tiny_model, leave=6 << 20)  # the training cache fits, a checkpoint (weights, Adam: ~12 MB) not
    result = in_process(capfd, "train", "--config", config)
    result.assert_one_line_error(f"{run_dir / 'checkpoints/stage1/.tmp-step-0000001'}: no space left to write the "
                                 "checkpoint (ENOSPC", "a rerun resumes from it")
    assert not list((run_dir / "checkpoints/stage1").glob("*step-*"))  # the space it took is given back
    assert not (run_dir / "train-stage1").exists()
